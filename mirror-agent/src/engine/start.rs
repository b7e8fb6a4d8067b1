//! What a connected run does first: read the checkpoint and decide between tailing, resuming a
//! scan, and a fresh genesis; claim the fence.

use std::time::Duration;

use etcd_client::GetOptions;
use mirror_core::{now_rfc3339, unary, ConditionType, DestRange, KeyRange, Reason, Side};
use mirror_fence::{read_checkpoint_since, Applier, Checkpoint, FenceError, FencedWriter, Observed};
use mirror_scan::count;
use mirror_watch::{open_watch, Watch};
use tracing::{info, warn};

use super::plan::{plan_start, StartFacts, StartPlan};
use super::{EngineError, Pending, Refusal, Run};

impl Run<'_> {
    /// Reads the checkpoint, plans and claims, and runs the plan. A claim that raced a writer
    /// who moved the checkpoint plans again from a fresh read (a fence bump against a busy
    /// writer wins within a few tries; the old writer's next Txn then fails its compare).
    pub(super) async fn start(&mut self, pending: Pending) -> Result<(), EngineError> {
        loop {
            match self.start_once(pending).await {
                Err(EngineError::Fence(FenceError::Raced)) => {
                    self.engine.stop_if_shutting_down()?;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                other => return other,
            }
        }
    }

    async fn start_once(&mut self, pending: Pending) -> Result<(), EngineError> {
        let key = self.cfg().checkpoint_key();
        let timeout = self.timeout();
        let committed = self.engine.target_committed;
        let observed = read_checkpoint_since(&mut self.target_kv, &key, timeout, committed).await?;
        if let Err(e) = mirror_fence::may_claim(&observed, &self.template(0)) {
            return Err(match e {
                FenceError::PrefixConflict { stored, ours } => {
                    let endpoints = &self.cfg().target.endpoints;
                    let at = KeyRange { end: mirror_core::key_after(&key), start: key.clone() };
                    Refusal::CheckpointTaken {
                        other: stored,
                        ours,
                        key: String::from_utf8_lossy(&key).escape_debug().to_string(),
                        clear: mirror_core::delete_commands(endpoints, &[at]).concat(),
                    }
                    .into()
                }
                e => e.into(),
            });
        }
        let stored = match &observed {
            Observed::Present { record, .. } => Some(record.clone()),
            Observed::Absent => None,
        };
        match &stored {
            Some(record) => self.remember_counts(record),
            // Before a new link's first write: is any of its destination another link's?
            None => self.refuse_overlaps().await?,
        }
        let ours = self.engine.rewriter.range_fingerprint();
        let plan = plan_start(&StartFacts {
            stored: stored.as_ref(),
            pending,
            source_cluster: self.source_cluster,
            target_cluster: self.target_cluster,
            range: &ours,
            mode: self.cfg().initial_sync.mode,
            start_revision: self.cfg().initial_sync.start_revision,
        });
        // Carrying on with a stored record under this agent's epoch, id and range (and its
        // excludes, which records written before they were kept lack).
        let resumed = |run: &Self, r: &Checkpoint| Checkpoint {
            excludes: run.engine.rewriter.dest_excludes(),
            source_seen: 0,
            ..r.resumed_by(run.cfg().epoch as u64, &run.engine.agent_id, &ours)
        };
        if let (StartPlan::Tail { .. } | StartPlan::ResumeScan, Some(r)) = (&plan, &stored) {
            self.refuse_source_behind(r.watermark).await?;
        }
        self.note_excluded_in_target().await?;
        match (plan, stored) {
            (StartPlan::Tail { watermark }, Some(r)) => {
                let next = resumed(self, &r);
                self.claim(observed, next).await?;
                self.engine.update(|s| {
                    s.watermark = watermark;
                    s.initial_sync.completed.get_or_insert_with(now_rfc3339);
                    s.set_condition(ConditionType::InitialSyncComplete, true, Reason::Resumed, "");
                });
                let watch = self.open_watch(watermark + 1).await?;
                self.tail(watch, None).await
            }
            (StartPlan::ResumeScan, Some(r)) => {
                let next = resumed(self, &r);
                self.claim(observed, next).await?;
                // The count says how many keys the earlier runs copied, once it answers.
                self.start_counting(r.watermark, &r.scan_cursor);
                self.engine.update(|s| {
                    s.initial_sync.total_keys = 0;
                    s.initial_sync.keys = 0;
                });
                self.genesis(r.watermark, r.scan_cursor.clone(), r.prune_pending).await
            }
            (StartPlan::TailFromStartRevision { start }, _) => {
                // The operator says the target already holds the source's state just before
                // `start_revision` (restored from a snapshot, say): tail from it, scan nothing.
                warn!(
                    start,
                    "initial_sync.start_revision: tailing from it with no scan; the target must already hold the source's state at {}",
                    start - 1
                );
                self.claim(observed, self.template(start - 1)).await?;
                self.engine.update(|s| {
                    s.initial_sync.completed.get_or_insert_with(now_rfc3339);
                    s.set_condition(
                        ConditionType::InitialSyncComplete,
                        true,
                        Reason::StartRevision,
                        format!("tailing from {start}, no scan"),
                    );
                });
                let watch = self.open_watch(start).await?;
                self.tail(watch, None).await
            }
            (StartPlan::FreshGenesis { require_empty, prune, forced }, _) => {
                if let Some(reason) = forced {
                    let why = match reason {
                        Reason::ClusterChanged => "stored cluster ids differ from the connected clusters (a side was rebuilt or restored)",
                        _ => "the mirrored range changed since the checkpoint was written",
                    };
                    warn!(reason = reason.as_str(), require_empty, "{why}; forced resync with prune");
                    self.engine.note_resync(reason, true);
                }
                if require_empty {
                    self.require_empty().await?;
                }
                // R0 from a read of one key; the range's count at R0 runs beside the scan.
                let r0 = self.source_revision().await?;
                self.start_counting(r0, &[]);
                let next = self.template(r0).scan_progress(r0, Vec::new(), prune);
                self.claim(observed, next).await?;
                self.engine.update(|s| {
                    s.initial_sync.total_keys = 0;
                    s.initial_sync.keys = 0;
                    s.lease_backed_keys = 0;
                    s.initial_sync.started = Some(now_rfc3339());
                    s.initial_sync.completed = None;
                    s.watermark = r0;
                    s.set_condition(ConditionType::InitialSyncComplete, false, Reason::Scanning, "");
                });
                self.genesis(r0, Vec::new(), prune).await
            }
            (StartPlan::Tail { .. } | StartPlan::ResumeScan, None) => {
                unreachable!("resume plans need a record")
            }
        }
    }

    /// Refuses a new link whose destination overlaps another link's, before its first write:
    /// an outer link (a checkpoint at a proper prefix of our destination) that does not exclude
    /// our destination, or an inner link (a reserved namespace inside our range) that we do not
    /// exclude. The link that starts second is the one refused; a link already writing is
    /// never stopped by a newcomer. Nested links stay possible: exclude the inner range from
    /// the outer link (`sync.exclude_prefixes`), whichever starts first.
    async fn refuse_overlaps(&mut self) -> Result<(), EngineError> {
        let ours = self.engine.rewriter.dest_prefix().to_vec();
        let marker = mirror_core::RESERVED_MARKER.as_bytes();
        let timeout = self.timeout();
        for len in 0..ours.len() {
            let key = [&ours[..len], marker, b"checkpoint"].concat();
            let resp = match unary("overlap check", Side::Target, timeout, self.target_kv.get(key, None))
                .await
            {
                Ok(resp) => resp,
                // A least-privilege user reads only its own prefix: it cannot see an outer link,
                // and is no reason to stop (the inner check below stays inside the range).
                Err(e) if e.fault == mirror_core::Fault::PermissionDenied => {
                    warn!("the target user may not read outside the destination prefix: outer links are not checked");
                    break;
                }
                Err(e) => return Err(e.into()),
            };
            let Some(kv) = resp.kvs().first() else { continue };
            let (other, excludes) = match Checkpoint::decode(kv.value()) {
                Ok(r) => (r.link_uid, r.excludes),
                Err(_) => ("unknown".to_owned(), Vec::new()),
            };
            let outer = DestRange { prefix: &ours[..len], excludes: &excludes };
            if outer.overlaps(&DestRange { prefix: &ours, excludes: &[] }) {
                return Err(self.overlap(other, &ours[..len]));
            }
        }
        let page = self.page_options("overlap check").keys_only();
        let inner =
            mirror_reconcile::foreign_dest_prefixes(self.target_kv.clone(), &self.engine.rewriter, page)
                .await?;
        let excluded = self.engine.rewriter.dest_excludes();
        let mine = DestRange { prefix: &ours, excludes: &excluded };
        for theirs in inner {
            if !mine.overlaps(&DestRange { prefix: &theirs, excludes: &[] }) {
                continue;
            }
            let key = [&theirs[..], marker, b"checkpoint"].concat();
            let resp = unary("overlap check", Side::Target, timeout, self.target_kv.get(key, None)).await?;
            let other = resp
                .kvs()
                .first()
                .and_then(|kv| Checkpoint::decode(kv.value()).ok())
                .map_or_else(|| "unknown".to_owned(), |r| r.link_uid);
            return Err(self.overlap(other, &theirs));
        }
        Ok(())
    }

    fn overlap(&self, other: String, theirs: &[u8]) -> EngineError {
        let show = |p: &[u8]| String::from_utf8_lossy(p).escape_debug().to_string();
        let namespace = KeyRange::prefix(&[theirs, mirror_core::RESERVED_MARKER.as_bytes()].concat());
        Refusal::Overlap {
            other,
            theirs: show(theirs),
            ours: show(self.engine.rewriter.dest_prefix()),
            clear: mirror_core::delete_commands(&self.cfg().target.endpoints, &[namespace]).concat(),
        }
        .into()
    }

    /// Status takes the link's counts from a stored record where it knows less (a restarted
    /// agent starts at 0); the records this run writes carry them on.
    fn remember_counts(&self, record: &Checkpoint) {
        self.engine.update(|s| {
            s.forced_resyncs.count = s.forced_resyncs.count.max(record.forced_resyncs);
            s.scan_restarts = s.scan_restarts.max(record.scan_restarts);
            // While a scan runs the last completion is history, not this sync's.
            if s.initial_sync.completed.is_none()
                && !record.initial_sync_completed.is_empty()
                && !record.scanning
            {
                s.initial_sync.completed = Some(record.initial_sync_completed.clone());
            }
        });
    }

    pub(super) async fn claim(&mut self, observed: Observed, next: Checkpoint) -> Result<(), EngineError> {
        let writer = FencedWriter::claim(
            self.target_kv.clone(),
            self.cfg().checkpoint_key(),
            observed,
            next,
            self.timeout(),
        )
        .await?
        .with_max_txn_ops(self.cfg().sync.max_txn_ops as usize);
        match self.engine.elected_at.take() {
            Some(at) => info!(
                epoch = writer.record().epoch,
                watermark = writer.record().watermark,
                fence_after_election_ms = at.elapsed().as_millis() as u64,
                "holding the fence"
            ),
            None => info!(
                epoch = writer.record().epoch,
                watermark = writer.record().watermark,
                "holding the fence"
            ),
        }
        let watermark = writer.record().watermark;
        let confirmed = Some(writer.record().confirmed_time.clone()).filter(|t| !t.is_empty());
        self.engine.update(|s| {
            s.watermark = watermark;
            s.confirmed_time = confirmed;
            s.set_condition(ConditionType::Fenced, false, Reason::HoldingFence, "");
        });
        let sync = self.cfg().sync.clone();
        self.applier = Some(Applier::new(writer, sync, self.engine.throttle, self.engine.shutdown.clone()));
        // Only the fence holder keeps leases: what the link holds is found now and kept alive
        // from now on; any that ran out meanwhile are granted again and their keys owed.
        let record = self.writer().record().clone();
        let (windows, target_windows) =
            (self.engine.rewriter.scan_windows(), self.engine.rewriter.target_windows());
        let watermarks = self.writer().watermarks();
        self.engine.repair_owed |= self.leases.claim(&record, &windows, target_windows, watermarks).await?;
        Ok(())
    }

    /// The source's current revision: the header of a count-only Get of one key. (A count of
    /// the whole range would make etcd walk every key of it in its index, under the lock every
    /// write needs: a second or more at millions of keys.)
    pub(super) async fn source_revision(&mut self) -> Result<i64, EngineError> {
        let range = self.engine.rewriter.source_range();
        let opts = GetOptions::new().with_count_only();
        let resp = unary(
            "revision",
            Side::Source,
            self.timeout(),
            self.source.kv_client().get(range.start, Some(opts)),
        )
        .await?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    /// SPEC §6 "source went back": a source below the watermark (same cluster id, restored
    /// from an older snapshot) would be watched from a future revision, which etcd accepts
    /// without a word, and its new history under revisions already applied would be skipped.
    /// Checked at every connect, before the watch opens. A linearizable read answers at or
    /// above every revision the source ever delivered, so a healthy source never trips it.
    pub(super) async fn refuse_source_behind(&mut self, watermark: i64) -> Result<(), EngineError> {
        let source_revision = self.source_revision().await?;
        if source_revision < watermark {
            return Err(Refusal::SourceWentBack { watermark, source_revision }.into());
        }
        Ok(())
    }

    /// Counts what the target still holds under each excluded prefix and lists it in status
    /// (`excluded_keys_in_target`), with one warning when there is any: those keys are outside
    /// the mirrored range, so no prune or reconcile pass ever touches them (an exclude added to a
    /// running link leaves its keys behind). One count-only read per exclude.
    pub(super) async fn note_excluded_in_target(&mut self) -> Result<(), EngineError> {
        // The configured ones only: the rewriter's list also holds the reserved namespace.
        let excludes = self.cfg().sync.exclude_prefixes.clone();
        let dest_prefix = self.engine.rewriter.dest_prefix().to_vec();
        let mut found = Vec::new();
        for exclude in &excludes {
            let relative = exclude.as_bytes();
            let start = [&dest_prefix[..], relative].concat();
            let window = [mirror_core::KeyRange { end: mirror_core::prefix_end(&start), start }];
            let timeout = self.timeout();
            let (keys, _) = count(&mut self.target_kv, &window, None, Side::Target, timeout).await?;
            if keys > 0 {
                let prefix = String::from_utf8_lossy(relative).into_owned();
                warn!(
                    exclude = %prefix,
                    keys,
                    "the target holds keys under an excluded prefix; the agent never touches them (delete them by hand if they are stale)"
                );
                found.push(mirror_core::ExcludedKeys { prefix, keys });
            }
        }
        self.engine.update(|s| s.excluded_keys_in_target = found);
        Ok(())
    }

    pub(super) async fn require_empty(&mut self) -> Result<(), EngineError> {
        let windows = self.engine.rewriter.target_windows();
        let timeout = self.timeout();
        let (n, _) = count(&mut self.target_kv, &windows, None, Side::Target, timeout).await?;
        if n > 0 {
            // With nothing in the reserved namespace (no link's checkpoint), deleting the whole
            // prefix deletes exactly the same keys, in one readable `etcdctl del --prefix`.
            let reserved = KeyRange::prefix(&self.engine.rewriter.reserved_prefix());
            let (held, _) = count(&mut self.target_kv, &[reserved], None, Side::Target, timeout).await?;
            let clear = if held == 0 { &[self.engine.rewriter.target_range()][..] } else { &windows[..] };
            let clear = mirror_core::delete_commands(&self.cfg().target.endpoints, clear);
            return Err(Refusal::EmptyTarget { keys: n, clear }.into());
        }
        Ok(())
    }

    pub(super) async fn open_watch(&mut self, start: i64) -> Result<Watch, EngineError> {
        let fragment = self.engine.fragment_watch;
        let stream = open_watch(&mut self.source, &self.engine.rewriter, start, fragment).await?;
        let first = !std::mem::replace(&mut self.engine.watch_opened, true);
        if !first {
            self.engine.update(|s| s.watch_restarts += 1);
        }
        let (sender, stream) = stream.split();
        Ok(Watch::new(sender, stream, self.held_revision_bytes()))
    }
}
