//! The exact tail: one fenced Txn per source revision, in order, each judged by the fence
//! ([`mirror_fence::Landing`]); between revisions the target leases are kept alive and the
//! target's compaction follows the source's.

use std::time::Duration;

use etcd_client::Client;
use mirror_core::{
    now_rfc3339, unary, Action, ConditionType, Config, ErrorClass, EtcdError, ExactRevision, LastError,
    Phase, Reason, RetryPolicy, Side, Spacer,
};
use mirror_watch::{ExactDelivery, ExactError, ExactWatch};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::compaction::{learn_compaction, Following, COMPACTION_CHECK};
use super::flight::{landed_prefix, Flight, Verdict};
use super::leases::TargetLeases;
use super::replica::{Replicas, Turn};
use super::seed::{Placed, SpoolReplay};

mod audit;
mod confirmed;
mod fence;
mod spool;
mod verdict;
use super::{timeout, Stop};
use crate::engine::confirm::Confirmer;
use crate::engine::ReconnectCause;
use crate::reporter::Reporter;

/// How often the tail looks at the leases due a keep-alive.
const KEEP_CHECK: Duration = Duration::from_secs(1);
/// How often an idle tail re-reads the checkpoint (a foreign write shows without a Txn).
const FENCE_CHECK: Duration = Duration::from_secs(2);

/// The tail's state: the clients, the fence, and how far the target holds the source.
pub(super) struct Tail<'c> {
    cfg: &'c Config,
    source: Client,
    target: Client,
    placed: Placed,
    /// The target's compaction, following the source's.
    compaction: Following,
    /// This agent's ID, written into every record it lands.
    me: String,
    /// The highest source revision the watch has shown (its responses' header revision).
    seen: i64,
    /// The watch's header revisions and when they came: when the source was at or below a
    /// revision (`confirmed_time`).
    heard: confirmed::Heard,
    /// The idle source's confirm read.
    confirmer: Confirmer,
    /// The latest `confirmed_time` of a revision landed: the source was at or below the
    /// watermark then.
    confirmed: String,
    /// The last source revision received (from the watch or the spool), landed or not.
    received: i64,
    /// The wait before Txns whose answer was lost are sent again: `sync.backoff`, steeper
    /// after "too many requests" (as compact mode's writes wait).
    retry: RetryPolicy,
    /// `last_error` (and maybe `TargetThrottled`) says a lost answer: the next revision this
    /// agent lands clears them.
    answer_lost: bool,
    /// The range fingerprint every record carries (computed once).
    range: String,
    /// Keeps a Txn sent behind another from reaching etcd together with it, and spreads the
    /// Txns in flight over the time one takes.
    spacer: Spacer,
    /// When the next Txn, built and waiting behind one in flight, may go: it is sent then, or
    /// at once should the one ahead be answered first (nothing left to overtake).
    spaced: Option<tokio::time::Instant>,
    /// The seed's spool while it is replayed (the source compacted what the watch would have
    /// brought); the watch is opened again after it.
    replay: Option<SpoolReplay>,
    /// Bytes of revisions received and not landed past which no more is received (G6).
    hold: usize,
    /// The TLS files' digests as this run connected with them: a change reconnects.
    tls_files: Option<Vec<[u8; 32]>>,
    /// Whether this process ever opened a source watch (later ones count as `watch_restarts`).
    watch_opened: &'c mut bool,
}

