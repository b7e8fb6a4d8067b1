//! Genesis (SPEC §5 steps 4-7): the buffered watch, the pipelined scan and its writes.

use super::*;

impl Run<'_> {
    /// Steps 4-7 of SPEC §5 from a claimed `{scanning: true, watermark: r0}`.
    pub(super) async fn genesis(&mut self, r0: i64, cursor: Vec<u8>, prune: bool) -> Result<(), EngineError> {
        self.engine.set_phase(Phase::InitialSync);
        let watch = match self.open_watch(r0 + 1).await {
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
        self.start_buffering(watch, r0);
        let mut pass = Ok(());
        if prune && self.prunes_everything() {
            // Before the first data write, not only before the sweep.
            pass = self.refuse_foreign_links().await;
        }
        if pass.is_ok() {
            pass = self.scan(r0, cursor, prune).await;
        }
        if pass.is_ok() && prune && !self.buffering_ended() {
            // Prune owed: sweep target keys whose source no longer has them.
            pass = self.sweep(r0).await;
        }
        let buffered = self.stop_buffering().await;
        pass?;
        let (watch, replay) = buffered?;
        let scan_end = self.source_revision().await?;
        info!(r0, scan_end, buffered = replay.len(), "scan done; replaying to scan_end");
        self.tail(watch, Some((scan_end, replay))).await
    }

    /// Step 5: the scan, pipelined (SPEC §9's hint).
    ///
    /// A reader task fetches pages and cuts them into Txn-sized chunks of
    /// [`scan_chunk_ops`] puts (laid out as nested Txns by the writer; chunks span pages, so
    /// every Txn is full), each with the source key it ends at, up to a cycle ahead of the
    /// writer. Chunks are written in *cycles*: every chunk of a cycle but the last goes out as
    /// a data-only Txn carrying just the fence compare, up to [`SCAN_TXNS_IN_FLIGHT`] at once.
    /// They all compare the same mod revision, so they never conflict with each other, and scan
    /// keys are disjoint and idempotent, so their order does not matter. Only when all of them
    /// have landed does the last chunk go out together with the checkpoint put that advances
    /// `scan_cursor` to its last key: every key up to the cursor has landed. The fence holds: a
    /// takeover moves the mod revision and every stale Txn fails; a chunk that failed is redone
    /// through the fenced, judged commit path.
    pub(super) async fn scan(&mut self, r0: i64, cursor: Vec<u8>, prune: bool) -> Result<(), EngineError> {
        let cfg = self.engine.cfg.sync.clone();
        let scanner = Scanner::new(
            self.source.kv_client(),
            &self.engine.rewriter,
            cfg.page_key_limit,
            cfg.page_bytes.bytes() as usize,
            cfg.request_timeout.get(),
        )
        .resume_after(&cursor);
        let chunker = self.chunker();
        // One cycle ahead, so the next cycle is read while this one is written; bounded, so
        // memory stays about two cycles.
        let (tx, mut chunks) = tokio::sync::mpsc::channel(SCAN_CYCLE_TXNS);
        let reader = tokio::spawn(read_chunks(scanner, chunker, self.engine.rewriter.clone(), r0, tx));
        let result = async {
            let mut cycle = Cycle::default();
            loop {
                let chunk = tokio::select! {
                    chunk = chunks.recv() => chunk,
                    _ = self.engine.shutdown.cancelled() => return Err(EngineError::Shutdown),
                };
                let Some(chunk) = chunk else { break };
                let chunk = chunk?;
                if self.buffering_ended() {
                    // It stops early only on overflow or a compacted watch: said by
                    // `stop_buffering`.
                    return Ok(false);
                }
                cycle.push(chunk);
                if cycle.chunks.len() >= SCAN_CYCLE_TXNS || cycle.bytes >= SCAN_CYCLE_BYTES {
                    self.flush_scan_cycle(std::mem::take(&mut cycle), r0, prune).await?;
                }
            }
            if !cycle.chunks.is_empty() {
                self.flush_scan_cycle(cycle, r0, prune).await?;
            }
            Ok(true)
        }
        .await;
        // The channel closed: the reader is done, or returning now.
        if let Ok(true) = result {
            // `total_keys` was a count of the scan windows at R0, which cannot leave out another
            // link's reserved keys there (a chain: an upstream link's checkpoint under our
            // source prefix); the scan skipped them, so the total does too now.
            if let Ok(uncounted) = reader.await {
                self.engine.update(|s| {
                    s.initial_sync.total_keys = s.initial_sync.total_keys.saturating_sub(uncounted)
                });
            }
        } else {
            reader.abort();
        }
        result.map(|_| ())
    }

    /// Writes one scan cycle: concurrent data-only Txns, then the last chunk with the cursor.
    pub(super) async fn flush_scan_cycle(
        &mut self,
        cycle: Cycle,
        r0: i64,
        prune: bool,
    ) -> Result<(), EngineError> {
        let Cycle { mut chunks, leased, .. } = cycle;
        let Some(last) = chunks.pop() else { return Ok(()) };
        let keys = chunks.iter().map(|c| c.ops.len()).sum::<usize>() + last.ops.len();
        let data = self.writer().data_writer();
        let in_flight = chunks.into_iter().map(|chunk| {
            let data = data.clone();
            async move {
                let landed = data.commit(chunk.ops.iter().map(Op::to_txn_op).collect()).await;
                (chunk.ops, landed)
            }
        });
        let results: Vec<(Vec<Op>, bool)> =
            futures::stream::iter(in_flight).buffer_unordered(SCAN_TXNS_IN_FLIGHT).collect().await;
        self.pace(keys - last.ops.len()).await?;
        for (ops, landed) in results {
            if !landed {
                // Redo through the judged path: a moved fence surfaces as a FenceError there.
                let same = self.writer().record().clone();
                self.commit_independent(&ops, same).await?;
            }
        }
        let mut next = self.writer().record().clone();
        next.watermark = r0;
        next.scanning = true;
        next.prune_pending = prune;
        next.scan_cursor = last.cursor;
        self.commit_independent(&last.ops, next).await?;
        self.engine.update(|s| {
            s.initial_sync.keys += keys as u64;
            s.keys_applied_total += keys as u64;
            s.lease_backed_keys += leased;
        });
        Ok(())
    }
}

