//! The demo as a new user runs it, without a terminal: `harness demo --keys 2000 --duration 10s`
//! (what `scripts/demo.sh` runs after set-up) mirrors, shows the live view, verifies, and with
//! `--keep` leaves both sides up so this test can compare them itself.

use std::process::Stdio;
use std::time::Duration;

use harness::{difference_now, AgentConfig};
use tokio::io::{AsyncBufReadExt as _, BufReader};

/// The value after `label` on the demo's `source: URL  (etcd V)` lines.
fn endpoint(lines: &[String], label: &str) -> String {
    let line = lines.iter().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("no {label:?} line"));
    line[label.len()..].split_whitespace().next().expect("an endpoint").to_owned()
}

#[tokio::test]
async fn demo_mirrors_shows_lag_and_verifies() {
    let mut demo = tokio::process::Command::new(env!("CARGO_BIN_EXE_harness"))
        .args(["demo", "--keys", "2000", "--duration", "10s", "--keep"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("harness demo starts");
    let mut out = BufReader::new(demo.stdout.take().expect("piped stdout")).lines();
    let mut lines = Vec::new();
    let kept = tokio::time::timeout(Duration::from_secs(180), async {
        while let Some(line) = out.next_line().await.expect("readable stdout") {
            println!("demo| {line}");
            let done = line.starts_with("--keep:");
            lines.push(line);
            if done {
                return true;
            }
        }
        false
    })
    .await
    .expect("the demo reaches --keep within 3 minutes");
    let text = lines.join("\n");
    assert!(kept, "the demo ended before --keep:\n{text}");

    assert!(text.contains("initial sync: done, 2000 keys"), "the initial sync is reported:\n{text}");
    let views: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("syncing") && l.contains(" lag ") && l.contains("watermark"))
        .collect();
    assert!(views.len() >= 5, "about one live-view line a second for 10 s:\n{text}");
    assert!(
        views.iter().any(|l| !l.contains("applied 0 keys/s")),
        "the live view shows the writer's changes being applied:\n{text}"
    );
    assert!(text.contains("\nEQUAL\n"), "mirror-agent verify said EQUAL:\n{text}");
    assert!(text.contains("verify: passed"), "the demo reports the verify:\n{text}");
    assert!(text.contains("phase syncing"), "the status summary is shown:\n{text}");

    // Both sides are still up: the target equals the source, compared here, not by the agent.
    let (source, target) = (endpoint(&lines, "source: "), endpoint(&lines, "target: "));
    let config = AgentConfig::new("demo", vec![source.clone()], vec![target.clone()], "/demo/");
    let rewriter = config.parsed().expect("demo config").rewriter();
    let mut s = etcd_client::Client::connect([source], None).await.expect("source reachable");
    let mut t = etcd_client::Client::connect([target], None).await.expect("target reachable");
    let keys = s
        .get("/demo/", Some(etcd_client::GetOptions::new().with_prefix().with_count_only()))
        .await
        .expect("count")
        .count();
    assert!(keys > 2000, "the writer added keys to the 2000 seeded ({keys})");
    assert_eq!(difference_now(&mut s, &mut t, &rewriter).await.expect("readable"), None);

    // SIGTERM: everything stops and the demo exits 0.
    harness::send_signal(demo.id().expect("running"), libc::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(60), demo.wait())
        .await
        .expect("the demo stops within 60 s of SIGTERM")
        .expect("wait");
    assert!(status.success(), "demo exit status {status}");
}
