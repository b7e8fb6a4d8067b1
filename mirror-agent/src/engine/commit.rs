//! The run's side of the fenced applier ([`mirror_fence::Applier`], which lands every write and
//! retries it by error class): [`Hooks`] hands it each Txn's lease ops and the TLS files' state,
//! and turns what it reports into status (conditions, `last_error`, the phase, the metrics)
//! and into the run's own moves (dropping the watch under sustained backoff, a reconcile pass
//! owed when a target lease ran out).

use std::time::Duration;

use mirror_core::{ConditionType, ErrorClass, EtcdError, LastError, Phase, Reason};
use mirror_fence::{Checkpoint, OnWriteError, Owner, Stop, WriteTrouble};
use mirror_watch::{Op, Watch};
use tracing::{error, info, warn};

use super::leases::LeaseKeeper;
use super::{tls_fingerprint, Engine, EngineError, Progress, ReconnectCause, Refusal};

/// What the applier reaches of a run: the engine (status, config), its lease keeper, its
/// watch and the TLS files it connected with.
pub(super) struct Hooks<'r> {
    pub engine: &'r mut Engine,
    pub leases: &'r LeaseKeeper,
    pub watch: &'r mut Option<Watch>,
    pub tls_files: &'r Option<Vec<[u8; 32]>>,
}

impl Owner for Hooks<'_> {
    type Error = EngineError;

    async fn txn_ops(&mut self, ops: &[Op]) -> Result<Vec<etcd_client::TxnOp>, EngineError> {
        self.leases.txn_ops(ops).await
    }

    async fn lease_not_found(&mut self, ops: &[Op]) -> Result<(), EngineError> {
        if self.engine.cfg.sync.leases == mirror_core::LeaseMode::Preserve {
            self.engine.repair_owed |= self.leases.lapsed(ops).await?;
        }
        Ok(())
    }

    fn tls_changed(&self) -> bool {
        tls_fingerprint(&self.engine.cfg) != *self.tls_files
    }

    fn redact(&self, key: &[u8]) -> String {
        self.engine.rewriter.redact(key)
    }

    fn landed(&mut self, ops: usize, took: Duration, record: &Checkpoint, recovered: bool) {
        self.engine.reporter.txn_landed(ops, took);
        // Status follows the fence: what the target holds is what status shows.
        self.engine.update(|s| {
            // A write landed: whatever failed before (this write's earlier tries included) is
            // no longer the last error.
            s.last_error = None;
            s.watermark = record.watermark;
            if !record.confirmed_time.is_empty() {
                s.confirmed_time = Some(record.confirmed_time.clone());
            }
        });
        self.engine.made_progress(Progress::Healthy);
        if recovered {
            self.engine.note_write_recovered(record.scanning);
        }
    }

    fn revisions_landed(&mut self, revisions: usize, last: i64, ops: usize) {
        self.engine.reporter.revisions_landed(revisions);
        // Sent only from the synced tail: a live apply.
        self.engine.note_applied(false, last, ops as u64);
    }

    fn retrying(&mut self, err: &EtcdError, class: ErrorClass, retry: &OnWriteError) {
        let OnWriteError::Retry { after, drop_watch, degrade, raise } = *retry else { return };
        if drop_watch && self.watch.take().is_some() {
            warn!("sustained target backoff: source watch cancelled; will re-watch from the watermark");
        }
        self.engine.note_write_failed(err, class, after, degrade, raise);
    }
}

impl From<Stop> for EngineError {
    fn from(stop: Stop) -> EngineError {
        match stop {
            Stop::Shutdown => EngineError::Shutdown,
            Stop::TlsChanged => EngineError::Reconnect(ReconnectCause::TlsRejectedOrFilesChanged),
            Stop::ValueTooLarge { key, bytes, fault } => Refusal::ValueTooLarge { key, bytes, fault }.into(),
        }
    }
}

