//! Why a fenced write did not happen, and how the engine handles each answer.

use mirror_core::{ErrorClass, EtcdError, Reason};

use crate::checkpoint::DecodeError;

/// Why a fenced write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// A writer with a newer epoch holds the fence: cold standby.
    #[error("fenced by epoch {stored} (this agent has epoch {ours})")]
    FencedByNewerEpoch {
        /// Epoch in the checkpoint.
        stored: u64,
        /// Our epoch.
        ours: u64,
    },
    /// An older or equal epoch wrote after we held the fence: someone runs with a stale config.
    #[error(
        "epoch regressed: {agent:?} wrote the checkpoint with epoch {stored} while this agent (epoch {ours}) holds or claims it; another agent runs with this epoch: give the one that should write a higher epoch"
    )]
    EpochRegressed {
        /// Epoch in the checkpoint.
        stored: u64,
        /// Our epoch.
        ours: u64,
        /// The writer named in the record.
        agent: String,
    },
    /// The checkpoint belongs to another link: two links write one range.
    #[error("checkpoint belongs to link {stored:?}, not {ours:?}")]
    PrefixConflict {
        /// Link in the checkpoint.
        stored: String,
        /// Our link.
        ours: String,
    },
    /// The target was promoted: nobody mirrors into it any more.
    #[error("the target was cut over (checkpoint role is primary)")]
    CutOver,
    /// The checkpoint key was deleted under us.
    #[error("the checkpoint key was deleted: fence lost")]
    FenceLost,
    /// A read shows the target older than a write it acknowledged to this writer: a member
    /// lost applied writes (etcd 3.5.0-3.5.2 can, when killed under load: etcd-io/etcd#13766,
    /// fixed in 3.5.3) or the target was restored from an older snapshot. Its answers, compare
    /// results included, can no longer be trusted: fail closed.
    #[error("the target went back: a linearizable read shows revision {head} with the checkpoint written at {seen}, older than this writer's own commit at {committed}; a target member lost writes it had acknowledged (etcd 3.5.0-3.5.2 do when killed under load, etcd-io/etcd#13766; fixed in 3.5.3) or the target was restored from an older snapshot. Writes stopped: compare `etcdctl endpoint status --cluster` revisions, replace the member that is behind (member remove, wipe, add), then restart the agent")]
    TargetWentBack {
        /// The checkpoint's mod revision this writer committed.
        committed: i64,
        /// The revision of the store that answered.
        head: i64,
        /// The checkpoint's mod revision in that answer (0 if absent).
        seen: i64,
    },
    /// A guard of [`crate::FencedWriter::commit_guarded`] failed while the fence held: nothing
    /// landed; read again and retry.
    #[error("a guarded write found its range changed since it was read; nothing was written")]
    GuardFailed,
    /// The checkpoint cannot be decoded; fail closed.
    #[error("checkpoint is corrupt: {0}")]
    Corrupt(#[from] DecodeError),
    /// This writer built a record that breaks the record's rules ([`crate::Checkpoint::check`]);
    /// nothing was written (every agent would have refused the stored record).
    #[error("refusing to write an invalid checkpoint record: {0}")]
    InvalidRecord(DecodeError),
    /// A claim lost a race to a writer that moved the replication state (watermark, scan, ...)
    /// the claim was planned from: plan again from a fresh read. Claiming anyway with the old
    /// plan would rewind the checkpoint below data the other writer had already applied.
    /// Also: a commit found its own earlier, timed-out attempt landed under a different batch.
    #[error("the checkpoint moved under this writer (a claim race, or an earlier commit of ours whose answer was lost landed); planning again from a fresh read")]
    Raced,
    /// The Txn itself failed.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    /// The ops cannot be laid out under the target's `max_txn_ops` even with nesting.
    #[error(transparent)]
    TooManyOps(crate::nest::TooManyOps),
}

impl FenceError {
    /// The class of SPEC §5: etcd errors keep theirs; every fence outcome is permanent for
    /// this writer (standby outcomes are told apart by [`FenceError::standby_reason`]).
    pub fn class(&self) -> ErrorClass {
        match self {
            FenceError::Etcd(e) => e.class(),
            FenceError::Raced | FenceError::GuardFailed => ErrorClass::Transient,
            _ => ErrorClass::Permanent,
        }
    }

    /// For outcomes that mean "another writer legitimately holds the fence": the `Fenced`
    /// condition's reason. The agent goes to cold standby instead of failing.
    pub fn standby_reason(&self) -> Option<Reason> {
        match self {
            FenceError::FencedByNewerEpoch { .. } => Some(Reason::FencedByNewerEpoch),
            FenceError::EpochRegressed { .. } => Some(Reason::EpochRegressed),
            FenceError::CutOver => Some(Reason::TargetPromoted),
            _ => None,
        }
    }

    /// CamelCase reason for status.
    pub fn reason(&self) -> Reason {
        match self {
            FenceError::FencedByNewerEpoch { .. } => Reason::FencedByNewerEpoch,
            FenceError::EpochRegressed { .. } => Reason::EpochRegressed,
            FenceError::PrefixConflict { .. } => Reason::PrefixConflict,
            FenceError::CutOver => Reason::TargetPromoted,
            FenceError::FenceLost => Reason::FenceLost,
            FenceError::TargetWentBack { .. } => Reason::TargetWentBack,
            FenceError::Raced => Reason::FenceRaced,
            FenceError::GuardFailed => Reason::GuardFailed,
            FenceError::Corrupt(_) => Reason::CorruptCheckpoint,
            FenceError::InvalidRecord(_) => Reason::InvalidCheckpointRecord,
            FenceError::Etcd(_) => Reason::EtcdError,
            FenceError::TooManyOps(_) => Reason::RevisionTooLarge,
        }
    }
}
