//! The fenced applier (`mirror_fence::Applier`) against real etcd, with an [`Owner`] that
//! records what it is told: independent ops laid out to the target's limits (nested deeper for
//! a lower `--max-txn-ops`, split in halves for a lower `--max-request-bytes`, a value too large
//! even alone named), a write retried through a target that does not answer, and a stop that
//! ends the wait. The engine's own use of it is covered by the scenarios (`big-values`,
//! `target-paused`, ...); here the component answers alone.

use std::time::Duration;

use etcd_client::TxnOp;
use harness::{ClusterSpec, EtcdCluster, EtcdVersion};
use mirror_core::{ErrorClass, EtcdError, HumanDuration, Op, SyncSection, ThrottleState};
use mirror_fence::{
    Applier, Checkpoint, FenceError, FencedWriter, Observed, OnWriteError, Owner, Role, Stop,
};
use tokio_util::sync::CancellationToken;

/// How a write the recorder owns ended without landing (its fields are read by the
/// assertions' `Debug` output only).
#[derive(Debug)]
#[allow(dead_code)]
enum Failed {
    Etcd(EtcdError),
    Fence(FenceError),
    Stop(Stop),
}

impl From<EtcdError> for Failed {
    fn from(e: EtcdError) -> Failed {
        Failed::Etcd(e)
    }
}

impl From<FenceError> for Failed {
    fn from(e: FenceError) -> Failed {
        Failed::Fence(e)
    }
}

impl From<Stop> for Failed {
    fn from(e: Stop) -> Failed {
        Failed::Stop(e)
    }
}

/// An owner that writes every op as it is and records what the applier tells it.
#[derive(Default)]
struct Recorder {
    /// Each landing: data ops, the watermark the fence then held, whether tries failed first.
    landed: Vec<(usize, i64, bool)>,
    /// Each failed try: its class and what the applier does next.
    retries: Vec<(ErrorClass, OnWriteError)>,
    /// Each batch sent behind others that landed: its last revision.
    sent_landed: Vec<i64>,
}

impl Owner for Recorder {
    type Error = Failed;

    async fn txn_ops(&mut self, ops: &[Op]) -> Result<Vec<TxnOp>, Failed> {
        Ok(ops.iter().map(|op| op.to_txn_op_with(|_| false)).collect())
    }

    async fn lease_not_found(&mut self, _ops: &[Op]) -> Result<(), Failed> {
        Ok(())
    }

    fn tls_changed(&self) -> bool {
        false
    }

    fn redact(&self, key: &[u8]) -> String {
        format!("<{} bytes>", key.len())
    }

    fn landed(&mut self, ops: usize, _took: Duration, record: &Checkpoint, recovered: bool) {
        self.landed.push((ops, record.watermark, recovered));
    }

    fn retrying(&mut self, _err: &EtcdError, class: ErrorClass, retry: &OnWriteError) {
        self.retries.push((class, *retry));
    }

    fn revisions_landed(&mut self, _revisions: usize, last: i64, _ops: usize) {
        self.sent_landed.push(last);
    }
}

