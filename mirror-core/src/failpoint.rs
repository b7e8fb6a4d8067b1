//! Fault injection for tests: one switch for every hook. A hook asks [`armed`] for its value,
//! `MIRROR_FAILPOINT_<NAME>` from the environment; without the `failpoints` feature (a build
//! of the agent alone, the release image included) nothing is ever armed and the hooks compile
//! to nothing. The hooks themselves live where they act: `mirror-fence`'s writer
//! (`DROP_CHECKPOINT_EVERY`), the agent's coalesced deletes (`FOREIGN_PUT_AFTER_COALESCE_READ`),
//! `failover` (`FAILOVER_MOVE_FENCE`) and `cutover` without `--wait` (`DETACHED_CLAIM_WAIT`).

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
