//! The config file of SPEC §4: parsed from TOML, defaults filled in, and validated.
//!
//! Parsing ([`Config::from_toml_str`]) only checks shapes and types; every semantic rule lives
//! in [`Config::validate`], which reports *all* violations at once, each naming the field and
//! the rule it breaks, so an operator fixes a file in one round.

use std::collections::BTreeSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

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

/// `[source.auth]` / `[target.auth]`: a user whose password comes from a file or the environment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Auth {
    /// The etcd user.
    #[serde(default)]
    pub username: String,
    /// File holding the password (trailing newline ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
    /// Environment variable holding the password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_env: Option<String>,
    /// Accepted by the parser only to be refused by `validate` with a clear message:
    /// passwords never live in the config file.
    #[serde(default, skip_serializing_if = "Option::is_none", serialize_with = "redact")]
    pub password: Option<String>,
}

fn redact<S: serde::Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(_) => s.serialize_str("<redacted>"),
        None => s.serialize_none(),
    }
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
}

impl Default for SyncSection {
    fn default() -> Self {
        SyncSection {
            dest_prefix: String::new(),
            exclude_prefixes: Vec::new(),
            max_txn_ops: 128,
            txn_flush_bytes: ByteSize(1 << 20),
            page_key_limit: 512,
            page_bytes: ByteSize(1 << 20),
            watch_buffer_bytes: ByteSize(16 << 20),
            max_ops_per_second: 0,
            request_timeout: HumanDuration::secs(30),
            dial_timeout: HumanDuration::secs(10),
            backoff: Backoff::default(),
            progress_interval: HumanDuration::secs(45),
            trust_progress_notify: TrustProgressNotify::Auto,
            max_lag: HumanDuration::secs(300),
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

// === errors ===

/// One broken rule: the field (dotted path, as in the file) and what it must be.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Violation {
    /// Dotted path of the field, e.g. `sync.max_txn_ops` or `source.endpoints[1]`.
    pub field: String,
    /// The rule, phrased so that `field rule` reads as a sentence.
    pub rule: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.rule)
    }
}

/// Why a config could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O failure.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("cannot parse config: {0}")]
    Parse(String),
    /// The file parsed but breaks rules.
    #[error("invalid config:\n{}", .0.iter().map(|v| format!("  - {v}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Violation>),
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
        Ok(config)
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

    /// The checkpoint key: configured, or the reserved namespace's `checkpoint`.
    pub fn checkpoint_key(&self) -> Vec<u8> {
        if self.checkpoint.key.is_empty() {
            self.rewriter().default_checkpoint_key()
        } else {
            self.checkpoint.key.as_bytes().to_vec()
        }
    }

    fn check(&self, v: &mut Rules) {
        let uid_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if self.link_uid.is_empty() {
            v.add("link_uid", "is required");
        } else if self.link_uid.len() > 128 || !self.link_uid.chars().all(uid_ok) {
            v.add("link_uid", "must be 1-128 characters of A-Z a-z 0-9 . _ -");
        }
        if self.epoch < 1 {
            v.add("epoch", "must be >= 1");
        }
        self.source.check("source", v);
        self.target.check("target", v);

        if self.initial_sync.start_revision < 0 {
            v.add("initial_sync.start_revision", "must be >= 0");
        } else if self.initial_sync.start_revision > 0
            && self.initial_sync.mode == InitialSyncMode::RequireEmpty
        {
            v.add(
                "initial_sync.start_revision",
                "must be 0 with initial_sync.mode = \"require_empty\" (a partial history cannot start from an empty target)",
            );
        }

        let s = &self.sync;
        if s.dest_prefix.contains(RESERVED_MARKER) {
            v.add("sync.dest_prefix", "must not contain the reserved marker \\u0000etcd-mirror/");
        }
        for (i, p) in s.exclude_prefixes.iter().enumerate() {
            if p.is_empty() {
                v.add(
                    format!("sync.exclude_prefixes[{i}]"),
                    "must not be empty (it would exclude the whole range)",
                );
            }
        }
        if s.max_txn_ops < 2 {
            v.add("sync.max_txn_ops", "must be >= 2 (one slot is reserved for the checkpoint)");
        }
        if s.txn_flush_bytes.bytes() == 0 {
            v.add("sync.txn_flush_bytes", "must be > 0");
        }
        if s.page_key_limit < 1 {
            v.add("sync.page_key_limit", "must be >= 1");
        }
        if s.page_bytes.bytes() == 0 {
            v.add("sync.page_bytes", "must be > 0");
        }
        if s.watch_buffer_bytes.bytes() == 0 {
            v.add("sync.watch_buffer_bytes", "must be > 0");
        }
        if s.max_ops_per_second < 0 {
            v.add("sync.max_ops_per_second", "must be >= 0 (0 = unlimited)");
        }
        for (field, d) in [
            ("sync.request_timeout", s.request_timeout),
            ("sync.dial_timeout", s.dial_timeout),
            ("sync.progress_interval", s.progress_interval),
            ("sync.backoff.initial", s.backoff.initial),
            ("sync.max_lag", s.max_lag),
        ] {
            if d.get().is_zero() {
                v.add(field, "must be > 0s");
            }
        }
        if s.backoff.max < s.backoff.initial {
            v.add("sync.backoff.max", "must be >= sync.backoff.initial");
        }

        let interval = self.reconcile.interval.get();
        if !interval.is_zero() && interval.as_secs() < 1 {
            v.add("reconcile.interval", "must be \"0s\" (disabled) or at least 1s");
        }

        if !self.checkpoint.key.is_empty() {
            let dest = self.destination_prefix();
            let reserved = String::from_utf8_lossy(&self.rewriter().reserved_prefix()).into_owned();
            if !self.checkpoint.key.starts_with(&dest) {
                v.add(
                    "checkpoint.key",
                    format!(
                        "must start with the destination prefix {dest:?} (target.prefix + sync.dest_prefix)"
                    ),
                );
            } else if !self.checkpoint.key.starts_with(&reserved) {
                v.add(
                    "checkpoint.key",
                    format!("must lie in the reserved namespace {reserved:?}, or mirrored keys could overwrite it"),
                );
            }
        }

        let ttl = self.ha.lease_ttl.get();
        if ttl.as_secs() < 2 {
            v.add("ha.lease_ttl", "must be >= 2s (etcd's smallest useful lease)");
        } else if ttl.as_secs() > 300 {
            v.add("ha.lease_ttl", "must be <= 300s (a standby waits this long after a leader dies)");
        } else if ttl.subsec_nanos() != 0 {
            v.add("ha.lease_ttl", "must be whole seconds (etcd leases count seconds)");
        }
        if self.http.listen.parse::<SocketAddr>().is_err() {
            v.add("http.listen", "must be an address and port, e.g. \"127.0.0.1:8080\"");
        }

        // The same cluster on both sides with overlapping ranges mirrors into itself. The
        // cluster-id check at connect catches different spellings of one cluster; this catches
        // the obvious case before anything connects.
        let norm = |s: &Side| {
            s.endpoints.iter().map(|e| e.trim_end_matches('/').to_owned()).collect::<BTreeSet<_>>()
        };
        let dest = self.destination_prefix();
        let src = &self.source.prefix;
        if !self.source.endpoints.is_empty()
            && norm(&self.source) == norm(&self.target)
            && (dest.starts_with(src.as_str()) || src.starts_with(dest.as_str()))
        {
            v.add(
                "target.endpoints",
                "are the source's endpoints and the destination range overlaps the source range (a direction conflict)",
            );
        }
    }
}

