//! Steps that write a side: `load`, `revoke`, `churn`, `put`, `txn`, and `check_perf` (etcd's
//! own load check against the source); `del` is in `delete.rs`.

use anyhow::{bail, Context as _};
use etcd_client::{Client, TxnOp};
use serde::{Deserialize, Serialize};

use mirror_watch::Written;

use super::{is_false, is_source, is_true, source_side, value_100, yes, SideName, Sides, Step};
use crate::scenario::world::World;
use crate::{load_cycling, Churn as ChurnLoad};

/// `keys` keys of `value_size` bytes under `prefix`, 128 per Txn.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Load {
    /// Which side (default source).
    #[serde(default = "source_side", skip_serializing_if = "is_source")]
    pub side: SideName,
    /// How many.
    pub keys: usize,
    /// Bytes per value.
    #[serde(default = "value_100")]
    pub value_size: usize,
    /// Under this sub-prefix.
    #[serde(default)]
    pub prefix: String,
    /// Extension: keys go under the source lease with this ID (granted with a 600 s TTL
    /// unless it exists), every `lease_every`-th key from the first (default every key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<i64>,
    /// Extension: see `lease`; 2 interleaves leased keys with keys that survive a revoke.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_every: Option<usize>,
    /// Extension: the TTL in seconds `lease` is granted with when it does not exist yet
    /// (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ttl: Option<i64>,
    /// Extension: the `keys` puts cycle over this many distinct keys, the later overwriting
    /// (default: every put a key of its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keyspace: Option<usize>,
}

#[async_trait::async_trait]
#[typetag::serde(name = "load")]
impl Step for Load {
    fn check(&self) -> anyhow::Result<()> {
        if self.lease.is_none() && self.lease_ttl.is_some() {
            bail!("load: lease_ttl needs a lease");
        }
        match (self.lease, self.lease_every) {
            (None, Some(_)) => bail!("load: lease_every needs a lease"),
            (_, Some(0)) => bail!("load: lease_every must be > 0"),
            _ if self.keyspace == Some(0) => bail!("load: keyspace must be > 0"),
            _ => Ok(()),
        }
    }

    fn detachable(&self) -> bool {
        true
    }

    async fn run(&self, world: &mut World, seed: u64) -> anyhow::Result<String> {
        write(self, world, seed, None).await
    }

    async fn run_detached(&self, mut sides: Sides, _seed: u64) -> anyhow::Result<String> {
        let (client, prefix) = sides.of(self.side);
        let lease = self.lease.map(|id| (id, self.lease_every.unwrap_or(1)));
        let under = format!("{prefix}{}", self.prefix);
        if let (Some(id), Some(ttl)) = (self.lease, self.lease_ttl) {
            if client.lease_time_to_live(id, None).await?.ttl() < 0 {
                client.lease_grant(ttl, Some(etcd_client::LeaseGrantOptions::new().with_id(id))).await?;
            }
        }
        let keyspace = self.keyspace.unwrap_or(self.keys);
        let rev = load_cycling(client, &under, self.keys, self.value_size, lease, keyspace).await?;
        Ok(format!("to revision {rev}"))
    }
}

/// Extension: revokes a source lease (`lease`, from a `load`): etcd deletes its keys in one
/// revision. `side = "target"` revokes the target's copy instead (a lease lapsing there, as
/// after an outage longer than its TTL).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Revoke {
    /// Which side (default source).
    #[serde(default = "source_side", skip_serializing_if = "is_source")]
    pub side: SideName,
    /// The lease ID.
    pub lease: i64,
    /// Extension, as on `del`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_revisions: Option<i64>,
}

#[async_trait::async_trait]
#[typetag::serde(name = "revoke")]
impl Step for Revoke {
    fn detachable(&self) -> bool {
        self.target_revisions.is_none()
    }

    async fn run(&self, world: &mut World, seed: u64) -> anyhow::Result<String> {
        write(self, world, seed, self.target_revisions).await
    }

