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

/// `require_empty` on a non-empty target writes nothing and reports `EmptyTargetViolation`.
#[tokio::test]
async fn require_empty_refuses_a_non_empty_target() {
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
    let (mut src, mut dst) = pair.clients().await;
    load_keys(&mut src, "/e/", 100, 8).await.unwrap();
    dst.put("/e/already-here", "x", None).await.unwrap();
    let before =
        dst.get("/", Some(GetOptions::new().with_count_only())).await.unwrap().header().unwrap().revision();
    let cfg = pair.config("empty", "/e/");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    assert!(status.condition(mirror_core::ConditionType::EmptyTargetViolation), "{status:#?}");
    assert_eq!(agent.http_code("/readyz").await.unwrap(), 503);
    assert_eq!(agent.http_code("/healthz").await.unwrap(), 200);
    let after =
        dst.get("/", Some(GetOptions::new().with_count_only())).await.unwrap().header().unwrap().revision();
    assert_eq!(before, after, "nothing may be written to the target");
}

/// `overwrite` keeps orphans and overwrites conflicts; `overwrite_and_prune` removes orphans.
#[tokio::test]
async fn overwrite_modes_treat_orphans_as_configured() {
    for (mode, orphan_survives) in [("overwrite", true), ("overwrite_and_prune", false)] {
        let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
        let (mut src, mut dst) = pair.clients().await;
        load_keys(&mut src, "/o/", 300, 8).await.unwrap();
        dst.put("/o/key-00000001", "stale", None).await.unwrap();
        dst.put("/o/orphan", "only-in-target", None).await.unwrap();
        let cfg =
            fast_progress(pair.config("overwrite", "/o/")).with(&format!("[initial_sync]\nmode = {mode:?}"));
        let agent = AgentProcess::start(&cfg).await.unwrap();
        synced(&agent).await;
        assert_eq!(dst.get("/o/key-00000001", None).await.unwrap().kvs()[0].value(), b"vvvvvvvv");
        assert_eq!(count(&mut dst, "/o/orphan").await == 1, orphan_survives, "mode {mode}");
        if !orphan_survives {
            assert!(matches!(g3(&pair, &cfg).await.unwrap(), G3::Holds { keys: 300, .. }));
        }
    }
}

/// A rebuilt source (another cluster id) in `overwrite` mode is a forced resync with prune
/// (SPEC §6, issue #20 defect 1): keys the old source held and the new one does not are gone from
/// the target once `InitialSyncComplete` is claimed again, and the resync is counted as
/// `ClusterChanged`.
#[tokio::test]
async fn a_rebuilt_source_is_a_forced_resync_with_prune() {
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
    let (mut src, mut dst) = pair.clients().await;
    load_keys(&mut src, "/rb/", 200, 8).await.unwrap();
    let cfg = fast_progress(pair.config("rebuilt", "/rb/")).with("[initial_sync]\nmode = \"overwrite\"");
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    assert_eq!(agent.terminate().await.unwrap(), Some(0));

    // The source is rebuilt from a backup that lacks the last 50 keys: a new cluster.
    let rebuilt = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut new_src = rebuilt.client().await.unwrap();
    load_keys(&mut new_src, "/rb/", 150, 8).await.unwrap();
    let cfg =
        fast_progress(AgentConfig::new("rebuilt", rebuilt.endpoints(), pair.target.endpoints(), "/rb/"))
            .with("[initial_sync]\nmode = \"overwrite\"");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = synced(&agent).await;
    assert_eq!(status.forced_resyncs.count, 1, "{status:#?}");
    assert_eq!(status.forced_resyncs.last_reason, Some(Reason::ClusterChanged), "{status:#?}");
    assert_eq!(count(&mut dst, "/rb/key-").await, 150, "keys the rebuilt source lacks must be pruned");
    let got = scenario::g3_of(&rebuilt, &pair.target, &cfg).await.unwrap();
    assert!(matches!(got, G3::Holds { keys: 150, .. }), "{got:?}");
}