impl<'c> Tail<'c> {
    pub(super) fn new(
        cfg: &'c Config,
        source: Client,
        target: Client,
        placed: Placed,
        me: String,
        tls_files: Option<Vec<[u8; 32]>>,
        watch_opened: &'c mut bool,
    ) -> Tail<'c> {
        let (seen, received) = (placed.watermark, placed.watermark);
        let confirmed = placed.confirmed.clone();
        let sync = &cfg.sync;
        let range = cfg.rewriter().range_fingerprint();
        let spacer = Spacer::paced(sync.exact_txn_spacing.get(), sync.exact_txns_in_flight as usize);
        Tail {
            cfg,
            source,
            target,
            placed,
            compaction: Following::new(cfg),
            me,
            seen,
            heard: Default::default(),
            confirmer: Confirmer::default(),
            confirmed,
            received,
            retry: RetryPolicy::new(sync),
            answer_lost: false,
            range,
            spacer,
            spaced: None,
            replay: None,
            hold: usize::try_from(sync.watch_buffer_bytes.bytes()).unwrap_or(usize::MAX),
            tls_files,
            watch_opened,
        }
    }

    /// Tails until something stops it.
    pub(super) async fn run(
        mut self,
        leases: TargetLeases,
        reporter: &Reporter,
        shutdown: &CancellationToken,
    ) -> Stop {
        match self.tail(leases, reporter, shutdown).await {
            Ok(never) => match never {},
            Err(stop) => stop,
        }
    }

    async fn tail(
        &mut self,
        mut leases: TargetLeases,
        reporter: &Reporter,
        shutdown: &CancellationToken,
    ) -> Result<std::convert::Infallible, Stop> {
        // None while the seed's spool is replayed.
        let mut watch = Some(self.open_watch(self.placed.watermark + 1, reporter).await?);
        let mut replicas =
            Replicas::open(self.cfg, &self.target, self.me.clone(), self.placed.watermark).await?;
        reporter.update(|s| s.watermark = self.placed.watermark);
        exact_status(reporter, |e| e.target_revision = self.placed.watermark);
        self.report_leases_and_spool(&leases, reporter);
        reporter.set_phase(Phase::Syncing, Reason::Syncing);
        let mut flight = Flight::new(self.cfg.sync.exact_txns_in_flight as usize);
        let mut keep = tokio::time::interval(KEEP_CHECK);
        // The keep-alives of a round, awaited beside the watch and the Txns in flight.
        let mut keeping = None;
        // The source's compaction is learned on a task of its own: each probe waits up to a
        // second for etcd's answer, which the tail must not (it stalled every revision behind).
        let (learned, mut source_compacted) = tokio::sync::watch::channel(0i64);
        let _probe = learn_compaction(self.source.clone(), self.cfg.clone(), learned);
        let _members = crate::members::watch_members(self.cfg.clone(), reporter.clone());
        let mut compaction = tokio::time::interval(COMPACTION_CHECK);
        let mut fence = tokio::time::interval(FENCE_CHECK);
        let mut confirm = tokio::time::interval(self.cfg.sync.progress_interval.get());
        let mut tls_check = tokio::time::interval(crate::engine::TLS_CHECK_INTERVAL);
        let mut audit = reporter.read(|s| audit::Audit::new(self.cfg, s));
        loop {
            if watch.is_none() && self.replay.is_none() {
                watch = Some(self.open_watch(self.received + 1, reporter).await?);
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Err(Stop::Shutdown),
                // Read only while what waits to land is under the bound: past it the source's
                // history holds the rest (a watch not read is etcd's slow watcher).
                delivered = next_delivery(&mut watch), if !flight.holds(self.hold) => match delivered {
                    Ok(ExactDelivery::Revisions { revisions, header }) => {
                        self.heard(header);
                        for rev in revisions {
                            self.received = rev.revision;
                            flight.receive(rev);
                        }
                        self.send_more(&mut flight, &mut leases, &mut replicas, reporter).await?;
                    }
                    Ok(ExactDelivery::Reply(header)) => {
                        self.heard(header);
                        let confirmed = self.confirm();
                        reporter.update(|s| {
                            s.source_revision = s.source_revision.max(header);
                            s.confirmed_time = confirmed.or(s.confirmed_time.take());
                        });
                    }
                    Ok(ExactDelivery::Compacted(at)) => {
                        // The seed's spool may hold what the source compacted away.
                        let from = self.received + 1;
                        if !self.replay_spool(&mut flight)? {
                            return Err(Stop::lost(
                                Reason::ReseedRequired,
                                format!(
                                    "the source compacted to revision {at}, past the replica's next revision {from}, \
                                     and no spool (sync.exact_seed) holds it: the history between is gone; re-seed \
                                     the target"
                                ),
                            ));
                        }
                        watch = None;
                        self.send_more(&mut flight, &mut leases, &mut replicas, reporter).await?;
                    }
                    Err(ExactError::Missing { .. }) => {
                        let err = delivered.err().map(|e| e.to_string()).unwrap_or_default();
                        return Err(Stop::lost(Reason::RevisionMissing, err));
                    }
                    Err(ExactError::Ended(why)) => {
                        return Err(Stop::Etcd(mirror_core::EtcdError::new(
                            "exact watch",
                            Side::Source,
                            etcd_client::Error::WatchError(why),
                        )))
                    }
                },
                _ = keep.tick(), if keeping.is_none() => keeping = Some(Box::pin(leases.start_round())),
                round = async { keeping.as_mut().expect("a round in flight").await }, if keeping.is_some() => {
                    keeping = None;
                    let gone = leases.kept(round)?;
                    if !gone.is_empty() {
                        self.check_fence(&format!("; {} ran out or was revoked", gone.join(", "))).await?;
                    }
                    self.report_leases_and_spool(&leases, reporter);
                }
                _ = compaction.tick() => {
                    // Also when the replica caught up with a compaction learned earlier.
                    let at = *source_compacted.borrow_and_update();
                    let (kv, t) = (self.target.kv_client(), timeout(self.cfg));
                    self.compaction.follow(at, self.placed.watermark, kv, t, reporter).await?;
                }
                _ = fence.tick() => self.check_fence("").await?,
                // Rotated files are used from the next connect on: make it now, as compact mode
                // does (a Txn in flight landed or not; the next run's checkpoint tells which).
                _ = tls_check.tick(), if self.tls_files.is_some() => {
                    if crate::engine::tls_fingerprint(self.cfg) != self.tls_files {
                        return Err(Stop::Reconnect(ReconnectCause::TlsFilesChanged));
                    }
                }
                _ = confirm.tick() => self.start_confirm_read(),
                // Every replica reads (an HA standby too: the roles change with each
                // revision, and each replica's status and alerts vouch for its own view).
                event = audit.next(), if audit.on() => match event {
                    audit::Event::Due => audit.start(self.cfg, &self.source, &self.target, self.placed.watermark),
                    audit::Event::Finished(pass) => reporter.update(|s| audit::report(pass, s)),
                },
                answer = self.confirmer.answer() => self.on_confirm_read(answer, reporter),
                _ = self.spacer.pause(left_until(self.spaced)), if self.spaced.is_some() => {
                    self.send_more(&mut flight, &mut leases, &mut replicas, reporter).await?;
                }
                answer = flight.next_answer(), if !flight.sent.is_empty() => {
                    self.on_answer(answer, &mut flight, &mut leases, &mut replicas, reporter).await?;
                    self.send_more(&mut flight, &mut leases, &mut replicas, reporter).await?;
                }
            }
        }
    }

    /// The source's watch from revision `from`; each after the process's first counts as a
    /// restart (`watch_restarts`).
    async fn open_watch(&mut self, from: i64, reporter: &Reporter) -> Result<ExactWatch, Stop> {
        let watch = ExactWatch::open(&mut self.source, from).await?;
        if std::mem::replace(self.watch_opened, true) {
            reporter.update(|s| s.watch_restarts += 1);
        }
        Ok(watch)
    }

    /// Status of the target leases and the seed's spool.
    fn report_leases_and_spool(&self, leases: &TargetLeases, reporter: &Reporter) {
        let (left, shortest) = leases.snapshot_leases();
        let spool = (!self.cfg.sync.exact_seed.is_empty())
            .then(|| super::digest::spool_path(std::path::Path::new(&self.cfg.sync.exact_seed)))
            .and_then(|p| std::fs::metadata(p).ok())
            .map_or(0, |m| m.len());
        reporter.update(|s| s.leases.preserved = leases.held() as u64);
        exact_status(reporter, |e| {
            e.snapshot_leases = left as u64;
            e.shortest_snapshot_lease_ttl_seconds = shortest;
            e.spool_bytes = spool;
        });
    }

    /// Sends what the window has room for, in order: a revision another replica landed is
    /// completed without a Txn; each other one gets its leases granted and its Txn built (once:
    /// a resend sends the same Txn). A Txn behind one in flight that must wait for the spacing
    /// is built, and left first in line until [`Tail::spaced`]: the loop takes answers
    /// meanwhile, and the one that leaves it no longer behind sends it at once.
    async fn send_more(
        &mut self,
        flight: &mut Flight,
        leases: &mut TargetLeases,
        replicas: &mut Replicas,
        reporter: &Reporter,
    ) -> Result<(), Stop> {
        self.spaced = None;
        self.read_spool(flight)?;
        while flight.room() {
            if replicas.active() {
                // HA: one Txn at a time, each only when it is this replica's turn.
                if !flight.sent.is_empty() {
                    break;
                }
                let revision = flight.waiting.front().expect("room() checked").0.revision;
                if replicas.turn(revision).await? == Turn::Landed {
                    let (rev, _) = flight.waiting.pop_front().expect("room() checked");
                    let needed = flight.landed(&rev);
                    self.done(&rev, false, &needed, leases, replicas, reporter).await?;
                    continue;
                }
            }
            let (rev, built) = flight.waiting.pop_front().expect("room() checked");
            let txn = match built {
                Some(txn) => txn,
                None => {
                    leases.ensure(&rev).await?;
                    self.build(&rev, leases.take_riders())?
                }
            };
            let left = self.spacer.left(!flight.sent.is_empty());
            if !left.is_zero() {
                flight.waiting.push_front((rev, Some(txn)));
                self.spaced = Some(tokio::time::Instant::now() + left);
                break;
            }
            let (mut kv, t) = (self.target.kv_client(), timeout(self.cfg));
            let request = txn.to_txn(self.placed.fence.key());
            let after_landed = self.placed.watermark == rev.revision - 1;
            self.spacer.sent();
            let send = async move { unary("exact txn", Side::Target, t, kv.txn(request)).await };
            flight.send(rev, txn, after_landed, send);
        }
        Ok(())
    }

    /// Judges the first Txn in flight by `answer`. Landed: it is done. Otherwise (sent too
    /// early, or its answer lost) every answer behind it is awaited, the last landing proves
    /// those before it ([`landed_prefix`]), and the rest wait to be sent again in order
    /// (after a backoff when an answer was lost).
    async fn on_answer(
        &mut self,
        answer: Result<etcd_client::TxnResponse, mirror_core::EtcdError>,
        flight: &mut Flight,
        leases: &mut TargetLeases,
        replicas: &mut Replicas,
        reporter: &Reporter,
    ) -> Result<(), Stop> {
        let oldest = flight.sent.front().expect("in flight");
        let (first, after_landed) = (oldest.rev.revision, oldest.after_landed);
        let judged = self.verdict(&oldest.rev, answer)?;
        if judged.verdict == Verdict::Again && judged.lost.is_none() && after_landed {
            // Its predecessor had landed before it was sent, yet it found the checkpoint behind
            // it: the checkpoint went back (deleted, or put again) under another writer.
            return Err(Stop::lost(
                Reason::ForeignWrite,
                format!(
                    "Txn {first} was sent after {} landed and found the checkpoint behind it: another writer deleted \
                     or rewrote the checkpoint",
                    first - 1
                ),
            ));
        }
        if judged.verdict == Verdict::Landed {
            let sent = flight.sent.pop_front().expect("checked");
            let rev = sent.rev;
            if judged.here {
                let took = sent.at.elapsed();
                reporter.txn_landed(rev.changes.len(), took);
                self.spacer.took(took);
            }
            self.retry.on_success();
            let needed = flight.landed(&rev);
            return self.done(&rev, judged.here, &needed, leases, replicas, reporter).await;
        }
        let (mut verdicts, mut lost) = (vec![judged.verdict], judged.lost);
        for (i, answer) in flight.drain().await.into_iter().enumerate() {
            let judged = self.verdict(&flight.sent[i + 1].rev, answer)?;
            verdicts.push(judged.verdict);
            // "Too many requests" rules the wait (the steeper curve) whichever Txn heard it.
            match (&lost, judged.lost) {
                (Some(e), _) if e.class() == ErrorClass::Throttle => {}
                (_, Some(e)) => lost = Some(e),
                _ => {}
            }
        }
        let landed = landed_prefix(&verdicts);
        for _ in 0..landed {
            let rev = flight.sent.pop_front().expect("counted").rev;
            let needed = flight.landed(&rev);
            self.done(&rev, false, &needed, leases, replicas, reporter).await?;
        }
        let again = flight.sent.len() as u64;
        exact_status(reporter, |e| e.resent += again);
        flight.resend_from(0);
        if let Some(e) = lost {
            let delay = self.answer_lost(&e, reporter);
            warn!(
                revision = first,
                "an exact Txn's answer was lost ({e}); sending again from it in {delay:?}"
            );
            tokio::time::sleep(delay).await;
        }
        Ok(())
    }

    /// The wait before the Txns whose answer `e` lost are sent again, and status says why
    /// meanwhile: `last_error`, and `TargetThrottled` when the target answered "too many
    /// requests" (its applied index trails its committed one), as in compact mode.
    fn answer_lost(&mut self, e: &EtcdError, reporter: &Reporter) -> Duration {
        let class = e.class();
        let delay = match self.retry.on_error(class) {
            Action::RetryAfter(delay) => delay,
            // `verdict` loses only transient and throttled answers.
            _ => self.cfg.sync.backoff.max.get(),
        };
        self.answer_lost = true;
        reporter.update(|s| note_answer_lost(s, e, delay));
        delay
    }

    /// Revision `rev` is on the target (`here`: by this agent's Txn): the watermark moves, the
    /// leases its changes left are revoked unless a revision still to land needs them, and
    /// status says so.
    async fn done(
        &mut self,
        rev: &ExactRevision,
        here: bool,
        needed: &std::collections::BTreeSet<i64>,
        leases: &mut TargetLeases,
        replicas: &mut Replicas,
        reporter: &Reporter,
    ) -> Result<(), Stop> {
        self.placed.watermark = rev.revision;
        if here {
            replicas.landed_by_me(rev.revision);
        } else {
            replicas.landed_elsewhere(rev.revision);
        }
        leases.release(rev, needed).await?;
        // One status update per revision (each takes the status lock and refreshes the lag).
        let now = now_rfc3339();
        let role = replicas.role();
        let confirmed = self.confirm();
        let answer_lost = here && std::mem::take(&mut self.answer_lost);
        reporter.update(|s| {
            s.watermark = rev.revision;
            s.role = role;
            s.source_revision = s.source_revision.max(rev.revision);
            s.keys_applied_total += rev.changes.len() as u64;
            s.last_progress_time = Some(now);
            s.confirmed_time = confirmed.or(s.confirmed_time.take());
            let e = s.exact.get_or_insert_with(Default::default);
            e.target_revision = rev.revision;
            if here {
                e.landed_here += 1;
            } else {
                e.landed_elsewhere += 1;
            }
            if here && s.condition(ConditionType::TargetQuotaExhausted) {
                s.set_condition(ConditionType::TargetQuotaExhausted, false, Reason::Recovered, "");
            }
            if answer_lost {
                note_answers_again(s);
            }
        });
        reporter.revisions_landed(1);
        Ok(())
    }
}

