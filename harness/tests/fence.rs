//! The fenced writer against real etcd, where a unit test cannot reach.

use std::time::Duration;

use harness::{ClusterSpec, EtcdCluster, EtcdVersion};
use mirror_fence::{read_checkpoint, Checkpoint, FenceError, FencedWriter, Observed, Role};

/// A target etcd, a client of it, the checkpoint key and the writer's deadline.
struct Fixture {
    target: EtcdCluster,
    client: etcd_client::Client,
    key: Vec<u8>,
    timeout: Duration,
}

async fn setup(timeout: Duration) -> Fixture {
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let client = target.client().await.unwrap();
    Fixture { target, client, key: b"/f/\0etcd-mirror/checkpoint".to_vec(), timeout }
}

/// Fault proxies in front of `target`, and a client through them.
async fn through_proxy(target: &EtcdCluster) -> (harness::Proxies, etcd_client::Client) {
    let proxies = target.proxies().await.unwrap();
    let through = etcd_client::Client::connect(proxies.endpoints(), None).await.unwrap();
    (proxies, through)
}

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
        confirmed_time: String::new(),
        forced_resyncs: 0,
        scan_restarts: 0,
        initial_sync_completed: String::new(),
        excludes: Vec::new(),
        source_seen: 0,
    }
}

