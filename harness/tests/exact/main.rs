//! Exact mode (`sync.revisions = "exact"`, SPEC §10) against real etcd: source revision R is
//! target revision R, every key keeps its value, create and mod revision, version and lease,
//! through churn, a kill -9 and an outage of the agent, and a real client (`etcdctl watch
//! --rev R --prev-kv`) sees the same history on both sides. Refusals leave the target
//! unwritten; a foreign write stops the link before it overwrites anything.
//!
//! This file holds the main scenario, the foreign write and the chain; `refusals` the targets
//! and commands that are refused, `failover` what clients see after a failover or cutover,
//! `flight` the Txns in flight, large revisions, leases and the pause, `memory` the agent's
//! memory with a frozen target and a large spool (G6), `privilege` users without the root role,
//! `audit` the periodic read-only comparison, `quiet` the alert rules on healthy replicas.

mod audit;
mod failover;
mod flight;
mod memory;
mod privilege;
mod quiet;
mod refusals;

use std::time::Duration;

use etcd_client::{Client, GetOptions, PutOptions};
use harness::exact::{
    etcdctl_watch, exact_config, keyspace, keyspace_difference, refuses_read_at, seed, SnapshotSave,
};
use harness::scenario::{caught_up, current_revision, SYNC_TIMEOUT};
use harness::{agent_command, load_keys, AgentProcess, Churn, ClusterSpec, EtcdCluster, EtcdVersion};
use mirror_core::{AgentRole, ErrorClass, Phase};
use rstest::rstest;

/// Seconds of the main churn: 3 in CI, 300 (the 5-minute form of issue #46) with
/// `MIRROR_EXACT_LONG=1`.
fn churn_seconds() -> usize {
    if std::env::var("MIRROR_EXACT_LONG").is_ok_and(|v| v == "1") {
        300
    } else {
        3
    }
}

async fn cluster(version: EtcdVersion) -> EtcdCluster {
    EtcdCluster::start(ClusterSpec::new(version)).await.unwrap()
}