/// Excluded prefixes are cut out of every Get window: the source's request log (every range
/// request is logged with `--experimental-warning-apply-duration=1ns`) never shows a Get that
/// starts inside an excluded prefix, and no excluded key reaches the target. With
/// `overwrite_and_prune` (reference #15) the prune sweep reads through the same windows, and it
/// deletes an orphan of the range but never a target key under the excluded prefix.
#[rstest::rstest]
#[case::require_empty("require_empty")]
#[case::overwrite_and_prune("overwrite_and_prune")]
#[tokio::test]
async fn excluded_prefixes_are_never_fetched(#[case] mode: &str) {
    let source = EtcdCluster::start(
        ClusterSpec::new(EtcdVersion::V3_5_1).arg("--experimental-warning-apply-duration=1ns"),
    )
    .await
    .unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_1)).await.unwrap();
    let mut src = source.client().await.unwrap();
    let mut dst = target.client().await.unwrap();
    load_keys(&mut src, "/x/keep/", 500, 8).await.unwrap();
    load_keys(&mut src, "/x/secret/", 500, 8).await.unwrap();
    load_keys(&mut src, "/x/zz/", 500, 8).await.unwrap();
    let prune = mode == "overwrite_and_prune";
    if prune {
        dst.put("/x/secret/target-only", "kept", None).await.unwrap();
        dst.put("/x/orphan", "pruned", None).await.unwrap();
    }
    let cfg = fast_progress(AgentConfig::new("excl", source.endpoints(), target.endpoints(), "/x/"))
        .with("exclude_prefixes = [\"secret/\"]\npage_key_limit = 100")
        .with(&format!("[initial_sync]\nmode = {mode:?}"));
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    src.put("/x/secret/live", "no", None).await.unwrap();
    src.put("/x/keep/live", "yes", None).await.unwrap();
    caught_up(&agent, &mut src).await;
    assert_eq!(count(&mut dst, "/x/secret/").await, i64::from(prune), "only the target's own key");
    assert_eq!(count(&mut dst, "/x/keep/").await, 501);
    assert_eq!(count(&mut dst, "/x/zz/").await, 500);
    assert_eq!(count(&mut dst, "/x/orphan").await, 0);
    let log = source.nodes_log();
    let gets: Vec<&str> = log.lines().filter(|l| l.contains("read-only range")).collect();
    assert!(gets.len() > 10, "expected the source to log the agent's Gets ({} found)", gets.len());
    let inside = gets.iter().filter(|l| l.contains("key:\\\"/x/secret/")).count();
    assert_eq!(inside, 0, "{inside} Gets started inside the excluded prefix");
}

/// A second agent with a higher epoch takes over; the first goes to standby and writes nothing
/// more; a corrupt checkpoint makes an agent refuse to write.
#[tokio::test]
async fn fence_overlap_rejects_stale_writer() {
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
    let (mut src, mut dst) = pair.clients().await;
    load_keys(&mut src, "/f/", 200, 8).await.unwrap();
    let cfg1 = fast_progress(pair.config("fence", "/f/"));
    let old = AgentProcess::start(&cfg1).await.unwrap();
    synced(&old).await;

    let cfg2 = cfg1.clone().epoch(2);
    let mut new = AgentProcess::start(&cfg2).await.unwrap();
    synced(&new).await;
    src.put("/f/after-takeover", "1", None).await.unwrap();
    let status = old.wait_for("standby", SYNC_TIMEOUT, |s| s.phase == Phase::Standby).await.unwrap();
    assert!(status.condition(mirror_core::ConditionType::Fenced), "{status:#?}");
    assert_eq!(old.http_code("/readyz").await.unwrap(), 200, "standby is ready");
    caught_up(&new, &mut src).await;

    // Stop the new holder; the old one must not write anything any more.
    new.terminate().await.unwrap();
    let cp = cfg1.parsed().unwrap().checkpoint_key();
    let before = dst.get(cp.clone(), None).await.unwrap().kvs()[0].mod_revision();
    src.put("/f/after-new-stopped", "1", None).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(dst.get(cp.clone(), None).await.unwrap().kvs()[0].mod_revision(), before);
    assert_eq!(count(&mut dst, "/f/after-new-stopped").await, 0);
    assert_eq!(old.status().await.unwrap().phase, Phase::Standby);

    // A corrupt checkpoint: an agent refuses to write.
    dst.put(cp.clone(), "{not json", None).await.unwrap();
    let rev = dst.get(cp.clone(), None).await.unwrap().kvs()[0].mod_revision();
    let third = AgentProcess::start(&cfg2.clone().epoch(3)).await.unwrap();
    let status = third.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    assert_eq!(status.last_error.unwrap().reason, Reason::CorruptCheckpoint);
    assert_eq!(dst.get(cp, None).await.unwrap().kvs()[0].mod_revision(), rev);
}

