//! Txns in flight (also through a target's or a source's leader loss), 200 KiB values, an
//! event lease of 10 000 keys running out, revisions cut into fragments or over the decode limit, snapshot leases running out while
//! every agent is down, unanswered keep-alives, and the pause.

use std::time::Duration;

use etcd_client::{Client, PutOptions, Txn, TxnOp};
use harness::exact::{etcdctl_watch, exact_config, seed};
use harness::scenario::{current_revision, SYNC_TIMEOUT};
use harness::{load_keys, AgentConfig, AgentProcess, Churn, ClusterSpec, EtcdCluster, EtcdVersion, Scraped};
use mirror_core::{ConditionType, Phase, Side};
use rstest::rstest;

use super::{assert_exact, cluster, keep_alive};

/// Several Txns in flight (`exact_txns_in_flight = 4`), sent back to back (`exact_txn_spacing =
/// "0s"`: the default spacing keeps most in order) under an open-loop burst: etcd runs some
/// out of order, they fail their fence compare and are sent again in order (counted in
/// `exact.resent`), and the replica is exact, its history the source's event for event.
#[tokio::test]
async fn txns_in_flight_land_in_order_whatever_etcd_runs_first() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 20, 16).await.unwrap();
    let r0 = seed(&source, &mut target, "seed").await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr")
        .overlay("[sync]\nexact_txns_in_flight = 4\nexact_txn_spacing = \"0s\"");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    Churn::new("/registry/pods/", 3000, 1500, 200).with_leases().spawn(src.clone()).await.unwrap().unwrap();
    let mut dst = target.client().await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the burst").await;
    let head = current_revision(&mut src).await.unwrap();
    let (s, t) = (&source.endpoints()[0], &target.endpoints()[0]);
    let theirs = etcdctl_watch(s, r0 + 1, head, Duration::from_secs(30)).await.unwrap();
    let ours = etcdctl_watch(t, r0 + 1, head, Duration::from_secs(30)).await.unwrap();
    assert_eq!(theirs, ours, "etcdctl watch --rev {} --prev-kv differs", r0 + 1);
    let resent = agent.status().await.unwrap().exact.map_or(0, |e| e.resent);
    println!("Txns sent again after a reorder: {resent}");
}

/// A 3-member target, or source, loses its leader (kill -9) under an open-loop churn with
/// leases, 2 Txns in flight: the Txns the dead member or the election refused are sent again in
/// order (a lost answer: the fence tells whether it had landed), the watch goes on from another
/// source member, the leases live on under the new leader, the killed member is named in status
/// (`MemberUnreachable`) until it is back, and the replica is exact on the members left, its
/// history the source's event for event.
#[rstest]
#[case::target(Side::Target)]
#[case::source(Side::Source)]
#[tokio::test]
async fn a_leader_killed_with_txns_in_flight_loses_no_revision(#[case] side: Side) {
    let members = |of: Side| ClusterSpec::new(EtcdVersion::V3_5_30).members(if of == side { 3 } else { 1 });
    let mut source = EtcdCluster::start(members(Side::Source)).await.unwrap();
    let mut target = EtcdCluster::start(members(Side::Target)).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 50, 16).await.unwrap();
    let r0 = seed(&source, &mut target, "seed").await.unwrap();
    let agent = AgentProcess::start(&exact_config(&source, &target, "k8s-dr")).await.unwrap();
    // Tolerant: the churn's own puts to a killed source member fail.
    let churn = Churn::new("/registry/pods/", 2000, 500, 100).with_leases().tolerant().spawn(src.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let three = if side == Side::Source { &mut source } else { &mut target };
    let leader = three.leader_index(Duration::from_secs(5)).await.unwrap();
    three.node(leader).kill().await.unwrap();
    let dead = three.endpoints()[leader].clone();
    churn.await.unwrap().unwrap();
    let (mut src, mut dst) = (source.client().await.unwrap(), target.client().await.unwrap());
    assert_exact(&agent, &mut src, &mut dst, &format!("after the {side}'s leader was killed")).await;
    let three = if side == Side::Source { &source } else { &target };
    assert_eq!(three.members_disagree().await, None, "the members left agree");
    let head = current_revision(&mut src).await.unwrap();
    let live =
        |c: &EtcdCluster, of: Side| c.endpoints()[if of == side { (leader + 1) % 3 } else { 0 }].clone();
    let theirs =
        etcdctl_watch(&live(&source, Side::Source), r0 + 1, head, Duration::from_secs(30)).await.unwrap();
    let ours =
        etcdctl_watch(&live(&target, Side::Target), r0 + 1, head, Duration::from_secs(30)).await.unwrap();
    assert_eq!(theirs, ours, "etcdctl watch --rev {} --prev-kv differs", r0 + 1);
    let status = agent.status().await.unwrap();
    let named = |s: &mirror_core::Status| match side {
        Side::Source => s.source.unreachable_endpoints.clone(),
        Side::Target => s.target.unreachable_endpoints.clone(),
    };
    assert!(status.condition(ConditionType::MemberUnreachable), "{:?}", status.conditions);
    assert_eq!(named(&status), vec![dead], "the killed member is named");
    let exact = status.exact.expect("exact status");
    println!("Txns sent again: {}; revisions landed: {}", exact.resent, exact.landed_here);

    // Back, it is no longer named: the tail probes the members while it runs.
    let three = if side == Side::Source { &mut source } else { &mut target };
    three.node(leader).start().await.unwrap();
    let back = |s: &mirror_core::Status| !s.condition(ConditionType::MemberUnreachable);
    let status = agent.wait_for("every member answers", SYNC_TIMEOUT, back).await.unwrap();
    assert!(named(&status).is_empty(), "{:?}", status.conditions);
}

