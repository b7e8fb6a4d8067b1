//! The config file of SPEC §4: parsed from TOML, defaults filled in, and validated.
//!
//! Parsing ([`Config::from_toml_str`]) only checks shapes and types; every semantic rule lives
//! in [`Config::validate`], which reports *all* violations at once, each naming the field and
//! the rule it breaks, so an operator fixes a file in one round.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::auth::Auth;
use crate::keys::{KeyRewriter, RESERVED_MARKER};
use crate::units::{ByteSize, HumanDuration};

/// The whole config file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Identifies the link in the fence; two links never share a checkpoint.
    #[serde(default)]
    pub link_uid: String,
    /// Operator-bumped generation; a higher epoch takes the fence over (SPEC §6).
    #[serde(default = "default_epoch")]
    pub epoch: i64,
    /// `sync` mirrors forever; `drain` stops at a verified cutover.
    #[serde(default)]
    pub mode: Mode,
    /// Stop writing (no watch, nothing buffered) while HTTP keeps serving; a reload with
    /// `false` resumes from the watermark. For maintenance windows on the target.
    #[serde(default)]
    pub paused: bool,
    /// The cluster read from.
    pub source: Side,
    /// The cluster written to.
    pub target: Side,
    /// How the first copy treats what the target already holds.
    #[serde(default)]
    pub initial_sync: InitialSync,
    /// Batching, paging, pacing and timeouts.
    #[serde(default)]
    pub sync: SyncSection,
    /// The periodic diff-and-repair pass.
    #[serde(default)]
    pub reconcile: Reconcile,
    /// Where the fence record lives.
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    /// Leader election among several agents of one link.
    #[serde(default)]
    pub ha: Ha,
    /// The status, metrics and health server.
    #[serde(default)]
    pub http: Http,
}

fn default_epoch() -> i64 {
    1
}

/// `mode` of the agent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Mirror continuously.
    #[default]
    Sync,
    /// Catch up to a drain revision, verify, promote the target, stop.
    Drain,
}

/// One side of the link: `[source]` or `[target]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Side {
    /// `http://host:port` or `https://host:port`, one per member.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// The key prefix of the range on this side.
    #[serde(default)]
    pub prefix: String,
    /// Absent means plaintext.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<Tls>,
    /// Absent means no authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<Auth>,
}

/// `[source.tls]` / `[target.tls]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tls {
    /// CA bundle that signs the server certificates; absent = system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM), for servers that require one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    /// Client key (PEM), set together with `cert_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// Name to verify the server certificate against; empty = the endpoint's host.
    #[serde(default)]
    pub server_name: String,
    /// Skip server verification. Needs the acknowledge field below.
    #[serde(default)]
    pub insecure_skip_verify: bool,
    /// The operator's explicit acceptance of `insecure_skip_verify`.
    #[serde(default)]
    pub insecure_skip_verify_acknowledge_risk: bool,
}

/// `[initial_sync]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitialSync {
    /// What to do with keys already in the destination range.
    #[serde(default)]
    pub mode: InitialSyncMode,
    /// Tail from this source revision with no scan, on a link's first start: the operator
    /// vouches that the target already holds the source's state just before it (0 = scan).
    #[serde(default)]
    pub start_revision: i64,
}

/// `initial_sync.mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InitialSyncMode {
    /// Refuse to start unless the destination range is empty.
    #[default]
    RequireEmpty,
    /// Copy over whatever is there; keys only in the target stay.
    Overwrite,
    /// Copy over, then delete keys only in the target.
    OverwriteAndPrune,
}

