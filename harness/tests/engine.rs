//! The replication engine against real etcd, driven through the `mirror-agent` binary.

use std::time::Duration;

use etcd_client::{Client, GetOptions};
use harness::{check_g3, load_keys, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion, G3};
use mirror_core::Phase;

const SYNC_TIMEOUT: Duration = Duration::from_secs(120);

struct Pair {
    source: EtcdCluster,
    target: EtcdCluster,
}

impl Pair {
    async fn start(source: EtcdVersion, target: EtcdVersion) -> Pair {
        Pair {
            source: EtcdCluster::start(ClusterSpec::new(source)).await.unwrap(),
            target: EtcdCluster::start(ClusterSpec::new(target)).await.unwrap(),
        }
    }

    fn config(&self, link: &str, prefix: &str) -> AgentConfig {
        AgentConfig::new(link, self.source.endpoints(), self.target.endpoints(), prefix)
    }

    async fn clients(&self) -> (Client, Client) {
        (self.source.client().await.unwrap(), self.target.client().await.unwrap())
    }
}

async fn g3(pair: &Pair, cfg: &AgentConfig) -> anyhow::Result<G3> {
    let parsed = cfg.parsed()?;
    let (mut s, mut t) = pair.clients().await;
    check_g3(&mut s, &mut t, &parsed.rewriter(), &parsed.checkpoint_key()).await
}

async fn synced(agent: &AgentProcess) -> mirror_core::Status {
    agent
        .wait_for("InitialSyncComplete", SYNC_TIMEOUT, |s| {
            s.phase == Phase::Syncing && s.condition("InitialSyncComplete")
        })
        .await
        .unwrap()
}

async fn count(client: &mut Client, prefix: &str) -> i64 {
    client.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await.unwrap().count()
}

/// Cold start: 50k keys land, the watermark equals R0, and the only extra target key is the
/// reserved checkpoint.
#[tokio::test]
async fn cold_start_lands_every_key() {
    let pair = Pair::start(EtcdVersion::V3_5_1, EtcdVersion::V3_5_1).await;
    let (mut src, mut dst) = pair.clients().await;
    let r0 = load_keys(&mut src, "/reg/", 50_000, 32).await.unwrap();
    let cfg = pair.config("cold", "/reg/");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = synced(&agent).await;
    assert_eq!(status.watermark, r0, "watermark must equal R0 on an idle source");
    assert_eq!(status.initial_sync.total_keys, 50_000);
    assert_eq!(count(&mut dst, "/reg/").await, 50_001, "50k keys plus the checkpoint");
    let cp = cfg.parsed().unwrap().checkpoint_key();
    let stored = dst.get(cp, None).await.unwrap();
    let record = mirror_fence::Checkpoint::decode(stored.kvs()[0].value()).unwrap();
    assert_eq!(record.watermark, r0);
    assert!(!record.scanning);
    assert_eq!(g3(&pair, &cfg).await.unwrap(), G3::Holds { watermark: r0, keys: 50_000 });
}

/// Waits until the agent's watermark reaches the source's current revision.
async fn caught_up(agent: &AgentProcess, src: &mut Client) -> mirror_core::Status {
    let rev =
        src.get("/", Some(GetOptions::new().with_count_only())).await.unwrap().header().unwrap().revision();
    agent.wait_for(&format!("watermark >= {rev}"), SYNC_TIMEOUT, |s| s.watermark >= rev).await.unwrap()
}

fn fast_progress(cfg: AgentConfig) -> AgentConfig {
    cfg.with("[sync]\nprogress_interval = \"1s\"\ntrust_progress_notify = \"always\"\nbackoff = { initial = \"200ms\", max = \"2s\" }")
}

