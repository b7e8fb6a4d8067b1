//! Genesis (SPEC §5 steps 4-7): the buffered watch, the pipelined scan and its writes.

use futures::stream::FuturesUnordered;
use futures::StreamExt as _;
use std::time::Duration;

use etcd_client::KvClient;
use mirror_core::{windows_after, ErrorClass, EtcdError, KeyRange, Phase, Side};
use mirror_scan::{count, ChunkCutter, ChunkedScan, ScanChunk, Scanner, Span};
use mirror_watch::Buffered;
use tokio::task::JoinError;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;
use tracing::{info, warn};

use super::link::{Link, Step};
use super::tail::Tail;
use super::{
    EngineError, Restart, ResyncCause, SCAN_READ_AHEAD, SCAN_SPAN_BYTES, SCAN_SPAN_TIME, SCAN_SPAN_TXNS,
    SCAN_TXNS_IN_FLIGHT,
};

/// A take of the genesis replay at most this long ends it: the forwarder stops and the rest
/// is applied with the watch unread for one short write.
const REPLAY_TAIL_REVISIONS: usize = 64;

/// Genesis (SPEC §5 steps 4-7), from a claimed `{scanning: true, watermark: r0}`: the scan
/// resumes after `cursor`, and with `prune` a sweep follows it.
pub(super) struct Genesis {
    r0: i64,
    cursor: Vec<u8>,
    prune: bool,
    /// The count of the range at R0 for `initial_sync.total_keys`, beside the scan.
    counting: Option<Counting>,
}

impl Genesis {
    pub(super) fn new(r0: i64, cursor: Vec<u8>, prune: bool, counting: Counting) -> Genesis {
        Genesis { r0, cursor, prune, counting: Some(counting) }
    }

    /// Steps 4-7 of SPEC §5; hands back the tail, which replays what the scan left to
    /// `scan_end` and then follows the source.
    pub(super) async fn run(mut self, link: &mut Link<'_>) -> Result<Step, EngineError> {
        let (r0, prune) = (self.r0, self.prune);
        link.engine.set_phase(Phase::InitialSync);
        let watch = match link.open_watch(r0 + 1).await {
            Ok(w) => w,
            Err(EngineError::Etcd(e)) if e.class() == ErrorClass::Resync => {
                return Err(EngineError::Resync(ResyncCause::CompactedDuringScan))
            }
            Err(e) => return Err(e),
        };
        // Buffer the watch while scanning, and through the prune sweep after it: a sweep that
        // left the watch unread let etcd compact past it (issue #20 defect 3).
        // The watch opens first: the foreign-link check reads the whole destination range, and
        // a compaction during it used to cancel a watch opened afterwards at R0 + 1.
        let limit = link.cfg().sync.watch_buffer_bytes.bytes() as usize;
        link.buffering.start(watch, r0, limit);
        let mut pass = Ok(());
        if prune && link.prunes_everything() {
            // Before the first data write, not only before the sweep.
            pass = link.refuse_foreign_links().await;
        }
        if pass.is_ok() {
            pass = self.scan(link).await;
        }
        let scanned = pass.is_ok() && !link.buffering.ended();
        if scanned && prune {
            // Prune owed: sweep target keys whose source no longer has them.
            pass = link.sweep(r0).await;
        }
        if pass.is_err() || link.buffering.ended() {
            // A full buffer or a compacted watch before the scan and sweep were done: said
            // by `Buffering::stop` (genesis restarts). A forwarder that ended by itself always
            // says why; were it ever to end quietly, the watch is gone all the same.
            let buffered = link.buffering.stop().await;
            pass?;
            return match buffered.err() {
                Some(EngineError::RestartGenesis(Restart::WatchBufferOverflow)) if scanned => {
                    rewatch_after_sweep(link, r0).await
                }
                e => Err(e.unwrap_or(EngineError::RestartGenesis(Restart::WatchEndedDuringScan))),
            };
        }
        let scan_end = link.source_revision().await?;
        let mut tail = Tail::new(Some(scan_end));
        let replayed = replay_buffered(&mut tail, link).await;
        let buffered = link.buffering.stop().await;
        let replayed = replayed?;
        let (watch, rest) = match buffered {
            Ok(buffered) => buffered,
            // The buffer filled while the backlog was written (a slow target): what was taken
            // has landed in order, so the tail watches again from the watermark, as after a
            // reconcile pass. Genesis restarts only for a compaction.
            Err(EngineError::RestartGenesis(Restart::WatchBufferOverflow)) => {
                let from = link.writer().record().watermark + 1;
                warn!(
                    from,
                    "the watch buffer filled during the genesis replay; re-watching from the watermark"
                );
                (link.open_watch(from).await?, Buffered::default())
            }
            Err(e) => return Err(e),
        };
        info!(r0, scan_end, replayed, buffered = rest.len(), "scan done; replaying to scan_end");
        // Where the replay already reached scan_end, the rest is the live tail's.
        Ok(Step::Tail(tail, Box::new(watch), rest))
    }
}