/// One source revision whose watch response is over 1 MiB (80 values of 12 KiB rewritten in
/// one Txn: 2 MB with their prev_kv): the agent's client cuts the response into fragments
/// before decoding it (mirror_core::watch_split), the exact watch joins them, and the revision
/// lands as one target Txn: the replica is exact, its history the source's event for event.
#[tokio::test]
async fn a_revision_cut_into_fragments_lands_whole() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/configmaps/", 80, 12 << 10).await.unwrap();
    let r0 = seed(&source, &mut target, "seed").await.unwrap();
    let agent = AgentProcess::start(&exact_config(&source, &target, "k8s-dr")).await.unwrap();
    let value = "w".repeat(12 << 10);
    let ops: Vec<TxnOp> =
        (0..80).map(|i| TxnOp::put(format!("/registry/configmaps/{i:08}"), value.as_str(), None)).collect();
    src.txn(Txn::new().and_then(ops)).await.unwrap();
    src.put("/registry/pods/after", "1", None).await.unwrap();
    let mut dst = target.client().await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the large revision").await;
    let head = current_revision(&mut src).await.unwrap();
    assert_eq!(head, r0 + 2, "one revision for the Txn, one for the put");
    let (s, t) = (&source.endpoints()[0], &target.endpoints()[0]);
    let theirs = etcdctl_watch(s, r0 + 1, head, Duration::from_secs(30)).await.unwrap();
    let ours = etcdctl_watch(t, r0 + 1, head, Duration::from_secs(30)).await.unwrap();
    assert_eq!(theirs, ours, "etcdctl watch --rev {} --prev-kv differs", r0 + 1);
    assert!(agent.status().await.unwrap().last_error.is_none());
    // Each Txn this agent landed is observed (send to answer), with its data ops.
    let scraped = Scraped::get(&agent.url()).await.unwrap();
    let sample =
        |name: &str| scraped.sample(name).unwrap_or_else(|| panic!("no {name}:\n{}", scraped.text()));
    assert_eq!(sample("etcd_mirror_apply_latency_seconds_count"), 2.0, "two revisions landed");
    assert_eq!(sample("etcd_mirror_batch_size_ops_sum"), 81.0, "80 puts and one");
}

/// Kubernetes-sized objects: 200 KiB values (a large ConfigMap or Secret) loaded, then churn
/// rewriting and deleting 180 KiB ones (its Txns of up to 8 puts stay under etcd's default
/// 1.5 MiB request limit, so their target Txns, a few hundred bytes more, do too), and one
/// revision of five 200 KiB values (1 MB), each a single target Txn: the replica is exact.
#[tokio::test]
async fn values_of_200_kib_land_exact() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/secrets/", 2, 200 << 10).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let agent = AgentProcess::start(&exact_config(&source, &target, "k8s-dr")).await.unwrap();
    // 8 keys: the whole keyspace stays under the checker's 4 MiB read.
    Churn::new("/registry/secrets/", 150, 50, 8)
        .value_size(180 << 10)
        .spawn(src.clone())
        .await
        .unwrap()
        .unwrap();
    let value = "s".repeat(200 << 10);
    let ops: Vec<TxnOp> =
        (0..5).map(|i| TxnOp::put(format!("/registry/configmaps/big-{i}"), value.as_str(), None)).collect();
    src.txn(Txn::new().and_then(ops)).await.unwrap();
    let mut dst = target.client().await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the 200 KiB values").await;
    assert!(agent.status().await.unwrap().last_error.is_none());
}

