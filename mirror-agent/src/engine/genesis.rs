//! Genesis (SPEC §5 steps 4-7): the buffered watch, the pipelined scan and its writes.

use super::*;

impl Run<'_> {
    /// Steps 4-7 of SPEC §5 from a claimed `{scanning: true, watermark: r0}`.
    pub(super) async fn genesis(&mut self, r0: i64, cursor: Vec<u8>, prune: bool) -> Result<(), EngineError> {
        self.engine.set_phase(Phase::InitialSync);
        if prune {
            // Before the first data write, not only before the sweep.
            self.refuse_foreign_links().await?;
        }
        let mut watch = match self.open_watch(r0 + 1).await {
            Ok(w) => w,
            Err(EngineError::Etcd(e)) if e.class() == ErrorClass::Resync => {
                return Err(EngineError::Resync("CompactedDuringScan"))
            }
            Err(e) => return Err(e),
        };
        // Buffer the watch while scanning.
        let buffer =
            Arc::new(Mutex::new(ReplayBuffer::new(self.cfg().sync.watch_buffer_bytes.bytes() as usize)));
        let stop = CancellationToken::new();
        let forwarder = tokio::spawn(forward(
            watch.stream,
            buffer.clone(),
            stop.clone(),
            self.engine.rewriter.clone(),
            r0,
        ));

        let scan = self.scan(r0, cursor, prune, &forwarder).await;
        stop.cancel();
        let (stream, forwarded) =
            forwarder.await.map_err(|_| EngineError::RestartGenesis("ForwarderPanicked"))?;
        scan?;
        forwarded?;
        watch.stream = stream;

        // Prune owed: sweep target keys whose source no longer has them.
        if prune {
            self.sweep(r0).await?;
        }
        let scan_end = self.source_revision().await?;
        let replay = buffer.lock().await.drain();
        info!(r0, scan_end, buffered = replay.len(), "scan done; replaying to scan_end");
        self.tail(watch, Some((scan_end, replay))).await
    }

    /// Step 5: the scan, pipelined (SPEC §9's hint).
    ///
    /// A reader task fetches the next page while the current one is written. Pages are cut into
    /// Txn-sized chunks and written in *cycles*: every chunk of a cycle but the last goes out as a
    /// data-only Txn carrying just the fence compare, up to [`SCAN_TXNS_IN_FLIGHT`] at once. They
    /// all compare the same mod revision, so they never conflict with each other, and scan keys
    /// are disjoint and idempotent, so their order does not matter. Only when all of them have
    /// landed does the last chunk go out together with the checkpoint put that advances
    /// `scan_cursor`. The fence holds: a takeover moves the mod revision and every stale Txn
    /// fails; a chunk that failed is redone through the fenced, judged commit path.
    pub(super) async fn scan(
        &mut self,
        r0: i64,
        cursor: Vec<u8>,
        prune: bool,
        forwarder: &tokio::task::JoinHandle<(WatchResponseStream, Result<(), EngineError>)>,
    ) -> Result<(), EngineError> {
        let cfg = self.engine.cfg.sync.clone();
        let mut scanner = Scanner::new(
            self.source.kv_client(),
            &self.engine.rewriter,
            cfg.page_key_limit,
            cfg.page_bytes.bytes() as usize,
            cfg.request_timeout.get(),
        )
        .resume_after(&cursor);
        // A few pages ahead, so the next cycle's pages are read while this one is written;
        // bounded, so memory stays O(page bytes).
        let (tx, mut pages) = tokio::sync::mpsc::channel(SCAN_READ_AHEAD_PAGES);
        let reader = tokio::spawn(async move {
            loop {
                let page = scanner.next_page().await;
                let done = !matches!(page, Ok(Some(_)));
                if tx.send(page).await.is_err() || done {
                    return;
                }
            }
        });
        let result = async {
            let max_ops = (cfg.max_txn_ops as usize).saturating_sub(1).max(1);
            let max_bytes = cfg.txn_flush_bytes.bytes() as usize;
            let mut cycle: Vec<Vec<Op>> = Vec::new();
            let mut cursor = cursor;
            let mut leased = 0u64;
            loop {
                let page = tokio::select! {
                    page = pages.recv() => page,
                    _ = self.engine.shutdown.cancelled() => return Err(EngineError::Shutdown),
                };
                let Some(page) = page else { break };
                let Some(page) = page? else { break };
                if forwarder.is_finished() {
                    // The forwarder stops early only on overflow or a compacted watch.
                    return Ok(());
                }
                let mut chunker = OpChunker::new(max_ops, max_bytes);
                for kv in &page.kvs {
                    let Some(key) = self.engine.rewriter.to_target(kv.key()) else { continue };
                    leased += u64::from(kv.lease() != 0);
                    cycle.extend(chunker.push(Op::Put { key, value: kv.value().to_vec() }));
                }
                cycle.extend(chunker.take());
                cursor = page.last_key().map(<[u8]>::to_vec).unwrap_or(cursor);
                if cycle.len() >= SCAN_CYCLE_TXNS {
                    self.flush_scan_cycle(
                        std::mem::take(&mut cycle),
                        r0,
                        prune,
                        &cursor,
                        std::mem::take(&mut leased),
                    )
                    .await?;
                }
            }
            if !cycle.is_empty() {
                self.flush_scan_cycle(cycle, r0, prune, &cursor, leased).await?;
            }
            Ok(())
        }
        .await;
        reader.abort();
        result
    }

    /// Writes one scan cycle: concurrent data-only Txns, then the last chunk with the cursor.
    pub(super) async fn flush_scan_cycle(
        &mut self,
        mut cycle: Vec<Vec<Op>>,
        r0: i64,
        prune: bool,
        cursor: &[u8],
        leased: u64,
    ) -> Result<(), EngineError> {
        let Some(last) = cycle.pop() else { return Ok(()) };
        let keys = cycle.iter().map(Vec::len).sum::<usize>() + last.len();
        let data = self.writer().data_writer();
        let in_flight = cycle.into_iter().map(|chunk| {
            let data = data.clone();
            async move {
                let landed = data.commit(chunk.iter().map(Op::to_txn_op).collect()).await;
                (chunk, landed)
            }
        });
        let results: Vec<(Vec<Op>, bool)> =
            futures::stream::iter(in_flight).buffer_unordered(SCAN_TXNS_IN_FLIGHT).collect().await;
        self.pace(keys - last.len()).await?;
        for (chunk, landed) in results {
            if !landed {
                // Redo through the judged path: a moved fence surfaces as a FenceError there.
                let same = self.writer().record().clone();
                self.commit_with_retry(&chunk, same).await?;
            }
        }
        let mut next = self.writer().record().clone();
        next.watermark = r0;
        next.scanning = true;
        next.prune_pending = prune;
        next.scan_cursor = cursor.to_vec();
        self.commit_with_retry(&last, next).await?;
        self.engine.update(|s| {
            s.initial_sync.keys += keys as u64;
            s.keys_applied_total += keys as u64;
            s.lease_backed_keys += leased;
        });
        Ok(())
    }
}