    async fn run_detached(&self, mut sides: Sides, _seed: u64) -> anyhow::Result<String> {
        let (client, _) = sides.of(self.side);
        let resp = client.lease_revoke(self.lease).await?;
        Ok(format!("lease {} revoked at {}", self.lease, resp.header().map_or(0, |h| h.revision())))
    }
}

fn rate_500() -> u32 {
    500
}

fn keyspace_1000() -> usize {
    1000
}

/// Open-loop churn: puts, overwrites, deletes, multi-op Txns, range deletes, leased puts.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Churn {
    /// Operations in all.
    pub ops: usize,
    /// Offered per second (SPEC §8 default: 500).
    #[serde(default = "rate_500")]
    pub rate: u32,
    /// Distinct keys (SPEC §8 default: 1000).
    #[serde(default = "keyspace_1000")]
    pub keyspace: usize,
    /// Bytes per value.
    #[serde(default = "value_100")]
    pub value_size: usize,
    /// Under this sub-prefix.
    #[serde(default)]
    pub prefix: String,
    /// Extension: 5 % of the puts go under a fresh 5 s source lease (default true). A cutover
    /// scenario sets it false: a lease that expires on the source after the cutover deletes
    /// keys nothing copies any more, so the sides would differ by design.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub leases: bool,
}

#[async_trait::async_trait]
#[typetag::serde(name = "churn")]
impl Step for Churn {
    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.rate > 0, "churn: rate must be > 0");
        Ok(())
    }

    fn detachable(&self) -> bool {
        true
    }

    async fn run(&self, world: &mut World, seed: u64) -> anyhow::Result<String> {
        write(self, world, seed, None).await
    }

    async fn run_detached(&self, sides: Sides, seed: u64) -> anyhow::Result<String> {
        let mut load = ChurnLoad::new(
            &format!("{}{}", sides.source_prefix, self.prefix),
            self.ops,
            self.rate,
            self.keyspace,
        )
        .value_size(self.value_size)
        .seed(seed)
        .tolerant();
        if self.leases {
            load = load.with_leases();
        }
        let report = load.spawn(sides.source.clone()).await??;
        Ok(format!("{} ops acknowledged, {} failed", report.ops, report.failed))
    }
}

/// One put.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Put {
    /// Which side (default source).
    #[serde(default = "source_side", skip_serializing_if = "is_source")]
    pub side: SideName,
    /// The key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The checkpoint key instead of `key`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub checkpoint: bool,
    /// The value (default: `value_size` bytes of `v`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Bytes of the default value.
    #[serde(default = "value_100")]
    pub value_size: usize,
    /// Extension: `key` is the whole key, not under the side's prefix (another application's
    /// write to the same cluster).
    #[serde(default, skip_serializing_if = "is_false")]
    pub outside_prefix: bool,
    /// Extension: under this existing lease of the side.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<i64>,
}

#[async_trait::async_trait]
#[typetag::serde(name = "put")]
impl Step for Put {
    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.key.is_some() != self.checkpoint,
            "put: give exactly one of key and checkpoint = true"
        );
        anyhow::ensure!(!self.outside_prefix || self.key.is_some(), "put: outside_prefix needs a key");
        Ok(())
    }

    fn detachable(&self) -> bool {
        true
    }

    async fn run(&self, world: &mut World, seed: u64) -> anyhow::Result<String> {
        write(self, world, seed, None).await
    }

    async fn run_detached(&self, mut sides: Sides, _seed: u64) -> anyhow::Result<String> {
        let key = match &self.key {
            Some(k) if self.outside_prefix => k.clone().into_bytes(),
            _ => key_of(&self.key, &sides, self.side),
        };
        let value = self.value.clone().unwrap_or_else(|| "v".repeat(self.value_size));
        let (client, _) = sides.of(self.side);
        let opts = self.lease.map(|id| etcd_client::PutOptions::new().with_lease(id));
        let rev = client.put(key.clone(), value.clone(), opts).await?.header().map_or(0, |h| h.revision());
        if self.side == SideName::Source {
            let lease = self.lease.unwrap_or(0);
            sides.journal.record([Written::Put { key, value: value.into_bytes(), revision: rev, lease }]);
        }
        Ok(format!("at {rev}"))
    }
}

