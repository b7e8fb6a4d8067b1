//! Conditions, Kubernetes style: the typed names of SPEC §7 and which state of each is healthy.

use serde::{Deserialize, Serialize};

/// One condition, Kubernetes style. On the wire (`/statusz`) the type is its SPEC §7 name and
/// the status `"True"` or `"False"`; in code both are typed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Condition {
    /// The condition, e.g. `Available`.
    #[serde(rename = "type")]
    pub type_: ConditionType,
    /// Whether it holds (`"True"` / `"False"`).
    #[serde(with = "true_false")]
    pub status: bool,
    /// Why it holds or not; named on the wire.
    pub reason: crate::Reason,
    /// Human-readable detail.
    pub message: String,
    /// When `status` last changed (RFC 3339).
    pub since: String,
}

impl Condition {
    /// The status as `/statusz` shows it: `True` or `False`.
    pub fn status_name(&self) -> &'static str {
        if self.status {
            "True"
        } else {
            "False"
        }
    }
}

/// A condition's status as Kubernetes writes it.
mod true_false {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(on: &bool, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(if *on { "True" } else { "False" })
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        match String::deserialize(d)?.as_str() {
            "True" => Ok(true),
            "False" => Ok(false),
            other => {
                Err(serde::de::Error::custom(format!("condition status {other:?} is neither True nor False")))
            }
        }
    }
}

/// The conditions of a status read from an agent: a condition type this build does not know (a
/// newer agent's) is dropped rather than failing the whole read.
pub(crate) fn known_conditions<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Condition>, D::Error> {
    #[derive(Deserialize)]
    struct Wire {
        #[serde(rename = "type")]
        type_: String,
        #[serde(with = "true_false")]
        status: bool,
        reason: crate::Reason,
        message: String,
        since: String,
    }
    let wire = Vec::<Wire>::deserialize(d)?;
    Ok(wire
        .into_iter()
        .filter_map(|w| {
            let type_ = w.type_.parse().ok()?;
            Some(Condition { type_, status: w.status, reason: w.reason, message: w.message, since: w.since })
        })
        .collect())
}

/// The condition types of SPEC §7, and `DrainVerificationFailed`. The engine names conditions
/// only through this enum; `/statusz` carries their names as strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConditionType {
    /// The link replicates (phase `syncing`) and is not stale.
    Available,
    /// The source answered the last probe.
    SourceReachable,
    /// The target answered the last probe and takes writes.
    TargetReachable,
    /// The target answers "too many requests".
    TargetThrottled,
    /// The target is out of space.
    TargetQuotaExhausted,
    /// The target equals the source at the watermark (G3).
    InitialSyncComplete,
    /// Resyncs or genesis restarts repeat with no live apply.
    ResyncLoopDetected,
    /// Lag, or time without progress, over `sync.max_lag`.
    ReplicationLagExceeded,
    /// The last reconcile pass found differences.
    DriftDetected,
    /// `require_empty` met a non-empty destination range.
    EmptyTargetViolation,
    /// Drained, verified and promoted.
    CutoverReady,
    /// Counts equal and no drift at the last pass.
    InvariantsHeld,
    /// An endpoint is a learner.
    LearnerEndpoint,
    /// An endpoint of a side does not answer.
    MemberUnreachable,
    /// Another link's checkpoint where this link writes or prunes.
    PrefixConflict,
    /// The link would write into its own source, or echo with another link.
    DirectionConflict,
    /// Another writer holds the fence.
    Fenced,
    /// The source answers below the watermark: restored from an older snapshot.
    SourceWentBack,
    /// The sides still differed after the drain's repair pass.
    DrainVerificationFailed,
}

impl ConditionType {
    /// The name in `/statusz`.
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionType::Available => "Available",
            ConditionType::SourceReachable => "SourceReachable",
            ConditionType::TargetReachable => "TargetReachable",
            ConditionType::TargetThrottled => "TargetThrottled",
            ConditionType::TargetQuotaExhausted => "TargetQuotaExhausted",
            ConditionType::InitialSyncComplete => "InitialSyncComplete",
            ConditionType::ResyncLoopDetected => "ResyncLoopDetected",
            ConditionType::ReplicationLagExceeded => "ReplicationLagExceeded",
            ConditionType::DriftDetected => "DriftDetected",
            ConditionType::EmptyTargetViolation => "EmptyTargetViolation",
            ConditionType::CutoverReady => "CutoverReady",
            ConditionType::InvariantsHeld => "InvariantsHeld",
            ConditionType::LearnerEndpoint => "LearnerEndpoint",
            ConditionType::MemberUnreachable => "MemberUnreachable",
            ConditionType::PrefixConflict => "PrefixConflict",
            ConditionType::DirectionConflict => "DirectionConflict",
            ConditionType::Fenced => "Fenced",
            ConditionType::SourceWentBack => "SourceWentBack",
            ConditionType::DrainVerificationFailed => "DrainVerificationFailed",
        }
    }
}

impl AsRef<str> for ConditionType {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl ConditionType {
    /// Every condition type, in SPEC §7's order.
    pub const ALL: [ConditionType; 19] = [
        ConditionType::Available,
        ConditionType::SourceReachable,
        ConditionType::TargetReachable,
        ConditionType::TargetThrottled,
        ConditionType::TargetQuotaExhausted,
        ConditionType::InitialSyncComplete,
        ConditionType::ResyncLoopDetected,
        ConditionType::ReplicationLagExceeded,
        ConditionType::DriftDetected,
        ConditionType::EmptyTargetViolation,
        ConditionType::CutoverReady,
        ConditionType::InvariantsHeld,
        ConditionType::LearnerEndpoint,
        ConditionType::MemberUnreachable,
        ConditionType::PrefixConflict,
        ConditionType::DirectionConflict,
        ConditionType::Fenced,
        ConditionType::SourceWentBack,
        ConditionType::DrainVerificationFailed,
    ];
}

impl ConditionType {
    /// The status at which this condition is healthy: `Some(true)` for the five that say the
    /// link works (`Available`, `SourceReachable`, `TargetReachable`, `InitialSyncComplete`,
    /// `InvariantsHeld`), `None` for `CutoverReady` (neither: it says a cutover finished),
    /// `Some(false)` for every condition that names a problem.
    pub fn healthy_when(self) -> Option<bool> {
        match self {
            ConditionType::Available
            | ConditionType::SourceReachable
            | ConditionType::TargetReachable
            | ConditionType::InitialSyncComplete
            | ConditionType::InvariantsHeld => Some(true),
            ConditionType::CutoverReady => None,
            _ => Some(false),
        }
    }
}

impl std::fmt::Display for ConditionType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is no condition type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is no condition type")]
pub struct UnknownCondition(pub String);

impl Serialize for ConditionType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ConditionType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

impl std::str::FromStr for ConditionType {
    type Err = UnknownCondition;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ConditionType::ALL.into_iter().find(|c| c.as_str() == s).ok_or_else(|| UnknownCondition(s.to_owned()))
    }
}
