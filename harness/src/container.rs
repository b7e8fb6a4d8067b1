//! The container launcher: etcd in Docker through testcontainers, from the local images that
//! `scripts/setup.sh` builds (no registry is reachable).

use std::time::Duration;

use anyhow::Context as _;
use testcontainers::core::{ContainerPort, Mount};
use testcontainers::runners::AsyncRunner;
use testcontainers::{ContainerAsync, GenericImage, ImageExt};

use crate::plan::MemberPlan;

/// Label on every harness container, for sweeping leftovers of killed test runs.
pub const LABEL: &str = "etcd-mirror.harness";

/// Tries of a pause that runc could not freeze.
const PAUSE_TRIES: u32 = 5;

/// Where a member container sees its PKI directory.
const TLS_DIR: &str = "/tls";

/// One member container; recreated on `start` so changed flags take effect, always on the same
/// bind-mounted data dir and the same host port.
pub(crate) struct ContainerNode {
    network: String,
    container: Option<ContainerAsync<GenericImage>>,
}

impl ContainerNode {
    pub(crate) async fn create(plan: &MemberPlan, network: &str) -> anyhow::Result<ContainerNode> {
        let mut node = ContainerNode { network: network.to_owned(), container: None };
        node.start(plan).await?;
        Ok(node)
    }

    pub(crate) async fn start(&mut self, plan: &MemberPlan) -> anyhow::Result<()> {
        if let Some(old) = self.container.take() {
            old.rm().await.ok();
        }
        std::fs::create_dir_all(&plan.data_dir)?;
        let name = &plan.name;
        let mut args = vec![
            format!("--name={name}"),
            "--data-dir=/data".to_owned(),
            format!("--listen-client-urls={}://0.0.0.0:2379", plan.client_scheme()),
            format!("--advertise-client-urls={}://{name}:2379", plan.client_scheme()),
            "--listen-peer-urls=http://0.0.0.0:2380".to_owned(),
            format!("--initial-advertise-peer-urls=http://{name}:2380"),
            format!("--initial-cluster={}", plan.initial_cluster),
            format!("--initial-cluster-token={}", plan.cluster_token),
            "--initial-cluster-state=new".to_owned(),
        ];
        args.extend(plan.tls_args(std::path::Path::new(TLS_DIR)));
        args.extend(plan.extra_args.iter().cloned());
        let mut image = GenericImage::new("etcd-mirror/etcd", plan.version.image_tag())
            .with_container_name(name)
            .with_network(&self.network)
            .with_label(LABEL, "1")
            .with_mount(Mount::bind_mount(plan.data_dir.display().to_string(), "/data"))
            .with_mapped_port(plan.client_port, ContainerPort::Tcp(2379));
        if let Some(dir) = &plan.tls {
            image = image.with_mount(Mount::bind_mount(dir.display().to_string(), TLS_DIR));
        }
        let container =
            image.with_cmd(args).with_startup_timeout(Duration::from_secs(60)).start().await.with_context(
                || format!("starting container {name} from etcd-mirror/etcd:{}", plan.version),
            )?;
        self.container = Some(container);
        Ok(())
    }

    fn get(&self) -> anyhow::Result<&ContainerAsync<GenericImage>> {
        self.container.as_ref().context("member container is not running")
    }

    pub(crate) async fn stop(&mut self) -> anyhow::Result<()> {
        // Thaw first: a paused container cannot be stopped gracefully.
        let c = self.get()?;
        c.unpause().await.ok();
        c.stop_with_timeout(Some(10)).await?;
        Ok(())
    }

    pub(crate) async fn kill(&mut self) -> anyhow::Result<()> {
        let c = self.get()?;
        c.unpause().await.ok();
        c.stop_with_timeout(Some(0)).await?;
        Ok(())
    }

    pub(crate) fn logs(&self) -> String {
        self.container.as_ref().map(|c| docker_logs(c.id())).unwrap_or_default()
    }

    /// Freezes the container. runc gives up ("unable to freeze") when a task of it will not
    /// stop in time, e.g. in an uninterruptible write on a loaded disk, and leaves it thawed:
    /// that is tried again a few times (a CI run's chaos schedule failed on it once).
    pub(crate) async fn pause(&mut self) -> anyhow::Result<()> {
        let mut tries = 1;
        loop {
            match self.get()?.pause().await {
                Ok(()) => return Ok(()),
                Err(e) if tries < PAUSE_TRIES && e.to_string().contains("unable to freeze") => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e).with_context(|| format!("after {tries} tries")),
            }
        }
    }

    pub(crate) async fn unpause(&mut self) -> anyhow::Result<()> {
        Ok(self.get()?.unpause().await?)
    }
}

impl Drop for ContainerNode {
    fn drop(&mut self) {
        if let Some(c) = &self.container {
            // A paused container cannot be removed by testcontainers' drop; thaw it on the way out.
            let id = c.id().to_owned();
            let _ = std::process::Command::new("docker")
                .args(["unpause", &id])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// What container `id` wrote to stdout and stderr so far (empty if `docker logs` fails: this
/// only ever feeds failure reports).
pub(crate) fn docker_logs(id: &str) -> String {
    std::process::Command::new("docker")
        .args(["logs", id])
        .output()
        .map(|o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
        .unwrap_or_default()
}
