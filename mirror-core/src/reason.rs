//! Why: the one vocabulary of reasons that conditions, `last_error`, `forced_resyncs` and the
//! logs carry. Every decision names its reason as a [`Reason`]; it becomes text only when
//! `/statusz` is serialized, a metric is labelled or a line is logged, always as the variant's
//! own name (SPEC §7's CamelCase reasons).

use serde::{Deserialize, Serialize};

/// Declares [`Reason`]: each variant's name is its wire text, its doc what it means.
macro_rules! reasons {
    ($($group:literal: { $($v:ident: $meaning:literal,)* })*) => {
        /// A reason, as conditions, `last_error`, `forced_resyncs` and logs give it. A name
        /// two parts of the agent give (a fault that is also a condition's reason) is one
        /// variant.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Reason {
            $($(#[doc = $meaning] $v,)*)*
            /// A reason this build does not know: read from a newer agent's `/statusz`.
            Unknown,
        }

        impl Reason {
            /// Every reason this build can give, in declaration order.
            pub const ALL: &'static [Reason] = &[$($(Reason::$v,)*)*];

            /// The wire text: the variant's name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($(Reason::$v => stringify!($v),)*)*
                    Reason::Unknown => "Unknown",
                }
            }

            /// What it means, one line (docs/configuration.md lists the same).
            pub fn meaning(self) -> &'static str {
                match self {
                    $($(Reason::$v => $meaning,)*)*
                    Reason::Unknown => "a reason this build does not know",
                }
            }

            /// Who gives it: the group it is declared in.
            pub fn group(self) -> &'static str {
                match self {
                    $($(Reason::$v => $group,)*)*
                    Reason::Unknown => "",
                }
            }
        }
    };
}

