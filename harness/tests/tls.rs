//! TLS on both sides against etcd servers that require client certificates: mirroring (also
//! an exact replica seeded by `snapshot save`), a wrong CA or a client certificate the server does
//! not trust (clear, permanent errors), and rotating the target's certificates and CA on disk
//! with no agent restart.

use std::time::Duration;

use harness::pki::{self, Pki, Validity};
use harness::{load_keys, scenario, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion, G3};
use mirror_core::Phase;
use rstest::rstest;

/// A TLS cluster of etcd 3.5.30 serving the PKI generated into `dir/name`.
async fn tls_cluster(dir: &std::path::Path, name: &str, validity: Validity) -> (Pki, EtcdCluster) {
    let pki = Pki::generate(&dir.join(name), name, validity).unwrap();
    let cluster = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30).tls(&pki)).await.unwrap();
    (pki, cluster)
}

/// The agent's own copy of a PKI's files (what a mounted secret would be).
fn agent_copy(pki: &Pki, dir: &std::path::Path) -> Pki {
    std::fs::create_dir_all(dir).unwrap();
    pki.install_over(dir).unwrap();
    Pki { dir: dir.to_owned(), ..pki.clone() }
}

/// Starts an agent on `cfg` that must fail permanently with `reason`, naming the target in
/// `last_error` and on the `TargetReachable` condition, having written nothing. Returns the
/// error message.
async fn fails_with(cfg: &AgentConfig, reason: &str) -> String {
    let agent = AgentProcess::start(cfg).await.unwrap();
    let status =
        agent.wait_for("failed", Duration::from_secs(60), |s| s.phase == Phase::Failed).await.unwrap();
    let err = status.last_error.clone().unwrap();
    assert_eq!((err.class, err.reason.as_str()), (mirror_core::ErrorClass::Permanent, reason), "{status:#?}");
    assert!(err.message.contains("target"), "{}", err.message);
    let cond =
        status.conditions.iter().find(|c| c.type_ == mirror_core::ConditionType::TargetReachable).unwrap();
    assert_eq!((cond.status, cond.reason.as_str()), (false, reason), "{status:#?}");
    assert_eq!(status.keys_applied_total, 0);
    err.message
}

/// `etcd_mirror_tls_cert_expiry_timestamp_seconds{side,kind}` as scraped from the agent.
async fn cert_expiry(agent: &AgentProcess, side: &str, kind: &str) -> Option<i64> {
    let series = format!("etcd_mirror_tls_cert_expiry_timestamp_seconds{{side=\"{side}\",kind=\"{kind}\"}}");
    agent.metrics().await.ok()?.sample(&series).map(|v| v as i64)
}

/// Both servers require client certificates: the agent mirrors, reports the expiry of what it
/// loaded, and survives a rotation of the target's CA and client certificate on disk (new
/// files first, then the server restarted on its new certificates) without a restart.
#[tokio::test]
async fn mirrors_with_client_certificates_and_survives_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let (src_pki, source) = tls_cluster(dir.path(), "source", Validity::default()).await;
    let (dst_pki, mut target) = tls_cluster(dir.path(), "target", Validity::default()).await;
    let src_files = agent_copy(&src_pki, &dir.path().join("agent-source"));
    let dst_files = agent_copy(&dst_pki, &dir.path().join("agent-target"));
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/tls/", 300, 16).await.unwrap();

    let cfg = AgentConfig::new("tls", source.endpoints(), target.endpoints(), "/tls/")
        .with(scenario::FAST_SYNC_TOML)
        .with(&src_files.toml("source"))
        .with(&dst_files.toml("target"));
    assert!(source.endpoints()[0].starts_with("https://"), "{:?}", source.endpoints());
    let agent = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&agent).await.unwrap();
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 300, .. }));
    assert_eq!(cert_expiry(&agent, "target", "client").await, Some(dst_pki.client_not_after));
    assert!(cert_expiry(&agent, "source", "ca").await.is_some());
    let pid = agent.pid();

    // Rotate the target to a new CA: the agent's files first, then the server's, then the
    // server restarts on them. The old CA is gone everywhere.
    let rotated = Validity { ca_until: (2041, 2, 2), leaf_until: (2037, 3, 3) };
    let new_pki = Pki::generate(&dir.path().join("target-rotated"), "target-rotated", rotated).unwrap();
    new_pki.install_over(&dst_files.dir).unwrap();
    new_pki.install_over(&dst_pki.dir).unwrap();
    target.node(0).stop().await.unwrap();
    target.node(0).start().await.unwrap();

    src.put("/tls/after-rotation", "1", None).await.unwrap();
    scenario::caught_up(&agent, &mut src).await.unwrap();
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 301, .. }));
    assert_eq!(agent.pid(), pid, "the agent must not have restarted");
    let status = agent.status().await.unwrap();
    assert_eq!(status.phase, Phase::Syncing, "{status:#?}");
    assert_eq!(cert_expiry(&agent, "target", "client").await, Some(new_pki.client_not_after));
}

