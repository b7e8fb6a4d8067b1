//! Connecting to one side of the link, and what a connection tells about the cluster.
//!
//! Every client has gRPC keepalive on (a paused or partitioned server is detected in seconds,
//! not when the kernel gives up on TCP) and carries etcd's require-leader metadata, so a member
//! cut off from its quorum answers "no leader" instead of serving a watch that never moves.
//! Deadlines are per unary call ([`unary`]); the channel has none, because a channel-wide
//! deadline would also end long-lived watch streams.
//!
//! ## Keepalive against etcd's ping enforcement
//! etcd (every version in the matrix: 3.4.23, 3.5.1, 3.5.16, 3.5.30) runs gRPC's keepalive
//! enforcement with `MinTime = --grpc-keepalive-min-time` (default 5 s) and
//! `PermitWithoutStream = false`. A ping is a strike when it comes sooner than `MinTime` after
//! the last one on a connection the server has sent nothing on since, or at all while the
//! connection has no open stream; the third strike is answered with GOAWAY
//! (`ENHANCE_YOUR_CALM`, "too_many_pings"), which the client sees as `h2 protocol error ...
//! stream closed`. A ping every 2 s on an idle watch therefore tore the watch down every
//! ~9 s (seen on 3.5.30 and 3.5.1 alike; Go clients survive it only because grpc-go doubles its
//! interval after such a GOAWAY, which hyper does not). So:
//! - pings are sent only while a stream (the watch) is open, never on an idle connection;
//! - the interval, [`KEEPALIVE_INTERVAL`] = 7 s, stays above the 5 s default with room for
//!   timer slack, and a paused server is declared dead [`KEEPALIVE_TIMEOUT`] = 5 s after an
//!   unanswered ping: within 12 s of its last answer;
//! - a connection with no open stream is guarded by the per-call deadline of [`unary`] instead.
//!
//! ## Least privilege: what a read-only user may ask
//! The agent needs read on the source range and read-write on the destination range, nothing
//! more (SPEC §5). etcd 3.5.30 (since the backport of etcd commit a07ecd12 "guard
//! unauthenticated endpoints with auth checks") answers Maintenance Status only to a user with
//! the root role; 3.5.16, 3.5.1 and 3.4.23 answer any authenticated user. When Status is
//! refused, [`probe_members`] learns the same facts another way, per endpoint:
//! - cluster id, and that the member knows a leader: a count-only Get of the side's own prefix
//!   (the user may read it; require-leader makes a member without a leader refuse it), whose
//!   header names the cluster and the member;
//! - the version: the client URL's `/version` (plain HTTP only; over https it is recorded as
//!   unknown, [`UNKNOWN_VERSION`]), so progress notifications stay trusted on a current server;
//!   an unknown version is never refused and never trusted;
//! - the learner flag: MemberList (open to non-admin users again on 3.5.30), by the member id
//!   of the Get's header; false when that is refused too.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tonic::transport::Endpoint;

use crate::auth::read_password;
use crate::config::{Side as SideConfig, SyncSection};
use crate::error::{EtcdError, Fault, Side};
use crate::tls::TlsMaterial;

/// HTTP/2 ping interval while a stream is open: above etcd's enforced 5 s minimum (see the module
/// doc), so an idle watch is never torn down by the server.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(7);
/// How long an unanswered ping may take before the connection is declared dead: a paused server
/// is noticed within [`KEEPALIVE_INTERVAL`] + this, 12 s.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The version recorded for a member whose version could not be learned (see the module doc).
pub const UNKNOWN_VERSION: &str = "unknown";

/// What one member reported in Maintenance Status.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MemberInfo {
    /// The endpoint asked.
    pub endpoint: String,
    /// Server version, e.g. `3.5.1`.
    pub version: String,
    /// Cluster id from the response header.
    pub cluster_id: u64,
    /// Whether the member is a learner (it cannot serve linearizable reads).
    pub learner: bool,
}

