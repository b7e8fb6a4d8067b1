//! Exact mode (`sync.revisions = "exact"`, SPEC §10) against real etcd: source revision R is
//! target revision R, every key keeps its value, create and mod revision, version and lease,
//! through churn, a kill -9 and an outage of the agent, and a real client (`etcdctl watch
//! --rev R --prev-kv`) sees the same history on both sides. Refusals leave the target
//! unwritten; a foreign write stops the link before it overwrites anything.

use std::time::Duration;

use etcd_client::{Client, GetOptions, PutOptions, Txn, TxnOp};
use harness::exact::{
    etcdctl_watch, exact_config, keyspace, keyspace_difference, refuses_read_at, seed, SnapshotSave,
};
use harness::scenario::{caught_up, current_revision, SYNC_TIMEOUT};
use harness::{
    agent_command, load_keys, AgentProcess, Churn, ClusterSpec, EtcdCluster, EtcdVersion, Scraped,
};
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

/// Targets that are not this source's snapshot are refused, naming what differs, and nothing
/// is written: one whose R0 the source compacted before the link ran; another cluster brought
/// to the same revision with other content; a target ahead of the source; a restore of a
/// replica that already holds this link's checkpoint.
#[tokio::test]
async fn a_target_that_is_not_the_snapshot_is_refused() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 40, 16).await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr");
    let checkpoint = cfg.parsed().unwrap().checkpoint_key();
    let refused = |agent: AgentProcess| async move {
        let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
        let err = failed.last_error.expect("a last error");
        assert_eq!(err.class, ErrorClass::Permanent, "{}", err.message);
        (err.reason.as_str().to_owned(), err.message)
    };

    // R0 compacted on the source before the link ran.
    let r0 = seed(&source, &mut target, "old").await.unwrap();
    load_keys(&mut src, "/registry/later/", 5, 16).await.unwrap();
    let head = current_revision(&mut src).await.unwrap();
    assert!(head > r0);
    src.compact(head, None).await.unwrap();
    let (reason, message) = refused(AgentProcess::start(&cfg).await.unwrap()).await;
    assert_eq!(reason, "ReseedRequired");
    assert!(message.contains("compacted past the snapshot's revision"), "{message}");

    // Another cluster at the same revision, other content.
    let other = cluster(EtcdVersion::V3_5_30).await;
    let mut oc = other.client().await.unwrap();
    let head = current_revision(&mut src).await.unwrap();
    while current_revision(&mut oc).await.unwrap() < head {
        oc.put("/registry/pods/key-0000001", "other", None).await.unwrap();
    }
    let (reason, message) =
        refused(AgentProcess::start(&exact_config(&source, &other, "k8s-dr")).await.unwrap()).await;
    assert_eq!(reason, "ReseedRequired");
    assert!(
        message.contains("content differs") && message.contains(&format!("revision {head}")),
        "{message}"
    );
    assert_eq!(oc.get(checkpoint.clone(), None).await.unwrap().count(), 0, "nothing written");

    // Ahead of the source.
    oc.put("/registry/pods/ahead", "x", None).await.unwrap();
    let (_, message) =
        refused(AgentProcess::start(&exact_config(&source, &other, "k8s-dr")).await.unwrap()).await;
    assert!(message.contains("ahead of the source"), "{message}");

    // A restore of the replica itself (it holds this link's checkpoint).
    let r0 = seed(&source, &mut target, "fresh").await.unwrap();
    let agent = AgentProcess::start(&cfg).await.unwrap();
    src.put("/registry/pods/new", "1", None).await.unwrap();
    caught_up(&agent, &mut src).await.unwrap();
    drop(agent);
    let mut copy = cluster(EtcdVersion::V3_5_30).await;
    target.save_snapshot("replica").await.unwrap();
    copy.restore_snapshot_file(&target.snapshot_file("replica").unwrap()).await.unwrap();
    let (reason, message) =
        refused(AgentProcess::start(&exact_config(&source, &copy, "k8s-dr")).await.unwrap()).await;
    assert_eq!(reason, "ReseedRequired");
    assert!(message.contains("already holds this link's checkpoint"), "{message}");
    let mut cc = copy.client().await.unwrap();
    assert_eq!(current_revision(&mut cc).await.unwrap(), r0 + 1, "nothing written to the copy");
}

