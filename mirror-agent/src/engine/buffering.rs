//! The source watch kept read through long passes (issue #20 defect 3): the engine's side of
//! [`mirror_watch::Forwarder`], which owns the reading and its rules. Here: when a pass runs
//! with it, and what each way it ends means for the run.

use mirror_core::{EtcdError, Fault, Side};
use mirror_watch::{Buffered, ForwardError, Forwarder, Watch};
use tracing::warn;

use super::{EngineError, ReconnectCause, Restart, ResyncCause, Run};

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

    /// Starts reading `watch` into a fresh buffer of `watch_buffer_bytes`; `floor` is the last
    /// revision already taken (events at or below it are dropped).
    pub(super) fn start_buffering(&mut self, watch: Watch, floor: i64) {
        let limit = self.cfg().sync.watch_buffer_bytes.bytes() as usize;
        self.buffering = Some(Forwarder::start(watch, limit, self.engine.rewriter.clone(), floor));
    }

    /// The revisions buffered so far, taken while buffering goes on (empty when it ended).
    pub(super) async fn take_buffered(&self) -> Buffered {
        match &self.buffering {
            Some(forwarder) => forwarder.take().await,
            None => Buffered::default(),
        }
    }

    /// Whether buffering stopped by itself (a full buffer, a compacted or broken watch): the
    /// running pass should end now.
    pub(super) fn buffering_ended(&self) -> bool {
        self.buffering.as_ref().is_some_and(Forwarder::ended)
    }

    /// Stops buffering: the watch back and what it buffered, in revision order, or why it
    /// stopped early (`WatchBufferOverflow`, `CompactedDuringScan`, a watch error).
    pub(super) async fn stop_buffering(&mut self) -> Result<(Watch, Buffered), EngineError> {
        let forwarder = self.buffering.take().expect("buffering started");
        forwarder.stop().await.map_err(forward_error)
    }
}

/// What a forwarder's early end means for the run: only a compaction restarts genesis; any
/// other cancel or read error is an error of its class (a reconnect resumes).
fn forward_error(e: ForwardError) -> EngineError {
    match e {
        ForwardError::Overflow(overflow) => overflow.into(),
        e @ ForwardError::Compacted { .. } => {
            warn!(error = %e, "the buffered source watch was compacted");
            EngineError::RestartGenesis(Restart::CompactedDuringScan)
        }
        ForwardError::Ended => EngineError::RestartGenesis(Restart::WatchEndedDuringScan),
        ForwardError::Panicked => EngineError::RestartGenesis(Restart::ForwarderPanicked),
        ForwardError::Read(e) => watch_error(e),
        ForwardError::Cancelled(reason) => EngineError::Etcd(EtcdError::new(
            "watch",
            Side::Source,
            etcd_client::Error::WatchError(format!("watch cancelled during the scan: {reason}")),
        )),
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
