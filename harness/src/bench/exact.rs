//! Exact mode's figures (issue #46), printed by `harness bench` (and alone by `--exact-only`):
//! - the target's own ceiling for ordered, fenced single-revision Txns, sent serially and with
//!   2 and 4 in flight by a probe independent of the agent ([`super::probe`]), resending in
//!   order from a Txn etcd ran too early (SPEC §11), the ones in flight sent back to back, a
//!   fixed `sync.exact_txn_spacing` apart, and paced as the agent paces them
//!   ([`Spacer::paced`]); of SPEC §11's shape (compare the fence key's mod revision with R-1,
//!   put one key and the fence key), and of the tail's own (its compares and checkpoint
//!   record), so what the Txn's shape costs the target shows apart from what the agent costs;
//! - the exact tail's lag (put acknowledged on the source to seen on the target) at the rates
//!   asked, open loop, and the highest rate of a ladder (125/s steps above them, up to the best
//!   ceiling, then one rung halfway back from the first rate missed) it keeps up with (p99 <=
//!   100 ms, and a watch on the source itself keeping up);
//! - the exact tail at the first rate asked where each revision takes a key off a lease that
//!   keeps 5 000 others ([`leased_rung`]: Kubernetes' event updates), beside the plain rung;
//! - the exact tail's own rate with the source's writes off the machine ([`catch_up`]): the
//!   source takes a backlog while no agent runs, then the agent applies it, timed on the target;
//! - the target's ceiling again beside a source taking the first rate the tail did not keep up
//!   with ([`probe_beside_load`]): on one machine the source's writes share its cores and disk
//!   with the target, and this is the ceiling the tail meets there, still without the agent;
//! - compact mode's lag at the same rates and 2 000/s on a fresh pair, for comparison, with one
//!   Txn at a time and with a second sent behind the first (`sync.txns_in_flight = 2`).

use std::time::Duration;

use etcd_client::{Client, WatchOptions};
use tokio::time::Instant;

use mirror_core::{Spacer, SyncSection};

use super::probe::{probe_ceiling, probe_lag, Shape, PROBE_SECONDS};
use super::{ms, tail_lag, BenchPlan};
use crate::exact::{exact_config, seed};
use crate::figures::quantile;
use crate::scenario::current_revision;
use crate::{load_keys, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion};

/// The ladder's step above the rates asked, revisions/s.
const LADDER_STEP: u32 = 125;

/// The p99 within which the exact tail counts as keeping up with a rate.
const KEPT_UP_P99: Duration = Duration::from_millis(100);