/// Connects to a side with keepalive and require-leader set, over TLS when the side has a `tls`
/// block (material read from disk now, see [`crate::tls`]), authenticating as the configured
/// user (the client refreshes an expired token by itself). The connection is lazy: a server
/// that is down or refuses the handshake shows at the first call; [`probe_members`] dials
/// eagerly to tell those apart.
pub async fn connect(side: Side, cfg: &SideConfig, sync: &SyncSection) -> Result<Client, EtcdError> {
    connect_to(side, cfg, sync, &cfg.endpoints).await
}

/// Probes every member and connects to those that answer: what a one-shot command (verify,
/// cutover) needs while a member is down.
pub async fn connect_reachable(
    side: Side,
    cfg: &SideConfig,
    sync: &SyncSection,
) -> Result<Client, EtcdError> {
    Ok(connect_probed(side, cfg, sync).await?.1)
}

/// [`connect_reachable`], with the probe it connected by (which members did not answer).
pub async fn connect_probed(
    side: Side,
    cfg: &SideConfig,
    sync: &SyncSection,
) -> Result<(Probe, Client), EtcdError> {
    let probe = probe_members(side, cfg, sync).await?;
    let client = connect_to(side, cfg, sync, &probe.serving_endpoints()).await?;
    Ok((probe, client))
}

/// [`connect()`] to `endpoints` only (those a [`probe_members`] found answering): requests are
/// never balanced onto a member known to be down.
pub async fn connect_to(
    side: Side,
    cfg: &SideConfig,
    sync: &SyncSection,
    endpoints: &[String],
) -> Result<Client, EtcdError> {
    let tls = load_tls(side, cfg)?;
    let endpoints = endpoints
        .iter()
        .map(|url| endpoint(side, url, tls.as_ref(), sync.dial_timeout.get()))
        .collect::<Result<Vec<_>, _>>()?;
    let channel = tonic::transport::Channel::balance_list(endpoints.into_iter());
    client(side, cfg, channel).await
}

/// Wraps a channel into a client with require-leader and the side's credentials.
async fn client(
    side: Side,
    cfg: &SideConfig,
    channel: tonic::transport::Channel,
) -> Result<Client, EtcdError> {
    let mut opts = ConnectOptions::new().with_require_leader(true);
    if let Some(auth) = &cfg.auth {
        let password = read_password(auth).map_err(|msg| {
            EtcdError::new("connect", side, etcd_client::Error::InvalidArgs(format!("{side}.auth: {msg}")))
        })?;
        opts = opts.with_user(auth.username.clone(), password).with_auto_token_refresh(true);
    }
    let channel = tower::util::BoxCloneSyncService::new(crate::watch_split::SplitWatch(channel));
    Client::from_channel(etcd_client::Channel::Custom(channel), Some(opts))
        .await
        .map_err(|e| EtcdError::new("connect", side, e))
}

/// Reads the side's TLS files; an unusable file is a `TlsConfig` fault naming its field.
fn load_tls(side: Side, cfg: &SideConfig) -> Result<Option<TlsMaterial>, EtcdError> {
    let Some(tls) = &cfg.tls else { return Ok(None) };
    crate::tls::load(side, tls).map(Some).map_err(|e| EtcdError {
        op: "connect",
        side,
        fault: Fault::TlsConfig,
        source: etcd_client::Error::InvalidArgs(e.to_string()),
    })
}