/// Reads the watch into the replay buffer during the scan. Ends on `stop` (returning the stream
/// for the tail), on overflow, or on a compacted or broken watch.
pub(super) async fn forward(
    mut stream: WatchResponseStream,
    buffer: Arc<Mutex<ReplayBuffer>>,
    stop: CancellationToken,
    rewriter: KeyRewriter,
    r0: i64,
) -> (WatchResponseStream, Result<(), EngineError>) {
    let mut floor = r0;
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => return (stream, Ok(())),
            msg = stream.message() => msg,
        };
        let resp = match msg {
            Ok(Some(r)) => r,
            Ok(None) => return (stream, Err(EngineError::RestartGenesis("WatchEndedDuringScan"))),
            Err(e) => return (stream, Err(EtcdError::new("watch", Side::Source, e).into())),
        };
        if resp.canceled() || resp.compact_revision() > 0 {
            // Name the real cause (defect #4 of issue 10): only a compaction restarts genesis;
            // any other cancel is an error of its class (a reconnect resumes the scan).
            let fault = Fault::of_watch_cancel(resp.compact_revision(), resp.cancel_reason());
            let err = match fault.class() {
                ErrorClass::Resync => EngineError::RestartGenesis("CompactedDuringScan"),
                _ => EngineError::Etcd(EtcdError::new(
                    "watch",
                    Side::Source,
                    etcd_client::Error::WatchError(format!(
                        "watch cancelled during the scan: {}",
                        resp.cancel_reason()
                    )),
                )),
            };
            return (stream, Err(err));
        }
        let converted = convert_events(resp.events(), &rewriter, floor);
        if let Some(last) = converted.revisions.last() {
            floor = last.revision;
        }
        if let Err(overflow) = buffer.lock().await.push(converted.revisions) {
            return (stream, Err(overflow.into()));
        }
    }
}
