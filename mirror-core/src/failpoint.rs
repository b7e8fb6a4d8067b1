//! Fault injection for tests: one switch for every hook. A hook asks [`armed`] for its value,
//! `MIRROR_FAILPOINT_<NAME>` from the environment; without the `failpoints` feature (a build
//! of the agent alone, the release image included) nothing is ever armed and the hooks compile
//! to nothing. The hooks themselves live where they act: `mirror-fence`'s writer
//! (`DROP_CHECKPOINT_EVERY`), the agent's coalesced deletes (`FOREIGN_PUT_AFTER_COALESCE_READ`),
//! every lease keep-alive (`UNANSWERED_KEEP_ALIVES`, `keep_alive_once`), `failover`
//! (`FAILOVER_MOVE_FENCE`), `cutover` without `--wait` (`DETACHED_CLAIM_WAIT`) and an exact
//! link's lease swap after its promote (`LEASE_SWAP_FAILS`).

/// The value of failpoint `name` when it is armed (set and not empty).
pub fn armed(name: &str) -> Option<String> {
    #[cfg(feature = "failpoints")]
    {
        std::env::var(format!("MIRROR_FAILPOINT_{name}")).ok().filter(|v| !v.is_empty())
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = name;
        None
    }
}

/// Whether this call is one of those failpoint `name` is armed for: `N`, the first N calls of
/// the process, or `A..B`, the calls numbered A to B - 1 from 0; `calls` counts them (one
/// static per hook).
pub fn armed_for_call(name: &str, calls: &std::sync::atomic::AtomicU64) -> bool {
    let Some(armed) = armed(name) else { return false };
    let (from, to) = match armed.split_once("..") {
        Some((a, b)) => (a.parse().unwrap_or(0), b.parse().unwrap_or(0)),
        None => (0, armed.parse().unwrap_or(0)),
    };
    let call: u64 = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    (from..to).contains(&call)
}
