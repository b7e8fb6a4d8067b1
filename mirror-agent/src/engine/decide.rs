//! The engine's decisions, apart from the I/O that carries them out, each a pure function so
//! every case is a row of a table test:
//! - [`on_run_error`]: what the run loop does once a run of the link ended in an error.
//! - [`on_progress_reply`]: what a watch response without events proves (see the engine doc,
//!   "Why genesis and drain completion do not rest on an untrusted progress reply").
//! - [`ReconcileClock`]: when the periodic reconcile pass is due.
//! - [`paced_repair_drops_watch`]: when a paced repair has run long enough to cancel the watch.
//!
//! What a fenced write does after the target refused it is the applier's
//! (`mirror_fence::on_write_error`). How long to wait is the retry policy's ([`mirror_core::RetryPolicy`]), which has its own
//! tests; the tests here run on paused time where the clock matters (the idle proof's spacing).

use std::time::Duration;

use mirror_core::{ConditionType, ErrorClass, Reason};
use mirror_fence::FenceError;
use tokio::time::Instant;

use super::{EngineError, ReconnectCause};

/// The next step after a failed run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Decision {
    /// Connect both sides again at once (no error to record); `fragments`: watch in fragments
    /// from now on (a response was over the decode limit).
    Reconnect { fragments: bool },
    /// Another writer legitimately holds the fence: cold standby (under HA, the term ends),
    /// with the `Fenced` condition's reason.
    StandBy(Reason),
    /// A fresh genesis after the policy's wait: a restart of it (`forced` false: nothing lost)
    /// or a forced resync with prune (history is gone).
    FreshGenesis { reason: Reason, forced: bool },
    /// No further writes: phase `failed`, raising `condition` (type, reason) when the error has
    /// one.
    Fail { condition: Option<(ConditionType, Reason)> },
    /// Back off by the policy and resume from the checkpoint.
    Retry,
}

/// The decision for `err`.
pub(super) fn on_run_error(err: &EngineError) -> Decision {
    match err {
        EngineError::Reconnect(why) => {
            Decision::Reconnect { fragments: *why == ReconnectCause::WatchResponseTooLarge }
        }
        EngineError::Fence(f) if f.standby_reason().is_some() => {
            Decision::StandBy(f.standby_reason().unwrap_or(Reason::FencedByNewerEpoch))
        }
        EngineError::RestartGenesis(r) => Decision::FreshGenesis { reason: r.reason(), forced: false },
        EngineError::Resync(r) => Decision::FreshGenesis { reason: r.reason(), forced: true },
        EngineError::Etcd(e) if e.class() == ErrorClass::Resync => {
            Decision::FreshGenesis { reason: Reason::SourceCompacted, forced: true }
        }
        err if err.class() == ErrorClass::Permanent => {
            let condition = match err {
                EngineError::Refused(refusal) => refusal.condition(),
                EngineError::Fence(FenceError::PrefixConflict { .. }) => {
                    Some((ConditionType::PrefixConflict, Reason::PrefixConflict))
                }
                _ => None,
            };
            Decision::Fail { condition }
        }
        _ => Decision::Retry,
    }
}

/// A watch response without events: a created reply or a progress notification, at the
/// source revision `header`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Reply {
    pub created: bool,
    pub header: i64,
}

/// What a reply without events proves, and so what the tail does with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum OnReply {
    /// Nothing to conclude (yet).
    Wait,
    /// The source holds nothing newer than the watermark: status may say it is current.
    Current,
    /// Everything up to this revision was delivered (a trusted notification): a
    /// checkpoint-only Txn moves the watermark there.
    Advance(i64),
    /// Nothing above the watermark is pending: an initial sync or a drain waiting for it may
    /// end; `current` says whether the watermark is also proven current.
    FinishIfDue { current: bool },
    /// An untrusted notification above the watermark with a proof due: prove the range
    /// unchanged from the watermark to this revision.
    ProveIdle(i64),
}

/// The decision for `reply` at `watermark`; `trusted`: the source's progress notifications
/// are ordered after its events; `next_proof`: no idle proof before this instant.
pub(super) fn on_progress_reply(
    reply: Reply,
    watermark: i64,
    trusted: bool,
    next_proof: Option<Instant>,
) -> OnReply {
    let above = reply.header > watermark;
    if reply.created {
        // The watch starts at watermark + 1: a created reply at or below the watermark says
        // the source has nothing newer (etcd 3.5.30 sends no progress notification for such a
        // watch until the source moves).
        return if above { OnReply::Wait } else { OnReply::Current };
    }
    match (trusted, above) {
        (true, true) => OnReply::Advance(reply.header),
        (true, false) => OnReply::FinishIfDue { current: true },
        (false, false) => OnReply::FinishIfDue { current: false },
        (false, true) if next_proof.is_some_and(|at| Instant::now() < at) => OnReply::Wait,
        (false, true) => OnReply::ProveIdle(reply.header),
    }
}

