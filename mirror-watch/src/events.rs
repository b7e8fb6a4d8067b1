//! Source events into whole target revisions: grouping a watch response by revision, joining
//! a revision cut across fragments, and holding a revision of very many deletes as runs.

use std::collections::VecDeque;

use etcd_client::EventType;
use mirror_core::{KeyRewriter, Op};

use crate::Revision;

/// Delete ops one revision may hold key by key at the default `watch_buffer_bytes` (16 MiB);
/// past this its deletes are kept as runs ([`Op::DeleteRun`]). Individual deletes of more bytes
/// than this could not go into one Txn at etcd's default request limit (1.5 MiB) anyway.
pub const HELD_DELETE_BYTES: usize = 2 << 20;

/// The bytes of ops one revision is held as key by key before its deletes fold into runs: an
/// eighth of `watch_buffer_bytes` (so [`HELD_DELETE_BYTES`] at its default). In memory an op
/// costs about 2.5 x its [`Op::size`], and the Txn built from it twice more, so this keeps a
/// huge revision within the watch buffer's budget. An operator whose revisions of scattered
/// deletes (a lease revoke whose keys interleave with keys that stay) do not fold raises
/// `watch_buffer_bytes`, and the target's `--max-request-bytes` that must take them in one Txn.
pub fn held_revision_bytes(watch_buffer_bytes: u64) -> usize {
    usize::try_from(watch_buffer_bytes / 8).unwrap_or(usize::MAX).max(1)
}

/// `ops` with every stretch of deletes in increasing key order (and runs already made) folded
/// into one [`Op::DeleteRun`]; puts and ranges stay where they are.
pub fn fold_delete_runs(ops: Vec<Op>) -> Vec<Op> {
    let mut out = Vec::new();
    let mut run: Option<(Vec<u8>, Vec<u8>, u64)> = None;
    let close = |run: &mut Option<(Vec<u8>, Vec<u8>, u64)>, out: &mut Vec<Op>| match run.take() {
        Some((key, _, 1)) => out.push(Op::Delete { key }),
        Some((key, last, count)) => out.push(Op::DeleteRun { key, last, count }),
        None => {}
    };
    for op in ops {
        let (first, last, count) = match op {
            Op::Delete { key } => (key.clone(), key, 1),
            Op::DeleteRun { key, last, count } => (key, last, count),
            other => {
                close(&mut run, &mut out);
                out.push(other);
                continue;
            }
        };
        match run.as_mut() {
            Some((_, run_last, run_count)) if first > *run_last => {
                *run_last = last;
                *run_count += count;
            }
            _ => {
                close(&mut run, &mut out);
                run = Some((first, last, count));
            }
        }
    }
    close(&mut run, &mut out);
    out
}

/// Source events of one watch response turned into target revisions.
#[derive(Debug, Default)]
pub struct Converted {
    /// Revisions above the floor, in order.
    pub revisions: Vec<Revision>,
    /// Puts of keys that carried a lease (stripped in the target).
    pub leased: u64,
}

