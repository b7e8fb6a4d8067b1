//! The tail ([`Tail`]): watch responses, progress, and the timers of a running link.

use std::time::Duration;

use mirror_core::{now_rfc3339, ConditionType, ErrorClass, EtcdError, Fault, Mode, Phase, Reason, Side};
use mirror_watch::{prove_unchanged, Buffered, Delivery, IdleProof, Revision, Watch, WatchEnd};
use tokio::time::Instant;
use tracing::{debug, info};

mod apply;
mod settle;

use super::buffering::watch_error;
use super::confirm::Confirmer;
use super::decide::{idle_proof_spacing, on_progress_reply, OnReply, ReconcileClock, Reply};
use super::leases::LeaseNews;
use super::link::{Link, Step};
use super::waits::{reload_changed, sleep_until_some};
use super::{
    tls_fingerprint, EngineError, Progress, ReconnectCause, ResyncCause, FENCE_CHECK_INTERVAL,
    TLS_CHECK_INTERVAL,
};
use mirror_fence::Applier;

/// The tail phase: follows the source's watch from the watermark, and until `scan_end` is
/// reached, finishes the initial sync.
pub(super) struct Tail {
    /// While the initial sync is not complete: the source revision the watermark must reach
    /// (`scan_end`, see the engine module doc); `None` once it is.
    scan_end: Option<i64>,
    /// Drain mode: the source revision the watermark must reach before verification.
    drain_target: Option<i64>,
    /// Comparisons in a row during a drain that found the target behind.
    drain_settles: u32,
    /// Not before this may the tail run another idle proof ([`mirror_watch::prove_unchanged`]):
    /// proofs read the range keys-only, so they are spaced to at most a fifth of the time, but
    /// never farther apart than `progress_interval`.
    next_idle_proof: Option<Instant>,
    /// What the source last said about its revision, and the confirm read in flight
    /// (`confirmed_time`).
    confirmer: Confirmer,
}

impl Tail {
    /// A tail that first finishes an initial sync at `scan_end`, or (`None`) follows a synced
    /// target.
    pub(super) fn new(scan_end: Option<i64>) -> Tail {
        Tail {
            scan_end,
            drain_target: None,
            drain_settles: 0,
            next_idle_proof: None,
            confirmer: Confirmer::default(),
        }
    }

