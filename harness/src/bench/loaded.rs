//! The loaded cases: an initial sync onto a fresh target while the source takes writes, the
//! tail lag and G3 after it ([`loaded_sync`]), and an initial sync of leased keys beside one
//! without leases ([`leased_sync`]).

use super::*;

/// The loaded case, on a fresh target: the source takes `plan.load_rate` writes/s (open loop,
/// new keys under `/bench/load/`) from a second before the agent starts until its
/// `InitialSyncComplete`; then [`tail_lag`] goes on at the same rate for a minute; G3 is
/// checked; then a reconcile pass runs while the writes go on again. The sync rate is the keys
/// loaded before the run over the time from the agent's start to `InitialSyncComplete`
/// (scan, replay of what the writes added meanwhile, and the catch-up).
pub(super) async fn loaded_sync(
    plan: &BenchPlan,
    source: &EtcdCluster,
    src: &Client,
    f: &mut Figures,
) -> anyhow::Result<LoadedFigures> {
    let rate = plan.load_rate;
    let target = EtcdCluster::start(ClusterSpec::new(plan.version)).await?;
    let dst = target.client().await?;
    let cfg = bench_agent(plan, "bench-loaded", source, &target);
    let keys =
        src.clone().get("/bench/", Some(GetOptions::new().with_prefix().with_count_only())).await?.count();
    let keys = keys as usize;
    let load = Background::start(src, "/bench/load/", rate);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = Instant::now();
    let mut agent = AgentProcess::start(&cfg).await?;
    until_synced(&agent, "initial sync under load").await?;
    let sync = keys as f64 / started.elapsed().as_secs_f64();
    let mut refused = load.stop().await?;
    let backlog = replay_backlog(&agent.log());
    let backlog_text = backlog.map_or_else(|| "unknown".to_owned(), |b| b.to_string());
    println!(
        "agent initial sync of {keys} keys under {rate} writes/s: {sync:>10.0} keys/s = {:.2} x ceiling = {:.2} x unloaded; replayed {backlog_text} revisions at scan end",
        sync / f.ceiling,
        sync / f.agent_sync
    );
    peak_rss(&agent, &format!("sync under {rate} writes/s"), f);

    let after = agent_tail_lag(&agent, src, &dst, "/bench/after/", rate, 60).await?;
    refused += after.rejected;
    println!("tail lag in the minute after it, {rate} writes/s: agent {}", after.summary());
    after.print_commits();
    let equal = crate::scenario::g3_of(source, &target, &cfg).await?;
    let G3::Holds { keys: held, watermark } = equal else {
        anyhow::bail!("after the loaded sync: {equal:?}");
    };
    println!(
        "G3 after the loaded sync and the minute after it: held ({held} keys equal at watermark {watermark})"
    );
    peak_rss(&agent, &format!("tail after it, {rate} writes/s"), f);

    let load = Background::start(src, "/bench/load2/", rate);
    agent.reload(cfg.clone().with("[reconcile]\ninterval = \"1s\""))?;
    let status =
        agent.wait_for("a reconcile pass", Duration::from_secs(900), |s| s.last_reconcile.is_some()).await?;
    refused += load.stop().await?;
    let pass = status.last_reconcile.unwrap_or_default();
    let reconcile = pass.keys_compared as f64 / pass.duration_seconds.max(1e-9);
    println!(
        "reconcile pass under {rate} writes/s ({} keys):  {reconcile:>10.0} keys/s = {:.2} x unloaded; {} repaired",
        pass.keys_compared,
        reconcile / f.reconcile.max(1e-9),
        pass.repaired
    );
    peak_rss(&agent, &format!("reconcile under {rate} writes/s"), f);
    if refused > 0 {
        println!("  the source refused {refused} of the offered puts: the rates above are what it accepted");
    }
    Ok(LoadedFigures { rate, keys, sync, backlog, lags: after.lags, refused, reconcile })
}