/// Waits until the target holds every source revision and both keyspaces agree (a lease may
/// expire on the source between the two reads: then the next round compares again).
async fn assert_exact(agent: &AgentProcess, src: &mut Client, dst: &mut Client, when: &str) {
    let deadline = tokio::time::Instant::now() + SYNC_TIMEOUT;
    loop {
        caught_up(agent, src).await.unwrap_or_else(|e| panic!("{when}: {e}\n{}", agent.log()));
        let (s, t) = (keyspace(src).await.unwrap(), keyspace(dst).await.unwrap());
        let Some(diff) = keyspace_difference(&s, &t) else { return };
        if tokio::time::Instant::now() > deadline {
            panic!("{when}: the replica is not exact: {diff}\n{}", agent.log());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the source deleted every key under `prefix` (a lease expired).
async fn gone(src: &mut Client, prefix: &str) {
    let empty = async {
        while src.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await.unwrap().count()
            > 0
        {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), empty).await.expect("the lease expired on the source");
}

/// Keeps lease `id` alive on `client` every second until the task is aborted.
fn keep_alive(mut client: Client, id: i64) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Ok((mut keeper, _stream)) = client.lease_keep_alive(id).await else { return };
        loop {
            let _ = keeper.keep_alive().await;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
}

/// The short form of issue #46's first scenario: seeded by `snapshot save` while a 5 s lease
/// the source keeps alive has keys and the source takes writes and compacts past R0 before
/// the target is up, then churn (puts, deletes, range deletes, multi-op Txns, leases expiring
/// and revoked, a source compaction the target follows), a kill -9 of the agent and an outage
/// longer than the TTL of a lease granted after the seed, with two HA replicas running at once and
/// a kill -9 of the leading one. After each fault: target revision =
/// source revision and every key agrees; both sides refuse a read below the compaction; and
/// etcdctl's watch from several revisions, one taken before the kill, prints the same events.
#[rstest]
#[case::v3_5_30(EtcdVersion::V3_5_30)]
#[case::v3_5_16(EtcdVersion::V3_5_16)]
#[case::v3_5_1(EtcdVersion::V3_5_1)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn an_exact_replica_keeps_every_revision(#[case] version: EtcdVersion) {
    let source = cluster(version).await;
    let mut target = cluster(version).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 200, 64).await.unwrap();
    let short = src.lease_grant(5, None).await.unwrap().id();
    let keeper = keep_alive(src.clone(), short);
    for k in ["/registry/masterleases/a", "/registry/masterleases/b"] {
        src.put(k, "10.0.0.1", Some(PutOptions::new().with_lease(short))).await.unwrap();
    }
    let long = src.lease_grant(600, None).await.unwrap().id();
    src.put("/registry/events/e1", "x", Some(PutOptions::new().with_lease(long))).await.unwrap();

    // Seeded by `snapshot save` while the source takes writes and compacts past R0 before the
    // target is up: the spool carries what the source compacted.
    let config = exact_config(&source, &target, "k8s-dr");
    let mut save = SnapshotSave::start(&config).await.unwrap();
    Churn::new("/registry/pods/", 100, 100, 50).seed(3).spawn(src.clone()).await.unwrap().unwrap();
    let head = current_revision(&mut src).await.unwrap();
    assert!(head > save.r0 + 50, "the source moved on after the snapshot");
    src.compact(head, None).await.unwrap();
    target.restore_snapshot_file(&save.file).await.unwrap();
    let mut dst = target.client().await.unwrap();
    assert_eq!(
        current_revision(&mut dst).await.unwrap(),
        save.r0,
        "the restore is at the R0 it printed\n{}",
        save.printed
    );
    // Two HA replicas at once: the fence decides which lands each revision.
    let config = config
        .overlay(&format!("[sync]\nexact_seed = {:?}", save.file.display().to_string()))
        .overlay("[ha]\nenabled = true");
    let mut agents =
        vec![AgentProcess::start(&config).await.unwrap(), AgentProcess::start(&config).await.unwrap()];
    assert_exact(&agents[0], &mut src, &mut dst, "after the seed").await;
    // The two leases that came with the snapshot are counted, the shortest TTL shown.
    let snapshot_leases = |n: u64, ttl: Option<i64>| {
        move |s: &mirror_core::Status| {
            s.exact
                .as_ref()
                .is_some_and(|e| e.snapshot_leases == n && e.shortest_snapshot_lease_ttl_seconds == ttl)
        }
    };
    agents[0].wait_for("2 snapshot leases, 5 s", SYNC_TIMEOUT, snapshot_leases(2, Some(5))).await.unwrap();
    assert_eq!(
        save.wait(Duration::from_secs(30)).await.unwrap(),
        Some(0),
        "snapshot save ends once the link runs"
    );

    // Churn with leases expiring, a revoke, the short snapshot lease let go, and a compaction.
    let churn =
        Churn::new("/registry/configmaps/", 200 * churn_seconds(), 200, 100).with_leases().spawn(src.clone());
    tokio::time::sleep(Duration::from_millis(800)).await;
    src.lease_revoke(long).await.unwrap();
    keeper.abort();
    churn.await.unwrap().unwrap();
    // The snapshot lease ends on the source and the agents revoke it on the target: from here
    // an outage longer than its 5 s loses nothing.
    gone(&mut src, "/registry/masterleases/").await;
    let compact_at = current_revision(&mut src).await.unwrap() - 50;
    src.compact(compact_at, None).await.unwrap();
    for agent in &agents {
        assert_exact(agent, &mut src, &mut dst, "after the churn").await;
        agent.wait_for("no snapshot lease left", SYNC_TIMEOUT, snapshot_leases(0, None)).await.unwrap();
    }
    let roles = [agents[0].status().await.unwrap().role, agents[1].status().await.unwrap().role];
    assert!(roles.contains(&AgentRole::Standby), "one replica stands by while the other lands: {roles:?}");
    let before_kill = current_revision(&mut src).await.unwrap();

    // kill -9 of the leading replica under churn: the other takes over.
    let leading = usize::from(roles[0] == AgentRole::Standby);
    let churn = Churn::new("/registry/services/", 300, 150, 60).seed(5).spawn(src.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    agents[leading].kill9().await.unwrap();
    churn.await.unwrap().unwrap();
    assert_exact(&agents[1 - leading], &mut src, &mut dst, "after the leading replica's kill -9").await;

    // A lease granted after the seed (3 s, kept alive by the source) outlives an outage of
    // every agent longer than its TTL, with writes meanwhile.
    let fresh = src.lease_grant(3, None).await.unwrap().id();
    let fresh_keeper = keep_alive(src.clone(), fresh);
    src.put("/registry/leases/node-1", "held", Some(PutOptions::new().with_lease(fresh))).await.unwrap();
    assert_exact(&agents[1 - leading], &mut src, &mut dst, "with the fresh lease").await;
    agents[1 - leading].kill9().await.unwrap();
    Churn::new("/registry/secrets/", 200, 100, 40).seed(7).spawn(src.clone()).await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    for agent in &mut agents {
        agent.restart().await.unwrap();
    }
    for agent in &agents {
        assert_exact(agent, &mut src, &mut dst, "after every agent's outage").await;
    }
    fresh_keeper.abort();

    // The target follows the compaction: a read below it is refused on both sides.
    let followed = async {
        while !refuses_read_at(&mut dst.clone(), compact_at - 1).await {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), followed)
        .await
        .expect("the target compacted where the source did");
    assert!(refuses_read_at(&mut src, compact_at - 1).await);

    // A real client's view of the history from several revisions, one before the kill.
    let head = current_revision(&mut src).await.unwrap();
    for from in [compact_at, compact_at + 17, before_kill] {
        let (s, t) = (&source.endpoints()[0], &target.endpoints()[0]);
        let theirs = etcdctl_watch(s, from, head, Duration::from_secs(20)).await.unwrap();
        let ours = etcdctl_watch(t, from, head, Duration::from_secs(20)).await.unwrap();
        assert!(!theirs.is_empty(), "the source's history from {from} has events");
        assert_eq!(theirs, ours, "etcdctl watch --rev {from} --prev-kv differs between the sides");
    }
    for agent in &agents {
        let status = agent.status().await.unwrap();
        assert_eq!((status.phase, status.watermark), (Phase::Syncing, head), "{:?}", status.last_error);
    }
    let verified = agent_command(&config, "verify", &[]).await.unwrap();
    let said = String::from_utf8_lossy(&verified.stdout);
    assert_eq!(verified.status.code(), Some(0), "{said}");
    assert!(said.contains("EQUAL") && said.contains(&format!("target revision:         {head}")), "{said}");
}

/// A key written on the target by anyone but the link, which the source then changes, with
/// Txns in flight under churn: the link stops with `ForeignWrite` and the foreign value stays
/// (nothing overwritten).
#[tokio::test]
async fn a_foreign_write_stops_the_link_before_it_overwrites() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 50, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr").overlay("[sync]\nexact_txns_in_flight = 4");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let mut dst = target.client().await.unwrap();
    src.put("/registry/pods/first", "1", None).await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the seed").await;

    let churn = Churn::new("/registry/configmaps/", 2000, 1000, 100).spawn(src.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    dst.put("/registry/pods/key-0000001", "foreign", None).await.unwrap();
    src.put("/registry/pods/key-0000001", "source", None).await.unwrap();
    churn.await.unwrap().unwrap();
    let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    let err = failed.last_error.expect("a last error");
    assert_eq!((err.class, err.reason.as_str()), (ErrorClass::Permanent, "ForeignWrite"), "{}", err.message);
    let kept = dst.get("/registry/pods/key-0000001", None).await.unwrap();
    assert_eq!(kept.kvs()[0].value(), b"foreign", "the foreign write is not overwritten");
    let cfg = exact_config(&source, &target, "k8s-dr");
    let verified = agent_command(&cfg, "verify", &[]).await.unwrap();
    let said = String::from_utf8_lossy(&verified.stdout);
    assert_eq!(verified.status.code(), Some(1), "{said}");
    assert!(said.contains("something other than the link wrote the target"), "{said}");
}

/// A chain A -> B -> C in exact mode: each link's checkpoint names the link, so C, seeded from a
/// snapshot of B (which holds A's record, frozen on C), mirrors B under its own record, and all
/// three clusters agree on every revision and key, reserved keys left out.
#[tokio::test]
async fn a_chain_of_exact_links_keeps_revisions_end_to_end() {
    let a = cluster(EtcdVersion::V3_5_30).await;
    let mut b = cluster(EtcdVersion::V3_5_30).await;
    let mut c = cluster(EtcdVersion::V3_5_30).await;
    let mut ac = a.client().await.unwrap();
    load_keys(&mut ac, "/registry/pods/", 30, 16).await.unwrap();
    seed(&a, &mut b, "ab").await.unwrap();
    let ab = AgentProcess::start(&exact_config(&a, &b, "a-b")).await.unwrap();
    ac.put("/registry/pods/first", "1", None).await.unwrap();
    let mut bc_client = b.client().await.unwrap();
    assert_exact(&ab, &mut ac, &mut bc_client, "A -> B").await;
    seed(&b, &mut c, "bc").await.unwrap();
    let bc = AgentProcess::start(&exact_config(&b, &c, "b-c")).await.unwrap();
    Churn::new("/registry/pods/", 300, 200, 50).with_leases().spawn(ac.clone()).await.unwrap().unwrap();
    let mut cc = c.client().await.unwrap();
    assert_exact(&ab, &mut ac, &mut bc_client, "A -> B under churn").await;
    assert_exact(&bc, &mut bc_client, &mut cc, "B -> C under churn").await;
    let (ka, kc) = (keyspace(&mut ac).await.unwrap(), keyspace(&mut cc).await.unwrap());
    assert_eq!(keyspace_difference(&ka, &kc), None, "A and C agree");
}