/// Groups events by revision, rewrites keys, drops out-of-scope events and every revision at
/// or below `floor` (already applied: a replayed duplicate is a no-op).
/// A revision whose ops pass `hold` bytes is folded into delete runs as it is read (see
/// [`held_revision_bytes`]).
pub fn convert_events(
    events: &[etcd_client::Event],
    rewriter: &KeyRewriter,
    floor: i64,
    hold: usize,
) -> Converted {
    let mut out = Converted::default();
    let mut grouped: VecDeque<Revision> = VecDeque::new();
    // Bytes of the current revision's ops, and the size at which they are folded into runs
    // next (doubling past what a fold left, so scattered deletes are not folded again and again).
    let (mut bytes, mut fold_at) = (0usize, hold);
    for ev in events {
        let Some(kv) = ev.kv() else { continue };
        let rev = kv.mod_revision();
        if rev <= floor {
            continue;
        }
        if grouped.back().is_none_or(|r| r.revision != rev) {
            // Room for one op: most revisions hold one, and an empty Vec's first push makes
            // room for four.
            grouped.push_back(Revision { revision: rev, ops: Vec::with_capacity(1) });
            (bytes, fold_at) = (0, hold);
        }
        if bytes > fold_at {
            // One revision of very many deletes in one response: hold it as runs while it is
            // read, not only once it is complete.
            let current = grouped.back_mut().expect("pushed above");
            current.ops = fold_delete_runs(std::mem::take(&mut current.ops));
            bytes = current.size();
            fold_at = hold.max(2 * bytes);
        }
        let Some(key) = rewriter.to_target(kv.key()) else { continue };
        let op = match ev.event_type() {
            EventType::Put => {
                if kv.lease() != 0 {
                    out.leased += 1;
                }
                Op::Put { key, value: kv.value().to_vec(), lease: kv.lease() }
            }
            EventType::Delete => Op::Delete { key },
        };
        bytes += op.size();
        grouped.back_mut().expect("pushed above").ops.push(op);
    }
    out.revisions = grouped.into();
    out
}

/// Joins the responses of a fragmented watch (etcd's `fragment` option: a response larger
/// than the server's request limit comes in pieces, each flagged `fragment` but the last). A
/// piece ends between events, so one revision may span two pieces: the last revision of a
/// piece is held back until the next piece shows whether it goes on. So no response is ever
/// decoded larger than the server's `--max-request-bytes`, and a revision is never split
/// (convert_events's floor would otherwise drop its second half as a duplicate).
#[derive(Debug)]
pub struct Fragments {
    pending: Option<Revision>,
    /// See [`held_revision_bytes`].
    hold: usize,
}

impl Fragments {
    /// Joins pieces, folding a revision past `hold` bytes into delete runs.
    pub fn new(hold: usize) -> Fragments {
        Fragments { pending: None, hold }
    }

    /// [`convert_events`] of one watch response, joined with the pieces before it.
    pub fn convert(
        &mut self,
        resp: &etcd_client::WatchResponse,
        rewriter: &KeyRewriter,
        floor: i64,
    ) -> Converted {
        // etcd-client exposes the `fragment` flag only through the raw message.
        self.join(convert_events(resp.events(), rewriter, floor, self.hold), resp.0.fragment)
    }

    /// The whole revisions of one response, given whether it is a fragment (more follow).
    pub fn join(&mut self, mut converted: Converted, fragment: bool) -> Converted {
        if let Some(mut held) = self.pending.take() {
            match converted.revisions.first_mut() {
                Some(first) if first.revision == held.revision => {
                    held.ops.append(&mut first.ops);
                    *first = held;
                }
                _ => converted.revisions.insert(0, held),
            }
        }
        // A revision of many deletes (a `del --prefix`, a lease revoke) is held as runs, not
        // keys (issue #27: 300 000 deletes held key by key, cloned and encoded took the agent
        // to 533 MiB), whether it came whole or is still arriving in pieces.
        for revision in &mut converted.revisions {
            if revision.size() > self.hold {
                revision.ops = fold_delete_runs(std::mem::take(&mut revision.ops));
            }
        }
        if fragment {
            self.pending = converted.revisions.pop();
        }
        converted
    }

