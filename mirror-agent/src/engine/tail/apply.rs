//! How the [`Tail`] commits batches of whole revisions through the fence, with retries by error
//! class.

use etcd_client::GetOptions;
use mirror_core::{now_rfc3339, unary, ConditionType, EtcdError, Fault, Reason, Side};
use mirror_fence::{Checkpoint, FenceError};
use mirror_watch::{Batch, Op, Revision, RevisionBatcher};
use tracing::{info, warn};

use super::Tail;
use crate::engine::link::Link;
use crate::engine::{Engine, EngineError, Progress, Refusal};

/// The largest batch sent behind Txns in flight: far under etcd's default request limit (1.5
/// MiB), so one is never refused as too large, which only the serial path can mend.
const OVERLAP_BYTES: usize = 512 << 10;

impl Tail {
    /// Packs whole revisions into batches (flushing at the end: the end of a watch response or
    /// of the replay) and commits each.
    pub(in crate::engine) async fn apply_revisions(
        &mut self,
        link: &mut Link<'_>,
        revisions: impl IntoIterator<Item = Revision>,
    ) -> Result<(), EngineError> {
        // Merged batches may hold several nested Txns' worth of ops (the writer lays them out).
        let mut batcher = RevisionBatcher::new(
            link.txn_ops_per_level() * mirror_fence::NESTED_TXNS,
            link.cfg().sync.txn_flush_bytes.bytes() as usize,
        );
        for rev in revisions {
            if let Some(b) = batcher.push(rev) {
                self.apply(link, b).await?;
            }
        }
        if let Some(b) = batcher.take() {
            self.apply(link, b).await?;
        }
        Ok(())
    }

    /// Moves the watermark to `revision` with a checkpoint-only Txn: the range is proven the
    /// same there (a trusted progress notification, the idle proof, a settled comparison).
    pub(super) async fn advance_to(&mut self, link: &mut Link<'_>, revision: i64) -> Result<(), EngineError> {
        self.apply(link, Batch { revisions: vec![Revision { revision, ops: Vec::new() }] }).await
    }

    /// A merged batch that cannot land as one Txn (`why`), applied one revision at a time.
    async fn apply_one_by_one(
        &mut self,
        link: &mut Link<'_>,
        batch: Batch,
        ops: usize,
        why: &str,
    ) -> Result<(), EngineError> {
        warn!(revisions = batch.revisions.len(), ops, "{why}; retrying one revision at a time");
        for one in batch.split() {
            Box::pin(self.apply(link, one)).await?;
        }
        Ok(())
    }

    /// Commits one batch with its checkpoint; splits it when the target finds it too big.
    pub(super) async fn apply(&mut self, link: &mut Link<'_>, batch: Batch) -> Result<(), EngineError> {
        if self.overlaps(link, &batch) {
            return self.send(link, batch).await;
        }
        // Everything else moves on from the record the fence holds with nothing in flight.
        link.drain().await?;
        let last = batch.last_revision();
        let ops: Vec<Op> = batch.ops().cloned().collect();
        let next = self.record_after(link.writer().record(), last);
        let (ops, guards) = resolve_runs(link, ops, last).await?;
        if batch.revisions.len() > 1 && !link.applier().0.holds(ops.len()) {
            // Merged for a higher per-level limit than the target turned out to allow: no
            // layout holds them together, each revision may still fit alone.
            let why = "no layout at the target's ops per level holds the merged Txn";
            return self.apply_one_by_one(link, batch, ops.len(), why).await;
        }
        let mut n = ops.len() as u64;
        let (applier, mut hooks) = link.applier();
        match applier.try_commit(&ops, next.clone(), guards.clone(), &mut hooks).await? {
            Ok(()) => {}
            Err(e) => {
                if batch.revisions.len() > 1 {
                    let why = "target refused a merged Txn as too big";
                    return self.apply_one_by_one(link, batch, ops.len(), why).await;
                }
                let (applier, _) = link.applier();
                if applier.may_nest_deeper(&e) {
                    // The target allows fewer ops per level than configured: lay the Txn out
                    // deeper rather than give up a revision that fits its byte limit.
                    applier.nest_deeper();
                    return Box::pin(self.apply(link, batch)).await;
                }
                let mut landed = match e.fault {
                    Fault::RequestTooLarge => {
                        commit_coalesced(link, &ops, next.clone(), last, &guards).await?
                    }
                    _ => None,
                };
                if landed.is_none() && e.fault == Fault::RequestTooLarge {
                    let (applier, mut hooks) = link.applier();
                    let alone = applier.commit_data_then_checkpoint(&ops, next, guards, &mut hooks).await?;
                    landed = alone.then_some(ops.len());
                }
                let Some(landed) = landed else {
                    let biggest = ops.iter().max_by_key(|op| op.size());
                    let bytes = ops.iter().map(Op::size).sum();
                    return Err(Refusal::RevisionTooLarge {
                        revision: last,
                        ops: ops.len(),
                        bytes,
                        first_key: biggest
                            .map(|op| link.engine.rewriter.redact(op.key()))
                            .unwrap_or_default(),
                        biggest: biggest.map_or(0, Op::size),
                        fault: e.said(),
                        remedy: format!(
                            "Raise the target's --max-request-bytes above {bytes} (etcd's default is 1.5 MiB)"
                        ),
                    }
                    .into());
                };
                n = landed as u64;
            }
        }
        link.engine.reporter.revisions_landed(batch.revisions.len());
        link.engine.note_applied(self.scan_end.is_some(), last, n);
        if self.scan_end.is_some_and(|end| last >= end) {
            self.finish_genesis_if_due(link, last).await?;
        }
        Ok(())
    }

