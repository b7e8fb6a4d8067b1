//! The tail: watch responses, progress, and the timers of a running link.

use std::time::Duration;

use mirror_core::{
    now_rfc3339, probe_members, ConditionType, Config, ErrorClass, EtcdError, Fault, Mode, Phase, Reason,
    Side,
};
use mirror_watch::{prove_unchanged, Buffered, Delivery, IdleProof, Revision, Watch, WatchEnd};
use tokio::time::Instant;
use tracing::{debug, info};

use super::buffering::watch_error;
use super::decide::{idle_proof_spacing, on_progress_reply, OnReply, ReconcileClock, Reply};
use super::leases::LeaseNews;
use super::{
    members_reachable, tls_fingerprint, EngineError, Progress, ReconnectCause, ResyncCause, Run,
    FENCE_CHECK_INTERVAL, MEMBER_CHECK_INTERVAL, MEMBER_RECHECK_INTERVAL, TLS_CHECK_INTERVAL,
};

impl Run<'_> {
    /// The tail. With `genesis = Some((scan_end, replay))`, first applies the replay and keeps
    /// `scanning: true` until the watermark reaches `scan_end`.
    pub(super) async fn tail(
        &mut self,
        watch: Watch,
        genesis: Option<(i64, Buffered)>,
    ) -> Result<(), EngineError> {
        self.watch = Some(watch);
        self.engine.made_progress(Progress::Healthy);
        let mut scan_end = genesis.as_ref().map(|(e, _)| *e);
        if let Some((_, replay)) = genesis {
            self.apply_revisions(replay, &mut scan_end).await?;
            // A scan that saw nothing after R0 (scan_end = R0 = the watermark) needs no proof
            // that more events are coming: the target equals the source at R0 now. Waiting for
            // a progress reply instead never ended on etcd 3.5.30 (and every release with etcd
            // commit 2d5a9b98), which sends no progress for a watch whose start revision (R0 +
            // 1) the server has not reached yet: an idle source never finished its sync.
            let watermark = self.writer().record().watermark;
            self.finish_genesis_if_due(&mut scan_end, watermark).await?;
        }
        if scan_end.is_none() {
            self.engine.set_phase(Phase::Syncing);
        }
        let steady = self.cfg().sync.progress_interval.get();
        let mut reconcile_clock = ReconcileClock::start(Instant::now());
        let mut fence_check = tokio::time::interval(FENCE_CHECK_INTERVAL);
        let mut tls_check = tokio::time::interval(TLS_CHECK_INTERVAL);
        let mut member_check = tokio::time::interval(MEMBER_CHECK_INTERVAL);
        // While the initial sync waits for scan_end, ask for progress often.
        let mut progress =
            tokio::time::interval(if scan_end.is_some() { Duration::from_millis(500) } else { steady });
        // A drain whose sync is already complete starts now: on an idle source no reply may
        // ever come to start it (etcd 3.5.30 sends no progress for a watch ahead of its revision).
        if scan_end.is_none() && self.drain_step(&mut progress).await? {
            return Ok(());
        }
        loop {
            if self.watch.is_none() {
                // Cancelled under sustained target backoff; the target takes writes again.
                let from = self.writer().record().watermark + 1;
                info!(from, "re-watching the source from the watermark");
                self.watch = Some(self.open_watch(from).await?);
            }
            if self.engine.repair_owed && scan_end.is_none() {
                // A target lease ran out and took its keys: put them back before anything else,
                // so the link does not report caught up while they are missing. The watch is
                // buffered meanwhile.
                self.engine.repair_owed = false;
                self.reconcile_buffered(&mut scan_end).await?;
                reconcile_clock.passed(Instant::now());
                continue;
            }
            let reconcile_at = reconcile_clock.due(self.cfg().reconcile.interval.get(), scan_end.is_none());
            // The watch's read: data above the watermark, Txns up to the flush size at once.
            let floor = self.writer().record().watermark;
            let budget = self.cfg().sync.txn_flush_bytes.bytes() as usize;
            let watch = self.watch.as_mut().expect("opened above");
            let read = tokio::select! {
                _ = self.engine.shutdown.cancelled() => return Ok(()),
                _ = reload_changed(&mut self.engine.reload) => {
                    self.engine.apply_reload()?;
                    self.reconfigure();
                    continue;
                }
                _ = tls_check.tick(), if self.tls_files.is_some() && scan_end.is_none() => {
                    if tls_fingerprint(self.cfg()) != self.tls_files {
                        return Err(EngineError::Reconnect(ReconnectCause::TlsFilesChanged));
                    }
                    continue;
                }
                _ = member_check.tick(), if self.member_probe.is_none() => {
                    let cfg = self.engine.cfg.clone();
                    self.member_probe = Some(tokio::spawn(async move {
                        let source = probe_members(Side::Source, &cfg.source, &cfg.sync).await;
                        let target = probe_members(Side::Target, &cfg.target, &cfg.sync).await;
                        (source, target)
                    }));
                    continue;
                }
                probed = join_some(&mut self.member_probe) => {
                    self.member_probe = None;
                    if let Ok((Ok(source), Ok(target))) = probed {
                        self.engine.update(|s| members_reachable(s, &source, &target));
                        let down = !source.unreachable.is_empty() || !target.unreachable.is_empty();
                        let every = if down { MEMBER_RECHECK_INTERVAL } else { MEMBER_CHECK_INTERVAL };
                        if member_check.period() != every {
                            member_check = tokio::time::interval_at(Instant::now() + every, every);
                        }
                    }
                    continue;
                }
                _ = fence_check.tick() => {
                    // An idle tail learns of a takeover or a cutover now, not at its next write.
                    self.writer().verify_held().await?;
                    continue;
                }
                _ = sleep_until_some(reconcile_at) => {
                    // Inline on the tail's own task: it cannot overlap genesis, a sweep, a
                    // drain or itself, and no tail write races its reads.
                    // The watch is buffered meanwhile, so etcd never finds it stuck.
                    self.reconcile_buffered(&mut scan_end).await?;
                    reconcile_clock.passed(Instant::now());
                    continue;
                }
                news = self.leases.news() => {
                    match news {
                        LeaseNews::RepairOwed => self.engine.repair_owed = true,
                        LeaseNews::Failed(e) => return Err(e),
                    }
                    continue;
                }
                _ = progress.tick() => {
                    watch.request_progress().await;
                    self.start_confirm_read(scan_end.is_some());
                    continue;
                }
                answer = self.confirmer.answer() => {
                    self.on_confirm_read(answer, &scan_end).await?;
                    continue;
                }
                read = watch.next(&self.engine.rewriter, floor, budget) => read,
            };
            self.on_deliveries(read.items, &mut scan_end).await?;
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
            if scan_end.is_none() && self.drain_step(&mut progress).await? {
                return Ok(());
            }
            if scan_end.is_none() && self.drain_target.is_none() && progress.period() != steady {
                progress = tokio::time::interval(steady);
                progress.tick().await;
            }
        }
    }

    /// Drain mode (SPEC §5 Drain and cutover), once the initial sync is complete: records the
    /// drain target revision the first time, and verifies and promotes once the watermark has
    /// reached it. `true` once promoted (the tail ends); always `false` outside drain mode.
    async fn drain_step(&mut self, progress: &mut tokio::time::Interval) -> Result<bool, EngineError> {
        if self.cfg().mode != Mode::Drain {
            return Ok(false);
        }
        let watermark = self.writer().record().watermark;
        let target = match self.drain_target {
            Some(target) => target,
            None => {
                let target = self.source_revision().await?;
                info!(
                    drain_target_revision = target,
                    "draining: waiting for the watermark to reach the drain target"
                );
                self.drain_target = Some(target);
                self.engine.update(|s| {
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
        self.verify_and_promote(target).await?;
        Ok(true)
    }

    /// Deliveries in arrival order: runs of whole revisions are applied as one batch stream
    /// (merged into as few Txns as the limits allow); a reply or a cancel is handled in its
    /// place, after the revisions before it. Revisions at or below the watermark (moved by a
    /// reply in the same read) are dropped: already applied, or proven.
    pub(super) async fn on_deliveries(
        &mut self,
        deliveries: Vec<Delivery>,
        scan_end: &mut Option<i64>,
    ) -> Result<(), EngineError> {
        let mut revisions: Vec<Revision> = Vec::new();
        for delivery in deliveries {
            match delivery {
                Delivery::Revisions { revisions: mut more, header } => {
                    self.engine.update(|s| s.source_revision = s.source_revision.max(header));
                    self.confirmer.heard(header);
                    let floor = revisions.last().map_or(self.writer().record().watermark, |r| r.revision);
                    more.retain(|r| r.revision > floor);
                    revisions.extend(more);
                }
                Delivery::Cancelled { compact_revision, reason } => {
                    self.apply_revisions(std::mem::take(&mut revisions), scan_end).await?;
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
                    self.apply_revisions(std::mem::take(&mut revisions), scan_end).await?;
                    self.on_reply(Reply { created, header }, scan_end).await?;
                }
            }
        }
        self.apply_revisions(revisions, scan_end).await
    }

    /// A created reply or a progress notification: only a trusted one proves that nothing at
    /// or below its revision is still to come (see the module doc).
    async fn on_reply(&mut self, reply: Reply, scan_end: &mut Option<i64>) -> Result<(), EngineError> {
        self.engine.update(|s| s.source_revision = s.source_revision.max(reply.header));
        self.confirmer.heard(reply.header);
        let watermark = self.writer().record().watermark;
        match on_progress_reply(reply, watermark, self.trust, self.next_idle_proof) {
            OnReply::Wait => Ok(()),
            OnReply::Current => {
                self.engine.update(|s| s.last_progress_time = Some(now_rfc3339()));
                self.confirm_current(scan_end).await
            }
            OnReply::Advance(to) => self.advance_to(to, scan_end).await,
            OnReply::FinishIfDue { current } => {
                self.finish_genesis_if_due(scan_end, watermark).await?;
                if current {
                    self.engine.update(|s| s.last_progress_time = Some(now_rfc3339()));
                }
                // The header was the source's revision when the reply was made: nothing above
                // the watermark existed then, whether or not the server's notifications are
                // ordered after its events.
                self.confirm_current(scan_end).await
            }
            OnReply::ProveIdle(to) => self.prove_idle(to, scan_end).await,
        }
    }

    /// A reply at or below the watermark confirmed it current: stores when, with a
    /// checkpoint-only Txn at most once per `progress_interval` ([`super::confirm::Confirmer::owed`]).
    async fn confirm_current(&mut self, scan_end: &Option<i64>) -> Result<(), EngineError> {
        let interval = self.cfg().sync.progress_interval.get();
        let record = self.applier.as_ref().expect("fence claimed").record();
        let Some(time) = self.confirmer.owed(&record.confirmed_time, interval, *scan_end) else {
            return Ok(());
        };
        let next = record.confirmed_at(time);
        self.commit_with_retry(&[], next).await
    }

    /// Starts the idle source's confirm read ([`super::confirm::Confirmer::start_read`]), one at a time.
    fn start_confirm_read(&mut self, in_genesis: bool) {
        let sync = &self.cfg().sync;
        let timeout = sync.request_timeout.get().min(sync.progress_interval.get());
        let watermark = self.writer().record().watermark;
        let key = self.engine.rewriter.source_prefix().to_vec();
        self.confirmer.start_read(watermark, in_genesis, self.source.kv_client(), key, timeout);
    }

    /// The confirm read's answer: the source's revision for status, and at or below the
    /// watermark a confirmation stored as for a reply.
    async fn on_confirm_read(
        &mut self,
        answer: Option<(i64, String)>,
        scan_end: &Option<i64>,
    ) -> Result<(), EngineError> {
        let watermark = self.writer().record().watermark;
        let (seen, confirmed) = self.confirmer.on_answer(answer, watermark);
        if let Some(header) = seen {
            self.engine.update(|s| s.source_revision = s.source_revision.max(header));
        }
        if confirmed {
            self.confirm_current(scan_end).await?;
        }
        Ok(())
    }

    /// The idle proof (engine module doc): the range is the same at `to` as at the watermark,
    /// so a checkpoint-only Txn moves the watermark to `to`. When the watermark was compacted
    /// away, an initial sync or a drain that must reach a revision settles by comparison
    /// instead; the tail waits for the next event.
    async fn prove_idle(&mut self, to: i64, scan_end: &mut Option<i64>) -> Result<(), EngineError> {
        let from = self.writer().record().watermark;
        let started = Instant::now();
        let proof = prove_unchanged(
            &self.source.kv_client(),
            &self.engine.rewriter.source_range(),
            from,
            to,
            self.page_options("idle proof page"),
            self.cfg().sync.request_timeout.get(),
        )
        .await?;
        let spacing = idle_proof_spacing(started.elapsed(), self.cfg().sync.progress_interval.get());
        self.next_idle_proof = Some(Instant::now() + spacing);
        debug!(from, to, ?proof, took = ?started.elapsed(), "idle proof");
        match proof {
            IdleProof::Unchanged => {
                self.advance_to(to, scan_end).await?;
                self.engine.update(|s| s.last_progress_time = Some(now_rfc3339()));
                Ok(())
            }
            IdleProof::Changed => Ok(()),
            IdleProof::Compacted => match scan_end.or(self.drain_target) {
                Some(end) if end > from && to >= end => self.settle_at(end, scan_end).await,
                _ => Ok(()),
            },
        }
    }

    pub(super) async fn finish_genesis_if_due(
        &mut self,
        scan_end: &mut Option<i64>,
        watermark: i64,
    ) -> Result<(), EngineError> {
        if let Some(end) = *scan_end {
            if watermark >= end && self.writer().record().scanning {
                let mut next = self.writer().record().genesis_complete();
                next.initial_sync_completed = now_rfc3339();
                self.commit_with_retry(&[], next).await?;
            }
            if watermark >= end {
                *scan_end = None;
                info!(watermark, "initial sync complete");
                let completed = Some(self.writer().record().initial_sync_completed.clone())
                    .filter(|t| !t.is_empty())
                    .unwrap_or_else(now_rfc3339);
                self.engine.update(|s| {
                    s.initial_sync.completed = Some(completed);
                    s.set_condition(ConditionType::InitialSyncComplete, true, Reason::Complete, "");
                });
                self.engine.set_phase(Phase::Syncing);
            }
        }
        Ok(())
    }
}

/// Resolves when a reloaded config is waiting (without consuming it), never without a channel.
pub(super) async fn reload_changed(reload: &mut Option<tokio::sync::watch::Receiver<Config>>) {
    match reload {
        Some(rx) => {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// The result of a spawned task, or never when there is none.
pub(super) async fn join_some<F: std::future::Future + Unpin>(task: &mut Option<F>) -> F::Output {
    match task {
        Some(handle) => handle.await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`, or forever when there is no deadline.
pub(super) async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
