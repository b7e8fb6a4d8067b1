//! Other links beside ours: a link nested in our destination range must survive our prune, and
//! a link that mirrors our target back into our source must be refused before any write.

use etcd_client::GetOptions;
use harness::scenario::{self, caught_up, synced, SYNC_TIMEOUT};
use harness::{load_keys, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion};
use mirror_core::Phase;

/// Link B writes `/b/` into `/copy/nested/`; link A then mirrors `/a/` into `/copy/` with
/// `overwrite_and_prune`. To A, B's keys look like orphans. A must stop with `PrefixConflict`
/// naming B before deleting anything; B's checkpoint and data stay, and B keeps mirroring.
/// (On the old code A's sweep deleted B's checkpoint and every key of B.)
#[tokio::test]
async fn nested_link_is_never_pruned() {
    let (source, target) = scenario::pair().await.unwrap();
    let (mut src, mut dst) = (source.client().await.unwrap(), target.client().await.unwrap());
    load_keys(&mut src, "/a/", 200, 16).await.unwrap();
    load_keys(&mut src, "/b/", 100, 16).await.unwrap();

    let mut b_cfg = scenario::fast_config(&source, &target, "link-b", "/b/");
    b_cfg.target_prefix = "/copy/nested/".into();
    let b = AgentProcess::start(&b_cfg).await.unwrap();
    synced(&b).await.unwrap();

    let mut a_cfg = scenario::fast_config(&source, &target, "link-a", "/a/")
        .with("[initial_sync]\nmode = \"overwrite_and_prune\"");
    a_cfg.target_prefix = "/copy/".into();
    let a = AgentProcess::start(&a_cfg).await.unwrap();
    let status = a.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    let err = status.last_error.clone().expect("a last error");
    assert_eq!(
        (err.class, err.reason.as_str()),
        (mirror_core::ErrorClass::Permanent, "PrefixConflict"),
        "{err:?}"
    );
    assert!(err.message.contains("\"link-b\""), "names the other link: {}", err.message);
    assert!(status.condition(mirror_core::ConditionType::PrefixConflict));

    let b_checkpoint = b_cfg.parsed().unwrap().checkpoint_key();
    let stored = dst.get(b_checkpoint, None).await.unwrap();
    let record = mirror_fence::Checkpoint::decode(stored.kvs()[0].value()).unwrap();
    assert_eq!(record.link_uid, "link-b");
    let b_keys = dst.get("/copy/nested/key-", Some(GetOptions::new().with_prefix().with_count_only())).await;
    assert_eq!(b_keys.unwrap().count(), 100, "B's data is intact");

    src.put("/b/after", "1", None).await.unwrap();
    caught_up(&b, &mut src).await.unwrap();
    assert_eq!(dst.get("/copy/nested/after", None).await.unwrap().kvs().len(), 1, "B still mirrors");
}

/// Link AB mirrors X:/p/ into Y:/p/. Link BA, Y:/p/ into X:/p/, would echo every write forever:
/// it finds AB's checkpoint in its source range naming its own clusters in reverse and stops
/// with `DirectionConflict` before writing anything.
#[tokio::test]
async fn reverse_link_is_refused_before_any_write() {
    let x = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let y = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut xc = x.client().await.unwrap();
    load_keys(&mut xc, "/p/", 50, 16).await.unwrap();
    let ab = AgentProcess::start(&scenario::fast_config(&x, &y, "ab", "/p/")).await.unwrap();
    synced(&ab).await.unwrap();
    let before = scenario::current_revision(&mut xc).await.unwrap();

    let ba_cfg = AgentConfig::new("ba", y.endpoints(), x.endpoints(), "/p/")
        .with(scenario::FAST_SYNC_TOML)
        .with("[initial_sync]\nmode = \"overwrite\"");
    let ba = AgentProcess::start(&ba_cfg).await.unwrap();
    let status = ba.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    let err = status.last_error.clone().expect("a last error");
    assert_eq!(err.reason, "DirectionConflict", "{err:?}");
    assert!(err.message.contains("\"ab\""), "names the other link: {}", err.message);
    assert!(status.condition(mirror_core::ConditionType::DirectionConflict));
    assert_eq!(scenario::current_revision(&mut xc).await.unwrap(), before, "BA wrote nothing into X");
}