reasons! {
    "phase": {
        Connecting: "probing both sides; not connected yet",
        InitialSync: "genesis: the scan and its replay",
        Syncing: "tailing the source",
        Degraded: "alive but held back (target full, throttled or unreachable)",
        Standby: "fenced: writing nothing, watching the fence",
        Drained: "cut over: the target is the primary",
        Failed: "a permanent error: writing nothing until restarted",
        Paused: "paused by config (`paused = true`)",
    }
    "fault": {
        Compacted: "a read or watch asked for a compacted revision",
        FutureRevision: "a read asked for a revision the server does not have yet",
        QuotaExceeded: "the target is out of space (`mvcc: database space exceeded`)",
        TooManyRequests: "the server throttles (`too many requests`)",
        ResourceExhausted: "the server refused for another resource",
        RequestTooLarge: "a request over the server's `--max-request-bytes`",
        TooManyOps: "a Txn over the server's `--max-txn-ops`",
        ResponseTooLarge: "an answer over the client's decode limit",
        DuplicateKey: "the same key twice in one Txn",
        AuthFailed: "wrong user or password",
        TlsConfig: "a TLS file is missing, unreadable or not PEM of the right kind",
        TlsRejected: "a TLS handshake was refused, by us or by the server",
        PermissionDenied: "the user lacks a permission",
        InvalidToken: "the auth token expired or is unknown",
        NoLeader: "the server has no leader",
        ElectionNoLeader: "nobody campaigns in the HA election",
        Unavailable: "the server or network is unreachable, or the connection broke",
        Timeout: "a deadline passed",
        LeaseNotFound: "a put named a lease the server does not hold",
        LeaseExists: "a grant named a lease ID the server holds",
        InvalidRequest: "the server considers a request malformed",
        Other: "any other etcd error",
    }
    "restart": {
        WatchBufferOverflow: "genesis restarts: the replay buffer passed `watch_buffer_bytes`",
        CompactedDuringScan: "the source compacted past the scan revision while it was read",
        WatchEndedDuringScan: "genesis restarts: the watch ended while it was buffered",
        ForwarderPanicked: "genesis restarts: the task buffering the watch panicked",
    }
    "resync": {
        WatchCompacted: "forced resync: the tail's watch was cancelled by a compaction past the watermark",
        SourceCompacted: "forced resync: a read at or after the watermark was refused as compacted",
        ClusterChanged: "forced resync: a side was rebuilt or restored",
        RangeChanged: "forced resync: the mirrored range differs from the checkpoint's",
    }
    "reconnect": {
        WatchResponseTooLarge: "reconnect: a watch response was over the decode limit (fragments from now on)",
        TlsRejectedOrFilesChanged: "reconnect: a TLS rejection, or the TLS files changed",
        ConnectionSettingsReloaded: "reconnect: a reload changed endpoints, TLS or auth",
        TlsFilesChanged: "reconnect: the TLS files on disk changed",
    }
    "fence": {
        FencedByNewerEpoch: "another writer holds the fence with a newer epoch",
        EpochRegressed: "another writer of the same epoch holds the fence",
        PrefixConflict: "another link's checkpoint where this link writes or prunes",
        TargetPromoted: "the target is cut over; nobody may write",
        FenceLost: "the checkpoint key was deleted under the writer",
        TargetWentBack: "the target answers from before this process's own commit",
        FenceRaced: "the checkpoint moved during a commit (another writer, or an earlier timed-out attempt)",
        GuardFailed: "a guarded write's condition failed while the fence held; nothing landed",
        CorruptCheckpoint: "the checkpoint record cannot be decoded",
        InvalidCheckpointRecord: "the checkpoint record decodes but breaks a rule",
        EtcdError: "the fence could not be read or written",
        RevisionTooLarge: "one source revision is more than the target takes in one Txn",
    }
    "exact": {
        ForeignWrite: "exact mode: something other than the link wrote the target, or a target lease ran out",
        ReseedRequired: "exact mode: the target is not a restore of this source at a revision the source still holds",
        RevisionMissing: "exact mode: a source revision never arrived on the watch of the whole keyspace",
        KeysEqual: "exact mode: the last periodic pass found every key equal on both sides at one revision",
        KeysDiffer: "exact mode: the last periodic pass found keys that differ at one revision",
    }
    "refusal": {
        EmptyTargetViolation: "`require_empty` met keys in the destination range",
        TargetNotEmpty: "the destination range holds keys (`EmptyTargetViolation`)",
        ValueTooLarge: "one value is more than the target takes",
        NestedLink: "another link's checkpoint inside this link's destination range",
        CheckpointTaken: "this link's checkpoint key holds another link's record",
        Overlap: "another link writes into this link's destination range",
        DirectionConflict: "the link would write into its own source, or echo with another",
        SameCluster: "source and target are one cluster and the ranges overlap",
        ReverseLink: "a link from the target back into this source's range",
        VersionUnsupported: "a side runs an etcd version below 3.4",
        MixedClusters: "the endpoints of a side belong to more than one cluster",
        DrainVerificationFailed: "the sides still differed after the drain's repair pass",
        SidesDiffer: "the drain's verification found differences",
        SourceWentBack: "the source answers below the watermark",
        BelowWatermark: "the source was restored from an older snapshot",
        LeaseConflict: "a target lease of the same ID with another TTL",
    }
    "engine": {
        Shutdown: "SIGTERM or SIGINT",
        Resumed: "resumed from the checkpoint",
        StartRevision: "tailing from `initial_sync.start_revision`, no scan",
        Scanning: "the initial sync is under way",
        Resyncing: "a forced resync or genesis restart is under way",
        Complete: "the target equals the source at the watermark",
        LiveApply: "a live revision was applied",
        HoldingFence: "this agent holds the fence",
        TakingOver: "a raised epoch takes the fence over",
        Recovered: "a write landed after failed tries",
        NoSpace: "the target is out of space",
        Verified: "drained and verified",
        CountsEqual: "source and target counts are equal",
        CountsDiffer: "source and target counts differ",
        Drift: "the last reconcile pass found differences",
        NoDrift: "the last reconcile pass found none",
    }
    "probe": {
        Probe: "the last probe answered",
        AllMembersAnswer: "every member of both sides answers",
        ProbeFailed: "a member did not answer its probe",
    }
    "election": {
        AwaitingElection: "another agent of this link leads, or the election is open",
        ElectedLeader: "this agent leads the HA election",
        LostElection: "this agent's election lease expired or was revoked",
        CutoverInProgress: "a cutover of this link holds the fence while it drains",
    }
    "freshness": {
        LagOverMax: "lag or time without progress over `sync.max_lag`",
        CaughtUp: "lag back under `sync.max_lag`",
        ReplicationLagExceeded: "`Available` while the lag is over `sync.max_lag`",
        Stale: "the last reconcile pass is older than twice `reconcile.interval`",
        NeverReconciled: "no pass in twice `reconcile.interval` after the initial sync",
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl AsRef<str> for Reason {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

/// By name, as `/statusz` and metrics list them (the wire order of `forced_resyncs.by_reason`).
impl Ord for Reason {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl PartialOrd for Reason {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl std::str::FromStr for Reason {
    type Err = std::convert::Infallible;

    /// A name this build does not know reads as [`Reason::Unknown`]: a status from a newer agent
    /// is still read.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Reason::ALL.iter().copied().find(|r| r.as_str() == s).unwrap_or(Reason::Unknown))
    }
}

impl Serialize for Reason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Reason {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(name.parse().unwrap_or(Reason::Unknown))
    }
}

impl From<crate::Fault> for Reason {
    fn from(fault: crate::Fault) -> Reason {
        use crate::Fault as F;
        match fault {
            F::Compacted => Reason::Compacted,
            F::FutureRevision => Reason::FutureRevision,
            F::QuotaExceeded => Reason::QuotaExceeded,
            F::TooManyRequests => Reason::TooManyRequests,
            F::ResourceExhausted => Reason::ResourceExhausted,
            F::RequestTooLarge => Reason::RequestTooLarge,
            F::TooManyOps => Reason::TooManyOps,
            F::ResponseTooLarge => Reason::ResponseTooLarge,
            F::DuplicateKey => Reason::DuplicateKey,
            F::AuthFailed => Reason::AuthFailed,
            F::TlsConfig => Reason::TlsConfig,
            F::TlsRejected => Reason::TlsRejected,
            F::PermissionDenied => Reason::PermissionDenied,
            F::InvalidToken => Reason::InvalidToken,
            F::NoLeader => Reason::NoLeader,
            F::ElectionNoLeader => Reason::ElectionNoLeader,
            F::Unavailable => Reason::Unavailable,
            F::Timeout => Reason::Timeout,
            F::LeaseNotFound => Reason::LeaseNotFound,
            F::LeaseExists => Reason::LeaseExists,
            F::InvalidRequest => Reason::InvalidRequest,
            F::Other => Reason::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Reason;

    /// Every name is one variant's, read back as that variant; names are unique; an unknown
    /// name reads as `Unknown` rather than failing the read.
    #[test]
    fn names_round_trip_and_are_unique() {
        let mut names = std::collections::BTreeSet::new();
        for &r in Reason::ALL {
            assert!(names.insert(r.as_str()), "{r} twice");
            assert_eq!(r.as_str().parse::<Reason>().unwrap(), r);
            let wire = serde_json::to_value(r).unwrap();
            assert_eq!(wire, r.as_str());
            assert_eq!(serde_json::from_value::<Reason>(wire).unwrap(), r);
        }
        assert_eq!(serde_json::from_str::<Reason>("\"SomethingNewer\"").unwrap(), Reason::Unknown);
    }

    /// A fault's reason is its own name, as `format!("{fault:?}")` gave it before reasons were
    /// typed (dashboards match on these).
    #[test]
    fn a_fault_is_named_as_its_variant() {
        use crate::Fault;
        for fault in
            [Fault::Compacted, Fault::TlsRejected, Fault::Unavailable, Fault::LeaseExists, Fault::Other]
        {
            assert_eq!(Reason::from(fault).as_str(), format!("{fault:?}"));
        }
    }

    /// Maps keyed by reason serialize by name, in name order, as `by_reason` did as strings.
    #[test]
    fn maps_keyed_by_reason_read_by_name() {
        let map: std::collections::BTreeMap<Reason, u64> =
            [(Reason::WatchCompacted, 2), (Reason::ClusterChanged, 1)].into();
        let text = serde_json::to_string(&map).unwrap();
        assert_eq!(text, r#"{"ClusterChanged":1,"WatchCompacted":2}"#);
        assert_eq!(serde_json::from_str::<std::collections::BTreeMap<Reason, u64>>(&text).unwrap(), map);
    }
}
