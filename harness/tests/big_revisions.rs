//! Everyday big revisions land atomically: `del --prefix` of 5 000 keys, a 128-op Txn (129 ops
//! with the checkpoint put) and a lease revoke deleting 1 000 keys each become exactly one
//! target revision, at etcd's default `--max-txn-ops` of 128, on both versions. Before nested
//! Txns each stopped the agent with `RevisionTooLarge`.

use etcd_client::{Client, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp};
use harness::scenario::{self, caught_up, current_revision, synced};
use harness::{load_keys, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion, G3};
use rstest::rstest;

/// Runs `op` on the source and returns how many target revisions the agent applied it as
/// (revisions that changed a mirrored key; checkpoint-only commits apply nothing).
async fn target_revisions_for<F: std::future::Future<Output = ()>>(
    agent: &AgentProcess,
    src: &mut Client,
    dst: &mut Client,
    op: F,
) -> i64 {
    caught_up(agent, src).await.unwrap();
    let before = current_revision(dst).await.unwrap();
    op.await;
    caught_up(agent, src).await.unwrap();
    let after = current_revision(dst).await.unwrap();
    let config = agent.config();
    let checkpoint = config.parsed().unwrap().checkpoint_key();
    scenario::data_revisions(dst, &config.target_prefix, &checkpoint, before, after).await.unwrap()
}

#[rstest]
#[case::v3_5_30(EtcdVersion::V3_5_30)]
#[case::v3_5_1(EtcdVersion::V3_5_1)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn big_revisions_land_as_one_target_revision(#[case] version: EtcdVersion) {
    let source = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let (mut src, mut dst) = (source.client().await.unwrap(), target.client().await.unwrap());
    load_keys(&mut src, "/big/del/", 5_000, 32).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "big-revisions", "/big/");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await.unwrap();
    let g3 = || scenario::g3_of(&source, &target, &cfg);
    assert!(matches!(g3().await.unwrap(), G3::Holds { keys: 5_000, .. }));

    // etcdctl del --prefix of 5 000 keys: one source revision of 5 000 deletes.
    let mut c = src.clone();
    let moved = target_revisions_for(&agent, &mut src, &mut dst, async move {
        c.delete("/big/del/", Some(DeleteOptions::new().with_prefix())).await.unwrap();
    })
    .await;
    assert_eq!(moved, 1, "{version}: the 5 000 deletes landed in {moved} target revisions");
    assert_eq!(scenario::count_prefix(&mut dst, "/big/del/").await.unwrap(), 0);
    assert!(matches!(g3().await.unwrap(), G3::Holds { keys: 0, .. }));

    // One source Txn of 128 puts (129 ops with the checkpoint).
    let mut c = src.clone();
    let moved = target_revisions_for(&agent, &mut src, &mut dst, async move {
        let ops: Vec<TxnOp> = (0..128).map(|i| TxnOp::put(format!("/big/txn/{i:03}"), "v", None)).collect();
        c.txn(Txn::new().and_then(ops)).await.unwrap();
    })
    .await;
    assert_eq!(moved, 1, "{version}: the 128-op Txn landed in {moved} target revisions");
    let landed = dst.get("/big/txn/", Some(GetOptions::new().with_prefix())).await.unwrap();
    let revs: std::collections::HashSet<i64> = landed.kvs().iter().map(|kv| kv.mod_revision()).collect();
    assert_eq!((landed.kvs().len(), revs.len()), (128, 1), "128 keys sharing one mod revision");
    assert!(matches!(g3().await.unwrap(), G3::Holds { keys: 128, .. }));

    // A lease revoke that deletes 1 000 keys in one revision.
    let lease = src.lease_grant(600, None).await.unwrap().id();
    for start in (0..1_000).step_by(100) {
        let ops: Vec<TxnOp> = (start..start + 100)
            .map(|i| {
                TxnOp::put(format!("/big/leased/{i:04}"), "v", Some(PutOptions::new().with_lease(lease)))
            })
            .collect();
        src.txn(Txn::new().and_then(ops)).await.unwrap();
    }
    let mut c = src.clone();
    let moved = target_revisions_for(&agent, &mut src, &mut dst, async move {
        c.lease_revoke(lease).await.unwrap();
    })
    .await;
    assert_eq!(moved, 1, "{version}: the lease revoke landed in {moved} target revisions");
    assert_eq!(scenario::count_prefix(&mut dst, "/big/leased/").await.unwrap(), 0);
    assert!(matches!(g3().await.unwrap(), G3::Holds { keys: 128, .. }));
    let status = agent.status().await.unwrap();
    assert!(status.last_error.is_none(), "{:?}", status.last_error);
}

/// A source of 3 000 keys `/wide/a-NNNN-ppp…` (about 80 bytes each) and a target whose
/// `--max-request-bytes` is 64 KiB: deleting them all is one revision over the target's limit.
async fn wide_pair(version: EtcdVersion) -> (EtcdCluster, EtcdCluster, Client, Client) {
    let source = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let target =
        EtcdCluster::start(ClusterSpec::new(version).arg("--max-request-bytes=65536")).await.unwrap();
    let (mut src, dst) = (source.client().await.unwrap(), target.client().await.unwrap());
    let pad = "p".repeat(60);
    for start in (0..3_000).step_by(100) {
        let ops: Vec<TxnOp> =
            (start..start + 100).map(|i| TxnOp::put(format!("/wide/a-{i:04}-{pad}"), "v", None)).collect();
        src.txn(Txn::new().and_then(ops)).await.unwrap();
    }
    (source, target, src, dst)
}