/// An event lease running out (kube-apiserver puts the events of a minute under one lease):
/// 10 000 keys of Kubernetes event names (about 80 bytes) under one lease granted after the
/// seed, left to expire on the source, which deletes them all as one revision. That revision
/// lands as one target Txn (10 000 deletes nested at the target's default 128 ops a level,
/// guarded by the keyspace compare, about 1 MB, under the default 1.5 MiB request limit),
/// whose watch response is cut into pieces; the target lease is revoked once empty. The
/// replica is exact, the target at the source's revision.
#[tokio::test]
async fn an_event_lease_of_10_000_keys_running_out_lands_as_one_revision() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 10, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let agent = AgentProcess::start(&exact_config(&source, &target, "k8s-dr")).await.unwrap();
    let mut dst = target.client().await.unwrap();
    src.put("/registry/pods/first", "1", None).await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "before the events").await;
    let lease = src.lease_grant(6, None).await.unwrap().id();
    let name = |i: usize| {
        format!("/registry/events/kube-system/kube-controller-manager-node-{i:05}.17f1d3c2a9b8e4f0")
    };
    for chunk in (0..10_000).collect::<Vec<_>>().chunks(100) {
        let puts = chunk
            .iter()
            .map(|&i| TxnOp::put(name(i), "event", Some(PutOptions::new().with_lease(lease))))
            .collect::<Vec<_>>();
        src.txn(Txn::new().and_then(puts)).await.unwrap();
    }
    let before = current_revision(&mut src).await.unwrap();
    super::gone(&mut src, "/registry/events/").await;
    let after = current_revision(&mut src).await.unwrap();
    assert_eq!(after, before + 1, "the lease's expiry is one revision on the source");
    assert_exact(&agent, &mut src, &mut dst, "after the event lease ran out").await;
    assert_eq!(current_revision(&mut dst).await.unwrap(), after, "one target revision for it");
    assert!(revoked_within_10s(&dst, lease).await, "the target lease is revoked once empty");
    assert!(agent.status().await.unwrap().last_error.is_none());
}

/// A catch-up over the watch's decode limit: while the agent is down the source rewrites four
/// values of 64 KiB 200 times, one revision each, so the restarted agent's watch would get them as one
/// response of 26 MB with their prev_kv (over 12 MiB). The watch is opened again asking etcd
/// for fragments, and every revision lands, the replica exact. Before, the watch failed at the
/// same revision at every retry.
#[tokio::test]
async fn a_catch_up_over_the_decode_limit_is_read_in_fragments() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/secrets/", 4, 64 << 10).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let mut agent = AgentProcess::start(&exact_config(&source, &target, "k8s-dr")).await.unwrap();
    let mut dst = target.client().await.unwrap();
    src.put("/registry/pods/first", "1", None).await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "before the outage").await;
    agent.kill9().await.unwrap();
    let value = "z".repeat(64 << 10);
    for i in 0..200 {
        src.put(format!("/registry/secrets/{:08}", i % 4), value.as_str(), None).await.unwrap();
    }
    agent.restart().await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the catch-up").await;
    assert!(agent.status().await.unwrap().last_error.is_none());
    assert!(
        agent.log().contains("watching in fragments"),
        "the response was not over the limit:\n{}",
        agent.log()
    );
}

/// An exact link seeded while the source keeps a lease alive with a key under it (as a
/// Kubernetes master lease), its agent started and caught up with a first write.
struct LeasedLink {
    source: EtcdCluster,
    target: EtcdCluster,
    src: Client,
    dst: Client,
    cfg: AgentConfig,
    agent: AgentProcess,
    /// Keeps the lease alive on the source until aborted.
    keeper: tokio::task::JoinHandle<()>,
}

/// [`LeasedLink`] with a 3 s lease.
async fn seeded_with_a_short_lease() -> LeasedLink {
    seeded_with_a_lease(3, |cfg| cfg).await
}

