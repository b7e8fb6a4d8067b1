//! Why the engine refuses to go on: the permanent rule breaks of SPEC §5, each carrying its
//! facts. The status reason, the condition raised and the message all come from here.

use mirror_core::{ConditionType, Reason, Side};

/// A rule of the product broken: writes stop, phase `failed`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// `require_empty` and the destination range holds keys.
    #[error(
        "initial_sync.mode = require_empty but the destination range holds {keys} keys; nothing was written. \
         To empty exactly that range (this deletes those keys on the target): {clear}. Or keep them and copy \
         over them with initial_sync.mode = \"overwrite\"",
        clear = clear.join(" && ")
    )]
    EmptyTarget {
        /// Keys found (reserved ones not counted).
        keys: u64,
        /// The commands that delete exactly the destination range
        /// ([`mirror_core::delete_commands`]).
        clear: Vec<String>,
    },
    /// One source revision is over the target's request limit, even with its deletes coalesced.
    #[error(
        "source revision {revision} ({ops} ops, {bytes} bytes; largest op {biggest} bytes, key {first_key}) is too \
         large for the target ({fault}), even written without the checkpoint; nothing of it was applied. {remedy}"
    )]
    RevisionTooLarge {
        /// The source revision.
        revision: i64,
        /// Its ops as last tried.
        ops: usize,
        /// Its bytes as last tried.
        bytes: usize,
        /// The key of its largest op, redacted.
        first_key: String,
        /// The size of its largest op.
        biggest: usize,
        /// What the target said.
        fault: String,
        /// What the operator raises, and to what.
        remedy: String,
    },
    /// One op (a scan put, a repair) is over the target's request limit even alone.
    #[error(
        "key {key}: {bytes} bytes is too large for the target ({fault}), even alone in a Txn; nothing of it was \
         written. Raise the target's --max-request-bytes above {bytes} (etcd's default is 1.5 MiB), or exclude the \
         key's prefix"
    )]
    ValueTooLarge {
        /// The target key, redacted.
        key: String,
        /// Its key and value bytes.
        bytes: usize,
        /// What the target said.
        fault: String,
    },
    /// Another link's checkpoint lies inside this link's destination range while a prune or
    /// orphan delete is on.
    #[error(
        "link {other:?} keeps its checkpoint inside this link's destination range (at {at}); a prune or \
         delete_orphans would delete its data, so nothing was deleted. Exclude its range from this link, or \
         turn the prune off; if link {other:?} is retired for good, clear its reserved keys with: {clear}"
    )]
    NestedLink {
        /// Its `link_uid`.
        other: String,
        /// Its reserved namespace.
        at: String,
        /// The command that deletes its reserved namespace ([`mirror_core::delete_commands`]).
        clear: String,
    },
    /// The checkpoint key holds another link's record: two links would write one range.
    #[error(
        "the checkpoint key {key} on the target belongs to link {other:?}, not {ours:?}: two links would write one \
         destination range, so nothing was written. Give this link its own destination prefix; if link {other:?} \
         is retired for good, delete its checkpoint with: {clear}"
    )]
    CheckpointTaken {
        /// The `link_uid` in the stored record.
        other: String,
        /// Ours.
        ours: String,
        /// The checkpoint key, escaped for reading.
        key: String,
        /// The command that deletes it ([`mirror_core::delete_commands`]).
        clear: String,
    },
    /// A new link's destination overlaps another link's (one nested in the other, not
    /// excluded): two writers would share keys.
    #[error(
        "link {other:?} writes under {theirs:?} on the target, which overlaps this link's destination {ours:?}: \
         two links would write the same keys, so nothing was written (the link that starts second is refused). \
         To nest one link in another, exclude the inner range from the outer link (sync.exclude_prefixes); \
         if link {other:?} is retired for good, clear its reserved keys with: {clear}"
    )]
    Overlap {
        /// Its `link_uid` (`"unknown"` when its checkpoint cannot be read).
        other: String,
        /// Its destination prefix, escaped for reading.
        theirs: String,
        /// Ours, escaped for reading.
        ours: String,
        /// The command that deletes its reserved namespace.
        clear: String,
    },
    /// Source and target are one cluster and the ranges overlap.
    #[error("source and target are the same cluster and the ranges overlap")]
    SameClusterOverlap,
    /// Another link mirrors this link's target back into its source range.
    #[error(
        "link {other:?} mirrors this link's target cluster into its source range (its checkpoint is at {at} in \
         the source); together they would echo every write forever, so nothing was written"
    )]
    ReverseLink {
        /// Its `link_uid`.
        other: String,
        /// Its checkpoint's namespace in the source, redacted.
        at: String,
    },
    /// A member runs etcd below 3.4.0.
    #[error("{side} endpoint {endpoint} runs etcd {version:?}; 3.4.0 or newer is required")]
    VersionUnsupported {
        /// The side.
        side: Side,
        /// The endpoint.
        endpoint: String,
        /// What it reported.
        version: String,
    },
    /// The endpoints of one side belong to different clusters.
    #[error("{side} endpoint {endpoint} belongs to another cluster than the side's first endpoint")]
    MixedClusters {
        /// The side.
        side: Side,
        /// The odd endpoint.
        endpoint: String,
    },
    /// TLS files unusable, or a handshake refused, before the link ever worked.
    #[error("{detail}")]
    Tls {
        /// `TlsConfig` or `TlsRejected`.
        reason: Reason,
        /// What failed, on which side.
        detail: String,
    },
    /// The source answers at a revision below the watermark: restored from an older snapshot
    /// under the same cluster id. Its history after that revision is not the one applied.
    #[error(
        "the source is at revision {source_revision}, below the watermark {watermark} already applied: it went \
         back (restored from an older snapshot with the same cluster id). Its new history would reuse revisions \
         the target already holds, so nothing more was written. To mirror the restored source, delete the \
         checkpoint key on the target and restart with initial_sync.mode = \"overwrite_and_prune\"; to keep the \
         target as it is, stop this link"
    )]
    SourceWentBack {
        /// The checkpoint's watermark.
        watermark: i64,
        /// The source's header revision.
        source_revision: i64,
    },
    /// `sync.leases = "preserve"` and the target holds the source lease's ID with another TTL.
    #[error(
        "lease {id:x} exists on the target with a granted TTL of {target_ttl}s, the source's is {source_ttl}s: \
         it is not this link's, so no key was written under it. Revoke it on the target if it is stale, or use \
         sync.leases = \"strip\""
    )]
    LeaseConflict {
        /// The lease ID.
        id: i64,
        /// Its granted TTL on the source.
        source_ttl: i64,
        /// Its granted TTL on the target.
        target_ttl: i64,
    },
    /// After one repair pass the sides still differ at the drained watermark.
    #[error(
        "after one repair pass the sides still differ at watermark {watermark}: missing {missing}, divergent \
         {divergent}, orphan {orphan}"
    )]
    DrainVerificationFailed {
        /// The drained watermark.
        watermark: i64,
        /// Keys missing in the target.
        missing: u64,
        /// Keys with other values.
        divergent: u64,
        /// Keys only in the target.
        orphan: u64,
    },
}

