//! Exact mode's Txn (SPEC §10): source revision R lands as target revision R.
//!
//! ## Why the target revision is the source's
//! The target starts as a restore of the source's snapshot at R0: the same keys, each with the
//! same create revision, mod revision, version and lease, at the same revision. etcd adds a
//! revision for a Txn exactly when it changes something (`storeTxnWrite.End`, 3.4 and 3.5), and
//! each of these Txns puts the checkpoint, so Txn R lands as target revision R once Txn R-1
//! landed as R-1 and nothing else wrote the target. It replays R's changes in the source's
//! order (so sub-revisions, and with them the order of a watch's events, agree), then puts the
//! checkpoint last.
//!
//! ## Why nothing someone else wrote is ever overwritten (the fence)
//! - The checkpoint key is put by Txn R0+1 first (absent before: version 0) and by every Txn
//!   after, so before Txn R its mod revision is R-1 and its version R-1-R0: both known before
//!   R-1 lands, which lets Txns be sent before their predecessors answer. A Txn sent too early
//!   (etcd reorders concurrent requests, SPEC §11) fails this compare and is resent in order.
//! - Each key R touches is compared with the source's view before R: a put's version and create
//!   revision (version 0: absent), a delete's mod revision (its prev_kv). So a key another
//!   writer changed fails the Txn before anything of it lands.
//! - A revision with more compares than one Txn level holds is guarded instead by "no key of the
//!   keyspace has a mod revision at or after R" (one range compare, which reads every key).
//! - A Txn that lands at another target revision than R means something else wrote the target
//!   (a key R does not touch): it landed, and the link must stop ([`Landing::Foreign`]).

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse};
use mirror_core::{Change, ExactRevision};

use crate::checkpoint::{Checkpoint, Role};
use crate::nest::{nest, TooManyOps};

/// One compare of a revision's Txn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Guard {
    /// The key's version is this (0: the key is absent).
    Version(Vec<u8>, i64),
    /// The key's create revision is this.
    CreateRevision(Vec<u8>, i64),
    /// The key's mod revision is this.
    ModRevision(Vec<u8>, i64),
    /// No key of the keyspace has a mod revision at or after this revision.
    NothingSince(i64),
}

impl Guard {
    fn compare(&self) -> Compare {
        match self {
            Guard::Version(k, v) => Compare::version(k.clone(), CompareOp::Equal, *v),
            Guard::CreateRevision(k, r) => Compare::create_revision(k.clone(), CompareOp::Equal, *r),
            Guard::ModRevision(k, r) => Compare::mod_revision(k.clone(), CompareOp::Equal, *r),
            // "\0" to the end: every key etcd can hold (it refuses the empty key).
            Guard::NothingSince(r) => Compare::mod_revision(vec![0], CompareOp::Less, *r).with_range(vec![0]),
        }
    }
}

/// The fence of an exact link: its checkpoint key and the seed's revision R0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExactFence {
    key: Vec<u8>,
    seed: i64,
}

/// The checkpoint as the target holds it: its mod revision and version (0 and 0: absent).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    /// The checkpoint key's mod revision.
    pub mod_revision: i64,
    /// The checkpoint key's version.
    pub version: i64,
}

/// What became of one revision's Txn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Landing {
    /// It landed as target revision R.
    Landed,
    /// Txn R had landed before (a lost answer, or another replica of the link).
    AlreadyLanded,
    /// It was sent before its predecessor landed (etcd reordered them): send it again, in
    /// order, with those behind it.
    Overtaken,
    /// The target is past R: another replica of the link landed more. Go on from there.
    Behind {
        /// The revision the checkpoint names now.
        at: i64,
    },
    /// Something other than this link wrote the target: the link must stop (`ForeignWrite`).
    Foreign(String),
    /// The target was promoted (cutover, failover): nobody of the link writes again.
    Promoted,
}

/// A revision's Txn, built: its guards (the fence's first) and the ops in order.
#[derive(Clone, Debug)]
pub struct RevisionTxn {
    /// The source revision it lands as.
    pub revision: i64,
    /// Every compare.
    pub guards: Vec<Guard>,
    /// The etcd ops, nested where they do not fit one level, the checkpoint put last.
    ops: Vec<TxnOp>,
}

impl ExactFence {
    /// The fence of a link seeded at `seed` (R0) whose checkpoint lives at `key`.
    pub fn new(key: Vec<u8>, seed: i64) -> ExactFence {
        ExactFence { key, seed }
    }

    /// The fence as a stored checkpoint shows it: R0 is its mod revision less its version.
    pub fn from_stamp(key: Vec<u8>, stamp: Stamp) -> ExactFence {
        ExactFence { key, seed: stamp.mod_revision - stamp.version }
    }

    /// R0.
    pub fn seed(&self) -> i64 {
        self.seed
    }

    /// The checkpoint key.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The checkpoint as it stands once Txn `revision` landed.
    pub fn stamp_after(&self, revision: i64) -> Stamp {
        if revision <= self.seed {
            return Stamp { mod_revision: 0, version: 0 };
        }
        Stamp { mod_revision: revision, version: revision - self.seed }
    }

    /// The fence's compares for Txn `revision`.
    fn fence_guards(&self, revision: i64) -> Vec<Guard> {
        let before = self.stamp_after(revision - 1);
        if before.version == 0 {
            return vec![Guard::Version(self.key.clone(), 0)];
        }
        vec![
            Guard::ModRevision(self.key.clone(), before.mod_revision),
            Guard::Version(self.key.clone(), before.version),
        ]
    }