    /// Whether `batch` goes out behind the Txns in flight (`sync.txns_in_flight` > 1): a plain
    /// batch of the synced tail. The initial sync, a drain, a paced target, range deletes and a
    /// batch near the request limit wait for the Txns in flight and take the serial path, which
    /// splits and retries as it needs.
    fn overlaps(&self, link: &Link<'_>, batch: &Batch) -> bool {
        let sync = &link.cfg().sync;
        let Some(applier) = link.applier.as_ref() else { return false };
        let ops = batch.ops().count();
        applier.overlaps()
            && self.scan_end.is_none()
            && link.cfg().mode != mirror_core::Mode::Drain
            && sync.max_ops_per_second == 0
            && ops > 0
            && applier.holds(ops)
            && batch.ops().map(Op::size).sum::<usize>() <= OVERLAP_BYTES
            && !batch.ops().any(|op| matches!(op, Op::DeleteRun { .. }))
    }

    /// Sends `batch` behind the Txns in flight ([`mirror_fence::Applier::send`]); its landing is
    /// counted when it comes ([`super::super::commit::Hooks`]).
    async fn send(&mut self, link: &mut Link<'_>, batch: Batch) -> Result<(), EngineError> {
        let last = batch.last_revision();
        let ops: Vec<Op> = batch.ops().cloned().collect();
        let (applier, mut hooks) = link.applier();
        let next = self.record_after(applier.latest(), last);
        applier.send(&ops, next, batch.revisions.len(), &mut hooks).await
    }

    /// The record a batch ending at source revision `last` moves the fence to from `base`: the
    /// watermark, the end of the initial sync (the record keeps when: status reads it back),
    /// and `confirmed_time` when the source was last seen at or below `last`.
    fn record_after(&self, base: &Checkpoint, last: i64) -> Checkpoint {
        let mut next = base.applied_to(last, self.scan_end);
        if base.scanning && !next.scanning {
            next.initial_sync_completed = now_rfc3339();
        }
        match self.confirmer.confirmed_by(last, self.scan_end) {
            Some(time) => next.confirmed_at(time),
            None => next,
        }
    }
}