/// Runs the exact section.
pub(super) async fn run(plan: &BenchPlan) -> anyhow::Result<()> {
    let version = plan.version;
    println!("exact revisions (sync.revisions = \"exact\"), etcd {version}:");
    let spacing = SyncSection::default().exact_txn_spacing.get();
    let (mut ceilings, mut serial) = (Best::default(), 0.0f64);
    for (shape, window, gap, paced) in [
        (Shape::Spec, 1usize, Duration::ZERO, false),
        (Shape::Spec, 2, Duration::ZERO, false),
        (Shape::Spec, 4, Duration::ZERO, false),
        (Shape::Spec, 2, spacing, false),
        (Shape::Spec, 4, spacing, false),
        (Shape::Spec, 2, spacing, true),
        (Shape::Tail, 1, Duration::ZERO, false),
        (Shape::Tail, 2, spacing, true),
    ] {
        let target = EtcdCluster::start(ClusterSpec::new(version)).await?;
        let c = probe_ceiling(&target.client().await?, shape, window, spacer(window, gap, paced)).await?;
        println!(
            "  target ceiling, ordered fenced 1-revision Txns, {}, {}: {:>7.0} Txns/s ({:.1} % sent again){}",
            shape.named(),
            spacing_named(window, gap, paced),
            c.rate,
            c.resent * 100.0,
            record_named(shape, c.record_bytes)
        );
        ceilings.note(shape, c.rate);
        if (shape, window) == (Shape::Spec, 1) {
            serial = c.rate;
        }
    }

    for &rate in &plan.exact_rates {
        let target = EtcdCluster::start(ClusterSpec::new(version)).await?;
        let lags = probe_lag(&target.client().await?, rate, plan.tail_seconds).await?;
        println!(
            "  the probe alone at {rate:>5} revisions/s, open loop, 1 in flight: p50 {:>8.2} ms p99 {:>8.2} ms (the target's own floor)",
            ms(quantile(&lags, 0.5)),
            ms(quantile(&lags, 0.99))
        );
    }

    let source = EtcdCluster::start(ClusterSpec::new(version)).await?;
    let mut target = EtcdCluster::start(ClusterSpec::new(version)).await?;
    let mut src = source.client().await?;
    load_keys(&mut src, "/bench/seed/", 1000, plan.value_size).await?;
    seed(&source, &mut target, "bench-seed").await?;
    let cfg = exact_config(&source, &target, "bench-exact").overlay(&plan.agent_toml);
    let agent = AgentProcess::start(&cfg).await?;
    // Tailing before the first rate: its start is no part of the first rate's lag.
    crate::scenario::caught_up(&agent, &mut src).await?;
    let dst = target.client().await?;
    let mut kept_up = None;
    // The rates asked, then 125/s steps above the highest of them up to the best ceiling (a
    // step of 250/s at 1 250/s left a fifth of the rate unresolved).
    let top = plan.exact_rates.iter().copied().max().unwrap_or(0);
    let steps = (1..).map(|i| top + LADDER_STEP * i).take_while(|r| f64::from(*r) <= ceilings.spec);
    let ladder: Vec<u32> = plan.exact_rates.iter().copied().chain(steps).collect();
    let rung = |i: usize, rate: u32| {
        let (src, dst) = (&src, &dst);
        async move {
            let lags = tail_lag(src, dst, &format!("/bench/exact{i}/"), rate, plan.tail_seconds).await?;
            let p99 = quantile(&lags.lags, 0.99);
            println!("  exact tail at {rate:>5} revisions/s, open loop: {}", lags.summary());
            if let Some(why) = lags.overloaded() {
                println!("    the source did not keep up with {rate}/s: {why}");
            }
            anyhow::Ok(p99 <= KEPT_UP_P99 && lags.overloaded().is_none())
        }
    };
    for (i, &rate) in ladder.iter().enumerate() {
        let asked = i < plan.exact_rates.len();
        if !asked && kept_up.is_none_or(|k| k < ladder[i - 1]) {
            break;
        }
        if rung(i, rate).await? {
            kept_up = Some(rate);
        } else if !asked {
            break;
        }
    }
    // The first rate the tail did not keep up with (none when it kept up with every rung).
    let mut failed = ladder.iter().copied().find(|r| kept_up.is_none_or(|k| *r > k));
    // One rung halfway between the highest kept up with and the first missed, so the figure
    // is resolved to half a step (62/s) rather than a whole one.
    if let (Some(k), Some(f)) = (kept_up, failed) {
        let half = (k + f) / 2;
        if half > k && half < f {
            if rung(ladder.len(), half).await? {
                kept_up = Some(half);
            } else {
                failed = Some(half);
            }
        }
    }
    let resent = agent.status().await?.exact.map_or(0, |e| e.resent);
    if let Some(&rate) = plan.exact_rates.first() {
        let lags = leased_rung(&agent, &mut src, &dst, rate, plan.tail_seconds).await?;
        println!(
            "  exact tail at {rate:>5} revisions/s, each taking a key off a lease that keeps {LEASE_KEPT} others: {}",
            lags.summary()
        );
    }
    drop(agent);
    let drained = catch_up(&cfg, &src, &dst).await?;
    drop((source, target));
    let beside = match failed {
        Some(rate) => Some((rate, probe_beside_load(version, rate, spacing).await?)),
        None => None,
    };
    match kept_up {
        Some(rate) => println!(
            "  highest rate the exact tail kept up with (p99 <= {} ms): {rate} revisions/s = {:.2} x the best ceiling, {:.2} x the serial one ({resent} Txns sent again)",
            ms(KEPT_UP_P99),
            rate as f64 / ceilings.spec,
            rate as f64 / serial
        ),
        None => println!("  the exact tail kept up with none of the rates (p99 <= {} ms)", ms(KEPT_UP_P99)),
    }
    if let Some(rate) = kept_up {
        println!(
            "  highest kept up with = {:.2} x the best ceiling of the tail's own Txn shape (its compares and record)",
            rate as f64 / ceilings.tail
        );
    }
    println!(
        "  exact tail catching up {BACKLOG} revisions the source took while no agent ran: {drained:>7.0} revisions/s = {:.2} x \
         the best ceiling, {:.2} x the serial one, {:.2} x the tail shape's best (its own rate, the source idle meanwhile)",
        drained / ceilings.spec,
        drained / serial,
        drained / ceilings.tail
    );
    if let (Some(rate), Some((_, beside))) = (kept_up, beside) {
        println!(
            "  highest kept up with = {:.2} x the ceiling beside the loaded source (SPEC shape; the machine's 2 cores and \
             disk shared), {:.2} x the tail shape's there",
            rate as f64 / beside.spec,
            rate as f64 / beside.tail
        );
    }

    // Compact mode, one Txn at a time and with a second sent behind the first
    // (`sync.txns_in_flight`), each on a fresh pair with the same rates.
    let mut rates = plan.exact_rates.clone();
    rates.push(2000);
    rates.dedup();
    for in_flight in [1, 2] {
        let source = EtcdCluster::start(ClusterSpec::new(version)).await?;
        let target = EtcdCluster::start(ClusterSpec::new(version)).await?;
        let cfg = AgentConfig::new("bench-compact", source.endpoints(), target.endpoints(), "/bench/")
            .with(crate::scenario::FAST_SYNC_TOML)
            .overlay(&format!("[sync]\ntxns_in_flight = {in_flight}"))
            .overlay(&plan.agent_toml);
        let agent = AgentProcess::start(&cfg).await?;
        crate::scenario::synced(&agent).await?;
        let (src, dst) = (source.client().await?, target.client().await?);
        for (i, rate) in rates.iter().enumerate() {
            let lags = tail_lag(&src, &dst, &format!("/bench/compact{i}/"), *rate, plan.tail_seconds).await?;
            println!(
                "  compact tail at {rate:>5} writes/s, same pair shape, {in_flight} Txn(s) in flight: {}",
                lags.summary()
            );
        }
    }
    Ok(())
}

