//! The fenced applier: how a compact-mode run lands every target write.
//!
//! [`Applier`] owns the run's [`FencedWriter`] and every rule of landing a write under it:
//! retries by error class (transient errors, throttling, a full target: [`on_write_error`]),
//! the throttle curve carried from one Txn to the next, pacing by `sync.max_ops_per_second`, a
//! Txn laid out deeper when the target allows fewer ops per level than configured, and
//! independent ops the target finds too large split in halves down to one op, which is written
//! apart from its checkpoint when it fits only alone. What it needs from the run (each op's
//! target lease, whether the TLS files changed) and what it reports (each landing, each failed
//! try) go through [`Owner`]; it keeps no status of its own.
//!
//! The ambiguous-commit rule and the takeover rules stay the writer's ([`FencedWriter`]); the
//! applier never retries a failed compare (a [`FenceError`] other than an etcd error ends the
//! write at once).

use std::future::Future;
use std::time::Duration;

use etcd_client::{Compare, TxnOp};
use mirror_core::{Action, ErrorClass, EtcdError, Fault, Op, RetryPolicy, SyncSection, ThrottleState};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{Checkpoint, FenceError, FencedWriter};

mod flight;
pub use flight::Answered;

/// What the applier asks of the run that owns it, and what it tells it.
pub trait Owner {
    /// The run's error, which carries every way a write ends without landing.
    type Error: From<EtcdError> + From<FenceError> + From<Stop>;

    /// The etcd ops of `ops`: a leased op with the target lease it rides.
    fn txn_ops(&mut self, ops: &[Op]) -> impl Future<Output = Result<Vec<TxnOp>, Self::Error>> + Send;

    /// A write of `ops` met "requested lease not found": a lease of them ran out on the target.
    fn lease_not_found(&mut self, ops: &[Op]) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Whether the target's TLS files changed since the run connected.
    fn tls_changed(&self) -> bool;

    /// `key` as logs and errors may show it (redacted).
    fn redact(&self, key: &[u8]) -> String;

    /// A Txn of `ops` data ops landed after `took`; the fence now holds `record`. `recovered`:
    /// earlier tries of this write failed.
    fn landed(&mut self, ops: usize, took: Duration, record: &Checkpoint, recovered: bool);

    /// A try failed with `err` (of `class`) and the write is sent again as `retry` says.
    fn retrying(&mut self, err: &EtcdError, class: ErrorClass, retry: &OnWriteError);

    /// A batch [`Applier::send`] sent landed: `revisions` whole source revisions, the last
    /// `last`, `ops` data ops (after [`Owner::landed`] for its Txn).
    fn revisions_landed(&mut self, revisions: usize, last: i64, ops: usize) {
        let _ = (revisions, last, ops);
    }
}

/// Why the applier stopped a write that is not an etcd or fence error.
#[derive(Debug, thiserror::Error)]
pub enum Stop {
    /// SIGTERM/SIGINT arrived while it waited (a retry, the pace).
    #[error("shutting down")]
    Shutdown,
    /// The target rejected TLS, or its files changed: retrying on this client cannot pick up
    /// new ones. Nothing past the watermark landed.
    #[error("the target's TLS files changed or were rejected")]
    TlsChanged,
    /// A single op the target refuses even alone (the request limit).
    #[error("the value of {key} ({bytes} bytes) is larger than the target accepts: {fault}")]
    ValueTooLarge {
        /// The op's key, redacted.
        key: String,
        /// The op's size.
        bytes: usize,
        /// The target's own words.
        fault: String,
    },
}

/// The next step after a fenced write failed with an error of some class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnWriteError {
    /// Reconnect now: retrying on this client cannot pick up new TLS files. Nothing past the
    /// watermark landed, so the batch is not lost.
    Reconnect,
    /// Not an error a retry can mend: the write ends with it.
    GiveUp,
    /// Wait `after`, then write again.
    Retry {
        /// The wait.
        after: Duration,
        /// Sustained backoff: cancel the source watch, so the source's events wait in the
        /// source rather than in this process (re-watched from the watermark).
        drop_watch: bool,
        /// Phase `degraded`.
        degrade: bool,
        /// A condition to raise now.
        raise: Option<WriteTrouble>,
    },
}

