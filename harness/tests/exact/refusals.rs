//! Refusals of exact mode: targets that are not this source's snapshot, `snapshot save` refused
//! or stopped, a checkpoint deleted under the link, a revision too large for the target. Nothing
//! is written to a refused target.

use std::time::Duration;

use etcd_client::{PutOptions, Txn, TxnOp};
use harness::exact::{exact_config, seed, snapshot_save_once, SnapshotSave};
use harness::scenario::{caught_up, current_revision, SYNC_TIMEOUT};
use harness::{load_keys, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion};
use mirror_core::{ErrorClass, Phase};

use super::{assert_exact, cluster};

/// Targets that are not this source's snapshot are refused, naming what differs, and nothing
/// is written: one whose R0 the source compacted before the link ran; another cluster brought
/// to the same revision with other content; a target ahead of the source; a restore of a
/// replica that already holds this link's checkpoint.
#[tokio::test]
async fn a_target_that_is_not_the_snapshot_is_refused() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 40, 16).await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr");
    let checkpoint = cfg.parsed().unwrap().checkpoint_key();
    let refused = |agent: AgentProcess| async move {
        let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
        let err = failed.last_error.expect("a last error");
        assert_eq!(err.class, ErrorClass::Permanent, "{}", err.message);
        (err.reason.as_str().to_owned(), err.message)
    };

    // R0 compacted on the source before the link ran.
    let r0 = seed(&source, &mut target, "old").await.unwrap();
    load_keys(&mut src, "/registry/later/", 5, 16).await.unwrap();
    let head = current_revision(&mut src).await.unwrap();
    assert!(head > r0);
    src.compact(head, None).await.unwrap();
    let (reason, message) = refused(AgentProcess::start(&cfg).await.unwrap()).await;
    assert_eq!(reason, "ReseedRequired");
    assert!(message.contains("compacted past the snapshot's revision"), "{message}");

    // Another cluster at the same revision, other content.
    let other = cluster(EtcdVersion::V3_5_30).await;
    let mut oc = other.client().await.unwrap();
    let head = current_revision(&mut src).await.unwrap();
    while current_revision(&mut oc).await.unwrap() < head {
        oc.put("/registry/pods/key-0000001", "other", None).await.unwrap();
    }
    let (reason, message) =
        refused(AgentProcess::start(&exact_config(&source, &other, "k8s-dr")).await.unwrap()).await;
    assert_eq!(reason, "ReseedRequired");
    assert!(
        message.contains("content differs") && message.contains(&format!("revision {head}")),
        "{message}"
    );
    assert_eq!(oc.get(checkpoint.clone(), None).await.unwrap().count(), 0, "nothing written");

    // Ahead of the source.
    oc.put("/registry/pods/ahead", "x", None).await.unwrap();
    let (_, message) =
        refused(AgentProcess::start(&exact_config(&source, &other, "k8s-dr")).await.unwrap()).await;
    assert!(message.contains("ahead of the source"), "{message}");

    // A restore of the replica itself (it holds this link's checkpoint).
    let r0 = seed(&source, &mut target, "fresh").await.unwrap();
    let agent = AgentProcess::start(&cfg).await.unwrap();
    src.put("/registry/pods/new", "1", None).await.unwrap();
    caught_up(&agent, &mut src).await.unwrap();
    drop(agent);
    let mut copy = cluster(EtcdVersion::V3_5_30).await;
    target.save_snapshot("replica").await.unwrap();
    copy.restore_snapshot_file(&target.snapshot_file("replica").unwrap()).await.unwrap();
    let (reason, message) =
        refused(AgentProcess::start(&exact_config(&source, &copy, "k8s-dr")).await.unwrap()).await;
    assert_eq!(reason, "ReseedRequired");
    assert!(message.contains("already holds this link's checkpoint"), "{message}");
    let mut cc = copy.client().await.unwrap();
    assert_eq!(current_revision(&mut cc).await.unwrap(), r0 + 1, "nothing written to the copy");
}