/// `[sync]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyncSection {
    /// Inserted between `target.prefix` and the key's rest.
    pub dest_prefix: String,
    /// Prefixes relative to `source.prefix` that are never copied.
    pub exclude_prefixes: Vec<String>,
    /// Ops per target Txn, one slot reserved for the checkpoint.
    pub max_txn_ops: i64,
    /// Bytes per target Txn before a flush.
    pub txn_flush_bytes: ByteSize,
    /// Keys per scan page at most.
    pub page_key_limit: i64,
    /// Bytes per scan page before the page size halves.
    pub page_bytes: ByteSize,
    /// Watch responses buffered during the initial scan.
    pub watch_buffer_bytes: ByteSize,
    /// Target write pacing; 0 = unlimited.
    pub max_ops_per_second: i64,
    /// Deadline of each unary RPC.
    pub request_timeout: HumanDuration,
    /// Deadline to establish a connection.
    pub dial_timeout: HumanDuration,
    /// Retry curve for transient errors.
    pub backoff: Backoff,
    /// How often the agent asks the source for a progress notification.
    pub progress_interval: HumanDuration,
    /// Whether progress notifications advance the watermark.
    pub trust_progress_notify: TrustProgressNotify,
    /// Lag beyond which `ReplicationLagExceeded` is raised and the link stops reporting
    /// `Available`: the watermark has trailed the source for this long, or nothing has moved it
    /// for this long while the source is ahead.
    pub max_lag: HumanDuration,
    /// What happens to the leases of source keys (SPEC §5, Leases).
    pub leases: LeaseMode,
    /// What the target's revisions mean: `compact` (the link's own) or `exact` (each source
    /// revision R lands as target revision R, SPEC §10; docs/exact-revisions.md).
    pub revisions: Revisions,
    /// Exact mode: the TTL of every target lease the agent grants (or the source's TTL where
    /// longer), so that no target lease runs out while every agent is down this long.
    pub exact_lease_hold: HumanDuration,
    /// Exact mode: the snapshot file `mirror-agent snapshot save` wrote (empty: none). Its
    /// `.json` proves a target restored from it after the source compacted past its revision,
    /// and its `.spool` holds the source revisions the source has compacted since.
    pub exact_seed: String,
    /// Exact mode: target Txns in flight at most (1 = one at a time); a second is sent only
    /// while revisions wait, and with `ha.enabled` one at a time.
    pub exact_txns_in_flight: i64,
    /// Exact mode: the least time between two sends while a Txn is in flight (etcd reorders
    /// requests that reach it together, SPEC §11).
    pub exact_txn_spacing: HumanDuration,
    /// Compact mode: the tail's target Txns in flight at most (1 = one at a time, each sent
    /// once the one before it landed); a later one compares the checkpoint with what the one
    /// before it stores.
    pub txns_in_flight: i64,
}

/// `sync.revisions`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Revisions {
    /// Target revisions are the link's own: revisions fold into Txns, the scan writes pages.
    #[default]
    Compact,
    /// Source revision R is target revision R: a replica of the whole keyspace, seeded from a
    /// snapshot, one target Txn per source revision.
    Exact,
}

impl Default for SyncSection {
    fn default() -> Self {
        SyncSection {
            dest_prefix: String::new(),
            exclude_prefixes: Vec::new(),
            max_txn_ops: 128,
            txn_flush_bytes: ByteSize(1 << 20),
            page_key_limit: 4096,
            page_bytes: ByteSize(1 << 20),
            watch_buffer_bytes: ByteSize(16 << 20),
            max_ops_per_second: 0,
            request_timeout: HumanDuration::secs(30),
            dial_timeout: HumanDuration::secs(10),
            backoff: Backoff::default(),
            progress_interval: HumanDuration::secs(45),
            trust_progress_notify: TrustProgressNotify::Auto,
            max_lag: HumanDuration::secs(300),
            leases: LeaseMode::Strip,
            revisions: Revisions::Compact,
            exact_lease_hold: HumanDuration::secs(3600),
            exact_seed: String::new(),
            exact_txns_in_flight: 2,
            exact_txn_spacing: HumanDuration(std::time::Duration::from_micros(100)),
            txns_in_flight: 1,
        }
    }
}

/// `sync.backoff`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Backoff {
    /// First delay.
    pub initial: HumanDuration,
    /// Cap.
    pub max: HumanDuration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { initial: HumanDuration::secs(1), max: HumanDuration::secs(30) }
    }
}

impl TrustProgressNotify {
    /// Whether progress notifications of a server of `version` (a side's lowest) are trusted.
    pub fn trusts(self, version: &str) -> bool {
        match self {
            TrustProgressNotify::Always => true,
            TrustProgressNotify::Never => false,
            TrustProgressNotify::Auto => crate::progress_notify_trustworthy(version),
        }
    }
}

/// `sync.leases`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseMode {
    /// Leased source keys are written without a lease; their expiry arrives as deletes.
    #[default]
    Strip,
    /// The target holds a lease with the same ID and TTL, kept alive while the source's lives.
    Preserve,
}

