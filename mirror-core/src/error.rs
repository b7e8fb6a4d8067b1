//! The five error classes of SPEC §5 and the mapping from etcd's answers to them.
//!
//! The agent decides what to do by [`ErrorClass`], never by string. Strings are read in exactly
//! one place, [`Fault::of_status`], because etcd reports several distinct conditions under one
//! gRPC code (quota and throttling are both `ResourceExhausted`; a compacted and a future
//! revision are both `OutOfRange`). The messages matched are etcd's `rpctypes` constants, which
//! are identical in 3.4 and 3.5; tests in `harness/tests/classify.rs` provoke each one from a
//! real server of both versions.

use std::fmt;

use tonic::Code;

pub use crate::side::Side;

/// What the engine does about an error (SPEC §5 table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// History the agent needs is gone: forced resync with a mandatory prune.
    Resync,
    /// The target is out of space: park, probe, resume by itself.
    Quota,
    /// The target asks us to slow down: own backoff curve.
    Throttle,
    /// Retrying cannot help: stop writing, phase `failed`, keep serving HTTP.
    Permanent,
    /// Retry with exponential backoff and re-watch from the watermark.
    Transient,
}

impl ErrorClass {
    /// Every class, in the order `etcd_mirror_last_error` lists them.
    pub const ALL: [ErrorClass; 5] = [
        ErrorClass::Transient,
        ErrorClass::Throttle,
        ErrorClass::Quota,
        ErrorClass::Resync,
        ErrorClass::Permanent,
    ];
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorClass::Resync => "resync",
            ErrorClass::Quota => "quota",
            ErrorClass::Throttle => "throttle",
            ErrorClass::Permanent => "permanent",
            ErrorClass::Transient => "transient",
        })
    }
}

/// A recognised etcd condition, finer than its class: the batcher needs to know that a Txn was
/// too large (and retry revision by revision), not only that it is permanent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `mvcc: required revision has been compacted` (Get or watch).
    Compacted,
    /// `mvcc: required revision is a future revision`.
    FutureRevision,
    /// `mvcc: database space exceeded`.
    QuotaExceeded,
    /// `too many requests`.
    TooManyRequests,
    /// Another `ResourceExhausted` the server chose to send.
    ResourceExhausted,
    /// The request exceeded `--max-request-bytes` (etcd's own check or gRPC's receive limit).
    RequestTooLarge,
    /// More ops than `--max-txn-ops`.
    TooManyOps,
    /// An answer larger than the client accepts (gRPC's "decoded message length too large");
    /// readers halve their page and ask again.
    ResponseTooLarge,
    /// The same key twice in one Txn.
    DuplicateKey,
    /// Wrong user or password.
    AuthFailed,
    /// A configured TLS file is missing, unreadable or not PEM of the right kind.
    TlsConfig,
    /// A TLS handshake was refused: the server's certificate did not verify against the CA
    /// file (or the server name), or the server refused our client certificate.
    TlsRejected,
    /// The user lacks a permission.
    PermissionDenied,
    /// The auth token expired or is unknown; the client logs in again.
    InvalidToken,
    /// The server has no leader or lost it mid-request.
    NoLeader,
    /// An election (etcd's v3election API) has no leader: nobody campaigns. An answer, not a
    /// failure; only the election reader asks.
    ElectionNoLeader,
    /// The server or network is unreachable, or the connection broke.
    Unavailable,
    /// A deadline passed or the client cancelled.
    Timeout,
    /// `requested lease not found`: a put named a lease the server does not hold (on the
    /// target: one this link granted ran out there, e.g. while the target was cut off for
    /// longer than its TTL). Retried once the lease is granted again.
    LeaseNotFound,
    /// `lease already exists`: a grant named an ID the server holds (the lease grant of
    /// `preserve` then compares its TTL: the same is this link's, another a `LeaseConflict`).
    LeaseExists,
    /// A request the server considers malformed (a bug, or a config the server refuses).
    InvalidRequest,
    /// Anything else.
    Other,
}

impl Fault {
    /// The class that decides the handling.
    pub fn class(self) -> ErrorClass {
        match self {
            Fault::Compacted | Fault::FutureRevision => ErrorClass::Resync,
            Fault::QuotaExceeded => ErrorClass::Quota,
            Fault::TooManyRequests | Fault::ResourceExhausted => ErrorClass::Throttle,
            Fault::RequestTooLarge
            | Fault::TooManyOps
            | Fault::ResponseTooLarge
            | Fault::DuplicateKey
            | Fault::LeaseExists
            | Fault::AuthFailed
            | Fault::PermissionDenied
            | Fault::InvalidRequest => ErrorClass::Permanent,
            // Retried, because a rotation in progress looks the same (files half replaced, the
            // server already on new certificates); the engine refuses them as permanent when
            // they happen before the first successful connect, where they mean a wrong config.
            Fault::TlsConfig | Fault::TlsRejected => ErrorClass::Transient,
            Fault::InvalidToken
            | Fault::LeaseNotFound
            | Fault::NoLeader
            | Fault::ElectionNoLeader
            | Fault::Unavailable
            | Fault::Timeout
            | Fault::Other => ErrorClass::Transient,
        }
    }

