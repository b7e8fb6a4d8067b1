//! `harness bench`: performance figures measured side by side on one etcd pair in one run.
//!
//! Every figure is printed next to a baseline from the same run (the machine is shared and
//! noisy, so absolute numbers mean little across runs):
//! - the target's raw write ceiling: 4 concurrent writers of 128-op Txns;
//! - the agent's initial sync keys/s, as a ratio of that ceiling;
//! - `etcdctl make-mirror` initial sync keys/s (3.5.1's etcdctl), where present;
//! - tail lag p50/p99 at a fixed, open-loop write rate (source put acknowledged → visible in
//!   the target);
//! - a reconcile pass (diff of both whole ranges, nothing to repair) in keys/s;
//! - the agent's peak RSS.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context as _;
use etcd_client::{Client, GetOptions, Txn, TxnOp, WatchOptions};
use tokio::time::Instant;

use crate::{load_keys, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion};

/// Sizes of one bench run.
#[derive(Clone, Debug)]
pub struct BenchPlan {
    /// Keys for the ceiling and the agent's initial sync.
    pub keys: usize,
    /// Value size in bytes.
    pub value_size: usize,
    /// Keys for make-mirror (it is slow: one serial Put per key).
    pub make_mirror_keys: usize,
    /// Tail write rates (writes/s, open loop), each measured for `tail_seconds`.
    pub tail_rates: Vec<u32>,
    /// How long the tail runs.
    pub tail_seconds: u64,
}

/// Runs the bench and prints its figures.
pub async fn run(plan: BenchPlan) -> anyhow::Result<()> {
    let version = EtcdVersion::V3_5_1;
    println!("etcd-mirror bench: etcd {version} pair, {} keys of {} B", plan.keys, plan.value_size);

    let ceiling = {
        let target = EtcdCluster::start(ClusterSpec::new(version)).await?;
        write_ceiling(&target.client().await?, plan.keys, plan.value_size).await?
    };
    println!("target write ceiling (4 writers x 128-op Txn): {ceiling:>10.0} keys/s   (baseline 1.00)");

    let source = EtcdCluster::start(ClusterSpec::new(version)).await?;
    let target = EtcdCluster::start(ClusterSpec::new(version)).await?;
    let mut src = source.client().await?;
    load_keys(&mut src, "/bench/", plan.keys, plan.value_size).await?;
    let cfg = AgentConfig::new("bench", source.endpoints(), target.endpoints(), "/bench/")
        .with("[sync]\nprogress_interval = \"1s\"");
    let started = Instant::now();
    let mut agent = AgentProcess::start(&cfg).await?;
    agent.wait_for("initial sync", Duration::from_secs(600), |s| s.condition("InitialSyncComplete")).await?;
    let agent_rate = plan.keys as f64 / started.elapsed().as_secs_f64();
    println!(
        "agent initial sync:                            {agent_rate:>10.0} keys/s   ({:.2} x ceiling)",
        agent_rate / ceiling
    );

    match make_mirror_rate(version, &plan).await {
        Ok(Some(rate)) => println!(
            "etcdctl make-mirror initial sync ({} keys):   {rate:>10.0} keys/s   ({:.3} x ceiling, agent is {:.0} x faster)",
            plan.make_mirror_keys,
            rate / ceiling,
            agent_rate / rate
        ),
        Ok(None) => println!("etcdctl make-mirror: etcdctl not found, skipped"),
        Err(e) => println!("etcdctl make-mirror: failed: {e:#}"),
    }

    for (round, &rate) in plan.tail_rates.iter().enumerate() {
        let prefix = format!("/bench/lag{round}/");
        let (p50, p99, n) =
            tail_lag(&mut src, &mut target.client().await?, &prefix, rate, plan.tail_seconds).await?;
        println!(
            "tail lag at {rate} writes/s, open loop ({n} writes):  p50 {:>8.2} ms   p99 {:>8.2} ms",
            p50.as_secs_f64() * 1e3,
            p99.as_secs_f64() * 1e3
        );
    }
    // A reload that sets a short reconcile interval starts a pass one second later.
    agent.reload(cfg.clone().with("[reconcile]\ninterval = \"1s\""))?;
    let status =
        agent.wait_for("a reconcile pass", Duration::from_secs(600), |s| s.last_reconcile.is_some()).await?;
    let pass = status.last_reconcile.unwrap_or_default();
    let pass_rate = pass.keys_compared as f64 / pass.duration_seconds.max(1e-9);
    println!(
        "reconcile pass ({} keys, both sides read):   {pass_rate:>10.0} keys/s   ({:.2} x ceiling)",
        pass.keys_compared,
        pass_rate / ceiling
    );
    match agent.peak_rss_bytes() {
        Some(b) => println!(
            "agent peak RSS:                                {:>10.1} MiB",
            b as f64 / (1 << 20) as f64
        ),
        None => println!("agent peak RSS: unavailable"),
    }
    Ok(())
}

