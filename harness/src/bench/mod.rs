//! `harness bench`: performance figures measured side by side in one run, on one etcd version (3.5.30
//! unless `--version` names another).
//!
//! Every figure is printed next to baselines from the same run (the machine is shared and
//! noisy, so absolute numbers mean little across runs). The flat ceiling, the copier and the
//! agent's initial sync are measured in `--rounds` rounds (3 by default), back to back; each
//! round is printed and each of the three figures is the median of its rounds:
//! - the target's raw write ceiling: 4 concurrent writers of flat 128-op Txns, and the same with
//!   nested Txns (N inner Txns of 128 - N puts in one Txn), to show where nesting stops paying;
//! - a naive copier: one reader of exact 1 000-key windows (no Get walks the rest of the
//!   range) and 4 unfenced writers of 128-op Txns, no checkpoint;
//! - the agent's initial sync, from its start to its own `InitialSyncComplete` (its `/statusz`
//!   read every 10 ms: [`until_synced`]), then checked equal once;
//! - `etcdctl make-mirror`'s initial sync (that version's etcdctl), on a pair of its own;
//! - tail lag p50/p99 for the agent and for make-mirror at each offered rate, open loop (every
//!   put is sent at its due time, on its own task, so a slow system cannot lower the rate),
//!   beside a watch on the source (its own delivery) and the agent's Txns over the same window
//!   (from sent to landed, and revisions per Txn: [`Commits`]);
//! - a reconcile pass (diff of both whole ranges, nothing to repair) in keys/s;
//! - the loaded case ([`loaded_sync`]): the same initial sync onto a fresh target while the
//!   source takes `--load-rate` writes/s, the tail lag over the minute after it, G3, and a
//!   reconcile pass under the same writes;
//! - the agent's peak RSS in each case (initial sync, each tail rate, reconcile pass; its
//!   VmHWM, reset between cases).
//!
//! `--plot FILE.svg` draws the lag distributions and the throughput bars ([`crate::plot`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use etcd_client::{Client, GetOptions};
use tokio::time::Instant;

mod baselines;
mod exact;
mod lag;
mod loaded;
mod probe;

pub use crate::figures::{quantile, Figures, LoadedFigures, TailFigures};
use crate::{
    load_keys, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion, Observed, Scraped, G3,
};
use baselines::{inner_ops, key, naive_copy, write_ceiling};
use lag::*;
use loaded::*;

/// Puts per flat Txn: etcd's default `--max-txn-ops` and the agent's default Txn size.
const FLAT_OPS: usize = 128;
/// Keys per read window of the naive copier.
const COPIER_WINDOW: usize = 1_000;
/// Concurrent writers of the ceiling and the copier.
const WRITERS: usize = 4;

