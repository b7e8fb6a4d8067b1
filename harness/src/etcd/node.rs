//! One member of a cluster, as a process or a container, and its controls.

use std::net::SocketAddr;
use std::time::Duration;

use super::wait_serving;
use crate::container::ContainerNode;
use crate::pki;
use crate::plan::MemberPlan;
use crate::process::ProcessNode;

pub(super) enum NodeInner {
    Process(ProcessNode),
    Container(Box<ContainerNode>),
}

/// One member and its controls.
pub struct Node {
    pub(super) plan: MemberPlan,
    pub(super) inner: NodeInner,
}

impl Node {
    /// Starts the member of `plan` as a process or as a container on `network`.
    pub(super) async fn launch(
        plan: &MemberPlan,
        backend: super::Backend,
        network: &str,
    ) -> anyhow::Result<Node> {
        let inner = match backend {
            super::Backend::Process => NodeInner::Process(ProcessNode::spawn(plan).await?),
            super::Backend::Container => {
                NodeInner::Container(Box::new(ContainerNode::create(plan, network).await?))
            }
        };
        Ok(Node { plan: plan.clone(), inner })
    }

    /// The member's name.
    pub fn name(&self) -> &str {
        &self.plan.name
    }

    /// The address clients on this host dial.
    pub fn client_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.plan.client_port))
    }

    /// `http://127.0.0.1:PORT`, or `https://` for a TLS cluster.
    pub fn endpoint(&self) -> String {
        format!("{}://{}", self.plan.client_scheme(), self.client_addr())
    }

    /// The `[tls]` block a client of this member needs (the PKI's CA and client certificate).
    pub fn client_tls(&self) -> Option<mirror_core::Tls> {
        self.plan.tls.as_deref().map(pki::client_tls_in)
    }

    /// Everything the member logged so far (stdout and stderr).
    pub fn log(&self) -> String {
        match &self.inner {
            NodeInner::Process(_) => {
                std::fs::read_to_string(self.plan.data_dir.with_extension("log")).unwrap_or_default()
            }
            NodeInner::Container(c) => c.logs(),
        }
    }

    /// Graceful stop (SIGTERM); data is kept.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        match &mut self.inner {
            NodeInner::Process(p) => p.stop().await,
            NodeInner::Container(c) => c.stop().await,
        }
    }

    /// SIGKILL; data is kept.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        match &mut self.inner {
            NodeInner::Process(p) => p.kill().await,
            NodeInner::Container(c) => c.kill().await,
        }
    }

    /// Starts a stopped or killed member on its data and waits until it serves.
    /// Its client port stays the one in its plan; if a short-lived outgoing connection holds
    /// that port just now, the start is retried for a few seconds.
    pub async fn start(&mut self) -> anyhow::Result<()> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let started = match &mut self.inner {
                NodeInner::Process(p) => p.start(&self.plan).await,
                NodeInner::Container(c) => c.start(&self.plan).await,
            };
            match started {
                Ok(()) => break,
                Err(e) if attempt < 10 && format!("{e:#}").contains("address already in use") => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        }
        wait_serving(&[self.endpoint()], self.client_tls().as_ref(), Duration::from_secs(30)).await
    }

    /// Stops the member and starts it again with `extra_args` replacing the cluster's extra
    /// flags (for example a larger `--quota-backend-bytes`).
    pub async fn restart_with(&mut self, extra_args: Vec<String>) -> anyhow::Result<()> {
        self.stop().await?;
        self.plan.extra_args = extra_args;
        self.start().await
    }

    /// Freezes the member (SIGSTOP / docker pause): it holds connections but answers nothing.
    pub async fn pause(&mut self) -> anyhow::Result<()> {
        match &mut self.inner {
            NodeInner::Process(p) => p.freeze().await,
            NodeInner::Container(c) => c.pause().await,
        }
    }

    /// Thaws a paused member.
    pub async fn unpause(&mut self) -> anyhow::Result<()> {
        match &mut self.inner {
            NodeInner::Process(p) => p.signal(libc::SIGCONT),
            NodeInner::Container(c) => c.unpause().await,
        }
    }
}
