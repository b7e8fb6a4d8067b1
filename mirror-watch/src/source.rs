//! The revision source: the tail's source watch read as values. One read ([`Watch::next`])
//! waits for a response and takes with it every data response already waiting behind it (group
//! commit, SPEC §5 Batching: the next target Txn carries every whole revision that arrived while
//! the last one was in flight, so under load Txns grow instead of the lag), each turned into a
//! [`Delivery`]: whole revisions (fragments joined, revisions at or below the floor dropped), a
//! reply without events (created, or progress) or a cancel. The engine decides what each means;
//! nothing here writes or judges progress.

use etcd_client::{WatchRequestSender, WatchResponse, WatchResponseStream};
use futures::FutureExt as _;
use mirror_core::KeyRewriter;

use crate::{Fragments, Revision, Watch};

/// Most watch responses gathered into one read.
const GROUP_RESPONSES: usize = 1024;

/// One thing the watch delivered, in arrival order.
#[derive(Debug)]
pub enum Delivery {
    /// Whole revisions above the floor, in order; `header` is the source's revision when the
    /// response was sent.
    Revisions {
        /// The revisions (possibly none: all at or below the floor, or a fragment held back).
        revisions: Vec<Revision>,
        /// The response header's revision.
        header: i64,
    },
    /// A response without events: the watch's created reply, or a progress notification.
    Reply {
        /// The created reply.
        created: bool,
        /// The response header's revision.
        header: i64,
    },
    /// etcd cancelled the watch: compacted past it (`compact_revision > 0`), or for `reason`.
    Cancelled {
        /// The compaction revision etcd answered with, 0 for another cancel.
        compact_revision: i64,
        /// etcd's cancel reason.
        reason: String,
    },
}

/// How the stream ended, after what it delivered before.
#[derive(Debug)]
pub enum WatchEnd {
    /// The server closed the stream.
    Closed,
    /// Reading failed.
    Failed(etcd_client::Error),
}

/// One read of the watch: what it delivered, then, if so, how the stream ended.
#[derive(Debug, Default)]
pub struct Deliveries {
    /// In arrival order.
    pub items: Vec<Delivery>,
    /// The stream ended after `items`.
    pub end: Option<WatchEnd>,
}

impl Watch {
    /// A watch over both halves of an open stream; a revision longer than `hold` bytes is kept
    /// as delete runs while its fragments arrive ([`crate::held_revision_bytes`]).
    pub fn new(sender: WatchRequestSender, stream: WatchResponseStream, hold: usize) -> Watch {
        Watch { sender, stream, fragments: Fragments::new(hold) }
    }

    /// Asks the source for a progress notification; a failure shows as the stream's end.
    pub async fn request_progress(&mut self) {
        let _ = self.sender.request_progress().await;
    }

    /// Waits for the next response, then takes every data response already waiting behind it,
    /// up to `budget` bytes of events and 1 024 responses, converted with
    /// `rewriter` above `floor` (the last revision taken: the watermark) and above each other.
    /// Cancel safe: nothing is taken until the first response arrives, and after it nothing
    /// waits.
    pub async fn next(&mut self, rewriter: &KeyRewriter, mut floor: i64, budget: usize) -> Deliveries {
        let mut read = Deliveries::default();
        let mut bytes = 0;
        let mut next = Some(self.stream.message().await);
        while let Some(message) = next.take() {
            match message {
                Ok(Some(resp)) => {
                    let data = is_data(&resp);
                    bytes += response_bytes(&resp);
                    read.items.push(self.deliver(&resp, rewriter, &mut floor));
                    if data && bytes < budget && read.items.len() < GROUP_RESPONSES {
                        next = self.stream.message().now_or_never();
                    }
                }
                Ok(None) => read.end = Some(WatchEnd::Closed),
                Err(e) => read.end = Some(WatchEnd::Failed(e)),
            }
        }
        read
    }

    /// One response as a delivery; data moves `floor` to its last revision.
    fn deliver(&mut self, resp: &WatchResponse, rewriter: &KeyRewriter, floor: &mut i64) -> Delivery {
        let header = resp.header().map_or(0, |h| h.revision());
        if resp.canceled() || resp.compact_revision() > 0 {
            let reason = resp.cancel_reason().to_owned();
            return Delivery::Cancelled { compact_revision: resp.compact_revision(), reason };
        }
        if resp.events().is_empty() {
            return Delivery::Reply { created: resp.created(), header };
        }
        let revisions = self.fragments.convert(resp, rewriter, *floor).revisions;
        if let Some(last) = revisions.last() {
            *floor = last.revision;
        }
        Delivery::Revisions { revisions, header }
    }
}

/// A response that carries events and nothing else to act on.
fn is_data(resp: &WatchResponse) -> bool {
    !resp.events().is_empty() && !resp.canceled() && resp.compact_revision() == 0
}

/// Roughly the bytes a response's events add to a Txn.
fn response_bytes(resp: &WatchResponse) -> usize {
    resp.events().iter().filter_map(|e| e.kv()).map(|kv| kv.key().len() + kv.value().len() + 16).sum()
}
