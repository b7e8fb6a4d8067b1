//! The applier's Txns in flight (compact mode's `sync.txns_in_flight`): batches sent before the
//! one before them landed, each fenced by the record the one before it stores
//! ([`crate::writer::Prepared`], whose module says why that is the fence).
//!
//! Answers are taken in the order the Txns were sent. A landed one is reported to the owner as
//! any landing is. On the first that did not land, every answer still to come is awaited: one
//! behind it that landed proves it landed too (its answer was lost); the rest are sent again,
//! one at a time, through the applier's serial commit, which judges a lost answer by the stored
//! bytes and retries by error class, so nothing is lost, applied twice or written over.

use std::collections::VecDeque;

use etcd_client::TxnResponse;
use futures::stream::{FuturesOrdered, StreamExt as _};
use mirror_core::{EtcdError, Op};
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use super::{Applier, Owner};
use crate::writer::Prepared;
use crate::Checkpoint;

/// A Txn on its way, on a task of its own (so it goes out at once and the applier stays `Sync`);
/// cancelled when dropped with the run.
type Answering = AbortOnDropHandle<Result<TxnResponse, EtcdError>>;

/// The Txns in flight, oldest first.
#[derive(Default)]
pub(super) struct Flight {
    answers: FuturesOrdered<Answering>,
    sent: VecDeque<Sent>,
}

/// What was sent, for the landing's report and for sending it again.
struct Sent {
    ops: Vec<Op>,
    revisions: usize,
    prepared: Prepared,
    at: Instant,
}

/// The oldest Txn in flight and its answer ([`Applier::answer`]): `None` when none came (an
/// error: it may or may not have landed).
pub struct Answered {
    sent: Sent,
    answer: Option<TxnResponse>,
}

impl Applier {
    /// Whether [`Applier::send`] keeps more than one Txn on its way (`sync.txns_in_flight`).
    pub fn overlaps(&self) -> bool {
        self.txns_in_flight > 1
    }

    /// Txns in flight now.
    pub fn in_flight(&self) -> usize {
        self.flight.sent.len()
    }

    /// The record the fence holds once every Txn in flight landed: what the next batch moves on
    /// from.
    pub fn latest(&self) -> &Checkpoint {
        self.flight.sent.back().map_or(self.writer.record(), |s| s.prepared.given())
    }

    /// Sends `ops` (`revisions` whole source revisions) with the checkpoint `next` without
    /// waiting for it to land, behind the Txns in flight; first takes the oldest one's answer
    /// while `sync.txns_in_flight` are on their way. Its landing is reported as any other
    /// ([`Owner::landed`], then [`Owner::revisions_landed`]).
    pub async fn send<O: Owner>(
        &mut self,
        ops: &[Op],
        next: Checkpoint,
        revisions: usize,
        owner: &mut O,
    ) -> Result<(), O::Error> {
        self.settle_down_to(self.txns_in_flight - 1, owner).await?;
        let txn_ops = owner.txn_ops(ops).await?;
        let after = self.flight.sent.back().map(|s| s.prepared.bytes().to_vec());
        let prepared = self.writer.prepare(txn_ops, next, after.as_deref())?;
        self.flight.answers.push_back(AbortOnDropHandle::new(tokio::spawn(self.writer.send(&prepared))));
        self.flight.sent.push_back(Sent { ops: ops.to_vec(), revisions, prepared, at: Instant::now() });
        Ok(())
    }

    /// The answer of the oldest Txn in flight; never resolves while none is. Safe to drop
    /// unresolved (a `select!` branch): the answer stays to come.
    pub async fn answer(&mut self) -> Answered {
        match self.flight.answers.next().await {
            Some(answer) => {
                let sent = self.flight.sent.pop_front().expect("one sent per answer");
                Answered { sent, answer: answer.ok().and_then(Result::ok) }
            }
            None => std::future::pending().await,
        }
    }

    /// Takes an answer ([`Applier::answer`]): a landing is reported; anything else settles
    /// every Txn in flight as the module doc says.
    pub async fn settle<O: Owner>(&mut self, answered: Answered, owner: &mut O) -> Result<(), O::Error> {
        let Answered { sent, answer } = answered;
        if let Some(resp) = &answer {
            if resp.succeeded() {
                let revision = resp.header().map_or(0, |h| h.revision());
                self.landed(sent, revision, owner);
                return Ok(());
            }
        }
        // Every answer still to come, then the last of them that landed: all before it did.
        let mut rest = vec![(sent, answer)];
        while self.in_flight() > 0 {
            let Answered { sent, answer } = self.answer().await;
            rest.push((sent, answer));
        }
        let landed = rest.iter().rposition(|(_, a)| a.as_ref().is_some_and(TxnResponse::succeeded));
        let mut rest = rest.into_iter();
        if let Some(last) = landed {
            for _ in 0..last {
                let (sent, _) = rest.next().expect("before the last landed");
                self.landed(sent, 0, owner);
            }
            let (sent, answer) = rest.next().expect("the last landed");
            let revision = answer.and_then(|r| r.header().map(|h| h.revision())).unwrap_or(0);
            self.landed(sent, revision, owner);
        }
        for (sent, answer) in rest {
            if answer.is_none() {
                // Lost, or refused before it ran: sent again with the same bytes, so one that
                // landed after all is adopted (the writer's ambiguous-commit rule).
                self.writer.prepared_unsettled(&sent.prepared);
            }
            let next = sent.prepared.given().clone();
            if let Err(too_big) = self.try_commit_now(&sent.ops, next, Vec::new(), owner).await? {
                return Err(too_big.into());
            }
            owner.revisions_landed(sent.revisions, self.writer.record().watermark, sent.ops.len());
        }
        Ok(())
    }

    /// Waits for every Txn in flight to land (or to be sent again and land): before any write
    /// that is not the next batch, and before anything reads the record the fence holds.
    pub async fn drain<O: Owner>(&mut self, owner: &mut O) -> Result<(), O::Error> {
        self.settle_down_to(0, owner).await
    }

    /// Takes the oldest answers until at most `left` Txns are in flight.
    async fn settle_down_to<O: Owner>(&mut self, left: usize, owner: &mut O) -> Result<(), O::Error> {
        while self.in_flight() > left {
            let answered = self.answer().await;
            self.settle(answered, owner).await?;
        }
        Ok(())
    }

    /// `sent` is on the target at `revision` (0: not known, a later one's comes next).
    fn landed<O: Owner>(&mut self, sent: Sent, revision: i64, owner: &mut O) {
        let Sent { ops, revisions, prepared, at } = sent;
        let watermark = prepared.given().watermark;
        self.writer.prepared_landed(prepared, revision);
        owner.landed(ops.len(), at.elapsed(), self.writer.record(), false);
        owner.revisions_landed(revisions, watermark, ops.len());
    }
}