/// Every [`Op::DeleteRun`] of `ops` as a range delete, with the compare that holds the
/// commit to what was checked; other ops pass through. A run is a stretch of one revision's
/// deletes whose keys between its ends were not kept (mirror-watch's `Fragments` bounds
/// what a revision of many deletes holds, issue #27). It becomes `[first, last]` deleted
/// when the target holds exactly `count` keys there (the run's own: G3) and the revision
/// puts none there, checked at one target revision T, and the commit requires that no key
/// of the range changed after T. Otherwise the deletes interleave with keys that stay (a
/// lease revoke of scattered keys too large to hold key by key): `RevisionTooLarge`,
/// nothing applied.
async fn resolve_runs(
    link: &mut Link<'_>,
    ops: Vec<Op>,
    revision: i64,
) -> Result<(Vec<Op>, Vec<etcd_client::Compare>), EngineError> {
    if !ops.iter().any(|op| matches!(op, Op::DeleteRun { .. })) {
        return Ok((ops, Vec::new()));
    }
    let puts: Vec<Vec<u8>> =
        ops.iter().filter(|op| matches!(op, Op::Put { .. })).map(|op| op.key().to_vec()).collect();
    let (mut out, mut guards) = (Vec::with_capacity(ops.len()), Vec::new());
    let total = ops.len();
    // A single delete's size, as the run's deletes would be held one by one.
    let delete_size = |key: &[u8]| key.len() + Op::Delete { key: Vec::new() }.size();
    // The revision's bytes as individual ops, a run's deletes estimated from its first key.
    let unfolded: usize = ops
        .iter()
        .map(|op| match op {
            Op::DeleteRun { key, count, .. } => *count as usize * delete_size(key),
            op => op.size(),
        })
        .sum();
    for op in ops {
        let Op::DeleteRun { key, last, count } = op else {
            out.push(op);
            continue;
        };
        let end = mirror_core::key_after(&last);
        let resp = unary(
            "count delete run",
            Side::Target,
            link.timeout(),
            link.target_kv
                .get(key.clone(), Some(GetOptions::new().with_range(end.clone()).with_count_only())),
        )
        .await?;
        let held = resp.count().max(0) as u64;
        let head = resp.header().map_or(0, |h| h.revision());
        let put_inside = puts.iter().any(|p| *p >= key && *p <= last);
        if held != count || put_inside {
            let hold = link.held_revision_bytes();
            return Err(Refusal::RevisionTooLarge {
                revision,
                ops: total,
                bytes: unfolded,
                first_key: link.engine.rewriter.redact(&key),
                biggest: delete_size(&key),
                fault: format!(
                    "{count} of its deletes lie between {} and {}, where the target holds {held} keys{}: they \
                     interleave with keys that stay, too many to hold key by key",
                    link.engine.rewriter.redact(&key),
                    link.engine.rewriter.redact(&last),
                    if put_inside { " and the revision puts some" } else { "" }
                ),
                remedy: format!(
                    "The agent holds a revision key by key up to an eighth of sync.watch_buffer_bytes ({hold} \
                     bytes now): raise sync.watch_buffer_bytes to at least {} bytes, and the target's \
                     --max-request-bytes above {unfolded} (etcd's default is 1.5 MiB), which must take its deletes \
                     in one Txn",
                    unfolded.saturating_mul(8)
                ),
            }
            .into());
        }
        guards.push(
            etcd_client::Compare::mod_revision(key.clone(), etcd_client::CompareOp::Less, head + 1)
                .with_range(end.clone()),
        );
        out.push(Op::DeleteRange { key, end });
    }
    info!(revision, runs = guards.len(), "deletes of a large revision applied as checked range deletes");
    Ok((out, guards))
}

/// Commits a revision too large for one request with its runs of deletes coalesced into
/// range deletes ([`coalesce_deletes`]); the ops landed, or `None` when nothing could
/// be coalesced or the result is still too large. Each range delete is guarded by "no key
/// of the span changed since it was read": a key another writer (another link, an operator)
/// creates inside a run between the read and the commit fails the guard instead of being
/// deleted, and the span is read again.
async fn commit_coalesced(
    link: &mut Link<'_>,
    ops: &[Op],
    next: Checkpoint,
    revision: i64,
    guards: &[etcd_client::Compare],
) -> Result<Option<usize>, EngineError> {
    const TRIES: u32 = 5;
    for _ in 0..TRIES {
        let Some((coalesced, guard)) = coalesce_deletes(link, ops).await? else { return Ok(None) };
        info!(
            revision,
            ops = ops.len(),
            now = coalesced.len(),
            "revision over the target's request limit: runs of deletes coalesced into range deletes"
        );
        let all = guards.iter().cloned().chain([guard]).collect();
        let (applier, mut hooks) = link.applier();
        match applier.commit_guarded(&coalesced, next.clone(), all, &mut hooks).await {
            Ok(()) => return Ok(Some(coalesced.len())),
            Err(EngineError::Fence(FenceError::GuardFailed)) => {
                warn!(revision, "a key appeared inside a coalesced delete range; reading the range again");
            }
            Err(EngineError::Etcd(e)) if e.fault.is_txn_too_big() => return Ok(None),
            Err(e) => return Err(e),
        }
    }
    // The range keeps changing under another writer: reconnect and resume from the
    // watermark (nothing of this revision landed).
    Err(FenceError::GuardFailed.into())
}

