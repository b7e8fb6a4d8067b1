//! Fault injection for tests: one switch for every hook. A hook asks [`armed`] for its value,
//! `MIRROR_FAILPOINT_<NAME>` from the environment; without the `failpoints` feature (a build
//! of the agent alone, the release image included) nothing is ever armed and the hooks compile
//! to nothing. The hooks themselves live where they act: `mirror-fence`'s writer
//! (`DROP_CHECKPOINT_EVERY`), the agent's coalesced deletes (`FOREIGN_PUT_AFTER_COALESCE_READ`),
//! the lease keeper's keep-alives (`UNANSWERED_KEEP_ALIVES`), `failover`
//! (`FAILOVER_MOVE_FENCE`) and `cutover` without `--wait` (`DETACHED_CLAIM_WAIT`).

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

/// Whether this call is one of the first N of the process, for failpoint `name` armed with N;
/// `calls` counts them (one static per hook).
pub fn within_first(name: &str, calls: &std::sync::atomic::AtomicU64) -> bool {
    let Some(n) = armed(name).and_then(|v| v.parse::<u64>().ok()) else { return false };
    calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n
}
