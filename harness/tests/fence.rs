//! The fenced writer against real etcd, where a unit test cannot reach.

use std::time::Duration;

use harness::{ClusterSpec, EtcdCluster, EtcdVersion};
use mirror_fence::{read_checkpoint, Checkpoint, FenceError, FencedWriter, Observed, Role};

fn record(watermark: i64) -> Checkpoint {
    Checkpoint {
        link_uid: "fence".into(),
        epoch: 1,
        role: Role::Mirror,
        watermark,
        scanning: false,
        scan_cursor: Vec::new(),
        prune_pending: false,
        source_cluster_id: 1,
        target_cluster_id: 2,
        // Two pods of a StatefulSet: same host name, same pid.
        agent_id: "mirror-0/1".into(),
        commit: String::new(),
        range: String::new(),
    }
}

/// Two writers with identical records (same link, epoch, watermark, host and pid): after the
/// second claims, the first's commit must fail its compare and be judged as lost, never adopted
/// as "our own ambiguous commit" because the stored bytes happen to match what it tried to
/// write (defect #9 of issue 10: the record had nothing unique per attempt).
#[tokio::test]
async fn identical_records_of_two_writers_are_never_adopted() {
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_1)).await.unwrap();
    let client = target.client().await.unwrap();
    let key = b"/f/\0etcd-mirror/checkpoint".to_vec();
    let timeout = Duration::from_secs(5);
    let mut first =
        FencedWriter::claim(client.kv_client(), key.clone(), Observed::Absent, record(10), timeout)
            .await
            .unwrap();
    let observed = read_checkpoint(&mut client.kv_client(), &key, timeout).await.unwrap();
    let second =
        FencedWriter::claim(client.kv_client(), key.clone(), observed, record(10), timeout).await.unwrap();
    assert!(second.mod_revision() > first.mod_revision());

    let outcome = first.commit(Vec::new(), Some(record(10))).await;
    assert!(
        matches!(outcome, Err(FenceError::EpochRegressed { .. })),
        "the first writer must learn it lost the fence: {outcome:?}"
    );
}

/// A higher epoch claiming while a lower-epoch writer keeps rewriting the record wins once the
/// other stops, however many races it loses first; it used to give up after three and report
/// `EpochRegressed` although its epoch was the higher one (defect #8 of issue 10).
#[tokio::test]
async fn a_higher_epoch_keeps_claiming_through_lost_races() {
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_1)).await.unwrap();
    let client = target.client().await.unwrap();
    let key = b"/f/\0etcd-mirror/checkpoint".to_vec();
    let timeout = Duration::from_secs(5);
    let racer = {
        let mut kv = client.kv_client();
        let key = key.clone();
        tokio::spawn(async move {
            let until = tokio::time::Instant::now() + Duration::from_secs(2);
            let mut n = 0i64;
            while tokio::time::Instant::now() < until {
                n += 1;
                kv.put(key.clone(), record(n).encode(), None).await.unwrap();
            }
            n
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let observed = read_checkpoint(&mut client.kv_client(), &key, timeout).await.unwrap();
    let mut ours = record(0);
    ours.epoch = 2;
    let writer = FencedWriter::claim(client.kv_client(), key.clone(), observed, ours, timeout).await;
    let races = racer.await.unwrap();
    let writer =
        writer.unwrap_or_else(|e| panic!("epoch 2 gave up against epoch 1 ({races} racing writes): {e}"));
    assert_eq!(writer.record().epoch, 2);
    let stored = read_checkpoint(&mut client.kv_client(), &key, timeout).await.unwrap();
    assert!(matches!(stored, Observed::Present { record, .. } if record.epoch == 2));
}

/// A commit whose answer is lost but which landed (the target stalled past the request
/// timeout, then applied it) is retried with the same bytes and adopted: the writer goes on. It
/// used to send each try with a fresh commit id, so the retry found "another writer of our
/// epoch" and parked a healthy agent in standby (`EpochRegressed`; found by
/// `harness/scenarios/target-paused.toml`).
#[tokio::test]
async fn a_retried_commit_that_had_landed_is_adopted() {
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_1)).await.unwrap();
    let proxies = target.proxies().await.unwrap();
    let through = etcd_client::Client::connect(proxies.endpoints(), None).await.unwrap();
    let mut direct = target.client().await.unwrap();
    let key = b"/f/\0etcd-mirror/checkpoint".to_vec();
    let timeout = Duration::from_secs(1);
    let mut writer =
        FencedWriter::claim(through.kv_client(), key.clone(), Observed::Absent, record(10), timeout)
            .await
            .unwrap();

    // Every chunk is held 1.5 s: the request times out here but reaches etcd and lands.
    proxies.delay(Duration::from_millis(1_500));
    let put = || vec![etcd_client::TxnOp::put("/f/landed", "1", None)];
    let first = writer.commit(put(), Some(record(20))).await;
    assert!(matches!(first, Err(FenceError::Etcd(_))), "the answer is lost: {first:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stored = read_checkpoint(&mut direct.kv_client(), &key, timeout).await.unwrap();
    let Observed::Present { record: landed, .. } = stored else { panic!("no checkpoint") };
    assert_eq!(landed.watermark, 20, "the timed-out commit landed (the test needs it to)");

    proxies.heal();
    let retried = writer.commit(put(), Some(record(20))).await;
    assert!(retried.is_ok(), "the retry adopts the landed commit: {retried:?}");
    assert_eq!(writer.record().watermark, 20);
    writer.commit(Vec::new(), Some(record(21))).await.expect("and the writer goes on");
    assert_eq!(direct.get("/f/landed", None).await.unwrap().kvs().len(), 1);
}