/// The watch's next delivery (pending while there is no watch: the spool is replayed).
async fn next_delivery(watch: &mut Option<ExactWatch>) -> Result<ExactDelivery, ExactError> {
    match watch.as_mut() {
        Some(watch) => watch.next().await,
        None => std::future::pending().await,
    }
}

/// The time from now until `at` (zero when past, or none).
fn left_until(at: Option<tokio::time::Instant>) -> Duration {
    at.map_or(Duration::ZERO, |at| at.saturating_duration_since(tokio::time::Instant::now()))
}

/// Status while Txns whose answer `e` lost wait `delay` to go again.
fn note_answer_lost(s: &mut mirror_core::Status, e: &EtcdError, delay: Duration) {
    let class = e.class();
    s.last_error = Some(LastError {
        class,
        reason: e.fault.into(),
        message: format!("{e}; sending the Txns in flight again in {delay:?}"),
        fix: None,
    });
    if class == ErrorClass::Throttle {
        s.set_condition(ConditionType::TargetThrottled, true, Reason::TooManyRequests, e.to_string());
    }
}

/// Status once a Txn landed after lost answers: what they said no longer holds.
fn note_answers_again(s: &mut mirror_core::Status) {
    s.last_error = None;
    if s.condition(ConditionType::TargetThrottled) {
        s.set_condition(ConditionType::TargetThrottled, false, Reason::Recovered, "");
    }
}