/// One member's endpoint with the agent's keepalive and dial timeout, TLS for `https://`. The
/// config check already refused mixed schemes and https without a tls block.
fn endpoint(
    side: Side,
    url: &str,
    tls: Option<&TlsMaterial>,
    dial_timeout: Duration,
) -> Result<Endpoint, EtcdError> {
    let invalid = |msg: String| EtcdError::new("connect", side, etcd_client::Error::InvalidArgs(msg));
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .map_err(|e| invalid(format!("{side} endpoint {url}: {e}")))?
        .keep_alive_while_idle(false)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .connect_timeout(dial_timeout);
    if let Some(tls) = tls {
        endpoint = match &tls.verifier {
            Some(verifier) => endpoint.tls_config_with_verifier(tls.options.clone(), verifier.clone()),
            None => endpoint.tls_config(tls.options.clone()),
        }
        .map_err(|e| invalid(format!("{side} endpoint {url}: TLS settings refused: {e}")))?;
    }
    Ok(endpoint)
}

/// What probing every endpoint of a side found.
#[derive(Clone, Debug)]
pub struct Probe {
    /// The members that answered.
    pub members: Vec<MemberInfo>,
    /// Endpoints that did not answer, each with why.
    pub unreachable: Vec<(String, String)>,
}

impl Probe {
    /// The endpoints to connect to, in configured order: those that answered, learners left
    /// out (a learner refuses linearizable reads, watches and writes, so a balancer that sent
    /// it one would fail that request).
    pub fn serving_endpoints(&self) -> Vec<String> {
        self.members.iter().filter(|m| !m.learner).map(|m| m.endpoint.clone()).collect()
    }
}

/// Asks every endpoint of a side for its Maintenance Status, all at once and each over its own
/// connection, so a learner or a member of another cluster hiding behind the balancer is seen.
/// The side is usable while any voting endpoint answers and its cluster has a leader: one
/// member down (or being restarted) is listed in [`Probe::unreachable`], not an error. With no
/// endpoint answering, the first endpoint's error is returned (a TLS or auth refusal there is
/// what the operator must fix); with no leader, or only learners answering, a transient
/// `NoLeader`.
pub async fn probe_members(side: Side, cfg: &SideConfig, sync: &SyncSection) -> Result<Probe, EtcdError> {
    let tls = load_tls(side, cfg)?;
    let asks = cfg.endpoints.iter().map(|url| probe_one(side, cfg, sync, url, tls.as_ref()));
    let answers = futures::future::join_all(asks).await;
    let mut probe = Probe { members: Vec::new(), unreachable: Vec::new() };
    let mut first_error = None;
    let mut has_leader = false;
    for (url, answer) in cfg.endpoints.iter().zip(answers) {
        match answer {
            Ok((member, leader)) => {
                has_leader |= leader;
                probe.members.push(member);
            }
            Err(e) => {
                probe.unreachable.push((url.clone(), e.to_string()));
                first_error.get_or_insert(e);
            }
        }
    }
    if probe.members.is_empty() {
        return Err(first_error.expect("at least one endpoint is configured"));
    }
    let answering = probe.members.len();
    let no_writer = |why: String| EtcdError {
        op: "status",
        side,
        fault: Fault::NoLeader,
        source: etcd_client::Error::IoError(std::io::Error::other(format!("{side}: {why}"))),
    };
    if probe.members.iter().all(|m| m.learner) {
        return Err(no_writer(format!(
            "only learners answer ({answering}); a learner serves no reads or writes"
        )));
    }
    if !has_leader {
        return Err(no_writer(format!("{answering} endpoint(s) answer but none knows a leader")));
    }
    Ok(probe)
}

/// One endpoint's Maintenance Status: the member, and whether it knows a leader.
async fn probe_one(
    side: Side,
    cfg: &SideConfig,
    sync: &SyncSection,
    url: &str,
    tls: Option<&TlsMaterial>,
) -> Result<(MemberInfo, bool), EtcdError> {
    let channel = endpoint(side, url, tls, sync.dial_timeout.get())?
        .connect()
        .await
        .map_err(|e| dial_error(side, url, e))?;
    let mut client = client(side, cfg, channel).await?;
    let timeout = sync.request_timeout.get();
    let status = match unary("status", side, timeout, client.status()).await {
        Ok(status) => status,
        Err(e) if e.fault == Fault::PermissionDenied => {
            return probe_without_status(side, cfg, url, &mut client, timeout).await;
        }
        Err(e) => return Err(late_tls_rejection(side, url, e)),
    };
    let member = MemberInfo {
        endpoint: url.to_owned(),
        version: status.version().to_owned(),
        cluster_id: status.header().map_or(0, |h| h.cluster_id()),
        learner: status.is_learner(),
    };
    Ok((member, status.leader() != 0))
}