/// Sizes of one bench run.
#[derive(Clone, Debug)]
pub struct BenchPlan {
    /// Keys for the ceilings, the copier and the agent's initial sync.
    pub keys: usize,
    /// Value size in bytes.
    pub value_size: usize,
    /// Keys for make-mirror's initial sync (it is slow: one serial Put per key).
    pub make_mirror_keys: usize,
    /// Tail write rates (writes/s, open loop), each measured for `tail_seconds`.
    pub tail_rates: Vec<u32>,
    /// How long each tail rate runs.
    pub tail_seconds: u64,
    /// Inner-Txn counts whose nested write ceiling is measured (empty: none).
    pub nested: Vec<usize>,
    /// Where to draw the figures as SVG.
    pub plot: Option<PathBuf>,
    /// TOML merged over the agent's config (to measure other settings).
    pub agent_toml: String,
    /// Stop after the agent's initial sync (ceiling, copier, agent only).
    pub sync_only: bool,
    /// Rounds of the flat ceiling, the copier and the agent's sync, back to back; each figure
    /// is the median of its rounds.
    pub rounds: usize,
    /// etcd version of every cluster of the run.
    pub version: EtcdVersion,
    /// Leases of the leased-keys case (0: skipped): `keys` keys spread over this many source
    /// leases, synced once with `sync.leases = "strip"` and once with `"preserve"`.
    pub leases: usize,
    /// Writes/s of the loaded case (0: skipped): see [`loaded_sync`].
    pub load_rate: u32,
    /// Source revisions/s of the exact tail (empty: the exact section is skipped).
    pub exact_rates: Vec<u32>,
    /// Only the exact section.
    pub exact_only: bool,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs the bench, prints its figures as they come, and draws them when asked.
pub async fn run(plan: BenchPlan) -> anyhow::Result<Figures> {
    let version = plan.version;
    if plan.exact_only {
        exact::run(&plan).await?;
        return Ok(Figures::default());
    }
    println!("etcd-mirror bench: etcd {version}, {} keys of {} B", plan.keys, plan.value_size);
    let mut f = Figures { keys: plan.keys, value_size: plan.value_size, ..Figures::default() };

    let source = EtcdCluster::start(ClusterSpec::new(version)).await?;
    let mut src = source.client().await?;
    load_keys(&mut src, "/bench/", plan.keys, plan.value_size).await?;

    // The flat ceiling, the copier and the agent's sync move 20-40 % between runs on a shared
    // machine, so they are measured in rounds, back to back, and each figure is the median of
    // its rounds. The last round's agent and target stay for the cases after it.
    let rounds = plan.rounds.max(1);
    let mut samples = Vec::with_capacity(rounds);
    let mut live: Option<LiveSync> = None;
    let mut sync_rss = None;
    for round in 1..=rounds {
        drop(live.take());
        let ceiling = on_fresh_target(version, |c| write_ceiling(c, plan.keys, plan.value_size, 1)).await?;
        let copier = on_fresh_target(version, |dst| naive_copy(src.clone(), dst, plan.keys)).await?;
        let sync = agent_sync(&plan, &source).await?;
        println!(
            "round {round}/{rounds}: flat ceiling {ceiling:>7.0}, copier {copier:>7.0} = {:.2} x, agent sync {:>7.0} = {:.2} x ceiling = {:.2} x copier",
            copier / ceiling,
            sync.rate,
            sync.rate / ceiling,
            sync.rate / copier
        );
        sync_rss = sync_rss.max(sync.agent.take_peak_rss_bytes());
        samples.push((ceiling, copier, sync.rate));
        live = Some(sync);
    }
    let LiveSync { mut agent, target, dst, cfg, .. } = live.context("no round ran")?;
    f.ceiling = median(samples.iter().map(|s| s.0));
    f.copier = median(samples.iter().map(|s| s.1));
    f.agent_sync = median(samples.iter().map(|s| s.2));
    println!("median of {rounds} round(s):");
    println!(
        "target write ceiling, {WRITERS} writers x flat {FLAT_OPS}-op Txn: {:>10.0} keys/s = 1.00 (baseline)",
        f.ceiling
    );
    println!(
        "naive copier (1 reader, {WRITERS} writers, no checkpoint):   {:>10.0} keys/s = {:.2} x",
        f.copier,
        f.copier / f.ceiling
    );
    println!(
        "agent initial sync (start to InitialSyncComplete):  {:>10.0} keys/s = {:.2} x ceiling = {:.2} x copier (target equal)",
        f.agent_sync,
        f.agent_sync / f.ceiling,
        f.agent_sync / f.copier
    );
    record_rss(sync_rss, "initial sync", &mut f);
    for &n in plan.nested.iter().filter(|_| !plan.sync_only) {
        let rate = on_fresh_target(version, |c| write_ceiling(c, plan.keys, plan.value_size, n)).await?;
        println!(
            "  nested, {n:>2} x {} puts per Txn:                 {rate:>10.0} keys/s = {:.2} x",
            inner_ops(n),
            rate / f.ceiling
        );
        f.nested.push((n, rate));
    }

    if plan.leases > 0 {
        leased_sync(&plan).await?;
    }
    if plan.sync_only {
        return Ok(f);
    }

    let make_mirror = match MakeMirror::start(version, &plan).await {
        Ok(Some(mm)) => {
            println!(
                "etcdctl make-mirror initial sync ({} keys):       {:>10.0} keys/s = {:.3} x; agent {:.0} x faster",
                plan.make_mirror_keys,
                mm.sync_rate,
                mm.sync_rate / f.ceiling,
                f.agent_sync / mm.sync_rate
            );
            f.make_mirror_sync = Some(mm.sync_rate);
            Some(mm)
        }
        Ok(None) => {
            println!("etcdctl make-mirror: skipped (no etcdctl, or --make-mirror-keys 0)");
            None
        }
        Err(e) => {
            println!("etcdctl make-mirror: failed: {e:#}");
            None
        }
    };

    for (round, &rate) in plan.tail_rates.iter().enumerate() {
        let prefix = format!("/bench/lag{round}/");
        let agent_lags = agent_tail_lag(&agent, &src, &dst, &prefix, rate, plan.tail_seconds).await?;
        let mm_lags = match &make_mirror {
            Some(mm) => {
                let prefix = format!("/mm/lag{round}/");
                Some(tail_lag(&mm.src, &mm.dst, &prefix, rate, plan.tail_seconds).await?)
            }
            None => None,
        };
        let mm_text =
            mm_lags.as_ref().map_or_else(String::new, |l| format!("   make-mirror {}", l.summary()));
        println!("tail lag at {rate:>5} writes/s, open loop: agent {}{mm_text}", agent_lags.summary());
        agent_lags.print_commits();
        peak_rss(&agent, &format!("tail at {rate} writes/s"), &mut f);
        let overloaded = agent_lags.overloaded();
        if let Some(why) = &overloaded {
            println!("  the source did not keep up with {rate} writes/s: {why}");
        }
        f.tails.push(TailFigures { rate, agent: agent_lags.lags, make_mirror: mm_lags.map(|l| l.lags) });
        if overloaded.is_some() {
            if let Some(accepted) =
                highest_kept_up(&agent, &src, &dst, round, rate, plan.tail_seconds).await?
            {
                peak_rss(&agent, &format!("tail at {} writes/s", accepted.rate), &mut f);
                f.tails.push(accepted);
            }
        }
    }
    drop(make_mirror);

    // A reload that sets a short reconcile interval starts a pass one second later.
    agent.reload(cfg.clone().with("[reconcile]\ninterval = \"1s\""))?;
    let status =
        agent.wait_for("a reconcile pass", Duration::from_secs(600), |s| s.last_reconcile.is_some()).await?;
    let pass = status.last_reconcile.unwrap_or_default();
    f.reconcile = pass.keys_compared as f64 / pass.duration_seconds.max(1e-9);
    println!(
        "reconcile pass ({} keys, both sides read):     {:>10.0} keys/s = {:.2} x",
        pass.keys_compared,
        f.reconcile,
        f.reconcile / f.ceiling
    );
    peak_rss(&agent, "reconcile pass", &mut f);
    drop(agent);
    drop(target);
    if plan.load_rate > 0 {
        f.loaded = Some(loaded_sync(&plan, &source, &src, &mut f).await?);
    }
    if !plan.exact_rates.is_empty() {
        exact::run(&plan).await?;
    }
    if let Some(path) = &plan.plot {
        crate::plot::draw(&f, path)?;
        println!("plot: {}", path.display());
    }
    Ok(f)
}

/// The agent after its initial sync onto a fresh target, and the sync's rate.
struct LiveSync {
    agent: AgentProcess,
    target: EtcdCluster,
    dst: Client,
    cfg: AgentConfig,
    /// Keys/s from the agent's start to its `InitialSyncComplete`.
    rate: f64,
}

/// Starts an agent from `source`'s `/bench/` onto a fresh target and times its initial sync
/// to its own `InitialSyncComplete` ([`until_synced`]); checks the target equal once after.
async fn agent_sync(plan: &BenchPlan, source: &EtcdCluster) -> anyhow::Result<LiveSync> {
    let target = EtcdCluster::start(ClusterSpec::new(plan.version)).await?;
    let dst = target.client().await?;
    let cfg = bench_agent(plan, "bench", source, &target);
    let started = Instant::now();
    let agent = AgentProcess::start(&cfg).await?;
    until_synced(&agent, "initial sync").await?;
    let rate = plan.keys as f64 / started.elapsed().as_secs_f64();
    let equal = crate::scenario::g3_of(source, &target, &cfg).await?;
    anyhow::ensure!(matches!(equal, G3::Holds { .. }), "after the initial sync: {equal:?}");
    Ok(LiveSync { agent, target, dst, cfg, rate })
}

/// The config of a bench agent from `source`'s `/bench/` onto `target`: 1 s progress
/// notifications, then `--agent-toml`.
fn bench_agent(plan: &BenchPlan, link: &str, source: &EtcdCluster, target: &EtcdCluster) -> AgentConfig {
    AgentConfig::new(link, source.endpoints(), target.endpoints(), "/bench/")
        .overlay("[sync]\nprogress_interval = \"1s\"")
        .overlay(&plan.agent_toml)
}

/// Waits for the agent's own `InitialSyncComplete`, reading its `/statusz` every 10 ms: the
/// agent says when its sync is done (every key written, the backlog replayed, the checkpoint
/// out of scanning), and nothing reads the clusters being timed (a count of the target's
/// range walks every key of it in etcd's index, ~0.2 s at 1 000 000 keys, under the lock its
/// writes need: see [`wait_for_landed`]).
async fn until_synced(agent: &AgentProcess, what: &str) -> anyhow::Result<()> {
    let synced = |s: &mirror_core::Status| s.condition(mirror_core::ConditionType::InitialSyncComplete);
    agent.wait_for_every(what, Duration::from_secs(900), Duration::from_millis(10), synced).await?;
    Ok(())
}

/// The median of `values` (the mean of the middle two for an even count; 0 for none).
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn peak_rss(agent: &AgentProcess, case: &str, f: &mut Figures) {
    record_rss(agent.take_peak_rss_bytes(), case, f);
}

fn record_rss(peak: Option<u64>, case: &str, f: &mut Figures) {
    match peak {
        Some(b) => {
            println!("agent peak RSS, {case:<30}       {:>10.1} MiB", b as f64 / (1 << 20) as f64);
            f.peak_rss.push((case.to_owned(), b));
        }
        None => println!("agent peak RSS, {case}: unavailable (no /proc for the agent)"),
    }
}

/// Runs `measure` against a fresh single-member target, then removes it.
async fn on_fresh_target<F, Fut>(version: EtcdVersion, measure: F) -> anyhow::Result<f64>
where
    F: FnOnce(Client) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<f64>>,
{
    let target = EtcdCluster::start(ClusterSpec::new(version)).await?;
    measure(target.client().await?).await
}

/// Waits until the target holds all `keys` keys `prefix + key-%08d` the source was loaded with.
///
/// It polls a point Get of the last key, and counts only once that key is there (a few chunks
/// written concurrently with it may still be in flight). A count-only read of the whole range
/// is no cheap poll: etcd walks every key of the range in its index under the index's read
/// lock, which every write needs to take for writing, so polling a count every 50 ms at 1M keys
/// kept the index locked for most of the run and slowed the very writes being timed (the
/// "agent slows from 100k to 1M keys" of issue #11 was mostly this).
async fn wait_for_landed(
    dst: &mut Client,
    prefix: &str,
    keys: usize,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    let last = key(prefix, keys.saturating_sub(1));
    loop {
        if dst.get(last.as_str(), None).await?.count() > 0 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "{last} never arrived within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    loop {
        let n = dst.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await?.count();
        if n as usize >= keys {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "only {n} of {keys} keys under {prefix} after {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `etcdctl make-mirror` running on a pair of its own, after its initial copy.
struct MakeMirror {
    src: Client,
    dst: Client,
    sync_rate: f64,
    _child: tokio::process::Child,
    _pair: (EtcdCluster, EtcdCluster),
}

impl MakeMirror {
    /// Loads `make_mirror_keys` keys, starts make-mirror and times its copy; `None` without
    /// etcdctl or with no keys asked for (make-mirror is then skipped).
    async fn start(version: EtcdVersion, plan: &BenchPlan) -> anyhow::Result<Option<MakeMirror>> {
        let etcdctl = version.etcdctl();
        if !etcdctl.exists() || plan.make_mirror_keys == 0 {
            return Ok(None);
        }
        let source = EtcdCluster::start(ClusterSpec::new(version)).await?;
        let target = EtcdCluster::start(ClusterSpec::new(version)).await?;
        let (mut src, mut dst) = (source.client().await?, target.client().await?);
        load_keys(&mut src, "/mm/", plan.make_mirror_keys, plan.value_size).await?;
        let started = Instant::now();
        let child = tokio::process::Command::new(&etcdctl)
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", source.endpoints()[0]))
            .arg("make-mirror")
            .arg("--prefix=/mm/")
            .arg(target.endpoints()[0].clone())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("spawning etcdctl make-mirror")?;
        wait_for_landed(&mut dst, "/mm/", plan.make_mirror_keys, Duration::from_secs(300)).await?;
        let sync_rate = plan.make_mirror_keys as f64 / started.elapsed().as_secs_f64();
        Ok(Some(MakeMirror { src, dst, sync_rate, _child: child, _pair: (source, target) }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The median of an odd count is its middle value, of an even count the mean of the
    /// middle two, in any input order.
    #[test]
    fn the_median_is_the_middle_of_the_sorted_rounds() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].into_iter()), 2.5);
        assert_eq!(median([7.0].into_iter()), 7.0);
        assert_eq!(median(std::iter::empty()), 0.0);
    }

    /// Quantiles pick from sorted lags and never index out of range.
    #[test]
    fn quantiles_pick_in_range() {
        let lags: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(quantile(&lags, 0.5), Duration::from_millis(51));
        assert_eq!(quantile(&lags, 0.99), Duration::from_millis(100));
        assert_eq!(quantile(&lags, 1.0), Duration::from_millis(100));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }
}
