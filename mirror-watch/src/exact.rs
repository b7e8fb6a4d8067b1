//! Exact mode's revision source (SPEC §10): a watch of the whole keyspace with prev_kv, read
//! as whole source revisions in order, each checked to follow the one before.
//!
//! ## Why a missing revision number is loss, never a gap
//! etcd adds a revision only for a write that changes something (`storeTxnWrite.End`), so every
//! revision has at least one event, and a watch of every key sees each one. A revision number
//! that does not follow the last one means events were not delivered: the replica would be
//! wrong from there on, so the watch reports it ([`ExactError::Missing`]) and the link stops.
//! etcd cuts its batches at revision boundaries, so a revision's events arrive in one response,
//! unless the agent's client cut that response into pieces flagged `fragment`
//! ([`mirror_core::watch_split`]: one over 1 MiB): a revision cut so is joined here and
//! delivered whole. A revision number repeated in any other way is refused.

use etcd_client::{Client, Event, EventType, WatchOptions, WatchResponse, WatchResponseStream};
use mirror_core::{Change, EtcdError, ExactRevision, Fault, Side, RESERVED_MARKER};

/// What one read of the watch delivered.
#[derive(Debug)]
pub enum ExactDelivery {
    /// Whole revisions, in order, each the one after the last delivered.
    Revisions {
        /// The revisions.
        revisions: Vec<ExactRevision>,
        /// The response header's revision: the source's revision when it was sent, which
        /// clients of the source may have seen (a catching-up watch's is ahead of its events).
        header: i64,
    },
    /// A response without events (created, or progress) at this source revision.
    Reply(i64),
    /// etcd compacted past the watch's next revision: the history the replica needs is gone.
    Compacted(i64),
}

/// The watch broke the replica's rule, or ended.
#[derive(Debug, thiserror::Error)]
pub enum ExactError {
    /// A revision number was skipped (or went back): events were lost.
    #[error(
        "source revision {expected} was expected next on the watch of the whole keyspace, {got} came: {why}"
    )]
    Missing {
        /// The revision that should have come.
        expected: i64,
        /// The one that came.
        got: i64,
        /// In words.
        why: &'static str,
    },
    /// etcd cancelled the watch for another reason, or the stream ended or failed.
    #[error("the source watch ended: {0}")]
    Ended(String),
}

/// The open watch and the next revision it must deliver.
pub struct ExactWatch {
    /// For opening the watch again in etcd's fragments.
    client: Client,
    /// Whether etcd was asked for fragments (after a response over the decode limit).
    fragment: bool,
    stream: WatchResponseStream,
    _sender: etcd_client::WatchRequestSender,
    next: i64,
    /// The last revision of a response flagged `fragment`: its events may go on in the next.
    held: Option<ExactRevision>,
}

impl ExactWatch {
    /// Watches every key of the source from `start`, with prev_kv and progress notifications.
    pub async fn open(client: &mut Client, start: i64) -> Result<ExactWatch, EtcdError> {
        ExactWatch::open_with(client.clone(), start, false).await
    }

    /// [`ExactWatch::open`], asking etcd for fragments or not. A response over
    /// [`crate::WATCH_RESPONSE_LIMIT`] (a catch-up after downtime bundles up to 1 000 revisions,
    /// each with its prev_kv) makes [`ExactWatch::next`] open it again with fragments, as the
    /// compact engine does ([`crate::open_watch`]).
    async fn open_with(client: Client, start: i64, fragment: bool) -> Result<ExactWatch, EtcdError> {
        let mut opts = WatchOptions::new()
            .with_range(vec![0])
            .with_start_revision(start)
            .with_prev_key()
            .with_progress_notify();
        let mut limit = crate::WATCH_RESPONSE_LIMIT;
        if fragment {
            opts = opts.with_fragment();
            limit = crate::FRAGMENT_RESPONSE_LIMIT;
        }
        let stream = client
            .watch_client()
            .max_decoding_message_size(limit)
            .watch(vec![0], Some(opts))
            .await
            .map_err(|e| EtcdError::new("open exact watch", Side::Source, e))?;
        let (sender, stream) = stream.split();
        Ok(ExactWatch { client, fragment, stream, _sender: sender, next: start, held: None })
    }