    /// Whether a Txn failed because it was too big, so a smaller one may pass.
    pub fn is_txn_too_big(self) -> bool {
        matches!(self, Fault::RequestTooLarge | Fault::TooManyOps)
    }

    /// Classifies any error of the etcd client.
    pub fn of(err: &etcd_client::Error) -> Fault {
        use etcd_client::Error as E;
        match err {
            E::GRpcStatus(status) if source_is_tls(status) => Fault::TlsRejected,
            E::GRpcStatus(status) => Fault::of_status(status.code(), status.message()),
            E::TransportError(e) if crate::tls_alert::is_tls_rejection(e) => Fault::TlsRejected,
            E::TransportError(_) | E::IoError(_) => Fault::Unavailable,
            E::WatchError(msg) => Fault::of_watch_cancel(0, msg),
            // etcd answers a keep-alive of a lease it does not hold with TTL 0, which the client
            // turns into this error.
            E::LeaseKeepAliveError(msg) if msg.contains("lease not found") => Fault::LeaseNotFound,
            E::LeaseKeepAliveError(_) | E::ElectError(_) => Fault::Unavailable,
            E::InvalidArgs(_)
            | E::InvalidUri(_)
            | E::Utf8Error(_)
            | E::InvalidMetadataValue(_)
            | E::EndpointError(_)
            | E::EndpointsNotManaged => Fault::InvalidRequest,
            _ => Fault::Other,
        }
    }

    /// Classifies a gRPC status by code, then by etcd's message where one code covers several
    /// conditions.
    pub fn of_status(code: Code, message: &str) -> Fault {
        let has = |s: &str| message.contains(s);
        // etcd's concurrency.ErrElectionNoLeader, passed through under whatever code the
        // server's gRPC layer gives an error it does not map.
        if has("election: no leader") {
            return Fault::ElectionNoLeader;
        }
        match code {
            Code::OutOfRange if has("compacted") => Fault::Compacted,
            Code::OutOfRange if has("future revision") => Fault::FutureRevision,
            // The client's own decode limit (tonic), not the server.
            Code::OutOfRange if has("message length too large") => Fault::ResponseTooLarge,
            Code::ResourceExhausted if has("database space exceeded") => Fault::QuotaExceeded,
            Code::ResourceExhausted if has("too many requests") => Fault::TooManyRequests,
            // gRPC's own receive limit (etcd sets it to --max-request-bytes plus headroom).
            Code::ResourceExhausted if has("larger than max") => Fault::RequestTooLarge,
            Code::ResourceExhausted => Fault::ResourceExhausted,
            Code::InvalidArgument if has("request is too large") => Fault::RequestTooLarge,
            Code::InvalidArgument if has("too many operations in txn") => Fault::TooManyOps,
            Code::InvalidArgument if has("duplicate key") => Fault::DuplicateKey,
            Code::InvalidArgument if has("authentication failed") => Fault::AuthFailed,
            Code::InvalidArgument => Fault::InvalidRequest,
            Code::PermissionDenied => Fault::PermissionDenied,
            Code::NotFound if has("requested lease not found") => Fault::LeaseNotFound,
            Code::Unauthenticated if has("invalid auth token") => Fault::InvalidToken,
            Code::Unauthenticated => Fault::AuthFailed,
            Code::FailedPrecondition if has("authentication is not enabled") => Fault::AuthFailed,
            Code::FailedPrecondition if has("lease already exists") => Fault::LeaseExists,
            Code::Unavailable if has("no leader") || has("leader changed") => Fault::NoLeader,
            Code::Unavailable | Code::Unknown | Code::Aborted => Fault::Unavailable,
            Code::DeadlineExceeded | Code::Cancelled => Fault::Timeout,
            Code::OutOfRange | Code::FailedPrecondition | Code::Unimplemented => Fault::InvalidRequest,
            _ => Fault::Other,
        }
    }

    /// Classifies the end of a watch: a response with `compact_revision > 0`, or a cancel with
    /// etcd's reason string.
    pub fn of_watch_cancel(compact_revision: i64, reason: &str) -> Fault {
        if compact_revision > 0 || reason.contains("compacted") {
            Fault::Compacted
        } else if reason.contains("future revision") {
            Fault::FutureRevision
        } else if reason.contains("permission denied") {
            Fault::PermissionDenied
        } else if reason.contains("no leader") {
            Fault::NoLeader
        } else {
            Fault::Unavailable
        }
    }
}

/// Whether a gRPC status was made from a TLS failure of the connection under it.
fn source_is_tls(status: &tonic::Status) -> bool {
    std::error::Error::source(status).is_some_and(crate::tls_alert::is_tls_rejection)
}

/// An etcd call that failed, with what the agent was doing and the classified fault.
#[derive(Debug, thiserror::Error)]
#[error("{op} on {side}: {source} ({})", self.fault.class())]
pub struct EtcdError {
    /// What was attempted, e.g. `"get page"`, `"txn apply"`.
    pub op: &'static str,
    /// `source` or `target`.
    pub side: Side,
    /// The classified condition.
    pub fault: Fault,
    /// The client's error.
    pub source: etcd_client::Error,
}