/// A condition a failing write raises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteTrouble {
    /// `TargetQuotaExhausted=True` (NoSpace).
    QuotaExhausted,
    /// `TargetThrottled=True` (TooManyRequests).
    Throttled,
    /// `TargetReachable=False`, with the fault as reason.
    Unreachable,
}

/// Rounds of one write's retries after which the target counts as unreachable, and the watch
/// is dropped.
const SUSTAINED_ROUNDS: u32 = 3;

/// The decision after a fenced write failed with an error of `class`; `tls_changed`: the
/// error is a TLS rejection or the side's TLS files changed since connect. Advances `policy`.
pub fn on_write_error(class: ErrorClass, tls_changed: bool, policy: &mut RetryPolicy) -> OnWriteError {
    if class == ErrorClass::Transient && tls_changed {
        return OnWriteError::Reconnect;
    }
    let Action::RetryAfter(after) = policy.on_error(class) else { return OnWriteError::GiveUp };
    let rounds = policy.rounds();
    let raise = match class {
        ErrorClass::Quota if rounds == 1 => Some(WriteTrouble::QuotaExhausted),
        ErrorClass::Throttle => Some(WriteTrouble::Throttled),
        ErrorClass::Transient if rounds == SUSTAINED_ROUNDS => Some(WriteTrouble::Unreachable),
        _ => None,
    };
    OnWriteError::Retry {
        after,
        drop_watch: rounds == SUSTAINED_ROUNDS,
        degrade: matches!(raise, Some(WriteTrouble::QuotaExhausted | WriteTrouble::Unreachable)),
        raise,
    }
}

/// The one writer of a compact-mode run: the fence it holds and how its writes land.
pub struct Applier {
    writer: FencedWriter,
    sync: SyncSection,
    throttle: ThrottleState,
    shutdown: CancellationToken,
    /// `sync.txns_in_flight` as the run started: how many [`Applier::send`] keeps on their way.
    txns_in_flight: usize,
    /// The Txns [`Applier::send`] sent that have not answered yet (`applier/flight.rs`).
    flight: flight::Flight,
}

impl Applier {
    /// Lands writes under `writer` as `sync` says (backoff, pace), continuing the throttle
    /// curve of earlier writes (`throttle`); `shutdown` ends any wait.
    pub fn new(
        writer: FencedWriter,
        sync: SyncSection,
        throttle: ThrottleState,
        shutdown: CancellationToken,
    ) -> Applier {
        let txns_in_flight = sync.txns_in_flight.max(1) as usize;
        Applier { writer, sync, throttle, shutdown, txns_in_flight, flight: flight::Flight::default() }
    }

    /// The writer: the record the fence holds, its key, its watermarks.
    pub fn writer(&self) -> &FencedWriter {
        &self.writer
    }

    /// The writer, for the writes that are not data (a fence check, the data writer of the
    /// scan).
    pub fn writer_mut(&mut self) -> &mut FencedWriter {
        &mut self.writer
    }

    /// The record the fence holds: with Txns in flight ([`Applier::send`]), the last that
    /// landed, so a commit built from it waits for them first ([`Applier::drain`]).
    pub fn record(&self) -> &Checkpoint {
        self.writer.record()
    }

    /// Where the throttle curve stands, for the next run's applier.
    pub fn throttle(&self) -> ThrottleState {
        self.throttle
    }

    /// Takes the reloaded `sync` settings: the pace and the backoff of the next write.
    pub fn reload(&mut self, sync: &SyncSection) {
        self.sync = sync.clone();
    }

    /// The per-level op limit Txns are laid out for: `sync.max_txn_ops`, halved where the
    /// target refused it.
    pub fn max_txn_ops(&self) -> usize {
        self.writer.max_txn_ops()
    }

    /// Whether one Txn at the current per-level limit holds `ops` ops beside the checkpoint
    /// put. Ops merged or cut for a higher limit (before the target's refusal halved it) may not.
    pub fn holds(&self, ops: usize) -> bool {
        crate::nest::holds(ops, self.writer.max_txn_ops(), 1)
    }

    /// The target refused a Txn for too many ops per level: lay Txns out with half as many.
    pub fn nest_deeper(&mut self) {
        let per_level = self.writer.max_txn_ops();
        tracing::warn!(
            configured = per_level,
            now = per_level / 2,
            "target refused a Txn for too many ops per level; sync.max_txn_ops is above the target's --max-txn-ops"
        );
        self.writer.set_max_txn_ops(per_level / 2);
    }

