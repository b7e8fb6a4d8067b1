//! Committing under the fence with retries: transient errors, throttling and a full target are
//! waited out here (with the conditions they raise), paced by `sync.max_ops_per_second`.

use std::time::Duration;

use mirror_core::{ConditionType, ErrorClass, EtcdError, Fault, LastError, Phase, Reason, RetryPolicy};
use mirror_fence::{Checkpoint, FenceError};
use mirror_watch::Op;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::decide::{on_write_error, OnWriteError, WriteTrouble};
use super::{tls_fingerprint, Engine, EngineError, Progress, ReconnectCause, Run};

impl Run<'_> {
    /// Holds target writes to `sync.max_ops_per_second` (read on every call, so a reload applies
    /// at once): after `ops` ops, wait `ops / rate` seconds.
    pub(super) async fn pace(&self, ops: usize) -> Result<(), EngineError> {
        let rate = self.cfg().sync.max_ops_per_second;
        if rate > 0 && ops > 0 {
            // A slow rate makes long pauses; SIGTERM must not wait them out.
            tokio::select! {
                _ = self.engine.shutdown.cancelled() => return Err(EngineError::Shutdown),
                _ = tokio::time::sleep(Duration::from_secs_f64(ops as f64 / rate as f64)) => {}
            }
        }
        Ok(())
    }

    /// One fenced Txn, retried through transient errors, throttling and a full target.
    pub(super) async fn commit_with_retry(
        &mut self,
        ops: &[Op],
        next: Checkpoint,
    ) -> Result<(), EngineError> {
        self.commit_guarded_with_retry(ops, next, Vec::new()).await
    }

    /// [`Run::commit_with_retry`] that also requires `guards` (a failed guard is returned at
    /// once as [`FenceError::GuardFailed`], never retried with the same ops).
    pub(super) async fn commit_guarded_with_retry(
        &mut self,
        ops: &[Op],
        next: Checkpoint,
        guards: Vec<etcd_client::Compare>,
    ) -> Result<(), EngineError> {
        let cfg = self.engine.cfg.sync.clone();
        // The throttle curve goes on from the last write: one Txn that got through a throttling
        // target does not send the next in after the shortest wait.
        let mut policy = RetryPolicy::new(&cfg).with_throttle_state(self.engine.throttle);
        loop {
            let txn_ops = self.leases.txn_ops(ops).await?;
            let started = Instant::now();
            let result = self.writer().commit_guarded(txn_ops, Some(next.clone()), guards.clone()).await;
            let err = match result {
                Ok(_) => {
                    self.engine.reporter.txn_landed(ops.len(), started.elapsed());
                    // Status follows the fence: what the target holds is what status shows.
                    self.engine.update(|s| {
                        // A write landed: whatever failed before (this write's earlier tries
                        // included) is no longer the last error.
                        s.last_error = None;
                        s.watermark = next.watermark;
                        if !next.confirmed_time.is_empty() {
                            s.confirmed_time = Some(next.confirmed_time.clone());
                        }
                    });
                    self.engine.made_progress(Progress::Healthy);
                    self.pace(ops.len()).await?;
                    if policy.rounds() > 0 {
                        self.engine.note_write_recovered(next.scanning);
                    }
                    return Ok(());
                }
                Err(FenceError::Etcd(e)) => e,
                Err(f) => return Err(f.into()),
            };
            if err.fault == Fault::LeaseNotFound && self.cfg().sync.leases == mirror_core::LeaseMode::Preserve
            {
                self.engine.repair_owed |= self.leases.lapsed(ops).await?;
            }
            let class = err.class();
            let tls_changed =
                err.fault == Fault::TlsRejected || tls_fingerprint(self.cfg()) != self.tls_files;
            let decided = on_write_error(class, tls_changed, &mut policy);
            self.engine.throttle = policy.throttle_state();
            let (delay, drop_watch, degrade, raise) = match decided {
                OnWriteError::Reconnect => {
                    return Err(EngineError::Reconnect(ReconnectCause::TlsRejectedOrFilesChanged))
                }
                OnWriteError::GiveUp => return Err(err.into()),
                OnWriteError::Retry { after, drop_watch, degrade, raise } => {
                    (after, drop_watch, degrade, raise)
                }
            };
            debug!(
                watermark = next.watermark,
                ops = ops.len(),
                rounds = policy.rounds(),
                "fenced Txn failed, retrying in {delay:?}: {err}"
            );
            if drop_watch && self.watch.take().is_some() {
                warn!("sustained target backoff: source watch cancelled; will re-watch from the watermark");
            }
            self.engine.note_write_failed(&err, class, delay, degrade, raise);
            tokio::select! {
                _ = self.engine.shutdown.cancelled() => return Err(EngineError::Shutdown),
                _ = tokio::time::sleep(delay) => {}
            }
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

    use super::super::decide::{on_write_error, OnWriteError};
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