    /// Txn `rev.revision`: the fence's compares, one per key the revision touches (or the
    /// keyspace compare where they do not fit `per_level`), the changes in order, then `riders`
    /// (the link's own writes to its reserved namespace, which ride the next revision's Txn),
    /// then the checkpoint put `record`.
    pub fn txn(
        &self,
        rev: &ExactRevision,
        record: Vec<u8>,
        riders: Vec<TxnOp>,
        per_level: usize,
    ) -> Result<RevisionTxn, TooManyOps> {
        let mut guards = self.fence_guards(rev.revision);
        let per_key: Vec<Guard> = rev.changes.iter().flat_map(key_guards).collect();
        let whole = rev.changes.iter().any(|c| matches!(c, Change::Delete { prev_mod_revision: None, .. }));
        if whole || guards.len() + per_key.len() > per_level {
            guards.push(Guard::NothingSince(rev.revision));
        } else {
            guards.extend(per_key);
        }
        let data = rev.changes.iter().map(txn_op).collect();
        let mut ops = nest(data, per_level, 1 + riders.len())?;
        ops.extend(riders);
        ops.push(TxnOp::put(self.key.clone(), record, None));
        Ok(RevisionTxn { revision: rev.revision, guards, ops })
    }

    /// What became of Txn `revision` from its answer; `now` is the checkpoint as its failure
    /// branch read it (only used when it failed).
    pub fn judge(&self, revision: i64, answer: &Answer) -> Landing {
        match *answer {
            Answer::Succeeded { revision: at } if at == revision => Landing::Landed,
            Answer::Succeeded { revision: at } => Landing::Foreign(format!(
                "source revision {revision} landed as target revision {at}: something other than this link wrote the \
                 target after revision {}",
                revision - 1
            )),
            Answer::Failed { checkpoint } => self.judge_failed(revision, checkpoint),
            Answer::Promoted => Landing::Promoted,
        }
    }

    fn judge_failed(&self, revision: i64, now: Stamp) -> Landing {
        let ours =
            now.mod_revision - now.version == self.seed || now == Stamp { mod_revision: 0, version: 0 };
        if !ours {
            return Landing::Foreign(format!(
                "the checkpoint is at mod revision {} with version {}, which no Txn of a link seeded at revision {} \
                 gives: another writer put it",
                now.mod_revision, now.version, self.seed
            ));
        }
        let landed = if now.version == 0 { self.seed } else { now.mod_revision };
        match landed {
            at if at == revision => Landing::AlreadyLanded,
            at if at < revision - 1 => Landing::Overtaken,
            at if at > revision => Landing::Behind { at },
            _ => Landing::Foreign(format!(
                "a key source revision {revision} writes is not as the source held it before {revision}: another \
                 writer changed it on the target"
            )),
        }
    }
}

/// A Txn's answer as the judge needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// It ran, and the target's revision after it is this.
    Succeeded {
        /// The response header's revision.
        revision: i64,
    },
    /// A compare failed; the failure branch read the checkpoint.
    Failed {
        /// The checkpoint then.
        checkpoint: Stamp,
    },
    /// A compare failed, and the checkpoint says the target is primary (cutover, failover).
    Promoted,
}

impl Answer {
    /// The answer of a [`RevisionTxn`] as etcd gave it.
    pub fn of(resp: &TxnResponse) -> Answer {
        if resp.succeeded() {
            return Answer::Succeeded { revision: resp.header().map_or(0, |h| h.revision()) };
        }
        let stored = resp.op_responses().iter().find_map(|r| match r {
            TxnOpResponse::Get(get) => get.kvs().first().cloned(),
            _ => None,
        });
        let Some(kv) = stored else {
            return Answer::Failed { checkpoint: Stamp { mod_revision: 0, version: 0 } };
        };
        if Checkpoint::decode(kv.value()).is_ok_and(|r| r.role == Role::Primary) {
            return Answer::Promoted;
        }
        Answer::Failed { checkpoint: Stamp { mod_revision: kv.mod_revision(), version: kv.version() } }
    }
}

impl RevisionTxn {
    /// The etcd Txn: the compares, the ops, and a read of the checkpoint when a compare fails.
    pub fn to_txn(&self, checkpoint_key: &[u8]) -> Txn {
        Txn::new()
            .when(self.guards.iter().map(Guard::compare).collect::<Vec<_>>())
            .and_then(self.ops.clone())
            .or_else(vec![TxnOp::get(checkpoint_key.to_vec(), None)])
    }
}

/// The source's view of a changed key before the revision, as compares.
fn key_guards(change: &Change) -> Vec<Guard> {
    match change {
        Change::Put { key, version, create_revision, .. } => {
            let before = version - 1;
            if before == 0 {
                vec![Guard::Version(key.clone(), 0)]
            } else {
                vec![
                    Guard::Version(key.clone(), before),
                    Guard::CreateRevision(key.clone(), *create_revision),
                ]
            }
        }
        Change::Delete { key, prev_mod_revision: Some(r), .. } => vec![Guard::ModRevision(key.clone(), *r)],
        Change::Delete { prev_mod_revision: None, .. } => Vec::new(),
    }
}

fn txn_op(change: &Change) -> TxnOp {
    match change {
        Change::Put { key, value, lease, .. } => {
            let options = (*lease != 0).then(|| PutOptions::new().with_lease(*lease));
            TxnOp::put(key.clone(), value.clone(), options)
        }
        Change::Delete { key, .. } => TxnOp::delete(key.clone(), None),
    }
}

#[cfg(test)]
#[path = "exact_tests.rs"]
mod tests;