/// [`seeded_with_a_short_lease`] with a lease of `ttl` seconds and the agent's config passed
/// through `tune` first.
async fn seeded_with_a_lease(ttl: i64, tune: impl FnOnce(AgentConfig) -> AgentConfig) -> LeasedLink {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    let lease = src.lease_grant(ttl, None).await.unwrap().id();
    let keeper = keep_alive(src.clone(), lease);
    src.put("/registry/masterleases/a", "10.0.0.1", Some(PutOptions::new().with_lease(lease))).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let cfg = tune(exact_config(&source, &target, "k8s-dr"));
    let agent = AgentProcess::start(&cfg).await.unwrap();
    src.put("/registry/pods/first", "1", None).await.unwrap();
    let mut dst = target.client().await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the seed").await;
    LeasedLink { source, target, src, dst, cfg, agent, keeper }
}

/// A lease that came with the snapshot, left to run out on the target while every agent is down
/// (the source keeps it alive): its keys went at a target revision the source never had, and
/// the restarted agent stops with `ForeignWrite` instead of writing on.
#[tokio::test]
async fn a_snapshot_lease_run_out_while_the_agents_were_down_is_detected() {
    let LeasedLink { source: _source, target: _target, src: _, mut dst, cfg: _, mut agent, keeper } =
        seeded_with_a_short_lease().await;
    agent.kill9().await.unwrap();
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        dst.get("/registry/masterleases/a", None).await.unwrap().count(),
        0,
        "the lease ran out on the target"
    );
    agent.restart().await.unwrap();
    let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    let err = failed.last_error.expect("a last error");
    assert_eq!(err.reason.as_str(), "ForeignWrite", "{}", err.message);
    keeper.abort();
}

/// `paused = true` by SIGHUP: nothing is written while the source takes writes (phase
/// `paused`, the target revision still), yet the snapshot's 3 s lease is kept alive on the
/// target meanwhile, so its key is still there after 6 s; `paused = false` resumes from the
/// checkpoint and the replica is exact again.
#[tokio::test]
async fn a_paused_link_writes_nothing_and_keeps_the_leases_alive() {
    let LeasedLink { source: _source, target: _target, mut src, mut dst, cfg, mut agent, keeper } =
        seeded_with_a_short_lease().await;
    agent.reload(cfg.clone().top("paused = true")).unwrap();
    agent.wait_for("paused", SYNC_TIMEOUT, |s| s.phase == Phase::Paused).await.unwrap();
    let held = current_revision(&mut dst).await.unwrap();
    for i in 0..5 {
        src.put(format!("/registry/pods/p{i}"), "v", None).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(current_revision(&mut dst).await.unwrap(), held, "the target was written while paused");
    assert_eq!(
        dst.get("/registry/masterleases/a", None).await.unwrap().count(),
        1,
        "the snapshot lease ran out on the target while the link was paused"
    );
    agent.reload(cfg.clone()).unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the pause").await;
    assert!(agent.status().await.unwrap().last_error.is_none());
    keeper.abort();
}

/// Target keep-alives that get no answer in time (as over a connection a network cut left
/// stale; here the first three: at the adoption, during the seed's proof, whose end cuts the
/// keep-alive short, and at the tail's first rounds) are retried a round later: the run goes
/// on, and the snapshot's 10 s lease is still kept alive on the target after twice its TTL.
/// Before, the first ended the run.
#[tokio::test]
async fn unanswered_keep_alives_are_retried_and_the_run_goes_on() {
    let LeasedLink { source: _source, target: _target, mut src, mut dst, cfg: _, agent, keeper } =
        seeded_with_a_lease(10, |cfg| {
            cfg.overlay("[sync]\nrequest_timeout = \"1s\"")
                .env("MIRROR_FAILPOINT_UNANSWERED_KEEP_ALIVES", "3")
        })
        .await;

    tokio::time::sleep(Duration::from_secs(20)).await;
    let log = agent.log();
    assert!(log.contains("retrying at the first round"), "the adoption's keep-alive was answered:\n{log}");
    assert!(log.contains("retrying at the next round"), "no round's keep-alive went unanswered:\n{log}");
    assert!(!log.contains("exact link run ended"), "the run ended:\n{log}");
    assert_eq!(
        dst.get("/registry/masterleases/a", None).await.unwrap().count(),
        1,
        "the snapshot lease ran out on the target"
    );
    src.put("/registry/pods/second", "2", None).await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the retries").await;
    assert!(agent.status().await.unwrap().last_error.is_none());
    keeper.abort();
}

/// A keep-alive waiting for its answer holds up no revision: the tail's round is awaited beside
/// the watch and the Txns in flight. The snapshot's 30 s lease is kept at the adoption (answered)
/// and next a third of its TTL later, where the keep-alive gets no answer until
/// `request_timeout` (8 s); a put made meanwhile lands at once, before the round gives up on it.
/// Before, the tail ran its keep-alives inline and stood still for the whole timeout.
#[tokio::test]
async fn a_keep_alive_waiting_for_its_answer_holds_up_no_revision() {
    let LeasedLink { source: _source, target: _target, mut src, mut dst, cfg: _, agent, keeper } =
        seeded_with_a_lease(30, |cfg| {
            cfg.overlay("[sync]\nrequest_timeout = \"8s\"")
                .env("MIRROR_FAILPOINT_UNANSWERED_KEEP_ALIVES", "1..2")
        })
        .await;

    // The second keep-alive went out 10 s after the adoption and waits until about 18 s.
    tokio::time::sleep(Duration::from_secs(12)).await;
    src.put("/registry/pods/during", "1", None).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while dst.get("/registry/pods/during", None).await.unwrap().count() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the put never landed:\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !agent.log().contains("a target keep-alive failed"),
        "the put landed only after the keep-alive gave up:\n{}",
        agent.log()
    );
    assert_exact(&agent, &mut src, &mut dst, "after the keep-alive").await;
    keeper.abort();
}

