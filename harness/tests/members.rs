//! Three-member clusters on both sides, with members down and leaders lost. One member down, or
//! the leader killed, must never stop replication beyond the election (SPEC §5 "Members").
//! Before, the agent retried `connect` forever when any configured endpoint did not answer.

use std::time::Duration;

use harness::scenario::{self, caught_up, synced, SYNC_TIMEOUT};
use harness::{load_keys, AgentProcess, Churn, EtcdVersion, G3};
use rstest::rstest;

const ELECTION: Duration = Duration::from_secs(30);

/// A source member and a target member are down before the agent starts: it syncs through the
/// others, lists both endpoints in status with `MemberUnreachable` True, and clears it once
/// they are back.
#[rstest]
#[case::v3_5_30(EtcdVersion::V3_5_30)]
#[case::v3_5_1(EtcdVersion::V3_5_1)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn member_down_before_start(#[case] version: EtcdVersion) {
    let (mut source, mut target) = scenario::pair_of(version, 3).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/m/", 3_000, 64).await.unwrap();
    let (down_src, down_dst) = (source.endpoints()[1].clone(), target.endpoints()[2].clone());
    source.node(1).stop().await.unwrap();
    target.node(2).stop().await.unwrap();

    let cfg = scenario::fast_config(&source, &target, "members", "/m/");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = synced(&agent).await.unwrap();
    assert!(status.condition(mirror_core::ConditionType::MemberUnreachable), "{:?}", status.conditions);
    assert_eq!(status.source.unreachable_endpoints, vec![down_src]);
    assert_eq!(status.target.unreachable_endpoints, vec![down_dst]);
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 3_000, .. }));

    source.node(1).start().await.unwrap();
    target.node(2).start().await.unwrap();
    let status = agent
        .wait_for("MemberUnreachable False", Duration::from_secs(60), |s| {
            !s.condition(mirror_core::ConditionType::MemberUnreachable)
        })
        .await
        .unwrap();
    assert!(status.source.unreachable_endpoints.is_empty() && status.target.unreachable_endpoints.is_empty());
    src.put("/m/after", "1", None).await.unwrap();
    caught_up(&agent, &mut src).await.unwrap();
    assert_eq!(agent.status().await.unwrap().forced_resyncs.count, 0);
}

/// The source leader is killed while the initial scan pages: the agent resumes from its scan
/// cursor through the remaining members, with no forced resync.
#[tokio::test]
async fn source_leader_killed_during_initial_sync() {
    let (mut source, target) = scenario::pair_of(EtcdVersion::V3_5_30, 3).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/s/", 30_000, 64).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "leader-scan", "/s/")
        .with("page_key_limit = 64\nmax_txn_ops = 16");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    agent.wait_for("scan under way", SYNC_TIMEOUT, |s| s.initial_sync.keys > 2_000).await.unwrap();
    let leader = source.leader_index(ELECTION).await.unwrap();
    source.node(leader).kill().await.unwrap();
    let status = synced(&agent).await.unwrap();
    assert_eq!(status.forced_resyncs.count, 0, "a leader loss is not a resync");
    assert!(status.initial_sync.keys < 30_000 + 5_000, "the scan resumed instead of restarting");
    agent
        .wait_for("MemberUnreachable True", Duration::from_secs(30), |s| {
            s.condition(mirror_core::ConditionType::MemberUnreachable)
        })
        .await
        .unwrap();
    let mut src = source.client().await.unwrap();
    src.put("/s/after", "1", None).await.unwrap();
    caught_up(&agent, &mut src).await.unwrap();
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 30_001, .. }));
    source.node(leader).start().await.unwrap();
}

/// The target leader is killed during live churn: writes fail over to the new leader and the
/// target converges with G3 holding and no forced resync.
#[tokio::test]
async fn target_leader_killed_during_live_churn() {
    let (source, mut target) = scenario::pair_of(EtcdVersion::V3_5_30, 3).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/c/", 2_000, 64).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "leader-churn", "/c/");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await.unwrap();
    let churn = Churn::new("/c/", 3_000, 400, 2_500).seed(5).spawn(src.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let leader = target.leader_index(ELECTION).await.unwrap();
    target.node(leader).kill().await.unwrap();
    agent
        .wait_for("MemberUnreachable True", Duration::from_secs(30), |s| {
            s.condition(mirror_core::ConditionType::MemberUnreachable)
        })
        .await
        .unwrap();
    churn.await.unwrap().unwrap();
    src.put("/c/zz-last", "1", None).await.unwrap();
    caught_up(&agent, &mut src).await.unwrap();
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { .. }));
    let status = agent.status().await.unwrap();
    assert_eq!(status.forced_resyncs.count, 0, "a leader loss is not a resync");
    target.node(leader).start().await.unwrap();
}

/// A learner in each side's endpoint list (a member being added, as kubeadm does): the agent
/// reports it (`learner` in status, `LearnerEndpoint` True), never sends it a read or a write
/// (a learner refuses them), and mirrors churn through the voting member with G3 held.
#[tokio::test]
async fn learner_endpoints_are_reported_and_left_out() {
    let (mut source, mut target) = scenario::pair().await.unwrap();
    source.add_learner().await.unwrap();
    target.add_learner().await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/l/", 2_000, 64).await.unwrap();

    let cfg = scenario::fast_config(&source, &target, "learners", "/l/");
    assert_eq!(cfg.parsed().unwrap().source.endpoints.len(), 2, "the learner is configured");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = synced(&agent).await.unwrap();
    assert!(status.source.learner && status.target.learner, "{status:?}");
    assert!(status.condition(mirror_core::ConditionType::LearnerEndpoint), "{status:?}");

    let churn = Churn::new("/l/", 1_000, 200, 2_500).seed(7).spawn(src.clone());
    churn.await.unwrap().unwrap();
    caught_up(&agent, &mut src).await.unwrap();
    let status = agent.status().await.unwrap();
    assert!(status.last_error.is_none(), "no RPC failed on a learner: {:?}", status.last_error);
    assert_eq!(status.forced_resyncs.count, 0);
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { .. }));
}
