//! Forced resync, prune, reconcile and verify against real etcd, driven through the binary.

use std::time::Duration;

use etcd_client::{Client, GetOptions};
use harness::{
    agent_command, check_g3, load_keys, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion, G3,
};
use mirror_core::Phase;

const SYNC_TIMEOUT: Duration = Duration::from_secs(120);

async fn pair() -> (EtcdCluster, EtcdCluster) {
    (
        EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_1)).await.unwrap(),
        EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_1)).await.unwrap(),
    )
}

fn config(source: &EtcdCluster, target: &EtcdCluster, link: &str, prefix: &str) -> AgentConfig {
    AgentConfig::new(link, source.endpoints(), target.endpoints(), prefix)
        .with("[sync]\nprogress_interval = \"1s\"\nbackoff = { initial = \"200ms\", max = \"2s\" }")
}

async fn synced(agent: &AgentProcess) -> mirror_core::Status {
    agent
        .wait_for("InitialSyncComplete", SYNC_TIMEOUT, |s| {
            s.phase == Phase::Syncing && s.condition("InitialSyncComplete")
        })
        .await
        .unwrap()
}

async fn caught_up(agent: &AgentProcess, src: &mut Client) -> mirror_core::Status {
    let rev =
        src.get("/", Some(GetOptions::new().with_count_only())).await.unwrap().header().unwrap().revision();
    agent.wait_for(&format!("watermark >= {rev}"), SYNC_TIMEOUT, |s| s.watermark >= rev).await.unwrap()
}

async fn g3(source: &EtcdCluster, target: &EtcdCluster, cfg: &AgentConfig) -> G3 {
    let parsed = cfg.parsed().unwrap();
    let (mut s, mut t) = (source.client().await.unwrap(), target.client().await.unwrap());
    check_g3(&mut s, &mut t, &parsed.rewriter(), &parsed.checkpoint_key()).await.unwrap()
}

/// `verify` exits 0 on an equal pair and non-zero, naming the key redacted, after a target key
/// is changed by hand.
#[tokio::test]
async fn verify_detects_a_hand_edited_key() {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/v/", 2_000, 16).await.unwrap();
    let cfg = config(&source, &target, "verify", "/v/");
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    caught_up(&agent, &mut src).await;
    agent.terminate().await.unwrap();

    let out = agent_command(&cfg, "verify", &[]).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("EQUAL"), "{text}");
    assert!(text.contains("source keys:      2000"), "{text}");

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