/// The agent trusts the wrong CA for the target, or shows the target a client certificate of
/// another CA: the agent fails before writing anything, permanently, with the reason
/// `TlsRejected` on the target's condition and a message that says what was refused.
#[rstest]
#[case::server_cert_from_unknown_ca(pki::CA, "not signed by a CA in target.tls.ca_file")]
#[case::client_cert_from_unknown_ca(pki::CLIENT_CERT, "the server refused our client certificate")]
#[tokio::test]
async fn a_wrong_ca_is_a_clear_permanent_error(#[case] swapped: &str, #[case] says: &str) {
    let dir = tempfile::tempdir().unwrap();
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let (dst_pki, target) = tls_cluster(dir.path(), "target", Validity::default()).await;
    let other = Pki::generate(&dir.path().join("other"), "other", Validity::default()).unwrap();
    let files = agent_copy(&dst_pki, &dir.path().join("agent-target"));
    std::fs::copy(other.path(swapped), files.path(swapped)).unwrap();
    if swapped == pki::CLIENT_CERT {
        std::fs::copy(other.path(pki::CLIENT_KEY), files.path(pki::CLIENT_KEY)).unwrap();
    }
    let cfg = scenario::fast_config(&source, &target, "wrongca", "/wca/").with(&files.toml("target"));
    let message = fails_with(&cfg, "TlsRejected").await;
    assert!(message.contains(says), "{message}");
}

/// A TLS file that is missing is refused before any connect, naming the field: permanent,
/// reason `TlsConfig`.
#[tokio::test]
async fn a_missing_tls_file_names_its_field() {
    let dir = tempfile::tempdir().unwrap();
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let (dst_pki, target) = tls_cluster(dir.path(), "target", Validity::default()).await;
    let files = agent_copy(&dst_pki, &dir.path().join("agent-target"));
    std::fs::remove_file(files.path(pki::CLIENT_KEY)).unwrap();
    let cfg = scenario::fast_config(&source, &target, "notls", "/ntl/").with(&files.toml("target"));
    let message = fails_with(&cfg, "TlsConfig").await;
    assert!(message.contains("target.tls.key_file: cannot read"), "{message}");
}

