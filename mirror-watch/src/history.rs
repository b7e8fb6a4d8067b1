//! Reading what a range took between two revisions, from etcd's history (issue #22: the
//! failback plan lists the writes an old source took after the promoted watermark).
//!
//! ## The end of the history
//! A watch from `after + 1` delivers the range's events in revision order, but it never says
//! "that was all up to `upto`": a quiet range of a busy cluster delivers nothing at all. The
//! read ends when one of these proves every event up to `upto` has come:
//! 1. an event above `upto` arrived (one watcher's events come in revision order);
//! 2. the last piece of a response ending exactly at `upto` arrived (a revision's events come
//!    in one response, or in pieces flagged `fragment` but the last);
//! 3. on a server whose progress notifications are trusted (3.4.25+, 3.5.8+), a progress
//!    reply at or above `upto`;
//! 4. on an older server, two progress replies in a row at or above `upto` with no event
//!    between, and then the idle proof ([`crate::prove_unchanged`]) that the range at `upto`
//!    is the range at the last revision delivered. Older servers may answer a progress request
//!    ahead of events still to come (the agent's engine doc), so the reply alone proves
//!    nothing; the proof shows no write with a net effect is still missing. What it cannot see
//!    is a key created and deleted again in that last stretch: etcd gives no other way to
//!    ask, and such a pair changes no state.
//!
//! The rules are the pure [`Reading`], tested without a server; [`read_history`] drives them.

use std::time::Duration;

use etcd_client::{Client, EventType, WatchOptions, WatchResponse};
use mirror_core::{EtcdError, Fault, KeyRange, PagerOptions, Side};

use crate::{prove_unchanged, IdleProof, FRAGMENT_RESPONSE_LIMIT, WATCH_RESPONSE_LIMIT};

/// One write the history holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Written {
    /// A put.
    Put {
        /// The key.
        key: Vec<u8>,
        /// Its value.
        value: Vec<u8>,
        /// The revision of the put (the key's `mod_revision`).
        revision: i64,
        /// Its lease (0 for none).
        lease: i64,
    },
    /// A delete (a `DeleteRange`, a lease expiring or revoked).
    Delete {
        /// The key.
        key: Vec<u8>,
        /// The revision of the delete.
        revision: i64,
    },
}

impl Written {
    /// The revision of the write.
    pub fn revision(&self) -> i64 {
        match self {
            Written::Put { revision, .. } | Written::Delete { revision, .. } => *revision,
        }
    }
}

/// What proved that every event up to `upto` had come (module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistoryEnd {
    /// Nothing to read: `upto <= after`.
    Empty,
    /// An event above `upto`.
    EventPast,
    /// The whole of revision `upto`.
    EventAt,
    /// A trusted progress reply at or above `upto`.
    TrustedProgress,
    /// Two untrusted progress replies and the idle proof.
    IdleProof,
}

impl HistoryEnd {
    /// How the end was proven, in words for the plan's header.
    pub fn describe(self) -> &'static str {
        match self {
            HistoryEnd::Empty => "nothing to read",
            HistoryEnd::EventPast => "an event past the last revision",
            HistoryEnd::EventAt => "the last revision's events",
            HistoryEnd::TrustedProgress => "a progress notification (trusted on this server version)",
            HistoryEnd::IdleProof => {
                "two progress notifications and the idle proof (this server's notifications are not trusted)"
            }
        }
    }
}

/// Why the history could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    /// etcd compacted past `after + 1`: the events are gone.
    #[error("the history was compacted (at revision {compact_revision})")]
    Compacted {
        /// etcd's compact revision (0 when it did not say).
        compact_revision: i64,
    },
    /// A read failed.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    /// The watch was cancelled for another reason, or its stream ended.
    #[error("the watch ended: {0}")]
    Ended(String),
    /// The caller's sink refused a write (a full disk).
    #[error("writing the history out: {0}")]
    Sink(#[from] std::io::Error),
}

/// What [`Reading`] wants next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Keep reading.
    Read,
    /// Every event up to `upto` has come.
    Done(HistoryEnd),
    /// Run the idle proof from this revision to `upto`.
    Prove(i64),
}

/// The stop rules (module doc), fed one response at a time.
#[derive(Clone, Debug)]
pub struct Reading {
    upto: i64,
    trusted: bool,
    /// Every event up to here has come (whole revisions).
    complete: i64,
    /// Untrusted progress replies at or above `upto` since the last event.
    idle_replies: u32,
}

impl Reading {
    /// Reading `(after, upto]`; `trusted`: the server's progress notifications are.
    pub fn new(after: i64, upto: i64, trusted: bool) -> Reading {
        Reading { upto, trusted, complete: after, idle_replies: 0 }
    }