impl Side {
    fn check(&self, side: &str, v: &mut Rules) {
        if self.endpoints.is_empty() {
            v.add(format!("{side}.endpoints"), "must list at least one endpoint");
        }
        let mut schemes = BTreeSet::new();
        for (i, e) in self.endpoints.iter().enumerate() {
            match parse_endpoint(e) {
                Ok(scheme) => {
                    schemes.insert(scheme);
                }
                Err(rule) => v.add(format!("{side}.endpoints[{i}]"), rule),
            }
        }
        if schemes.len() > 1 {
            v.add(format!("{side}.endpoints"), "must not mix http:// and https://");
        }
        match (&self.tls, schemes.iter().next().copied()) {
            (None, Some("https")) => v.add(format!("{side}.tls"), "is required for https:// endpoints"),
            (Some(_), Some("http")) if schemes.len() == 1 => v.add(
                format!("{side}.tls"),
                "must be absent for http:// endpoints (use https:// to enable TLS)",
            ),
            _ => {}
        }
        if let Some(tls) = &self.tls {
            if tls.insecure_skip_verify && !tls.insecure_skip_verify_acknowledge_risk {
                v.add(
                    format!("{side}.tls.insecure_skip_verify"),
                    "requires insecure_skip_verify_acknowledge_risk = true",
                );
            }
            if tls.cert_file.is_some() != tls.key_file.is_some() {
                v.add(format!("{side}.tls.cert_file"), "and key_file must be set together");
            }
        }
        if let Some(auth) = &self.auth {
            if auth.username.is_empty() {
                v.add(format!("{side}.auth.username"), "must not be empty");
            }
            if auth.password.is_some() {
                v.add(
                    format!("{side}.auth.password"),
                    "is not accepted in the config file; use password_file or password_env",
                );
            }
            if auth.password_file.is_some() == auth.password_env.is_some() {
                v.add(format!("{side}.auth"), "needs exactly one of password_file or password_env");
            }
        }
        if self.prefix.contains(RESERVED_MARKER) {
            v.add(format!("{side}.prefix"), "must not contain the reserved marker \\u0000etcd-mirror/");
        }
    }
}

/// Checks `scheme://host:port` and returns the scheme.
fn parse_endpoint(e: &str) -> Result<&'static str, String> {
    let (scheme, rest) =
        e.split_once("://").ok_or_else(|| format!("{e:?} must be http://host:port or https://host:port"))?;
    let scheme = match scheme {
        "http" => "http",
        "https" => "https",
        other => return Err(format!("{e:?} has scheme {other:?}; use http or https")),
    };
    let authority = rest.trim_end_matches('/');
    if authority.contains('@') {
        return Err("must not carry credentials; use the auth section".into());
    }
    if authority.contains('/') {
        return Err(format!("{e:?} must not have a path"));
    }
    let (host, port) = authority.rsplit_once(':').ok_or_else(|| format!("{e:?} needs an explicit port"))?;
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(format!("{e:?} must be {scheme}://host:port with a port in 1-65535"));
    }
    Ok(scheme)
}

#[derive(Default)]
struct Rules(Vec<Violation>);

impl Rules {
    fn add(&mut self, field: impl Into<String>, rule: impl Into<String>) {
        self.0.push(Violation { field: field.into(), rule: rule.into() });
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