/// `insecure_skip_verify` with its acknowledgement and no CA: the server's certificate is not
/// checked (the server still checks ours), and the agent mirrors.
#[tokio::test]
async fn insecure_skip_verify_mirrors_without_a_ca() {
    let dir = tempfile::tempdir().unwrap();
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let (dst_pki, target) = tls_cluster(dir.path(), "target", Validity::default()).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/skv/", 50, 8).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "skipverify", "/skv/").with(&format!(
        "[target.tls]\ncert_file = {:?}\nkey_file = {:?}\ninsecure_skip_verify = true\ninsecure_skip_verify_acknowledge_risk = true\n",
        dst_pki.path(pki::CLIENT_CERT),
        dst_pki.path(pki::CLIENT_KEY)
    ));
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&agent).await.unwrap();
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 50, .. }));
    // Said once, at start, for the side that skips (issue #25, upstream #116); a reload that
    // keeps it on does not say it again.
    agent.reload(cfg.clone()).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !agent.log().contains("config reloaded") {
        assert!(tokio::time::Instant::now() < deadline, "no reload:\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = agent.log();
    assert_eq!(log.matches("insecure_skip_verify is on").count(), 1, "{log}");
    assert!(
        log.contains("target.tls.insecure_skip_verify is on") && !log.contains("source.tls.insecure"),
        "{log}"
    );
}

/// A side with TLS and no `ca_file` verifies the server against the system's roots (reference
/// #93): with the target's CA as the system bundle (`SSL_CERT_FILE`, which the native-roots
/// loader reads instead of the platform store) the agent mirrors; with another CA there, the
/// handshake is refused (`TlsRejected`), so the roots are really the ones checked.
#[tokio::test]
async fn without_a_ca_file_the_system_roots_verify_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let (dst_pki, target) = tls_cluster(dir.path(), "target", Validity::default()).await;
    let other = Pki::generate(&dir.path().join("other"), "other", Validity::default()).unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/roots/", 50, 8).await.unwrap();
    let client_only = format!(
        "[target.tls]\ncert_file = {:?}\nkey_file = {:?}\n",
        dst_pki.path(pki::CLIENT_CERT),
        dst_pki.path(pki::CLIENT_KEY)
    );
    let with_roots = |link: &str, ca: std::path::PathBuf| {
        scenario::fast_config(&source, &target, link, "/roots/")
            .with(&client_only)
            .env("SSL_CERT_FILE", &ca.display().to_string())
            .env("SSL_CERT_DIR", &dir.path().join("no-such-dir").display().to_string())
    };

    let message = fails_with(&with_roots("roots-other", other.path(pki::CA)), "TlsRejected").await;
    assert!(message.contains("not signed by a CA") && message.contains("system's CA roots"), "{message}");

    let cfg = with_roots("roots-system", dst_pki.path(pki::CA));
    let agent = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&agent).await.unwrap();
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 50, .. }));
}

/// Waits until the agent reports `want` as the target's client certificate expiry.
async fn wait_client_expiry(agent: &AgentProcess, want: i64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while cert_expiry(agent, "target", "client").await != Some(want) {
        assert!(tokio::time::Instant::now() < deadline, "the agent never loaded the new client certificate");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A client certificate reissued in place (same paths, same CA) is picked up by the running
/// agent without a restart, a signal or a server restart; so is a SIGHUP that points the target
/// at other files. Replication continues after each.
#[tokio::test]
async fn rotated_files_and_reloaded_paths_are_picked_up_while_running() {
    let dir = tempfile::tempdir().unwrap();
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let (dst_pki, target) = tls_cluster(dir.path(), "target", Validity::default()).await;
    let files = agent_copy(&dst_pki, &dir.path().join("agent-target"));
    let mut src = source.client().await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "rotate", "/rot/").with(&files.toml("target"));
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&agent).await.unwrap();
    wait_client_expiry(&agent, dst_pki.client_not_after).await;
    let pid = agent.pid();

    let reissued = files.reissue_client((2034, 4, 4)).unwrap();
    wait_client_expiry(&agent, reissued.client_not_after).await;
    src.put("/rot/a", "1", None).await.unwrap();
    scenario::caught_up(&agent, &mut src).await.unwrap();

    let elsewhere =
        agent_copy(&dst_pki, &dir.path().join("agent-target-2")).reissue_client((2035, 5, 5)).unwrap();
    let reloaded = scenario::fast_config(&source, &target, "rotate", "/rot/").with(&elsewhere.toml("target"));
    agent.reload(reloaded.clone()).unwrap();
    wait_client_expiry(&agent, elsewhere.client_not_after).await;
    src.put("/rot/b", "2", None).await.unwrap();
    scenario::caught_up(&agent, &mut src).await.unwrap();
    assert!(matches!(scenario::g3_of(&source, &target, &reloaded).await.unwrap(), G3::Holds { keys: 2, .. }));
    assert_eq!(agent.pid(), pid, "the agent must not have restarted");
    assert!(agent.log().contains("TlsFilesChanged"), "{}", agent.log());
    assert!(agent.log().contains("ConnectionSettingsReloaded"), "{}", agent.log());
}