/// `snapshot save` refuses a link that is not exact (2) and never overwrites a file (3).
#[tokio::test]
async fn snapshot_save_refuses_a_compact_link_and_an_existing_file() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let target = cluster(EtcdVersion::V3_5_30).await;
    let dir = tempfile::tempdir().unwrap();
    let save =
        |config, file: std::path::PathBuf| async move { snapshot_save_once(&config, &file).await.unwrap() };
    let compact = harness::scenario::fast_config(&source, &target, "compact", "/a/");
    let (code, said) = save(compact, dir.path().join("a.db")).await;
    assert_eq!(code, Some(2), "{said}");
    assert!(said.contains("sync.revisions"), "{said}");
    let taken = dir.path().join("taken.db");
    std::fs::write(dir.path().join("taken.db.spool"), "mine").unwrap();
    let (code, said) = save(exact_config(&source, &target, "k8s-dr"), taken.clone()).await;
    assert_eq!(code, Some(3), "{said}");
    assert!(said.contains("never overwritten") && !taken.exists(), "{said}");
    assert_eq!(std::fs::read(dir.path().join("taken.db.spool")).unwrap(), b"mine");
}

/// The checkpoint deleted on the target by another writer: the next Txn finds no fence where
/// its predecessor's landing left one, and the link stops with `ForeignWrite` instead of
/// sending that Txn again and again as if etcd had run it too early.
#[tokio::test]
async fn a_deleted_checkpoint_stops_the_link() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 10, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let mut dst = target.client().await.unwrap();
    for i in 0..3 {
        src.put(format!("/registry/pods/n{i}"), "1", None).await.unwrap();
    }
    assert_exact(&agent, &mut src, &mut dst, "after the seed").await;
    // Deleted and the source written at once, before the agent's idle fence check looks.
    dst.delete(cfg.parsed().unwrap().checkpoint_key(), None).await.unwrap();
    src.put("/registry/pods/n9", "1", None).await.unwrap();
    let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    let err = failed.last_error.expect("a last error");
    assert_eq!(err.reason.as_str(), "ForeignWrite", "{}", err.message);
    assert_eq!(
        dst.get("/registry/pods/n9", None).await.unwrap().count(),
        0,
        "nothing landed after the delete"
    );
}

/// `snapshot save` stopped by Ctrl-C before the link runs exits 1 (docs/operations.md, "Exit
/// codes"): the seed's deadline is the source's compaction again. The snapshot, its seed file
/// and the spool it wrote up to then stay for the operator.
#[tokio::test]
async fn snapshot_save_stopped_before_the_link_runs_exits_1() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 20, 64).await.unwrap();
    let mut save = SnapshotSave::start(&exact_config(&source, &target, "k8s-dr")).await.unwrap();
    let spool = save.file.with_extension("db.spool");
    let size = || std::fs::metadata(&spool).map_or(0, |m| m.len());
    let before = size();
    src.put("/registry/pods/after", "spooled", None).await.unwrap();
    let spooled = async {
        while size() <= before {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), spooled).await.expect("the write after R0 was spooled");
    assert_eq!(save.interrupt(Duration::from_secs(30)).await.unwrap(), Some(1), "{}", save.printed);
    assert!(save.file.exists() && spool.exists(), "the snapshot and its spool are left in place");
}

/// Ctrl-C while the snapshot streams (the source 300 ms away each way, so the Snapshot call is
/// in flight when the spool, opened just before it, appears): exit 1, and the seed's partial
/// files go (the spool, the snapshot's `.part`), so the next try starts clean. Before, the
/// signal's default action killed the command (no exit code) and left the spool, which the
/// next try refused to overwrite.
#[tokio::test]
async fn snapshot_save_stopped_during_the_snapshot_exits_1_and_leaves_nothing() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 20, 64).await.unwrap();
    let proxies = source.proxies().await.unwrap();
    proxies.delay(Duration::from_millis(300));
    let mut cfg = exact_config(&source, &target, "k8s-dr");
    cfg.source = proxies.endpoints();
    let dir = tempfile::tempdir().unwrap();
    let (cfg_path, file) = (dir.path().join("mirror.toml"), dir.path().join("seed.db"));
    std::fs::write(&cfg_path, cfg.render()).unwrap();
    let mut save = tokio::process::Command::new(harness::agent_binary())
        .args(["snapshot", "save"])
        .arg(&file)
        .arg("--config")
        .arg(&cfg_path)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let spool = file.with_extension("db.spool");
    let opened = async {
        while !spool.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), opened).await.expect("the spool was opened");
    assert!(!file.exists(), "the snapshot is still streaming");
    harness::send_signal(save.id().unwrap(), libc::SIGINT);
    let status = tokio::time::timeout(Duration::from_secs(30), save.wait()).await.unwrap().unwrap();
    assert_eq!(status.code(), Some(1));
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    // Only the config: `read_dir` has no order, but one name has one.
    assert_eq!(left, vec![std::ffi::OsString::from("mirror.toml")], "no partial file left");
}

