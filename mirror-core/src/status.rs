//! The `/statusz` document of SPEC §7. Field names are public interface.

use std::collections::BTreeMap;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::condition::{Condition, ConditionType};
use crate::error::ErrorClass;
use crate::reason::Reason;

/// Where the agent is in its life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Probing both sides.
    #[default]
    Connecting,
    /// Genesis scan and replay.
    InitialSync,
    /// Tailing the source; G3 holds.
    Syncing,
    /// Alive but held back (target full, throttled, unreachable).
    Degraded,
    /// Fenced: writes nothing, watches the fence.
    Standby,
    /// Cut over: the target is the primary.
    Drained,
    /// A permanent error: writes nothing, keeps serving HTTP.
    Failed,
    /// Paused by config (`paused = true`): no watch, no writes; HTTP keeps serving.
    Paused,
}

impl Phase {
    /// Every phase, for one-hot metrics.
    pub const ALL: [Phase; 8] = [
        Phase::Connecting,
        Phase::InitialSync,
        Phase::Syncing,
        Phase::Degraded,
        Phase::Standby,
        Phase::Drained,
        Phase::Failed,
        Phase::Paused,
    ];

    /// The snake_case name used in JSON and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Connecting => "connecting",
            Phase::InitialSync => "initial_sync",
            Phase::Syncing => "syncing",
            Phase::Degraded => "degraded",
            Phase::Standby => "standby",
            Phase::Drained => "drained",
            Phase::Failed => "failed",
            Phase::Paused => "paused",
        }
    }

    /// The reason `Available` carries while the agent is in this phase.
    pub fn reason(self) -> Reason {
        match self {
            Phase::Connecting => Reason::Connecting,
            Phase::InitialSync => Reason::InitialSync,
            Phase::Syncing => Reason::Syncing,
            Phase::Degraded => Reason::Degraded,
            Phase::Standby => Reason::Standby,
            Phase::Drained => Reason::Drained,
            Phase::Failed => Reason::Failed,
            Phase::Paused => Reason::Paused,
        }
    }
}

/// What this agent is to its link, as `/statusz` names it (`role`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentRole {
    /// Mirrors the source into the target (or would, once connected).
    #[default]
    Mirror,
    /// Under HA, waits for the election while another agent of the link leads.
    Standby,
    /// The target is cut over: it is the primary, and this agent writes nothing.
    Primary,
}

impl AgentRole {
    /// The name in `/statusz`.
    pub fn as_str(self) -> &'static str {
        match self {
            AgentRole::Mirror => "mirror",
            AgentRole::Standby => "standby",
            AgentRole::Primary => "primary",
        }
    }
}

impl std::fmt::Display for AgentRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one side reported at connect.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SideStatus {
    /// Lowest member version seen.
    pub version: String,
    /// Cluster id, decimal.
    pub cluster_id: String,
    /// Whether any endpoint is a learner.
    pub learner: bool,
    /// Configured endpoints that did not answer the last probe (a member down); replication
    /// goes on through the others while the cluster has a leader.
    #[serde(default)]
    pub unreachable_endpoints: Vec<String>,
    /// Expiry of the TLS material loaded at the last connect (`ca`, `client`); empty without TLS.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tls_cert_expiry: Vec<crate::tls::CertExpiry>,
}

/// `leases` of the status: the target leases of `sync.leases = "preserve"`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LeaseStatus {
    /// Target leases this agent keeps alive now.
    pub preserved: u64,
    /// Target leases granted since the agent started.
    pub granted_total: u64,
    /// Target leases revoked since the agent started (their source lease was gone).
    pub revoked_total: u64,
    /// The longest time since a kept lease was last kept alive, at the last check.
    pub keepalive_lag_seconds: f64,
}

/// `exact` of the status: an exact replica (SPEC §10).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExactStatus {
    /// The target's revision: the last source revision landed (the watermark, as a revision of
    /// both clusters).
    pub target_revision: i64,
    /// Leases that came with the snapshot and are still held: while one lives, an outage of
    /// every agent longer than its TTL loses the replica.
    pub snapshot_leases: u64,
    /// The shortest TTL among them, seconds (`null`: none left).
    pub shortest_snapshot_lease_ttl_seconds: Option<i64>,
    /// Bytes of the seed's spool (`sync.exact_seed`), 0 without one.
    pub spool_bytes: u64,
    /// Revisions this agent landed since it started.
    pub landed_here: u64,
    /// Revisions another replica of the link landed (HA) since it started.
    pub landed_elsewhere: u64,
    /// The revision the link last compacted the target at, following the source (0: not yet).
    pub compacted_revision: i64,
    /// Txns sent again since the agent started: etcd ran a later one first (it then failed its
    /// fence compare), or an answer was lost.
    pub resent: u64,
}

