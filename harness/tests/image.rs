//! The agent image (`scripts/image.sh`, which `scripts/test.sh` runs first) is what the
//! Kubernetes manifest says it is, and runs as the manifest runs it: the manifest's args on the
//! image, a config mounted at /etc/etcd-mirror, etcd containers on their Docker networks. It
//! mirrors, answers the manifest's probes on the manifest's port, runs as the manifest's non-root
//! user, and exits 0 on SIGTERM (`docker stop`, as the kubelet stops a pod).

use std::process::Command;
use std::time::Duration;

use harness::scenario::{self, SYNC_TIMEOUT};
use harness::{
    difference_now, load_keys, AgentConfig, Backend, ClusterSpec, EtcdCluster, EtcdVersion, Scraped,
    AGENT_IMAGE,
};

const MANIFEST: &str = include_str!("../../deploy/kubernetes/etcd-mirror.yaml");

/// What the manifest's mirror-agent container declares.
#[derive(Debug)]
struct Declared {
    image: String,
    args: Vec<String>,
    container_port: u16,
    run_as_user: u32,
    liveness: String,
    readiness: String,
}

/// Reads the container spec out of the manifest's flow-style lines (`key: value`).
fn declared() -> Declared {
    let value = |key: &str| -> String {
        let line = MANIFEST
            .lines()
            .map(str::trim)
            .find_map(|l| l.strip_prefix(key).map(str::trim))
            .unwrap_or_else(|| panic!("the manifest has no {key:?} line"));
        line.to_owned()
    };
    let probe = |kind: &str| -> String {
        let mut lines = MANIFEST.lines().map(str::trim).skip_while(|l| !l.starts_with(kind));
        let http = lines.nth(1).unwrap_or_else(|| panic!("{kind} has no httpGet"));
        let path = http.split("path:").nth(1).and_then(|r| r.split(',').next()).expect("a probe path");
        assert!(http.contains("port: http"), "{kind} probes the named port http: {http}");
        path.trim().to_owned()
    };
    let run_as = value("securityContext:");
    Declared {
        image: value("image:"),
        args: serde_json::from_str(&value("args:")).expect("args is a JSON-style list"),
        container_port: value("- {name: http, containerPort:").trim_end_matches('}').trim().parse().unwrap(),
        run_as_user: run_as
            .split("runAsUser:")
            .nth(1)
            .and_then(|r| r.trim_end_matches('}').trim().parse().ok())
            .expect("runAsUser"),
        liveness: probe("livenessProbe:"),
        readiness: probe("readinessProbe:"),
    }
}

fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().expect("docker runs");
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn inspect(what: &str, format: &str) -> String {
    docker(&["inspect", "--format", format, what])
}

/// The image's metadata matches the manifest's container.
#[test]
fn manifest_matches_the_image() {
    let d = declared();
    assert_eq!(d.image, AGENT_IMAGE, "the manifest runs the image scripts/image.sh builds");
    let json = |format: &str| -> serde_json::Value {
        serde_json::from_str(&inspect(AGENT_IMAGE, format)).expect("docker inspect JSON")
    };
    assert_eq!(json("{{json .Config.Entrypoint}}"), serde_json::json!(["/usr/local/bin/mirror-agent"]));
    assert_eq!(json("{{json .Config.Cmd}}"), serde_json::json!(d.args), "manifest args = the image's CMD");
    let exposed = json("{{json .Config.ExposedPorts}}");
    assert!(exposed.get(format!("{}/tcp", d.container_port)).is_some(), "the image exposes {exposed}");
    let user = inspect(AGENT_IMAGE, "{{.Config.User}}");
    assert_eq!(user.split(':').next(), Some(d.run_as_user.to_string().as_str()), "image USER {user}");
    assert!(d.run_as_user != 0);
    assert_eq!((d.liveness.as_str(), d.readiness.as_str()), ("/healthz", "/readyz"));
}