/// `sync.trust_progress_notify`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrustProgressNotify {
    /// Trust from 3.4.25 / 3.5.8 on, where etcd's progress notifications are correct.
    #[default]
    Auto,
    /// Always trust.
    Always,
    /// Never trust; the watermark moves only with data.
    Never,
}

/// `[reconcile]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Reconcile {
    /// Period of the diff-and-repair pass; `"0s"` disables it.
    pub interval: HumanDuration,
    /// Delete keys found only in the target.
    pub delete_orphans: bool,
}

impl Default for Reconcile {
    fn default() -> Self {
        Reconcile { interval: HumanDuration::secs(3600), delete_orphans: false }
    }
}

/// `[checkpoint]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Empty = the reserved namespace's `checkpoint` key.
    pub key: String,
}

/// `[ha]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Ha {
    /// Campaign for leadership instead of writing straight away.
    pub enabled: bool,
    /// TTL of the election lease.
    pub lease_ttl: HumanDuration,
}

impl Default for Ha {
    fn default() -> Self {
        Ha { enabled: false, lease_ttl: HumanDuration::secs(10) }
    }
}

/// `[http]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Http {
    /// Address of `/statusz`, `/metrics`, `/healthz`, `/readyz`.
    pub listen: String,
}

impl Default for Http {
    fn default() -> Self {
        Http { listen: "127.0.0.1:8080".into() }
    }
}

// === impl Config ===

impl Config {
    /// Parses TOML and fills in defaults; does not validate.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))
    }

    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        let config = Config::from_toml_str(&text)?;
        config.validate()?;
        config.check_password_files()?;
        Ok(config)
    }

    /// A password file that is there but empty (or unreadable) is a config error, found when the file is
    /// loaded rather than at the first connect (a file not there yet is left to the connect,
    /// which names it: the Secret may be mounted later than the config is checked).
    fn check_password_files(&self) -> Result<(), ConfigError> {
        let mut empty = Vec::new();
        for (name, side) in [("source", &self.source), ("target", &self.target)] {
            let Some(auth) = &side.auth else { continue };
            if !auth.password_file.as_ref().is_some_and(|p| p.exists()) {
                continue;
            }
            if let Err(why) = crate::auth::read_password(auth) {
                empty.push(Violation { field: format!("{name}.auth.password_file"), rule: why });
            }
        }
        if empty.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(empty))
        }
    }

    /// Checks every rule of SPEC §4 and returns all violations, sorted by field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut v = Rules::default();
        self.check(&mut v);
        if v.0.is_empty() {
            Ok(())
        } else {
            v.0.sort();
            Err(ConfigError::Invalid(v.0))
        }
    }

    /// The effective config as TOML, with every secret replaced by `<redacted>`.
    pub fn to_redacted_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    /// The target prefix every mirrored key lands under: `target.prefix + sync.dest_prefix`.
    pub fn destination_prefix(&self) -> String {
        format!("{}{}", self.target.prefix, self.sync.dest_prefix)
    }

    /// The key rewriter this config describes.
    pub fn rewriter(&self) -> KeyRewriter {
        KeyRewriter::new(
            self.source.prefix.as_bytes(),
            self.destination_prefix().as_bytes(),
            self.sync.exclude_prefixes.iter().map(|p| p.as_bytes()),
        )
    }

    /// Whether source revision R is target revision R (`sync.revisions = "exact"`).
    pub fn exact(&self) -> bool {
        self.sync.revisions == Revisions::Exact
    }

    /// The checkpoint key: configured, or the reserved namespace's `checkpoint`; in exact
    /// mode `\0etcd-mirror/<link_uid>/checkpoint`, naming the link, so that a chain's next
    /// link (whose target is restored from this one's) never reads this record as its own.
    pub fn checkpoint_key(&self) -> Vec<u8> {
        if self.exact() {
            return [&self.rewriter().reserved_prefix()[..], self.link_uid.as_bytes(), b"/checkpoint"]
                .concat();
        }
        if self.checkpoint.key.is_empty() {
            self.rewriter().default_checkpoint_key()
        } else {
            self.checkpoint.key.as_bytes().to_vec()
        }
    }
}

#[path = "config_rules.rs"]
mod rules;
use rules::Rules;

#[path = "config_error.rs"]
mod error;
pub use error::{ConfigError, Violation};

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
