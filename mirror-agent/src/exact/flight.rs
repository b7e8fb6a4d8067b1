//! Exact mode's Txns in flight (SPEC §10, Fence and pipeline): revisions received and not yet
//! sent, and Txns sent and not yet judged, in order. etcd does not keep the order of
//! concurrent requests, even on one connection (SPEC §11): a Txn sent before its predecessor
//! landed may run first, and fails its fence compare. So answers are judged in send order, and
//! when the first unjudged one did not land (overtaken, or its answer lost), every answer
//! behind it is awaited too: the last one that landed proves every revision before it landed,
//! and the rest go back to be sent again in order ([`landed_prefix`]). A second Txn is sent
//! only while revisions wait, so an unloaded link sends one at a time.
//!
//! What the pipeline holds is counted ([`Flight::holds`]): the tail receives more (from the
//! watch or the seed's spool) only while it is under `sync.watch_buffer_bytes` (G6), so a
//! target that is down or slow leaves the rest in the source's history, not in the agent.

use std::collections::VecDeque;
use std::future::Future;

use etcd_client::TxnResponse;
use futures::future::BoxFuture;
use futures::stream::FuturesOrdered;
use futures::StreamExt as _;
use mirror_core::{EtcdError, ExactRevision};
use mirror_fence::RevisionTxn;
use tokio_util::task::AbortOnDropHandle;

/// An answer as the pipeline needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The Txn landed (or had landed, or the checkpoint is past it).
    Landed,
    /// It did not land: sent too early, or its answer was lost.
    Again,
}

/// How many of a window's Txns, judged in order, landed: up to and including the last one that
/// did (a Txn lands only after its predecessor landed, so every one before it did too).
pub(super) fn landed_prefix(verdicts: &[Verdict]) -> usize {
    verdicts.iter().rposition(|v| *v == Verdict::Landed).map_or(0, |i| i + 1)
}

/// A revision, with its Txn once built (a Txn sent again is the one built first: the lease
/// records it carries ride it once).
pub(super) type Entry = (ExactRevision, Option<RevisionTxn>);

/// A Txn in flight.
pub(super) struct Sent {
    pub rev: ExactRevision,
    pub txn: RevisionTxn,
    /// Whether its predecessor had landed (its answer judged) when it was sent.
    pub after_landed: bool,
    /// When it was sent (the apply latency metric).
    pub at: tokio::time::Instant,
}

/// Revisions waiting and Txns in flight.
pub(super) struct Flight {
    /// Txns in flight at most.
    pub window: usize,
    /// Received, not yet sent, in order.
    pub waiting: VecDeque<Entry>,
    /// Sent, not yet judged, in order.
    pub sent: VecDeque<Sent>,
    /// Bytes of the revisions received and not yet landed ([`ExactRevision::size`]).
    held: usize,
    answers: FuturesOrdered<BoxFuture<'static, Result<TxnResponse, EtcdError>>>,
}

impl Flight {
    /// An empty pipeline of `window` Txns in flight at most.
    pub(super) fn new(window: usize) -> Flight {
        Flight {
            window: window.max(1),
            waiting: VecDeque::new(),
            sent: VecDeque::new(),
            held: 0,
            answers: FuturesOrdered::new(),
        }
    }

    /// Queues revision `rev`, received, behind those waiting.
    pub(super) fn receive(&mut self, rev: ExactRevision) {
        self.held += rev.size();
        self.waiting.push_back((rev, None));
    }

    /// Whether the revisions received and not yet landed hold `limit` bytes or more: then no
    /// more is received until some land. One revision is received whatever its size.
    pub(super) fn holds(&self, limit: usize) -> bool {
        self.held >= limit
    }

    /// Revision `landed`, taken out of the pipeline, is on the target: it is no longer held.
    /// Of the leases its changes left, those a put of a revision waiting or in flight names:
    /// none of them may be revoked yet. Nothing is scanned for a revision that left no lease
    /// (most do), so a backlog costs nothing per landing.
    pub(super) fn landed(&mut self, landed: &ExactRevision) -> std::collections::BTreeSet<i64> {
        self.held = self.held.saturating_sub(landed.size());
        self.still_needed(landed)
    }

    /// Whether another Txn may be sent now: one waits, and the window has room (a second only
    /// while a backlog waits).
    pub(super) fn room(&self) -> bool {
        !self.waiting.is_empty() && self.sent.len() < self.window
    }

    /// Sends `txn` for `rev` with `send`; `after_landed`: its predecessor's landing was judged
    /// before (then etcd cannot have run it too early, and a fence compare it fails as if it had
    /// is another writer's doing). The request goes now, on a task of its own, not when the
    /// answers are next polled: two sent between polls would reach etcd together, which the
    /// tail's spacing is there to avoid.
    pub(super) fn send(
        &mut self,
        rev: ExactRevision,
        txn: RevisionTxn,
        after_landed: bool,
        send: impl Future<Output = Result<TxnResponse, EtcdError>> + Send + 'static,
    ) {
        self.sent.push_back(Sent { rev, txn, after_landed, at: tokio::time::Instant::now() });
        let task = AbortOnDropHandle::new(tokio::spawn(send));
        // Aborted only with its handle (the flight dropped), so it ends in an answer or a panic.
        self.answers.push_back(Box::pin(async move {
            task.await.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
        }));
    }