impl EtcdError {
    /// Wraps and classifies a client error.
    pub fn new(op: &'static str, side: Side, source: etcd_client::Error) -> EtcdError {
        EtcdError { op, side, fault: Fault::of(&source), source }
    }

    /// The class of the fault.
    pub fn class(&self) -> ErrorClass {
        self.fault.class()
    }

    /// Whether the member could not be reached or the connection to it broke: `Unavailable`,
    /// and not an etcd server's own answer ("etcdserver: request timed out" is `Unavailable` too,
    /// from a member that is up). A client balanced over the side's members may send its next
    /// requests to that member again; a caller that must not can reconnect to those that serve.
    pub fn is_unreachable(&self) -> bool {
        self.fault == Fault::Unavailable
            && match &self.source {
                etcd_client::Error::GRpcStatus(status) => !status.message().starts_with("etcdserver:"),
                _ => true,
            }
    }

    /// The fault and the server's own words, for a refusal's message: one fault can come from
    /// two places (a request over etcd's `--max-request-bytes` is refused by etcd, "request is
    /// too large"; one also over the gRPC receive limit etcd derives from it, by gRPC, "larger
    /// than max"), and the operator should see which. Server messages of these faults carry
    /// sizes and limits, never keys or values.
    pub fn said(&self) -> String {
        match &self.source {
            etcd_client::Error::GRpcStatus(status) => format!("{:?}: {}", self.fault, status.message()),
            other => format!("{:?}: {other}", self.fault),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Messages copied from etcd's rpctypes map to the class SPEC §5 assigns them.
    #[test]
    fn etcd_messages_map_to_spec_classes() {
        let cases = [
            (Code::OutOfRange, "etcdserver: mvcc: required revision has been compacted", ErrorClass::Resync),
            (
                Code::OutOfRange,
                "etcdserver: mvcc: required revision is a future revision",
                ErrorClass::Resync,
            ),
            (Code::ResourceExhausted, "etcdserver: mvcc: database space exceeded", ErrorClass::Quota),
            (Code::ResourceExhausted, "etcdserver: too many requests", ErrorClass::Throttle),
            (Code::InvalidArgument, "etcdserver: request is too large", ErrorClass::Permanent),
            (Code::InvalidArgument, "etcdserver: too many operations in txn request", ErrorClass::Permanent),
            (Code::PermissionDenied, "etcdserver: permission denied", ErrorClass::Permanent),
            (Code::Unavailable, "etcdserver: no leader", ErrorClass::Transient),
            (Code::NotFound, "etcdserver: requested lease not found", ErrorClass::Transient),
            (Code::Unknown, "transport: broken pipe", ErrorClass::Transient),
            (Code::Cancelled, "Timeout expired", ErrorClass::Transient),
        ];
        for (code, msg, class) in cases {
            assert_eq!(Fault::of_status(code, msg).class(), class, "{code:?} {msg}");
        }
    }

    /// An election nobody leads is its own fault, whatever the code; a cluster without a raft
    /// leader is not that.
    #[test]
    fn an_election_without_leader_is_told_from_a_cluster_without_one() {
        assert_eq!(Fault::of_status(Code::Unknown, "election: no leader"), Fault::ElectionNoLeader);
        assert_eq!(Fault::of_status(Code::Unavailable, "etcdserver: no leader"), Fault::NoLeader);
    }

    /// A lease the server does not hold is its own fault (the engine grants it again), not
    /// another `NotFound`.
    #[test]
    fn a_missing_lease_is_told_from_other_not_found_answers() {
        let missing = Fault::of_status(Code::NotFound, "etcdserver: requested lease not found");
        assert_eq!(missing, Fault::LeaseNotFound);
        assert_eq!(Fault::of_status(Code::NotFound, "etcdserver: member not found"), Fault::Other);
        let kept = Fault::of(&etcd_client::Error::LeaseKeepAliveError("lease not found".into()));
        assert_eq!(kept, Fault::LeaseNotFound, "a keep-alive answered with TTL 0");
        let exists = Fault::of_status(Code::FailedPrecondition, "etcdserver: lease already exists");
        assert_eq!(exists, Fault::LeaseExists);
    }

    /// A member that is down or a broken connection is unreachable; a member that answers with
    /// a timeout, or without a leader, is not.
    #[test]
    fn an_unreachable_member_is_told_from_one_that_answers() {
        let error = |code, message: &str| {
            EtcdError::new(
                "txn",
                Side::Target,
                etcd_client::Error::GRpcStatus(tonic::Status::new(code, message)),
            )
        };
        assert!(error(Code::Unavailable, "tcp connect error").is_unreachable());
        assert!(error(Code::Unknown, "transport: broken pipe").is_unreachable());
        assert!(!error(Code::Unavailable, "etcdserver: request timed out").is_unreachable());
        assert!(!error(Code::Unavailable, "etcdserver: leader changed").is_unreachable());
        assert!(!error(Code::DeadlineExceeded, "Timeout expired").is_unreachable());
    }
}
