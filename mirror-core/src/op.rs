//! One target write, already rewritten: the unit every crate that reads a source and writes a
//! target speaks (the watch's events, the scan's pages, the reconcile's repairs).

use etcd_client::TxnOp;

/// One target write, already rewritten.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Put `value` at `key` (leases are stripped).
    Put {
        /// Target key.
        key: Vec<u8>,
        /// Value.
        value: Vec<u8>,
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
            Op::Put { key, value } => key.len() + value.len() + OVERHEAD,
            Op::Delete { key } => key.len() + OVERHEAD,
            Op::DeleteRange { key, end } => key.len() + end.len() + OVERHEAD,
            Op::DeleteRun { key, last, .. } => key.len() + last.len() + 1 + OVERHEAD,
        }
    }

    /// The etcd op.
    pub fn to_txn_op(&self) -> TxnOp {
        match self {
            Op::Put { key, value } => TxnOp::put(key.clone(), value.clone(), None),
            Op::Delete { key } => TxnOp::delete(key.clone(), None),
            Op::DeleteRange { key, end } => {
                TxnOp::delete(key.clone(), Some(etcd_client::DeleteOptions::new().with_range(end.clone())))
            }
            // The agent resolves every run before it writes; as an op it is its range.
            Op::DeleteRun { key, last, .. } => TxnOp::delete(
                key.clone(),
                Some(etcd_client::DeleteOptions::new().with_range([last.as_slice(), &[0]].concat())),
            ),
        }
    }
}