/// One endpoint's facts for a user Maintenance Status refuses (module doc, "Least privilege").
async fn probe_without_status(
    side: Side,
    cfg: &SideConfig,
    url: &str,
    client: &mut Client,
    timeout: Duration,
) -> Result<(MemberInfo, bool), EtcdError> {
    // The whole keyspace for the prefix "" (exact mode): etcd refuses an empty key.
    let range = crate::keys::KeyRange::prefix(cfg.prefix.as_bytes());
    let opts = etcd_client::GetOptions::new().with_range(range.end).with_count_only().with_limit(1);
    // Answered at all (linearizable, with require-leader): the member knows a leader.
    let read = client.get(range.start, Some(opts));
    let resp = unary("status (read of the prefix)", side, timeout, read).await?;
    let (cluster_id, member_id) = resp.header().map_or((0, 0), |h| (h.cluster_id(), h.member_id()));
    let learner = match unary("member list", side, timeout, client.member_list()).await {
        Ok(list) => list.members().iter().any(|m| m.id() == member_id && m.is_learner()),
        Err(_) => false,
    };
    let version =
        version_over_http(side, cfg, url, timeout).await.unwrap_or_else(|| UNKNOWN_VERSION.to_owned());
    tracing::debug!(%side, url, version, "Maintenance Status refused to this user; probed by a read");
    Ok((MemberInfo { endpoint: url.to_owned(), version, cluster_id, learner }, true))
}

/// The server version from the client URL's `/version`; over https with the side's TLS
/// material (CA, client certificate, server name), so a TLS cluster's version is known and its
/// progress notifications trusted by the same rule as elsewhere. `None` when it cannot be read.
async fn version_over_http(side: Side, cfg: &SideConfig, url: &str, timeout: Duration) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Version {
        etcdserver: String,
    }
    let mut builder = reqwest::Client::builder().timeout(timeout);
    if url.starts_with("https://") {
        let tls = cfg.tls.clone().unwrap_or_default();
        match crate::tls::https_config(side, &tls) {
            Ok(config) => builder = builder.use_preconfigured_tls(config),
            Err(e) => {
                tracing::debug!(%side, url, "no TLS settings for /version: {e}");
                return None;
            }
        }
    } else if !url.starts_with("http://") {
        return None;
    }
    let client = builder.build().ok()?;
    let resp = match client.get(format!("{}/version", url.trim_end_matches('/'))).send().await {
        Ok(resp) => resp,
        Err(e) => {
            tracing::debug!(%side, url, "/version: {e}");
            return None;
        }
    };
    let v: Version = resp.error_for_status().ok()?.json().await.ok()?;
    crate::parse_version(&v.etcdserver).map(|_| v.etcdserver)
}

/// A TLS refusal that arrived with the first request instead of the dial (see
/// [`crate::tls_alert::late_alert`]), with what to check spelled out as for a refused dial; any other
/// error as it is.
fn late_tls_rejection(side: Side, url: &str, e: EtcdError) -> EtcdError {
    let alert = match &e.source {
        etcd_client::Error::GRpcStatus(status) => {
            std::error::Error::source(status).and_then(crate::tls_alert::late_alert)
        }
        etcd_client::Error::TransportError(t) => crate::tls_alert::late_alert(t),
        _ => None,
    };
    let Some(alert) = alert else { return e };
    let message = format!(
        "{side} endpoint {url}: TLS refused by the server after the handshake: {alert} ({})",
        crate::tls_alert::client_cert_hint(side)
    );
    EtcdError {
        op: e.op,
        side,
        fault: Fault::TlsRejected,
        source: etcd_client::Error::IoError(std::io::Error::other(message)),
    }
}

