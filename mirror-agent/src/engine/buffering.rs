//! The source watch kept read through long passes (issue #20 defect 3).
//!
//! A pass that runs on the engine's own task (the genesis scan and its prune sweep, a periodic
//! reconcile pass) does not read the watch. On a busy source etcd then marks the watcher slow,
//! and once compaction passes the revision it is stuck at, the watch is cancelled as compacted:
//! a full resync, at every genesis whose sweep outlasts the source's compaction retention. So
//! while such a pass runs, a task of its own reads the watch into a [`ReplayBuffer`] bounded by
//! `watch_buffer_bytes`, and the pass checks [`Run::buffering_ended`] between its writes: when
//! the buffer is full (or the watch ends) it stops early rather than let the watch fall behind.
//! Afterwards the buffered revisions are applied in order, as the genesis replay is.
//!
//! Memory: the buffer's limit, never the pass's length.

use mirror_watch::Fragments;

use super::*;

/// A watch being read into a replay buffer by [`forward`].
pub(super) struct Buffering {
    task: tokio::task::JoinHandle<(WatchResponseStream, Fragments, Result<(), EngineError>)>,
    stop: CancellationToken,
    buffer: Arc<Mutex<ReplayBuffer>>,
    sender: WatchRequestSender,
}

impl Run<'_> {
    /// The periodic reconcile pass of the tail with the watch buffered meanwhile; afterwards
    /// the buffered revisions are applied. A full buffer does not cut the pass short (a paced
    /// repair may outlast any buffer): the watch is dropped then and re-opened from the
    /// watermark once the pass ends, as before buffering existed.
    pub(super) async fn reconcile_buffered(&mut self, scan_end: &mut Option<i64>) -> Result<(), EngineError> {
        let delete_orphans = self.cfg().reconcile.delete_orphans;
        let Some(watch) = self.watch.take() else { return self.reconcile_pass(delete_orphans).await };
        let floor = self.writer().record().watermark;
        self.start_buffering(watch, floor);
        let pass = self.reconcile_pass(delete_orphans).await;
        let buffered = self.stop_buffering().await;
        pass?;
        match buffered {
            Ok((watch, revisions)) => {
                self.watch = Some(watch);
                self.apply_revisions(revisions, scan_end).await
            }
            Err(EngineError::RestartGenesis(Restart::WatchBufferOverflow)) => {
                warn!("the watch buffer filled during the reconcile pass; re-watching from the watermark");
                Ok(())
            }
            Err(EngineError::RestartGenesis(Restart::CompactedDuringScan)) => {
                Err(EngineError::Resync(ResyncCause::WatchCompacted))
            }
            Err(e) => Err(e),
        }
    }

    /// Starts reading `watch` into a fresh buffer; `floor` is the last revision already taken
    /// (events at or below it are dropped).
    pub(super) fn start_buffering(&mut self, watch: Watch, floor: i64) {
        let limit = self.cfg().sync.watch_buffer_bytes.bytes() as usize;
        let buffer = Arc::new(Mutex::new(ReplayBuffer::new(limit)));
        let stop = CancellationToken::new();
        let task = tokio::spawn(forward(
            watch.stream,
            watch.fragments,
            buffer.clone(),
            stop.clone(),
            self.engine.rewriter.clone(),
            floor,
        ));
        self.buffering = Some(Buffering { task, stop, buffer, sender: watch.sender });
    }

    /// Whether the buffering task stopped by itself (a full buffer, a compacted or broken
    /// watch): the running pass should end now.
    pub(super) fn buffering_ended(&self) -> bool {
        self.buffering.as_ref().is_some_and(|b| b.task.is_finished())
    }

    /// Stops the buffering task: the watch back and what it buffered, in revision order, or
    /// why it stopped early (`WatchBufferOverflow`, `CompactedDuringScan`, a watch error).
    pub(super) async fn stop_buffering(&mut self) -> Result<(Watch, Vec<Revision>), EngineError> {
        let b = self.buffering.take().expect("buffering started");
        b.stop.cancel();
        let (stream, fragments, forwarded) =
            b.task.await.map_err(|_| EngineError::RestartGenesis(Restart::ForwarderPanicked))?;
        forwarded?;
        let revisions = b.buffer.lock().await.drain();
        Ok((Watch { sender: b.sender, stream, fragments }, revisions))
    }
}

/// Reads the watch into the replay buffer. Ends on `stop` (returning the stream), on overflow,
/// or on a compacted or broken watch.
pub(super) async fn forward(
    mut stream: WatchResponseStream,
    mut fragments: Fragments,
    buffer: Arc<Mutex<ReplayBuffer>>,
    stop: CancellationToken,
    rewriter: KeyRewriter,
    r0: i64,
) -> (WatchResponseStream, Fragments, Result<(), EngineError>) {
    let mut floor = r0;
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => return (stream, fragments, Ok(())),
            msg = stream.message() => msg,
        };
        let resp = match msg {
            Ok(Some(r)) => r,
            Ok(None) => {
                return (stream, fragments, Err(EngineError::RestartGenesis(Restart::WatchEndedDuringScan)))
            }
            Err(e) => return (stream, fragments, Err(watch_error(e))),
        };
        if resp.canceled() || resp.compact_revision() > 0 {
            // Name the real cause (defect #4 of issue 10): only a compaction restarts genesis;
            // any other cancel is an error of its class (a reconnect resumes the scan).
            let fault = Fault::of_watch_cancel(resp.compact_revision(), resp.cancel_reason());
            let err = match fault.class() {
                ErrorClass::Resync => EngineError::RestartGenesis(Restart::CompactedDuringScan),
                _ => EngineError::Etcd(EtcdError::new(
                    "watch",
                    Side::Source,
                    etcd_client::Error::WatchError(format!(
                        "watch cancelled during the scan: {}",
                        resp.cancel_reason()
                    )),
                )),
            };
            return (stream, fragments, Err(err));
        }
        let converted = fragments.convert(&resp, &rewriter, floor);
        if let Some(last) = converted.revisions.last() {
            floor = last.revision;
        }
        if let Err(overflow) = buffer.lock().await.push(converted.revisions) {
            return (stream, fragments, Err(overflow.into()));
        }
    }
}

/// A failed watch read. A response over the client's decode limit (a catch-up bundling up to
/// 1 000 revisions of large values) is no fault of the link: reconnect, and watch again asking
/// for fragments (`Engine::fragment_watch`, set by the run loop on this reason).
pub(super) fn watch_error(e: etcd_client::Error) -> EngineError {
    let e = EtcdError::new("watch", Side::Source, e);
    if e.fault == Fault::ResponseTooLarge {
        return EngineError::Reconnect(ReconnectCause::WatchResponseTooLarge);
    }
    e.into()
}