    /// The next response, as revisions checked to follow each other.
    pub async fn next(&mut self) -> Result<ExactDelivery, ExactError> {
        loop {
            let resp = match self.stream.message().await {
                Ok(Some(resp)) => resp,
                Ok(None) => return Err(ExactError::Ended("closed by the server".into())),
                Err(e) => {
                    let e = EtcdError::new("exact watch", Side::Source, e);
                    if e.fault != Fault::ResponseTooLarge || self.fragment {
                        return Err(ExactError::Ended(e.to_string()));
                    }
                    // Nothing of that response was delivered: from the first revision not
                    // delivered whole, in etcd's fragments from now on.
                    let from = self.held.take().map_or(self.next, |held| held.revision);
                    tracing::warn!(
                        from,
                        "an exact watch response was over the decode limit; watching in fragments from now on"
                    );
                    let client = self.client.clone();
                    *self = ExactWatch::open_with(client, from, true)
                        .await
                        .map_err(|e| ExactError::Ended(e.to_string()))?;
                    continue;
                }
            };
            match deliver(&resp, &mut self.next, &mut self.held)? {
                // A fragment whose one revision goes on in the next response.
                ExactDelivery::Revisions { revisions, .. } if revisions.is_empty() => continue,
                delivery => return Ok(delivery),
            }
        }
    }
}

/// One response as a delivery; `next` is the revision that must come first, moved past what
/// was delivered. `held` carries the last revision of a response flagged `fragment` into the
/// next response (whose first events may belong to it): it is delivered once whole.
pub fn deliver(
    resp: &WatchResponse,
    next: &mut i64,
    held: &mut Option<ExactRevision>,
) -> Result<ExactDelivery, ExactError> {
    if resp.compact_revision() > 0 {
        return Ok(ExactDelivery::Compacted(resp.compact_revision()));
    }
    if resp.canceled() {
        return Err(ExactError::Ended(format!("cancelled: {}", resp.cancel_reason())));
    }
    let header = resp.header().map_or(0, |h| h.revision());
    if resp.events().is_empty() {
        return Ok(ExactDelivery::Reply(header));
    }
    // etcd-client exposes the `fragment` flag only through the raw message.
    let mut revisions = exact_revisions(resp.events(), next, held.take())?;
    if resp.0.fragment {
        *held = revisions.pop();
    }
    Ok(ExactDelivery::Revisions { revisions, header })
}

