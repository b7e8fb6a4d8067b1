//! Real etcd clusters on demand: one API, two launchers.
//!
//! [`EtcdCluster::start`] runs 1 or 3 members of etcd 3.5.30, 3.5.16, 3.5.1 or 3.4.23 either as Docker
//! containers (through `testcontainers`, from the images `scripts/setup.sh` builds locally) or as
//! local processes. Each member has its own data directory on the host (bind-mounted into its
//! container), so a member can be stopped, killed, restarted, or restarted with other flags
//! (say a larger quota) and keep its data. Members are removed when the cluster is dropped, also
//! during a panic; processes additionally die with the test process (`PR_SET_PDEATHSIG`), and
//! containers carry the label `etcd-mirror.harness` so `scripts/test.sh` sweeps any that a
//! killed test left behind.

use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{bail, Context as _};
use etcd_client::Client;

use crate::pki::Pki;
use crate::plan::MemberPlan;
pub use crate::plan::{tools_dir, EtcdVersion};
use crate::proxy::FaultProxy;

mod auth;
mod clients;
mod node;
mod snapshot;

use clients::client_settings;
pub(crate) use clients::unique_id;
pub use clients::{agent_client, wait_serving, Proxies};
pub use node::Node;

/// How members are launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Docker containers through testcontainers.
    Container,
    /// Local child processes.
    Process,
}

impl Backend {
    /// `HARNESS_BACKEND=process|container` if set; otherwise containers when a Docker engine
    /// answers and the local images exist, else processes.
    pub fn detect() -> Backend {
        static DETECTED: OnceLock<Backend> = OnceLock::new();
        *DETECTED.get_or_init(|| match std::env::var("HARNESS_BACKEND").as_deref() {
            Ok("process") => Backend::Process,
            Ok("container") => Backend::Container,
            _ if docker_ready() => Backend::Container,
            _ => Backend::Process,
        })
    }
}

/// Whether a Docker engine answers and has the local image of every etcd version.
pub fn docker_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        EtcdVersion::ALL.iter().all(|v| {
            std::process::Command::new("docker")
                .args(["image", "inspect", "-f", "{{.Id}}", &format!("etcd-mirror/etcd:{}", v.image_tag())])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
    })
}

/// What to start.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// etcd version of every member.
    pub version: EtcdVersion,
    /// 1 or 3.
    pub members: usize,
    /// Launcher; [`Backend::detect`] by default.
    pub backend: Backend,
    /// Extra etcd flags for every member, e.g. `--quota-backend-bytes=...`.
    pub extra_args: Vec<String>,
    /// Serve clients over TLS with the server certificate of this PKI and require client
    /// certificates signed by its CA.
    pub tls: Option<Pki>,
}

impl ClusterSpec {
    /// One member of `version` on the detected backend.
    pub fn new(version: EtcdVersion) -> ClusterSpec {
        ClusterSpec { version, members: 1, backend: Backend::detect(), extra_args: Vec::new(), tls: None }
    }

    /// Sets the member count.
    pub fn members(mut self, n: usize) -> Self {
        self.members = n;
        self
    }

    /// Sets the launcher.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Adds an etcd flag to every member.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra_args.push(arg.into());
        self
    }

    /// Serves clients over TLS from `pki` and requires client certificates (`--client-cert-auth`).
    pub fn tls(mut self, pki: &Pki) -> Self {
        self.tls = Some(pki.clone());
        self
    }
}