    /// The tail: first applies `replay` (what genesis buffered past its replay) and keeps
    /// `scanning: true` until the watermark reaches `scan_end`; then follows the source. Ends
    /// with [`Step::Done`] at shutdown or once a drain promoted the target.
    pub(super) async fn run(
        mut self,
        link: &mut Link<'_>,
        watch: Box<Watch>,
        replay: Buffered,
    ) -> Result<Step, EngineError> {
        link.watch = Some(*watch);
        link.engine.made_progress(Progress::Healthy);
        self.apply_revisions(link, replay).await?;
        // A scan that saw nothing after R0 (scan_end = R0 = the watermark) needs no proof that
        // more events are coming: the target equals the source at R0 now. Waiting for a
        // progress reply instead never ended on etcd 3.5.30 (and every release with etcd commit
        // 2d5a9b98), which sends no progress for a watch whose start revision (R0 + 1) the
        // server has not reached yet: an idle source never finished its sync.
        let watermark = link.writer().record().watermark;
        self.finish_genesis_if_due(link, watermark).await?;
        if self.scan_end.is_none() {
            link.engine.set_phase(Phase::Syncing);
        }
        let steady = link.cfg().sync.progress_interval.get();
        let mut reconcile_clock = ReconcileClock::start(Instant::now());
        let mut fence_check = tokio::time::interval(FENCE_CHECK_INTERVAL);
        let mut tls_check = tokio::time::interval(TLS_CHECK_INTERVAL);
        // Members that go down or come back, said in status (`MemberUnreachable`) meanwhile.
        let _members = crate::members::watch_members(link.engine.cfg.clone(), link.engine.reporter.clone());
        // While the initial sync waits for scan_end, ask for progress often.
        let mut progress =
            tokio::time::interval(if self.scan_end.is_some() { Duration::from_millis(500) } else { steady });
        // A drain whose sync is already complete starts now: on an idle source no reply may
        // ever come to start it (etcd 3.5.30 sends no progress for a watch ahead of its revision).
        if self.scan_end.is_none() && self.drain_step(link, &mut progress).await? {
            return Ok(Step::Done);
        }
        loop {
            if link.watch.is_none() {
                // Cancelled under sustained target backoff; the target takes writes again.
                link.drain().await?;
                let from = link.writer().record().watermark + 1;
                info!(from, "re-watching the source from the watermark");
                link.watch = Some(link.open_watch(from).await?);
            }
            if link.engine.repair_owed && self.scan_end.is_none() {
                // A target lease ran out and took its keys: put them back before anything else,
                // so the link does not report caught up while they are missing. The watch is
                // buffered meanwhile.
                link.engine.repair_owed = false;
                self.reconcile_buffered(link).await?;
                reconcile_clock.passed(Instant::now());
                continue;
            }
            let reconcile_at =
                reconcile_clock.due(link.cfg().reconcile.interval.get(), self.scan_end.is_none());
            // The watch's read: data above the watermark, Txns up to the flush size at once.
            let floor = link.writer().record().watermark;
            let budget = link.cfg().sync.txn_flush_bytes.bytes() as usize;
            let watch = link.watch.as_mut().expect("opened above");
            let in_flight = link.applier.as_ref().map_or(0, Applier::in_flight);
            let read = tokio::select! {
                _ = link.engine.shutdown.cancelled() => return Ok(Step::Done),
                _ = reload_changed(&mut link.engine.reload) => {
                    link.engine.apply_reload()?;
                    link.reconfigure();
                    continue;
                }
                _ = tls_check.tick(), if link.tls_files.is_some() && self.scan_end.is_none() => {
                    if tls_fingerprint(link.cfg()) != link.tls_files {
                        return Err(EngineError::Reconnect(ReconnectCause::TlsFilesChanged));
                    }
                    continue;
                }
                answered = link.applier.as_mut().expect("fence claimed").answer(), if in_flight > 0 => {
                    // The oldest of the Txns sent behind one another (`sync.txns_in_flight`).
                    let (applier, mut hooks) = link.applier();
                    applier.settle(answered, &mut hooks).await?;
                    continue;
                }
                _ = fence_check.tick() => {
                    // An idle tail learns of a takeover or a cutover now, not at its next write.
                    link.drain().await?;
                    link.writer().verify_held().await?;
                    continue;
                }
                _ = sleep_until_some(reconcile_at) => {
                    // Inline on the tail's own task: it cannot overlap genesis, a sweep, a
                    // drain or itself, and no tail write races its reads.
                    // The watch is buffered meanwhile, so etcd never finds it stuck.
                    self.reconcile_buffered(link).await?;
                    reconcile_clock.passed(Instant::now());
                    continue;
                }
                news = link.leases.news() => {
                    match news {
                        LeaseNews::RepairOwed => link.engine.repair_owed = true,
                        LeaseNews::Failed(e) => return Err(e),
                    }
                    continue;
                }
                _ = progress.tick() => {
                    watch.request_progress().await;
                    self.start_confirm_read(link, self.scan_end.is_some());
                    continue;
                }
                answer = self.confirmer.answer() => {
                    link.drain().await?;
                    self.on_confirm_read(link, answer).await?;
                    continue;
                }
                read = watch.next(&link.engine.rewriter, floor, budget) => read,
            };
            self.on_deliveries(link, read.items).await?;
            match read.end {
                None => {}
                Some(WatchEnd::Closed) => {
                    return Err(EngineError::Etcd(EtcdError::new(
                        "watch",
                        Side::Source,
                        etcd_client::Error::WatchError("watch stream ended".into()),
                    )))
                }
                Some(WatchEnd::Failed(e)) => return Err(watch_error(e)),
            }
            if self.scan_end.is_none() && self.drain_step(link, &mut progress).await? {
                return Ok(Step::Done);
            }
            if self.scan_end.is_none() && self.drain_target.is_none() && progress.period() != steady {
                progress = tokio::time::interval(steady);
                progress.tick().await;
            }
        }
    }

