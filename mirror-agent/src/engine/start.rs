//! What a connected run does first: read the checkpoint and decide between tailing, resuming a
//! scan, and a fresh genesis; claim the fence.

use std::time::Duration;

use mirror_core::{now_rfc3339, unary, ConditionType, DestRange, KeyRange, Reason, Side};
use mirror_fence::{read_checkpoint_since, Applier, Checkpoint, FenceError, FencedWriter, Observed};
use mirror_scan::count;
use tracing::{info, warn};

use super::genesis::Genesis;
use super::link::{Link, Step};
use super::plan::{plan_start, StartFacts, StartPlan};
use super::tail::Tail;
use super::{EngineError, Pending, Refusal};

/// The first phase of a run: what the run loop asked for ([`Pending`]).
pub(super) struct Start {
    pending: Pending,
}

impl Start {
    pub(super) fn new(pending: Pending) -> Start {
        Start { pending }
    }

    /// Reads the checkpoint, plans and claims, and hands back the phase the plan starts with. A
    /// claim that raced a writer who moved the checkpoint plans again from a fresh read (a
    /// fence bump against a busy writer wins within a few tries; the old writer's next Txn
    /// then fails its compare).
    pub(super) async fn run(self, link: &mut Link<'_>) -> Result<Step, EngineError> {
        loop {
            match self.once(link).await {
                Err(EngineError::Fence(FenceError::Raced)) => {
                    link.engine.stop_if_shutting_down()?;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                other => return other,
            }
        }
    }

    async fn once(&self, link: &mut Link<'_>) -> Result<Step, EngineError> {
        let pending = self.pending;
        let key = link.cfg().checkpoint_key();
        let timeout = link.timeout();
        let committed = link.engine.target_committed;
        let observed = read_checkpoint_since(&mut link.target_kv, &key, timeout, committed).await?;
        if let Err(e) = mirror_fence::may_claim(&observed, &link.template(0)) {
            return Err(match e {
                FenceError::PrefixConflict { stored, ours } => {
                    let endpoints = &link.cfg().target.endpoints;
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
            Some(record) => remember_counts(link, record),
            // Before a new link's first write: is any of its destination another link's?
            None => refuse_overlaps(link).await?,
        }
        let ours = link.engine.rewriter.range_fingerprint();
        let plan = plan_start(&StartFacts {
            stored: stored.as_ref(),
            pending,
            source_cluster: link.source_cluster,
            target_cluster: link.target_cluster,
            range: &ours,
            mode: link.cfg().initial_sync.mode,
            start_revision: link.cfg().initial_sync.start_revision,
        });
        // Carrying on with a stored record under this agent's epoch, id and range (and its
        // excludes, which records written before they were kept lack).
        let resumed = |link: &Link<'_>, r: &Checkpoint| Checkpoint {
            excludes: link.engine.rewriter.dest_excludes(),
            source_seen: 0,
            ..r.resumed_by(link.cfg().epoch as u64, &link.engine.agent_id, &ours)
        };
        if let (StartPlan::Tail { .. } | StartPlan::ResumeScan, Some(r)) = (&plan, &stored) {
            refuse_source_behind(link, r.watermark).await?;
        }
        link.note_excluded_in_target().await?;
        match (plan, stored) {
            (StartPlan::Tail { watermark }, Some(r)) => {
                let next = resumed(link, &r);
                claim(link, observed, next).await?;
                link.engine.update(|s| {
                    s.watermark = watermark;
                    s.initial_sync.completed.get_or_insert_with(now_rfc3339);
                    s.set_condition(ConditionType::InitialSyncComplete, true, Reason::Resumed, "");
                });
                let watch = link.open_watch(watermark + 1).await?;
                Ok(Step::Tail(Tail::new(None), Box::new(watch), Default::default()))
            }
            (StartPlan::ResumeScan, Some(r)) => {
                let next = resumed(link, &r);
                claim(link, observed, next).await?;
                // The count says how many keys the earlier runs copied, once it answers.
                let counting = Genesis::count(link, r.watermark, &r.scan_cursor);
                link.engine.update(|s| {
                    s.initial_sync.total_keys = 0;
                    s.initial_sync.keys = 0;
                });
                Ok(Step::Genesis(Genesis::new(r.watermark, r.scan_cursor.clone(), r.prune_pending, counting)))
            }
            (StartPlan::TailFromStartRevision { start }, _) => {
                // The operator says the target already holds the source's state just before
                // `start_revision` (restored from a snapshot, say): tail from it, scan nothing.
                warn!(
                    start,
                    "initial_sync.start_revision: tailing from it with no scan; the target must already hold the source's state at {}",
                    start - 1
                );
                claim(link, observed, link.template(start - 1)).await?;
                link.engine.update(|s| {
                    s.initial_sync.completed.get_or_insert_with(now_rfc3339);
                    s.set_condition(
                        ConditionType::InitialSyncComplete,
                        true,
                        Reason::StartRevision,
                        format!("tailing from {start}, no scan"),
                    );
                });
                let watch = link.open_watch(start).await?;
                Ok(Step::Tail(Tail::new(None), Box::new(watch), Default::default()))
            }
            (StartPlan::FreshGenesis { require_empty: empty_first, prune, forced }, _) => {
                if let Some(reason) = forced {
                    let why = match reason {
                        Reason::ClusterChanged => "stored cluster ids differ from the connected clusters (a side was rebuilt or restored)",
                        _ => "the mirrored range changed since the checkpoint was written",
                    };
                    warn!(
                        reason = reason.as_str(),
                        require_empty = empty_first,
                        "{why}; forced resync with prune"
                    );
                    link.engine.note_resync(reason, true);
                }
                if empty_first {
                    require_empty(link).await?;
                }
                // R0 from a read of one key; the range's count at R0 runs beside the scan.
                let r0 = link.source_revision().await?;
                let counting = Genesis::count(link, r0, &[]);
                let next = link.template(r0).scan_progress(r0, Vec::new(), prune);
                claim(link, observed, next).await?;
                link.engine.update(|s| {
                    s.initial_sync.total_keys = 0;
                    s.initial_sync.keys = 0;
                    s.lease_backed_keys = 0;
                    s.initial_sync.started = Some(now_rfc3339());
                    s.initial_sync.completed = None;
                    s.watermark = r0;
                    s.set_condition(ConditionType::InitialSyncComplete, false, Reason::Scanning, "");
                });
                Ok(Step::Genesis(Genesis::new(r0, Vec::new(), prune, counting)))
            }
            (StartPlan::Tail { .. } | StartPlan::ResumeScan, None) => {
                unreachable!("resume plans need a record")
            }
        }
    }
}

/// Refuses a new link whose destination overlaps another link's, before its first write:
/// an outer link (a checkpoint at a proper prefix of our destination) that does not exclude
/// our destination, or an inner link (a reserved namespace inside our range) that we do not
/// exclude. The link that starts second is the one refused; a link already writing is
/// never stopped by a newcomer. Nested links stay possible: exclude the inner range from
/// the outer link (`sync.exclude_prefixes`), whichever starts first.
async fn refuse_overlaps(link: &mut Link<'_>) -> Result<(), EngineError> {
    let ours = link.engine.rewriter.dest_prefix().to_vec();
    let marker = mirror_core::RESERVED_MARKER.as_bytes();
    let timeout = link.timeout();
    for len in 0..ours.len() {
        let key = [&ours[..len], marker, b"checkpoint"].concat();
        let resp = match unary("overlap check", Side::Target, timeout, link.target_kv.get(key, None)).await {
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
            return Err(overlap(link, other, &ours[..len]));
        }
    }
    let page = link.page_options("overlap check").keys_only();
    let inner =
        mirror_reconcile::foreign_dest_prefixes(link.target_kv.clone(), &link.engine.rewriter, page).await?;
    let excluded = link.engine.rewriter.dest_excludes();
    let mine = DestRange { prefix: &ours, excludes: &excluded };
    for theirs in inner {
        if !mine.overlaps(&DestRange { prefix: &theirs, excludes: &[] }) {
            continue;
        }
        let key = [&theirs[..], marker, b"checkpoint"].concat();
        let resp = unary("overlap check", Side::Target, timeout, link.target_kv.get(key, None)).await?;
        let other = resp
            .kvs()
            .first()
            .and_then(|kv| Checkpoint::decode(kv.value()).ok())
            .map_or_else(|| "unknown".to_owned(), |r| r.link_uid);
        return Err(overlap(link, other, &theirs));
    }
    Ok(())
}

fn overlap(link: &Link<'_>, other: String, theirs: &[u8]) -> EngineError {
    let show = |p: &[u8]| String::from_utf8_lossy(p).escape_debug().to_string();
    let namespace = KeyRange::prefix(&[theirs, mirror_core::RESERVED_MARKER.as_bytes()].concat());
    Refusal::Overlap {
        other,
        theirs: show(theirs),
        ours: show(link.engine.rewriter.dest_prefix()),
        clear: mirror_core::delete_commands(&link.cfg().target.endpoints, &[namespace]).concat(),
    }
    .into()
}

/// Status takes the link's counts from a stored record where it knows less (a restarted
/// agent starts at 0); the records this run writes carry them on.
fn remember_counts(link: &Link<'_>, record: &Checkpoint) {
    link.engine.update(|s| {
        s.forced_resyncs.count = s.forced_resyncs.count.max(record.forced_resyncs);
        s.scan_restarts = s.scan_restarts.max(record.scan_restarts);
        // While a scan runs the last completion is history, not this sync's.
        if s.initial_sync.completed.is_none() && !record.initial_sync_completed.is_empty() && !record.scanning
        {
            s.initial_sync.completed = Some(record.initial_sync_completed.clone());
        }
    });
}

async fn claim(link: &mut Link<'_>, observed: Observed, next: Checkpoint) -> Result<(), EngineError> {
    let sent = tokio::time::Instant::now();
    let writer = FencedWriter::claim(
        link.target_kv.clone(),
        link.cfg().checkpoint_key(),
        observed,
        next,
        link.timeout(),
    )
    .await?
    .with_max_txn_ops(link.cfg().sync.max_txn_ops as usize);
    match link.engine.elected_at.take() {
        // Of a slow takeover, this says whether the claim's Txn or what came before it (the
        // probe, the dials, the checkpoint read) took the time.
        Some(at) => info!(
            epoch = writer.record().epoch,
            watermark = writer.record().watermark,
            fence_after_election_ms = at.elapsed().as_millis() as u64,
            claim_txn_ms = sent.elapsed().as_millis() as u64,
            "holding the fence"
        ),
        None => {
            info!(epoch = writer.record().epoch, watermark = writer.record().watermark, "holding the fence")
        }
    }
    let watermark = writer.record().watermark;
    let confirmed = Some(writer.record().confirmed_time.clone()).filter(|t| !t.is_empty());
    link.engine.update(|s| {
        s.watermark = watermark;
        s.confirmed_time = confirmed;
        s.set_condition(ConditionType::Fenced, false, Reason::HoldingFence, "");
    });
    let sync = link.cfg().sync.clone();
    link.applier = Some(Applier::new(writer, sync, link.engine.throttle, link.engine.shutdown.clone()));
    // Only the fence holder keeps leases: what the link holds is found now and kept alive
    // from now on; any that ran out meanwhile are granted again and their keys owed.
    let record = link.writer().record().clone();
    let (windows, target_windows) =
        (link.engine.rewriter.scan_windows(), link.engine.rewriter.target_windows());
    let watermarks = link.writer().watermarks();
    link.engine.repair_owed |= link.leases.claim(&record, &windows, target_windows, watermarks).await?;
    Ok(())
}

/// SPEC §6 "source went back": a source below the watermark (same cluster id, restored
/// from an older snapshot) would be watched from a future revision, which etcd accepts
/// without a word, and its new history under revisions already applied would be skipped.
/// Checked at every connect, before the watch opens. A linearizable read answers at or
/// above every revision the source ever delivered, so a healthy source never trips it.
async fn refuse_source_behind(link: &mut Link<'_>, watermark: i64) -> Result<(), EngineError> {
    let source_revision = link.source_revision().await?;
    if source_revision < watermark {
        return Err(Refusal::SourceWentBack { watermark, source_revision }.into());
    }
    Ok(())
}

async fn require_empty(link: &mut Link<'_>) -> Result<(), EngineError> {
    let windows = link.engine.rewriter.target_windows();
    let timeout = link.timeout();
    let (n, _) = count(&mut link.target_kv, &windows, None, Side::Target, timeout).await?;
    if n > 0 {
        // With nothing in the reserved namespace (no link's checkpoint), deleting the whole
        // prefix deletes exactly the same keys, in one readable `etcdctl del --prefix`.
        let reserved = KeyRange::prefix(&link.engine.rewriter.reserved_prefix());
        let (held, _) = count(&mut link.target_kv, &[reserved], None, Side::Target, timeout).await?;
        let clear = if held == 0 { &[link.engine.rewriter.target_range()][..] } else { &windows[..] };
        let clear = mirror_core::delete_commands(&link.cfg().target.endpoints, clear);
        return Err(Refusal::EmptyTarget { keys: n, clear }.into());
    }
    Ok(())
}