/// Extension: `etcdctl check perf` against the source, with the source version's etcdctl:
/// etcd's own load check, as a user would run it (`load = "l"`: 500 clients writing for 60 s,
/// then one revision deleting everything it wrote). Its pass/fail verdict is about the source
/// on this machine, not the agent: the step reports it and never fails on it.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CheckPerf {
    /// Workload model: s, m, l or xl (default s).
    #[serde(default = "load_s")]
    pub load: String,
    /// Its keys' sub-prefix under `source.prefix`.
    pub prefix: String,
}

fn load_s() -> String {
    "s".into()
}

#[async_trait::async_trait]
#[typetag::serde(name = "check_perf")]
impl Step for CheckPerf {
    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            ["s", "m", "l", "xl"].contains(&self.load.as_str()),
            "load: {:?} (s, m, l or xl)",
            self.load
        );
        Ok(())
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let source = &world.source;
        let prefix = format!("{}{}", world.scenario.source_prefix(), self.prefix);
        let out = tokio::process::Command::new(source.spec().version.etcdctl())
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", source.endpoints().join(",")))
            .args(["check", "perf", &format!("--load={}", self.load), &format!("--prefix={prefix}")])
            .kill_on_drop(true)
            .output()
            .await
            .context("running etcdctl check perf")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let verdict: Vec<&str> =
            text.lines().filter(|l| l.starts_with("PASS") || l.starts_with("FAIL")).collect();
        anyhow::ensure!(
            !verdict.is_empty(),
            "etcdctl check perf gave no verdict ({}): {}{}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(verdict.join("; "))
    }
}

/// `ops` puts in one source Txn.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Txn {
    /// Puts in the Txn.
    pub ops: usize,
    /// Bytes per value.
    #[serde(default = "value_100")]
    pub value_size: usize,
    /// Under this sub-prefix.
    #[serde(default)]
    pub prefix: String,
}

#[async_trait::async_trait]
#[typetag::serde(name = "txn")]
impl Step for Txn {
    fn detachable(&self) -> bool {
        true
    }

    async fn run(&self, world: &mut World, seed: u64) -> anyhow::Result<String> {
        write(self, world, seed, None).await
    }

    async fn run_detached(&self, mut sides: Sides, seed: u64) -> anyhow::Result<String> {
        let under = format!("{}{}", sides.source_prefix, self.prefix);
        let keys: Vec<String> = (0..self.ops).map(|i| format!("{under}txn-{seed}-{i:05}")).collect();
        let value = "v".repeat(self.value_size);
        let puts: Vec<TxnOp> = keys.iter().map(|k| TxnOp::put(k.as_str(), value.as_str(), None)).collect();
        let source: &mut Client = &mut sides.source;
        let rev =
            source.txn(etcd_client::Txn::new().and_then(puts)).await?.header().map_or(0, |h| h.revision());
        sides.journal.record(keys.into_iter().map(|k| Written::Put {
            key: k.into_bytes(),
            value: value.clone().into_bytes(),
            revision: rev,
            lease: 0,
        }));
        Ok(format!("{} puts at {rev}", self.ops))
    }
}

/// Runs a write step in the foreground: with `target_revisions`, checks that agent `a`
/// applies it as exactly that many target revisions.
pub(super) async fn write(
    step: &dyn Step,
    world: &mut World<'_>,
    seed: u64,
    target_revisions: Option<i64>,
) -> anyhow::Result<String> {
    let sides = world.sides().await?;
    match target_revisions {
        Some(want) => world.applied_as(want, step.run_detached(sides, seed)).await,
        None => step.run_detached(sides, seed).await,
    }
}

/// `key` under the side's prefix, or the checkpoint key when none is given.
pub(super) fn key_of(key: &Option<String>, sides: &Sides, side: SideName) -> Vec<u8> {
    let prefix = match side {
        SideName::Source => &sides.source_prefix,
        SideName::Target => &sides.target_prefix,
    };
    match key {
        Some(k) => format!("{prefix}{k}").into_bytes(),
        None => sides.checkpoint.clone(),
    }
}
