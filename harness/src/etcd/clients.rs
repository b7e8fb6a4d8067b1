//! Clients of a cluster: fault proxies in front of its members, and clients made the way the
//! agent makes them.

use std::time::Duration;

use anyhow::bail;
use etcd_client::Client;

use crate::proxy::FaultProxy;

/// Fault proxies in front of every member of one cluster.
pub struct Proxies(pub(super) Vec<FaultProxy>);

impl Proxies {
    /// Endpoints through the proxies.
    pub fn endpoints(&self) -> Vec<String> {
        self.0.iter().map(FaultProxy::endpoint).collect()
    }

    /// Blackholes the whole side.
    pub fn cut(&self) {
        self.0.iter().for_each(FaultProxy::cut);
    }

    /// Delays every chunk to and from the whole side.
    pub fn delay(&self, delay: std::time::Duration) {
        self.0.iter().for_each(|p| p.delay(delay));
    }

    /// Ends a cut and a delay on every member.
    pub fn heal(&self) {
        self.0.iter().for_each(FaultProxy::heal);
    }
}

/// A client through mirror-core's connect, the path the agent takes (keepalive, require-leader,
/// TLS with `tls`).
pub async fn agent_client(
    endpoints: &[String],
    tls: Option<&mirror_core::Tls>,
    dial_timeout: Duration,
) -> Result<Client, mirror_core::EtcdError> {
    let (side, sync) = client_settings(endpoints, tls, None, dial_timeout);
    mirror_core::connect(mirror_core::Side::Source, &side, &sync).await
}

/// Settings of a harness client: `auth` is the root user's once the cluster's auth is on.
pub(super) fn client_settings(
    endpoints: &[String],
    tls: Option<&mirror_core::Tls>,
    auth: Option<&mirror_core::Auth>,
    dial_timeout: Duration,
) -> (mirror_core::SideConfig, mirror_core::SyncSection) {
    let side = mirror_core::SideConfig {
        endpoints: endpoints.to_vec(),
        prefix: String::new(),
        tls: tls.cloned(),
        auth: auth.cloned(),
    };
    let sync = mirror_core::SyncSection {
        dial_timeout: mirror_core::HumanDuration(dial_timeout),
        request_timeout: mirror_core::HumanDuration(Duration::from_secs(5)),
        ..mirror_core::SyncSection::default()
    };
    (side, sync)
}

/// Polls until a linearizable read succeeds on `endpoints` (over TLS with `tls`).
pub async fn wait_serving(
    endpoints: &[String],
    tls: Option<&mirror_core::Tls>,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    let mut last = String::from("no attempt");
    while tokio::time::Instant::now() < deadline {
        let attempt = async {
            let mut c = agent_client(endpoints, tls, Duration::from_secs(2)).await?;
            match c.get("/__harness_probe", None).await {
                // Auth is on (a member restored from a snapshot of a cluster with auth): the
                // read was refused for want of a user, which etcd checks after the
                // linearizable read's wait for the leader, so the member serves.
                Err(etcd_client::Error::GRpcStatus(s)) if refused_for_auth(&s) => anyhow::Ok(()),
                read => read.map(drop).map_err(Into::into),
            }
        };
        match tokio::time::timeout(Duration::from_secs(3), attempt).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "probe timed out".into(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("etcd at {endpoints:?} not serving after {within:?}: {last}")
}

/// A read refused because the client logged in as nobody, or as a user without the right.
fn refused_for_auth(status: &tonic::Status) -> bool {
    use tonic::Code;
    matches!(status.code(), Code::PermissionDenied | Code::Unauthenticated)
        || (status.code() == Code::InvalidArgument && status.message().contains("user name is empty"))
}

pub(crate) fn unique_id() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("{:x}{:x}{}", std::process::id(), nanos & 0xffff, N.fetch_add(1, Ordering::Relaxed))
}