/// Leases whose keys leave one at a time, each kind of leaving (deleted, put without a lease,
/// put under another lease): the agent counts each lease's keys on the target and reads a lease
/// only once its count reaches zero, so each lease must still be on the target, its keys with
/// it, until its last key left, and gone right after. One lease came with the snapshot (counted
/// when the agent adopts it), one is granted after the seed (counted from its grant); the agent
/// is killed between two leavings, and the restarted one counts again. On 3.5.30 and 3.4.23: a
/// count read from a lease is as of its answer's revision, which both fill.
#[rstest]
#[case::v3_5_30(EtcdVersion::V3_5_30)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn a_lease_is_revoked_on_the_target_when_its_last_key_leaves_and_not_before(
    #[case] version: EtcdVersion,
) {
    let source = cluster(version).await;
    let mut target = cluster(version).await;
    let mut src = source.client().await.unwrap();
    let under = |lease| Some(PutOptions::new().with_lease(lease));
    let snap = src.lease_grant(600, None).await.unwrap().id();
    for key in ["/registry/events/s1", "/registry/events/s2", "/registry/events/s3"] {
        src.put(key, "e", under(snap)).await.unwrap();
    }
    seed(&source, &mut target, "seed").await.unwrap();
    let mut agent = AgentProcess::start(&exact_config(&source, &target, "k8s-dr")).await.unwrap();
    let mut dst = target.client().await.unwrap();
    let fresh = src.lease_grant(600, None).await.unwrap().id();
    let other = src.lease_grant(600, None).await.unwrap().id();
    for key in ["/registry/events/f1", "/registry/events/f2", "/registry/events/f3"] {
        src.put(key, "e", under(fresh)).await.unwrap();
    }
    src.put("/registry/events/o1", "e", under(other)).await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "with three leases").await;

    // Each lease loses two of its three keys, one way after another; both stay.
    src.delete("/registry/events/s1", None).await.unwrap();
    src.put("/registry/events/f1", "e2", None).await.unwrap();
    agent.kill9().await.unwrap();
    src.put("/registry/events/s2", "e2", under(other)).await.unwrap();
    agent.restart().await.unwrap();
    src.delete("/registry/events/f2", None).await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after two keys of each left").await;
    for id in [snap, fresh, other] {
        assert!(
            holds_lease(&dst, id).await,
            "lease {id:x} was revoked on the target with keys still under it"
        );
    }

    // The last key of each leaves: each is revoked; the lease keys moved to stays.
    src.put("/registry/events/s3", "e2", None).await.unwrap();
    src.put("/registry/events/f3", "e2", under(other)).await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the last keys left").await;
    for id in [snap, fresh] {
        assert!(
            revoked_within_10s(&dst, id).await,
            "lease {id:x} holds no key, yet it was not revoked within 10 s"
        );
    }
    assert!(holds_lease(&dst, other).await, "the lease the keys moved to was revoked");
    assert!(agent.status().await.unwrap().last_error.is_none());
}

/// The target holds lease `id`.
async fn holds_lease(dst: &Client, id: i64) -> bool {
    dst.clone().leases().await.unwrap().leases().iter().any(|l| l.id() == id)
}

/// Lease `id` is gone from the target within 10 s.
async fn revoked_within_10s(dst: &Client, id: i64) -> bool {
    let gone = async {
        while holds_lease(dst, id).await {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), gone).await.is_ok()
}