/// Live tail: a multi-key source Txn lands as one target Txn; puts, overwrites, deletes and
/// range deletes land; G3 holds at every check during a steady write load.
#[tokio::test]
async fn live_tail_keeps_revisions_atomic_and_g3() {
    let pair = Pair::start(EtcdVersion::V3_5_1, EtcdVersion::V3_5_1).await;
    let (mut src, mut dst) = pair.clients().await;
    let cfg = fast_progress(pair.config("tail", "/t/"));
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;

    // One source Txn of three puts.
    let ops: Vec<etcd_client::TxnOp> =
        ["a", "b", "c"].iter().map(|k| etcd_client::TxnOp::put(format!("/t/multi/{k}"), "1", None)).collect();
    src.txn(etcd_client::Txn::new().and_then(ops)).await.unwrap();
    // Overwrite, delete, range delete.
    src.put("/t/over", "old", None).await.unwrap();
    src.put("/t/over", "new", None).await.unwrap();
    src.put("/t/gone", "x", None).await.unwrap();
    src.delete("/t/gone", None).await.unwrap();
    for i in 0..5 {
        src.put(format!("/t/range/{i}"), "r", None).await.unwrap();
    }
    src.delete("/t/range/", Some(etcd_client::DeleteOptions::new().with_prefix())).await.unwrap();
    caught_up(&agent, &mut src).await;

    let multi = dst.get("/t/multi/", Some(GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(multi.kvs().len(), 3);
    let revs: std::collections::HashSet<i64> = multi.kvs().iter().map(|kv| kv.mod_revision()).collect();
    assert_eq!(revs.len(), 1, "the three keys of one source revision share one target revision");
    assert_eq!(dst.get("/t/over", None).await.unwrap().kvs()[0].value(), b"new");
    assert_eq!(count(&mut dst, "/t/gone").await, 0);
    assert_eq!(count(&mut dst, "/t/range/").await, 0);
    assert!(matches!(g3(&pair, &cfg).await.unwrap(), G3::Holds { .. }));

    // Steady load; check G3 continuously while it runs.
    let writer = {
        let mut c = src.clone();
        tokio::spawn(async move {
            for i in 0..600u32 {
                let k = format!("/t/load/{}", i % 97);
                match i % 5 {
                    0 => drop(c.delete(k, None).await),
                    1 => {
                        let ops = (0..4)
                            .map(|j| etcd_client::TxnOp::put(format!("/t/load/txn{j}"), i.to_string(), None));
                        drop(c.txn(etcd_client::Txn::new().and_then(ops.collect::<Vec<_>>())).await)
                    }
                    _ => drop(c.put(k, i.to_string(), None).await),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let mut checks = 0;
    while !writer.is_finished() {
        match g3(&pair, &cfg).await {
            Ok(G3::Holds { .. }) => checks += 1,
            Ok(G3::NotYet) => panic!("initial sync flag came back during the tail"),
            Err(e) => panic!("G3 violated under load: {e:#}"),
        }
    }
    writer.await.unwrap();
    assert!(checks >= 3, "only {checks} checks ran during the load");
    caught_up(&agent, &mut src).await;
    assert!(matches!(g3(&pair, &cfg).await.unwrap(), G3::Holds { .. }));
}

/// SIGTERM exits 0; a restart resumes from the watermark without rescanning and catches up
/// with writes made while it was down.
#[tokio::test]
async fn restart_resumes_without_rescan() {
    let pair = Pair::start(EtcdVersion::V3_5_1, EtcdVersion::V3_5_1).await;
    let (mut src, _dst) = pair.clients().await;
    load_keys(&mut src, "/r/", 2_000, 16).await.unwrap();
    let cfg = fast_progress(pair.config("resume", "/r/"));
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    assert_eq!(agent.terminate().await.unwrap(), Some(0), "SIGTERM is a clean exit");

    src.put("/r/while-down", "1", None).await.unwrap();
    src.delete("/r/key-00000007", None).await.unwrap();
    agent.restart().await.unwrap();
    let status = synced(&agent).await;
    assert_eq!(status.initial_sync.keys, 0, "a resumed agent scans nothing");
    caught_up(&agent, &mut src).await;
    assert!(matches!(g3(&pair, &cfg).await.unwrap(), G3::Holds { keys: 2_000, .. }));
}

/// kill -9 in the middle of the scan and again in the middle of tail batches: after restarts
/// nothing is lost or duplicated and G3 holds.
#[tokio::test]
async fn kill9_mid_batch_loses_nothing() {
    let pair = Pair::start(EtcdVersion::V3_5_1, EtcdVersion::V3_5_1).await;
    let (mut src, mut dst) = pair.clients().await;
    load_keys(&mut src, "/k/", 20_000, 64).await.unwrap();
    let cfg = fast_progress(pair.config("kill", "/k/")).with("max_txn_ops = 16\npage_key_limit = 64");
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    agent.wait_for("scan under way", SYNC_TIMEOUT, |s| s.initial_sync.keys > 2_000).await.unwrap();
    agent.kill9().await.unwrap();
    let cp = cfg.parsed().unwrap().checkpoint_key();
    let record =
        mirror_fence::Checkpoint::decode(dst.get(cp.clone(), None).await.unwrap().kvs()[0].value()).unwrap();
    assert!(record.scanning && !record.scan_cursor.is_empty(), "killed mid-scan with a cursor: {record:?}");

    agent.restart().await.unwrap();
    synced(&agent).await;

    // Kill again while multi-key revisions stream in.
    let writer = {
        let mut c = src.clone();
        tokio::spawn(async move {
            for i in 0..300u32 {
                let ops =
                    (0..8).map(|j| etcd_client::TxnOp::put(format!("/k/burst/{j}"), i.to_string(), None));
                c.txn(etcd_client::Txn::new().and_then(ops.collect::<Vec<_>>())).await.unwrap();
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    agent.kill9().await.unwrap();
    writer.await.unwrap();
    agent.restart().await.unwrap();
    caught_up(&agent, &mut src).await;
    assert!(matches!(g3(&pair, &cfg).await.unwrap(), G3::Holds { .. }));
    assert_eq!(count(&mut dst, "/k/").await, count(&mut src, "/k/").await + 1);
}

/// Aggressive compaction while 50k keys are scanned: the unpinned scan converges with no
/// forced resync.
#[tokio::test]
async fn compaction_mid_scan_converges() {
    let pair = Pair::start(EtcdVersion::V3_5_1, EtcdVersion::V3_5_1).await;
    let (mut src, _dst) = pair.clients().await;
    load_keys(&mut src, "/c/", 50_000, 16).await.unwrap();
    let cfg = fast_progress(pair.config("compact", "/c/")).with("max_txn_ops = 32\npage_key_limit = 128");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let churn = {
        let mut c = src.clone();
        tokio::spawn(async move {
            for i in 0..200u32 {
                let resp =
                    c.put(format!("/c/key-{:08}", (i * 251) % 50_000), i.to_string(), None).await.unwrap();
                if i % 10 == 0 {
                    c.compact(resp.header().unwrap().revision(), None).await.unwrap();
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let status = synced(&agent).await;
    churn.await.unwrap();
    caught_up(&agent, &mut src).await;
    assert!(matches!(g3(&pair, &cfg).await.unwrap(), G3::Holds { keys: 50_000, .. }));
    assert_eq!(status.forced_resyncs.count, 0, "compaction mid-scan must not force a resync");
}
