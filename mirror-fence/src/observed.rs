//! Reading the checkpoint key, and the rules a claim follows from what it holds.

use std::time::Duration;

use etcd_client::KvClient;
use mirror_core::{unary, Side};

use crate::checkpoint::{Checkpoint, Role};
use crate::FenceError;

/// What the checkpoint key holds now.
#[derive(Clone, Debug, PartialEq, Eq)]
// One per checkpoint read, held briefly: its size does not matter, and a boxed record would
// make every match on it clumsier.
#[allow(clippy::large_enum_variant)]
pub enum Observed {
    /// No checkpoint: a new link.
    Absent,
    /// A decodable record and its mod revision.
    Present {
        /// The record.
        record: Checkpoint,
        /// Its mod revision, the fence token.
        mod_revision: i64,
        /// The target revision that created the key: every key this link wrote has a mod
        /// revision above it.
        create_revision: i64,
    },
}

impl Observed {
    /// The mod revision to compare against (0 matches an absent key in etcd).
    pub fn mod_revision(&self) -> i64 {
        match self {
            Observed::Absent => 0,
            Observed::Present { mod_revision, .. } => *mod_revision,
        }
    }
}

/// Reads and decodes the checkpoint; undecodable bytes are an error (fail closed).
pub async fn read_checkpoint(
    kv: &mut KvClient,
    key: &[u8],
    timeout: Duration,
) -> Result<Observed, FenceError> {
    read_checkpoint_since(kv, key, timeout, 0).await
}

/// [`read_checkpoint`] by a writer that already committed the checkpoint at target revision
/// `committed` (0: never): a store that answers from before it (a member that lost acknowledged
/// writes, a target restored from an older snapshot) is [`FenceError::TargetWentBack`] at once,
/// at connect, not only once a later compare fails. Resuming from the older record it holds
/// would otherwise look like a normal restart.
pub async fn read_checkpoint_since(
    kv: &mut KvClient,
    key: &[u8],
    timeout: Duration,
    committed: i64,
) -> Result<Observed, FenceError> {
    let resp = unary("read checkpoint", Side::Target, timeout, kv.get(key, None)).await?;
    let seen = resp.kvs().first().map_or(0, |kv| kv.mod_revision());
    let head = resp.header().map_or(0, |h| h.revision());
    if committed > 0 && went_back(committed, head, seen) {
        return Err(FenceError::TargetWentBack { committed, head, seen });
    }
    match resp.kvs().first() {
        None => Ok(Observed::Absent),
        Some(kv) => Ok(Observed::Present {
            record: Checkpoint::decode(kv.value())?,
            mod_revision: kv.mod_revision(),
            create_revision: kv.create_revision(),
        }),
    }
}

/// Whether `ours` may take the fence from what is stored (checked before the first commit).
pub fn may_claim(observed: &Observed, ours: &Checkpoint) -> Result<(), FenceError> {
    match observed {
        Observed::Absent => Ok(()),
        Observed::Present { record, .. } => {
            if record.link_uid != ours.link_uid {
                return Err(FenceError::PrefixConflict {
                    stored: record.link_uid.clone(),
                    ours: ours.link_uid.clone(),
                });
            }
            if record.role == Role::Primary {
                return Err(FenceError::CutOver);
            }
            if record.epoch > ours.epoch {
                return Err(FenceError::FencedByNewerEpoch { stored: record.epoch, ours: ours.epoch });
            }
            Ok(())
        }
    }
}

/// What a claim plans from: everything in a stored record but who wrote it (epoch, agent,
/// commit id).
pub(crate) fn replication_state(observed: &Observed) -> Option<Checkpoint> {
    match observed {
        Observed::Absent => None,
        Observed::Present { record, .. } => {
            let mut state = record.clone();
            state.epoch = 0;
            state.agent_id.clear();
            state.commit.clear();
            Some(state)
        }
    }
}

/// Whether a linearizable read of the checkpoint (store at `head`, key last written at `seen`,
/// 0 if absent) shows a target older than this writer's own commit at `committed`. No writer
/// can move a key's mod revision backwards, and a linearizable read sees every acknowledged
/// write: so the member that answered lost writes it had acknowledged, or the target was
/// restored from an older snapshot.
pub(crate) fn went_back(committed: i64, head: i64, seen: i64) -> bool {
    head < committed || (seen > 0 && seen < committed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read older than our own commit is told apart from a newer writer (higher mod revision)
    /// and from a deleted key (current head, no key).
    #[test]
    fn a_read_older_than_our_commit_is_a_target_that_went_back() {
        assert!(went_back(612, 700, 431), "the key older than our commit");
        assert!(went_back(612, 500, 0), "the whole store older than our commit");
        assert!(!went_back(612, 700, 650), "another writer moved the key on");
        assert!(!went_back(612, 700, 0), "deleted after our commit");
        assert!(!went_back(612, 612, 612), "our own commit");
    }

    /// may_claim: another link, a promoted target and a newer epoch refuse; older or equal
    /// epochs of our link may be taken over.
    #[test]
    fn claim_rules() {
        let record = crate::checkpoint::test_record;
        let stored = |r: Checkpoint| Observed::Present { record: r, mod_revision: 5, create_revision: 2 };
        let ours = record("l", 2, Role::Mirror);
        assert!(may_claim(&Observed::Absent, &ours).is_ok());
        assert!(may_claim(&stored(record("l", 1, Role::Mirror)), &ours).is_ok());
        assert!(may_claim(&stored(record("l", 2, Role::Mirror)), &ours).is_ok());
        assert!(matches!(
            may_claim(&stored(record("l", 3, Role::Mirror)), &ours),
            Err(FenceError::FencedByNewerEpoch { stored: 3, ours: 2 })
        ));
        assert!(matches!(may_claim(&stored(record("l", 1, Role::Primary)), &ours), Err(FenceError::CutOver)));
        assert!(matches!(
            may_claim(&stored(record("other", 1, Role::Mirror)), &ours),
            Err(FenceError::PrefixConflict { .. })
        ));
    }
}
