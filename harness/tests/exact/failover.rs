//! After a failover or a cutover of an exact link: what a list-then-watch client sees on the
//! target, at the head and behind what it saw on the source.

use std::time::Duration;

use etcd_client::{Client, GetOptions, PutOptions};
use harness::exact::{exact_config, keyspace, refuses_read_at, seed};
use harness::scenario::{current_revision, SYNC_TIMEOUT};
use harness::{agent_command, load_keys, AgentProcess, Churn, EtcdCluster, EtcdVersion, Proxies};
use mirror_core::Phase;

use super::{assert_exact, cluster};

/// A source of `pods` keys under `/registry/pods/`, seeded into a target (3.5.30 both), and the
/// exact link's config between them (link `k8s-dr`).
async fn seeded(pods: usize) -> (EtcdCluster, EtcdCluster, Client, harness::AgentConfig) {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", pods, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr");
    (source, target, src, cfg)
}

/// Starts the link's agent, waits until the target is exact after one more put, then kills it
/// (-9) and has the source take 100 revisions it does not see.
async fn exact_then_down(cfg: &harness::AgentConfig, src: &mut Client, dst: &mut Client) -> AgentProcess {
    let mut agent = AgentProcess::start(cfg).await.unwrap();
    src.put("/registry/pods/first", "1", None).await.unwrap();
    assert_exact(&agent, src, dst, "before").await;
    agent.kill9().await.unwrap();
    Churn::new("/registry/pods/", 100, 500, 30).spawn(src.clone()).await.unwrap().unwrap();
    agent
}

/// The agent, down while the source took revisions, comes back through a slow target (the
/// target's `proxies` delayed 100 ms), sees them all (the watch's header) and lands a few; then
/// the source's member dies, and the agent is killed: R < Rs for a failover.
pub(super) async fn land_a_few_then_lose_the_source(
    agent: &mut AgentProcess,
    source: &mut EtcdCluster,
    dst: &mut Client,
    proxies: &Proxies,
) {
    proxies.delay(Duration::from_millis(100));
    agent.restart().await.unwrap();
    let start = current_revision(dst).await.unwrap();
    agent.wait_for("a few landed", SYNC_TIMEOUT, |s| s.watermark > start + 2).await.unwrap();
    source.node(0).kill().await.unwrap();
    agent.kill9().await.unwrap();
    proxies.heal();
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
/// takes writes; an agent of the link restarted afterwards stops with `TargetPromoted`. While
/// the source is idle before, `confirmed_time` in status keeps moving.
#[tokio::test]
async fn after_failover_at_the_head_an_informer_goes_on_from_the_target() {
    let (mut source, target, mut src, cfg) = seeded(50).await;
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    let mut informer = Informer::list(&mut src, "/registry/").await;
    let node_lease = src.lease_grant(30, None).await.unwrap().id();
    src.put("/registry/leases/node-a", "up", Some(PutOptions::new().with_lease(node_lease))).await.unwrap();
    Churn::new("/registry/pods/", 200, 200, 60).spawn(src.clone()).await.unwrap().unwrap();
    let head = current_revision(&mut src).await.unwrap();
    informer.follow(&mut src, "/registry/", head).await.unwrap();
    let mut dst = target.client().await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "before the source is lost").await;
    // The source idle: the agent's confirm read keeps `confirmed_time` in status moving (no
    // watch progress comes for a watch ahead of the source's revision). Before, it stayed at
    // the last revision landed, and the staleness alert fired on a quiet source.
    let idle = std::time::SystemTime::now() + Duration::from_secs(1);
    let after_idle = |s: &mirror_core::Status| {
        let at = s.confirmed_time.as_deref().and_then(|t| humantime::parse_rfc3339_weak(t).ok());
        at.is_some_and(|at| at > idle)
    };
    agent.wait_for("confirmed while the source is idle", SYNC_TIMEOUT, after_idle).await.unwrap();

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
/// the target takes writes. The `confirmed_time` it prints is from before the source passed R
/// (the source was at or below R then): before, each Txn of the catch-up stamped the time it
/// was built, seconds after the source had gone past it, and the loss window looked smaller
/// than it was.
#[tokio::test]
async fn after_failover_behind_what_clients_saw_they_relist() {
    let (mut source, target, mut src, mut cfg) = seeded(20).await;
    let proxies = target.proxies().await.unwrap();
    cfg.target = proxies.endpoints();
    let mut dst = target.client().await.unwrap();
    // The agent is down while the source takes 100 revisions; it comes back through a slow
    // target, sees them all (the watch's header) and lands a few before the source dies.
    let mut agent = exact_then_down(&cfg, &mut src, &mut dst).await;
    let seen = Informer::list(&mut src, "/registry/").await;
    let passed = std::time::SystemTime::now();
    tokio::time::sleep(Duration::from_secs(2)).await; // the record's times are in whole seconds
    land_a_few_then_lose_the_source(&mut agent, &mut source, &mut dst, &proxies).await;

    let out = agent_command(&cfg, "failover", &[]).await.unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains(&format!("Rs = {}", seen.at)) && said.contains("compacted at"), "{said}");
    let confirmed = said.split("confirmed_time  ").nth(1).and_then(|t| t.split(": ").next());
    let confirmed = confirmed.expect("a confirmed_time");
    let confirmed = humantime::parse_rfc3339_weak(confirmed).unwrap();
    assert!(confirmed <= passed, "confirmed {confirmed:?}, after the source passed R at {passed:?}: {said}");
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

/// Failover when clients of the source saw revisions the link never did: the agent was down
/// while the source took them, then the source was lost. The link's records say R = Rs, so a
/// plain failover adds nothing, and a client at the source's last revision S is below no
/// compaction: etcd takes its watch from S + 1 (a future revision) and it would miss the
/// target's new writes up to S. The operator, who knows S from the source's monitoring, runs
/// `failover --seen-revision S` again: the target is filled past S and compacted at S + 2, the
/// client's watch is refused ("compacted") and it relists; a third run finds S in the promoted
/// record. Refused, nothing written: the flag on a compact link, and a value more than a
/// million revisions past the target's.
#[tokio::test]
async fn a_failover_told_what_clients_saw_makes_them_relist() {
    let (mut source, target, mut src, cfg) = seeded(20).await;
    let mut dst = target.client().await.unwrap();
    let _agent = exact_then_down(&cfg, &mut src, &mut dst).await;
    let mut informer = Informer::list(&mut src, "/registry/").await;
    let s = informer.at;
    source.node(0).kill().await.unwrap();

    let head = current_revision(&mut dst).await.unwrap();
    let compact =
        harness::AgentConfig::new("compact-link", source.endpoints(), target.endpoints(), "/registry/");
    let out = agent_command(&compact, "failover", &["--seen-revision", &s.to_string()]).await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("nothing written: --seen-revision is for exact links"), "{err}");
    let far = (head + 1_000_001).to_string();
    let out = agent_command(&cfg, "failover", &["--seen-revision", &far]).await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("nothing written: --seen-revision {far} is 1000001 revisions past")),
        "{err}"
    );
    assert_eq!(current_revision(&mut dst).await.unwrap(), head, "the refusals wrote nothing");

    let out = agent_command(&cfg, "failover", &[]).await.unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains(&format!("every source revision the link saw: R = Rs = {head}")), "{said}");
    let promoted = current_revision(&mut dst).await.unwrap();
    assert!(
        promoted < s && !refuses_read_at(&mut dst, head).await,
        "{promoted} < {s}: a watch from {s} + 1 waits"
    );

    let out = agent_command(&cfg, "failover", &["--seen-revision", &s.to_string()]).await.unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("already promoted by a failover"), "{said}");
    assert!(
        said.contains(&format!("clients may have seen (--seen-revision; the link had seen {head})")),
        "{said}"
    );
    assert!(
        said.contains(&format!("up to Rs = {s}")) && said.contains(&format!("compacted at    {}", s + 2)),
        "{said}"
    );
    let refused = informer.follow(&mut dst, "/registry/", s + 1).await;
    assert!(refused.as_ref().is_err_and(|e| e.starts_with("compacted")), "{refused:?}");
    assert!(refuses_read_at(&mut dst, s + 1).await);

    let out = agent_command(&cfg, "failover", &[]).await.unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains(&format!("Rs = {s}")), "the promoted record holds Rs: {said}");
    dst.put("/registry/pods/after", "new", None).await.expect("the target takes writes");
}

