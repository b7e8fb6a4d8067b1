//! The initial sync under write load must not complete on a progress reply that overtook events
//! (etcd < 3.4.25 / 3.5.8, both versions we run): issue #9's reproduced data loss.
//!
//! Shape of the original report, scaled to fit a test: the target holds many orphans under the
//! destination prefix, `overwrite_and_prune` makes the agent sweep them after the scan (during
//! the sweep nothing reads the source watch, so the server parks it as a slow watcher), and a
//! churn of puts, deletes, Txns and range deletes runs through the whole initial sync. Before
//! the fix the target ended short of hundreds of keys with `InitialSyncComplete` True.

use harness::scenario;
use harness::{check_g3, load_keys, AgentProcess, Churn, ClusterSpec, EtcdCluster, EtcdVersion, G3};
use rstest::rstest;

/// Sweep under churn, then G3 once the churn stopped and the agent caught up. With 20 000 ops
/// the churn outlasts the initial sync (completion is proven by a later event); with 2 500 it
/// stops during the sweep, so the source is idle when the replay reaches the end of the scan
/// and completion comes from comparing the sides.
#[rstest]
#[case::v3_5_1_busy(EtcdVersion::V3_5_1, 20_000)]
#[case::v3_5_1_idle(EtcdVersion::V3_5_1, 2_500)]
#[case::v3_4_23_busy(EtcdVersion::V3_4_23, 20_000)]
#[case::v3_4_23_idle(EtcdVersion::V3_4_23, 2_500)]
#[tokio::test]
async fn initial_sync_with_sweep_under_churn_loses_nothing(#[case] version: EtcdVersion, #[case] ops: usize) {
    let source = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let (mut src, mut dst) = (source.client().await.unwrap(), target.client().await.unwrap());
    load_keys(&mut src, "/app/", 20_000, 200).await.unwrap();
    // Orphans that sort among the source's keys, so the sweep deletes them page by page.
    load_keys(&mut dst, "/app/key-orphan-", 40_000, 16).await.unwrap();

    let cfg = scenario::fast_config(&source, &target, "sweep-churn", "/app/")
        .with("[initial_sync]\nmode = \"overwrite_and_prune\"");
    // Values of 1 KiB fill the watch stream's flow-control window within a second of the sweep,
    // so the server parks the watcher as a slow one while the sweep runs.
    let churn = Churn::new("/app/", ops, 1_500, 24_000).value_size(1024).seed(9).spawn(src.clone());
    // Writes outside the mirrored range, as any shared cluster has: the source revision moves
    // past the last event of the range, so once the churn stops only a progress reply (or a
    // comparison) can tell the agent that nothing more is coming.
    let elsewhere = {
        let mut c = src.clone();
        tokio::spawn(async move {
            for i in 0u64.. {
                c.put("/elsewhere/tick", i.to_string(), None).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let agent = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&agent).await.unwrap();
    churn.await.unwrap().unwrap();
    elsewhere.abort();
    // One last in-range write, so the watermark can reach the current revision by data.
    src.put("/app/zz-last", "1", None).await.unwrap();
    scenario::caught_up(&agent, &mut src).await.unwrap();

    let parsed = cfg.parsed().unwrap();
    let g3 = check_g3(&mut src, &mut dst, &parsed.rewriter(), &parsed.checkpoint_key()).await;
    assert!(
        matches!(g3, Ok(G3::Holds { .. })),
        "{version}: G3 after the churn: {g3:?}\nagent log:\n{}",
        tail(&agent.log())
    );
    eprintln!("{}", tail(&agent.log()));
    let status = agent.status().await.unwrap();
    assert_eq!(status.forced_resyncs.count, 0, "no forced resync was needed");
}

fn tail(log: &str) -> String {
    log.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
}