/// Progress of the genesis scan.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct InitialSyncStatus {
    /// Keys written by the scan so far.
    pub keys: u64,
    /// Keys in scope at R0.
    pub total_keys: u64,
    /// When the scan started (RFC 3339).
    pub started: Option<String>,
    /// When the initial sync completed (RFC 3339).
    pub completed: Option<String>,
}

/// Forced resyncs since the agent started.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ForcedResyncs {
    /// How many.
    pub count: u64,
    /// How many per reason.
    pub by_reason: BTreeMap<Reason, u64>,
    /// The most recent reason.
    pub last_reason: Option<Reason>,
}

/// Keys the target holds under one excluded prefix.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExcludedKeys {
    /// The exclude, relative to the source prefix, as configured (lossy UTF-8).
    pub prefix: String,
    /// Target keys under its destination form.
    pub keys: u64,
}

/// Result of the last reconcile pass.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LastReconcile {
    /// When it finished (RFC 3339).
    pub time: Option<String>,
    /// Keys in the source missing from the target.
    pub missing: u64,
    /// Keys whose values differ.
    pub divergent: u64,
    /// Keys only in the target.
    pub orphan: u64,
    /// Keys repaired or deleted.
    pub repaired: u64,
    /// Source keys compared (the pass reads the whole range of both sides).
    #[serde(default)]
    pub keys_compared: u64,
    /// How long the pass took, repairs included.
    #[serde(default)]
    pub duration_seconds: f64,
}

/// `ha` of /statusz, present when `ha.enabled`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HaStatus {
    /// Whether this agent leads the election (and so may write).
    pub leader: bool,
    /// The agent id of the leader, as far as this agent knows.
    pub leader_agent_id: Option<String>,
    /// This agent's election lease while it campaigns or leads.
    pub lease_id: i64,
    /// The epoch of this agent's current or last term as leader (0: never led).
    pub term: u64,
}

/// The cutover record (drain mode).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CutoverStatus {
    /// Source revision the drain waits for.
    pub drain_target_revision: i64,
    /// Watermark at which both sides were verified.
    pub drained_revision: i64,
    /// When verification passed (RFC 3339).
    pub verified_time: Option<String>,
    /// Source keys at the drained revision.
    pub source_keys: u64,
    /// Target keys after the drain.
    pub target_keys: u64,
    /// Source keys that carried a lease (stripped in the target).
    pub leased_keys: u64,
}

/// The last error the engine met.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LastError {
    /// `resync`, `quota`, `throttle`, `permanent`, `transient`.
    pub class: ErrorClass,
    /// Why, e.g. `TooManyOps`.
    pub reason: Reason,
    /// Human-readable, keys redacted.
    pub message: String,
    /// The shell command that clears the way, where there is one (the `etcdctl` commands of an
    /// `EmptyTargetViolation` or a `PrefixConflict`); also in `message`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

/// The live status, shared by the engine (writer) and the HTTP server (readers).
pub type StatusHandle = std::sync::Arc<std::sync::RwLock<Status>>;

