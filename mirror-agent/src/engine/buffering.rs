//! The source watch kept read through long passes (issue #20 defect 3): the engine's side of
//! [`mirror_watch::Forwarder`], which owns the reading and its rules. [`Buffering`] is a
//! component of its own: it holds the forwarder of the pass that runs, and says
//! what each way it ends means for the run.

use mirror_core::{EtcdError, Fault, KeyRewriter, Side};
use mirror_watch::{Buffered, ForwardError, Forwarder, Watch};
use tracing::warn;

use super::{EngineError, ReconnectCause, Restart};

/// The watch read into a replay buffer while a long pass (the scan, the sweep, a reconcile
/// pass) runs, or nothing.
pub(super) struct Buffering {
    rewriter: KeyRewriter,
    forwarder: Option<Forwarder>,
}

impl Buffering {
    /// Nothing buffered yet; revisions will be rewritten by `rewriter`.
    pub(super) fn new(rewriter: KeyRewriter) -> Buffering {
        Buffering { rewriter, forwarder: None }
    }

    /// Starts reading `watch` into a fresh buffer of `limit` bytes (`watch_buffer_bytes`);
    /// `floor` is the last revision already taken (events at or below it are dropped).
    pub(super) fn start(&mut self, watch: Watch, floor: i64, limit: usize) {
        self.forwarder = Some(Forwarder::start(watch, limit, self.rewriter.clone(), floor));
    }

    /// The revisions buffered so far, taken while buffering goes on (empty when it ended).
    pub(super) async fn take(&self) -> Buffered {
        match &self.forwarder {
            Some(forwarder) => forwarder.take().await,
            None => Buffered::default(),
        }
    }

    /// Whether buffering stopped by itself (a full buffer, a compacted or broken watch): the
    /// running pass should end now.
    pub(super) fn ended(&self) -> bool {
        self.forwarder.as_ref().is_some_and(Forwarder::ended)
    }

    /// Stops buffering: the watch back and what it buffered, in revision order, or why it
    /// stopped early (`WatchBufferOverflow`, `CompactedDuringScan`, a watch error).
    pub(super) async fn stop(&mut self) -> Result<(Watch, Buffered), EngineError> {
        let forwarder = self.forwarder.take().expect("buffering started");
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

#[cfg(test)]
mod tests {
    use mirror_watch::{ForwardError, Overflow};

    use super::{forward_error, watch_error, EngineError, ReconnectCause, Restart};

    /// Only a compaction (or an overflow, the forwarder's own end) restarts genesis; a
    /// response over the decode limit reconnects asking for fragments; any other read error
    /// keeps its class.
    #[test]
    fn each_early_end_means_what_the_run_does_next() {
        let restart = |e: ForwardError| match forward_error(e) {
            EngineError::RestartGenesis(r) => Some(r),
            _ => None,
        };
        assert_eq!(
            restart(ForwardError::Overflow(Overflow { limit: 1 })),
            Some(Restart::WatchBufferOverflow)
        );
        let compacted = ForwardError::Compacted { at: 9, read_to: 3, head: 12 };
        assert_eq!(restart(compacted), Some(Restart::CompactedDuringScan));
        assert_eq!(restart(ForwardError::Ended), Some(Restart::WatchEndedDuringScan));
        assert_eq!(restart(ForwardError::Panicked), Some(Restart::ForwarderPanicked));
        let cancelled = forward_error(ForwardError::Cancelled("etcdserver: no leader".into()));
        assert!(matches!(cancelled, EngineError::Etcd(_)), "{cancelled:?}");
        let big = watch_error(etcd_client::Error::GRpcStatus(tonic::Status::out_of_range(
            "decoded message length too large: found 5000000 bytes, the limit is: 4194304 bytes",
        )));
        assert!(matches!(big, EngineError::Reconnect(ReconnectCause::WatchResponseTooLarge)), "{big:?}");
    }
}
