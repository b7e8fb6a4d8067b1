//! Grouping source events into target Txns without ever splitting a revision (G2).

use std::collections::{HashSet, VecDeque};

use etcd_client::EventType;
use mirror_core::{KeyRewriter, Op};

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

/// Every in-scope event of one source revision. May be empty (all its events were excluded);
/// it still moves the watermark.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revision {
    /// The source revision.
    pub revision: i64,
    /// Its target ops, in event order.
    pub ops: Vec<Op>,
}

impl Revision {
    /// Request bytes of all ops.
    pub fn size(&self) -> usize {
        self.ops.iter().map(Op::size).sum()
    }
}

/// Whole revisions to commit in one Txn.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// In revision order.
    pub revisions: Vec<Revision>,
}

impl Batch {
    /// The watermark after this batch lands.
    pub fn last_revision(&self) -> i64 {
        self.revisions.last().map_or(0, |r| r.revision)
    }

    /// Ops in order.
    pub fn ops(&self) -> impl Iterator<Item = &Op> {
        self.revisions.iter().flat_map(|r| r.ops.iter())
    }

    /// Number of ops.
    pub fn op_count(&self) -> usize {
        self.revisions.iter().map(|r| r.ops.len()).sum()
    }

    /// The batch split into one batch per revision, for the retry after the target refused the
    /// merged Txn as too big.
    pub fn split(self) -> Vec<Batch> {
        self.revisions.into_iter().map(|r| Batch { revisions: vec![r] }).collect()
    }
}

/// Packs whole revisions into Txn-sized batches (SPEC §5 "Batching").
///
/// A pending batch is flushed before a revision when adding it would pass the op limit minus
/// one (one slot is the checkpoint's) or `txn_flush_bytes`, or when it touches a key already
/// pending (etcd refuses a key twice in one Txn). The caller also flushes at the end of each
/// group of watch responses it commits together with [`RevisionBatcher::take`]. A single revision over the limits forms a
/// batch of its own; whether the target accepts it is the target's call.
#[derive(Debug)]
pub struct RevisionBatcher {
    max_ops: usize,
    max_bytes: usize,
    pending: Vec<Revision>,
    ops: usize,
    bytes: usize,
    keys: HashSet<Vec<u8>>,
}

impl RevisionBatcher {
    /// `max_txn_ops` as configured (>= 2); `flush_bytes` > 0.
    pub fn new(max_txn_ops: usize, flush_bytes: usize) -> RevisionBatcher {
        RevisionBatcher {
            max_ops: max_txn_ops.saturating_sub(1).max(1),
            max_bytes: flush_bytes.max(1),
            pending: Vec::new(),
            ops: 0,
            bytes: 0,
            keys: HashSet::new(),
        }
    }

    /// Adds a revision; returns the batch that must be committed *before* it, if any.
    pub fn push(&mut self, rev: Revision) -> Option<Batch> {
        let size = rev.size();
        let must_flush = !self.pending.is_empty()
            && (self.ops + rev.ops.len() > self.max_ops
                || self.bytes + size > self.max_bytes
                || rev.ops.iter().any(|op| self.keys.contains(op.key())));
        let flushed = if must_flush { self.take() } else { None };
        self.ops += rev.ops.len();
        self.bytes += size;
        self.keys.extend(rev.ops.iter().map(|op| op.key().to_vec()));
        self.pending.push(rev);
        flushed
    }

