//! What the engine reports: the one writer of `/statusz` and of the live-observed metrics.
//!
//! The engine never touches the status lock or the histograms itself; it tells the reporter
//! what happened (a change to status, a phase, a landed Txn). Every change recomputes the lag
//! figures and the freshness rule ([`crate::freshness::refresh`]), so `/statusz` and
//! `/metrics` (encoded from the same status) never disagree.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mirror_core::{ConditionType, Phase, Reason, Status, StatusHandle};
use tracing::info;

use crate::freshness::{refresh, Freshness};
use crate::metrics::Metrics;

/// The status and metrics handles of one engine (a clone reports into the same).
#[derive(Clone)]
pub struct Reporter {
    status: StatusHandle,
    metrics: Option<Arc<Metrics>>,
    freshness: Freshness,
}

impl Reporter {
    /// Reports into `status`, with the staleness rule of the config in force.
    pub fn new(status: StatusHandle, freshness: Freshness) -> Reporter {
        Reporter { status, metrics: None, freshness }
    }

    /// Also observes apply latency and batch size into `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Reporter {
        self.metrics = Some(metrics);
        self
    }

    /// The status this reports into, for a component that reports its own part of it.
    pub fn handle(&self) -> StatusHandle {
        self.status.clone()
    }

    /// A reloaded config's staleness rule.
    pub fn set_freshness(&mut self, freshness: Freshness) {
        self.freshness = freshness;
    }

    /// Reads from the status.
    pub fn read<T>(&self, f: impl FnOnce(&Status) -> T) -> T {
        f(&self.status.read().expect("status lock"))
    }

    /// Applies `f` to the status, then refreshes lag and freshness.
    pub fn update(&self, f: impl FnOnce(&mut Status)) {
        let mut s = self.status.write().expect("status lock");
        let progress_before = s.last_progress_time.clone();
        f(&mut s);
        let now = SystemTime::now();
        if s.last_progress_time != progress_before {
            s.progress_at = Some(now);
        }
        refresh(&mut s, now, &self.freshness);
    }

    /// Moves to `phase` (logged once per change); `Available` follows it, and reaching
    /// `syncing` clears `last_error`: an error that no longer holds is not the last error.
    pub fn set_phase(&self, phase: Phase, reason: Reason) {
        let old = self.status.read().expect("status lock").phase;
        if old != phase {
            info!(from = old.as_str(), to = phase.as_str(), "phase");
            self.update(|s| {
                s.phase = phase;
                if phase == Phase::Syncing {
                    s.last_error = None;
                }
                s.set_condition(ConditionType::Available, phase == Phase::Syncing, reason, "");
            });
        }
    }

    /// A tail Txn of `revisions` whole source revisions landed.
    pub fn revisions_landed(&self, revisions: usize) {
        if let Some(m) = &self.metrics {
            m.batch_revisions.observe(revisions as f64);
        }
    }

    /// A fenced Txn of `ops` data ops landed after `took`.
    pub fn txn_landed(&self, ops: usize, took: Duration) {
        if let Some(m) = &self.metrics {
            m.apply_latency.observe(took.as_secs_f64());
            m.batch_size.observe(ops as f64);
        }
    }
}