/// A revision whose bytes exceed the target's request limit fails permanently, key redacted,
/// revision, op count and bytes named, nothing of it applied; earlier revisions landed. Both
/// byte bands (upstream #16), each with its own cause in the message: 20 x 8 KiB is over the
/// target's `--max-request-bytes` (64 KiB) and etcd refuses it ("request is too large"); 20 x
/// 40 KiB is also over the gRPC receive limit etcd derives from it (+ 512 KiB), and gRPC
/// refuses it before etcd sees it ("larger than max").
#[rstest::rstest]
#[case::etcd_request_limit(8 << 10, "request is too large")]
#[case::grpc_receive_limit(40 << 10, "larger than max")]
#[tokio::test]
async fn oversized_revision_fails_permanently_unapplied(#[case] value_bytes: usize, #[case] cause: &str) {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30).arg("--max-request-bytes=65536"))
        .await
        .unwrap();
    let mut src = source.client().await.unwrap();
    let cfg = fast_progress(AgentConfig::new("big", source.endpoints(), target.endpoints(), "/b/"))
        .with("txn_flush_bytes = \"32KiB\"");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    agent.wait_for("syncing", SYNC_TIMEOUT, |s| s.phase == Phase::Syncing).await.unwrap();
    src.put("/b/small", "1", None).await.unwrap();
    let ops: Vec<etcd_client::TxnOp> = (0..20)
        .map(|i| etcd_client::TxnOp::put(format!("/b/secret-name-{i:02}"), vec![b'v'; value_bytes], None))
        .collect();
    let big = src.txn(etcd_client::Txn::new().and_then(ops)).await.unwrap();
    let revision = big.header().unwrap().revision();
    let status = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    let err = status.last_error.unwrap();
    assert_eq!(err.class, mirror_core::ErrorClass::Permanent);
    assert_eq!(err.reason, Reason::RevisionTooLarge);
    assert!(err.message.contains(&format!("source revision {revision} (20 ops")), "{}", err.message);
    assert!(err.message.contains(cause), "the cause is named: {}", err.message);
    assert!(err.message.contains("/b/…"), "key must be shown redacted: {}", err.message);
    assert!(!err.message.contains("secret-name"), "key must not leak: {}", err.message);
    assert!(!agent.log().contains("secret-name"), "logs must not leak the key");
    let mut dst = target.client().await.unwrap();
    assert_eq!(count(&mut dst, "/b/small").await, 1);
    assert_eq!(count(&mut dst, "/b/secret-name-").await, 0, "nothing of the revision may land");
}

/// `sync.max_txn_ops` set above the target's `--max-txn-ops`: a revision the target refuses for
/// too many ops per level is laid out deeper and still lands as one target revision.
#[tokio::test]
async fn max_txn_ops_above_the_targets_is_laid_out_deeper() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let target =
        EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30).arg("--max-txn-ops=16")).await.unwrap();
    let mut src = source.client().await.unwrap();
    let cfg = fast_progress(AgentConfig::new("deeper", source.endpoints(), target.endpoints(), "/b/"))
        .with("max_txn_ops = 64");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    let ops: Vec<etcd_client::TxnOp> =
        (0..40).map(|i| etcd_client::TxnOp::put(format!("/b/k-{i:02}"), "v", None)).collect();
    src.txn(etcd_client::Txn::new().and_then(ops)).await.unwrap();
    caught_up(&agent, &mut src).await;
    let mut dst = target.client().await.unwrap();
    let landed = dst.get("/b/k-", Some(GetOptions::new().with_prefix())).await.unwrap();
    let revs: std::collections::HashSet<i64> = landed.kvs().iter().map(|kv| kv.mod_revision()).collect();
    assert_eq!(landed.kvs().len(), 40);
    assert_eq!(revs.len(), 1, "the revision landed as one target revision");
    assert!(agent.log().contains("above the target's --max-txn-ops"), "the target never refused");
    assert!(matches!(g3(&Pair { source, target }, &cfg).await.unwrap(), G3::Holds { .. }));
}

