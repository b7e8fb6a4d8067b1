//! Authentication on both sides: a user limited to the mirrored prefix mirrors; a wrong
//! password is a permanent, clearly named error.

use std::time::Duration;

use etcd_client::{Client, Permission};
use harness::scenario;
use harness::{agent_command, load_keys, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion, G3};
use mirror_core::{Phase, Reason};

/// Enables auth (`EtcdCluster::enable_auth`: a root user, and a `mirror` user, password
/// `mirror-pw`, whose role may only `read` or `read_write` the prefix); returns a root client.
async fn enable_auth(cluster: &mut EtcdCluster, prefix: &str, writable: bool) -> Client {
    let perm = if writable { Permission::read_write(prefix) } else { Permission::read(prefix) };
    cluster.enable_auth("mirror", vec![perm.with_prefix()]).await.unwrap();
    cluster.client().await.unwrap()
}

/// Least privilege (SPEC §5), on every version of the matrix: a source user with only `read` on
/// the prefix and a target user with only `readwrite` on it mirror, tail, verify and cut over.
/// The source password comes from an environment variable, the target's from a file. On 3.5.30
/// Maintenance Status is refused to such users (root only); the agent learns what it needs by a
/// read of the prefix and `/version` instead, and still trusts progress notifications there.
#[rstest::rstest]
#[case::v3_5_30(EtcdVersion::V3_5_30)]
#[case::v3_5_16(EtcdVersion::V3_5_16)]
#[case::v3_5_1(EtcdVersion::V3_5_1)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn least_privilege_users_mirror_verify_and_cut_over(#[case] version: EtcdVersion) {
    let mut source = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let mut target = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let mut src = enable_auth(&mut source, "/au/", false).await;
    let mut dst = enable_auth(&mut target, "/au/", true).await;
    load_keys(&mut src, "/au/", 500, 8).await.unwrap();
    src.put("/outside/secret", "x", None).await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("target-pass");
    std::fs::write(&pw, "mirror-pw\n").unwrap();
    let env = "MIRROR_SOURCE_PASSWORD";
    let cfg = scenario::fast_config(&source, &target, "auth", "/au/").env(env, "mirror-pw").with(&format!(
        "[source.auth]\nusername = \"mirror\"\npassword_env = {env:?}\n[target.auth]\nusername = \"mirror\"\npassword_file = {:?}",
        pw.display().to_string()
    ));
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    let status = scenario::synced(&agent).await.unwrap();
    assert_eq!(status.source.version, version.as_str(), "the version is learned without Status: {status:#?}");
    src.put("/au/live", "1", None).await.unwrap();
    scenario::caught_up(&agent, &mut src).await.unwrap();
    let parsed = cfg.parsed().unwrap();
    let got =
        harness::check_g3(&mut src, &mut dst, &parsed.rewriter(), &parsed.checkpoint_key()).await.unwrap();
    assert!(matches!(got, G3::Holds { keys: 501, .. }), "{got:?}");

    let verify = agent_command(&cfg, "verify", &[]).await.unwrap();
    assert_eq!(verify.status.code(), Some(0), "verify: {}", String::from_utf8_lossy(&verify.stderr));
    let cutover = agent_command(&cfg, "cutover", &["--wait"]).await.unwrap();
    assert_eq!(
        cutover.status.code(),
        Some(0),
        "cutover: {}\n{}",
        String::from_utf8_lossy(&cutover.stdout),
        String::from_utf8_lossy(&cutover.stderr)
    );
    let standby = agent.wait_for("standby", scenario::SYNC_TIMEOUT, |s| s.phase == Phase::Standby).await;
    assert!(standby.is_ok(), "the daemon stands by after the cutover: {standby:?}");
    agent.terminate().await.unwrap();
}

/// A wrong target password: permanent, reason AuthFailed, condition on the target side.
#[tokio::test]
async fn wrong_password_is_permanent_and_names_the_side() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_1)).await.unwrap();
    let mut target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_1)).await.unwrap();
    let _root = enable_auth(&mut target, "/wp/", true).await;
    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("target-pass");
    std::fs::write(&pw, "not-the-password").unwrap();
    let cfg = scenario::fast_config(&source, &target, "wrongpw", "/wp/").with(&format!(
        "[target.auth]\nusername = \"mirror\"\npassword_file = {:?}",
        pw.display().to_string()
    ));
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status =
        agent.wait_for("failed", Duration::from_secs(60), |s| s.phase == Phase::Failed).await.unwrap();
    let err = status.last_error.clone().unwrap();
    assert_eq!(err.class, mirror_core::ErrorClass::Permanent, "{status:#?}");
    assert_eq!(err.reason, Reason::AuthFailed, "{status:#?}");
    assert!(err.message.contains("target"), "{}", err.message);
    let cond =
        status.conditions.iter().find(|c| c.type_ == mirror_core::ConditionType::TargetReachable).unwrap();
    assert_eq!((cond.status, cond.reason.as_str()), (false, "AuthFailed"));
    assert!(!agent.log().contains("not-the-password"), "the password must never be logged");
}

/// A standby whose first connect fails (here: the target's password file is unreadable at
/// that moment) keeps retrying instead of parking until shutdown, so a raised epoch still
/// takes over once the file is back (defect #7 of issue 10: the engine task ended there).
#[tokio::test]
async fn a_standby_whose_connect_fails_still_takes_over() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_1)).await.unwrap();
    let mut target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_1)).await.unwrap();
    let mut src = source.client().await.unwrap();
    let mut root = enable_auth(&mut target, "/sb/", true).await;
    load_keys(&mut src, "/sb/", 50, 8).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("target-pass");
    std::fs::write(&pw, "mirror-pw\n").unwrap();
    let cfg = scenario::fast_config(&source, &target, "standby-retry", "/sb/").with(&format!(
        "[target.auth]\nusername = \"mirror\"\npassword_file = {:?}",
        pw.display().to_string()
    ));
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&agent).await.unwrap();

    // The password file goes away (a Secret being rotated), then a newer epoch takes the fence.
    std::fs::remove_file(&pw).unwrap();
    let key = cfg.parsed().unwrap().checkpoint_key();
    let stored = root.get(key.clone(), None).await.unwrap();
    let mut record = mirror_fence::Checkpoint::decode(stored.kvs()[0].value()).unwrap();
    record.epoch = 2;
    record.agent_id = "someone-else".into();
    // Written as a record of the first v1 shape (without `commit` and `range`), which every
    // agent reads.
    let mut json: serde_json::Value = serde_json::from_slice(&record.encode().unwrap()).unwrap();
    json.as_object_mut().unwrap().retain(|k, _| k != "commit" && k != "range");
    root.put(key, serde_json::to_vec(&json).unwrap(), None).await.unwrap();
    agent.wait_for("standby", Duration::from_secs(30), |s| s.phase == Phase::Standby).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The file is back and the operator raises our epoch above the stored one.
    std::fs::write(&pw, "mirror-pw\n").unwrap();
    agent.reload(cfg.clone().epoch(3)).unwrap();
    let status = agent
        .wait_for("took over with epoch 3", Duration::from_secs(60), |s| {
            s.phase == Phase::Syncing && s.epoch == 3
        })
        .await
        .unwrap();
    assert!(!status.condition(mirror_core::ConditionType::Fenced));
    src.put("/sb/after", "1", None).await.unwrap();
    scenario::caught_up(&agent, &mut src).await.unwrap();
}
