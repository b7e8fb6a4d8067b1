//! One target write, already rewritten: the unit every crate that reads a source and writes a
//! target speaks (the watch's events, the scan's pages, the reconcile's repairs).

use etcd_client::TxnOp;

/// One target write, already rewritten.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Put `value` at `key`.
    Put {
        /// Target key.
        key: Vec<u8>,
        /// Value.
        value: Vec<u8>,
        /// The source key's lease (0: none). Written to the target only where leases are
        /// preserved ([`Op::to_txn_op_with`]); stripped otherwise.
        lease: i64,
    },
    /// Delete `key`.
    Delete {
        /// Target key.
        key: Vec<u8>,
    },
    /// Delete every key in `[key, end)`: a run of deletes coalesced after the agent checked
    /// that the target holds exactly those keys in the range.
    DeleteRange {
        /// First target key.
        key: Vec<u8>,
        /// First key after the range.
        end: Vec<u8>,
    },
    /// `count` deletes of one revision, in key order from `key` to `last`, whose keys between
    /// were not kept (mirror-watch's `Fragments` bounds what one revision holds). Not yet an op etcd can take:
    /// the agent checks that the target holds exactly `count` keys in `[key, last]` and then
    /// deletes the range, or refuses the revision.
    DeleteRun {
        /// First target key.
        key: Vec<u8>,
        /// Last target key.
        last: Vec<u8>,
        /// Deletes in the run.
        count: u64,
    },
}

impl Op {
    /// The target key.
    pub fn key(&self) -> &[u8] {
        match self {
            Op::Put { key, .. }
            | Op::Delete { key }
            | Op::DeleteRange { key, .. }
            | Op::DeleteRun { key, .. } => key,
        }
    }

    /// Bytes this op adds to a Txn request (key + value + a small per-op overhead).
    pub fn size(&self) -> usize {
        const OVERHEAD: usize = 16;
        match self {
            Op::Put { key, value, .. } => key.len() + value.len() + OVERHEAD,
            Op::Delete { key } => key.len() + OVERHEAD,
            Op::DeleteRange { key, end } => key.len() + end.len() + OVERHEAD,
            Op::DeleteRun { key, last, .. } => key.len() + last.len() + 1 + OVERHEAD,
        }
    }

    /// The etcd op, leases stripped.
    pub fn to_txn_op(&self) -> TxnOp {
        self.to_txn_op_with(|_| false)
    }

    /// The etcd op; a put carries its lease where `attach` says the target holds it.
    pub fn to_txn_op_with(&self, attach: impl Fn(i64) -> bool) -> TxnOp {
        match self {
            Op::Put { key, value, lease } if *lease != 0 && attach(*lease) => TxnOp::put(
                key.clone(),
                value.clone(),
                Some(etcd_client::PutOptions::new().with_lease(*lease)),
            ),
            Op::Put { key, value, .. } => TxnOp::put(key.clone(), value.clone(), None),
            Op::Delete { key } => TxnOp::delete(key.clone(), None),
            Op::DeleteRange { key, end } => {
                TxnOp::delete(key.clone(), Some(etcd_client::DeleteOptions::new().with_range(end.clone())))
            }
            // The agent resolves every run before it writes; as an op it is its range.
            Op::DeleteRun { key, last, .. } => TxnOp::delete(
                key.clone(),
                Some(etcd_client::DeleteOptions::new().with_range(crate::keys::key_after(last))),
            ),
        }
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

#[cfg(test)]
mod chunker_tests {
    use super::*;

    /// A chunk is flushed *before* the op that would pass the byte limit, and by op count.
    #[test]
    fn op_chunker_checks_bytes_before_adding() {
        let put = |n: usize| Op::Put { key: b"k".to_vec(), value: vec![0; n], lease: 0 };
        let mut c = OpChunker::new(10, 1000);
        assert!(c.push(put(600)).is_none());
        let first = c.push(put(600)).expect("600 + 600 would pass 1000");
        assert_eq!(first.len(), 1);
        let mut c = OpChunker::new(2, 1 << 20);
        assert!(c.push(put(1)).is_none() && c.push(put(1)).is_none());
        assert_eq!(c.push(put(1)).map(|v| v.len()), Some(2));
        assert_eq!(c.take().map(|v| v.len()), Some(1));
        assert!(c.take().is_none());
    }
}
