//! The harness itself against real etcd: both versions on both launchers, member controls,
//! keepalive against a paused member, and a network cut through the fault proxy.

use std::time::Duration;

use etcd_client::{Client, GetOptions};
use harness::{Backend, ClusterSpec, EtcdCluster, EtcdVersion};
use rstest::rstest;

fn require_docker(backend: Backend) {
    if backend == Backend::Container {
        assert!(
            harness::docker_ready(),
            "Docker engine or etcd-mirror/etcd images missing: run scripts/setup.sh"
        );
    }
}

async fn put_get(client: &mut Client, key: &str, value: &str) -> anyhow::Result<()> {
    client.put(key, value, None).await?;
    let resp = client.get(key, None).await?;
    let kv = resp.kvs().first().ok_or_else(|| anyhow::anyhow!("{key} not found"))?;
    anyhow::ensure!(kv.value() == value.as_bytes(), "value mismatch for {key}");
    Ok(())
}

/// Retries `f` for up to 20 s (elections, reconnects), panicking with the last error.
async fn eventually(mut f: impl AsyncFnMut() -> anyhow::Result<()>) {
    let mut last = None;
    for _ in 0..100 {
        match f().await {
            Ok(()) => return,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("never succeeded: {last:?}");
}

/// Each version starts on each launcher, reports its version, and round-trips a key.
#[rstest]
#[case::container_3_5_30(Backend::Container, EtcdVersion::V3_5_30)]
#[case::container_3_5_16(Backend::Container, EtcdVersion::V3_5_16)]
#[case::container_3_5_1(Backend::Container, EtcdVersion::V3_5_1)]
#[case::container_3_4_23(Backend::Container, EtcdVersion::V3_4_23)]
#[case::process_3_5_30(Backend::Process, EtcdVersion::V3_5_30)]
#[case::process_3_5_16(Backend::Process, EtcdVersion::V3_5_16)]
#[case::process_3_5_1(Backend::Process, EtcdVersion::V3_5_1)]
#[case::process_3_4_23(Backend::Process, EtcdVersion::V3_4_23)]
#[tokio::test]
async fn single_member_round_trips_a_key(#[case] backend: Backend, #[case] version: EtcdVersion) {
    require_docker(backend);
    let cluster = EtcdCluster::start(ClusterSpec::new(version).backend(backend)).await.unwrap();
    let mut client = cluster.client().await.unwrap();
    put_get(&mut client, "/rt/a", "1").await.unwrap();
    let status = client.status().await.unwrap();
    assert_eq!(status.version(), version.as_str());
}

/// A three-member cluster keeps serving with one member killed, and the member rejoins with its
/// data after a restart.
#[rstest]
#[case::container(Backend::Container)]
#[case::process(Backend::Process)]
#[tokio::test]
async fn three_members_survive_one_kill(#[case] backend: Backend) {
    require_docker(backend);
    let mut cluster =
        EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30).members(3).backend(backend)).await.unwrap();
    let mut client = cluster.client().await.unwrap();
    put_get(&mut client, "/three/a", "1").await.unwrap();
    let members = client.member_list().await.unwrap();
    assert_eq!(members.members().len(), 3);

    cluster.node(0).kill().await.unwrap();
    let others = cluster.endpoints()[1..].to_vec();
    let mut rest = Client::connect(others, None).await.unwrap();
    // If the killed member led, the others need an election first.
    eventually(async || put_get(&mut rest, "/three/b", "2").await).await;

    cluster.node(0).start().await.unwrap();
    let mut first = Client::connect([cluster.node(0).endpoint()], None).await.unwrap();
    // A linearizable read on the restarted member sees the write made while it was down.
    eventually(async || {
        let got = first.get("/three/b", None).await?;
        anyhow::ensure!(got.kvs().first().map(|kv| kv.value()) == Some(&b"2"[..]), "not replicated yet");
        Ok(())
    })
    .await;
    // Killed while idle, it holds the same history as the others: the member check (which
    // names etcd-io/etcd#13766 in scenario failure reports) must not cry wolf.
    for i in 0..20 {
        put_get(&mut rest, &format!("/three/c{i}"), "3").await.unwrap();
    }
    assert_eq!(cluster.members_disagree().await, None);
}