    /// Whether a refusal as too big can still be mended by nesting deeper.
    pub fn may_nest_deeper(&self, e: &EtcdError) -> bool {
        e.fault == Fault::TooManyOps && self.writer.max_txn_ops() > 2
    }

    /// One fenced Txn of `ops` moving the record to `next`, retried through transient errors,
    /// throttling and a full target. A refusal as too big is an error like any other.
    pub async fn commit<O: Owner>(
        &mut self,
        ops: &[Op],
        next: Checkpoint,
        owner: &mut O,
    ) -> Result<(), O::Error> {
        self.commit_guarded(ops, next, Vec::new(), owner).await
    }

    /// [`Applier::commit`] that also requires `guards` (a failed guard is returned at once as
    /// [`FenceError::GuardFailed`], never retried with the same ops).
    pub async fn commit_guarded<O: Owner>(
        &mut self,
        ops: &[Op],
        next: Checkpoint,
        guards: Vec<Compare>,
        owner: &mut O,
    ) -> Result<(), O::Error> {
        match self.try_commit(ops, next, guards, owner).await? {
            Ok(()) => Ok(()),
            Err(too_big) => Err(too_big.into()),
        }
    }

    /// [`Applier::commit_guarded`], with a refusal as too big (`Fault::is_txn_too_big`)
    /// returned apart, as `Ok(Err(_))`: nothing landed, and the caller may lay the ops out
    /// otherwise.
    pub async fn try_commit<O: Owner>(
        &mut self,
        ops: &[Op],
        next: Checkpoint,
        guards: Vec<Compare>,
        owner: &mut O,
    ) -> Result<Result<(), EtcdError>, O::Error> {
        self.drain(owner).await?;
        self.try_commit_now(ops, next, guards, owner).await
    }

