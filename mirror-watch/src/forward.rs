//! The source watch kept read through long passes (issue #20 defect 3).
//!
//! A pass that runs on the engine's own task (the genesis scan and its prune sweep, a periodic
//! reconcile pass) does not read the watch. On a busy source etcd then marks the watcher slow,
//! and once compaction passes the revision it is stuck at, the watch is cancelled as compacted:
//! a full resync, at every genesis whose sweep outlasts the source's compaction retention. So
//! while such a pass runs, a [`Forwarder`] task reads the watch into a [`ReplayBuffer`] bounded
//! by `watch_buffer_bytes`, and the pass asks [`Forwarder::ended`] between its writes: when the
//! buffer is full (or the watch ends) it stops early rather than let the watch fall behind.
//! Afterwards the buffered revisions are applied in order, as the genesis replay is; the
//! genesis replay itself is applied while the task reads on ([`Forwarder::take`]), since
//! replaying a long sweep's backlog takes seconds too.
//!
//! Memory: the buffer's limit (encoded bytes, which is what it holds), never the pass's length.

use etcd_client::{WatchRequestSender, WatchResponse, WatchResponseStream};
use mirror_core::{ErrorClass, Fault, KeyRewriter};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::{Buffered, Fragments, Overflow, ReplayBuffer};

/// An open source watch: both halves and the revision its fragments are joining. Read by the
/// tail as a revision source ([`Watch::next`]), or by a [`Forwarder`] through a long pass.
#[derive(Debug)]
pub struct Watch {
    /// Progress requests and cancels go here.
    pub(crate) sender: WatchRequestSender,
    /// Responses come from here.
    pub(crate) stream: WatchResponseStream,
    /// The part of a revision whose response came in fragments, until its last piece.
    pub(crate) fragments: Fragments,
}

/// Why forwarding stopped before it was asked to.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// The buffer passed `watch_buffer_bytes`.
    #[error("the replay buffer passed its {} bytes", .0.limit)]
    Overflow(Overflow),
    /// etcd compacted past the watch: at `at`, when the last revision read was `read_to` and
    /// the source stood at `head`. How far `read_to` trails `at` tells a reader that stalled
    /// (far behind) from a watcher etcd let fall behind for a moment (close).
    #[error("the watch was compacted at {at}; read to {read_to}, the source at {head}")]
    Compacted {
        /// The compaction revision etcd answered with.
        at: i64,
        /// The last revision taken from the watch.
        read_to: i64,
        /// The source's revision in the cancelling response's header.
        head: i64,
    },
    /// The stream closed.
    #[error("the watch ended")]
    Ended,
    /// etcd cancelled the watch for another reason (its text).
    #[error("watch cancelled: {0}")]
    Cancelled(String),
    /// Reading the stream failed.
    #[error(transparent)]
    Read(etcd_client::Error),
    /// The task did not return.
    #[error("the watch forwarder panicked")]
    Panicked,
}

/// What the task reads into: pure, so every way a response ends forwarding is tested without
/// a server.
#[derive(Debug)]
struct Intake {
    buffer: ReplayBuffer,
    fragments: Fragments,
    rewriter: KeyRewriter,
    /// The last revision taken: events at or below it are dropped.
    floor: i64,
}

impl Intake {
    /// Takes one response into the buffer, or says why forwarding must stop.
    fn take(&mut self, resp: &WatchResponse) -> Result<(), ForwardError> {
        if resp.canceled() || resp.compact_revision() > 0 {
            // Only a compaction restarts genesis; any other cancel is an error of its class.
            let fault = Fault::of_watch_cancel(resp.compact_revision(), resp.cancel_reason());
            return Err(match fault.class() {
                ErrorClass::Resync => ForwardError::Compacted {
                    at: resp.compact_revision(),
                    read_to: self.floor,
                    head: resp.header().map_or(0, |h| h.revision()),
                },
                _ => ForwardError::Cancelled(resp.cancel_reason().to_owned()),
            });
        }
        let converted = self.fragments.convert(resp, &self.rewriter, self.floor);
        if let Some(last) = converted.revisions.last() {
            self.floor = last.revision;
        }
        self.buffer.push(converted.revisions).map_err(ForwardError::Overflow)
    }
}

type Returned = (WatchResponseStream, Intake, Result<(), ForwardError>);

/// A request for what the task buffered so far.
type Take = oneshot::Sender<Buffered>;

/// A watch being read into a replay buffer by a task of its own.
#[derive(Debug)]
pub struct Forwarder {
    task: JoinHandle<Returned>,
    stop: oneshot::Sender<()>,
    takes: mpsc::Sender<Take>,
    sender: WatchRequestSender,
}

impl Forwarder {
    /// Starts reading `watch` into a buffer of `limit` bytes; `floor` is the last revision
    /// already taken.
    pub fn start(watch: Watch, limit: usize, rewriter: KeyRewriter, floor: i64) -> Forwarder {
        let (stop, stopped) = oneshot::channel();
        let (takes, taken) = mpsc::channel(1);
        let intake = Intake { buffer: ReplayBuffer::new(limit), fragments: watch.fragments, rewriter, floor };
        let task = tokio::spawn(forward(watch.stream, intake, stopped, taken));
        Forwarder { task, stop, takes, sender: watch.sender }
    }

