//! Exact mode's checks (SPEC §10): the seed of a target from a source's snapshot, the state of
//! a whole keyspace with every key's revisions, and a real client's view of the history
//! (`etcdctl watch --rev R --prev-kv -w json`), reserved keys left out on both sides.

use std::time::Duration;

use anyhow::Context as _;
use etcd_client::{Client, GetOptions};
use mirror_core::RESERVED_MARKER;

use crate::{AgentConfig, EtcdCluster, EtcdVersion};

/// An exact link from `source` to `target`: the whole keyspace, leases preserved, fast retries.
pub fn exact_config(source: &EtcdCluster, target: &EtcdCluster, link: &str) -> AgentConfig {
    AgentConfig::new(link, source.endpoints(), target.endpoints(), "").with(
        "[sync]\nrevisions = \"exact\"\nleases = \"preserve\"\nprogress_interval = \"1s\"\n\
         backoff = { initial = \"200ms\", max = \"2s\" }",
    )
}

/// Saves a snapshot of `source` as `name` and restores every member of `target` from it; the
/// target's revision afterwards (R0).
pub async fn seed(source: &EtcdCluster, target: &mut EtcdCluster, name: &str) -> anyhow::Result<i64> {
    source.save_snapshot(name).await?;
    target.restore_snapshot_file(&source.snapshot_file(name)?).await?;
    let mut client = target.client().await?;
    Ok(client
        .get(vec![0], Some(GetOptions::new().with_count_only()))
        .await?
        .header()
        .map_or(0, |h| h.revision()))
}

/// One key as exact mode must keep it.
#[derive(Clone, PartialEq, Eq)]
pub struct KeyState {
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// create_revision, mod_revision, version.
    pub revisions: (i64, i64, i64),
    /// The lease ID (0: none).
    pub lease: i64,
}

/// Values shown in a difference, at most (a 256 KiB value would bury the message).
const SHOWN_VALUE: usize = 48;

impl std::fmt::Debug for KeyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = String::from_utf8_lossy(&self.value[..self.value.len().min(SHOWN_VALUE)]);
        let more = if self.value.len() > SHOWN_VALUE { "..." } else { "" };
        f.debug_struct("KeyState")
            .field("key", &String::from_utf8_lossy(&self.key))
            .field("value", &format_args!("{value:?}{more} ({} bytes)", self.value.len()))
            .field("revisions", &self.revisions)
            .field("lease", &self.lease)
            .finish()
    }
}

/// Every key of a cluster outside the reserved namespace, read at one revision, and that
/// revision.
pub async fn keyspace(client: &mut Client) -> anyhow::Result<(i64, Vec<KeyState>)> {
    let resp = client.get(vec![0], Some(GetOptions::new().with_range(vec![0]))).await?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let keys = resp
        .kvs()
        .iter()
        .filter(|kv| !kv.key().starts_with(RESERVED_MARKER.as_bytes()))
        .map(|kv| KeyState {
            key: kv.key().to_vec(),
            value: kv.value().to_vec(),
            revisions: (kv.create_revision(), kv.mod_revision(), kv.version()),
            lease: kv.lease(),
        })
        .collect();
    Ok((revision, keys))
}

/// The first difference between two keyspaces, in words (`None`: the same, revisions too).
pub fn keyspace_difference(source: &(i64, Vec<KeyState>), target: &(i64, Vec<KeyState>)) -> Option<String> {
    if source.0 != target.0 {
        return Some(format!("source revision {} but target revision {}", source.0, target.0));
    }
    if source.1.len() != target.1.len() {
        return Some(format!("source holds {} keys, target {}", source.1.len(), target.1.len()));
    }
    source.1.iter().zip(&target.1).find(|(a, b)| a != b).map(|(a, b)| format!("source {a:?}\ntarget {b:?}"))
}

/// Whether a read at `revision` is refused as compacted.
pub async fn refuses_read_at(client: &mut Client, revision: i64) -> bool {
    let read = client.get(vec![0], Some(GetOptions::new().with_count_only().with_revision(revision))).await;
    matches!(read, Err(e) if e.to_string().contains("compacted"))
}

