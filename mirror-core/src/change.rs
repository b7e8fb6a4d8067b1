//! One source change as exact mode (SPEC §10) replays it: the key, what the source wrote, and
//! what the source held just before, which is what the target must hold for the change to land
//! the same way.

/// One event of a source revision, with the source's view of its key before the revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// The source put `value` at `key`.
    Put {
        /// The key (exact mode does not rewrite keys).
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
        /// The source lease (0: none); the target holds a lease with the same ID.
        lease: i64,
        /// The key's version after the put: 1 when the put created it.
        version: i64,
        /// The key's create revision after the put.
        create_revision: i64,
        /// The lease the key had before (0: none, or the key was absent).
        prev_lease: i64,
    },
    /// The source deleted `key`.
    Delete {
        /// The key.
        key: Vec<u8>,
        /// The mod revision of the key before the delete (the event's prev_kv); `None` where
        /// the source could not say (prev_kv compacted away).
        prev_mod_revision: Option<i64>,
        /// The lease the key had before (0: none, or unknown).
        prev_lease: i64,
    },
}

impl Change {
    /// The key.
    pub fn key(&self) -> &[u8] {
        match self {
            Change::Put { key, .. } | Change::Delete { key, .. } => key,
        }
    }

    /// The lease the key leaves by this change (0: none): once the change landed, that lease
    /// may hold no key on the target any more.
    pub fn left_lease(&self) -> i64 {
        match self {
            Change::Put { lease, prev_lease, .. } if lease != prev_lease => *prev_lease,
            Change::Put { .. } => 0,
            Change::Delete { prev_lease, .. } => *prev_lease,
        }
    }

    /// Bytes this change adds to a Txn request (key + value + a small per-op overhead).
    pub fn size(&self) -> usize {
        const OVERHEAD: usize = 16;
        match self {
            Change::Put { key, value, .. } => key.len() + value.len() + OVERHEAD,
            Change::Delete { key, .. } => key.len() + OVERHEAD,
        }
    }
}

/// Every change of one source revision, in the source's order (its sub-revisions).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExactRevision {
    /// The source revision.
    pub revision: i64,
    /// Its changes; empty where every event fell in the source's reserved namespace.
    pub changes: Vec<Change>,
}
