//! Small steps every scenario test repeats: wait for the agent, count keys, check G3.

use std::time::Duration;

use etcd_client::{Client, GetOptions};
use mirror_core::{Phase, Status};

use crate::{check_g3, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion, G3};

/// How long a scenario waits for the agent to reach a state.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(120);

/// A `[sync]` section with a short progress interval and backoff, so tests converge quickly.
/// Progress notifications keep the version gate: 3.5.1 and 3.4.23 predate etcd's fix, and a
/// test here saw a forced-trust 3.5.1 move the watermark past undelivered events.
pub const FAST_SYNC_TOML: &str =
    "[sync]\nprogress_interval = \"1s\"\nbackoff = { initial = \"200ms\", max = \"2s\" }";

/// A config between two clusters with [`FAST_SYNC_TOML`].
pub fn fast_config(source: &EtcdCluster, target: &EtcdCluster, link: &str, prefix: &str) -> AgentConfig {
    AgentConfig::new(link, source.endpoints(), target.endpoints(), prefix).with(FAST_SYNC_TOML)
}

/// A single-member source and target of the default etcd version (3.5.30) on the detected
/// launcher.
pub async fn pair() -> anyhow::Result<(EtcdCluster, EtcdCluster)> {
    pair_of(EtcdVersion::default(), 1).await
}

/// A source and a target of `version`, each of `members` members (1 or 3).
pub async fn pair_of(version: EtcdVersion, members: usize) -> anyhow::Result<(EtcdCluster, EtcdCluster)> {
    // Both at once: most of a start is Docker's (network, container, port), not etcd's.
    let (source, target) = tokio::join!(
        EtcdCluster::start(ClusterSpec::new(version).members(members)),
        EtcdCluster::start(ClusterSpec::new(version).members(members))
    );
    Ok((source?, target?))
}

/// Waits for phase `syncing` with the initial sync complete.
pub async fn synced(agent: &AgentProcess) -> anyhow::Result<Status> {
    agent
        .wait_for("InitialSyncComplete", SYNC_TIMEOUT, |s| {
            s.phase == Phase::Syncing && s.condition(mirror_core::ConditionType::InitialSyncComplete)
        })
        .await
}

/// The source's current revision.
pub async fn current_revision(client: &mut Client) -> anyhow::Result<i64> {
    let resp = client.get("/", Some(GetOptions::new().with_count_only())).await?;
    Ok(resp.header().map_or(0, |h| h.revision()))
}

/// Waits until the agent's watermark reaches the source's current revision.
pub async fn caught_up(agent: &AgentProcess, source: &mut Client) -> anyhow::Result<Status> {
    let rev = current_revision(source).await?;
    agent.wait_for(&format!("watermark >= {rev}"), SYNC_TIMEOUT, |s| s.watermark >= rev).await
}

/// Target revisions in `(before, after]` that changed a key under `dest_prefix` other than
/// `checkpoint`: what a source write was applied as. A checkpoint-only commit (a refreshed
/// `confirmed_time`, an advance over an idle range) applies nothing and is not counted.
///
/// Read with ranges at each revision, not a watch from `before`: etcd cuts one revision of
/// 300 000 deletes into watch fragments in minutes (4 on 3.5.1 here), ranges answer at once.
/// A revision put a data key when a key other than `checkpoint` has that `mod_revision`; it
/// deleted one when fewer keys are left than were there before plus those it created.
pub async fn data_revisions(
    dst: &mut Client,
    dest_prefix: &str,
    checkpoint: &[u8],
    before: i64,
    after: i64,
) -> anyhow::Result<i64> {
    // The write itself changed at least one key, so a single revision is it.
    if after - before <= 1 {
        return Ok((after - before).max(0));
    }
    let count_at = |dst: &mut Client, rev: i64| {
        let mut dst = dst.clone();
        async move {
            let opts = GetOptions::new().with_prefix().with_count_only().with_revision(rev);
            anyhow::Ok(dst.get(dest_prefix, Some(opts)).await?.count())
        }
    };
    let mut moved = 0;
    let mut was = count_at(dst, before).await?;
    for rev in before + 1..=after {
        let now = count_at(dst, rev).await?;
        let opts = GetOptions::new()
            .with_prefix()
            .with_keys_only()
            .with_revision(rev)
            .with_min_mod_revision(rev)
            .with_max_mod_revision(rev);
        let written = dst.get(dest_prefix, Some(opts)).await?;
        let created = written.kvs().iter().filter(|kv| kv.create_revision() == rev).count() as i64;
        let put_data = written.kvs().iter().any(|kv| kv.key() != checkpoint);
        if put_data || was + created > now {
            moved += 1;
        }
        was = now;
    }
    Ok(moved)
}

/// Keys under `prefix`.
pub async fn count_prefix(client: &mut Client, prefix: &str) -> anyhow::Result<i64> {
    Ok(client.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await?.count())
}

/// Checks G3 for the link `config` describes.
pub async fn g3_of(source: &EtcdCluster, target: &EtcdCluster, config: &AgentConfig) -> anyhow::Result<G3> {
    let parsed = config.parsed()?;
    let (mut s, mut t) = (source.client().await?, target.client().await?);
    check_g3(&mut s, &mut t, &parsed.rewriter(), &parsed.checkpoint_key()).await
}

mod checker;
mod file;
mod plan;
mod run;
mod sides;
pub mod step;
mod world;

pub use file::{AgentKind, Scenario, SideSpec, StepAt};
pub use run::{run, run_file, RunOptions};
pub use step::{parse_condition, parse_until, MemberRef, RevisionRef, SideName, Signal, Step, Until};
pub use world::World;