/// A `del --prefix` whose deletes alone are over the target's `--max-request-bytes` (3 000 keys
/// of ~80 bytes against 64 KiB): the runs of deleted keys are coalesced into range deletes and
/// the revision still lands as one target revision. A key the range must not touch (under an
/// excluded prefix, present only in the target) sits among the deleted keys and survives.
#[rstest]
#[case::v3_5_30(EtcdVersion::V3_5_30)]
#[case::v3_5_1(EtcdVersion::V3_5_1)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn deletes_over_the_request_limit_are_coalesced(#[case] version: EtcdVersion) {
    let (source, target, mut src, mut dst) = wide_pair(version).await;
    src.put("/wide/b-stays", "v", None).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "coalesce", "/wide/")
        .with("txn_flush_bytes = \"32KiB\"\nexclude_prefixes = [\"a-1500-excluded/\"]");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await.unwrap();
    // Not ours: under an excluded prefix, between a-1500-… and a-1501-… in key order.
    dst.put("/wide/a-1500-excluded/keep", "theirs", None).await.unwrap();

    let mut c = src.clone();
    let moved = target_revisions_for(&agent, &mut src, &mut dst, async move {
        c.delete("/wide/a-", Some(DeleteOptions::new().with_prefix())).await.unwrap();
    })
    .await;
    assert_eq!(moved, 1, "{version}: the coalesced deletes landed in {moved} target revisions");
    let left = dst.get("/wide/a-", Some(GetOptions::new().with_prefix().with_keys_only())).await.unwrap();
    let left: Vec<&[u8]> = left.kvs().iter().map(|kv| kv.key()).collect();
    assert_eq!(left, vec![&b"/wide/a-1500-excluded/keep"[..]], "only the excluded key is left");
    assert_eq!(dst.get("/wide/b-stays", None).await.unwrap().kvs().len(), 1);
    assert!(agent.log().contains("coalesced into range deletes"), "the revision was never over the limit");
    assert!(agent.status().await.unwrap().last_error.is_none());
}

/// Issue #20 defect 8: a key another writer creates inside a run of deleted keys, after the
/// agent read the target to coalesce them and before its range delete lands, survives. The
/// agent's debug failpoint writes that key at exactly that moment; the range delete's guard
/// ("no key of the span changed since the read") fails, the span is read again, and the new
/// key ends the run. Before, the range delete was guarded by the checkpoint compare only and
/// deleted it.
#[tokio::test]
async fn a_key_created_inside_a_coalesced_range_survives() {
    let version = EtcdVersion::V3_5_30;
    let (source, target, mut src, mut dst) = wide_pair(version).await;
    // Between a-1999-… and a-2000-p… in key order: inside the one run of 3 000 deletes.
    let foreign = "/wide/a-2000-late";
    let cfg = scenario::fast_config(&source, &target, "coalesce-race", "/wide/")
        .with("txn_flush_bytes = \"32KiB\"")
        .env("MIRROR_FAILPOINT_FOREIGN_PUT_AFTER_COALESCE_READ", foreign);
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await.unwrap();

    src.delete("/wide/a-", Some(DeleteOptions::new().with_prefix())).await.unwrap();
    caught_up(&agent, &mut src).await.unwrap();
    let left = dst.get("/wide/a-", Some(GetOptions::new().with_prefix().with_keys_only())).await.unwrap();
    let left: Vec<&[u8]> = left.kvs().iter().map(|kv| kv.key()).collect();
    assert_eq!(left, vec![foreign.as_bytes()], "the foreign key, and only it, is left");
    let log = agent.log();
    assert!(log.contains("coalesced into range deletes"), "the revision was never over the limit");
    assert!(log.contains("appeared inside a coalesced delete range"), "the guard never failed:\n{log}");
}

/// The counter the tests above rely on, against a history written by hand: of five revisions
/// after `before`, two touch only the checkpoint, one puts a key (together with the
/// checkpoint), one deletes a key, one deletes and puts in one Txn: three data revisions.
#[tokio::test]
async fn data_revisions_counts_puts_and_deletes_but_not_the_checkpoint() {
    let cluster = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    let checkpoint = b"/t/__mirror/checkpoint".to_vec();
    c.put("/t/old", "v", None).await.unwrap();
    c.put(checkpoint.clone(), "0", None).await.unwrap();
    let before = current_revision(&mut c).await.unwrap();
    c.put(checkpoint.clone(), "1", None).await.unwrap();
    let both = vec![TxnOp::put("/t/new", "v", None), TxnOp::put(checkpoint.clone(), "2", None)];
    c.txn(Txn::new().and_then(both)).await.unwrap();
    c.put(checkpoint.clone(), "3", None).await.unwrap();
    c.delete("/t/old", None).await.unwrap();
    let swap = vec![TxnOp::delete("/t/new", None), TxnOp::put("/t/newer", "v", None)];
    c.txn(Txn::new().and_then(swap)).await.unwrap();
    let after = current_revision(&mut c).await.unwrap();
    assert_eq!(after - before, 5);
    let moved = scenario::data_revisions(&mut c, "/t/", &checkpoint, before, after).await.unwrap();
    assert_eq!(moved, 3);
    // One revision past `before` is counted without a read.
    assert_eq!(scenario::data_revisions(&mut c, "/t/", &checkpoint, before, before + 1).await.unwrap(), 1);
}
