//! Group commit in the tail (issue #11): under an open-loop load of multi-key Txns the agent
//! carries several whole revisions per target Txn, and G3 holds at every check meanwhile.

use std::time::Duration;

use etcd_client::{Txn, TxnOp};
use harness::scenario::{self, caught_up, synced};
use harness::{load_keys, AgentProcess, G3};

/// 5 000 writes/s (1 250 Txns of 4 puts per second, each sent at its due time whether or not
/// earlier ones returned) for at least 20 s and until the G3 checker, running throughout, has
/// checked 5 times (each check reads both ranges, which takes longer on a loaded machine: a
/// fixed 20 s saw only 2 checks beside other tests); afterwards the target equals the source and
/// the batch histogram shows Txns that carried more than one revision. Two worker threads: on
/// one, the checker shared it with 1 250 spawned Txns a second and, on a loaded machine, ran fewer
/// than 5 checks in 120 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_keeps_g3_under_five_thousand_writes_per_second() {
    let (source, target) = scenario::pair().await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/gc/", 1_000, 32).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "group", "/gc/");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await.unwrap();

    let txns_per_second = 1_250u32;
    let (least, most) = (Duration::from_secs(20), Duration::from_secs(120));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (client, stop) = (src.clone(), stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1) / txns_per_second);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut tasks = tokio::task::JoinSet::new();
            for n in 0u32.. {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                tick.tick().await;
                let mut c = client.clone();
                tasks.spawn(async move {
                    let ops: Vec<TxnOp> = (0..4u32)
                        .map(|j| {
                            TxnOp::put(
                                format!("/gc/key-{:08}", (n * 4 + j * 251) % 2_000),
                                n.to_string(),
                                None,
                            )
                        })
                        .collect();
                    c.txn(Txn::new().and_then(ops)).await.map(|_| ())
                });
            }
            while let Some(done) = tasks.join_next().await {
                done.unwrap().unwrap();
            }
        })
    };
    let (parsed, mut dst) = (cfg.parsed().unwrap(), target.client().await.unwrap());
    let (rewriter, checkpoint_key) = (parsed.rewriter(), parsed.checkpoint_key());
    let mut checker = source.client().await.unwrap();
    let (mut checks, started) = (0, tokio::time::Instant::now());
    while checks < 5 || started.elapsed() < least {
        assert!(started.elapsed() < most, "only {checks} G3 checks in {most:?} of load");
        match harness::check_g3(&mut checker, &mut dst, &rewriter, &checkpoint_key).await {
            Ok(G3::Holds { .. }) => checks += 1,
            Ok(G3::NotYet) => panic!("the initial sync flag came back under load"),
            Err(e) => panic!("G3 violated under load after {checks} checks: {e:#}"),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.await.unwrap();
    caught_up(&agent, &mut src).await.unwrap();
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { .. }));

    let metrics = agent.metrics().await.unwrap();
    let value = |series: &str| metrics.sample(series).unwrap_or_else(|| panic!("{series} not in /metrics"));
    let single = value("etcd_mirror_batch_revisions_bucket{le=\"1.0\"}");
    let all = value("etcd_mirror_batch_revisions_count");
    eprintln!("tail Txns: {all}, of which single-revision: {single}; G3 checks under load: {checks}");
    assert!(all > single, "no Txn carried more than one revision ({all} Txns)");
}