    /// Every event up to this revision has come.
    pub fn complete(&self) -> i64 {
        self.complete
    }

    /// Where a read starts (`complete + 1`), or `Done` when there is nothing to read.
    pub fn start(&self) -> Result<i64, HistoryEnd> {
        if self.upto <= self.complete {
            Err(HistoryEnd::Empty)
        } else {
            Ok(self.complete + 1)
        }
    }

    /// A response carrying the revisions `revisions` (of its events, in order); `fragment`:
    /// more pieces of its last revision follow. Returns how many of its events are within
    /// `upto` (to be kept) and what comes next.
    pub fn on_events(&mut self, revisions: &[i64], fragment: bool) -> (usize, Next) {
        self.idle_replies = 0;
        let within = revisions.iter().take_while(|&&r| r <= self.upto).count();
        if within < revisions.len() {
            self.complete = self.upto;
            return (within, Next::Done(HistoryEnd::EventPast));
        }
        if let Some(&last) = revisions.last() {
            if !fragment {
                self.complete = last;
                if last == self.upto {
                    return (within, Next::Done(HistoryEnd::EventAt));
                }
            } else if let Some(&before) = revisions.iter().rev().find(|&&r| r < last) {
                self.complete = self.complete.max(before);
            }
        }
        (within, Next::Read)
    }

    /// A progress reply (no events) at `revision`.
    pub fn on_progress(&mut self, revision: i64) -> Next {
        if revision < self.upto {
            return Next::Read;
        }
        if self.trusted {
            return Next::Done(HistoryEnd::TrustedProgress);
        }
        self.idle_replies += 1;
        if self.idle_replies >= 2 {
            self.idle_replies = 0;
            Next::Prove(self.complete)
        } else {
            Next::Read
        }
    }

    /// The idle proof's answer.
    pub fn on_proof(&mut self, proof: IdleProof) -> Result<Next, HistoryError> {
        match proof {
            IdleProof::Unchanged => {
                self.complete = self.upto;
                Ok(Next::Done(HistoryEnd::IdleProof))
            }
            // Events with an effect are still on their way.
            IdleProof::Changed => Ok(Next::Read),
            IdleProof::Compacted => Err(HistoryError::Compacted { compact_revision: 0 }),
        }
    }
}

/// What to read and how.
#[derive(Clone, Debug)]
pub struct History {
    /// The range.
    pub range: KeyRange,
    /// Writes after this revision...
    pub after: i64,
    /// ...up to and including this one.
    pub upto: i64,
    /// The server's progress notifications are trusted.
    pub trusted: bool,
    /// How often progress is asked for.
    pub progress_every: Duration,
    /// Page limits and deadline of the idle proof's reads.
    pub pager: PagerOptions,
}

/// Reads every write of `history.range` in `(after, upto]`, in revision order, into `sink`;
/// says how the end was proven. A response too large to decode is read again in fragments.
pub async fn read_history(
    client: &Client,
    history: &History,
    mut sink: impl FnMut(Written) -> std::io::Result<()>,
) -> Result<HistoryEnd, HistoryError> {
    let mut reading = Reading::new(history.after, history.upto, history.trusted);
    let mut fragment = false;
    loop {
        match read_from(client, history, &mut reading, fragment, &mut sink).await {
            Err(HistoryError::Etcd(e)) if e.fault == Fault::ResponseTooLarge && !fragment => fragment = true,
            other => return other,
        }
    }
}