    /// The next answer, in send order (pending forever while nothing is in flight).
    pub(super) async fn next_answer(&mut self) -> Result<TxnResponse, EtcdError> {
        match self.answers.next().await {
            Some(answer) => answer,
            None => std::future::pending().await,
        }
    }

    /// Every answer still to come, in order.
    pub(super) async fn drain(&mut self) -> Vec<Result<TxnResponse, EtcdError>> {
        let mut all = Vec::with_capacity(self.answers.len());
        while let Some(answer) = self.answers.next().await {
            all.push(answer);
        }
        all
    }

    /// Puts the sent Txns from `from` on back in front of the waiting ones, in order.
    pub(super) fn resend_from(&mut self, from: usize) {
        while self.sent.len() > from {
            let sent = self.sent.pop_back().expect("len checked");
            self.waiting.push_front((sent.rev, Some(sent.txn)));
        }
    }

    /// Of the leases `landed`'s changes left, those a put of a revision waiting or in flight
    /// names ([`Flight::landed`]).
    fn still_needed(&self, landed: &ExactRevision) -> std::collections::BTreeSet<i64> {
        let left: std::collections::BTreeSet<i64> =
            landed.changes.iter().map(mirror_core::Change::left_lease).filter(|l| *l != 0).collect();
        if left.is_empty() {
            return left;
        }
        let revs = self.waiting.iter().map(|(r, _)| r).chain(self.sent.iter().map(|s| &s.rev));
        revs.flat_map(|r| r.changes.iter())
            .filter_map(|c| match c {
                mirror_core::Change::Put { lease, .. } if left.contains(lease) => Some(*lease),
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use mirror_core::{Change, ExactRevision};

    use super::{landed_prefix, Flight, Verdict::*};

    fn put(key: &str, lease: i64, prev_lease: i64) -> Change {
        Change::Put { key: key.into(), value: Vec::new(), lease, version: 2, create_revision: 1, prev_lease }
    }

    /// A lease a landed revision left is still needed while a revision waiting to land puts a
    /// key under it; one nobody names any more may go; a revision that left none needs nothing.
    #[test]
    fn a_lease_left_is_kept_while_a_waiting_revision_names_it() {
        let mut flight = Flight::new(1);
        flight.receive(ExactRevision { revision: 12, changes: vec![put("/b", 7, 0)] });
        let landed = ExactRevision { revision: 11, changes: vec![put("/a", 0, 7), put("/c", 0, 8)] };
        assert_eq!(flight.still_needed(&landed).into_iter().collect::<Vec<_>>(), [7]);
        let quiet = ExactRevision { revision: 11, changes: vec![put("/a", 7, 7)] };
        assert!(flight.still_needed(&quiet).is_empty());
    }

    /// What is held grows with each revision received and shrinks as each lands; one revision
    /// larger than the limit is still received when nothing is held.
    #[test]
    fn what_is_held_is_counted_until_it_lands() {
        let rev = |revision: i64, bytes: usize| ExactRevision {
            revision,
            changes: vec![Change::Put {
                key: b"/k".to_vec(),
                value: vec![0; bytes],
                lease: 0,
                version: 1,
                create_revision: revision,
                prev_lease: 0,
            }],
        };
        let mut flight = Flight::new(2);
        assert!(!flight.holds(1000), "nothing held: a revision of any size may come");
        let (first, second) = (rev(11, 600), rev(12, 600));
        flight.receive(first.clone());
        assert!(!flight.holds(1000));
        flight.receive(second.clone());
        assert!(flight.holds(1000), "1 200 bytes and more held");
        flight.waiting.pop_front();
        flight.landed(&first);
        assert!(!flight.holds(1000), "the first landed: {} bytes held", second.size());
        flight.waiting.pop_front();
        flight.landed(&second);
        assert!(!flight.holds(1));
    }

    /// The last Txn that landed proves those before it landed, whatever their own answers
    /// said (lost, or sent too early and then overtaken by a resend); those after go again.
    #[test]
    fn the_last_landing_proves_the_ones_before_it() {
        assert_eq!(landed_prefix(&[]), 0);
        assert_eq!(landed_prefix(&[Again, Again]), 0);
        assert_eq!(landed_prefix(&[Landed, Again, Again]), 1);
        assert_eq!(landed_prefix(&[Again, Landed, Again]), 2, "a lost answer before a landing landed");
        assert_eq!(landed_prefix(&[Landed, Landed]), 2);
    }
}
