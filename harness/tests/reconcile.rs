//! Forced resync, prune, reconcile and verify against real etcd, driven through the binary.

use std::time::Duration;

use etcd_client::{Client, GetOptions};
use harness::scenario::{self, SYNC_TIMEOUT};
use harness::{agent_command, load_keys, AgentConfig, AgentProcess, EtcdCluster, G3};
use mirror_core::{Phase, Reason};

async fn pair() -> (EtcdCluster, EtcdCluster) {
    scenario::pair().await.unwrap()
}

async fn synced(agent: &AgentProcess) -> mirror_core::Status {
    scenario::synced(agent).await.unwrap()
}

async fn caught_up(agent: &AgentProcess, src: &mut Client) -> mirror_core::Status {
    scenario::caught_up(agent, src).await.unwrap()
}

async fn g3(source: &EtcdCluster, target: &EtcdCluster, cfg: &AgentConfig) -> G3 {
    scenario::g3_of(source, target, cfg).await.unwrap()
}

async fn count(client: &mut Client, prefix: &str) -> i64 {
    scenario::count_prefix(client, prefix).await.unwrap()
}

/// `verify` exits 0 on an equal pair and non-zero, naming the key redacted, after a target key
/// is changed by hand.
#[tokio::test]
async fn verify_detects_a_hand_edited_key() {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/v/", 2_000, 16).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "verify", "/v/");
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    caught_up(&agent, &mut src).await;
    agent.terminate().await.unwrap();

    let out = agent_command(&cfg, "verify", &[]).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("EQUAL"), "{text}");
    assert!(text.contains("source keys:      2000"), "{text}");
    // Not on a terminal: progress comes as plain lines on stderr, the report alone on stdout.
    let progress = String::from_utf8_lossy(&out.stderr);
    assert!(progress.contains("verify: 0/2000 source keys compared"), "{progress}");

    let mut dst = target.client().await.unwrap();
    dst.put("/v/key-00000042", "edited by hand", None).await.unwrap();
    let out = agent_command(&cfg, "verify", &[]).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("divergent:        1"), "{text}");
    let redacted = mirror_core::redact_key(b"/v/", b"/v/key-00000042");
    assert!(text.contains(&redacted), "expected {redacted} in {text}");
    assert!(!text.contains("key-00000042"), "keys must be redacted: {text}");
    // Verify read only: the hand edit is still there.
    assert_eq!(dst.get("/v/key-00000042", None).await.unwrap().kvs()[0].value(), b"edited by hand");
}

async fn compact_now(src: &mut Client) {
    let rev = scenario::current_revision(src).await.unwrap();
    src.compact(rev, None).await.unwrap();
}

/// Keys deleted and added while the agent is down, then the source compacted past the
/// watermark: the restarted agent resyncs, prunes the deleted keys, and G3 holds.
#[tokio::test]
async fn compaction_while_down_forces_resync_with_prune() {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/p/", 1_000, 16).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "prune", "/p/");
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    agent.terminate().await.unwrap();

    src.delete("/p/key-00000100", Some(etcd_client::DeleteOptions::new().with_range("/p/key-00000200")))
        .await
        .unwrap();
    load_keys(&mut src, "/p/new/", 50, 16).await.unwrap();
    compact_now(&mut src).await;

    agent.restart().await.unwrap();
    // The restarted agent resumes the tail (synced, for a moment) before its watch reports the
    // compaction: wait for the resync's own initial sync to complete.
    agent
        .wait_for("the forced resync completed", SYNC_TIMEOUT, |s| {
            s.forced_resyncs.count >= 1
                && s.phase == Phase::Syncing
                && s.condition(mirror_core::ConditionType::InitialSyncComplete)
        })
        .await
        .unwrap();
    let status = caught_up(&agent, &mut src).await;
    assert_eq!(status.forced_resyncs.count, 1, "{status:#?}");
    assert_eq!(status.forced_resyncs.last_reason, Some(Reason::WatchCompacted));
    let mut dst = target.client().await.unwrap();
    assert_eq!(count(&mut dst, "/p/key-000001").await, 0, "deleted keys must be pruned");
    assert_eq!(g3(&source, &target, &cfg).await, G3::Holds { watermark: status.watermark, keys: 950 });
}

