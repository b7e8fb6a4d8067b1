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
    /// Agent peak RSS in bytes per case (initial sync, each tail rate, reconcile pass), where
    /// /proc has it.
    pub peak_rss: Vec<(String, u64)>,
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