/// How long after a proof that took `took` the next may run: at most a fifth of the time goes
/// to proofs (each reads the range keys-only), but never farther apart than the progress
/// interval, so a proof slowed by a starved machine does not hold the watermark back for four
/// times as long again.
pub(super) fn idle_proof_spacing(took: Duration, progress_interval: Duration) -> Duration {
    (took * 4).min(progress_interval)
}

/// Seconds of paced repair after which the source watch is cancelled (and re-opened from the
/// watermark once the pass ends), so its events do not pile up in this process.
const PACED_REPAIR_WATCH_SECONDS: f64 = 3.0;

/// Whether a reconcile pass that has repaired `repaired` keys under `max_ops_per_second`
/// (0: unpaced) has been held back by pacing for longer than [`PACED_REPAIR_WATCH_SECONDS`].
pub(super) fn paced_repair_drops_watch(repaired: u64, max_ops_per_second: i64) -> bool {
    max_ops_per_second > 0 && repaired as f64 > PACED_REPAIR_WATCH_SECONDS * max_ops_per_second as f64
}

/// When the periodic reconcile pass is due: `reconcile.interval` after the last pass ended
/// (or the tail started), never before the initial sync completed, never with the interval
/// at zero (passes off). The interval is read at each question, so a reload that changes it
/// moves the due time from the same start, and a reload of anything else moves nothing (it
/// used to restart the wait: a config pushed every 30 minutes kept an hourly pass from ever
/// running).
#[derive(Clone, Copy, Debug)]
pub(super) struct ReconcileClock {
    since: Instant,
}

impl ReconcileClock {
    /// Counting from `now`: the tail starts.
    pub(super) fn start(now: Instant) -> ReconcileClock {
        ReconcileClock { since: now }
    }

    /// When the next pass is due; `None`: not armed.
    pub(super) fn due(&self, interval: Duration, initial_sync_complete: bool) -> Option<Instant> {
        (initial_sync_complete && !interval.is_zero()).then(|| self.since + interval)
    }

