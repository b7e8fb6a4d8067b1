//! Other links beside ours: a link nested in our destination range must survive our prune, and
//! a link that mirrors our target back into our source must be refused before any write, and so
//! must an endpoint list that mixes two clusters, and a source below etcd 3.4.

use etcd_client::GetOptions;
use harness::scenario::{self, caught_up, synced, SYNC_TIMEOUT};
use harness::{load_keys, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion};
use mirror_core::{Phase, Reason};

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
    assert_eq!(err.reason, Reason::DirectionConflict, "{err:?}");
    assert!(err.message.contains("\"ab\""), "names the other link: {}", err.message);
    assert!(status.condition(mirror_core::ConditionType::DirectionConflict));
    assert_eq!(scenario::current_revision(&mut xc).await.unwrap(), before, "BA wrote nothing into X");
}

/// A source endpoint list that names members of two clusters (a copy-paste slip) is refused
/// at connect with `MixedClusters`, naming the odd endpoint, before anything is read or written.
#[tokio::test]
async fn endpoints_of_two_clusters_are_refused() {
    let (source, target) = scenario::pair().await.unwrap();
    let stray = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut endpoints = source.endpoints();
    endpoints.extend(stray.endpoints());
    let cfg = AgentConfig::new("mixed", endpoints, target.endpoints(), "/mx/").with(scenario::FAST_SYNC_TOML);
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    let err = status.last_error.clone().expect("a last error");
    assert_eq!(err.reason, Reason::MixedClusters, "{err:?}");
    assert!(err.message.contains(&stray.endpoints()[0]), "names the odd endpoint: {}", err.message);
    let mut dst = target.client().await.unwrap();
    let written = dst.get("", Some(GetOptions::new().with_from_key().with_count_only())).await.unwrap();
    assert_eq!(written.count(), 0, "nothing written to the target");
}

/// A source below etcd 3.4 is refused at connect with `VersionUnsupported`, naming the
/// endpoint and its version, before anything is written. No such server is at hand: a 3.5.30
/// member poses as 3.3.30 through a proxy that rewrites its version string.
#[tokio::test]
async fn a_source_below_3_4_is_refused_at_connect() {
    let (mut source, target) = scenario::pair().await.unwrap();
    let old = harness::FaultProxy::start_rewriting(source.node(0).client_addr(), b"3.5.30", b"3.3.30")
        .await
        .unwrap();
    let cfg = AgentConfig::new("too-old", vec![old.endpoint()], target.endpoints(), "/old/")
        .with(scenario::FAST_SYNC_TOML);
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    let err = status.last_error.clone().expect("a last error");
    assert_eq!(
        (err.class, err.reason.as_str()),
        (mirror_core::ErrorClass::Permanent, "VersionUnsupported"),
        "{err:?}"
    );
    assert!(err.message.contains("3.3.30") && err.message.contains(&old.endpoint()), "{}", err.message);
    let mut dst = target.client().await.unwrap();
    let written = dst.get("", Some(GetOptions::new().with_from_key().with_count_only())).await.unwrap();
    assert_eq!(written.count(), 0, "nothing written to the target");
}