/// The buffer filled during the prune sweep, after a whole scan: the sweep went on to its
/// end ([`Link::sweep`]), and the tail now watches again from R0 + 1, as the buffered watch
/// would have delivered it, and replays to the source's revision now. SPEC §5 restarts
/// genesis for an overflow while scanning; after the scan a restart only scanned the
/// whole range again and began the sweep again, which on a busy source overflowed again
/// (scenario `sweep-outlasts-buffer`: 7 restarts before). Only a source that compacted
/// past R0 meanwhile restarts genesis.
async fn rewatch_after_sweep(link: &mut Link<'_>, r0: i64) -> Result<Step, EngineError> {
    warn!(
        from = r0 + 1,
        "the watch buffer filled during the prune sweep; the sweep went on, re-watching from R0 + 1"
    );
    let watch = match link.open_watch(r0 + 1).await {
        Ok(w) => w,
        Err(EngineError::Etcd(e)) if e.class() == ErrorClass::Resync => {
            return Err(EngineError::RestartGenesis(Restart::CompactedDuringScan))
        }
        Err(e) => return Err(e),
    };
    let scan_end = link.source_revision().await?;
    info!(r0, scan_end, "scan and sweep done; replaying to scan_end");
    Ok(Step::Tail(Tail::new(Some(scan_end)), Box::new(watch), Buffered::default()))
}

/// Applies the revisions buffered during the scan and sweep while the forwarder goes on
/// reading the watch: a backlog of a minute at 1 000 writes/s takes seconds to write, and
/// a watch left unread that long on a busy source is one etcd compacts past (sweep-under-load
/// with 4 096-key pages: one forced `WatchCompacted` resync in three runs). Takes until a
/// take finds at most [`REPLAY_TAIL_REVISIONS`] (the rest is applied after the forwarder
/// stops) or the forwarder ends; returns how many revisions it applied.
async fn replay_buffered(tail: &mut Tail, link: &mut Link<'_>) -> Result<usize, EngineError> {
    let mut replayed = 0;
    loop {
        let taken = link.buffering.take().await;
        let n = taken.len();
        tail.apply_revisions(link, taken).await?;
        replayed += n;
        if n <= REPLAY_TAIL_REVISIONS {
            return Ok(replayed);
        }
    }
}