fn record(watermark: i64) -> Checkpoint {
    Checkpoint {
        link_uid: "applier".into(),
        epoch: 1,
        role: Role::Mirror,
        watermark,
        scanning: false,
        scan_cursor: Vec::new(),
        prune_pending: false,
        source_cluster_id: 1,
        target_cluster_id: 2,
        agent_id: "applier/1".into(),
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

/// `n` puts of `value_bytes` each, at `/a/NAME-0000` and on.
fn puts(name: &str, n: usize, value_bytes: usize) -> Vec<Op> {
    let put = |i| Op::Put {
        key: format!("/a/{name}-{i:04}").into_bytes(),
        value: vec![b'v'; value_bytes],
        lease: 0,
    };
    (0..n).map(put).collect()
}

/// The checkpoint key of these tests.
const CHECKPOINT: &[u8] = b"/a/\0etcd-mirror/checkpoint";

/// An applier holding the fence of `client`'s cluster at watermark 10, with short backoff.
async fn applier(client: &etcd_client::Client, shutdown: CancellationToken) -> Applier {
    applier_sending(client, shutdown, 1).await
}

/// [`applier`] that keeps up to `in_flight` Txns on their way ([`Applier::send`]).
async fn applier_sending(
    client: &etcd_client::Client,
    shutdown: CancellationToken,
    in_flight: i64,
) -> Applier {
    let key = CHECKPOINT.to_vec();
    let writer =
        FencedWriter::claim(client.kv_client(), key, Observed::Absent, record(10), Duration::from_secs(1))
            .await
            .unwrap();
    let mut sync = SyncSection::default();
    sync.backoff.initial = HumanDuration(Duration::from_millis(100));
    sync.backoff.max = HumanDuration(Duration::from_millis(400));
    sync.txns_in_flight = in_flight;
    Applier::new(writer, sync, ThrottleState::default(), shutdown)
}

async fn count(client: &mut etcd_client::Client) -> i64 {
    let all = etcd_client::GetOptions::new().with_prefix().with_count_only();
    client.get("/a/", Some(all)).await.unwrap().count() - 1
}

/// A target with 16 ops per level and 64 KiB per request: 100 small puts land by nesting deeper
/// (the applier's limit halves until it fits), 12 puts of 20 KiB by halving the batch, and each
/// moved the checkpoint with its last part; a single 100 KiB value is refused, named, with
/// nothing written.
#[tokio::test]
async fn independent_ops_are_laid_out_to_the_target_s_limits() {
    let spec =
        ClusterSpec::new(EtcdVersion::V3_5_30).arg("--max-txn-ops=16").arg("--max-request-bytes=65536");
    let target = EtcdCluster::start(spec).await.unwrap();
    let mut client = target.client().await.unwrap();
    let mut applier = applier(&client, CancellationToken::new()).await;
    let mut owner = Recorder::default();

    applier.commit_independent(&puts("small", 100, 8), record(11), &mut owner).await.unwrap();
    assert!(applier.max_txn_ops() <= 16, "nested deeper: {} ops per level", applier.max_txn_ops());
    assert_eq!(count(&mut client).await, 100);
    assert_eq!(applier.record().watermark, 11);

    let big = puts("big", 12, 20 << 10);
    let landed_before = owner.landed.len();
    applier.commit_independent(&big, record(12), &mut owner).await.unwrap();
    assert_eq!(count(&mut client).await, 112);
    let parts = &owner.landed[landed_before..];
    assert!(parts.len() >= 4, "12 x 20 KiB in 64 KiB requests: at least four Txns, {parts:?}");
    assert_eq!(parts.iter().map(|(ops, _, _)| ops).sum::<usize>(), 12, "every op landed once: {parts:?}");
    assert!(
        parts[..parts.len() - 1].iter().all(|(_, w, _)| *w == 11),
        "the halves before keep 11: {parts:?}"
    );
    assert_eq!(parts.last().map(|(_, w, _)| *w), Some(12), "the last part moves the checkpoint");

    let huge = vec![Op::Put { key: b"/a/huge".to_vec(), value: vec![b'x'; 100 << 10], lease: 0 }];
    let refused = applier.commit_independent(&huge, record(13), &mut owner).await;
    match refused {
        Err(Failed::Stop(Stop::ValueTooLarge { key, bytes, .. })) => {
            assert_eq!(key, "<7 bytes>", "named as the owner redacts it");
            assert!(bytes > 100 << 10);
        }
        other => panic!("a value too large even alone is refused: {other:?}"),
    }
    assert_eq!(count(&mut client).await, 112, "nothing of it written");
    assert_eq!(applier.record().watermark, 12);
    assert!(owner.retries.is_empty(), "a refusal as too large is not retried: {:?}", owner.retries);
}

/// A target with 8 ops per level, the applier at etcd's default of 128: 952 independent puts
/// (a scan chunk cut for 128, the engine's chunk size there) no layout at 16 per level holds,
/// so they are halved as the limit halves, and every op lands once. Before, nesting deeper
/// stopped at 16 with a permanent "952 ops do not fit one Txn with max_txn_ops 16"
/// (scenario `low-max-txn-ops`: the initial sync never ended).
#[tokio::test]
async fn a_chunk_cut_for_a_higher_limit_is_split_to_the_target_s() {
    let target =
        EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30).arg("--max-txn-ops=8")).await.unwrap();
    let mut client = target.client().await.unwrap();
    let mut applier = applier(&client, CancellationToken::new()).await;
    let mut owner = Recorder::default();
    let chunk = puts("chunk", 952, 8);
    assert_eq!(mirror_fence::nested_txn_capacity(128), chunk.len(), "a whole chunk at 128 per level");
    applier.commit_independent(&chunk, record(11), &mut owner).await.unwrap();
    assert!(applier.max_txn_ops() <= 8, "nested deeper: {} ops per level", applier.max_txn_ops());
    assert_eq!(count(&mut client).await, 952);
    assert_eq!(owner.landed.iter().map(|(ops, _, _)| ops).sum::<usize>(), 952, "every op landed once");
    assert!(owner.landed.len() > 1, "split: {:?}", owner.landed);
    assert_eq!(applier.record().watermark, 11);
    assert!(owner.retries.is_empty(), "a layout refusal is not retried: {:?}", owner.retries);
}

