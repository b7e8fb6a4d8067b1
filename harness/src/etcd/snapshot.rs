//! Snapshots of a cluster: saved through the Maintenance API, restored member by member as an
//! operator recovering a cluster would (`etcdutl`, `etcdctl` on 3.4).

use anyhow::Context as _;

use super::{EtcdCluster, EtcdVersion, Node};

impl EtcdCluster {
    /// Saves a snapshot of the whole store (etcd's Maintenance Snapshot, from a member that
    /// answers) as `name` in the cluster's data dir, for [`EtcdCluster::restore_snapshot`].
    pub async fn save_snapshot(&self, name: &str) -> anyhow::Result<u64> {
        use tokio::io::AsyncWriteExt as _;
        let mut client = self.client().await?;
        let mut stream = client.snapshot().await?;
        let mut file = tokio::fs::File::create(self.snapshot_path(name)?).await?;
        let mut bytes = 0u64;
        while let Some(part) = stream.message().await? {
            file.write_all(part.blob()).await?;
            bytes += part.blob().len() as u64;
        }
        file.sync_all().await?;
        Ok(bytes)
    }

    /// Restores every member from snapshot `name` as an operator recovering a cluster would:
    /// stops them all, replaces each data dir with `etcdutl snapshot restore` (`etcdctl` on 3.4,
    /// which only the process backend can restore: it resolves the peer URLs' hosts)
    /// under the member's own name, cluster token and peer URLs, and starts them again. The
    /// cluster keeps its cluster id and endpoints, and goes back to the snapshot's revision.
    pub async fn restore_snapshot(&mut self, name: &str) -> anyhow::Result<()> {
        let snapshot = self.snapshot_path(name)?;
        anyhow::ensure!(snapshot.exists(), "no snapshot {name:?} was saved on this cluster");
        self.restore_snapshot_file(&snapshot).await
    }

    /// The file [`EtcdCluster::save_snapshot`] wrote as `name`.
    pub fn snapshot_file(&self, name: &str) -> anyhow::Result<std::path::PathBuf> {
        self.snapshot_path(name)
    }

    /// [`EtcdCluster::restore_snapshot`] from any snapshot file, another cluster's included: an
    /// exact replica's seed. The members keep their own cluster token, so a restore of another
    /// cluster's snapshot gets a cluster ID of its own.
    pub async fn restore_snapshot_file(&mut self, snapshot: &std::path::Path) -> anyhow::Result<()> {
        for node in &mut self.nodes {
            node.stop().await?;
        }
        for node in &self.nodes {
            let plan = &node.plan;
            let peer = plan
                .initial_cluster
                .split(',')
                .find_map(|m| m.strip_prefix(&format!("{}=", plan.name)))
                .context("member missing from its own initial cluster")?;
            if plan.data_dir.exists() {
                std::fs::remove_dir_all(&plan.data_dir)?;
            }
            // 3.5.30's etcdutl for every 3.5 member (the snapshot format is one across 3.5):
            // older ones resolve each peer URL's host, and a stopped member container's name
            // resolves nowhere. 3.4 has no etcdutl: its etcdctl restores.
            let etcdutl = EtcdVersion::V3_5_30.etcdctl().with_file_name("etcdutl");
            let mut cmd = if plan.version != EtcdVersion::V3_4_23 {
                std::process::Command::new(etcdutl)
            } else {
                let mut c = std::process::Command::new(plan.version.etcdctl());
                c.env("ETCDCTL_API", "3");
                c
            };
            let out = cmd
                .arg("snapshot")
                .arg("restore")
                .arg(snapshot)
                .arg(format!("--name={}", plan.name))
                .arg(format!("--data-dir={}", plan.data_dir.display()))
                .arg(format!("--initial-cluster={}", plan.initial_cluster))
                .arg(format!("--initial-cluster-token={}", plan.cluster_token))
                .arg(format!("--initial-advertise-peer-urls={peer}"))
                .output()?;
            anyhow::ensure!(
                out.status.success(),
                "snapshot restore of member {} failed: {}",
                plan.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // Members of a restored cluster wait for each other, as in a new one.
        let started = futures::future::join_all(self.nodes.iter_mut().map(Node::start)).await;
        started.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
        Ok(())
    }

    fn snapshot_path(&self, name: &str) -> anyhow::Result<std::path::PathBuf> {
        anyhow::ensure!(
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
            "snapshot name {name:?}: use letters, digits, '-' and '_'"
        );
        Ok(self._data.path().join(format!("{name}.snapshot.db")))
    }
}