/// The revisions replayed at scan end: `replayed` (applied while the watch was still read)
/// plus `buffered` (the rest) of the agent's "scan done" log line.
pub(super) fn replay_backlog(log: &str) -> Option<u64> {
    let line = log.lines().rev().find(|l| l.contains("scan done"))?;
    let field = |name: &str| -> Option<u64> {
        let rest = &line[line.find(name)? + name.len()..];
        let digits: String = rest
            .trim_start_matches(|c: char| !c.is_ascii_digit())
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    };
    Some(field("replayed").unwrap_or(0) + field("buffered")?)
}

/// An open-loop writer that runs until stopped: see [`open_loop`].
pub(super) struct Background {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<Sent>>,
}

impl Background {
    fn start(src: &Client, prefix: &str, rate: u32) -> Background {
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(open_loop(src.clone(), prefix.to_owned(), rate, usize::MAX, stop.clone()));
        Background { stop, task }
    }

    /// Stops sending, waits for the puts in flight, and says how many the source refused.
    async fn stop(self) -> anyhow::Result<usize> {
        self.stop.cancel();
        Ok(self.task.await??.refused)
    }
}

/// Prints and records the agent's peak RSS over the case that just ended, and starts the next
/// case's peak from the RSS it has now.
/// The leased-keys case: the same keys under `plan.leases` source leases, synced to a fresh
/// target with leases stripped, then preserved (a grant per lease before its first Txn, and the
/// keep-alive rounds between scan spans); the second as a ratio of the first.
pub(super) async fn leased_sync(plan: &BenchPlan) -> anyhow::Result<()> {
    let source = EtcdCluster::start(ClusterSpec::new(plan.version)).await?;
    let mut src = source.client().await?;
    let n = plan.leases as i64;
    for id in 1..=n {
        src.lease_grant(600, Some(etcd_client::LeaseGrantOptions::new().with_id(id))).await?;
    }
    let value = vec![b'v'; plan.value_size];
    for start in (0..plan.keys).step_by(FLAT_OPS) {
        let puts: Vec<etcd_client::TxnOp> = (start..(start + FLAT_OPS).min(plan.keys))
            .map(|i| {
                let lease = etcd_client::PutOptions::new().with_lease(1 + i as i64 % n);
                etcd_client::TxnOp::put(key("/bench/", i), value.clone(), Some(lease))
            })
            .collect();
        src.txn(etcd_client::Txn::new().and_then(puts)).await?;
    }
    let mut rates = Vec::new();
    for mode in ["strip", "preserve"] {
        let target = EtcdCluster::start(ClusterSpec::new(plan.version)).await?;
        let mut dst = target.client().await?;
        let cfg = AgentConfig::new("bench-leases", source.endpoints(), target.endpoints(), "/bench/")
            .overlay(&format!("[sync]\nprogress_interval = \"1s\"\nleases = \"{mode}\""))
            .overlay(&plan.agent_toml);
        let started = Instant::now();
        let _agent = AgentProcess::start(&cfg).await?;
        wait_for_landed(&mut dst, "/bench/", plan.keys, Duration::from_secs(900)).await?;
        let rate = plan.keys as f64 / started.elapsed().as_secs_f64();
        rates.push(rate);
        // Preserved means held: the target has every lease (stripped: none).
        let held = dst.leases().await?.leases().len();
        let want = if mode == "preserve" { plan.leases } else { 0 };
        anyhow::ensure!(held == want, "leases {mode}: the target holds {held} leases, not {want}");
        println!(
            "agent initial sync, {} keys under {n} leases, leases {mode:<8}: {rate:>10.0} keys/s = {:.2} x strip",
            plan.keys,
            rate / rates[0]
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The replay backlog is read from the last "scan done" line, text or JSON logs.
    #[test]
    fn replay_backlog_reads_the_scan_done_line() {
        let text =
            "INFO scan done; replaying to scan_end r0=5 scan_end=90 replayed=400 buffered=37\nINFO syncing";
        assert_eq!(replay_backlog(text), Some(437));
        let json =
            r#"{"fields":{"message":"scan done; replaying to scan_end","replayed":0,"buffered":1204}}"#;
        assert_eq!(replay_backlog(json), Some(1204));
        assert_eq!(replay_backlog("INFO syncing"), None);
    }
}