/// A target that does not answer: every try fails as transient and is retried on the backoff,
/// the third round says the target is unreachable (degrade, drop the watch); once it answers,
/// the write lands and the owner hears it recovered. A stop during a wait ends the write at
/// once with `Stop::Shutdown`, nothing landed.
#[tokio::test]
async fn a_write_is_retried_until_the_target_answers_and_a_stop_ends_the_wait() {
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let proxies = target.proxies().await.unwrap();
    let through = etcd_client::Client::connect(proxies.endpoints(), None).await.unwrap();
    let shutdown = CancellationToken::new();
    let mut applier = applier(&through, shutdown.clone()).await;
    let mut owner = Recorder::default();

    proxies.cut();
    let heal = async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        proxies.heal();
    };
    let one = puts("one", 1, 8);
    let (landed, ()) = tokio::join!(applier.commit(&one, record(11), &mut owner), heal);
    landed.unwrap();
    assert!(owner.retries.len() >= 3, "{:?}", owner.retries);
    assert!(owner.retries.iter().all(|(class, _)| *class == ErrorClass::Transient), "{:?}", owner.retries);
    let third = owner.retries[2].1;
    assert!(
        matches!(third, OnWriteError::Retry { drop_watch: true, degrade: true, raise: Some(_), .. }),
        "the third round: {third:?}"
    );
    assert_eq!(owner.landed, vec![(1, 11, true)], "landed once, after failed tries");

    proxies.cut();
    let stop = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        shutdown.cancel();
    };
    let two = puts("two", 1, 8);
    let (stopped, ()) = tokio::join!(applier.commit(&two, record(12), &mut owner), stop);
    assert!(matches!(stopped, Err(Failed::Stop(Stop::Shutdown))), "{stopped:?}");
    assert_eq!(owner.landed.len(), 1, "nothing more landed");
    proxies.heal();
}

/// Batch `i` of the tests of Txns in flight: a put of the key `/a/seq` (each batch overwrites
/// it) and one of a key of its own, `/a/k-i`.
fn batch(i: i64) -> Vec<Op> {
    let put =
        |key: String, value: String| Op::Put { key: key.into_bytes(), value: value.into_bytes(), lease: 0 };
    vec![put("/a/seq".into(), i.to_string()), put(format!("/a/k-{i:04}"), i.to_string())]
}

/// The checkpoint record stored on the target.
async fn stored(client: &mut etcd_client::Client) -> Checkpoint {
    let resp = client.get(CHECKPOINT, None).await.unwrap();
    Checkpoint::decode(resp.kvs()[0].value()).unwrap()
}

