//! # mirror-core
//!
//! The vocabulary every other etcd-mirror crate speaks: the config file, which keys are
//! mirrored and where they land, how etcd's errors are classified, and how a side is connected.
//!
//! ## What it guarantees
//! - **Config** ([`Config`]): parsed exactly as SPEC §4; [`Config::validate`] enforces every rule
//!   and names the field of each violation, all at once.
//! - **Keys** ([`KeyRewriter`]): the one anchored rewrite of SPEC §3. It is injective on scope,
//!   never yields a key of the reserved namespace, and never maps an excluded key (the argument
//!   is in the `keys` module; property tests check it).
//! - **Errors** ([`Fault`], [`ErrorClass`]): every etcd client error maps to one of the five
//!   classes of SPEC §5, so callers decide by class, never by string.
//! - **Retries** ([`RetryPolicy`]): one decision from (error class, attempts) to an [`Action`],
//!   with a backoff that resets after success.
//! - **Paging** ([`Pager`]): every reader pages by keys and bytes, starts small, and halves a
//!   page the client refused as too large; only one key over the limit is an error.
//! - **Writes as values** ([`Op`]): one target write, already rewritten; the watch, the scan
//!   and the reconcile all produce them, and only the fenced writer sends them.
//! - **Connect** ([`connect()`]): keepalive and require-leader on every client; per-call deadlines
//!   through [`unary`]; TLS material read from disk at every connect ([`tls`]), so rotated files
//!   are used from the next connect on. A watch response over 1 MiB is cut into pieces flagged
//!   `fragment` before it is decoded ([`watch_split`]), so one huge revision is never decoded
//!   whole.
//!
//! ## What it deliberately does not do
//! It never writes to etcd and holds no state: fencing lives in `mirror-fence`, the engine in
//! the crates above it.

mod auth;
mod backoff;
mod change;
mod condition;
mod config;
mod connect;
#[cfg(test)]
mod docs_tests;
mod error;
pub mod failpoint;
mod keys;
mod op;
mod pager;
mod reason;
mod reload;
mod shell;
mod side;
mod spacing;
mod status;
mod stride;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tls;
mod tls_alert;
mod units;
mod version;
pub mod watch_split;

pub use auth::{read_password, Auth};
pub use backoff::{Action, ExponentialBackoff, RetryPolicy, ThrottleState};
pub use change::{Change, ExactRevision, Malformed};
pub use condition::{Condition, ConditionType, UnknownCondition};
pub use config::{
    Backoff, CheckpointSection, Config, ConfigError, Ha, Http, InitialSync, InitialSyncMode, LeaseMode, Mode,
    Reconcile, Revisions, Side as SideConfig, SyncSection, Tls, TrustProgressNotify, Violation,
};
pub use connect::{
    connect, connect_probed, connect_reachable, connect_to, keep_alive_once, probe_members, read_head, unary,
    Head, MemberInfo, Probe, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, UNKNOWN_VERSION,
};
pub use error::{ErrorClass, EtcdError, Fault, Side};
pub use keys::{
    key_after, normalize_excludes, prefix_end, redact_key, windows_after, DestRange, KeyRange, KeyRewriter,
    RESERVED_MARKER,
};
pub use op::{Op, OpChunker};
pub use pager::{Pager, PagerOptions, RESPONSE_LIMIT, START_LIMIT};
pub use reason::Reason;
pub use reload::{changed_fields, sort_changes, Applies};
pub use shell::{delete_commands, shell_quote};
pub use spacing::Spacer;
pub use status::{
    now_rfc3339, process_memory, AgentRole, CutoverStatus, ExactStatus, ExcludedKeys, ForcedResyncs,
    HaStatus, InitialSyncStatus, LastError, LastReconcile, LeaseStatus, Phase, SideStatus, Status,
    StatusHandle,
};
pub use stride::Stride;
pub use units::{ByteSize, HumanDuration};
pub use version::{parse_version, progress_notify_trustworthy};