    /// The whole revisions buffered so far, in order, while the task reads on (the buffer's
    /// bytes start again from zero); empty once the task has ended ([`Forwarder::stop`] says
    /// why). A revision still arriving in fragments stays until its last piece.
    pub async fn take(&self) -> Buffered {
        let (reply, answer) = oneshot::channel();
        if self.takes.send(reply).await.is_err() {
            return Buffered::default();
        }
        answer.await.unwrap_or_default()
    }

    /// Whether the task stopped by itself (a full buffer, a compacted or broken watch): the
    /// running pass should end now.
    pub fn ended(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops the task: the watch back and what it buffered, in revision order, or why it
    /// stopped early.
    pub async fn stop(self) -> Result<(Watch, Buffered), ForwardError> {
        let _ = self.stop.send(());
        let (stream, mut intake, forwarded) = self.task.await.map_err(|_| ForwardError::Panicked)?;
        forwarded?;
        let revisions = intake.buffer.drain();
        Ok((Watch { sender: self.sender, stream, fragments: intake.fragments }, revisions))
    }
}

/// Reads the watch into the intake until told to stop or forwarding fails; hands out what it
/// holds when asked.
async fn forward(
    mut stream: WatchResponseStream,
    mut intake: Intake,
    mut stopped: oneshot::Receiver<()>,
    mut takes: mpsc::Receiver<Take>,
) -> Returned {
    loop {
        let msg = tokio::select! {
            _ = &mut stopped => return (stream, intake, Ok(())),
            Some(take) = takes.recv() => {
                let _ = take.send(intake.buffer.drain());
                continue;
            }
            msg = stream.message() => msg,
        };
        let taken = match msg {
            Ok(Some(resp)) => intake.take(&resp),
            Ok(None) => Err(ForwardError::Ended),
            Err(e) => Err(ForwardError::Read(e)),
        };
        if let Err(e) = taken {
            // What was buffered is never applied now (`stop` returns the error): free it at
            // once rather than hold a full buffer until the pass ends.
            drop(intake.buffer.drain());
            return (stream, intake, Err(e));
        }
    }
}

#[cfg(test)]
mod tests {
    use etcd_client::proto::{PbEvent, PbKeyValue, PbWatchResponse};

    use super::*;

    fn intake(limit: usize, floor: i64) -> Intake {
        let rewriter = KeyRewriter::new(b"/a/", b"/b/", []);
        Intake { buffer: ReplayBuffer::new(limit), fragments: Fragments::new(1 << 20), rewriter, floor }
    }

    fn put(key: &str, revision: i64) -> PbEvent {
        let kv = PbKeyValue {
            key: key.into(),
            value: b"v".to_vec(),
            mod_revision: revision,
            ..Default::default()
        };
        PbEvent { kv: Some(kv), ..Default::default() }
    }

    fn response(events: Vec<PbEvent>, fragment: bool) -> WatchResponse {
        WatchResponse(PbWatchResponse { events, fragment, ..Default::default() })
    }

    /// Revisions are buffered in order, once: events at or below the floor are dropped, and a
    /// revision split across fragments is held until its last piece.
    #[test]
    fn revisions_are_buffered_once_and_whole() {
        let mut i = intake(1 << 20, 1);
        i.take(&response(vec![put("/a/old", 1), put("/a/x", 2), put("/a/y", 3)], true)).unwrap();
        i.take(&response(vec![put("/a/z", 3), put("/a/w", 4)], false)).unwrap();
        i.take(&response(vec![put("/a/x", 4), put("/a/v", 5)], false)).unwrap();
        let got: Vec<(i64, Vec<Vec<u8>>)> = i
            .buffer
            .drain()
            .map(|r| (r.revision, r.ops.iter().map(|op| op.key().to_vec()).collect()))
            .collect();
        let want = |r, keys: &[&str]| (r, keys.iter().map(|k| k.as_bytes().to_vec()).collect());
        assert_eq!(
            got,
            [want(2, &["/b/x"]), want(3, &["/b/y", "/b/z"]), want(4, &["/b/w"]), want(5, &["/b/v"])]
        );
    }

    /// A compaction, any other cancel and a full buffer each end forwarding with their own
    /// error.
    #[test]
    fn compaction_cancel_and_overflow_end_forwarding() {
        let compacted =
            WatchResponse(PbWatchResponse { canceled: true, compact_revision: 7, ..Default::default() });
        let said = intake(1 << 20, 5).take(&compacted);
        assert!(matches!(said, Err(ForwardError::Compacted { at: 7, read_to: 5, head: 0 })), "{said:?}");
        let denied = WatchResponse(PbWatchResponse {
            canceled: true,
            cancel_reason: "etcdserver: permission denied".into(),
            ..Default::default()
        });
        assert!(
            matches!(intake(1 << 20, 0).take(&denied), Err(ForwardError::Cancelled(r)) if r.contains("permission"))
        );
        let mut small = intake(30, 0);
        let full = small.take(&response(vec![put("/a/k", 1), put("/a/l", 2)], false));
        assert!(matches!(full, Err(ForwardError::Overflow(Overflow { limit: 30 }))), "{full:?}");
    }
}
