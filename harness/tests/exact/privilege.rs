//! Exact mode under users that hold key permissions only, as docs/exact-revisions.md lists
//! them: the source user reads the whole keyspace; the target user, added on the restored
//! target (the restore copies the source's auth store), reads and writes it. Neither has the
//! root role, which etcd 3.5 requires for a compaction and 3.4 does not.

use etcd_client::{Permission, PutOptions};
use harness::exact::{exact_config, refuses_read_at, seed, snapshot_save_once, SnapshotSave};
use harness::scenario::{current_revision, SYNC_TIMEOUT};
use harness::{agent_command, load_keys, AgentProcess, Churn, EtcdCluster, EtcdVersion};
use mirror_core::{Auth, Phase, Reason};
use rstest::rstest;

use super::{assert_exact, cluster, keep_alive};

/// `[source.auth]` and `[target.auth]` of the two users.
fn auth_toml(source: &Auth, target: &Auth) -> String {
    let file = |a: &Auth| a.password_file.as_ref().expect("a password file").display().to_string();
    format!(
        "[source.auth]\nusername = {:?}\npassword_file = {:?}\n[target.auth]\nusername = {:?}\npassword_file = {:?}\n",
        source.username,
        file(source),
        target.username,
        file(target)
    )
}

/// Every key: from "\0" on.
fn all_keys(p: fn(Vec<u8>) -> Permission) -> Vec<Permission> {
    vec![p(vec![0]).with_from_key()]
}

/// A source with auth on, 20 keys and its user `reader` (read on every key), and a target
/// restored from its snapshot with the user `replica` (readwrite on every key) added there.
struct Restored {
    source: EtcdCluster,
    target: EtcdCluster,
    src: etcd_client::Client,
    reader: Auth,
    replica: Auth,
}

async fn restored_under_users(version: EtcdVersion) -> Restored {
    let mut source = cluster(version).await;
    let mut target = cluster(version).await;
    let reader = source.enable_auth("reader", all_keys(Permission::read)).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 20, 16).await.unwrap();
    target.logs_in_as_root_of(&source);
    seed(&source, &mut target, "seed").await.unwrap();
    let replica = target.add_user("replica", all_keys(Permission::read_write)).await.unwrap();
    Restored { source, target, src, reader, replica }
}

/// The tail, a lease the source keeps alive, the source's compaction and `verify` under those
/// users; then a failover behind what clients saw (R < Rs), which compacts the target past Rs.
/// On 3.4 the target user compacts: the target follows the source's compaction and the
/// failover ends with 0. On 3.5 both compactions are refused to it: the replica goes on exact
/// (phase syncing, `last_error` PermissionDenied naming the compaction and the command that
/// allows it), and the failover promotes, then ends with exit 6 naming the compaction to run
/// as root; run again after it, it finishes. Before, the tail's refused compaction stopped the
/// replica for good (a permanent error parks exact mode), and a failover that failed after its
/// promote said "already primary" when run again, its fillers, compaction and lease swap never
/// done.
#[rstest]
#[case::v3_5_30(EtcdVersion::V3_5_30)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn an_exact_replica_under_least_privilege_users(#[case] version: EtcdVersion) {
    let root_compacts_only = version != EtcdVersion::V3_4_23;
    let Restored { mut source, target, mut src, reader, replica } = restored_under_users(version).await;
    let proxies = target.proxies().await.unwrap();
    let mut cfg = exact_config(&source, &target, "k8s-dr").overlay(&auth_toml(&reader, &replica));
    cfg.target = proxies.endpoints();
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    // A node lease the source keeps alive: the agent grants it on the target for
    // `exact_lease_hold`, and the failover swaps it for the source's TTL.
    let lease = src.lease_grant(30, None).await.unwrap().id();
    src.put("/registry/leases/node-a", "up", Some(PutOptions::new().with_lease(lease))).await.unwrap();
    let _kept = keep_alive(src.clone(), lease);

    Churn::new("/registry/pods/", 200, 200, 20).spawn(src.clone()).await.unwrap().unwrap();
    let compacted = current_revision(&mut src).await.unwrap();
    // Compacted only once the agent has the history (no spool here): a compaction past what
    // its watch has read is a re-seed, rightly (a CI run with three busy lanes compacted
    // before the agent's first watch opened, and it stopped with ReseedRequired).
    agent.wait_for("the churn applied", SYNC_TIMEOUT, |s| s.watermark >= compacted).await.unwrap();
    src.compact(compacted, None).await.unwrap();
    src.put("/registry/pods/after-compaction", "1", None).await.unwrap();
    let mut dst = target.client().await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "under least-privilege users").await;
    // The compaction is learned and followed every 10 s.
    let followed = agent
        .wait_for("the compaction followed or refused", SYNC_TIMEOUT, |s| {
            s.exact.as_ref().is_some_and(|e| e.compacted_revision == compacted)
                || s.last_error.as_ref().is_some_and(|e| e.reason == Reason::PermissionDenied)
        })
        .await
        .unwrap();
    if root_compacts_only {
        let said = followed.last_error.expect("the refusal in last_error");
        assert_eq!(said.reason, Reason::PermissionDenied, "{}", said.message);
        assert!(said.message.contains(&format!("compacting the target at {compacted}")), "{}", said.message);
        assert_eq!(said.fix.as_deref().map(|f| f.contains("user grant-role replica root")), Some(true));
        assert!(!refuses_read_at(&mut dst, compacted - 1).await, "the target was not compacted");
    } else {
        assert!(followed.last_error.is_none(), "{:?}", followed.last_error);
        assert!(refuses_read_at(&mut dst, compacted - 1).await, "the target follows the source's compaction");
    }
    src.put("/registry/pods/after-refusal", "1", None).await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the compaction check").await;
    assert_eq!(agent.status().await.unwrap().phase, Phase::Syncing);
    let verified = agent_command(&cfg, "verify", &[]).await.unwrap();
    let said = String::from_utf8_lossy(&verified.stdout);
    assert_eq!(verified.status.code(), Some(0), "verify under those users: {said}");
    assert!(said.contains("EQUAL"), "{said}");

    // The agent is down while the source takes 100 revisions; it comes back through a slow
    // target, sees them all and lands a few before the source dies: R < Rs.
    agent.kill9().await.unwrap();
    Churn::new("/registry/pods/", 100, 500, 20).spawn(src.clone()).await.unwrap().unwrap();
    let rs = current_revision(&mut src).await.unwrap();
    super::failover::land_a_few_then_lose_the_source(&mut agent, &mut source, &mut dst, &proxies).await;

    let out = agent_command(&cfg, "failover", &[]).await.unwrap();
    let (said, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("the target is primary"), "{said}{err}");
    if root_compacts_only {
        assert_eq!(out.status.code(), Some(6), "{said}{err}");
        let command = format!("--user root compact {}", rs + 2);
        assert!(err.contains(&command) && err.contains("run `mirror-agent failover` again"), "{err}");
        assert!(!refuses_read_at(&mut dst, rs + 1).await, "nothing compacted yet");
        // The operator compacts as root, and runs the failover again.
        dst.compact(rs + 2, None).await.unwrap();
        let out = agent_command(&cfg, "failover", &[]).await.unwrap();
        let (said, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{said}{err}");
        assert!(said.contains("already promoted by a failover"), "{said}");
        assert!(said.contains(&format!("Rs = {rs}")) && said.contains("compacted at"), "{said}");
        assert!(said.contains("leases          1 swapped"), "the lease swap ran on the second run: {said}");
    } else {
        assert_eq!(out.status.code(), Some(0), "{said}{err}");
        assert!(said.contains(&format!("Rs = {rs}")) && said.contains("compacted at"), "{said}");
        assert!(said.contains("leases          1 swapped"), "{said}");
    }
    assert!(refuses_read_at(&mut dst, rs + 1).await, "a watch from up to Rs + 1 is refused");
    let swapped = dst.get("/registry/leases/node-a", None).await.unwrap().kvs()[0].lease();
    let ttl = dst.lease_time_to_live(swapped, None).await.unwrap().granted_ttl();
    assert_eq!(ttl, 30, "the node lease has the source's TTL");
    dst.put("/registry/pods/after", "new", None).await.expect("the target takes writes");
}