/// A revision's ops with runs of deleted keys replaced by range deletes
/// ([`mirror_watch::Coalescer`]: a run is adjacent *in the target*), or `None` when that
/// saved nothing. The target's keys over the deletes' span are read at one revision, and
/// the compare that comes with the ops holds the commit to it ("no key of the span has a
/// mod revision after it").
async fn coalesce_deletes(
    link: &mut Link<'_>,
    ops: &[Op],
) -> Result<Option<(Vec<Op>, etcd_client::Compare)>, EngineError> {
    let Some(mut coalescer) = mirror_watch::Coalescer::new(ops) else { return Ok(None) };
    let span = coalescer.span();
    // One snapshot: the target's revision now, every page read at it.
    let head = unary(
        "coalesce revision",
        Side::Target,
        link.timeout(),
        link.target_kv.get(span.start.clone(), Some(GetOptions::new().with_count_only())),
    )
    .await?
    .header()
    .map_or(0, |h| h.revision());
    let guard =
        etcd_client::Compare::mod_revision(span.start.clone(), etcd_client::CompareOp::Less, head + 1)
            .with_range(span.end.clone());
    let page = link.page_options("coalesce page").keys_only().at_revision(head);
    let mut target =
        mirror_reconcile::RangeReader::new(link.target_kv.clone(), Side::Target, vec![span], page);
    while let Some(kv) = target.next().await? {
        coalescer.target_key(kv.key());
    }
    if let Some(key) = failpoint::foreign_put_after_coalesce_read() {
        link.target_kv
            .put(key, "foreign", None)
            .await
            .map_err(|e| EtcdError::new("failpoint put", Side::Target, e))?;
    }
    Ok(coalescer.finish().map(|out| (out, guard)))
}

/// Test hooks, armed only with the `failpoints` feature (`mirror_core::failpoint`).
mod failpoint {
    /// `MIRROR_FAILPOINT_FOREIGN_PUT_AFTER_COALESCE_READ=KEY`: once per process, right after
    /// the target was read for coalescing deletes, put KEY into the target as another writer
    /// would (the race the range delete's guard exists for).
    pub(super) fn foreign_put_after_coalesce_read() -> Option<String> {
        use std::sync::atomic::{AtomicBool, Ordering};
        static FIRED: AtomicBool = AtomicBool::new(false);
        let key = mirror_core::failpoint::armed("FOREIGN_PUT_AFTER_COALESCE_READ")?;
        (!FIRED.swap(true, Ordering::Relaxed)).then_some(key)
    }
}

impl Engine {
    /// A batch of `ops` ops landed, up to source revision `last`; `in_genesis`: a replay of
    /// the initial sync or a resync. Only a live tail apply ends a resync loop: replays inside
    /// a resync are part of it (defect #5 of issue 10: the condition flapped during a livelock).
    pub(in crate::engine) fn note_applied(&mut self, in_genesis: bool, last: i64, ops: u64) {
        let live = ends_resync_loop(in_genesis, ops);
        if live {
            self.resyncs_in_a_row = 0;
            self.made_progress(Progress::Live);
        }
        self.update(|s| {
            s.watermark = last;
            s.keys_applied_total += ops;
            s.last_progress_time = Some(now_rfc3339());
            if live && s.condition(ConditionType::ResyncLoopDetected) {
                s.set_condition(ConditionType::ResyncLoopDetected, false, Reason::LiveApply, "");
            }
        });
    }
}

/// Whether an applied batch ends a resync loop: only a live tail apply with data does. Replays
/// inside a genesis are part of the loop (a resync that replays and then resyncs again is still
/// a livelock), so they must not clear `ResyncLoopDetected`.
fn ends_resync_loop(in_genesis: bool, ops: u64) -> bool {
    !in_genesis && ops > 0
}

#[cfg(test)]
mod tests {
    use super::ends_resync_loop;

    /// Defect #5 of issue 10: the latch was cleared by any apply with data, including the
    /// replay of a genesis inside the loop, so it flapped during a livelock.
    #[test]
    fn only_a_live_apply_ends_a_resync_loop() {
        assert!(!ends_resync_loop(true, 10), "a replay inside a genesis is part of the loop");
        assert!(!ends_resync_loop(false, 0), "a progress-only commit is no evidence");
        assert!(ends_resync_loop(false, 1));
    }
}