/// Keys that stay under the lease of [`leased_rung`] while others leave it.
const LEASE_KEPT: usize = 5_000;

/// The exact tail at `rate`, open loop, where each revision takes a key off one source lease
/// that keeps [`LEASE_KEPT`] keys: Kubernetes' event updates past the API server's lease-reuse
/// window, which move an event off a lease holding the rest of that window's events. The
/// agent must see that the lease still holds keys (it revokes a target lease once its last key
/// left); the lag beside the plain rung at the same rate is what finding that out costs.
async fn leased_rung(
    agent: &AgentProcess,
    src: &mut Client,
    dst: &Client,
    rate: u32,
    seconds: u64,
) -> anyhow::Result<super::Lags> {
    let prefix = "/bench/leased/";
    let lease = src.lease_grant(600, None).await?.id();
    let moved = (rate as u64 * seconds) as usize;
    let keys = (0..moved)
        .map(|i| format!("{prefix}{i:08}"))
        .chain((0..LEASE_KEPT).map(|i| format!("/bench/kept/{i:08}")));
    let keys: Vec<String> = keys.collect();
    for chunk in keys.chunks(64) {
        let under = || Some(etcd_client::PutOptions::new().with_lease(lease));
        let puts: Vec<_> = chunk.iter().map(|k| etcd_client::TxnOp::put(k.as_str(), "x", under())).collect();
        src.txn(etcd_client::Txn::new().and_then(puts)).await?;
    }
    crate::scenario::caught_up(agent, src).await?;
    tail_lag(src, dst, prefix, rate, seconds).await
}

/// Revisions the source takes while no agent runs, for [`catch_up`].
const BACKLOG: usize = 20_000;

/// Writers putting the backlog.
const BACKLOG_WRITERS: usize = 8;

