//! The replication engine against real etcd, driven through the `mirror-agent` binary.
//!
//! What a scenario file can say lives in `harness/scenarios/` (kill -9 mid-batch, compaction
//! mid-scan, mixed versions moved there). The tests left here assert what a file cannot:
//! exact watermarks and checkpoint fields, target mod revisions (atomicity), that the target
//! revision did not move, HTTP probe codes, a rewound checkpoint, a restart with other etcd
//! flags.

use std::time::Duration;

use etcd_client::{Client, GetOptions};
use harness::scenario::{self, SYNC_TIMEOUT};
use harness::{check_g3, load_keys, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion, G3};
use mirror_core::{Phase, Reason};

mod genesis;
mod leases;
mod writes;

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
    scenario::g3_of(&pair.source, &pair.target, cfg).await
}

async fn synced(agent: &AgentProcess) -> mirror_core::Status {
    scenario::synced(agent).await.unwrap()
}

async fn count(client: &mut Client, prefix: &str) -> i64 {
    scenario::count_prefix(client, prefix).await.unwrap()
}

/// Cold start: 50k keys land, the watermark equals R0, and the only extra target key is the
/// reserved checkpoint.
#[tokio::test]
async fn cold_start_lands_every_key() {
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
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

async fn caught_up(agent: &AgentProcess, src: &mut Client) -> mirror_core::Status {
    scenario::caught_up(agent, src).await.unwrap()
}

/// See [`scenario::FAST_SYNC_TOML`].
fn fast_progress(cfg: AgentConfig) -> AgentConfig {
    cfg.with(scenario::FAST_SYNC_TOML)
}

/// Live tail: a multi-key source Txn lands as one target Txn; puts, overwrites, deletes and
/// range deletes land; G3 holds at every check during a steady write load.
#[tokio::test]
async fn live_tail_keeps_revisions_atomic_and_g3() {
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
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
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
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

/// A scan stopped part way and resumed after its cursor reports the whole sync's progress:
/// `initial_sync.total_keys` is the range at R0 and `initial_sync.keys` starts from the keys
/// the stopped run already copied, so both read 6 000 at completion (they read 0 and this
/// run's keys only before). The stopped run's progress moved with each paced Txn, before any
/// span ended.
#[tokio::test]
async fn a_resumed_scan_counts_what_the_stopped_run_copied() {
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
    let (mut src, mut dst) = pair.clients().await;
    load_keys(&mut src, "/s/", 6_000, 16).await.unwrap();
    // Paced: a 500-key Txn a second; a span (the cursor) ends after 5 s.
    let cfg = pair.config("resumed", "/s/").with("[sync]\nmax_ops_per_second = 500");
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    let first = agent.wait_for("a Txn landed", SYNC_TIMEOUT, |s| s.initial_sync.keys >= 500).await.unwrap();
    let key = cfg.parsed().unwrap().checkpoint_key();
    assert!(stored_cursor(&mut dst, &key).await.is_empty(), "progress before the first span end: {first:#?}");
    let deadline = tokio::time::Instant::now() + SYNC_TIMEOUT;
    while stored_cursor(&mut dst, &key).await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "no span ended under {key:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let part = agent.status().await.unwrap();
    assert!(part.initial_sync.completed.is_none(), "stopped before the scan ended: {part:#?}");
    assert_eq!(agent.terminate().await.unwrap(), Some(0));

    agent.restart().await.unwrap();
    let status = synced(&agent).await;
    let reason =
        status.conditions.iter().find(|c| c.type_ == mirror_core::ConditionType::InitialSyncComplete);
    assert_eq!(reason.map(|c| c.reason.as_str()), Some("Complete"), "a finished scan, not a resumed tail");
    assert_eq!((status.initial_sync.keys, status.initial_sync.total_keys), (6_000, 6_000), "{status:#?}");
    assert!(matches!(g3(&pair, &cfg).await.unwrap(), G3::Holds { keys: 6_000, .. }));
}

/// The `scan_cursor` of the checkpoint under `key` on the target (empty before one is stored).
async fn stored_cursor(dst: &mut Client, key: &[u8]) -> Vec<u8> {
    let resp = dst.get(key, None).await.unwrap();
    let record = resp.kvs().first().map(|kv| mirror_fence::Checkpoint::decode(kv.value()).unwrap());
    record.map(|r| r.scan_cursor).unwrap_or_default()
}
