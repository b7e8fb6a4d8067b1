//! SIGHUP: live fields apply, fields that define the link are refused, restart-only, next-run
//! and next-genesis fields say so (docs/configuration.md has the column, mirror_core::Applies
//! the rule, and a test in mirror-core holds one to the other).

use std::time::Duration;

use harness::scenario;
use harness::{load_keys, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion};

/// A changed rate limit applies on SIGHUP (the tail is paced from then on); a changed prefix is
/// refused with a clear log line and replication continues unchanged.
#[tokio::test]
async fn sighup_applies_rates_and_refuses_prefix_changes() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/hup/", 100, 8).await.unwrap();
    let base = scenario::fast_config(&source, &target, "hup", "/hup/");
    let mut agent = AgentProcess::start(&base).await.unwrap();
    scenario::synced(&agent).await.unwrap();

    // Refused: the prefix defines the link.
    let mut moved = base.clone();
    moved.source_prefix = "/elsewhere/".into();
    agent.reload(moved).unwrap();
    let deadline = tokio::time::Instant::now() + scenario::SYNC_TIMEOUT;
    while !agent.log().contains("reload refused") {
        assert!(tokio::time::Instant::now() < deadline, "no refusal logged:\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(agent.log().contains("source.prefix"), "the refusal names the field:\n{}", agent.log());
    src.put("/hup/after-refusal", "1", None).await.unwrap();
    scenario::caught_up(&agent, &mut src).await.unwrap();
    let mut dst = target.client().await.unwrap();
    assert_eq!(scenario::count_prefix(&mut dst, "/hup/after-refusal").await.unwrap(), 1);

    // Applied: 20 target ops per second from now on. Restart-only: http.listen, whose change
    // is logged while the rest applies and the status stays where it was. Next run and next
    // genesis: named in a warning, the rest applies.
    let paced = base.clone().with("max_ops_per_second = 20").overlay(
        "[http]\nlisten = \"127.0.0.1:1\"\n[sync]\nmax_txn_ops = 64\n[initial_sync]\nmode = \"overwrite\"",
    );
    agent.reload(paced).unwrap();
    while !agent.log().contains("max_ops_per_second=20") {
        assert!(tokio::time::Instant::now() < deadline, "no reload logged:\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = agent.log();
    assert!(log.contains("http.listen applies only at restart") && log.contains("127.0.0.1:1"), "{log}");
    assert!(log.contains("sync.max_txn_ops: the running values stay until the next run"), "{log}");
    assert!(log.contains("initial_sync.mode: read only when an initial sync is planned"), "{log}");
    assert_eq!(agent.status().await.unwrap().link_uid, "hup", "still served on the running address");
    // Three rounds of 20 one-key revisions: each round lands (status shows what the target
    // holds), then pacing holds the next Txn for 20 ops / 20 per s = 1 s; the third round cannot
    // land in under 2 s (unpaced all three take milliseconds).
    let started = tokio::time::Instant::now();
    for round in 0..3 {
        for i in 0..20 {
            src.put(format!("/hup/paced/{round}/{i}"), "v", None).await.unwrap();
        }
        scenario::caught_up(&agent, &mut src).await.unwrap();
    }
    assert!(
        started.elapsed() >= Duration::from_millis(1_500),
        "the rate limit did not apply: {:?}",
        started.elapsed()
    );
    assert!(matches!(scenario::g3_of(&source, &target, &base).await.unwrap(), harness::G3::Holds { .. }));

    // `mirror-agent status --json` prints the same document; without it, a summary (its layout
    // is pinned by insta snapshots in mirror-agent/src/summary.rs); `--watch` refreshes it.
    let status = |args: &[&str]| {
        let mut cmd = tokio::process::Command::new(harness::agent_binary());
        cmd.args(["status", "--url", &agent.url()]).args(args);
        cmd
    };
    let out = status(&["--json"]).output().await.unwrap();
    assert!(out.status.success());
    let shown: mirror_core::Status = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown.link_uid, "hup");
    assert_eq!(shown.phase, mirror_core::Phase::Syncing);
    let out = status(&[]).output().await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.starts_with("link hup  phase syncing"), "{text}");
    assert!(
        text.contains("conditions all healthy") && !text.contains('\x1b'),
        "no colour off a terminal: {text}"
    );
    let mut watching = status(&["--watch"]).stdout(std::process::Stdio::piped()).spawn().unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    watching.start_kill().unwrap();
    let out = watching.wait_with_output().await.unwrap();
    let views = String::from_utf8_lossy(&out.stdout).matches("link hup  phase").count();
    assert!(views >= 2, "--watch refreshed {views} times in 2.5 s");
}

/// `/readyz` is 503 while the agent cannot connect (phase `connecting`) and 200 once syncing;
/// `/healthz` is 200 throughout.
#[tokio::test]
async fn readyz_follows_the_phase() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    target.node(0).stop().await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "ready", "/rdy/");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status =
        agent.wait_for("a failed connect", scenario::SYNC_TIMEOUT, |s| s.last_error.is_some()).await.unwrap();
    assert_eq!(status.phase, mirror_core::Phase::Connecting);
    assert_eq!(agent.http_code("/readyz").await.unwrap(), 503);
    assert_eq!(agent.http_code("/healthz").await.unwrap(), 200);

    target.node(0).start().await.unwrap();
    scenario::synced(&agent).await.unwrap();
    assert_eq!(agent.http_code("/readyz").await.unwrap(), 200);
}

/// `--log-format json`: every log line is a JSON object; state transitions are logged once
/// each, not per heartbeat, and values never appear.
#[tokio::test]
async fn json_logs_one_line_per_transition() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut src = source.client().await.unwrap();
    src.put("/js/a", "value-that-must-not-be-logged", None).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "json", "/js/").arg("--log-format").arg("json");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&agent).await.unwrap();
    // Several progress intervals of an idle link.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let log = agent.log();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    for l in &lines {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v.get("level").is_some() && v.get("fields").is_some(), "{l}");
    }
    let to_syncing = lines.iter().filter(|l| l.contains("\"to\":\"syncing\"")).count();
    assert_eq!(to_syncing, 1, "one line per transition:\n{log}");
    assert!(lines.len() < 20, "an idle agent must not log per heartbeat:\n{log}");
    assert!(!log.contains("value-that-must-not-be-logged"));
}
