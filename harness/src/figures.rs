//! What one `harness bench` run measured: filled by [`crate::bench`], drawn by
//! [`crate::plot`], so neither imports the other.

use std::time::Duration;

/// What one run measured.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    /// Keys and value size of the run.
    pub keys: usize,
    /// Value size in bytes.
    pub value_size: usize,
    /// Flat 128-op Txn write ceiling, keys/s (the baseline).
    pub ceiling: f64,
    /// (inner Txns per Txn, keys/s) of the nested ceilings.
    pub nested: Vec<(usize, f64)>,
    /// Naive copier, keys/s.
    pub copier: f64,
    /// Agent initial sync, keys/s.
    pub agent_sync: f64,
    /// make-mirror initial sync, keys/s, when etcdctl is present.
    pub make_mirror_sync: Option<f64>,
    /// Tail lags per offered rate.
    pub tails: Vec<TailFigures>,
    /// Reconcile pass, keys/s.
    pub reconcile: f64,
    /// The initial sync under live writes, when measured.
    pub loaded: Option<LoadedFigures>,
    /// Agent peak RSS in bytes per case (initial sync, each tail rate, reconcile pass), where
    /// /proc has it.
    pub peak_rss: Vec<(String, u64)>,
}

/// The loaded case: an initial sync while the source takes writes, the minute after it, and a
/// reconcile pass under the same writes.
#[derive(Clone, Debug, Default)]
pub struct LoadedFigures {
    /// Offered writes/s, open loop, throughout.
    pub rate: u32,
    /// Keys at the start of the sync.
    pub keys: usize,
    /// Agent start to `InitialSyncComplete`, keys/s (the keys at the start over that time).
    pub sync: f64,
    /// Revisions buffered during the scan and replayed at its end, from the agent's log.
    pub backlog: Option<u64>,
    /// Tail lags over the minute after the sync, sorted.
    pub lags: Vec<Duration>,
    /// Puts the source refused, over the whole case.
    pub refused: usize,
    /// Reconcile pass under the same writes, keys/s.
    pub reconcile: f64,
}

/// Lags at one offered rate, sorted ascending.
#[derive(Clone, Debug, Default)]
pub struct TailFigures {
    /// Offered writes/s.
    pub rate: u32,
    /// Agent: put acknowledged in the source → visible in the target.
    pub agent: Vec<Duration>,
    /// make-mirror, measured the same way on its own pair.
    pub make_mirror: Option<Vec<Duration>>,
}

/// The `q` quantile of sorted `lags`.
pub fn quantile(lags: &[Duration], q: f64) -> Duration {
    if lags.is_empty() {
        return Duration::ZERO;
    }
    lags[((lags.len() as f64 * q) as usize).min(lags.len() - 1)]
}