/// `snapshot save` refuses a link that is not exact (2) and never overwrites a file (3).
#[tokio::test]
async fn snapshot_save_refuses_a_compact_link_and_an_existing_file() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let target = cluster(EtcdVersion::V3_5_30).await;
    let dir = tempfile::tempdir().unwrap();
    let save = |config: harness::AgentConfig, file: std::path::PathBuf| {
        let cfg_path = dir.path().join(format!("{}.toml", config.link_uid));
        std::fs::write(&cfg_path, config.render()).unwrap();
        async move {
            let out = tokio::process::Command::new(harness::agent_binary())
                .args(["snapshot", "save"])
                .arg(&file)
                .arg("--config")
                .arg(&cfg_path)
                .output()
                .await
                .unwrap();
            (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
        }
    };
    let compact = harness::scenario::fast_config(&source, &target, "compact", "/a/");
    let (code, said) = save(compact, dir.path().join("a.db")).await;
    assert_eq!(code, Some(2), "{said}");
    assert!(said.contains("sync.revisions"), "{said}");
    let taken = dir.path().join("taken.db");
    std::fs::write(dir.path().join("taken.db.spool"), "mine").unwrap();
    let (code, said) = save(exact_config(&source, &target, "k8s-dr"), taken.clone()).await;
    assert_eq!(code, Some(3), "{said}");
    assert!(said.contains("never overwritten") && !taken.exists(), "{said}");
    assert_eq!(std::fs::read(dir.path().join("taken.db.spool")).unwrap(), b"mine");
}

/// A list-then-watch client of the source (an informer): its cache after listing at one
/// revision and applying every event of its watch up to another.
struct Informer {
    cache: std::collections::BTreeMap<Vec<u8>, (Vec<u8>, i64)>,
    at: i64,
}

impl Informer {
    async fn list(client: &mut Client, prefix: &str) -> Informer {
        let resp = client.get(prefix, Some(GetOptions::new().with_prefix())).await.unwrap();
        let at = resp.header().unwrap().revision();
        let cache = resp
            .kvs()
            .iter()
            .map(|kv| (kv.key().to_vec(), (kv.value().to_vec(), kv.mod_revision())))
            .collect();
        Informer { cache, at }
    }

    /// Watches `prefix` from its revision + 1 until it has applied `until`; the watch's error
    /// when etcd refuses it.
    async fn follow(&mut self, client: &mut Client, prefix: &str, until: i64) -> Result<(), String> {
        let opts = etcd_client::WatchOptions::new().with_prefix().with_start_revision(self.at + 1);
        let mut stream = client.watch(prefix, Some(opts)).await.map_err(|e| e.to_string())?;
        let floor = self.at;
        while self.at < until {
            let resp = tokio::time::timeout(Duration::from_secs(20), stream.message())
                .await
                .map_err(|_| format!("no event up to {until}; at {}", self.at))?
                .map_err(|e| e.to_string())?
                .ok_or("the watch ended")?;
            if resp.compact_revision() > 0 {
                return Err(format!("compacted at {}", resp.compact_revision()));
            }
            for event in resp.events() {
                let kv = event.kv().unwrap();
                let rev = kv.mod_revision();
                assert!(
                    rev > floor && rev >= self.at,
                    "a duplicate: event at {rev} after {} (from {floor})",
                    self.at
                );
                match event.event_type() {
                    etcd_client::EventType::Put => {
                        self.cache.insert(kv.key().to_vec(), (kv.value().to_vec(), kv.mod_revision()));
                    }
                    etcd_client::EventType::Delete => drop(self.cache.remove(kv.key())),
                }
                self.at = kv.mod_revision();
            }
        }
        Ok(())
    }
}