/// The image run with the manifest's args mirrors, answers the probes, runs as the manifest's
/// user and exits 0 on SIGTERM.
#[tokio::test]
async fn the_image_runs_as_the_manifest_runs_it() {
    let d = declared();
    let spec = || ClusterSpec::new(EtcdVersion::V3_5_30).backend(Backend::Container);
    let source = EtcdCluster::start(spec()).await.unwrap();
    let target = EtcdCluster::start(spec()).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/img/", 3_000, 64).await.unwrap();

    // The config as the manifest's ConfigMap would hold it: the container sees etcd by name.
    let config = AgentConfig::new(
        "image",
        source.network_endpoints().unwrap(),
        target.network_endpoints().unwrap(),
        "/img/",
    );
    let dir = tempfile::tempdir().unwrap();
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(dir.path().join("mirror.toml"), config.render()).unwrap();
        std::fs::set_permissions(dir.path().join("mirror.toml"), std::fs::Permissions::from_mode(0o644))
            .unwrap();
    }
    let port = harness::free_ports(1).unwrap()[0];
    let name = format!("em-agent-image-{}", std::process::id());
    let mut create = vec![
        "create".to_owned(),
        "--name".into(),
        name.clone(),
        "--label".into(),
        format!("{}=1", harness::CONTAINER_LABEL),
        "--network".into(),
        source.docker_network().unwrap(),
        "--publish".into(),
        format!("127.0.0.1:{port}:{}", d.container_port),
        "--volume".into(),
        format!("{}:/etc/etcd-mirror:ro", dir.path().display()),
        AGENT_IMAGE.into(),
    ];
    create.extend(d.args.iter().cloned());
    let id = docker(&create.iter().map(String::as_str).collect::<Vec<_>>());
    let _cleanup = Removed(id.clone());
    docker(&["network", "connect", &target.docker_network().unwrap(), &id]);
    docker(&["start", &id]);

    let url = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + SYNC_TIMEOUT;
    loop {
        let ready = http.get(format!("{url}{}", d.readiness)).send().await.map(|r| r.status().as_u16()).ok();
        let status: Option<mirror_core::Status> = match http.get(format!("{url}/statusz")).send().await {
            Ok(r) => r.json().await.ok(),
            Err(_) => None,
        };
        if ready == Some(200)
            && status.as_ref().is_some_and(|s| s.condition(mirror_core::ConditionType::InitialSyncComplete))
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the container never became ready and synced: {ready:?} {status:#?}\n{}",
            docker(&["logs", &id])
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let live = http.get(format!("{url}{}", d.liveness)).send().await.unwrap().status();
    assert_eq!(live.as_u16(), 200);

    // Non-root: the agent process's real uid, read from the host.
    let pid = inspect(&id, "{{.State.Pid}}");
    let proc_status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = proc_status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert_eq!(uid.split_whitespace().nth(1), Some(d.run_as_user.to_string().as_str()), "{uid}");

    // Writes while running are mirrored, and the container's own /metrics counts them; then
    // SIGTERM exits 0.
    let applied_before = sample(&url, "etcd_mirror_keys_applied_total").await;
    assert!(applied_before >= 3_000.0, "the scan's 3 000 keys are counted: {applied_before}");
    load_keys(&mut src, "/img/later-", 500, 64).await.unwrap();
    let rev = scenario::current_revision(&mut src).await.unwrap();
    let deadline = tokio::time::Instant::now() + SYNC_TIMEOUT;
    loop {
        let s: mirror_core::Status =
            http.get(format!("{url}/statusz")).send().await.unwrap().json().await.unwrap();
        if s.watermark >= rev {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never caught up to {rev}: {s:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rewriter = config.parsed().unwrap().rewriter();
    let mut dst = target.client().await.unwrap();
    assert_eq!(difference_now(&mut src, &mut dst, &rewriter).await.unwrap(), None);
    let applied_after = sample(&url, "etcd_mirror_keys_applied_total").await;
    assert!(applied_after >= applied_before + 500.0, "{applied_before} -> {applied_after}");
    assert!(sample(&url, "etcd_mirror_watermark").await >= rev as f64);

    docker(&["stop", "--time", "30", &id]);
    assert_eq!(inspect(&id, "{{.State.ExitCode}}"), "0", "{}", docker(&["logs", &id]));
    let logs = Command::new("docker").args(["logs", &id]).output().unwrap();
    let logs = format!("{}{}", String::from_utf8_lossy(&logs.stdout), String::from_utf8_lossy(&logs.stderr));
    assert!(
        logs.lines().any(|l| serde_json::from_str::<serde_json::Value>(l).is_ok()),
        "--log-format json gives JSON lines:\n{logs}"
    );
}

/// The value of the unlabelled sample `name` in the agent's `/metrics`.
async fn sample(url: &str, name: &str) -> f64 {
    let scraped = Scraped::get(url).await.unwrap();
    scraped.sample(name).unwrap_or_else(|| panic!("no sample {name} in /metrics:\n{}", scraped.text()))
}

/// Removes the container, also when the test fails.
struct Removed(String);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rm", "--force", &self.0]).output();
    }
}