/// Events grouped into revisions, reserved keys (`\0etcd-mirror/...`, other links' records)
/// left out of the changes but their revision kept; each revision must be `next`, except that
/// the first events may go on with `carry` (a revision begun in a fragment before).
pub fn exact_revisions(
    events: &[Event],
    next: &mut i64,
    carry: Option<ExactRevision>,
) -> Result<Vec<ExactRevision>, ExactError> {
    let mut out: Vec<ExactRevision> = carry.into_iter().collect();
    for event in events {
        let Some(kv) = event.kv() else { continue };
        let revision = kv.mod_revision();
        if out.last().is_none_or(|r| r.revision != revision) {
            if revision != *next {
                let why = if revision > *next {
                    "revisions in between were never delivered"
                } else {
                    "a revision came twice, or in two responses"
                };
                return Err(ExactError::Missing { expected: *next, got: revision, why });
            }
            out.push(ExactRevision { revision, changes: Vec::new() });
            *next = revision + 1;
        }
        if kv.key().starts_with(RESERVED_MARKER.as_bytes()) {
            continue;
        }
        let change = match event.event_type() {
            EventType::Put => Change::Put {
                key: kv.key().to_vec(),
                value: kv.value().to_vec(),
                lease: kv.lease(),
                version: kv.version(),
                create_revision: kv.create_revision(),
                prev_lease: event.prev_kv().map_or(0, |p| p.lease()),
            },
            EventType::Delete => Change::Delete {
                key: kv.key().to_vec(),
                prev_mod_revision: event.prev_kv().map(|p| p.mod_revision()),
                prev_lease: event.prev_kv().map_or(0, |p| p.lease()),
            },
        };
        out.last_mut().expect("pushed above").changes.push(change);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use etcd_client::proto::{PbEvent, PbKeyValue, PbWatchResponse};

    use super::*;

    fn put(key: &str, revision: i64, version: i64) -> PbEvent {
        let kv = PbKeyValue {
            key: key.into(),
            value: b"v".to_vec(),
            mod_revision: revision,
            create_revision: revision - version + 1,
            version,
            lease: 7,
        };
        PbEvent { kv: Some(kv), ..Default::default() }
    }

    fn del(key: &str, revision: i64, prev: i64) -> PbEvent {
        let kv = PbKeyValue { key: key.into(), mod_revision: revision, ..Default::default() };
        let prev_kv =
            PbKeyValue { key: key.into(), mod_revision: prev, version: 1, lease: 7, ..Default::default() };
        PbEvent { r#type: 1, kv: Some(kv), prev_kv: Some(prev_kv) }
    }

    fn response(events: Vec<PbEvent>) -> WatchResponse {
        WatchResponse(PbWatchResponse { events, ..Default::default() })
    }

    /// Events become whole revisions in order, with the source's view of each key; a revision
    /// of reserved keys only (another link's record) keeps its number with no changes.
    #[test]
    fn events_become_revisions_that_follow_each_other() {
        let mut next = 10;
        let got = deliver(
            &response(vec![
                put("/a", 10, 1),
                put("/b", 10, 3),
                put("\0etcd-mirror/x/checkpoint", 11, 4),
                del("/a", 12, 10),
            ]),
            &mut next,
            &mut None,
        )
        .unwrap();
        let ExactDelivery::Revisions { revisions: revs, .. } = got else { panic!("{got:?}") };
        assert_eq!(
            revs.iter().map(|r| (r.revision, r.changes.len())).collect::<Vec<_>>(),
            [(10, 2), (11, 0), (12, 1)]
        );
        assert_eq!(
            revs[0].changes[1],
            Change::Put {
                key: b"/b".to_vec(),
                value: b"v".to_vec(),
                lease: 7,
                version: 3,
                create_revision: 8,
                prev_lease: 0
            }
        );
        assert_eq!(
            revs[2].changes[0],
            Change::Delete { key: b"/a".to_vec(), prev_mod_revision: Some(10), prev_lease: 7 }
        );
        assert_eq!(next, 13);
    }

    /// A revision cut across responses flagged `fragment` (mirror-core's watch_split cuts one
    /// over 1 MiB) is delivered once, whole, with the revision after it; without the flag the
    /// same second half is a repeat and refused.
    #[test]
    fn a_revision_cut_into_fragments_is_joined() {
        let fragment = |events| {
            let mut resp = response(events);
            resp.0.fragment = true;
            resp
        };
        let (mut next, mut held) = (10, None);
        let first =
            deliver(&fragment(vec![put("/a", 10, 1), put("/b", 11, 1)]), &mut next, &mut held).unwrap();
        let ExactDelivery::Revisions { revisions, .. } = first else { panic!("{first:?}") };
        assert_eq!(revisions.iter().map(|r| r.revision).collect::<Vec<_>>(), [10]);
        let second = deliver(&fragment(vec![put("/c", 11, 1)]), &mut next, &mut held).unwrap();
        assert!(matches!(&second, ExactDelivery::Revisions { revisions, .. } if revisions.is_empty()));
        let last =
            deliver(&response(vec![put("/d", 11, 1), del("/a", 12, 10)]), &mut next, &mut held).unwrap();
        let ExactDelivery::Revisions { revisions, .. } = last else { panic!("{last:?}") };
        assert_eq!(
            revisions.iter().map(|r| (r.revision, r.changes.len())).collect::<Vec<_>>(),
            [(11, 3), (12, 1)]
        );
        assert!(held.is_none());
        assert_eq!(next, 13);
        let err = deliver(&response(vec![put("/e", 12, 1)]), &mut next, &mut held).unwrap_err();
        assert!(matches!(err, ExactError::Missing { expected: 13, got: 12, .. }), "{err}");
    }

    /// A skipped revision number is loss, and a revision repeated (or split across two
    /// responses) is refused too: nothing of the offending response is delivered.
    #[test]
    fn a_missing_or_repeated_revision_is_refused() {
        let mut next = 10;
        let err =
            deliver(&response(vec![put("/a", 10, 1), put("/a", 12, 2)]), &mut next, &mut None).unwrap_err();
        assert!(matches!(err, ExactError::Missing { expected: 11, got: 12, .. }), "{err}");
        let mut next = 11;
        let err = deliver(&response(vec![put("/a", 10, 1)]), &mut next, &mut None).unwrap_err();
        assert!(matches!(err, ExactError::Missing { expected: 11, got: 10, .. }), "{err}");
    }

    /// A compaction past the watch is a value of its own, never mistaken for an empty reply.
    #[test]
    fn a_compaction_is_delivered_as_such() {
        let resp =
            WatchResponse(PbWatchResponse { compact_revision: 40, canceled: true, ..Default::default() });
        assert!(matches!(deliver(&resp, &mut 30, &mut None), Ok(ExactDelivery::Compacted(40))));
    }
}