impl Genesis {
    /// Step 5: the scan, pipelined (SPEC §9's hint).
    ///
    /// A reader task ([`ChunkedScan`]) fetches pages and cuts them into Txn-sized chunks of
    /// [`mirror_fence::nested_txn_capacity`] puts, each with the source key it ends at, up to
    /// [`SCAN_READ_AHEAD`] chunks ahead of the writer. Chunks are written in *spans*
    /// ([`Span`]): every chunk of a span but the last goes out as it comes, as a data-only Txn
    /// carrying just the fence compare, up to [`SCAN_TXNS_IN_FLIGHT`] at once. They all compare
    /// the same mod revision, so they never conflict with each other, and scan keys are disjoint
    /// and idempotent, so their order does not matter. Only when all of them have landed does
    /// the last chunk go out together with the checkpoint put that advances `scan_cursor` to its
    /// last key: every key up to the cursor has landed. That put moves the mod revision, so it
    /// is the one point where the writes wait; a span of [`SCAN_SPAN_TXNS`] makes it rare, and
    /// memory holds only the Txns in flight, the read-ahead and the held chunk, however long
    /// the span. A span also ends after [`SCAN_SPAN_TIME`], so a paced or slow scan still moves
    /// its cursor; its progress moves as each Txn lands and its leases' keep-alives go out on the
    /// lease keeper's task, neither waiting for a span end. The fence holds: a takeover moves
    /// the mod revision and every stale Txn fails; a chunk that failed is redone through the
    /// fenced, judged commit path.
    async fn scan(&mut self, link: &mut Link<'_>) -> Result<(), EngineError> {
        let (r0, prune, cursor) = (self.r0, self.prune, std::mem::take(&mut self.cursor));
        let cfg = link.engine.cfg.sync.clone();
        let scanner = Scanner::new(
            link.source.kv_client(),
            &link.engine.rewriter,
            cfg.page_key_limit,
            cfg.page_bytes.bytes() as usize,
            cfg.request_timeout.get(),
        )
        .resume_after(&cursor);
        let cutter = ChunkCutter::new(link.chunker(), link.engine.rewriter.clone(), r0);
        let mut chunks = ChunkedScan::start(scanner, cutter, SCAN_READ_AHEAD);
        let mut span = Span::default();
        let mut writes = SpanWrites::default();
        let mut data = link.writer().data_writer();
        let mut opened = Instant::now();
        loop {
            // In this order, the next chunk last: the read-ahead is nearly always ready, and an
            // unbiased `select!` (a random first branch, the first ready one taken) left pushed
            // Txns unsent and landed ones uncounted for several chunks (each paced, in a
            // rate-limited scan: the resumed-scan test saw no progress before a span end).
            let chunk = tokio::select! {
                biased;
                Some((chunk, landed)) = writes.in_flight.next(), if !writes.in_flight.is_empty() => {
                    data_txn_ended(link, &mut writes, chunk, landed);
                    continue;
                }
                _ = link.engine.shutdown.cancelled() => return Err(EngineError::Shutdown),
                // Applied between chunks: a rate at once; a pause or new connection settings
                // stop the scan, which resumes after its cursor.
                _ = super::waits::reload_changed(&mut link.engine.reload) => {
                    link.engine.apply_reload()?;
                    link.reconfigure();
                    continue;
                }
                counted = super::waits::join_some(&mut self.counting) => {
                    self.counted(link, counted)?;
                    continue;
                }
                chunk = chunks.next(), if writes.in_flight.len() < SCAN_TXNS_IN_FLIGHT => chunk,
            };
            let Some(chunk) = chunk else { break };
            let chunk = chunk?;
            if link.buffering.ended() {
                // It stops early only on overflow or a compacted watch: said by
                // `Buffering::stop`.
                return Ok(());
            }
            link.applier.as_ref().expect("fence claimed").pace(chunk.ops.len()).await?;
            if let Some(chunk) = span.push(chunk) {
                let (txn, data) = (link.leases.txn_ops(&chunk.ops).await?, data.clone());
                writes.in_flight.push(Box::pin(async move {
                    let landed = data.commit(txn).await;
                    (chunk, landed)
                }));
            }
            if span.is_full(SCAN_SPAN_TXNS, SCAN_SPAN_BYTES) || opened.elapsed() >= SCAN_SPAN_TIME {
                end_span(link, &mut span, &mut writes, r0, prune).await?;
                data = link.writer().data_writer();
                opened = Instant::now();
            }
        }
        end_span(link, &mut span, &mut writes, r0, prune).await?;
        if let Some(counting) = self.counting.as_mut() {
            let counted = counting.await;
            self.counted(link, counted)?;
        }
        // `total_keys` was a count of the scan windows at R0, which cannot leave out another
        // link's reserved keys there (a chain: an upstream link's checkpoint under our source
        // prefix); the scan skipped them, so the total does too now.
        let uncounted = chunks.finish().await;
        link.engine
            .update(|s| s.initial_sync.total_keys = s.initial_sync.total_keys.saturating_sub(uncounted));
        Ok(())
    }
}

/// Ends a span: waits for its data-only Txns, redoes those that failed, then commits the
/// held chunk with the checkpoint that moves `scan_cursor` to its last key.
async fn end_span(
    link: &mut Link<'_>,
    span: &mut Span,
    writes: &mut SpanWrites,
    r0: i64,
    prune: bool,
) -> Result<(), EngineError> {
    let Some(last) = span.close() else { return Ok(()) };
    while let Some((chunk, landed)) = writes.in_flight.next().await {
        data_txn_ended(link, writes, chunk, landed);
    }
    for chunk in std::mem::take(&mut writes.failed) {
        // Redo through the judged path: a moved fence surfaces as a FenceError there.
        link.commit_keep(&chunk.ops).await?;
        scanned(link, &chunk);
    }
    let next = link.writer().record().scan_progress(r0, last.cursor.clone(), prune);
    link.commit_independent(&last.ops, next).await?;
    scanned(link, &last);
    Ok(())
}