impl Engine {
    /// Status after a failed write that is retried in `delay`: the error stands as
    /// `last_error`, the phase degrades where `degrade` says, and the trouble it amounts to
    /// raises its condition.
    pub(super) fn note_write_failed(
        &self,
        err: &EtcdError,
        class: ErrorClass,
        delay: Duration,
        degrade: bool,
        raise: Option<WriteTrouble>,
    ) {
        self.update(|s| {
            s.last_error = Some(LastError {
                class,
                reason: err.fault.into(),
                message: format!("{err}; retrying the write in {delay:?}"),
                fix: None,
            })
        });
        if degrade {
            self.set_phase(Phase::Degraded);
        }
        let (condition, status, reason) = match raise {
            None => return,
            Some(WriteTrouble::QuotaExhausted) => {
                error!("target out of space; holding writes and probing");
                (ConditionType::TargetQuotaExhausted, true, Reason::NoSpace)
            }
            Some(WriteTrouble::Throttled) => (ConditionType::TargetThrottled, true, Reason::TooManyRequests),
            Some(WriteTrouble::Unreachable) => {
                warn!("target unavailable for 3 rounds: {err}");
                (ConditionType::TargetReachable, false, err.fault.into())
            }
        };
        self.update(|s| s.set_condition(condition, status, reason, err.to_string()));
    }

    /// Status once a write landed after failed tries: what they raised clears, and the phase
    /// is the one the write belongs to again.
    pub(super) fn note_write_recovered(&self, scanning: bool) {
        info!("target accepts writes again");
        self.update(|s| {
            s.set_condition(ConditionType::TargetThrottled, false, Reason::Recovered, "");
            s.set_condition(ConditionType::TargetQuotaExhausted, false, Reason::Recovered, "");
            s.set_condition(ConditionType::TargetReachable, true, Reason::Recovered, "");
        });
        self.set_phase(if scanning { Phase::InitialSync } else { Phase::Syncing });
    }
}

#[cfg(test)]
mod tests {
    use mirror_core::{
        ConditionType, Config, ErrorClass, EtcdError, Phase, Reason, RetryPolicy, Side, StatusHandle,
    };
    use tokio_util::sync::CancellationToken;

    use mirror_fence::{on_write_error, OnWriteError};

    use super::Engine;

    /// Issue #26 item 10: a target answering "too many requests" raises `TargetThrottled` with
    /// the server's words and leaves the error as `last_error` while the write is retried; a
    /// write that lands after it clears the condition and the phase is `syncing` again. The
    /// engine's own path: the target's gRPC status, classified, decided, noted.
    #[test]
    fn a_throttled_write_raises_target_throttled_until_one_lands() {
        let cfg = Config::from_toml_str(mirror_core::testing::MINIMAL_CONFIG).unwrap();
        let status = StatusHandle::default();
        let engine = Engine::new(cfg.clone(), status.clone(), CancellationToken::new());
        let answer = tonic::Status::resource_exhausted("etcdserver: too many requests");
        let err = EtcdError::new("txn", Side::Target, etcd_client::Error::GRpcStatus(answer));
        let class = err.class();
        assert_eq!(class, ErrorClass::Throttle);
        let mut policy = RetryPolicy::new(&cfg.sync);
        let OnWriteError::Retry { after, degrade, raise, .. } = on_write_error(class, false, &mut policy)
        else {
            panic!("a throttled write is retried");
        };
        engine.note_write_failed(&err, class, after, degrade, raise);
        let throttled = || {
            let s = status.read().unwrap();
            let c = s.conditions.iter().find(|c| c.type_ == ConditionType::TargetThrottled).cloned();
            (c.map(|c| (c.status, c.reason, c.message)), s.last_error.clone())
        };
        let (condition, last_error) = throttled();
        let (raised, reason, message) = condition.expect("TargetThrottled is set");
        assert!(
            raised && reason == Reason::TooManyRequests && message.contains("too many requests"),
            "{message}"
        );
        assert_eq!(last_error.map(|e| e.class), Some(ErrorClass::Throttle));

        engine.note_write_recovered(false);
        let (condition, _) = throttled();
        assert_eq!(condition.map(|(raised, reason, _)| (raised, reason)), Some((false, Reason::Recovered)));
        assert_eq!(status.read().unwrap().phase, Phase::Syncing);
    }
}
