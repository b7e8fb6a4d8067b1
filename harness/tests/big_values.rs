//! Values of 200 KiB: 150 of them are 30 MB, far over gRPC's default 4 MiB answer. Before the
//! byte-aware pager the first scan page was refused by the client and classed permanent; the
//! reconcile, verify and drain readers had no byte adaptation at all, and repair batches could
//! pass the target's request limit.

use std::time::Duration;

use etcd_client::Client;
use harness::scenario::{self, caught_up, synced};
use harness::{agent_command, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion, G3};
use rstest::rstest;

const VALUE: usize = 200 << 10;

fn value(i: usize, salt: u8) -> Vec<u8> {
    let mut v = vec![b'a' + (i % 26) as u8; VALUE];
    v[0] = salt;
    v
}

async fn put_big(client: &mut Client, prefix: &str, n: usize, salt: u8) {
    for i in 0..n {
        client.put(format!("{prefix}{i:04}"), value(i, salt), None).await.unwrap();
    }
}

#[rstest]
#[case::v3_5_30(EtcdVersion::V3_5_30)]
#[case::v3_5_1(EtcdVersion::V3_5_1)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn large_values_sync_reconcile_verify_and_cut_over(#[case] version: EtcdVersion) {
    let source = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let (mut src, mut dst) = (source.client().await.unwrap(), target.client().await.unwrap());
    put_big(&mut src, "/blob/", 150, b'0').await;

    let cfg =
        scenario::fast_config(&source, &target, "blobs", "/blob/").with("[reconcile]\ninterval = \"2s\"");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await.unwrap();
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 150, .. }));

    // Live: a few more large puts, one source Txn of five (1 MB).
    let ops: Vec<etcd_client::TxnOp> =
        (0..5).map(|i| etcd_client::TxnOp::put(format!("/blob/txn-{i}"), value(i, b'1'), None)).collect();
    src.txn(etcd_client::Txn::new().and_then(ops)).await.unwrap();
    caught_up(&agent, &mut src).await.unwrap();

    // Divergent values written behind the agent's back; the periodic pass repairs them.
    put_big(&mut dst, "/blob/", 40, b'X').await;
    let status = agent
        .wait_for("a reconcile pass that repaired 40 divergent keys", Duration::from_secs(60), |s| {
            s.last_reconcile.as_ref().is_some_and(|r| r.divergent == 40 && r.repaired == 40)
        })
        .await
        .unwrap();
    assert!(status.last_error.is_none(), "{:?}", status.last_error);
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 155, .. }));

    let out = agent_command(&cfg, "verify", &[]).await.unwrap();
    assert!(
        out.status.success(),
        "verify: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let out = agent_command(&cfg, "cutover", &["--wait"]).await.unwrap();
    assert!(
        out.status.success(),
        "cutover: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let status = agent.status().await.unwrap();
    assert!(status.last_error.as_ref().is_none_or(|e| e.class != "permanent"), "{:?}", status.last_error);
}