    /// A pass ended at `now`: the next is counted from here.
    pub(super) fn passed(&mut self, now: Instant) {
        self.since = now;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use mirror_core::{ConditionType, EtcdError, Reason, Side};
    use mirror_fence::FenceError;
    use tokio::time::Instant;

    use super::super::{EngineError, ReconnectCause, Refusal, Restart, ResyncCause};
    use super::{
        idle_proof_spacing, on_progress_reply, on_run_error, paced_repair_drops_watch, Decision, OnReply,
        ReconcileClock, Reply,
    };

    fn etcd(code: tonic::Code, message: &str) -> EngineError {
        let status = tonic::Status::new(code, message);
        EngineError::Etcd(EtcdError::new("test", Side::Target, etcd_client::Error::GRpcStatus(status)))
    }

    /// Every kind of error the engine ends a run with, and what follows it.
    #[test]
    fn every_error_has_its_decision() {
        use tonic::Code;
        let cases: Vec<(EngineError, Decision)> = vec![
            (
                EngineError::Reconnect(ReconnectCause::WatchResponseTooLarge),
                Decision::Reconnect { fragments: true },
            ),
            (
                EngineError::Reconnect(ReconnectCause::TlsFilesChanged),
                Decision::Reconnect { fragments: false },
            ),
            (
                EngineError::Fence(FenceError::FencedByNewerEpoch { stored: 3, ours: 2 }),
                Decision::StandBy(Reason::FencedByNewerEpoch),
            ),
            (
                EngineError::Fence(FenceError::EpochRegressed { stored: 2, ours: 2, agent: "b".into() }),
                Decision::StandBy(Reason::EpochRegressed),
            ),
            (EngineError::Fence(FenceError::CutOver), Decision::StandBy(Reason::TargetPromoted)),
            (
                EngineError::RestartGenesis(Restart::WatchBufferOverflow),
                Decision::FreshGenesis { reason: Reason::WatchBufferOverflow, forced: false },
            ),
            (
                EngineError::Resync(ResyncCause::WatchCompacted),
                Decision::FreshGenesis { reason: Reason::WatchCompacted, forced: true },
            ),
            (
                etcd(Code::OutOfRange, "etcdserver: mvcc: required revision has been compacted"),
                Decision::FreshGenesis { reason: Reason::SourceCompacted, forced: true },
            ),
            (etcd(Code::Unavailable, "etcdserver: no leader"), Decision::Retry),
            (etcd(Code::ResourceExhausted, "etcdserver: too many requests"), Decision::Retry),
            (etcd(Code::ResourceExhausted, "etcdserver: mvcc: database space exceeded"), Decision::Retry),
            (EngineError::Fence(FenceError::Raced), Decision::Retry),
            (
                etcd(Code::PermissionDenied, "etcdserver: permission denied"),
                Decision::Fail { condition: None },
            ),
            (
                EngineError::Refused(Refusal::SourceWentBack { watermark: 9, source_revision: 5 }),
                Decision::Fail { condition: Some((ConditionType::SourceWentBack, Reason::BelowWatermark)) },
            ),
            (
                EngineError::Fence(FenceError::PrefixConflict { stored: "x".into(), ours: "y".into() }),
                Decision::Fail { condition: Some((ConditionType::PrefixConflict, Reason::PrefixConflict)) },
            ),
            (EngineError::Fence(FenceError::FenceLost), Decision::Fail { condition: None }),
        ];
        for (err, want) in cases {
            assert_eq!(on_run_error(&err), want, "{err}");
        }
    }

    /// Every reply without events, trusted or not, below, at and above the watermark, with the
    /// idle proof due or not yet (paused time).
    #[tokio::test(start_paused = true)]
    async fn every_progress_reply_case() {
        let w = 100;
        let reply = |created, header| Reply { created, header };
        let soon = Some(Instant::now() + Duration::from_secs(2));
        let cases: Vec<(Reply, bool, Option<Instant>, OnReply)> = vec![
            // Created replies: current when at or below the watermark, whatever the trust.
            (reply(true, 90), false, None, OnReply::Current),
            (reply(true, 100), true, None, OnReply::Current),
            (reply(true, 101), true, None, OnReply::Wait),
            (reply(true, 101), false, None, OnReply::Wait),
            // Trusted notifications.
            (reply(false, 150), true, None, OnReply::Advance(150)),
            (reply(false, 150), true, soon, OnReply::Advance(150)),
            (reply(false, 100), true, None, OnReply::FinishIfDue { current: true }),
            (reply(false, 90), true, None, OnReply::FinishIfDue { current: true }),
            // Untrusted: never taken as proof of delivery.
            (reply(false, 100), false, None, OnReply::FinishIfDue { current: false }),
            (reply(false, 90), false, soon, OnReply::FinishIfDue { current: false }),
            (reply(false, 150), false, None, OnReply::ProveIdle(150)),
            (reply(false, 150), false, soon, OnReply::Wait),
        ];
        for (r, trusted, next_proof, want) in cases {
            assert_eq!(
                on_progress_reply(r, w, trusted, next_proof),
                want,
                "{r:?} trusted {trusted} {next_proof:?}"
            );
        }
        // The spacing runs out on the clock.
        tokio::time::advance(Duration::from_millis(1999)).await;
        assert_eq!(on_progress_reply(reply(false, 150), w, false, soon), OnReply::Wait);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(on_progress_reply(reply(false, 150), w, false, soon), OnReply::ProveIdle(150));
    }

    /// A proof is followed by four times its length, capped at the progress interval.
    #[test]
    fn idle_proofs_are_spaced_but_never_past_the_progress_interval() {
        let ms = Duration::from_millis;
        assert_eq!(idle_proof_spacing(ms(10), ms(45_000)), ms(40));
        assert_eq!(idle_proof_spacing(ms(2_000), ms(500)), ms(500));
        assert_eq!(idle_proof_spacing(ms(0), ms(500)), ms(0));
    }

    /// The periodic pass: off at zero, not armed before the initial sync completed, due an
    /// interval after the tail started or the last pass ended; a reloaded interval counts
    /// from the same start.
    #[tokio::test(start_paused = true)]
    async fn reconcile_is_due_an_interval_after_the_last_pass() {
        let hour = Duration::from_secs(3600);
        let start = Instant::now();
        let mut clock = ReconcileClock::start(start);
        assert_eq!(clock.due(Duration::ZERO, true), None, "interval 0s: passes off");
        assert_eq!(clock.due(hour, false), None, "never during the initial sync");
        assert_eq!(clock.due(hour, true), Some(start + hour));
        // Reloads come and go: only a changed interval moves the due time, from the same start.
        tokio::time::advance(Duration::from_secs(1800)).await;
        assert_eq!(clock.due(hour, true), Some(start + hour), "a reload of another field");
        assert_eq!(clock.due(hour / 4, true), Some(start + hour / 4), "shorter: due at once");
        // A pass that ends now re-arms from its end.
        clock.passed(Instant::now());
        assert_eq!(clock.due(hour, true), Some(Instant::now() + hour));
    }

    /// Unpaced repairs never drop the watch; paced ones do past three seconds of pacing.
    #[test]
    fn paced_repairs_drop_the_watch_past_three_seconds() {
        for (repaired, rate, drops) in
            [(1_000_000, 0, false), (30, 10, false), (31, 10, true), (299, 100, false), (301, 100, true)]
        {
            assert_eq!(paced_repair_drops_watch(repaired, rate), drops, "{repaired} keys at {rate}/s");
        }
    }
}
