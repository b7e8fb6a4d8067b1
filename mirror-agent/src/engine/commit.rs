//! Committing under the fence with retries: transient errors, throttling and a full target are
//! waited out here (with the conditions they raise), paced by `sync.max_ops_per_second`.

use std::time::Duration;

use mirror_core::{Action, ConditionType, ErrorClass, Fault, LastError, Phase, RetryPolicy};
use mirror_fence::{Checkpoint, FenceError};
use mirror_watch::Op;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

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
        let mut policy = RetryPolicy::new(&cfg);
        loop {
            let txn_ops = ops.iter().map(Op::to_txn_op).collect();
            let started = Instant::now();
            let result = self.writer().commit_guarded(txn_ops, Some(next.clone()), guards.clone()).await;
            let err = match result {
                Ok(_) => {
                    self.engine.reporter.txn_landed(ops.len(), started.elapsed());
                    // Status follows the fence: what the target holds is what status shows.
                    self.engine.update(|s| s.watermark = next.watermark);
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
            if class == ErrorClass::Transient
                && (err.fault == Fault::TlsRejected || tls_fingerprint(self.cfg()) != self.tls_files)
            {
                // Retrying on this client cannot pick up new TLS files: only a reconnect
                // reads them. The batch is not lost: nothing past the watermark landed.
                return Err(EngineError::Reconnect(ReconnectCause::TlsRejectedOrFilesChanged));
            }
            let Action::RetryAfter(delay) = policy.on_error(class) else { return Err(err.into()) };
            self.engine.update(|s| {
                s.last_error = Some(LastError {
                    class: class.to_string(),
                    reason: format!("{:?}", err.fault),
                    message: format!("{err}; retrying the write in {delay:?}"),
                })
            });
            let rounds = policy.rounds();
            debug!(
                watermark = next.watermark,
                ops = ops.len(),
                rounds,
                "fenced Txn failed, retrying in {delay:?}: {err}"
            );
            if rounds == 3 && self.watch.take().is_some() {
                warn!("sustained target backoff: source watch cancelled; will re-watch from the watermark");
            }
            match class {
                ErrorClass::Quota if rounds == 1 => {
                    error!("target out of space; holding writes and probing");
                    self.engine.set_phase(Phase::Degraded);
                    self.engine.update(|s| {
                        s.set_condition(ConditionType::TargetQuotaExhausted, true, "NoSpace", err.to_string())
                    });
                }
                ErrorClass::Throttle => {
                    self.engine.update(|s| {
                        s.set_condition(
                            ConditionType::TargetThrottled,
                            true,
                            "TooManyRequests",
                            err.to_string(),
                        )
                    });
                }
                ErrorClass::Transient if rounds == 3 => {
                    warn!("target unavailable for 3 rounds: {err}");
                    self.engine.set_phase(Phase::Degraded);
                    self.engine.update(|s| {
                        s.set_condition(
                            ConditionType::TargetReachable,
                            false,
                            &format!("{:?}", err.fault),
                            err.to_string(),
                        )
                    });
                }
                _ => {}
            }
            tokio::select! {
                _ = self.engine.shutdown.cancelled() => return Err(EngineError::Shutdown),
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }
}