/// Keys/s that 4 concurrent writers of 128-op Txns reach on `client`'s cluster.
async fn write_ceiling(client: &Client, keys: usize, value_size: usize) -> anyhow::Result<f64> {
    let started = Instant::now();
    let per = keys.div_ceil(4);
    let mut tasks = Vec::new();
    for w in 0..4 {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            let value = vec![b'c'; value_size];
            for start in (w * per..((w + 1) * per).min(keys)).step_by(128) {
                let end = (start + 128).min((w + 1) * per).min(keys);
                let ops: Vec<TxnOp> = (start..end)
                    .map(|i| TxnOp::put(format!("/ceiling/{i:08}"), value.clone(), None))
                    .collect();
                c.txn(Txn::new().and_then(ops)).await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(keys as f64 / started.elapsed().as_secs_f64())
}

/// make-mirror's initial copy rate on a fresh pair, or `None` without etcdctl.
async fn make_mirror_rate(version: EtcdVersion, plan: &BenchPlan) -> anyhow::Result<Option<f64>> {
    let etcdctl = version.etcdctl();
    if !etcdctl.exists() {
        return Ok(None);
    }
    let source = EtcdCluster::start(ClusterSpec::new(version)).await?;
    let target = EtcdCluster::start(ClusterSpec::new(version)).await?;
    let mut src = source.client().await?;
    load_keys(&mut src, "/mm/", plan.make_mirror_keys, plan.value_size).await?;
    let started = Instant::now();
    let mut child = tokio::process::Command::new(&etcdctl)
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
    let mut dst = target.client().await?;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let n = dst.get("/mm/", Some(GetOptions::new().with_prefix().with_count_only())).await?.count();
        if n as usize >= plan.make_mirror_keys {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "make-mirror copied only {n} keys in 300 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rate = plan.make_mirror_keys as f64 / started.elapsed().as_secs_f64();
    child.kill().await.ok();
    Ok(Some(rate))
}

/// Writes at `rate`/s for `seconds` and measures put-acknowledged → visible-in-target latency.
/// The writer and the target watch run as separate tasks so neither delays the other's clock.
async fn tail_lag(
    src: &mut Client,
    dst: &mut Client,
    prefix: &str,
    rate: u32,
    seconds: u64,
) -> anyhow::Result<(Duration, Duration, usize)> {
    let total = (rate as u64 * seconds) as usize;
    let mut stream = dst.watch(prefix, Some(WatchOptions::new().with_prefix())).await?;
    let seen = tokio::spawn(async move {
        let mut seen: HashMap<Vec<u8>, Instant> = HashMap::new();
        let deadline = Instant::now() + Duration::from_secs(seconds + 30);
        while seen.len() < total && Instant::now() < deadline {
            let Ok(Ok(Some(resp))) = tokio::time::timeout(Duration::from_secs(1), stream.message()).await
            else {
                continue;
            };
            let now = Instant::now();
            for ev in resp.events() {
                if let Some(kv) = ev.kv() {
                    seen.entry(kv.key().to_vec()).or_insert(now);
                }
            }
        }
        seen
    });
    // Open loop: each put is sent at its due time on a task of its own, whether or not earlier
    // ones returned, so a slow system cannot lower the offered rate.
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut puts = tokio::task::JoinSet::new();
    for i in 0..total {
        tick.tick().await;
        let key = format!("{prefix}{i:08}").into_bytes();
        let mut c = src.clone();
        puts.spawn(async move {
            c.put(key.clone(), "x", None).await?;
            anyhow::Ok((key, Instant::now()))
        });
    }
    let mut acked: HashMap<Vec<u8>, Instant> = HashMap::new();
    while let Some(done) = puts.join_next().await {
        let (key, at) = done??;
        acked.insert(key, at);
    }
    let seen = seen.await?;
    let mut lags: Vec<Duration> =
        acked.iter().filter_map(|(k, at)| seen.get(k).map(|s| s.saturating_duration_since(*at))).collect();
    anyhow::ensure!(!lags.is_empty(), "no write became visible in the target");
    lags.sort();
    let pick = |q: f64| lags[((lags.len() as f64 * q) as usize).min(lags.len() - 1)];
    Ok((pick(0.50), pick(0.99), lags.len()))
}