    /// Bytes held back (a part of one revision).
    pub fn held_bytes(&self) -> usize {
        self.pending.as_ref().map_or(0, |r| r.ops.iter().map(Op::size).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stretches of deletes in key order fold into runs; puts end them, a key out of order starts
    /// a new one, a run of one stays a delete, and folding twice changes nothing.
    #[test]
    fn delete_runs_fold_stretches_in_key_order() {
        let del = |k: &str| Op::Delete { key: k.as_bytes().to_vec() };
        let run = |a: &str, b: &str, count| Op::DeleteRun {
            key: a.as_bytes().to_vec(),
            last: b.as_bytes().to_vec(),
            count,
        };
        let put = Op::Put { key: b"m".to_vec(), value: b"v".to_vec(), lease: 0 };
        let ops = vec![del("a"), del("b"), del("c"), put.clone(), del("n"), del("d"), del("e")];
        let folded = fold_delete_runs(ops);
        assert_eq!(folded, vec![run("a", "c", 3), put.clone(), del("n"), run("d", "e", 2)]);
        assert_eq!(fold_delete_runs(folded.clone()), folded);
        let more = fold_delete_runs(vec![run("a", "c", 3), del("d"), run("e", "g", 3)]);
        assert_eq!(more, vec![run("a", "g", 7)]);
    }

    /// One response's events come out grouped by revision, in order, keys rewritten: revisions
    /// at or below the floor are dropped (a replayed duplicate), an out-of-scope key is dropped
    /// but its revision stays, empty (the watermark still moves past it), and a leased put is
    /// counted.
    #[test]
    fn events_are_grouped_by_revision_above_the_floor() {
        use etcd_client::proto::{PbEvent, PbKeyValue, PbWatchResponse};
        let (put, del) = (0, 1);
        let ev = |kind: i32, key: &str, mod_revision: i64, lease: i64| PbEvent {
            r#type: kind,
            kv: Some(PbKeyValue {
                key: key.into(),
                value: b"v".to_vec(),
                mod_revision,
                lease,
                ..Default::default()
            }),
            ..Default::default()
        };
        let events = vec![
            ev(put, "/a/old", 3, 0),
            ev(put, "/a/x", 4, 0),
            ev(del, "/a/y", 4, 0),
            ev(put, "/elsewhere", 5, 0),
            ev(put, "/a/z", 6, 7),
        ];
        let resp = etcd_client::WatchResponse(PbWatchResponse { events, ..Default::default() });
        let rewriter = KeyRewriter::new(b"/a/", b"/b/", []);
        let out = convert_events(resp.events(), &rewriter, 3, HELD_DELETE_BYTES);
        let target_put = |k: &str, lease| Op::Put { key: k.into(), value: b"v".to_vec(), lease };
        let want = vec![
            Revision { revision: 4, ops: vec![target_put("/b/x", 0), Op::Delete { key: b"/b/y".to_vec() }] },
            Revision { revision: 5, ops: vec![] },
            Revision { revision: 6, ops: vec![target_put("/b/z", 7)] },
        ];
        assert_eq!(out.revisions, want);
        assert_eq!(out.leased, 1);
    }

    /// A revision spanning fragments comes out whole and once; one that ends with its fragment
    /// is held only until the next shows it did; a last piece releases everything.
    #[test]
    fn fragments_join_a_revision_split_across_responses() {
        let rev = |revision: i64, keys: &[&str]| Revision {
            revision,
            ops: keys.iter().map(|k| Op::Delete { key: k.as_bytes().to_vec() }).collect(),
        };
        let of = |revisions: Vec<Revision>| Converted { revisions, leased: 0 };
        let revs = |c: &Converted| c.revisions.iter().map(|r| (r.revision, r.ops.len())).collect::<Vec<_>>();
        let mut f = Fragments::new(HELD_DELETE_BYTES);
        let out = f.join(of(vec![rev(5, &["a"]), rev(6, &["b", "c"])]), true);
        assert_eq!(revs(&out), vec![(5, 1)], "6 may go on in the next piece");
        let out = f.join(of(vec![rev(6, &["d"]), rev(7, &["e"])]), true);
        assert_eq!(revs(&out), vec![(6, 3)]);
        let out = f.join(of(vec![rev(8, &["f"])]), false);
        assert_eq!(revs(&out), vec![(7, 1), (8, 1)]);
        assert_eq!(f.held_bytes(), 0);
        // A piece wholly inside one revision.
        let mut f = Fragments::new(HELD_DELETE_BYTES);
        assert!(f.join(of(vec![rev(9, &["a"])]), true).revisions.is_empty());
        assert!(f.join(of(vec![rev(9, &["b"])]), true).revisions.is_empty());
        assert_eq!(revs(&f.join(of(vec![rev(9, &["c"])]), false)), vec![(9, 3)]);
    }
}