/// The exact tail's own rate, the source's writes off the machine's cores: with no agent
/// running, the source takes [`BACKLOG`] puts (one revision each); then the agent of `cfg` is
/// started and the target's revision read every 10 ms until it holds the source's. Revisions/s
/// from the first read past where it stood (the agent's start is no part of it) to the last.
async fn catch_up(cfg: &AgentConfig, src: &Client, dst: &Client) -> anyhow::Result<f64> {
    let (mut src, mut dst) = (src.clone(), dst.clone());
    let from = current_revision(&mut dst).await?;
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..BACKLOG_WRITERS {
        let mut kv = src.kv_client();
        writers.spawn(async move {
            for i in (w..BACKLOG).step_by(BACKLOG_WRITERS) {
                kv.put(format!("/bench/backlog/{i}"), "x", None).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = writers.join_next().await {
        done??;
    }
    let head = current_revision(&mut src).await?;
    let _agent = AgentProcess::start(cfg).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut first = None;
    loop {
        let (at, now) = (current_revision(&mut dst).await?, Instant::now());
        if at > from && first.is_none() {
            first = Some((at, now));
        }
        if at >= head {
            let (first_at, first_now) = first.expect("moved past where it stood");
            return Ok((at - first_at) as f64 / (now - first_now).as_secs_f64().max(1e-3));
        }
        anyhow::ensure!(
            now < deadline,
            "the exact tail did not catch up within 2 min: target at {at}, source at {head}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The best ceiling of each shape among the probes run.
#[derive(Default)]
struct Best {
    spec: f64,
    tail: f64,
}

impl Best {
    /// A probe of `shape` landed `rate` Txns/s.
    fn note(&mut self, shape: Shape, rate: f64) {
        let best = match shape {
            Shape::Spec => &mut self.spec,
            Shape::Tail => &mut self.tail,
        };
        *best = best.max(rate);
    }
}

/// The target's ceiling (SPEC's shape serially, 2 in flight `gap` apart and 2 paced; the tail's
/// shape 2 paced) while a source on the same machine takes `rate` puts/s, open loop, watched
/// twice (the agent's watch and the bench's own), and the target is watched where the probe
/// writes (the bench's watch of the target): the ceiling the exact tail meets at that rate,
/// without the agent. Each is printed; the best of each shape is returned.
async fn probe_beside_load(version: EtcdVersion, rate: u32, gap: Duration) -> anyhow::Result<Best> {
    let mut best = Best::default();
    for (shape, window, gap, paced) in [
        (Shape::Spec, 1usize, Duration::ZERO, false),
        (Shape::Spec, 2, gap, false),
        (Shape::Spec, 2, gap, true),
        (Shape::Tail, 2, gap, true),
    ] {
        let source = EtcdCluster::start(ClusterSpec::new(version)).await?;
        let target = EtcdCluster::start(ClusterSpec::new(version)).await?;
        let (src, dst) = (source.client().await?, target.client().await?);
        let mut watched = dst.clone().watch("/probe/", Some(WatchOptions::new().with_prefix())).await?;
        let drain = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
            while let Ok(Some(_)) = watched.message().await {}
        }));
        let load =
            tokio::spawn(
                async move { tail_lag(&src, &src, "/bench/beside/", rate, PROBE_SECONDS + 2).await },
            );
        tokio::time::sleep(Duration::from_secs(1)).await;
        let c = probe_ceiling(&dst, shape, window, spacer(window, gap, paced)).await?;
        load.await??;
        drop(drain);
        println!(
            "  target ceiling beside a source taking {rate} puts/s, {}, {}: {:>7.0} Txns/s ({:.1} % sent again)",
            shape.named(),
            spacing_named(window, gap, paced),
            c.rate,
            c.resent * 100.0
        );
        best.note(shape, c.rate);
    }
    Ok(best)
}

/// The probe's spacing: none, `gap`, or paced as the agent paces (`gap` the least).
fn spacer(window: usize, gap: Duration, paced: bool) -> Spacer {
    if paced {
        Spacer::paced(gap, window)
    } else {
        Spacer::new(gap)
    }
}

/// The tail shape's record size, for its line.
fn record_named(shape: Shape, bytes: usize) -> String {
    match shape {
        Shape::Spec => String::new(),
        Shape::Tail => format!(", {bytes}-byte record"),
    }
}

/// How a probe sent its Txns, for its line.
fn spacing_named(window: usize, gap: Duration, paced: bool) -> String {
    match (window, gap.is_zero(), paced) {
        (1, _, _) => "1 in flight".to_owned(),
        (_, true, _) => format!("{window} in flight back to back"),
        (_, false, false) => format!("{window} in flight {} us apart", gap.as_micros()),
        (_, false, true) => format!("{window} in flight paced (>= {} us apart)", gap.as_micros()),
    }
}