    /// [`Applier::try_commit`] with no Txn in flight.
    async fn try_commit_now<O: Owner>(
        &mut self,
        ops: &[Op],
        next: Checkpoint,
        guards: Vec<Compare>,
        owner: &mut O,
    ) -> Result<Result<(), EtcdError>, O::Error> {
        let mut policy = RetryPolicy::new(&self.sync).with_throttle_state(self.throttle);
        loop {
            let txn_ops = owner.txn_ops(ops).await?;
            let started = Instant::now();
            let err = match self.writer.commit_guarded(txn_ops, Some(next.clone()), guards.clone()).await {
                Ok(_) => {
                    owner.landed(ops.len(), started.elapsed(), &next, policy.rounds() > 0);
                    self.pace(ops.len()).await?;
                    return Ok(Ok(()));
                }
                Err(FenceError::Etcd(e)) => e,
                Err(f) => return Err(f.into()),
            };
            if err.fault == Fault::LeaseNotFound {
                owner.lease_not_found(ops).await?;
            }
            let class = err.class();
            let tls_changed = err.fault == Fault::TlsRejected || owner.tls_changed();
            let decided = on_write_error(class, tls_changed, &mut policy);
            self.throttle = policy.throttle_state();
            let delay = match decided {
                OnWriteError::Reconnect => return Err(Stop::TlsChanged.into()),
                OnWriteError::GiveUp if err.fault.is_txn_too_big() => return Ok(Err(err)),
                OnWriteError::GiveUp => return Err(err.into()),
                OnWriteError::Retry { after, .. } => after,
            };
            tracing::debug!(
                watermark = next.watermark,
                ops = ops.len(),
                rounds = policy.rounds(),
                "fenced Txn failed, retrying in {delay:?}: {err}"
            );
            owner.retrying(&err, class, &decided);
            tokio::select! {
                _ = self.shutdown.cancelled() => return Err(Stop::Shutdown.into()),
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// Commits independent ops under the checkpoint as it stands (a scan chunk redone, a
    /// repair, the first half of a split): [`Applier::commit_independent`] without a
    /// transition.
    pub async fn commit_keep<O: Owner>(&mut self, ops: &[Op], owner: &mut O) -> Result<(), O::Error> {
        // The record as it stands once the Txns in flight landed.
        self.drain(owner).await?;
        let same = self.writer.record().clone();
        self.commit_independent(ops, same, owner).await
    }

    /// Commits independent ops (scan puts, repairs, prune deletes: any subset may land before
    /// the rest) with the checkpoint `next`, whatever the target's limits: the one write path of
    /// every pass that is not the tail (issue #20 defect 5: the scan, sweep, settle and
    /// reconcile paths never split a Txn, and a value near the request limit failed the scan
    /// with a permanent error naming nothing). Too many ops per level: nest deeper. Too large:
    /// halves, the first under the record as it stands, the second with `next`, down to a single
    /// op; a single op that fits only without the checkpoint put is written alone
    /// ([`Applier::commit_data_then_checkpoint`]); one that does not fit at all is
    /// [`Stop::ValueTooLarge`], naming the key (redacted) and its size. Ops that no layout of
    /// the per-level limit holds (a chunk cut for a higher limit than the target allows, after
    /// nesting deeper) are halved before they are sent.
    pub async fn commit_independent<O: Owner>(
        &mut self,
        ops: &[Op],
        next: Checkpoint,
        owner: &mut O,
    ) -> Result<(), O::Error> {
        if ops.len() > 1 && !self.holds(ops.len()) {
            let (first, second) = ops.split_at(ops.len() / 2);
            Box::pin(self.commit_keep(first, owner)).await?;
            return Box::pin(self.commit_independent(second, next, owner)).await;
        }
        let Err(e) = self.try_commit(ops, next.clone(), Vec::new(), owner).await? else { return Ok(()) };
        if self.may_nest_deeper(&e) {
            self.nest_deeper();
            return Box::pin(self.commit_independent(ops, next, owner)).await;
        }
        if ops.len() > 1 {
            let (first, second) = ops.split_at(ops.len() / 2);
            Box::pin(self.commit_keep(first, owner)).await?;
            return Box::pin(self.commit_independent(second, next, owner)).await;
        }
        if e.fault == Fault::RequestTooLarge
            && self.commit_data_then_checkpoint(ops, next, Vec::new(), owner).await?
        {
            return Ok(());
        }
        let op = ops.first();
        Err(Stop::ValueTooLarge {
            key: op.map(|op| owner.redact(op.key())).unwrap_or_default(),
            bytes: op.map_or(0, Op::size),
            fault: e.said(),
        }
        .into())
    }

    /// The last resort for ops that fit the target's request limit only without the checkpoint
    /// put beside them (a value the source accepted under the same `--max-request-bytes`): one
    /// fenced data-only Txn with all of them, then a checkpoint-only Txn moving the record to
    /// `next`. Nothing is partial: the ops land together, and a crash between the two re-applies
    /// them (puts and deletes are idempotent) from the old watermark. Until the second Txn the
    /// target is a step ahead of its watermark, never behind it. False when even the ops alone
    /// are too large.
    pub async fn commit_data_then_checkpoint<O: Owner>(
        &mut self,
        ops: &[Op],
        next: Checkpoint,
        guards: Vec<Compare>,
        owner: &mut O,
    ) -> Result<bool, O::Error> {
        self.drain(owner).await?;
        let txn_ops = owner.txn_ops(ops).await?;
        match self.writer.commit_guarded(txn_ops, None, guards).await {
            Ok(_) => {}
            Err(FenceError::Etcd(e)) if e.fault.is_txn_too_big() => return Ok(false),
            // Not settled: a transient error; the caller's retry starts over from the
            // watermark, and the ops are idempotent.
            Err(FenceError::Etcd(e)) => return Err(e.into()),
            Err(f) => return Err(f.into()),
        }
        tracing::warn!(
            ops = ops.len(),
            bytes = ops.iter().map(Op::size).sum::<usize>(),
            "ops fit the target's request limit only without the checkpoint: written alone, the checkpoint follows"
        );
        self.commit(&[], next, owner).await?;
        Ok(true)
    }

    /// Holds target writes to `sync.max_ops_per_second` (a reload applies at the next write;
    /// the scan's data Txns call it too):
    /// after `ops` ops, wait `ops / rate` seconds.
    pub async fn pace(&self, ops: usize) -> Result<(), Stop> {
        let rate = self.sync.max_ops_per_second;
        if rate > 0 && ops > 0 {
            // A slow rate makes long pauses; SIGTERM must not wait them out.
            tokio::select! {
                _ = self.shutdown.cancelled() => return Err(Stop::Shutdown),
                _ = tokio::time::sleep(Duration::from_secs_f64(ops as f64 / rate as f64)) => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "applier_tests.rs"]
mod tests;