/// A failed dial, with the TLS reason and what to check spelled out when the handshake was
/// refused (the transport error's own text is only "transport error").
fn dial_error(side: Side, url: &str, e: tonic::transport::Error) -> EtcdError {
    let (fault, message) = match crate::tls_alert::rejection(&e) {
        Some(tls) => (
            Fault::TlsRejected,
            format!(
                "{side} endpoint {url}: TLS handshake refused: {tls} ({})",
                crate::tls_alert::hint(side, tls)
            ),
        ),
        None => {
            let mut chain = Vec::<String>::new();
            let mut next: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(err) = next {
                let text = err.to_string();
                if !chain.last().is_some_and(|prev| prev.contains(&text)) {
                    chain.push(text);
                }
                next = err.source();
            }
            (Fault::Unavailable, format!("{side} endpoint {url}: cannot connect: {}", chain.join(": ")))
        }
    };
    EtcdError {
        op: "connect",
        side,
        fault,
        source: etcd_client::Error::IoError(std::io::Error::other(message)),
    }
}

/// Runs one unary call under a deadline; an expired deadline is a transient timeout.
pub async fn unary<T>(
    op: &'static str,
    side: Side,
    deadline: Duration,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, EtcdError> {
    match tokio::time::timeout(deadline, call).await {
        Ok(result) => result.map_err(|e| EtcdError::new(op, side, e)),
        Err(_) => Err(EtcdError::new(
            op,
            side,
            etcd_client::Error::GRpcStatus(tonic::Status::deadline_exceeded(format!(
                "no answer within {deadline:?}"
            ))),
        )),
    }
}

/// Where a cluster stands, from the header of an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    /// The cluster's current revision.
    pub revision: i64,
    /// Its cluster ID.
    pub cluster_id: u64,
}

/// The cluster's current revision and ID, from the header of a count-only Get of `key` under
/// `deadline` (`op` names it in an error). One key, never a range: a count of a whole range
/// makes etcd walk every key of it in its index, under the lock every write needs.
pub async fn read_head(
    kv: &mut etcd_client::KvClient,
    key: impl Into<Vec<u8>>,
    op: &'static str,
    side: Side,
    deadline: Duration,
) -> Result<Head, EtcdError> {
    let opts = etcd_client::GetOptions::new().with_count_only();
    let resp = unary(op, side, deadline, kv.get(key, Some(opts))).await?;
    let header = resp.header();
    Ok(Head {
        revision: header.map_or(0, |h| h.revision()),
        cluster_id: header.map_or(0, |h| h.cluster_id()),
    })
}

/// One keep-alive of target lease `id` under a deadline: a stream opened for one request and
/// its answer (etcd-client's supported API; it fails with "lease not found" on a TTL of 0).
/// False when the target no longer knows the lease.
pub async fn keep_alive_once(target: &Client, id: i64, deadline: Duration) -> Result<bool, EtcdError> {
    let mut client = target.lease_client();
    let keep_alive = async {
        if unanswered_keep_alive() {
            std::future::pending::<()>().await;
        }
        client.keep_alive(id).await
    };
    match unary("lease keep-alive", Side::Target, deadline, keep_alive).await {
        Ok(_) => Ok(true),
        Err(e) if e.fault == Fault::LeaseNotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Failpoint `UNANSWERED_KEEP_ALIVES=N` (or `A..B`): the first N keep-alives of the process
/// (those numbered A to B - 1) get no answer and run into their deadline, as over a connection
/// a network cut left stale.
fn unanswered_keep_alive() -> bool {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    crate::failpoint::armed_for_call("UNANSWERED_KEEP_ALIVES", &CALLS)
}
