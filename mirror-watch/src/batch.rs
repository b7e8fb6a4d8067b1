//! Grouping source events into target Txns without ever splitting a revision (G2).

use std::collections::HashSet;

use mirror_core::Op;

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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn put(k: &str, v: usize) -> Op {
        Op::Put { key: k.as_bytes().to_vec(), value: vec![b'v'; v], lease: 0 }
    }

    fn rev(r: i64, ops: Vec<Op>) -> Revision {
        Revision { revision: r, ops }
    }

    /// A split keeps every revision whole, in order, one batch each, with an empty revision
    /// (all its events excluded) kept too: the retry after the target refused the merged Txn
    /// as too big commits the same revisions, and each batch's watermark is its revision.
    #[test]
    fn split_keeps_revisions_whole_and_in_order() {
        let merged = Batch {
            revisions: vec![
                rev(3, vec![put("a", 1), put("b", 1)]),
                rev(4, vec![]),
                rev(5, vec![put("c", 1)]),
            ],
        };
        let parts = merged.clone().split();
        assert_eq!(parts.iter().map(Batch::last_revision).collect::<Vec<_>>(), vec![3, 4, 5]);
        assert!(parts.iter().all(|b| b.revisions.len() == 1));
        let rejoined: Vec<Revision> = parts.into_iter().flat_map(|b| b.revisions).collect();
        assert_eq!(rejoined, merged.revisions);
    }

    /// A revision that would pass max_txn_ops - 1 starts a new batch.
    #[test]
    fn flushes_on_op_limit_keeping_a_checkpoint_slot() {
        let mut b = RevisionBatcher::new(4, 1 << 20);
        assert!(b.push(rev(1, vec![put("a", 1), put("b", 1)])).is_none());
        let flushed = b.push(rev(2, vec![put("c", 1), put("d", 1)])).expect("3 data ops max");
        assert_eq!(flushed.last_revision(), 1);
        assert_eq!(b.take().unwrap().last_revision(), 2);
        // The boundary itself: exactly max_txn_ops - 1 data ops are held without a flush, one
        // more flushes them as they were.
        let mut b = RevisionBatcher::new(4, 1 << 20);
        assert!(b.push(rev(1, vec![put("a", 1), put("b", 1), put("c", 1)])).is_none(), "3 of 4 fit");
        let flushed = b.push(rev(2, vec![put("d", 1)])).expect("a 4th data op leaves no checkpoint slot");
        assert_eq!((flushed.last_revision(), flushed.revisions.len()), (1, 1));
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