/// A source revision whose Txn the target refuses as too large (a source that takes larger
/// requests than the target: here 256 KiB against 64 KiB, a 100 KiB value) cannot land as one
/// target Txn: the link stops with `RevisionTooLarge`, naming the revision and the target's
/// limit, and writes nothing more. Before, the run was retried for ever, phase `connecting`.
#[tokio::test]
async fn a_revision_over_the_targets_request_limit_stops_the_link() {
    let spec =
        |bytes: u32| ClusterSpec::new(EtcdVersion::V3_5_30).arg(format!("--max-request-bytes={bytes}"));
    let source = EtcdCluster::start(spec(256 << 10)).await.unwrap();
    let mut target = EtcdCluster::start(spec(64 << 10)).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 20, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let agent = AgentProcess::start(&exact_config(&source, &target, "k8s-dr")).await.unwrap();
    src.put("/registry/pods/small", "1", None).await.unwrap();
    let landed = caught_up(&agent, &mut src).await.unwrap().watermark;
    src.put("/registry/configmaps/big", vec![b'v'; 100 << 10], None).await.unwrap();
    src.put("/registry/pods/after", "2", None).await.unwrap();

    let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    let err = failed.last_error.expect("a last error");
    assert_eq!(
        (err.class, err.reason.as_str()),
        (ErrorClass::Permanent, "RevisionTooLarge"),
        "{}",
        err.message
    );
    let big = landed + 1;
    assert!(err.message.contains(&format!("source revision {big}")), "{}", err.message);
    assert!(err.message.contains("--max-request-bytes"), "{}", err.message);
    let mut dst = target.client().await.unwrap();
    assert_eq!(
        current_revision(&mut dst).await.unwrap(),
        landed,
        "nothing written past the last revision landed"
    );
}

/// The same stop for a revision etcd made itself, with both sides at the same limit (256
/// KiB): 4 000 event keys under one lease, put in Txns of 100, then the lease is revoked (as
/// when it runs out: a request of a few bytes) and the source deletes them all as one revision
/// (about 330 KiB as a target Txn), larger than any request the source took. The message names
/// the revision's size and what makes one.
#[tokio::test]
async fn a_lease_running_out_over_the_targets_request_limit_stops_the_link() {
    let spec = || ClusterSpec::new(EtcdVersion::V3_5_30).arg(format!("--max-request-bytes={}", 256 << 10));
    let source = EtcdCluster::start(spec()).await.unwrap();
    let mut target = EtcdCluster::start(spec()).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 20, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let agent = AgentProcess::start(&exact_config(&source, &target, "k8s-dr")).await.unwrap();
    let lease = src.lease_grant(600, None).await.unwrap().id();
    let name =
        |i: usize| format!("/registry/events/default/web-7d4b9c6f5-{i:05}.17f1d3c2a9b8e4f0a1b2c3d4e5f6a7b8");
    for chunk in (0..4000).collect::<Vec<_>>().chunks(100) {
        let puts = chunk.iter().map(|&i| TxnOp::put(name(i), "e", Some(PutOptions::new().with_lease(lease))));
        src.txn(Txn::new().and_then(puts.collect::<Vec<_>>())).await.unwrap();
    }
    let landed = caught_up(&agent, &mut src).await.unwrap().watermark;
    src.lease_revoke(lease).await.unwrap();

    let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    let err = failed.last_error.expect("a last error");
    assert_eq!(err.reason.as_str(), "RevisionTooLarge", "{}", err.message);
    let said = &err.message;
    assert!(said.contains(&format!("source revision {} (4000 changes, about ", landed + 1)), "{said}");
    assert!(said.contains("a lease running out") && said.contains("--max-request-bytes above"), "{said}");
    let mut dst = target.client().await.unwrap();
    assert_eq!(
        current_revision(&mut dst).await.unwrap(),
        landed,
        "nothing written past the last revision landed"
    );
}