/// `sync.txns_in_flight = 4`: 400 batches sent behind one another, each landing only after the
/// one before (its Txn compares the checkpoint with what that one stores). etcd runs a good
/// share of concurrent Txns out of order (SPEC §11: 25-50 % with four in flight); each of those
/// fails its compare and is sent again in order. So every batch lands once and in order: the
/// key each batch overwrites holds the last one's value, each batch's own key a mod revision
/// above the one before's, the checkpoint the last watermark, and the owner heard every
/// landing once, in order.
#[tokio::test]
async fn txns_sent_behind_one_another_land_once_and_in_order() {
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut client = target.client().await.unwrap();
    let mut applier = applier_sending(&client, CancellationToken::new(), 4).await;
    let mut owner = Recorder::default();
    let mut most = 0;
    for i in 11..=410 {
        applier.send(&batch(i), record(i), 1, &mut owner).await.unwrap();
        most = most.max(applier.in_flight());
    }
    assert_eq!(most, 4, "up to four on their way");
    applier.drain(&mut owner).await.unwrap();
    assert_eq!(applier.in_flight(), 0);
    assert_eq!(owner.sent_landed, (11..=410).collect::<Vec<_>>(), "every landing heard once, in order");
    assert_eq!(applier.record().watermark, 410);
    assert_eq!(stored(&mut client).await.watermark, 410);
    let seq = client.get("/a/seq", None).await.unwrap();
    assert_eq!(seq.kvs()[0].value(), b"410", "the last batch's put is the last write of the key");
    assert_eq!(seq.kvs()[0].version(), 400, "each batch put it once");
    let all = etcd_client::GetOptions::new().with_prefix();
    let keys = client.get("/a/k-", Some(all)).await.unwrap();
    let revisions: Vec<i64> = keys.kvs().iter().map(|kv| kv.mod_revision()).collect();
    assert_eq!(revisions.len(), 400);
    assert!(revisions.windows(2).all(|w| w[0] < w[1]), "batches landed in the order sent");
    assert!(owner.retries.is_empty(), "sent again in order, never retried as failed: {:?}", owner.retries);
}

/// Another writer takes the checkpoint (a newer epoch) while two batches are on their way
/// behind one another: the first fails its mod-revision compare, the one behind it its value
/// compare, nothing of either lands, and the applier says the fence is lost.
#[tokio::test]
async fn a_foreign_checkpoint_write_stops_every_txn_in_flight() {
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut client = target.client().await.unwrap();
    let mut applier = applier_sending(&client, CancellationToken::new(), 2).await;
    let mut owner = Recorder::default();
    applier.send(&batch(11), record(11), 1, &mut owner).await.unwrap();
    applier.send(&batch(12), record(12), 1, &mut owner).await.unwrap();
    applier.drain(&mut owner).await.unwrap();
    assert_eq!(owner.sent_landed, vec![11, 12]);

    let newer = Checkpoint { epoch: 2, agent_id: "other/1".into(), ..record(12) };
    client.put(CHECKPOINT, newer.encode().unwrap(), None).await.unwrap();
    applier.send(&batch(13), record(13), 1, &mut owner).await.unwrap();
    applier.send(&batch(14), record(14), 1, &mut owner).await.unwrap();
    let stopped = applier.drain(&mut owner).await;
    assert!(
        matches!(stopped, Err(Failed::Fence(FenceError::FencedByNewerEpoch { stored: 2, ours: 1 }))),
        "{stopped:?}"
    );
    let all = etcd_client::GetOptions::new().with_prefix().with_count_only();
    assert_eq!(client.get("/a/k-0013", Some(all.clone())).await.unwrap().count(), 0, "nothing of 13");
    assert_eq!(client.get("/a/k-0014", Some(all)).await.unwrap().count(), 0, "nothing of 14");
    assert_eq!(stored(&mut client).await.epoch, 2, "the other writer's record stands");
    assert_eq!(owner.sent_landed, vec![11, 12]);
}