async fn read_from(
    client: &Client,
    history: &History,
    reading: &mut Reading,
    fragment: bool,
    sink: &mut impl FnMut(Written) -> std::io::Result<()>,
) -> Result<HistoryEnd, HistoryError> {
    let start = match reading.start() {
        Ok(start) => start,
        Err(end) => return Ok(end),
    };
    let mut opts = WatchOptions::new()
        .with_range(history.range.end.clone())
        .with_start_revision(start)
        .with_progress_notify();
    let mut limit = WATCH_RESPONSE_LIMIT;
    if fragment {
        opts = opts.with_fragment();
        limit = FRAGMENT_RESPONSE_LIMIT;
    }
    let (mut sender, mut stream) = client
        .watch_client()
        .max_decoding_message_size(limit)
        .watch(history.range.start.clone(), Some(opts))
        .await
        .map_err(|e| EtcdError::new("history watch", Side::Source, e))?
        .split();
    let mut tick = tokio::time::interval(history.progress_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let resp: WatchResponse = tokio::select! {
            _ = tick.tick() => {
                let _ = sender.request_progress().await;
                continue;
            }
            msg = stream.message() => match msg {
                Ok(Some(resp)) => resp,
                Ok(None) => return Err(HistoryError::Ended("the stream closed".into())),
                Err(e) => return Err(EtcdError::new("history watch", Side::Source, e).into()),
            },
        };
        if resp.canceled() || resp.compact_revision() > 0 {
            if Fault::of_watch_cancel(resp.compact_revision(), resp.cancel_reason()) == Fault::Compacted {
                return Err(HistoryError::Compacted { compact_revision: resp.compact_revision() });
            }
            return Err(HistoryError::Ended(resp.cancel_reason().to_owned()));
        }
        let next = if resp.events().is_empty() {
            if resp.created() {
                continue;
            }
            reading.on_progress(resp.header().map_or(0, |h| h.revision()))
        } else {
            let revisions: Vec<i64> =
                resp.events().iter().map(|e| e.kv().map_or(0, |kv| kv.mod_revision())).collect();
            let (keep, next) = reading.on_events(&revisions, resp.0.fragment);
            for event in &resp.events()[..keep] {
                let Some(kv) = event.kv() else { continue };
                sink(match event.event_type() {
                    EventType::Put => Written::Put {
                        key: kv.key().to_vec(),
                        value: kv.value().to_vec(),
                        revision: kv.mod_revision(),
                        lease: kv.lease(),
                    },
                    EventType::Delete => {
                        Written::Delete { key: kv.key().to_vec(), revision: kv.mod_revision() }
                    }
                })?;
            }
            next
        };
        let next = match next {
            Next::Prove(from) => {
                let proof = prove_unchanged(
                    &client.kv_client(),
                    &history.range,
                    from,
                    history.upto,
                    history.pager.clone(),
                    history.pager.timeout,
                )
                .await?;
                reading.on_proof(proof)?
            }
            next => next,
        };
        if let Next::Done(end) = next {
            return Ok(end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{HistoryEnd, IdleProof, Next, Reading};

    /// Events up to `upto` are kept; one above it ends the read and is dropped.
    #[test]
    fn an_event_past_the_end_ends_it() {
        let mut r = Reading::new(10, 20, false);
        assert_eq!(r.start(), Ok(11));
        assert_eq!(r.on_events(&[12, 12, 15], false), (3, Next::Read));
        assert_eq!(r.complete(), 15);
        assert_eq!(r.on_events(&[19, 21, 22], false), (1, Next::Done(HistoryEnd::EventPast)));
    }

    /// A response ending at `upto` ends the read, unless more pieces of `upto` follow.
    #[test]
    fn the_last_revision_ends_it_once_whole() {
        let mut r = Reading::new(10, 20, false);
        assert_eq!(r.on_events(&[18, 20, 20], true), (3, Next::Read));
        assert_eq!(r.complete(), 18, "revision 20 is not whole yet");
        assert_eq!(r.on_events(&[20], false), (1, Next::Done(HistoryEnd::EventAt)));
        assert_eq!(r.complete(), 20);
    }

    /// Nothing to read when the range is asked for no revision at all.
    #[test]
    fn an_empty_window_is_done_at_once() {
        assert_eq!(Reading::new(20, 20, true).start(), Err(HistoryEnd::Empty));
        assert_eq!(Reading::new(21, 20, true).start(), Err(HistoryEnd::Empty));
    }

    /// A trusted reply at or above `upto` ends the read; below it proves nothing.
    #[test]
    fn a_trusted_reply_ends_it() {
        let mut r = Reading::new(10, 20, true);
        assert_eq!(r.on_progress(19), Next::Read);
        assert_eq!(r.on_progress(20), Next::Done(HistoryEnd::TrustedProgress));
    }

    /// Untrusted: two replies in a row, then the proof from the last whole revision; an event
    /// between the replies starts the count again; a changed range keeps reading.
    #[test]
    fn untrusted_replies_need_two_and_the_proof() {
        let mut r = Reading::new(10, 20, false);
        r.on_events(&[13], false);
        assert_eq!(r.on_progress(25), Next::Read);
        r.on_events(&[14], false);
        assert_eq!(r.on_progress(25), Next::Read, "an event came between: the count starts again");
        assert_eq!(r.on_progress(26), Next::Prove(14));
        assert_eq!(r.on_proof(IdleProof::Changed).unwrap(), Next::Read);
        assert_eq!(r.on_progress(26), Next::Read);
        assert_eq!(r.on_progress(27), Next::Prove(14));
        assert_eq!(r.on_proof(IdleProof::Unchanged).unwrap(), Next::Done(HistoryEnd::IdleProof));
        assert!(r.on_proof(IdleProof::Compacted).is_err());
    }
}