    /// Drain mode (SPEC §5 Drain and cutover), once the initial sync is complete: records the
    /// drain target revision the first time, and verifies and promotes once the watermark has
    /// reached it. `true` once promoted (the tail ends); always `false` outside drain mode.
    async fn drain_step(
        &mut self,
        link: &mut Link<'_>,
        progress: &mut tokio::time::Interval,
    ) -> Result<bool, EngineError> {
        if link.cfg().mode != Mode::Drain {
            return Ok(false);
        }
        // A reload may have started the drain while Txns sent before it are in flight.
        link.drain().await?;
        let watermark = link.writer().record().watermark;
        let target = match self.drain_target {
            Some(target) => target,
            None => {
                let target = link.source_revision().await?;
                info!(
                    drain_target_revision = target,
                    "draining: waiting for the watermark to reach the drain target"
                );
                self.drain_target = Some(target);
                link.engine.update(|s| {
                    s.cutover = Some(mirror_core::CutoverStatus {
                        drain_target_revision: target,
                        ..Default::default()
                    })
                });
                *progress = tokio::time::interval(Duration::from_millis(500));
                target
            }
        };
        if watermark < target {
            return Ok(false);
        }
        self.verify_and_promote(link, target).await?;
        Ok(true)
    }

    /// Deliveries in arrival order: runs of whole revisions are applied as one batch stream
    /// (merged into as few Txns as the limits allow); a reply or a cancel is handled in its
    /// place, after the revisions before it. Revisions at or below the watermark (moved by a
    /// reply in the same read) are dropped: already applied, or proven.
    pub(super) async fn on_deliveries(
        &mut self,
        link: &mut Link<'_>,
        deliveries: Vec<Delivery>,
    ) -> Result<(), EngineError> {
        let mut revisions: Vec<Revision> = Vec::new();
        for delivery in deliveries {
            match delivery {
                Delivery::Revisions { revisions: mut more, header } => {
                    link.engine.update(|s| s.source_revision = s.source_revision.max(header));
                    self.confirmer.heard(header);
                    let floor = revisions.last().map_or(link.writer().record().watermark, |r| r.revision);
                    more.retain(|r| r.revision > floor);
                    revisions.extend(more);
                }
                Delivery::Cancelled { compact_revision, reason } => {
                    self.apply_revisions(link, std::mem::take(&mut revisions)).await?;
                    let fault = Fault::of_watch_cancel(compact_revision, &reason);
                    return Err(match fault.class() {
                        ErrorClass::Resync => EngineError::Resync(ResyncCause::WatchCompacted),
                        _ => EngineError::Etcd(EtcdError::new(
                            "watch",
                            Side::Source,
                            etcd_client::Error::WatchError(format!("watch cancelled: {reason}")),
                        )),
                    });
                }
                Delivery::Reply { created, header } => {
                    self.apply_revisions(link, std::mem::take(&mut revisions)).await?;
                    self.on_reply(link, Reply { created, header }).await?;
                }
            }
        }
        self.apply_revisions(link, revisions).await
    }

    /// A created reply or a progress notification: only a trusted one proves that nothing at
    /// or below its revision is still to come (see the module doc).
    async fn on_reply(&mut self, link: &mut Link<'_>, reply: Reply) -> Result<(), EngineError> {
        // What it proves is measured against the record the fence holds.
        link.drain().await?;
        link.engine.update(|s| s.source_revision = s.source_revision.max(reply.header));
        self.confirmer.heard(reply.header);
        let watermark = link.writer().record().watermark;
        match on_progress_reply(reply, watermark, link.trust, self.next_idle_proof) {
            OnReply::Wait => Ok(()),
            OnReply::Current => {
                link.engine.update(|s| s.last_progress_time = Some(now_rfc3339()));
                self.confirm_current(link).await
            }
            OnReply::Advance(to) => self.advance_to(link, to).await,
            OnReply::FinishIfDue { current } => {
                self.finish_genesis_if_due(link, watermark).await?;
                if current {
                    link.engine.update(|s| s.last_progress_time = Some(now_rfc3339()));
                }
                // The header was the source's revision when the reply was made: nothing above
                // the watermark existed then, whether or not the server's notifications are
                // ordered after its events.
                self.confirm_current(link).await
            }
            OnReply::ProveIdle(to) => self.prove_idle(link, to).await,
        }
    }

