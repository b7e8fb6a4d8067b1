//! Exact mode's figures (issue #46), printed by `harness bench` (and alone by `--exact-only`):
//! - the target's own ceiling for ordered, fenced single-revision Txns of one shape (compare
//!   the fence key's mod revision with R-1, put one key and the fence key), sent serially and
//!   with 2 and 4 in flight by a probe independent of the agent, resending in order from a Txn
//!   etcd ran too early (SPEC §11), the ones in flight sent back to back, a fixed
//!   `sync.exact_txn_spacing` apart, and paced as the agent paces them ([`Spacer::paced`]);
//! - the exact tail's lag (put acknowledged on the source to seen on the target) at the rates
//!   asked, open loop, and the highest rate of a ladder (125/s steps above them, up to the best
//!   ceiling) it keeps up with (p99 <= 100 ms, and a watch on the source itself keeping up);
//! - the target's ceiling again beside a source taking the first rate the tail did not keep up
//!   with ([`probe_beside_load`]): on one machine the source's writes share its cores and disk
//!   with the target, and this is the ceiling the tail meets there, still without the agent;
//! - compact mode's lag at the same rates and 2 000/s on a fresh pair, for comparison, with one
//!   Txn at a time and with a second sent behind the first (`sync.txns_in_flight = 2`).

use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp, WatchOptions};
use futures::stream::FuturesOrdered;
use futures::StreamExt as _;
use tokio::time::Instant;

use mirror_core::{Spacer, SyncSection};

use super::{ms, tail_lag, BenchPlan};
use crate::exact::{exact_config, seed};
use crate::figures::quantile;
use crate::{load_keys, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion};

/// How long each ceiling probe sends.
const PROBE_SECONDS: u64 = 5;

/// The ladder's step above the rates asked, revisions/s.
const LADDER_STEP: u32 = 125;

/// The p99 within which the exact tail counts as keeping up with a rate.
const KEPT_UP_P99: Duration = Duration::from_millis(100);