impl Refusal {
    /// The `last_error.reason`.
    pub fn reason(&self) -> Reason {
        match self {
            Refusal::EmptyTarget { .. } => Reason::EmptyTargetViolation,
            Refusal::RevisionTooLarge { .. } => Reason::RevisionTooLarge,
            Refusal::ValueTooLarge { .. } => Reason::ValueTooLarge,
            Refusal::NestedLink { .. } | Refusal::CheckpointTaken { .. } | Refusal::Overlap { .. } => {
                Reason::PrefixConflict
            }
            Refusal::SameClusterOverlap | Refusal::ReverseLink { .. } => Reason::DirectionConflict,
            Refusal::VersionUnsupported { .. } => Reason::VersionUnsupported,
            Refusal::MixedClusters { .. } => Reason::MixedClusters,
            Refusal::Tls { reason, .. } => *reason,
            Refusal::DrainVerificationFailed { .. } => Reason::DrainVerificationFailed,
            Refusal::SourceWentBack { .. } => Reason::SourceWentBack,
            Refusal::LeaseConflict { .. } => Reason::LeaseConflict,
        }
    }

    /// The shell command that clears the way (also in the message), where there is one.
    pub fn fix(&self) -> Option<String> {
        match self {
            Refusal::EmptyTarget { clear, .. } => Some(clear.join(" && ")),
            Refusal::NestedLink { clear, .. }
            | Refusal::CheckpointTaken { clear, .. }
            | Refusal::Overlap { clear, .. } => Some(clear.clone()),
            _ => None,
        }
    }