/// What `etcdctl watch --prefix '' --rev FROM --prev-kv -w json` (3.5.30's etcdctl) prints for
/// the revisions FROM..=TO, one line per event (type, key, value, create/mod revision, version,
/// lease, and the prev_kv's value, mod revision and version), reserved keys left out. The
/// watch runs until it has delivered TO, or `within`.
pub async fn etcdctl_watch(
    endpoint: &str,
    from: i64,
    to: i64,
    within: Duration,
) -> anyhow::Result<Vec<String>> {
    use tokio::io::AsyncBufReadExt as _;
    let mut child = tokio::process::Command::new(EtcdVersion::V3_5_30.etcdctl())
        .args([
            "--endpoints",
            endpoint,
            "watch",
            "--prefix",
            "",
            "--rev",
            &from.to_string(),
            "--prev-kv",
            "-w",
            "json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("etcdctl watch")?;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().context("stdout")?).lines();
    let mut events = Vec::new();
    let reserved = base64(RESERVED_MARKER.as_bytes());
    let read = async {
        while let Some(line) = lines.next_line().await? {
            let Ok(resp) = serde_json::from_str::<serde_json::Value>(&line) else { continue };
            for e in resp["Events"].as_array().into_iter().flatten() {
                let (kv, prev) = (&e["kv"], &e["prev_kv"]);
                let rev = kv["mod_revision"].as_i64().unwrap_or(0);
                if rev > to {
                    return anyhow::Ok(());
                }
                if kv["key"].as_str().unwrap_or("").starts_with(&reserved[..16]) {
                    continue;
                }
                events.push(format!(
                    "type={} key={} value={} create={} mod={} version={} lease={} prev=({}, {}, {})",
                    e["type"],
                    kv["key"],
                    kv["value"],
                    kv["create_revision"],
                    rev,
                    kv["version"],
                    kv["lease"],
                    prev["value"],
                    prev["mod_revision"],
                    prev["version"]
                ));
            }
            if resp["Events"].as_array().and_then(|a| a.last()).and_then(|e| e["kv"]["mod_revision"].as_i64())
                == Some(to)
            {
                return Ok(());
            }
        }
        Ok(())
    };
    tokio::time::timeout(within, read)
        .await
        .context("etcdctl watch did not reach the revision in time")??;
    Ok(events)
}

/// `--admin-user U --admin-password-file F` of `admin`, or nothing.
pub fn admin_args(admin: Option<&mirror_core::Auth>) -> Vec<std::ffi::OsString> {
    let Some(admin) = admin else { return Vec::new() };
    let file = admin.password_file.clone().unwrap_or_default();
    vec!["--admin-user".into(), admin.username.clone().into(), "--admin-password-file".into(), file.into()]
}

fn base64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Runs `mirror-agent snapshot save FILE` for `config` (written to FILE.toml) to its end, as an
/// operator whose command is refused: its exit code and what it printed to stderr.
pub async fn snapshot_save_once(
    config: &AgentConfig,
    file: &std::path::Path,
) -> anyhow::Result<(Option<i32>, String)> {
    let cfg_path = std::path::PathBuf::from(format!("{}.toml", file.display()));
    std::fs::write(&cfg_path, config.render())?;
    let out = tokio::process::Command::new(crate::agent_binary())
        .args(["snapshot", "save"])
        .arg(file)
        .arg("--config")
        .arg(&cfg_path)
        .output()
        .await
        .context("mirror-agent snapshot save")?;
    Ok((out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

/// A running `mirror-agent snapshot save FILE`: it saved the snapshot, printed R0, and spools
/// until the link runs.
pub struct SnapshotSave {
    child: tokio::process::Child,
    _dir: tempfile::TempDir,
    /// The snapshot file.
    pub file: std::path::PathBuf,
    /// The snapshot's revision as the command printed it.
    pub r0: i64,
    /// Everything it printed up to R0's line and the digest's.
    pub printed: String,
}

impl SnapshotSave {
    /// Starts `snapshot save` for `config` into a new directory and waits until it printed R0.
    pub async fn start(config: &AgentConfig) -> anyhow::Result<SnapshotSave> {
        SnapshotSave::start_as(config, None).await
    }

    /// [`SnapshotSave::start`] with `--admin-user` and `--admin-password-file` of `admin`.
    pub async fn start_as(
        config: &AgentConfig,
        admin: Option<&mirror_core::Auth>,
    ) -> anyhow::Result<SnapshotSave> {
        use tokio::io::AsyncBufReadExt as _;
        let dir = tempfile::Builder::new().prefix("mirror-seed-").tempdir()?;
        let file = dir.path().join("seed.db");
        let cfg_path = dir.path().join("mirror.toml");
        std::fs::write(&cfg_path, config.render())?;
        let mut child = tokio::process::Command::new(crate::agent_binary())
            .arg("snapshot")
            .arg("save")
            .arg(&file)
            .arg("--config")
            .arg(&cfg_path)
            .args(admin_args(admin))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("mirror-agent snapshot save")?;
        let mut lines = tokio::io::BufReader::new(child.stdout.take().context("stdout")?).lines();
        let mut printed = String::new();
        let mut r0 = None;
        let read = async {
            while let Some(line) = lines.next_line().await? {
                printed.push_str(&line);
                printed.push('\n');
                if let Some(rest) = line.split("R0 = ").nth(1) {
                    r0 = rest.trim_end_matches('.').parse().ok();
                }
                if line.starts_with("Digest") || line.starts_with("The source compacted past R0") {
                    break;
                }
            }
            anyhow::Ok(())
        };
        tokio::time::timeout(Duration::from_secs(60), read)
            .await
            .context("snapshot save printed no R0")??;
        let r0 = r0.with_context(|| format!("no R0 in:\n{printed}"))?;
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(SnapshotSave { child, _dir: dir, file, r0, printed })
    }

    /// Ctrl-C (SIGINT) at the command, as an operator would stop it before the link runs; its
    /// exit code.
    pub async fn interrupt(&mut self, within: Duration) -> anyhow::Result<Option<i32>> {
        let pid = self.child.id().context("snapshot save already ended")?;
        crate::process::send(pid, libc::SIGINT);
        self.wait(within).await
    }

    /// Waits for the command to end by itself (once the link runs); its exit code.
    pub async fn wait(&mut self, within: Duration) -> anyhow::Result<Option<i32>> {
        let status =
            tokio::time::timeout(within, self.child.wait()).await.context("snapshot save did not end")??;
        Ok(status.code())
    }
}

#[cfg(test)]
mod tests {
    use super::{keyspace_difference, KeyState};

    /// A difference in a large value names the key and the sizes, not the whole value.
    #[test]
    fn a_difference_in_a_large_value_stays_readable() {
        let state = |fill: u8| KeyState {
            key: b"/registry/configmaps/big".to_vec(),
            value: vec![fill; 256 << 10],
            revisions: (2, 9, 4),
            lease: 0,
        };
        let said = keyspace_difference(&(9, vec![state(b'a')]), &(9, vec![state(b'b')])).expect("differs");
        assert!(said.len() < 600, "{} bytes: {said}", said.len());
        assert!(said.contains("/registry/configmaps/big") && said.contains("262144 bytes"), "{said}");
        assert_eq!(keyspace_difference(&(9, vec![state(b'a')]), &(9, vec![state(b'a')])), None);
    }
}