/// Runs the exact section.
pub(super) async fn run(plan: &BenchPlan) -> anyhow::Result<()> {
    let version = plan.version;
    println!("exact revisions (sync.revisions = \"exact\"), etcd {version}:");
    let spacing = SyncSection::default().exact_txn_spacing.get();
    let (mut best, mut serial) = (0.0f64, 0.0f64);
    for (window, gap, paced) in [
        (1usize, Duration::ZERO, false),
        (2, Duration::ZERO, false),
        (4, Duration::ZERO, false),
        (2, spacing, false),
        (4, spacing, false),
        (2, spacing, true),
    ] {
        let target = EtcdCluster::start(ClusterSpec::new(version)).await?;
        let (rate, resent) =
            probe_ceiling(&target.client().await?, window, spacer(window, gap, paced)).await?;
        let how = spacing_named(window, gap, paced);
        println!(
            "  target ceiling, ordered fenced 1-revision Txns, {how}: {rate:>7.0} Txns/s ({:.1} % sent again)",
            resent * 100.0
        );
        best = best.max(rate);
        if window == 1 {
            serial = rate;
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
    let steps = (1..).map(|i| top + LADDER_STEP * i).take_while(|r| f64::from(*r) <= best);
    let ladder: Vec<u32> = plan.exact_rates.iter().copied().chain(steps).collect();
    for (i, &rate) in ladder.iter().enumerate() {
        let asked = i < plan.exact_rates.len();
        if !asked && kept_up.is_none_or(|k| k < ladder[i - 1]) {
            break;
        }
        let lags = tail_lag(&src, &dst, &format!("/bench/exact{i}/"), rate, plan.tail_seconds).await?;
        let p99 = quantile(&lags.lags, 0.99);
        let ok = p99 <= KEPT_UP_P99 && lags.overloaded().is_none();
        println!("  exact tail at {rate:>5} revisions/s, open loop: {}", lags.summary());
        if let Some(why) = lags.overloaded() {
            println!("    the source did not keep up with {rate}/s: {why}");
        }
        if ok {
            kept_up = Some(rate);
        } else if !asked {
            break;
        }
    }
    let resent = agent.status().await?.exact.map_or(0, |e| e.resent);
    drop(agent);
    // The first rate the tail did not keep up with (none when it kept up with every rung).
    let failed = ladder.iter().copied().find(|r| kept_up.is_none_or(|k| *r > k));
    let beside = match failed {
        Some(rate) => Some((rate, probe_beside_load(version, rate, spacing).await?)),
        None => None,
    };
    match kept_up {
        Some(rate) => println!(
            "  highest rate the exact tail kept up with (p99 <= {} ms): {rate} revisions/s = {:.2} x the best ceiling, {:.2} x the serial one ({resent} Txns sent again)",
            ms(KEPT_UP_P99),
            rate as f64 / best,
            rate as f64 / serial
        ),
        None => println!("  the exact tail kept up with none of the rates (p99 <= {} ms)", ms(KEPT_UP_P99)),
    }
    if let (Some(rate), Some((_, beside))) = (kept_up, beside) {
        println!(
            "  highest kept up with = {:.2} x the ceiling beside the loaded source (the machine's 2 cores and disk shared)",
            rate as f64 / beside
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

/// The probe's Txns arriving at `rate`/s for `seconds` (open loop: arrival i is due at i/rate
/// whether or not earlier ones landed) and sent one at a time in order, as an exact link with
/// no work of its own would: each one's time from its arrival to its landing, sorted.
async fn probe_lag(client: &Client, rate: u32, seconds: u64) -> anyhow::Result<Vec<Duration>> {
    let fence = b"/probe/fence".to_vec();
    let mut kv = client.kv_client();
    let head = kv.put(fence.clone(), "0", None).await?.header().map_or(0, |h| h.revision());
    let total = rate as u64 * seconds;
    let start = Instant::now();
    let mut lags = Vec::with_capacity(total as usize);
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / rate.max(1) as f64);
        tokio::time::sleep_until(due).await;
        let r = head + 1 + i as i64;
        let txn = Txn::new()
            .when(vec![Compare::mod_revision(fence.clone(), CompareOp::Equal, r - 1)])
            .and_then(vec![
                TxnOp::put(format!("/probe/{r}"), "x", None),
                TxnOp::put(fence.clone(), r.to_string(), None),
            ]);
        anyhow::ensure!(kv.txn(txn).await?.succeeded(), "the probe's Txn {r} failed its compare");
        lags.push(Instant::now() - due);
    }
    lags.sort();
    Ok(lags)
}

/// Txns/s of ordered fenced single-revision Txns with `window` in flight for
/// [`PROBE_SECONDS`], each sent after the one before as `spacer` has it while that one is in
/// flight (as the agent's [`Spacer`], told each Txn's time), and the share sent again (etcd
/// ran a later one first: it failed its compare, and it and those behind it were sent again
/// in order).
async fn probe_ceiling(client: &Client, window: usize, mut spacer: Spacer) -> anyhow::Result<(f64, f64)> {
    let fence = b"/probe/fence".to_vec();
    let mut kv = client.kv_client();
    let head = kv.put(fence.clone(), "0", None).await?.header().map_or(0, |h| h.revision());
    let txn = |r: i64| {
        Txn::new().when(vec![Compare::mod_revision(fence.clone(), CompareOp::Equal, r - 1)]).and_then(vec![
            TxnOp::put(format!("/probe/{r}"), "x", None),
            TxnOp::put(fence.clone(), r.to_string(), None),
        ])
    };
    let (start, until) = (Instant::now(), Instant::now() + Duration::from_secs(PROBE_SECONDS));
    let (mut landed, mut next, mut sent, mut again) = (head, head + 1, 0u64, 0u64);
    let mut flight = FuturesOrdered::new();
    while Instant::now() < until {
        while flight.len() < window {
            spacer.send(!flight.is_empty()).await;
            // Sent now, on a task of its own, not when the flight is next polled.
            let mut kv = kv.clone();
            let t = txn(next);
            let at = Instant::now();
            let sending =
                tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move { kv.txn(t).await }));
            flight.push_back(async move { anyhow::Ok((sending.await??, at.elapsed())) });
            next += 1;
            sent += 1;
        }
        let (answer, took) = flight.next().await.expect("in flight")?;
        spacer.took(took);
        if answer.succeeded() {
            landed += 1;
        } else {
            // Sent before its predecessor landed: it and those behind it go again, in order.
            while let Some(answer) = flight.next().await {
                if answer?.0.succeeded() {
                    landed += 1;
                }
            }
            again += (next - (landed + 1)) as u64;
            next = landed + 1;
        }
    }
    while let Some(answer) = flight.next().await {
        if answer?.0.succeeded() {
            landed += 1;
        }
    }
    let rate = (landed - head) as f64 / start.elapsed().as_secs_f64();
    Ok((rate, again as f64 / sent.max(1) as f64))
}

/// The target's ceiling (the best of serial, 2 in flight `gap` apart and 2 paced) while a
/// source on the same machine takes `rate` puts/s, open loop, watched twice (the agent's watch
/// and the bench's own), and the target is watched where the probe writes (the bench's watch
/// of the target): the ceiling the exact tail meets at that rate, without the agent. Each is
/// printed; the best is returned.
async fn probe_beside_load(version: EtcdVersion, rate: u32, gap: Duration) -> anyhow::Result<f64> {
    let mut best = 0.0f64;
    for (window, gap, paced) in [(1usize, Duration::ZERO, false), (2, gap, false), (2, gap, true)] {
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
        let (ceiling, resent) = probe_ceiling(&dst, window, spacer(window, gap, paced)).await?;
        load.await??;
        drop(drain);
        let how = spacing_named(window, gap, paced);
        println!(
            "  target ceiling beside a source taking {rate} puts/s, {how}: {ceiling:>7.0} Txns/s ({:.1} % sent again)",
            resent * 100.0
        );
        best = best.max(ceiling);
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

/// How a probe sent its Txns, for its line.
fn spacing_named(window: usize, gap: Duration, paced: bool) -> String {
    match (window, gap.is_zero(), paced) {
        (1, _, _) => "1 in flight".to_owned(),
        (_, true, _) => format!("{window} in flight back to back"),
        (_, false, false) => format!("{window} in flight {} us apart", gap.as_micros()),
        (_, false, true) => format!("{window} in flight paced (>= {} us apart)", gap.as_micros()),
    }
}