/// Puts in one scan Txn: [`mirror_fence::NESTED_TXNS`] nested Txns, each as full as etcd allows under
/// a parent holding that many ops (`max_txn_ops - n`), less one top-level slot for the
/// checkpoint put of a cycle's last Txn; never fewer than a flat Txn holds.
pub(super) fn scan_chunk_ops(max_txn_ops: i64) -> usize {
    let limit = max_txn_ops.max(2) as usize;
    let nested = mirror_fence::NESTED_TXNS.min(limit / 2);
    (nested * (limit - nested - 1)).max(limit - 1)
}

/// Scan puts for one Txn and the source key they end at.
#[derive(Debug)]
pub(super) struct ScanChunk {
    ops: Vec<Op>,
    /// The source key of the last put: the `scan_cursor` once this chunk and all before it
    /// landed.
    cursor: Vec<u8>,
    /// Lease-backed keys among them.
    leased: u64,
    bytes: usize,
}

/// The chunks of one scan cycle.
#[derive(Debug, Default)]
pub(super) struct Cycle {
    chunks: Vec<ScanChunk>,
    bytes: usize,
    leased: u64,
}

impl Cycle {
    fn push(&mut self, chunk: ScanChunk) {
        self.bytes += chunk.bytes;
        self.leased += chunk.leased;
        self.chunks.push(chunk);
    }
}

/// The scan's reader task: pages in key order, rewritten and cut into [`ScanChunk`]s that span
/// pages, sent until the scan ends, an error (sent too) or the receiver is gone.
async fn read_chunks(
    mut scanner: Scanner,
    mut chunker: OpChunker,
    rewriter: KeyRewriter,
    r0: i64,
    tx: tokio::sync::mpsc::Sender<Result<ScanChunk, EngineError>>,
) -> u64 {
    // The last source key and the lease-backed keys of the chunk being filled.
    let mut cursor = Vec::new();
    let mut leased = 0u64;
    // Keys skipped as not ours to mirror (another link's reserved keys) that existed at R0.
    let mut uncounted = 0u64;
    loop {
        let page = match scanner.next_page().await {
            Ok(Some(page)) => page,
            Ok(None) => break,
            Err(e) => {
                let _ = tx.send(Err(e.into())).await;
                return uncounted;
            }
        };
        for kv in &page.kvs {
            let Some(key) = rewriter.to_target(kv.key()) else {
                uncounted += u64::from(kv.mod_revision() <= r0);
                continue;
            };
            if let Some(ops) = chunker.push(Op::Put { key, value: kv.value().to_vec() }) {
                // `kv` opens the next chunk: the full one ends at the previous key.
                let chunk = scan_chunk(ops, std::mem::take(&mut cursor), std::mem::take(&mut leased));
                if tx.send(Ok(chunk)).await.is_err() {
                    return uncounted;
                }
            }
            leased += u64::from(kv.lease() != 0);
            cursor = kv.key().to_vec();
        }
    }
    if let Some(ops) = chunker.take() {
        let _ = tx.send(Ok(scan_chunk(ops, cursor, leased))).await;
    }
    uncounted
}

fn scan_chunk(ops: Vec<Op>, cursor: Vec<u8>, leased: u64) -> ScanChunk {
    let bytes = ops.iter().map(Op::size).sum();
    ScanChunk { ops, cursor, leased, bytes }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scan Txn is 8 nested Txns as full as etcd accepts beside the checkpoint put, and
    /// never smaller than a flat Txn, whatever `max_txn_ops` the target has.
    #[test]
    fn scan_txns_nest_up_to_what_etcd_accepts() {
        assert_eq!(scan_chunk_ops(128), 8 * 119);
        for limit in [2i64, 3, 4, 16, 17, 64, 128, 1000] {
            let ops = scan_chunk_ops(limit);
            assert!(ops >= limit as usize - 1, "{limit}: {ops}");
            // etcd's rule, with the checkpoint put beside the children at the top level.
            let puts: Vec<etcd_client::TxnOp> =
                (0..ops).map(|i| etcd_client::TxnOp::put(format!("k{i}"), "v", None)).collect();
            assert!(mirror_fence::nest(puts, limit as usize, 1).is_ok(), "{limit}: {ops} ops do not lay out");
        }
    }
}