/// kill -9 during the prune sweep: prune_pending is durable, so the restarted agent completes
/// the sweep.
#[tokio::test]
async fn kill9_during_sweep_completes_on_restart() {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/w/", 12_000, 16).await.unwrap();
    let cfg =
        scenario::fast_config(&source, &target, "sweep", "/w/").with("max_txn_ops = 4\npage_key_limit = 100");
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    agent.terminate().await.unwrap();

    // One revision of 10 000 deletes (too large for one target Txn, so only a resync can
    // carry it), then another write so that compacting to now removes that revision.
    src.delete("/w/key-00000000", Some(etcd_client::DeleteOptions::new().with_range("/w/key-00010000")))
        .await
        .unwrap();
    src.put("/elsewhere", "x", None).await.unwrap();
    compact_now(&mut src).await;
    agent.restart().await.unwrap();
    let deadline = tokio::time::Instant::now() + SYNC_TIMEOUT;
    while !agent.log().contains("prune sweep started") {
        assert!(tokio::time::Instant::now() < deadline, "sweep never started:\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    agent.kill9().await.unwrap();

    let mut dst = target.client().await.unwrap();
    let cp = cfg.parsed().unwrap().checkpoint_key();
    let record = mirror_fence::Checkpoint::decode(dst.get(cp, None).await.unwrap().kvs()[0].value()).unwrap();
    assert!(record.prune_pending && record.scanning, "the owed prune must be durable: {record:?}");
    let left = count(&mut dst, "/w/key-0000").await;
    assert!(left > 2_000, "killed mid-sweep: {left} keys left (the test must interrupt the sweep)");

    agent.restart().await.unwrap();
    synced(&agent).await;
    caught_up(&agent, &mut src).await;
    assert_eq!(count(&mut dst, "/w/").await, 2_001, "2000 survivors plus the checkpoint");
    assert!(matches!(g3(&source, &target, &cfg).await, G3::Holds { keys: 2_000, .. }));
}

/// A source that changes faster than the agent can scan (here: a watch buffer too small to
/// hold what arrives during the scan) restarts genesis again and again; after three in a row
/// `ResyncLoopDetected` latches, and it clears after a live apply.
#[tokio::test]
async fn resync_loop_latches_and_clears() {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/l/", 5_000, 16).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "loop", "/l/")
        .with("max_txn_ops = 8\npage_key_limit = 50\nwatch_buffer_bytes = \"2KiB\"");
    let churn = {
        let mut c = src.clone();
        tokio::spawn(async move {
            let mut i = 0u64;
            loop {
                if c.put(format!("/l/churn/{}", i % 50), vec![b'c'; 200], None).await.is_err() {
                    return;
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = agent
        .wait_for("ResyncLoopDetected", SYNC_TIMEOUT, |s| {
            s.condition(mirror_core::ConditionType::ResyncLoopDetected)
        })
        .await
        .unwrap();
    assert!(status.scan_restarts >= 3, "{status:#?}");
    churn.abort();
    synced(&agent).await;
    src.put("/l/live", "1", None).await.unwrap();
    agent
        .wait_for("ResyncLoopDetected cleared", SYNC_TIMEOUT, |s| {
            !s.condition(mirror_core::ConditionType::ResyncLoopDetected)
        })
        .await
        .unwrap();
}

/// Drift injected into the target (a changed value, a deleted key, an extra key) is found and
/// repaired by the periodic pass; the extra key is only reported with delete_orphans = false and
/// deleted with true.
#[tokio::test]
async fn periodic_pass_repairs_drift_and_honours_orphan_policy() {
    for delete_orphans in [false, true] {
        let (source, target) = pair().await;
        let mut src = source.client().await.unwrap();
        load_keys(&mut src, "/d/", 500, 16).await.unwrap();
        let cfg = scenario::fast_config(&source, &target, "drift", "/d/")
            .with(&format!("[reconcile]\ninterval = \"1s\"\ndelete_orphans = {delete_orphans}"));
        let agent = AgentProcess::start(&cfg).await.unwrap();
        synced(&agent).await;
        agent
            .wait_for("a clean pass", SYNC_TIMEOUT, |s| {
                s.condition(mirror_core::ConditionType::InvariantsHeld)
            })
            .await
            .unwrap();

        let mut dst = target.client().await.unwrap();
        // All three damages in one Txn, so no pass sees only part of them.
        let damage = etcd_client::Txn::new().and_then(vec![
            etcd_client::TxnOp::put("/d/key-00000001", "changed", None),
            etcd_client::TxnOp::delete("/d/key-00000002", None),
            etcd_client::TxnOp::put("/d/extra", "orphan", None),
        ]);
        dst.txn(damage).await.unwrap();
        let status = agent
            .wait_for("drift found", SYNC_TIMEOUT, |s| {
                s.last_reconcile.as_ref().is_some_and(|r| r.orphan == 1)
            })
            .await
            .unwrap();
        let r = status.last_reconcile.clone().unwrap();
        assert_eq!((r.missing, r.divergent, r.orphan), (1, 1, 1), "{status:#?}");
        assert_eq!(r.repaired, if delete_orphans { 3 } else { 2 });
        assert!(status.condition(mirror_core::ConditionType::DriftDetected));
        assert_eq!(dst.get("/d/key-00000001", None).await.unwrap().kvs()[0].value(), b"vvvvvvvvvvvvvvvv");
        assert_eq!(count(&mut dst, "/d/key-00000002").await, 1);
        assert_eq!(count(&mut dst, "/d/extra").await, if delete_orphans { 0 } else { 1 });
        if delete_orphans {
            // The next pass finds nothing.
            agent
                .wait_for("clean again", SYNC_TIMEOUT, |s| {
                    !s.condition(mirror_core::ConditionType::DriftDetected)
                })
                .await
                .unwrap();
            assert!(matches!(g3(&source, &target, &cfg).await, G3::Holds { keys: 500, .. }));
        }
    }
}

/// A fence bump during a paced repair pass aborts it: the agent goes to standby and writes
/// nothing after the bump.
#[tokio::test]
async fn fence_bump_during_pass_aborts_cleanly() {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    // 600 keys: the pacing below also slows the initial copy, so keep it small.
    load_keys(&mut src, "/fb/", 600, 16).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "bump", "/fb/")
        .with("max_ops_per_second = 50\nmax_txn_ops = 11\n[reconcile]\ninterval = \"1s\"");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    let mut dst = target.client().await.unwrap();
    // 600 divergent keys take ~12 s to repair at 50 ops/s.
    for start in (0..600).step_by(100) {
        let ops: Vec<etcd_client::TxnOp> = (start..start + 100)
            .map(|i| etcd_client::TxnOp::put(format!("/fb/key-{i:08}"), "damaged", None))
            .collect();
        dst.txn(etcd_client::Txn::new().and_then(ops)).await.unwrap();
    }
    // Wait until the pass is repairing, then bump the fence as a newer agent would.
    let deadline = tokio::time::Instant::now() + SYNC_TIMEOUT;
    loop {
        let fixed = dst.get("/fb/key-00000000", None).await.unwrap().kvs()[0].value() != b"damaged";
        if fixed {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the pass never started repairing");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cp = cfg.parsed().unwrap().checkpoint_key();
    let mut record =
        mirror_fence::Checkpoint::decode(dst.get(cp.clone(), None).await.unwrap().kvs()[0].value()).unwrap();
    record.epoch = 9;
    record.agent_id = "newer-agent".into();
    let bump = dst.put(cp, record.encode().unwrap(), None).await.unwrap().header().unwrap().revision();

    let status = agent.wait_for("standby", SYNC_TIMEOUT, |s| s.phase == Phase::Standby).await.unwrap();
    assert!(status.condition(mirror_core::ConditionType::Fenced), "{status:#?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let now =
        dst.get("/", Some(GetOptions::new().with_count_only())).await.unwrap().header().unwrap().revision();
    assert_eq!(now, bump, "nothing may be written after the fence bump");
    let left = dst
        .get("/fb/", Some(GetOptions::new().with_prefix()))
        .await
        .unwrap()
        .kvs()
        .iter()
        .filter(|kv| kv.value() == b"damaged")
        .count();
    assert!(left > 0, "the pass was interrupted, so some damage remains");
}

/// A link synced over 200 keys under `prefix`, its agent stopped, and its checkpoint record
/// rewritten by `edit` (a cluster id that no longer matches what it mirrors).
struct Edited {
    _clusters: (EtcdCluster, EtcdCluster),
    src: Client,
    dst: Client,
    cfg: AgentConfig,
    agent: AgentProcess,
    /// The record as the agent left it.
    original: mirror_fence::Checkpoint,
}

async fn synced_then_checkpoint_edited(
    link: &str,
    prefix: &str,
    edit: impl FnOnce(&mut mirror_fence::Checkpoint),
) -> Edited {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, prefix, 200, 8).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, link, prefix);
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    agent.terminate().await.unwrap();
    let mut dst = target.client().await.unwrap();
    let original = stored_checkpoint(&mut dst, &cfg).await;
    let mut record = original.clone();
    edit(&mut record);
    dst.put(cfg.parsed().unwrap().checkpoint_key(), record.encode().unwrap(), None).await.unwrap();
    Edited { _clusters: (source, target), src, dst, cfg, agent, original }
}

async fn stored_checkpoint(dst: &mut Client, cfg: &AgentConfig) -> mirror_fence::Checkpoint {
    let resp = dst.get(cfg.parsed().unwrap().checkpoint_key(), None).await.unwrap();
    mirror_fence::Checkpoint::decode(resp.kvs()[0].value()).unwrap()
}

/// Restarts the agent of `e` and waits until it fails on the non-empty target, having written
/// nothing.
async fn restart_refuses_writing_nothing(e: &mut Edited) -> mirror_core::Status {
    let before = scenario::current_revision(&mut e.dst).await.unwrap();
    e.agent.restart().await.unwrap();
    let status = e.agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    assert!(status.condition(mirror_core::ConditionType::EmptyTargetViolation), "{status:#?}");
    assert_eq!(scenario::current_revision(&mut e.dst).await.unwrap(), before, "nothing may be written");
    status
}

/// A stored target cluster id that differs from the connected target (a restored or rebuilt
/// target) forces a fresh genesis with `require_empty` re-armed: a non-empty target is refused
/// and nothing is written.
#[tokio::test]
async fn changed_target_cluster_id_rearms_require_empty() {
    // Pretend the target was restored from a backup of another cluster: same data, same
    // checkpoint, but the stored cluster id no longer matches.
    let mut e = synced_then_checkpoint_edited("cid", "/cid/", |r| r.target_cluster_id ^= 1).await;
    restart_refuses_writing_nothing(&mut e).await;
}

/// The source side of the same rule (reference #13, #131): a stored *source* cluster id that
/// differs from the connected source (the source was rebuilt) forces a fresh genesis with
/// `require_empty` re-armed and `InitialSyncComplete` reset, writing nothing; restarted with
/// `overwrite_and_prune`, the link converges (an orphan pruned) and the checkpoint is bound to
/// the clusters it now mirrors.
#[tokio::test]
async fn changed_source_cluster_id_rearms_require_empty_and_a_prune_converges() {
    let mut e = synced_then_checkpoint_edited("scid", "/scid/", |r| r.source_cluster_id ^= 1).await;
    e.dst.put("/scid/orphan", "only on the target", None).await.unwrap();
    let status = restart_refuses_writing_nothing(&mut e).await;
    assert!(!status.condition(mirror_core::ConditionType::InitialSyncComplete), "{status:#?}");
    e.agent.terminate().await.unwrap();

    let prune = e.cfg.clone().with("[initial_sync]\nmode = \"overwrite_and_prune\"");
    let agent = AgentProcess::start(&prune).await.unwrap();
    synced(&agent).await;
    let rewriter = prune.parsed().unwrap().rewriter();
    assert_eq!(harness::difference_now(&mut e.src, &mut e.dst, &rewriter).await.unwrap(), None);
    let record = stored_checkpoint(&mut e.dst, &e.cfg).await;
    let ids = |r: &mirror_fence::Checkpoint| (r.source_cluster_id, r.target_cluster_id);
    assert_eq!(ids(&record), ids(&e.original));
}

/// Issue #20 defect 9: `lease_backed_keys` says how many keys of the range carry a lease now,
/// not how many leased puts ever passed. 20 leased keys, each re-put 5 times under the same
/// lease, then 15 deleted: the reconcile pass reports 5 (it used to count 20 + 100 and grow
/// on every re-put, never falling on a delete).
#[tokio::test]
async fn lease_backed_keys_counts_keys_that_carry_a_lease_now() {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/l/plain/", 30, 16).await.unwrap();
    let lease = src.lease_grant(600, None).await.unwrap().id();
    let leased = || etcd_client::PutOptions::new().with_lease(lease);
    for i in 0..20 {
        src.put(format!("/l/leased/{i:02}"), "v", Some(leased())).await.unwrap();
    }
    let cfg = scenario::fast_config(&source, &target, "leased", "/l/").with("[reconcile]\ninterval = \"1s\"");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    for round in 0..5 {
        for i in 0..20 {
            src.put(format!("/l/leased/{i:02}"), format!("v{round}"), Some(leased())).await.unwrap();
        }
    }
    for i in 0..15 {
        src.delete(format!("/l/leased/{i:02}"), None).await.unwrap();
    }
    let head = scenario::current_revision(&mut src).await.unwrap();
    let status = agent
        .wait_for("a pass after the deletes", SYNC_TIMEOUT, |s| {
            s.watermark >= head && s.last_reconcile.is_some() && s.lease_backed_keys == 5
        })
        .await;
    let status = match status {
        Ok(s) => s,
        Err(e) => panic!("{e}: lease_backed_keys = {}", agent.status().await.unwrap().lease_backed_keys),
    };
    assert_eq!(status.source_keys, Some(35), "{status:#?}");
}
