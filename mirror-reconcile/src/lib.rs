//! # mirror-reconcile
//!
//! Reserved for the periodic diff-and-repair pass, counts and drain verification of SPEC §5
//! (issue 4). It holds no code yet; the mark-and-sweep prune owed by a forced resync currently
//! runs inside the agent's engine (`mirror-agent/src/engine.rs`, `sweep`).