/// Two writers with identical records (same link, epoch, watermark, host and pid): after the
/// second claims, the first's commit must fail its compare and be judged as lost, never adopted
/// as "our own ambiguous commit" because the stored bytes happen to match what it tried to
/// write (defect #9 of issue 10: the record had nothing unique per attempt).
#[tokio::test]
async fn identical_records_of_two_writers_are_never_adopted() {
    let Fixture { target: _target, client, key, timeout } = setup(Duration::from_secs(5)).await;
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

/// A higher epoch claiming while a lower-epoch writer keeps committing wins, however many races
/// it loses first (it used to give up after three and report `EpochRegressed` although its
/// epoch was the higher one: defect #8 of issue 10). Each lost race that moved the record is
/// `Raced`, and the claimer plans again from a fresh read, as the engine does: the record it
/// wins with carries the busy writer's last watermark, and that writer's next commit is fenced.
#[tokio::test]
async fn a_higher_epoch_keeps_claiming_through_lost_races() {
    let Fixture { target: _target, client, key, timeout } = setup(Duration::from_secs(5)).await;
    let mut busy = FencedWriter::claim(client.kv_client(), key.clone(), Observed::Absent, record(0), timeout)
        .await
        .unwrap();
    let racer = tokio::spawn(async move {
        let mut n = 0i64;
        loop {
            match busy.commit(Vec::new(), Some(record(n + 1))).await {
                Ok(_) => n += 1,
                Err(e) => return (n, e),
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut raced = 0;
    let writer = loop {
        let observed = read_checkpoint(&mut client.kv_client(), &key, timeout).await.unwrap();
        let mut ours = match &observed {
            Observed::Present { record, .. } => record.clone(),
            Observed::Absent => record(0),
        };
        ours.epoch = 2;
        match FencedWriter::claim(client.kv_client(), key.clone(), observed, ours, timeout).await {
            Err(FenceError::Raced) => raced += 1,
            other => break other.unwrap_or_else(|e| panic!("epoch 2 gave up against epoch 1: {e}")),
        }
    };
    let (last, fenced) = tokio::time::timeout(Duration::from_secs(10), racer).await.unwrap().unwrap();
    assert!(matches!(fenced, FenceError::FencedByNewerEpoch { stored: 2, ours: 1 }), "{fenced:?}");
    assert_eq!(writer.record().epoch, 2);
    assert_eq!(
        writer.record().watermark,
        last,
        "the claim carries the busy writer's last watermark ({raced} races)"
    );
}

/// A commit whose answer is lost but which landed (the target stalled past the request
/// timeout, then applied it) is retried with the same bytes and adopted: the writer goes on. It
/// used to send each try with a fresh commit id, so the retry found "another writer of our
/// epoch" and parked a healthy agent in standby (`EpochRegressed`; found by
/// `harness/scenarios/target-paused.toml`).
#[tokio::test]
async fn a_retried_commit_that_had_landed_is_adopted() {
    let Fixture { target, client: mut direct, key, timeout } = setup(Duration::from_secs(1)).await;
    let (proxies, mut writer) = landed_with_its_answer_lost(&target, &key, timeout).await;
    proxies.heal();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // What the writer publishes to the lease keeper follows the record it holds, adopted
    // commits included, and never a commit that did not settle.
    let watermarks = writer.watermarks();
    assert_eq!(*watermarks.borrow(), 10, "the claimed record's, not the unsettled commit's");
    let retried = writer.commit(put("first"), Some(record(20))).await;
    assert!(retried.is_ok(), "the retry adopts the landed commit: {retried:?}");
    assert_eq!(writer.record().watermark, 20);
    assert_eq!(*watermarks.borrow(), 20, "an adopted commit publishes its watermark");
    writer.commit(Vec::new(), Some(record(21))).await.expect("and the writer goes on");
    assert_eq!(*watermarks.borrow(), 21);
    assert_eq!(direct.get("/f/first", None).await.unwrap().kvs().len(), 1);
}

/// The same lost answer on the drain's last commit, the one that turns the role to `primary`
/// (upstream #21, DrainRoleFlip): the retry adopts the promotion that landed instead of calling
/// it a fence violation (the stored record's role differs from the writer's last one).
#[tokio::test]
async fn a_promotion_whose_answer_was_lost_is_adopted() {
    let Fixture { target, key, timeout, .. } = setup(Duration::from_secs(1)).await;
    let (proxies, through) = through_proxy(&target).await;
    let mut writer =
        FencedWriter::claim(through.kv_client(), key.clone(), Observed::Absent, record(10), timeout)
            .await
            .unwrap();
    proxies.delay(Duration::from_millis(1_500));
    let promoted = writer.record().promoted();
    let first = writer.commit(Vec::new(), Some(promoted.clone())).await;
    assert!(matches!(first, Err(FenceError::Etcd(_))), "the answer is lost: {first:?}");
    let mut kv = target.client().await.unwrap().kv_client();
    let started = tokio::time::Instant::now();
    loop {
        let stored = read_checkpoint(&mut kv, &key, Duration::from_secs(5)).await.unwrap();
        if matches!(&stored, Observed::Present { record, .. } if record.role == Role::Primary) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "the promotion never landed: {stored:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proxies.heal();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let retried = writer.commit(Vec::new(), Some(promoted)).await;
    assert!(retried.is_ok(), "the retry adopts the landed promotion: {retried:?}");
    assert_eq!((writer.record().role, writer.record().watermark), (Role::Primary, 10));
}

/// A claim planned from a read that the running writer has since moved past fails with
/// `Raced` (the engine plans again from a fresh read) instead of writing its stale plan: it
/// used to retry with the old record and rewind the checkpoint below data already applied
/// (found by `harness chaos --seed 42`, a fence bump under churn).
#[tokio::test]
async fn a_claim_never_rewinds_a_moving_checkpoint() {
    let Fixture { target: _target, client, key, timeout } = setup(Duration::from_secs(5)).await;
    let mut running =
        FencedWriter::claim(client.kv_client(), key.clone(), Observed::Absent, record(10), timeout)
            .await
            .unwrap();
    let stale = read_checkpoint(&mut client.kv_client(), &key, timeout).await.unwrap();
    running.commit(Vec::new(), Some(record(11))).await.unwrap();

    let mut planned = record(10);
    planned.epoch = 2;
    let outcome = FencedWriter::claim(client.kv_client(), key.clone(), stale, planned, timeout).await;
    assert!(
        matches!(outcome, Err(FenceError::Raced)),
        "{:?}",
        outcome.as_ref().map(|w| w.record().watermark)
    );
    let now = read_checkpoint(&mut client.kv_client(), &key, timeout).await.unwrap();
    let Observed::Present { record: stored, .. } = now else { panic!("no checkpoint") };
    assert_eq!((stored.watermark, stored.epoch), (11, 1), "nothing rewound");
}

/// The same lost answer, but the retry carries another batch (rebuilt after re-watching the
/// source): the writer reports `Raced` (the engine resumes from the checkpoint as it stands)
/// instead of `EpochRegressed`, which would park it in standby behind its own write.
#[tokio::test]
async fn a_landed_commit_under_another_batch_is_a_race_not_a_regression() {
    let Fixture { target, key, timeout, .. } = setup(Duration::from_secs(1)).await;
    let (proxies, mut writer) = landed_with_its_answer_lost(&target, &key, timeout).await;
    proxies.heal();
    // Let the delay line drain what it still holds (the lost answer, the cancellation).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let other_batch = writer.commit(put("rebuilt"), Some(record(25))).await;
    assert!(matches!(other_batch, Err(FenceError::Raced)), "{other_batch:?}");
}

/// Two answers lost in a row, the first attempt landed and the second (another batch) failed its
/// compare unseen: the third try must still know the stored record as this writer's own and
/// report `Raced`. The writer remembered only its last unsettled attempt, so it called its own
/// first write `EpochRegressed` and parked in standby (found by
/// `harness/scenarios/target-leader-loss.toml`: a Txn to the killed leader landed, then the
/// retry's answer was lost while the new leader was elected).
#[tokio::test]
async fn a_landed_commit_is_ours_after_more_lost_answers() {
    let Fixture { target, key, timeout, .. } = setup(Duration::from_secs(1)).await;
    let (proxies, mut writer) = landed_with_its_answer_lost(&target, &key, timeout).await;
    let second = writer.commit(put("second"), Some(record(25))).await;
    assert!(matches!(second, Err(FenceError::Etcd(_))), "this answer is lost too: {second:?}");
    proxies.heal();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let third = writer.commit(put("third"), Some(record(30))).await;
    assert!(matches!(third, Err(FenceError::Raced)), "{third:?}");
}

/// One put of `/f/{k}`.
fn put(k: &str) -> Vec<etcd_client::TxnOp> {
    vec![etcd_client::TxnOp::put(format!("/f/{k}"), "1", None)]
}

/// A writer claimed through fault proxies whose first commit (`put("first")`, watermark 20)
/// landed but lost its answer: every chunk is held 1.5 s, so the request times out here but
/// reaches etcd. The proxies still delay.
async fn landed_with_its_answer_lost(
    target: &EtcdCluster,
    key: &[u8],
    timeout: Duration,
) -> (harness::Proxies, FencedWriter) {
    let (proxies, through) = through_proxy(target).await;
    let mut writer =
        FencedWriter::claim(through.kv_client(), key.to_vec(), Observed::Absent, record(10), timeout)
            .await
            .unwrap();
    proxies.delay(Duration::from_millis(1_500));
    let first = writer.commit(put("first"), Some(record(20))).await;
    assert!(matches!(first, Err(FenceError::Etcd(_))), "the answer is lost: {first:?}");
    wait_for_watermark(target, key, 20).await;
    (proxies, writer)
}

/// Waits (reading the target directly) until the delayed commit of `watermark` has landed:
/// every chunk through the proxy is held, so it arrives seconds after its timeout.
async fn wait_for_watermark(target: &EtcdCluster, key: &[u8], watermark: i64) {
    let mut kv = target.client().await.unwrap().kv_client();
    let started = tokio::time::Instant::now();
    loop {
        let stored = read_checkpoint(&mut kv, key, Duration::from_secs(5)).await.unwrap();
        if matches!(&stored, Observed::Present { record, .. } if record.watermark == watermark) {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "the timed-out commit never landed: {stored:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