/// `snapshot save` as the link's source user (no `--admin-user`): etcd refuses that user the
/// Snapshot call, and the command fails (exit 1) naming the refusal and leaving none of its
/// files, so the operator's retry with `--admin-user root` starts clean and saves. Before, the
/// spool it had opened before the snapshot stayed, and the retry was refused ("exists; it is
/// never overwritten") until the operator found and removed it.
#[rstest]
#[case::v3_5_30(EtcdVersion::V3_5_30)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn snapshot_save_refused_the_snapshot_leaves_nothing_behind(#[case] version: EtcdVersion) {
    let mut source = cluster(version).await;
    let target = cluster(version).await;
    let reader = source.enable_auth("reader", all_keys(Permission::read)).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 20, 16).await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr").overlay(&auth_toml(&reader, &reader));
    let dir = tempfile::tempdir().unwrap();
    let (code, said) = snapshot_save_once(&cfg, &dir.path().join("seed.db")).await.unwrap();
    assert_eq!(code, Some(1), "{said}");
    assert!(said.to_lowercase().contains("permission denied"), "the refusal is named: {said}");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    // Only the config: `read_dir` has no order, but one name has one.
    assert_eq!(left, vec![std::ffi::OsString::from("seed.db.toml")], "no partial file left");

    let save = SnapshotSave::start_as(&cfg, source.root()).await.unwrap();
    assert_eq!(save.r0, current_revision(&mut src).await.unwrap(), "{}", save.printed);
}

/// `cutover` of an exact link under the same users (etcd 3.5.30, whose lease and compaction
/// rules are the stricter): the drain, the comparison at the drain target, the promote and the
/// lease swap all run under the source's read user and the target's readwrite user.
#[tokio::test]
async fn an_exact_cutover_under_least_privilege_users() {
    let Restored { source, target, mut src, reader, replica } =
        restored_under_users(EtcdVersion::V3_5_30).await;
    let cfg = exact_config(&source, &target, "k8s-dr").overlay(&auth_toml(&reader, &replica));
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let lease = src.lease_grant(40, None).await.unwrap().id();
    src.put("/registry/leases/node-c", "up", Some(PutOptions::new().with_lease(lease))).await.unwrap();
    let _kept = keep_alive(src.clone(), lease);
    Churn::new("/registry/pods/", 100, 200, 20).spawn(src.clone()).await.unwrap().unwrap();
    let drain = current_revision(&mut src).await.unwrap();

    let out = agent_command(&cfg, "cutover", &["--wait"]).await.unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains(&format!("source revision {drain} verified equal")), "{said}");
    assert!(said.contains("1 swapped"), "{said}");
    let failed = agent.wait_for("failed", SYNC_TIMEOUT, |s| s.phase == Phase::Failed).await.unwrap();
    assert_eq!(failed.last_error.map(|e| e.reason), Some(Reason::TargetPromoted));
    let mut dst = target.client().await.unwrap();
    let swapped = dst.get("/registry/leases/node-c", None).await.unwrap().kvs()[0].lease();
    assert_eq!(dst.lease_time_to_live(swapped, None).await.unwrap().granted_ttl(), 40);
}