/// Failover with the source lost when the target holds every revision the link saw (R = Rs):
/// the lease the link granted for `exact_lease_hold` is swapped for one with the source's TTL;
/// an informer that had followed the source goes on from the target with no gap and no
/// duplicate (the swap's re-put included), and its cache equals the target's keys; the target
/// takes writes; an agent of the link restarted afterwards stops with `TargetPromoted`.
#[tokio::test]
async fn after_failover_at_the_head_an_informer_goes_on_from_the_target() {
    let mut source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 50, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr");
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    let mut informer = Informer::list(&mut src, "/registry/").await;
    let node_lease = src.lease_grant(30, None).await.unwrap().id();
    src.put("/registry/leases/node-a", "up", Some(PutOptions::new().with_lease(node_lease))).await.unwrap();
    Churn::new("/registry/pods/", 200, 200, 60).spawn(src.clone()).await.unwrap().unwrap();
    let head = current_revision(&mut src).await.unwrap();
    informer.follow(&mut src, "/registry/", head).await.unwrap();
    let mut dst = target.client().await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "before the source is lost").await;

    source.node(0).kill().await.unwrap();
    agent.kill9().await.unwrap();
    let out = agent_command(&cfg, "failover", &[]).await.unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains(&format!("R = Rs = {head}")), "{said}");

    assert!(said.contains("leases          1 swapped for their source TTL (1 keys put again"), "{said}");
    let swapped = dst.get("/registry/leases/node-a", None).await.unwrap().kvs()[0].lease();
    assert!(swapped != 0 && swapped != node_lease, "the key is under a new lease");
    let ttl = dst.lease_time_to_live(swapped, None).await.unwrap().granted_ttl();
    assert_eq!(ttl, 30, "the new lease has the source's TTL, not exact_lease_hold");
    for i in 0..3 {
        dst.put(format!("/registry/pods/after-{i}"), "new", None).await.unwrap();
    }
    let end = current_revision(&mut dst).await.unwrap();
    informer.follow(&mut dst.clone(), "/registry/", end).await.expect("the informer goes on from the target");
    let (_, keys) = keyspace(&mut dst).await.unwrap();
    let target_cache: std::collections::BTreeMap<Vec<u8>, (Vec<u8>, i64)> = keys
        .into_iter()
        .filter(|k| k.key.starts_with(b"/registry/"))
        .map(|k| (k.key, (k.value, k.revisions.1)))
        .collect();
    assert_eq!(informer.cache, target_cache, "the informer's cache is the target's state");

    agent.restart().await.unwrap();
    let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    assert_eq!(failed.last_error.map(|e| e.reason.as_str().to_owned()).as_deref(), Some("TargetPromoted"));
}

/// Failover when the link had seen source revisions it had not landed (R < Rs: the agent was
/// catching up through a slow target when the source died): the target is compacted past Rs,
/// so an informer that saw a revision the target lacks is refused ("compacted") and relists;
/// the target takes writes.
#[tokio::test]
async fn after_failover_behind_what_clients_saw_they_relist() {
    let mut source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 20, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let proxies = target.proxies().await.unwrap();
    let mut cfg = exact_config(&source, &target, "k8s-dr");
    cfg.target = proxies.endpoints();
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    src.put("/registry/pods/first", "1", None).await.unwrap();
    let mut dst = target.client().await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "before").await;

    // The agent is down while the source takes 100 revisions; it comes back through a slow
    // target, sees them all (the watch's header) and lands a few before the source dies.
    agent.kill9().await.unwrap();
    Churn::new("/registry/pods/", 100, 500, 30).spawn(src.clone()).await.unwrap().unwrap();
    let seen = Informer::list(&mut src, "/registry/").await;
    proxies.delay(Duration::from_millis(100));
    agent.restart().await.unwrap();
    let start = current_revision(&mut dst).await.unwrap();
    agent.wait_for("a few landed", SYNC_TIMEOUT, |s| s.watermark > start + 2).await.unwrap();
    source.node(0).kill().await.unwrap();
    agent.kill9().await.unwrap();
    proxies.heal();

    let out = agent_command(&cfg, "failover", &[]).await.unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains(&format!("Rs = {}", seen.at)) && said.contains("compacted at"), "{said}");
    let mut informer = seen;
    let refused = informer.follow(&mut dst, "/registry/", informer.at + 1).await;
    assert!(refused.as_ref().is_err_and(|e| e.starts_with("compacted")), "{refused:?}");
    dst.put("/registry/pods/after", "new", None).await.expect("the target takes writes");

    // The old source back: failback-plan lists the revisions it took above R.
    let r: i64 = said.split("R = ").nth(1).and_then(|t| t.split(';').next()).unwrap().parse().unwrap();
    source.node(0).start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.jsonl");
    let args = ["--promoted-watermark", &r.to_string(), "--out", plan.to_str().unwrap()];
    let out = agent_command(&cfg.reversed(), "failback-plan", &args).await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = std::fs::read_to_string(&plan).unwrap().lines().count();
    assert!(lines as i64 > informer.at - r, "{lines} lines for the revisions above {r}");
}