/// A running etcd cluster. Dropping it removes every member and its data.
pub struct EtcdCluster {
    spec: ClusterSpec,
    nodes: Vec<Node>,
    /// The Docker network of a container cluster.
    network: String,
    /// The root user's credentials once [`EtcdCluster::enable_auth`] ran: every harness client
    /// of the cluster logs in with them.
    root: Option<mirror_core::Auth>,
    // Dropped after the nodes, so containers are gone before their bind-mounted data.
    _data: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts the cluster and waits until every member serves linearizable reads.
    pub async fn start(spec: ClusterSpec) -> anyhow::Result<EtcdCluster> {
        if spec.members != 1 && spec.members != 3 {
            bail!("the harness runs 1 or 3 members, not {}", spec.members);
        }
        if spec.backend == Backend::Process && !spec.version.binary().exists() {
            bail!("{} is missing: run scripts/setup.sh", spec.version.binary().display());
        }
        // A free port can be taken by another test between probing and binding; a start that
        // fails is retried on fresh ports.
        let mut last = None;
        for _ in 0..3 {
            match EtcdCluster::try_start(&spec).await {
                Ok(cluster) => return Ok(cluster),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    async fn try_start(spec: &ClusterSpec) -> anyhow::Result<EtcdCluster> {
        let data = tempfile::Builder::new().prefix("etcd-mirror-harness-").tempdir()?;
        let id = unique_id();
        let ports = crate::ports::free_ports(spec.members * 2)?;
        let names: Vec<String> = (0..spec.members).map(|i| format!("em-{id}-{i}")).collect();
        let initial_cluster = names
            .iter()
            .enumerate()
            .map(|(i, name)| match spec.backend {
                Backend::Process => format!("{name}=http://127.0.0.1:{}", ports[2 * i + 1]),
                Backend::Container => format!("{name}=http://{name}:2380"),
            })
            .collect::<Vec<_>>()
            .join(",");
        let plans: Vec<MemberPlan> = names
            .iter()
            .enumerate()
            .map(|(i, name)| MemberPlan {
                name: name.clone(),
                version: spec.version,
                client_port: ports[2 * i],
                peer_port: ports[2 * i + 1],
                initial_cluster: initial_cluster.clone(),
                cluster_token: format!("tok-{id}"),
                data_dir: data.path().join(name),
                extra_args: spec.extra_args.clone(),
                tls: spec.tls.as_ref().map(|p| p.dir.clone()),
            })
            .collect();
        let network = format!("em-net-{id}");
        // Members of a new cluster wait for each other, so all start together.
        let started =
            futures::future::join_all(plans.iter().map(|plan| Node::launch(plan, spec.backend, &network)))
                .await;
        let nodes = started.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
        let cluster = EtcdCluster { spec: spec.clone(), nodes, network, root: None, _data: data };
        for node in &cluster.nodes {
            if let Err(e) =
                wait_serving(&[node.endpoint()], node.client_tls().as_ref(), Duration::from_secs(30)).await
            {
                let log = node.log();
                let tail: Vec<&str> = log.lines().rev().take(8).collect();
                return Err(e).with_context(|| {
                    format!(
                        "member {} of etcd {} never served; its last log lines, newest first:\n{}",
                        node.name(),
                        spec.version,
                        tail.join("\n")
                    )
                });
            }
        }
        Ok(cluster)
    }

    /// Adds a learner member, as an operator growing a cluster would: `member add --learner`
    /// through the running members, then the new member started against them
    /// (`--initial-cluster-state=existing`). Its endpoint is the last of
    /// [`EtcdCluster::endpoints`]. Returns once it answers a Status request (a learner refuses
    /// linearizable reads, so it never passes [`wait_serving`]).
    pub async fn add_learner(&mut self) -> anyhow::Result<()> {
        let first = self.nodes[0].plan.clone();
        let name = format!("{}-learner{}", first.name, self.nodes.len());
        let ports = crate::ports::free_ports(2)?;
        let peer_url = match self.spec.backend {
            Backend::Process => format!("http://127.0.0.1:{}", ports[1]),
            Backend::Container => format!("http://{name}:2380"),
        };
        let mut client = self.client().await?;
        client
            .member_add([peer_url.clone()], Some(etcd_client::MemberAddOptions::new().with_is_learner()))
            .await
            .context("member add --learner")?;
        let mut extra_args = first.extra_args.clone();
        extra_args.push("--initial-cluster-state=existing".into());
        let plan = MemberPlan {
            name: name.clone(),
            client_port: ports[0],
            peer_port: ports[1],
            initial_cluster: format!("{},{name}={peer_url}", first.initial_cluster),
            data_dir: first.data_dir.with_file_name(&name),
            extra_args,
            ..first
        };
        let node = Node::launch(&plan, self.spec.backend, &self.network).await?;
        let (endpoint, tls) = (node.endpoint(), node.client_tls());
        self.nodes.push(node);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let attempt = async {
                let mut c =
                    agent_client(std::slice::from_ref(&endpoint), tls.as_ref(), Duration::from_secs(2))
                        .await?;
                anyhow::Ok(c.status().await?.is_learner())
            };
            match tokio::time::timeout(Duration::from_secs(3), attempt).await {
                Ok(Ok(true)) => return Ok(()),
                Ok(Ok(false)) => bail!("member {name} answers but is not a learner"),
                _ if tokio::time::Instant::now() > deadline => {
                    bail!("learner {name} never answered Status; its log:\n{}", self.nodes_log())
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// The spec it was started from.
    pub fn spec(&self) -> &ClusterSpec {
        &self.spec
    }

    /// Client endpoints of every member.
    pub fn endpoints(&self) -> Vec<String> {
        self.nodes.iter().map(Node::endpoint).collect()
    }

    /// The Docker network its member containers are on (`None` for processes).
    pub fn docker_network(&self) -> Option<String> {
        (self.spec.backend == Backend::Container).then(|| self.network.clone())
    }

    /// Client endpoints as seen from another container on [`EtcdCluster::docker_network`]
    /// (`scheme://member-name:2379`); `None` for processes.
    pub fn network_endpoints(&self) -> Option<Vec<String>> {
        self.docker_network()?;
        Some(
            self.nodes.iter().map(|n| format!("{}://{}:2379", n.plan.client_scheme(), n.plan.name)).collect(),
        )
    }

    /// Member `i`.
    pub fn node(&mut self, i: usize) -> &mut Node {
        &mut self.nodes[i]
    }

    /// The index of the member that is the raft leader now, asked of each member that answers
    /// (a stopped or paused member is skipped). Fails when no answering member names a leader
    /// among the members within `within`.
    pub async fn leader_index(&self, within: Duration) -> anyhow::Result<usize> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            for (i, _, status) in self.answering().await {
                let me = status.header().map_or(0, |h| h.member_id());
                if status.leader() != 0 && status.leader() == me {
                    return Ok(i);
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("no member reports itself leader within {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Each member that answers a status request within 2 s (a stopped or paused one does
    /// not): its index, a client of it alone, and its status.
    async fn answering(&self) -> Vec<(usize, Client, etcd_client::StatusResponse)> {
        let mut out = Vec::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let ask = async {
                let tls = node.client_tls();
                let (side, sync) = client_settings(
                    &[node.endpoint()],
                    tls.as_ref(),
                    self.root.as_ref(),
                    Duration::from_secs(1),
                );
                let mut c = mirror_core::connect(mirror_core::Side::Source, &side, &sync).await?;
                let status = c.status().await?;
                anyhow::Ok((c, status))
            };
            if let Ok(Ok((c, status))) = tokio::time::timeout(Duration::from_secs(2), ask).await {
                out.push((i, c, status));
            }
        }
        out
    }

    /// All members.
    pub fn nodes(&mut self) -> &mut [Node] {
        &mut self.nodes
    }

    /// Logs of every member, concatenated.
    pub fn nodes_log(&self) -> String {
        self.nodes.iter().map(Node::log).collect::<Vec<_>>().join("\n")
    }

    /// A client to every member, with the agent's keepalive settings (and the PKI's client
    /// certificate on a TLS cluster).
    /// Only members that answer now are used (a stopped member would otherwise get a share of
    /// the requests), as the agent does.
    pub async fn client(&self) -> anyhow::Result<Client> {
        let tls = self.nodes.first().and_then(Node::client_tls);
        let (side, sync) =
            client_settings(&self.endpoints(), tls.as_ref(), self.root.as_ref(), Duration::from_secs(2));
        let probe = mirror_core::probe_members(mirror_core::Side::Source, &side, &sync).await?;
        let reachable = probe.serving_endpoints();
        Ok(mirror_core::connect_to(mirror_core::Side::Source, &side, &sync, &reachable).await?)
    }

    /// Whether the members that answer hold different histories: each one's KV hash at the
    /// lowest revision they all have, among members with the same compaction. `Some(report)`
    /// when they disagree. Healthy members never do; etcd 3.5.0-3.5.2 members killed under load
    /// can (etcd-io/etcd#13766), and then every reader of that member sees stale data, so a
    /// failed check on such a cluster says little about the agent.
    pub async fn members_disagree(&self) -> Option<String> {
        let mut answering: Vec<(usize, Client, i64)> = self
            .answering()
            .await
            .into_iter()
            .map(|(i, c, status)| (i, c, status.header().map_or(0, |h| h.revision())))
            .collect();
        let at = answering.iter().map(|(_, _, r)| *r).min()?;
        let mut hashes = Vec::new();
        for (i, c, revision) in &mut answering {
            if let Ok(Ok(h)) = tokio::time::timeout(Duration::from_secs(5), c.hash_kv(at)).await {
                hashes.push((*i, *revision, h.compact_version(), h.hash()));
            }
        }
        let differ = hashes.iter().any(|(_, _, compact, hash)| {
            hashes.iter().any(|(_, _, other_compact, other)| compact == other_compact && hash != other)
        });
        differ.then(|| {
            let each: Vec<String> = hashes
                .iter()
                .map(|(i, revision, _, hash)| format!("member {i}: revision {revision}, hash {hash:08x}"))
                .collect();
            format!(
                "members disagree on the history up to revision {at} ({}): a member lost applied writes \
                 (etcd 3.5.0-3.5.2 killed under load: etcd-io/etcd#13766)",
                each.join("; ")
            )
        })
    }

    /// A fault proxy in front of every member; the agent dials `proxies.endpoints()`.
    pub async fn proxies(&self) -> anyhow::Result<Proxies> {
        let mut all = Vec::new();
        for node in &self.nodes {
            all.push(FaultProxy::start(node.client_addr()).await?);
        }
        Ok(Proxies(all))
    }
}