    /// The condition this refusal raises (with the refusal's message), if any, and its reason.
    pub fn condition(&self) -> Option<(ConditionType, Reason)> {
        match self {
            Refusal::EmptyTarget { .. } => {
                Some((ConditionType::EmptyTargetViolation, Reason::TargetNotEmpty))
            }
            Refusal::NestedLink { .. } => Some((ConditionType::PrefixConflict, Reason::NestedLink)),
            Refusal::CheckpointTaken { .. } => Some((ConditionType::PrefixConflict, Reason::CheckpointTaken)),
            Refusal::Overlap { .. } => Some((ConditionType::PrefixConflict, Reason::Overlap)),
            Refusal::SameClusterOverlap => Some((ConditionType::DirectionConflict, Reason::SameCluster)),
            Refusal::ReverseLink { .. } => Some((ConditionType::DirectionConflict, Reason::ReverseLink)),
            Refusal::DrainVerificationFailed { .. } => {
                Some((ConditionType::DrainVerificationFailed, Reason::SidesDiffer))
            }
            Refusal::SourceWentBack { .. } => Some((ConditionType::SourceWentBack, Reason::BelowWatermark)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal, its `last_error.reason`, its condition and whether it carries a fix command.
    type Row = (Refusal, &'static str, Option<(ConditionType, &'static str)>, bool);

    /// One of each refusal with its expected `last_error.reason`, condition and fix command:
    /// the typed error → status mapping the runbook and alerts are written against.
    fn table() -> Vec<Row> {
        let clear = || "etcdctl del 'a' 'b'".to_string();
        vec![
            (
                Refusal::EmptyTarget { keys: 3, clear: vec![clear(), clear()] },
                "EmptyTargetViolation",
                Some((ConditionType::EmptyTargetViolation, "TargetNotEmpty")),
                true,
            ),
            (
                Refusal::RevisionTooLarge {
                    revision: 9,
                    ops: 2,
                    bytes: 3,
                    first_key: "k".into(),
                    biggest: 3,
                    fault: "f".into(),
                    remedy: "r".into(),
                },
                "RevisionTooLarge",
                None,
                false,
            ),
            (
                Refusal::ValueTooLarge { key: "k".into(), bytes: 3, fault: "f".into() },
                "ValueTooLarge",
                None,
                false,
            ),
            (
                Refusal::NestedLink { other: "o".into(), at: "a".into(), clear: clear() },
                "PrefixConflict",
                Some((ConditionType::PrefixConflict, "NestedLink")),
                true,
            ),
            (
                Refusal::CheckpointTaken {
                    other: "o".into(),
                    ours: "u".into(),
                    key: "k".into(),
                    clear: clear(),
                },
                "PrefixConflict",
                Some((ConditionType::PrefixConflict, "CheckpointTaken")),
                true,
            ),
            (
                Refusal::Overlap { other: "o".into(), theirs: "t".into(), ours: "u".into(), clear: clear() },
                "PrefixConflict",
                Some((ConditionType::PrefixConflict, "Overlap")),
                true,
            ),
            (
                Refusal::SameClusterOverlap,
                "DirectionConflict",
                Some((ConditionType::DirectionConflict, "SameCluster")),
                false,
            ),
            (
                Refusal::ReverseLink { other: "o".into(), at: "a".into() },
                "DirectionConflict",
                Some((ConditionType::DirectionConflict, "ReverseLink")),
                false,
            ),
            (
                Refusal::VersionUnsupported {
                    side: Side::Source,
                    endpoint: "e".into(),
                    version: "3.3.0".into(),
                },
                "VersionUnsupported",
                None,
                false,
            ),
            (
                Refusal::MixedClusters { side: Side::Target, endpoint: "e".into() },
                "MixedClusters",
                None,
                false,
            ),
            (Refusal::Tls { reason: Reason::TlsRejected, detail: "d".into() }, "TlsRejected", None, false),
            (
                Refusal::SourceWentBack { watermark: 9, source_revision: 3 },
                "SourceWentBack",
                Some((ConditionType::SourceWentBack, "BelowWatermark")),
                false,
            ),
            (
                Refusal::LeaseConflict { id: 0x2a, source_ttl: 10, target_ttl: 20 },
                "LeaseConflict",
                None,
                false,
            ),
            (
                Refusal::DrainVerificationFailed { watermark: 9, missing: 1, divergent: 2, orphan: 3 },
                "DrainVerificationFailed",
                Some((ConditionType::DrainVerificationFailed, "SidesDiffer")),
                false,
            ),
        ]
    }

    #[test]
    fn each_refusal_maps_to_its_reason_condition_and_fix() {
        for (refusal, reason, condition, has_fix) in table() {
            // The wire text the runbook and alerts match on.
            assert_eq!(refusal.reason().as_str(), reason, "{refusal:?}");
            let named = refusal.condition().map(|(type_, why)| (type_, why.as_str()));
            assert_eq!(named, condition, "{refusal:?}");
            assert_eq!(refusal.fix().is_some(), has_fix, "{refusal:?}");
            // The fix is also in the message, so a reader of the log alone has it.
            if let Some(fix) = refusal.fix() {
                assert!(refusal.to_string().contains(&fix), "{refusal:?}");
            }
        }
    }

    #[test]
    fn messages_carry_their_facts() {
        let empty = Refusal::EmptyTarget { keys: 3, clear: vec!["c1".into(), "c2".into()] };
        assert!(empty.to_string().contains("holds 3 keys"));
        assert!(empty.to_string().contains("c1 && c2"));
        let big = Refusal::ValueTooLarge { key: "app/x…".into(), bytes: 2_000_000, fault: "f".into() };
        assert!(big.to_string().starts_with("key app/x…: 2000000 bytes"));
        let lease = Refusal::LeaseConflict { id: 0x2a, source_ttl: 10, target_ttl: 20 };
        assert!(lease.to_string().starts_with("lease 2a exists on the target with a granted TTL of 20s"));
        let version = Refusal::VersionUnsupported {
            side: Side::Source,
            endpoint: "e:1".into(),
            version: "3.3.0".into(),
        };
        assert!(version.to_string().contains("e:1 runs etcd \"3.3.0\""), "{version}");
    }
}