/// `cutover` of an exact link: once the writes stop, the agents land the source's last
/// revision, the sides are verified equal there and the target is promoted; the agent stops
/// with `TargetPromoted`, and a leased key's lease is swapped for the source's TTL.
#[tokio::test]
async fn cutover_of_an_exact_link_promotes_a_verified_target() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 30, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let lease = src.lease_grant(40, None).await.unwrap().id();
    src.put("/registry/leases/node-b", "up", Some(PutOptions::new().with_lease(lease))).await.unwrap();
    Churn::new("/registry/pods/", 150, 300, 40).spawn(src.clone()).await.unwrap().unwrap();
    let drain = current_revision(&mut src).await.unwrap();

    let out = agent_command(&cfg, "cutover", &["--wait"]).await.unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains(&format!("source revision {drain} verified equal")), "{said}");
    assert!(said.contains("1 swapped"), "{said}");
    let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    assert_eq!(failed.last_error.map(|e| e.reason.as_str().to_owned()).as_deref(), Some("TargetPromoted"));
    let mut dst = target.client().await.unwrap();
    let kept = dst.get("/registry/leases/node-b", None).await.unwrap().kvs()[0].lease();
    assert_eq!(dst.lease_time_to_live(kept, None).await.unwrap().granted_ttl(), 40);
}

/// Several Txns in flight (`exact_txns_in_flight = 4`) under an open-loop burst: etcd runs some
/// out of order, they fail their fence compare and are sent again in order (counted in
/// `exact.resent`), and the replica is exact, its history the source's event for event.
#[tokio::test]
async fn txns_in_flight_land_in_order_whatever_etcd_runs_first() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 20, 16).await.unwrap();
    let r0 = seed(&source, &mut target, "seed").await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr").overlay("[sync]\nexact_txns_in_flight = 4");
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

/// An exact link seeded while the source keeps a 3 s lease alive with a key under it (as a
/// Kubernetes master lease), its agent started and caught up with a first write.
struct LeasedLink {
    source: EtcdCluster,
    target: EtcdCluster,
    src: Client,
    dst: Client,
    cfg: harness::AgentConfig,
    agent: AgentProcess,
    /// Keeps the lease alive on the source until aborted.
    keeper: tokio::task::JoinHandle<()>,
}

async fn seeded_with_a_short_lease() -> LeasedLink {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    let lease = src.lease_grant(3, None).await.unwrap().id();
    let keeper = keep_alive(src.clone(), lease);
    src.put("/registry/masterleases/a", "10.0.0.1", Some(PutOptions::new().with_lease(lease))).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr");
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

/// The checkpoint deleted on the target by another writer: the next Txn finds no fence where
/// its predecessor's landing left one, and the link stops with `ForeignWrite` instead of
/// sending that Txn again and again as if etcd had run it too early.
#[tokio::test]
async fn a_deleted_checkpoint_stops_the_link() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 10, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let mut dst = target.client().await.unwrap();
    for i in 0..3 {
        src.put(format!("/registry/pods/n{i}"), "1", None).await.unwrap();
    }
    assert_exact(&agent, &mut src, &mut dst, "after the seed").await;
    // Deleted and the source written at once, before the agent's idle fence check looks.
    dst.delete(cfg.parsed().unwrap().checkpoint_key(), None).await.unwrap();
    src.put("/registry/pods/n9", "1", None).await.unwrap();
    let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    let err = failed.last_error.expect("a last error");
    assert_eq!(err.reason.as_str(), "ForeignWrite", "{}", err.message);
    assert_eq!(
        dst.get("/registry/pods/n9", None).await.unwrap().count(),
        0,
        "nothing landed after the delete"
    );
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