/// The whole `/statusz` document.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// Current phase.
    pub phase: Phase,
    /// The link.
    pub link_uid: String,
    /// This agent's epoch.
    pub epoch: u64,
    /// What this agent is to the link: `mirror`, `standby` or `primary`.
    pub role: AgentRole,
    /// This agent's id.
    pub agent_id: String,
    /// The source cluster.
    pub source: SideStatus,
    /// The target cluster.
    pub target: SideStatus,
    /// Source revision the target reflects.
    pub watermark: i64,
    /// Latest source revision seen.
    pub source_revision: i64,
    /// `source_revision - watermark`.
    pub lag_revisions: i64,
    /// Seconds since the watermark last equalled the source revision.
    pub lag_seconds: f64,
    /// When the watermark last advanced or was confirmed current (RFC 3339).
    pub last_progress_time: Option<String>,
    /// When the source was last confirmed at or below the watermark, as the checkpoint stores
    /// it (RFC 3339): a failover now would lose at most what the source took since.
    #[serde(default)]
    pub confirmed_time: Option<String>,
    /// Seconds since `confirmed_time` (0 before any confirmation), refreshed every second.
    #[serde(default)]
    pub confirmed_age_seconds: f64,
    /// Seconds since `last_progress_time` (0 before any progress); refreshed every second even
    /// when the engine is stuck, so a wedged loop shows.
    #[serde(default)]
    pub seconds_since_progress: f64,
    /// Genesis progress.
    pub initial_sync: InitialSyncStatus,
    /// Target keys written by the tail and the scan.
    pub keys_applied_total: u64,
    /// Leases kept on the target (`sync.leases = "preserve"`).
    #[serde(default)]
    pub leases: LeaseStatus,
    /// Source keys in scope that carry a lease, as of the last full
    /// read of the range: the initial sync's scan (growing while it runs), then each reconcile
    /// pass or drain verification. The tail does not move it: a put with a lease may re-put a
    /// key already counted, and a lease's expiry arrives as plain deletes.
    pub lease_backed_keys: u64,
    /// Forced resyncs.
    pub forced_resyncs: ForcedResyncs,
    /// Genesis restarts (buffer overflow, compaction mid-scan).
    pub scan_restarts: u64,
    /// Source watches opened after the first one of this process (any reconnect, a re-watch
    /// after sustained target backoff, a genesis restart). An idle link should not add to it.
    #[serde(default)]
    pub watch_restarts: u64,
    /// Source keys in scope at the last count.
    pub source_keys: Option<u64>,
    /// Target keys in the destination range at the last count.
    pub target_keys: Option<u64>,
    /// The last reconcile pass.
    pub last_reconcile: Option<LastReconcile>,
    /// Excluded prefixes under which the target still holds keys (counted at every connect and
    /// reconcile pass): typically an exclude added to a running link. The agent never writes,
    /// counts or prunes there, so those keys stay until someone deletes them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub excluded_keys_in_target: Vec<ExcludedKeys>,
    /// Conditions.
    #[serde(deserialize_with = "crate::condition::known_conditions")]
    pub conditions: Vec<Condition>,
    /// Cutover record, once draining.
    pub cutover: Option<CutoverStatus>,
    /// The last error.
    pub last_error: Option<LastError>,
    /// Resident memory of the agent now (`VmRSS`), read when status is served; 0 where /proc
    /// has none.
    #[serde(default)]
    pub rss_bytes: u64,
    /// The most resident memory the agent has held (`VmHWM`): what a memory limit must cover.
    #[serde(default)]
    pub peak_rss_bytes: u64,
    /// The HA election, when `ha.enabled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ha: Option<HaStatus>,
    /// Exact mode (`sync.revisions = "exact"`, SPEC §10); absent in compact mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<ExactStatus>,
    /// Since when the watermark trails the source revision (wall clock, not served).
    #[serde(skip)]
    pub behind_since: Option<SystemTime>,
    /// When the watermark last moved or was confirmed current (wall clock, not served).
    #[serde(skip)]
    pub progress_at: Option<SystemTime>,
}

/// The process's resident memory now and at its peak (`VmRSS`, `VmHWM` of /proc/self/status),
/// in bytes; `None` where /proc is not there.
pub fn process_memory() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = |field: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(field))?;
        line[field.len()..].trim().trim_end_matches("kB").trim().parse::<u64>().ok().map(|k| k << 10)
    };
    Some((kib("VmRSS:")?, kib("VmHWM:")?))
}

impl Status {
    /// Fills `rss_bytes` and `peak_rss_bytes` from /proc (left as they are elsewhere).
    pub fn read_memory(&mut self) {
        if let Some((rss, peak)) = process_memory() {
            self.rss_bytes = rss;
            self.peak_rss_bytes = peak;
        }
    }

    /// Sets a condition; `since` moves only when its status flips.
    pub fn set_condition(
        &mut self,
        type_: ConditionType,
        on: bool,
        reason: Reason,
        message: impl Into<String>,
    ) {
        let message = message.into();
        match self.conditions.iter_mut().find(|c| c.type_ == type_) {
            Some(c) => {
                if c.status != on {
                    c.since = now_rfc3339();
                }
                c.status = on;
                c.reason = reason;
                c.message = message;
            }
            None => {
                self.conditions.push(Condition { type_, status: on, reason, message, since: now_rfc3339() })
            }
        }
    }

    /// Whether a condition is currently true.
    pub fn condition(&self, type_: ConditionType) -> bool {
        self.conditions.iter().any(|c| c.type_ == type_ && c.status)
    }
}

/// Now as RFC 3339 with seconds.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

#[cfg(test)]
#[path = "status_tests.rs"]
mod tests;