    /// Takes whatever is pending.
    pub fn take(&mut self) -> Option<Batch> {
        if self.pending.is_empty() {
            return None;
        }
        self.ops = 0;
        self.bytes = 0;
        self.keys.clear();
        Some(Batch { revisions: std::mem::take(&mut self.pending) })
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

/// Independent ops (scan puts, repairs, prune deletes: no revision to keep whole) packed into
/// Txns by op count *and* bytes, checked before an op is added, so a chunk of large values never
/// passes `max_bytes` unless one op alone does.
#[derive(Debug)]
pub struct OpChunker {
    max_ops: usize,
    max_bytes: usize,
    ops: Vec<Op>,
    bytes: usize,
}

impl OpChunker {
    /// Chunks of at most `max_ops` ops and `max_bytes` bytes (each at least 1).
    pub fn new(max_ops: usize, max_bytes: usize) -> OpChunker {
        OpChunker { max_ops: max_ops.max(1), max_bytes: max_bytes.max(1), ops: Vec::new(), bytes: 0 }
    }

    /// Adds `op`; returns the full chunk to write first when `op` would not fit beside it.
    pub fn push(&mut self, op: Op) -> Option<Vec<Op>> {
        let size = op.size();
        let full =
            !self.ops.is_empty() && (self.ops.len() + 1 > self.max_ops || self.bytes + size > self.max_bytes);
        let flushed = if full { self.take() } else { None };
        self.bytes += size;
        self.ops.push(op);
        flushed
    }

    /// Takes whatever is pending.
    pub fn take(&mut self) -> Option<Vec<Op>> {
        self.bytes = 0;
        (!self.ops.is_empty()).then(|| std::mem::take(&mut self.ops))
    }

    /// Ops pending.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
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
            grouped.push_back(Revision { revision: rev, ops: Vec::new() });
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
                Op::Put { key, value: kv.value().to_vec() }
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
        let put = Op::Put { key: b"m".to_vec(), value: b"v".to_vec() };
        let ops = vec![del("a"), del("b"), del("c"), put.clone(), del("n"), del("d"), del("e")];
        let folded = fold_delete_runs(ops);
        assert_eq!(folded, vec![run("a", "c", 3), put.clone(), del("n"), run("d", "e", 2)]);
        assert_eq!(fold_delete_runs(folded.clone()), folded);
        let more = fold_delete_runs(vec![run("a", "c", 3), del("d"), run("e", "g", 3)]);
        assert_eq!(more, vec![run("a", "g", 7)]);
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

    /// A chunk is flushed *before* the op that would pass the byte limit, and by op count.
    #[test]
    fn op_chunker_checks_bytes_before_adding() {
        let put = |n: usize| Op::Put { key: b"k".to_vec(), value: vec![0; n] };
        let mut c = super::OpChunker::new(10, 1000);
        assert!(c.push(put(600)).is_none());
        let first = c.push(put(600)).expect("600 + 600 would pass 1000");
        assert_eq!(first.len(), 1);
        let mut c = super::OpChunker::new(2, 1 << 20);
        assert!(c.push(put(1)).is_none() && c.push(put(1)).is_none());
        assert_eq!(c.push(put(1)).map(|v| v.len()), Some(2));
        assert_eq!(c.take().map(|v| v.len()), Some(1));
        assert!(c.take().is_none());
    }

    use proptest::prelude::*;

    use super::*;

    fn put(k: &str, v: usize) -> Op {
        Op::Put { key: k.as_bytes().to_vec(), value: vec![b'v'; v] }
    }

    fn rev(r: i64, ops: Vec<Op>) -> Revision {
        Revision { revision: r, ops }
    }

    /// A revision that would pass max_txn_ops - 1 starts a new batch.
    #[test]
    fn flushes_on_op_limit_keeping_a_checkpoint_slot() {
        let mut b = RevisionBatcher::new(4, 1 << 20);
        assert!(b.push(rev(1, vec![put("a", 1), put("b", 1)])).is_none());
        let flushed = b.push(rev(2, vec![put("c", 1), put("d", 1)])).expect("3 data ops max");
        assert_eq!(flushed.last_revision(), 1);
        assert_eq!(b.take().unwrap().last_revision(), 2);
    }

    /// A key already pending forces a flush (etcd refuses duplicate keys in a Txn).
    #[test]
    fn flushes_on_duplicate_key() {
        let mut b = RevisionBatcher::new(128, 1 << 20);
        assert!(b.push(rev(1, vec![put("a", 1)])).is_none());
        assert!(b.push(rev(2, vec![put("b", 1)])).is_none());
        let flushed = b.push(rev(3, vec![Op::Delete { key: b"a".to_vec() }])).unwrap();
        assert_eq!(flushed.revisions.len(), 2);
    }

    /// Bytes bound a batch too.
    #[test]
    fn flushes_on_bytes() {
        let mut b = RevisionBatcher::new(128, 100);
        assert!(b.push(rev(1, vec![put("a", 60)])).is_none());
        assert!(b.push(rev(2, vec![put("b", 60)])).is_some());
    }

    /// An oversized revision is never split: it forms a batch alone.
    #[test]
    fn oversized_revision_goes_alone() {
        let mut b = RevisionBatcher::new(4, 1 << 20);
        assert!(b.push(rev(1, vec![put("x", 1)])).is_none());
        let big = rev(2, (0..10).map(|i| put(&format!("k{i}"), 1)).collect());
        assert_eq!(b.push(big).unwrap().last_revision(), 1);
        let alone = b.push(rev(3, vec![put("y", 1)])).unwrap();
        assert_eq!(alone.revisions.len(), 1);
        assert_eq!(alone.op_count(), 10);
    }

    proptest! {
        /// Whatever the sizes, batches are whole revisions in order, none is lost, and a batch
        /// of several revisions respects both limits and has no duplicate key.
        #[test]
        fn batches_never_split_or_drop_revisions(
            revs in prop::collection::vec(prop::collection::vec((0u8..8, 0usize..50), 0..6), 1..40),
            max_ops in 2usize..10,
            max_bytes in 50usize..300,
        ) {
            let mut b = RevisionBatcher::new(max_ops, max_bytes);
            let input: Vec<Revision> = revs.iter().enumerate().map(|(i, ops)| {
                let mut seen = HashSet::new();
                let ops = ops.iter().filter(|(k, _)| seen.insert(*k)).map(|(k, v)| put(&format!("k{k}"), *v)).collect();
                rev(i as i64 + 1, ops)
            }).collect();
            let mut batches = Vec::new();
            for r in input.clone() {
                batches.extend(b.push(r));
            }
            batches.extend(b.take());
            let flat: Vec<Revision> = batches.iter().flat_map(|b| b.revisions.clone()).collect();
            prop_assert_eq!(&flat, &input);
            for batch in &batches {
                if batch.revisions.len() > 1 {
                    prop_assert!(batch.op_count() < max_ops);
                    prop_assert!(batch.ops().map(Op::size).sum::<usize>() <= max_bytes);
                    let keys: HashSet<_> = batch.ops().map(Op::key).collect();
                    prop_assert_eq!(keys.len(), batch.op_count());
                }
            }
        }
    }
}