/// Replaying revisions already applied (the checkpoint rewound, as after an ambiguous commit)
/// changes nothing: the target still equals the source.
#[tokio::test]
async fn duplicate_replay_is_idempotent() {
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
    let (mut src, mut dst) = pair.clients().await;
    let cfg = fast_progress(pair.config("dup", "/d/"));
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    let start = synced(&agent).await.watermark;
    for i in 0..50 {
        src.put(format!("/d/{}", i % 7), i.to_string(), None).await.unwrap();
        if i % 9 == 0 {
            src.delete(format!("/d/{}", i % 5), None).await.unwrap();
        }
    }
    caught_up(&agent, &mut src).await;
    agent.terminate().await.unwrap();
    // Rewind the watermark to before all of it.
    let cp = cfg.parsed().unwrap().checkpoint_key();
    let mut record =
        mirror_fence::Checkpoint::decode(dst.get(cp.clone(), None).await.unwrap().kvs()[0].value()).unwrap();
    record.watermark = start;
    dst.put(cp, record.encode().unwrap(), None).await.unwrap();
    agent.restart().await.unwrap();
    caught_up(&agent, &mut src).await;
    assert!(matches!(g3(&pair, &cfg).await.unwrap(), G3::Holds { .. }));
}

/// A target with a tiny quota: the agent reports `TargetQuotaExhausted` and holds; after the
/// operator restarts the target with a larger quota and disarms the alarm, it resumes by itself
/// and G3 holds.
#[tokio::test]
async fn quota_exhaustion_parks_and_recovers() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut target =
        EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30).arg("--quota-backend-bytes=1048576"))
            .await
            .unwrap();
    let mut src = source.client().await.unwrap();
    let cfg = fast_progress(AgentConfig::new("quota", source.endpoints(), target.endpoints(), "/q/"));
    let agent = AgentProcess::start(&cfg).await.unwrap();
    agent.wait_for("syncing", SYNC_TIMEOUT, |s| s.phase == Phase::Syncing).await.unwrap();
    // Write until the target runs out of space (its database grows in steps, so the exact
    // amount varies).
    let value = vec![b'q'; 100 * 1024];
    let mut written = 0;
    for i in 0..400 {
        src.put(format!("/q/{i:03}"), value.clone(), None).await.unwrap();
        written += 1;
        if i % 10 == 9
            && agent.status().await.unwrap().condition(mirror_core::ConditionType::TargetQuotaExhausted)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = agent
        .wait_for("TargetQuotaExhausted", SYNC_TIMEOUT, |s| {
            s.condition(mirror_core::ConditionType::TargetQuotaExhausted)
        })
        .await
        .unwrap();
    assert_eq!(status.phase, Phase::Degraded);

    target.node(0).restart_with(vec!["--quota-backend-bytes=1073741824".into()]).await.unwrap();
    let mut dst = target.client().await.unwrap();
    // Disarm as `etcdctl alarm disarm` does: each raised alarm by its member id.
    let alarms = dst.alarm(etcd_client::AlarmAction::Get, etcd_client::AlarmType::None, None).await.unwrap();
    assert!(!alarms.alarms().is_empty(), "the NOSPACE alarm should be raised");
    for a in alarms.alarms() {
        let mut opts = etcd_client::AlarmOptions::new();
        opts.with_member(a.member_id());
        dst.alarm(etcd_client::AlarmAction::Deactivate, etcd_client::AlarmType::Nospace, Some(opts))
            .await
            .unwrap();
    }
    caught_up(&agent, &mut src).await;
    let status = agent.status().await.unwrap();
    assert!(!status.condition(mirror_core::ConditionType::TargetQuotaExhausted), "{status:#?}");
    assert_eq!(status.phase, Phase::Syncing);
    let parsed = cfg.parsed().unwrap();
    let got = check_g3(&mut src, &mut dst, &parsed.rewriter(), &parsed.checkpoint_key()).await.unwrap();
    assert!(matches!(got, G3::Holds { keys, .. } if keys == written), "{got:?}, {written} written");
}

