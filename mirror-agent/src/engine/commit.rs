//! Committing under the fence with retries: transient errors, throttling and a full target are
//! waited out here (with the conditions they raise), paced by `sync.max_ops_per_second`.

use std::time::Duration;

use mirror_core::{ConditionType, Fault, LastError, Phase, RetryPolicy};
use mirror_fence::{Checkpoint, FenceError};
use mirror_watch::Op;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::decide::{on_write_error, OnWriteError, WriteTrouble};
use super::{tls_fingerprint, EngineError, Progress, ReconnectCause, Run};

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
        self.ensure_leases(ops).await?;
        loop {
            let txn_ops = self.txn_ops(ops);
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
                        info!("target accepts writes again");
                        self.engine.update(|s| {
                            s.set_condition(ConditionType::TargetThrottled, false, "Recovered", "");
                            s.set_condition(ConditionType::TargetQuotaExhausted, false, "Recovered", "");
                            s.set_condition(ConditionType::TargetReachable, true, "Recovered", "");
                        });
                        let phase = if next.scanning { Phase::InitialSync } else { Phase::Syncing };
                        self.engine.set_phase(phase);
                    }
                    return Ok(());
                }
                Err(FenceError::Etcd(e)) => e,
                Err(f) => return Err(f.into()),
            };
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
            self.engine.update(|s| {
                s.last_error = Some(LastError {
                    class,
                    reason: format!("{:?}", err.fault),
                    message: format!("{err}; retrying the write in {delay:?}"),
                    fix: None,
                })
            });
            debug!(
                watermark = next.watermark,
                ops = ops.len(),
                rounds = policy.rounds(),
                "fenced Txn failed, retrying in {delay:?}: {err}"
            );
            if drop_watch && self.watch.take().is_some() {
                warn!("sustained target backoff: source watch cancelled; will re-watch from the watermark");
            }
            if degrade {
                self.engine.set_phase(Phase::Degraded);
            }
            match raise {
                Some(WriteTrouble::QuotaExhausted) => {
                    error!("target out of space; holding writes and probing");
                    self.engine.update(|s| {
                        s.set_condition(ConditionType::TargetQuotaExhausted, true, "NoSpace", err.to_string())
                    });
                }
                Some(WriteTrouble::Throttled) => self.engine.update(|s| {
                    s.set_condition(ConditionType::TargetThrottled, true, "TooManyRequests", err.to_string())
                }),
                Some(WriteTrouble::Unreachable) => {
                    warn!("target unavailable for 3 rounds: {err}");
                    self.engine.update(|s| {
                        s.set_condition(
                            ConditionType::TargetReachable,
                            false,
                            &format!("{:?}", err.fault),
                            err.to_string(),
                        )
                    });
                }
                None => {}
            }
            tokio::select! {
                _ = self.engine.shutdown.cancelled() => return Err(EngineError::Shutdown),
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }
}