    /// A reply at or below the watermark confirmed it current: stores when, with a
    /// checkpoint-only Txn at most once per `progress_interval` ([`super::confirm::Confirmer::owed`]).
    async fn confirm_current(&mut self, link: &mut Link<'_>) -> Result<(), EngineError> {
        let interval = link.cfg().sync.progress_interval.get();
        let record = link.applier.as_ref().expect("fence claimed").record();
        let Some(time) = self.confirmer.owed(&record.confirmed_time, interval, self.scan_end) else {
            return Ok(());
        };
        let next = record.confirmed_at(time);
        link.commit_with_retry(&[], next).await
    }

    /// Starts the idle source's confirm read ([`super::confirm::Confirmer::start_read`]), one at a time.
    fn start_confirm_read(&mut self, link: &mut Link<'_>, in_genesis: bool) {
        let sync = &link.cfg().sync;
        let timeout = sync.request_timeout.get().min(sync.progress_interval.get());
        let watermark = link.writer().record().watermark;
        let key = link.engine.rewriter.source_prefix().to_vec();
        self.confirmer.start_read(watermark, in_genesis, link.source.kv_client(), key, timeout);
    }

    /// The confirm read's answer: the source's revision for status, and at or below the
    /// watermark a confirmation stored as for a reply.
    async fn on_confirm_read(
        &mut self,
        link: &mut Link<'_>,
        answer: Option<(i64, String)>,
    ) -> Result<(), EngineError> {
        let watermark = link.writer().record().watermark;
        let (seen, confirmed) = self.confirmer.on_answer(answer, watermark);
        if let Some(header) = seen {
            link.engine.update(|s| s.source_revision = s.source_revision.max(header));
        }
        if confirmed {
            self.confirm_current(link).await?;
        }
        Ok(())
    }

    /// The idle proof (engine module doc): the range is the same at `to` as at the watermark,
    /// so a checkpoint-only Txn moves the watermark to `to`. When the watermark was compacted
    /// away, an initial sync or a drain that must reach a revision settles by comparison
    /// instead; the tail waits for the next event.
    async fn prove_idle(&mut self, link: &mut Link<'_>, to: i64) -> Result<(), EngineError> {
        let from = link.writer().record().watermark;
        let started = Instant::now();
        let proof = prove_unchanged(
            &link.source.kv_client(),
            &link.engine.rewriter.source_range(),
            from,
            to,
            link.page_options("idle proof page"),
            link.cfg().sync.request_timeout.get(),
        )
        .await?;
        let spacing = idle_proof_spacing(started.elapsed(), link.cfg().sync.progress_interval.get());
        self.next_idle_proof = Some(Instant::now() + spacing);
        debug!(from, to, ?proof, took = ?started.elapsed(), "idle proof");
        match proof {
            IdleProof::Unchanged => {
                self.advance_to(link, to).await?;
                link.engine.update(|s| s.last_progress_time = Some(now_rfc3339()));
                Ok(())
            }
            IdleProof::Changed => Ok(()),
            IdleProof::Compacted => match self.scan_end.or(self.drain_target) {
                Some(end) if end > from && to >= end => self.settle_at(link, end).await,
                _ => Ok(()),
            },
        }
    }

    pub(super) async fn finish_genesis_if_due(
        &mut self,
        link: &mut Link<'_>,
        watermark: i64,
    ) -> Result<(), EngineError> {
        if let Some(end) = self.scan_end {
            if watermark >= end && link.writer().record().scanning {
                let mut next = link.writer().record().genesis_complete();
                next.initial_sync_completed = now_rfc3339();
                link.commit_with_retry(&[], next).await?;
            }
            if watermark >= end {
                self.scan_end = None;
                info!(watermark, "initial sync complete");
                let completed = Some(link.writer().record().initial_sync_completed.clone())
                    .filter(|t| !t.is_empty())
                    .unwrap_or_else(now_rfc3339);
                link.engine.update(|s| {
                    s.initial_sync.completed = Some(completed);
                    s.set_condition(ConditionType::InitialSyncComplete, true, Reason::Complete, "");
                });
                link.engine.set_phase(Phase::Syncing);
            }
        }
        Ok(())
    }
}
