//! Genesis modes against a target that is not empty, a rebuilt source, excluded prefixes and
//! the counts of an initial sync.

use super::*;

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