/// Stop then start keeps the data; restart_with changes flags on the same data.
#[rstest]
#[case::container(Backend::Container)]
#[case::process(Backend::Process)]
#[tokio::test]
async fn restart_keeps_data_and_applies_new_flags(#[case] backend: Backend) {
    require_docker(backend);
    let mut cluster =
        EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_4_23).backend(backend)).await.unwrap();
    let mut client = cluster.client().await.unwrap();
    client.put("/keep/a", "1", None).await.unwrap();
    cluster.node(0).stop().await.unwrap();
    cluster.node(0).restart_with(vec!["--max-txn-ops=3".into()]).await.unwrap();
    let mut client = cluster.client().await.unwrap();
    assert_eq!(client.get("/keep/a", None).await.unwrap().kvs().len(), 1);
    // The new flag is in force: a 4-op Txn is refused.
    let ops: Vec<etcd_client::TxnOp> =
        (0..4).map(|i| etcd_client::TxnOp::put(format!("/keep/t{i}"), "v", None)).collect();
    let err = client.txn(etcd_client::Txn::new().and_then(ops)).await.unwrap_err();
    assert!(err.to_string().contains("too many operations"), "{err}");
}

/// A paused member makes a keepalive client fail within seconds (not hang), and unpausing
/// restores service on the same client.
#[rstest]
#[case::container(Backend::Container)]
#[case::process(Backend::Process)]
#[tokio::test]
async fn paused_member_fails_keepalive_client_fast(#[case] backend: Backend) {
    require_docker(backend);
    let mut cluster =
        EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30).backend(backend)).await.unwrap();
    // The agent's options: keepalive on, no per-request deadline on the channel.
    let mut client = cluster.client().await.unwrap();
    client.put("/pause/a", "1", None).await.unwrap();

    cluster.node(0).pause().await.unwrap();
    // Without keepalive this Get would wait forever; the bound is generous, the point is "not hang".
    let outcome = tokio::time::timeout(Duration::from_secs(20), client.get("/pause/a", None)).await;
    match outcome {
        Ok(Err(_)) => {}
        Ok(Ok(_)) => panic!("a paused member answered"),
        Err(_) => panic!("the client hung on a paused member: keepalive did not fire"),
    }

    cluster.node(0).unpause().await.unwrap();
    let mut recovered = false;
    for _ in 0..50 {
        if client.get("/pause/a", GetOptions::new().with_limit(1).into()).await.is_ok() {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(recovered, "client did not recover after unpause");
}

/// Cutting the network through the fault proxy fails requests; healing restores them.
#[rstest]
#[case::container(Backend::Container)]
#[case::process(Backend::Process)]
#[tokio::test]
async fn network_cut_and_heal(#[case] backend: Backend) {
    require_docker(backend);
    let cluster = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30).backend(backend)).await.unwrap();
    let proxies = cluster.proxies().await.unwrap();
    let mut client = harness::agent_client(&proxies.endpoints(), None, Duration::from_secs(2)).await.unwrap();
    put_get(&mut client, "/cut/a", "1").await.unwrap();

    proxies.cut();
    let outcome = tokio::time::timeout(Duration::from_secs(20), client.get("/cut/a", None)).await;
    assert!(matches!(outcome, Ok(Err(_))), "request through a cut network must fail, not hang or succeed");

    // The server itself is fine: a direct client still works while the proxy is cut.
    let mut direct = cluster.client().await.unwrap();
    put_get(&mut direct, "/cut/b", "2").await.unwrap();

    proxies.heal();
    let mut healed = false;
    for _ in 0..50 {
        if let Ok(resp) = client.get("/cut/b", None).await {
            assert_eq!(resp.kvs()[0].value(), b"2");
            healed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(healed, "client did not recover after heal");
}