/// `server_name` is the name the server certificate is verified against: `localhost` (in the
/// test certificate) mirrors over an IP endpoint; a name the certificate lacks is refused,
/// saying so.
#[tokio::test]
async fn server_name_is_the_name_verified() {
    let dir = tempfile::tempdir().unwrap();
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let (dst_pki, target) = tls_cluster(dir.path(), "target", Validity::default()).await;
    let with_name = |link: &str, prefix: &str, name: &str| {
        scenario::fast_config(&source, &target, link, prefix)
            .with(&format!("{}server_name = {name:?}\n", dst_pki.toml("target")))
    };
    let good = AgentProcess::start(&with_name("sn-good", "/sng/", "localhost")).await.unwrap();
    scenario::synced(&good).await.unwrap();

    let message = fails_with(&with_name("sn-bad", "/snb/", "db.invalid"), "TlsRejected").await;
    assert!(message.contains("not valid for the name checked: target.tls.server_name"), "{message}");
}

/// Over https with least-privilege users (SPEC §11): etcd 3.5.30 refuses Maintenance Status to
/// them, so the agent reads each member's `/version` with the side's own TLS material (CA and
/// client certificate). The version is known, not `unknown`, so progress notifications are
/// trusted by the version rule (before issue #44 every TLS cluster read `unknown` and each idle
/// proof read the whole range).
#[tokio::test]
async fn over_tls_a_least_privilege_user_learns_the_version_and_trusts_progress() {
    let dir = tempfile::tempdir().unwrap();
    let (src_pki, mut source) = tls_cluster(dir.path(), "source", Validity::default()).await;
    let (dst_pki, mut target) = tls_cluster(dir.path(), "target", Validity::default()).await;
    let src_files = agent_copy(&src_pki, &dir.path().join("agent-source"));
    let dst_files = agent_copy(&dst_pki, &dir.path().join("agent-target"));
    let read = etcd_client::Permission::read("/tlsau/").with_prefix();
    let readwrite = etcd_client::Permission::read_write("/tlsau/").with_prefix();
    let src_user = source.enable_auth("mirror", vec![read]).await.unwrap();
    let dst_user = target.enable_auth("mirror", vec![readwrite]).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/tlsau/", 200, 16).await.unwrap();
    let auth = |side: &str, user: &mirror_core::Auth| {
        let file = user.password_file.as_ref().unwrap().display().to_string();
        format!("[{side}.auth]\nusername = \"mirror\"\npassword_file = {file:?}\n")
    };
    let cfg = AgentConfig::new("tlsau", source.endpoints(), target.endpoints(), "/tlsau/")
        .with(scenario::FAST_SYNC_TOML)
        .with(&src_files.toml("source"))
        .with(&dst_files.toml("target"))
        .with(&auth("source", &src_user))
        .with(&auth("target", &dst_user));
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = scenario::synced(&agent).await.unwrap();
    for (side, seen) in [("source", &status.source.version), ("target", &status.target.version)] {
        let trusted = mirror_core::progress_notify_trustworthy(seen);
        println!("{side} over https as a least-privilege user: version {seen}, progress notifications trusted: {trusted}");
        assert_eq!(seen, EtcdVersion::V3_5_30.as_str(), "{side}: {status:#?}");
        assert!(trusted, "{side}: 3.5.30 sends trustworthy progress notifications");
    }
    src.put("/tlsau/live", "1", None).await.unwrap();
    scenario::caught_up(&agent, &mut src).await.unwrap();
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 201, .. }));
}