/// Updates the `exact` section of the status.
fn exact_status(reporter: &Reporter, f: impl FnOnce(&mut mirror_core::ExactStatus)) {
    reporter.update(|s| f(s.exact.get_or_insert_with(Default::default)));
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use mirror_core::{ConditionType, ErrorClass, EtcdError, Reason, Side, Status};

    use super::{note_answer_lost, note_answers_again};

    fn lost(status: tonic::Status) -> EtcdError {
        EtcdError::new("exact txn", Side::Target, etcd_client::Error::GRpcStatus(status))
    }

    fn throttled(s: &Status) -> Option<(bool, Reason, String)> {
        let c = s.conditions.iter().find(|c| c.type_ == ConditionType::TargetThrottled)?;
        Some((c.status, c.reason, c.message.clone()))
    }

    /// A Txn answered "too many requests" raises `TargetThrottled` with the server's words and
    /// leaves the error as `last_error` while the Txns wait; a transient loss says `last_error`
    /// only; a landing after them clears both, as compact mode's writes do.
    #[test]
    fn a_throttled_answer_raises_target_throttled_until_a_txn_lands() {
        let mut s = Status::default();
        let e = lost(tonic::Status::resource_exhausted("etcdserver: too many requests"));
        assert_eq!(e.class(), ErrorClass::Throttle);
        note_answer_lost(&mut s, &e, Duration::from_secs(2));
        let (raised, reason, message) = throttled(&s).expect("TargetThrottled is set");
        assert!(
            raised && reason == Reason::TooManyRequests && message.contains("too many requests"),
            "{message}"
        );
        let last = s.last_error.clone().expect("last_error");
        assert_eq!(last.class, ErrorClass::Throttle);
        assert!(last.message.contains("again in 2s"), "{}", last.message);

        note_answers_again(&mut s);
        assert_eq!(
            throttled(&s).map(|(raised, reason, _)| (raised, reason)),
            Some((false, Reason::Recovered))
        );
        assert!(s.last_error.is_none());

        let e = lost(tonic::Status::unavailable("etcdserver: request timed out"));
        assert_eq!(e.class(), ErrorClass::Transient);
        note_answer_lost(&mut s, &e, Duration::from_millis(200));
        assert_eq!(s.last_error.as_ref().map(|l| l.class), Some(ErrorClass::Transient));
        assert!(!s.condition(ConditionType::TargetThrottled), "a timeout is not throttling");
    }
}