/// A data-only Txn answered: a chunk that landed counts, one that failed is kept for the
/// span end to redo.
fn data_txn_ended(link: &Link<'_>, writes: &mut SpanWrites, chunk: ScanChunk, landed: bool) {
    if landed {
        scanned(link, &chunk);
    } else {
        writes.failed.push(chunk);
    }
}

/// Takes a chunk that landed into `initial_sync.keys` as it lands, not at its span's end:
/// the progress figure moves with every Txn, however long a span runs.
fn scanned(link: &Link<'_>, chunk: &ScanChunk) {
    let keys = chunk.ops.len() as u64;
    link.engine.update(|s| {
        s.initial_sync.keys += keys;
        s.keys_applied_total += keys;
        s.lease_backed_keys += chunk.leased;
    });
}

/// The range's key count at R0, taken beside the scan: (keys in scope, those of them at or
/// before the cursor the scan resumed after).
pub(super) type Counting = AbortOnDropHandle<Result<(u64, u64), EtcdError>>;

impl Genesis {
    /// Counts the scan windows at `r0` for `initial_sync.total_keys` (SPEC §5 step 2) beside
    /// the scan: a count-only Get walks every key of the range in etcd's index (0.2 s at
    /// 1 000 000 keys, most of what the time to the fence was), and nothing the scan does waits
    /// for the total. A scan resumed after `cursor` also counts what is left after it, so
    /// `initial_sync.keys` starts from the keys an earlier run already copied and the two
    /// figures show the whole sync's progress, not only this run's. A source compacted past
    /// `r0` meanwhile is counted at its current revision instead (a progress figure; the
    /// scan's unpinned pages are not at `r0` either).
    pub(super) fn count(link: &Link<'_>, r0: i64, cursor: &[u8]) -> Counting {
        let mut kv = link.source.kv_client();
        let windows = link.engine.rewriter.scan_windows();
        let left = (!cursor.is_empty()).then(|| windows_after(&windows, cursor));
        let timeout = link.timeout();
        AbortOnDropHandle::new(tokio::spawn(async move {
            let mut at = Some(r0);
            loop {
                match count_both(&mut kv, &windows, left.as_deref(), at, timeout).await {
                    Err(e) if e.class() == ErrorClass::Resync && at.is_some() => at = None,
                    counted => return counted,
                }
            }
        }))
    }

    /// Takes the count into status. A count that failed fails the run as a failed scan read
    /// does (the next run resumes after the scan's cursor).
    fn counted(
        &mut self,
        link: &Link<'_>,
        counted: Result<Result<(u64, u64), EtcdError>, JoinError>,
    ) -> Result<(), EngineError> {
        self.counting = None;
        match counted {
            Ok(total) => {
                let (total, done) = total?;
                link.engine.update(|s| {
                    s.initial_sync.total_keys = total;
                    s.initial_sync.keys += done;
                });
            }
            // It never panics; were it ever to, the total stays unknown (0), nothing else.
            Err(e) => warn!(error = %e, "the count of the source range did not finish"),
        }
        Ok(())
    }
}

/// The keys of `windows` and, of those, the ones not in `left` (the part a resumed scan still
/// has to read; `None` for a scan from the start), both at `revision` (`None`: the latest).
async fn count_both(
    kv: &mut KvClient,
    windows: &[KeyRange],
    left: Option<&[KeyRange]>,
    revision: Option<i64>,
    timeout: Duration,
) -> Result<(u64, u64), EtcdError> {
    let (total, header) = count(kv, windows, revision, Side::Source, timeout).await?;
    let Some(left) = left else { return Ok((total, 0)) };
    // Pinned to the first count's revision, so the difference is of one snapshot.
    let (still_to_scan, _) = count(kv, left, Some(header), Side::Source, timeout).await?;
    Ok((total, total.saturating_sub(still_to_scan)))
}

/// A data-only scan Txn on its way: its chunk, and whether it landed.
type DataTxn = std::pin::Pin<Box<dyn std::future::Future<Output = (ScanChunk, bool)> + Send>>;

/// The data-only Txns of the open span: those in flight, and the chunks of those that failed.
#[derive(Default)]
struct SpanWrites {
    in_flight: FuturesUnordered<DataTxn>,
    failed: Vec<ScanChunk>,
}