/// `cutover` of an exact link: once the writes stop, the agents land the source's last
/// revision, the sides are verified equal there and the target is promoted; the agent stops
/// with `TargetPromoted`, and a leased key's lease is swapped for the source's TTL. The first
/// run's lease swap fails (failpoint `LEASE_SWAP_FAILS`, as a target lost after the promote
/// would): exit 6, and the run after it finds its own promote and finishes the swap. Before, it
/// said "already promoted" and exited 0, the leased keys left for `exact_lease_hold` instead of
/// the source's TTL. A `failover --seen-revision` after it writes nothing and says so.
#[tokio::test]
async fn cutover_of_an_exact_link_promotes_a_verified_target() {
    let (_source, target, mut src, cfg) = seeded(30).await;
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let lease = src.lease_grant(40, None).await.unwrap().id();
    src.put("/registry/leases/node-b", "up", Some(PutOptions::new().with_lease(lease))).await.unwrap();
    Churn::new("/registry/pods/", 150, 300, 40).spawn(src.clone()).await.unwrap().unwrap();
    let drain = current_revision(&mut src).await.unwrap();

    let refused = cfg.clone().env("MIRROR_FAILPOINT_LEASE_SWAP_FAILS", "the target lost");
    let out = agent_command(&refused, "cutover", &["--wait"]).await.unwrap();
    let (said, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(6), "{said}{err}");
    assert!(said.contains(&format!("source revision {drain} verified equal")), "{said}");
    assert!(err.contains("run `mirror-agent cutover` again"), "{err}");
    let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    assert_eq!(failed.last_error.map(|e| e.reason.as_str().to_owned()).as_deref(), Some("TargetPromoted"));
    let mut dst = target.client().await.unwrap();
    let held = dst.get("/registry/leases/node-b", None).await.unwrap().kvs()[0].lease();
    assert_ne!(dst.lease_time_to_live(held, None).await.unwrap().granted_ttl(), 40, "not swapped yet");

    let out = agent_command(&cfg, "cutover", &["--wait"]).await.unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("already promoted by a cutover"), "{said}");
    assert!(said.contains(&format!("at source revision {drain}; finishing its steps")), "{said}");
    assert!(said.contains("1 swapped"), "{said}");
    let kept = dst.get("/registry/leases/node-b", None).await.unwrap().kvs()[0].lease();
    assert_eq!(dst.lease_time_to_live(kept, None).await.unwrap().granted_ttl(), 40);
    // A failover after the cutover changes nothing, and says that what it was told goes unused.
    let head = current_revision(&mut dst).await.unwrap();
    let out = agent_command(&cfg, "failover", &["--force", "--seen-revision", &(head + 50).to_string()])
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("already promoted") && said.contains("--seen-revision not used"), "{said}");
    assert_eq!(current_revision(&mut dst).await.unwrap(), head, "nothing written");
}