/// Exact mode over TLS, as a Kubernetes control plane's etcd runs (client certificates, no etcd
/// auth): `snapshot save` reads the source and spools its watch over TLS while the source takes
/// writes, the target restored from the snapshot serves its own certificates, and through churn
/// with leases the replica is exact: target revision = source revision, every key the same in
/// value, create and mod revision, version and lease.
#[tokio::test]
async fn an_exact_replica_over_tls_keeps_every_revision() {
    use harness::exact::{exact_config, SnapshotSave};
    use harness::Churn;
    let dir = tempfile::tempdir().unwrap();
    let (src_pki, source) = tls_cluster(dir.path(), "source", Validity::default()).await;
    let (dst_pki, mut target) = tls_cluster(dir.path(), "target", Validity::default()).await;
    let src_files = agent_copy(&src_pki, &dir.path().join("agent-source"));
    let dst_files = agent_copy(&dst_pki, &dir.path().join("agent-target"));
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 100, 64).await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr")
        .with(&src_files.toml("source"))
        .with(&dst_files.toml("target"));

    let save = SnapshotSave::start(&cfg).await.unwrap();
    Churn::new("/registry/pods/", 100, 200, 50).spawn(src.clone()).await.unwrap().unwrap();
    target.restore_snapshot_file(&save.file).await.unwrap();
    let mut dst = target.client().await.unwrap();
    assert_eq!(scenario::current_revision(&mut dst).await.unwrap(), save.r0, "{}", save.printed);
    let agent = AgentProcess::start(&cfg).await.unwrap();
    Churn::new("/registry/pods/", 600, 300, 100)
        .with_leases()
        .seed(2)
        .spawn(src.clone())
        .await
        .unwrap()
        .unwrap();

    exact_within(&agent, &mut src, &mut dst, "after the churn").await;
    let status = agent.status().await.unwrap();
    assert!(status.last_error.is_none(), "{:?}", status.last_error);
    assert!(status.exact.is_some_and(|e| e.landed_here > 0), "the agent landed the churn");

    // The expiry of what it loaded is reported (gauge and warning), and a client certificate
    // reissued in place is used within seconds, as in compact mode: before, exact mode
    // reported no expiry and kept the old files until a connection broke.
    wait_client_expiry(&agent, dst_pki.client_not_after).await;
    let pid = agent.pid();
    let reissued = dst_files.reissue_client((2034, 4, 4)).unwrap();
    wait_client_expiry(&agent, reissued.client_not_after).await;
    src.put("/registry/pods/after-rotation", "1", None).await.unwrap();
    exact_within(&agent, &mut src, &mut dst, "after the rotation").await;
    assert_eq!(agent.pid(), pid, "the agent must not have restarted");
    assert!(agent.log().contains("TlsFilesChanged"), "{}", agent.log());
}

/// Waits until the exact replica holds every source revision and both keyspaces agree.
async fn exact_within(
    agent: &AgentProcess,
    src: &mut etcd_client::Client,
    dst: &mut etcd_client::Client,
    when: &str,
) {
    use harness::exact::{keyspace, keyspace_difference};
    let deadline = tokio::time::Instant::now() + scenario::SYNC_TIMEOUT;
    loop {
        scenario::caught_up(agent, src).await.unwrap_or_else(|e| panic!("{when}: {e}\n{}", agent.log()));
        let (s, t) = (keyspace(src).await.unwrap(), keyspace(dst).await.unwrap());
        let Some(diff) = keyspace_difference(&s, &t) else { return };
        assert!(tokio::time::Instant::now() < deadline, "{when}: not exact: {diff}\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