/// Many small revisions delivered in one watch response are merged into one Txn; when the target
/// (here `--max-txn-ops=8`) refuses it, the agent retries one revision at a time and every key
/// lands.
#[tokio::test]
async fn merged_txn_too_big_is_retried_per_revision() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let target =
        EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30).arg("--max-txn-ops=8")).await.unwrap();
    let mut src = source.client().await.unwrap();
    let cfg = fast_progress(AgentConfig::new("split", source.endpoints(), target.endpoints(), "/s/"))
        .with("max_txn_ops = 64");
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    agent.terminate().await.unwrap();
    // While the agent is down, 30 one-key revisions: the restarted watch delivers them together.
    for i in 0..30 {
        src.put(format!("/s/{i:02}"), "v", None).await.unwrap();
    }
    agent.restart().await.unwrap();
    caught_up(&agent, &mut src).await;
    let mut dst = target.client().await.unwrap();
    assert_eq!(count(&mut dst, "/s/").await, 31);
    let parsed = cfg.parsed().unwrap();
    let got = check_g3(&mut src, &mut dst, &parsed.rewriter(), &parsed.checkpoint_key()).await.unwrap();
    assert!(matches!(got, G3::Holds { keys: 30, .. }), "{got:?}");
    assert!(agent.log().contains("retrying one revision at a time"), "the merged Txn was never refused");
}

/// Issue #20 defect 9: an exclude added to a running link leaves the keys already mirrored
/// under it in the target, where no prune or pass will touch them; status lists them
/// (`excluded_keys_in_target`) instead of staying silent. 100 keys under `skip/` are mirrored,
/// the agent restarts with `skip/` excluded (a forced resync, `RangeChanged`): the keys stay
/// and status names the prefix and their count.
#[tokio::test]
async fn keys_under_a_newly_added_exclude_are_listed_in_status() {
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
    let (mut src, mut dst) = pair.clients().await;
    load_keys(&mut src, "/ex/keep/", 50, 8).await.unwrap();
    load_keys(&mut src, "/ex/skip/", 100, 8).await.unwrap();
    let cfg = fast_progress(pair.config("new-exclude", "/ex/"));
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    let status = synced(&agent).await;
    assert!(status.excluded_keys_in_target.is_empty(), "{status:#?}");
    assert_eq!(agent.terminate().await.unwrap(), Some(0));

    let agent = AgentProcess::start(&cfg.clone().with("exclude_prefixes = [\"skip/\"]")).await.unwrap();
    let status = synced(&agent).await;
    assert_eq!(status.forced_resyncs.last_reason, Some(Reason::RangeChanged), "{status:#?}");
    let listed = &status.excluded_keys_in_target;
    assert_eq!(listed.len(), 1, "{status:#?}");
    assert_eq!((listed[0].prefix.as_str(), listed[0].keys), ("skip/", 100));
    assert_eq!(count(&mut dst, "/ex/skip/").await, 100, "excluded keys are never pruned");
    assert!(agent.log().contains("holds keys under an excluded prefix"));
}

/// Issue #20 defect 9: `initial_sync.total_keys` counts the keys the scan will copy. In a chain
/// the source range holds an upstream link's reserved keys (its checkpoint and election keys
/// under `its prefix + "\0etcd-mirror/"`), which the scan skips; the total used to count them, so
/// a finished sync read 100/103.
#[tokio::test]
async fn total_keys_leaves_out_another_links_reserved_keys() {
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
    let (mut src, mut dst) = pair.clients().await;
    load_keys(&mut src, "/ch/", 100, 8).await.unwrap();
    for name in ["checkpoint", "election/1", "election/2"] {
        // An upstream link whose destination is /ch/up/, nested in our source range (one at
        // /ch/ itself is cut out of the scan windows like our own namespace).
        let key = format!("/ch/up/{}{name}", mirror_core::RESERVED_MARKER);
        src.put(key, "an upstream link's", None).await.unwrap();
    }
    let agent = AgentProcess::start(&fast_progress(pair.config("chain", "/ch/"))).await.unwrap();
    let status = synced(&agent).await;
    assert_eq!((status.initial_sync.keys, status.initial_sync.total_keys), (100, 100), "{status:#?}");
    assert_eq!(count(&mut dst, "/ch/key-").await, 100);
}
