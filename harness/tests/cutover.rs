//! Drain and cutover against real etcd, driven through the binary.

use std::time::Duration;

use etcd_client::Client;
use harness::scenario::{self, SYNC_TIMEOUT};
use harness::{agent_command, load_keys, AgentConfig, AgentProcess, EtcdCluster};
use mirror_core::{AgentRole, Phase, Reason};
use mirror_fence::{Checkpoint, Role};

async fn pair() -> (EtcdCluster, EtcdCluster) {
    scenario::pair().await.unwrap()
}

async fn revision(c: &mut Client) -> i64 {
    scenario::current_revision(c).await.unwrap()
}

async fn checkpoint(dst: &mut Client, cfg: &AgentConfig) -> Checkpoint {
    let cp = cfg.parsed().unwrap().checkpoint_key();
    Checkpoint::decode(dst.get(cp, None).await.unwrap().kvs()[0].value()).unwrap()
}

/// With writers stopped, `cutover --wait` exits 0 and promotes the target; the running daemon
/// stands by at once, and the same daemon restarted in sync mode writes nothing afterwards.
#[tokio::test]
async fn cutover_promotes_and_fences_out_the_old_view() {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/cut/", 1_500, 16).await.unwrap();
    // Source writes outside the range move the revision past the last in-range event.
    src.put("/unrelated", "x", None).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "cut", "/cut/");
    let mut daemon = AgentProcess::start(&cfg).await.unwrap();
    daemon
        .wait_for("synced", SYNC_TIMEOUT, |s| {
            s.phase == Phase::Syncing && s.condition(mirror_core::ConditionType::InitialSyncComplete)
        })
        .await
        .unwrap();

    let out = agent_command(&cfg, "cutover", &["--wait"]).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let block: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    // Not on a terminal: the stages come as plain lines on stderr, the block alone on stdout.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        ["connecting:", "catching-up:", "draining:", "verifying:"]
            .iter()
            .any(|stage| stderr.contains(&format!("cutover: {stage}"))),
        "{stderr}"
    );
    assert_eq!(block["cutover"]["source_keys"], 1_500);
    assert_eq!(block["cutover"]["target_keys"], 1_500);
    assert!(
        block["cutover"]["drained_revision"].as_i64().unwrap()
            >= block["cutover"]["drain_target_revision"].as_i64().unwrap()
    );

    let mut dst = target.client().await.unwrap();
    let record = checkpoint(&mut dst, &cfg).await;
    assert_eq!(record.role, Role::Primary);
    assert_eq!(record.epoch, 2, "cutover claims the stored epoch + 1");

    let status = daemon.wait_for("standby", SYNC_TIMEOUT, |s| s.phase == Phase::Standby).await.unwrap();
    assert!(status.condition(mirror_core::ConditionType::Fenced), "{status:#?}");

    // The same daemon restarted in sync mode with the old view writes nothing.
    daemon.terminate().await.unwrap();
    daemon.restart().await.unwrap();
    daemon.wait_for("standby after restart", SYNC_TIMEOUT, |s| s.phase == Phase::Standby).await.unwrap();
    let before = revision(&mut dst).await;
    src.put("/cut/after-cutover", "1", None).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(revision(&mut dst).await, before, "nothing may be written after the cutover");
}

/// Without `--wait`, cutover returns once the drain has started: a detached process holds the
/// fence at the next epoch (the running daemon stands by at once), then drains, verifies and
/// promotes on its own, its output (the cutover block included) in `--log`.
#[tokio::test]
async fn cutover_without_wait_returns_once_the_drain_started() {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/bg/", 500, 16).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "bg", "/bg/");
    let daemon = AgentProcess::start(&cfg).await.unwrap();
    daemon
        .wait_for("synced", SYNC_TIMEOUT, |s| s.condition(mirror_core::ConditionType::InitialSyncComplete))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("cutover.log");
    let out = agent_command(&cfg, "cutover", &["--log", log.to_str().unwrap()]).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("cutover started") && stdout.contains(log.to_str().unwrap()), "{stdout}");

    // Returned with the fence claimed: the stored epoch + 1, the daemon standing by.
    let mut dst = target.client().await.unwrap();
    assert_eq!(checkpoint(&mut dst, &cfg).await.epoch, 2, "claimed when the command returned");
    daemon.wait_for("standby", SYNC_TIMEOUT, |s| s.phase == Phase::Standby).await.unwrap();

    // The detached process finishes the job by itself.
    let deadline = tokio::time::Instant::now() + SYNC_TIMEOUT;
    while checkpoint(&mut dst, &cfg).await.role != Role::Primary {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not promoted: {}",
            std::fs::read_to_string(&log).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let block = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if let Some(at) = text.find("{\n  \"cutover\"") {
            if let Ok(block) =
                serde_json::from_str::<serde_json::Value>(&text[at..text.rfind('}').unwrap() + 1])
            {
                break block;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "no cutover block in the log: {text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(block["cutover"]["source_keys"], 500);
    assert_eq!(block["cutover"]["target_keys"], 500);
}

/// The role flip alone fences the running engine (reference TestRoleFlipCutoverFence): the
/// record is rewritten to role `primary` at the *same* epoch, so no epoch rule can be what
/// stops it. The daemon's next write fails its compare, it re-reads the record, stands by with
/// `Fenced` / `TargetPromoted`, and nothing lands after the flip.
#[tokio::test]
async fn a_role_flip_at_the_same_epoch_fences_the_running_engine() {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/flip/", 200, 16).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "flip", "/flip/");
    let daemon = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&daemon).await.unwrap();

    let mut dst = target.client().await.unwrap();
    let mut record = checkpoint(&mut dst, &cfg).await;
    let epoch = record.epoch;
    record.role = Role::Primary;
    let key = cfg.parsed().unwrap().checkpoint_key();
    dst.put(key.clone(), record.encode().unwrap(), None).await.unwrap();
    let flipped = revision(&mut dst).await;

    src.put("/flip/after-the-flip", "1", None).await.unwrap();
    let status = daemon.wait_for("standby", SYNC_TIMEOUT, |s| s.phase == Phase::Standby).await.unwrap();
    let fenced = status.conditions.iter().find(|c| c.type_ == mirror_core::ConditionType::Fenced).unwrap();
    assert!(fenced.status && fenced.reason == Reason::TargetPromoted, "{status:#?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(revision(&mut dst).await, flipped, "nothing lands after the role flip");
    let after = checkpoint(&mut dst, &cfg).await;
    assert_eq!((after.role, after.epoch), (Role::Primary, epoch), "the flip alone, at the same epoch");
    assert!(dst.get("/flip/after-the-flip", None).await.unwrap().kvs().is_empty());
}

/// A daemon in `mode = "drain"` drains, verifies and promotes by itself: phase `drained`,
/// `CutoverReady`, the cutover block in status, HTTP still served.
#[tokio::test]
async fn drain_mode_daemon_reports_cutover() {
    let (source, target) = pair().await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/dr/", 800, 16).await.unwrap();
    // The periodic pass off: the drain's verification is a mandatory pass and publishes the
    // counts and its time all the same (reference #35).
    let cfg = scenario::fast_config(&source, &target, "drain", "/dr/")
        .top("mode = \"drain\"")
        .with("[reconcile]\ninterval = \"0s\"");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = agent.wait_for("drained", SYNC_TIMEOUT, |s| s.phase == Phase::Drained).await.unwrap();
    assert!(status.condition(mirror_core::ConditionType::CutoverReady), "{status:#?}");
    assert!(status.condition(mirror_core::ConditionType::InvariantsHeld), "{status:#?}");
    assert_eq!((status.source_keys, status.target_keys), (Some(800), Some(800)));
    assert_eq!(status.role, AgentRole::Primary);
    let block = status.cutover.expect("cutover block");
    assert_eq!((block.source_keys, block.target_keys), (800, 800));
    assert!(block.verified_time.is_some());
    assert_eq!(agent.http_code("/healthz").await.unwrap(), 200);
    assert_eq!(agent.http_code("/readyz").await.unwrap(), 200);
    let mut dst = target.client().await.unwrap();
    assert_eq!(checkpoint(&mut dst, &cfg).await.role, Role::Primary);
}

/// Writers not stopped: the cutover verifies what it drained but says how far the source moved
/// and exits non-zero, unless --allow-moving-source.
#[tokio::test]
async fn cutover_with_moving_source_exits_non_zero() {
    let (source, target) = pair().await;
    let (src, cfg) = synced_then_stopped(&source, &target, "moving", "/mv/", 300).await;
    let writer = {
        let mut c = src.clone();
        tokio::spawn(async move {
            for i in 0..400 {
                c.put(format!("/mv/live/{i}"), "x", None).await.unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let out = agent_command(&cfg, "cutover", &["--wait"]).await.unwrap();
    writer.await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("kept changing"), "{stderr}");
}

/// Writers that only *delete* after the drain are seen too: the check compares the source at
/// the drained revision with the source now, so deletes count (defect #12 of issue 10: a
/// min_mod_revision Get against the drain target could not see them).
#[tokio::test]
async fn cutover_sees_deletes_after_the_drain() {
    let (source, target) = pair().await;
    let (src, cfg) = synced_then_stopped(&source, &target, "deletes", "/dl/", 600).await;
    let deleter = {
        let mut c = src.clone();
        tokio::spawn(async move {
            for i in 0..500 {
                c.delete(format!("/dl/key-{i:08}"), None).await.unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let out = agent_command(&cfg, "cutover", &["--wait"]).await.unwrap();
    deleter.await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("kept changing") && stderr.contains("deleted"), "{stderr}");
}

/// Someone else keeps writing into the target range during the drain: the one repair pass
/// cannot make the sides equal, so the cutover refuses with `DrainVerificationFailed` (exit 1)
/// and the target is not promoted.
///
/// Four intruders on their own threads each put a new key after every answer: a key the repair
/// pass deleted was put again only some puts later when they cycled through five keys, and
/// under a loaded CI run the second comparison once came first (the cutover exited 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutover_refuses_when_the_target_keeps_changing_under_it() {
    let (source, target) = pair().await;
    let (_src, cfg) = synced_then_stopped(&source, &target, "intruded", "/in/", 200).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let mut intruders = tokio::task::JoinSet::new();
    for writer in 0..4 {
        let mut dst = target.client().await.unwrap();
        let stop = stop.clone();
        intruders.spawn(async move {
            let mut puts = 0u64;
            while !stop.is_cancelled() {
                dst.put(format!("/in/intruder-{writer}-{puts}"), "x", None).await.unwrap();
                puts += 1;
            }
            puts
        });
    }
    let out = agent_command(&cfg, "cutover", &["--wait"]).await.unwrap();
    stop.cancel();
    let puts: u64 = intruders.join_all().await.into_iter().sum();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("DrainVerificationFailed"), "{text}");
    assert!(puts > 0);
    let mut dst = target.client().await.unwrap();
    assert_eq!(checkpoint(&mut dst, &cfg).await.role, Role::Mirror, "not promoted");
}

/// The source goes away the moment the target is promoted: the cutover cannot check it for
/// writes after the drained revision, says so, and exits 5; the target stays primary. (The
/// source is reached through a proxy that delays it 200 ms, so the post-promotion check is
/// still dialling when the cut lands.)
#[tokio::test]
async fn cutover_that_cannot_check_the_source_exits_5() {
    let (mut source, target) = pair().await;
    let (_src, cfg) = synced_then_stopped(&source, &target, "unchecked", "/uc/", 100).await;
    let proxy = harness::FaultProxy::start(source.node(0).client_addr()).await.unwrap();
    proxy.delay(Duration::from_millis(200));
    let mut via = cfg.clone().overlay("[sync]\ndial_timeout = \"1s\"\nrequest_timeout = \"2s\"");
    via.source = vec![proxy.endpoint()];

    let mut dst = target.client().await.unwrap();
    let key = cfg.parsed().unwrap().checkpoint_key();
    let mut stream = dst.watch(key, None).await.unwrap();
    let cutter = tokio::spawn(async move {
        while let Some(resp) = stream.message().await.unwrap() {
            let promoted = resp
                .events()
                .iter()
                .filter_map(|e| e.kv())
                .any(|kv| Checkpoint::decode(kv.value()).is_ok_and(|c| c.role == Role::Primary));
            if promoted {
                proxy.cut();
                return proxy;
            }
        }
        panic!("the checkpoint watch ended before a promotion");
    });
    let out = agent_command(&via, "cutover", &["--wait"]).await.unwrap();
    let _proxy = cutter.await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{stderr}");
    assert!(stderr.contains("could not check the source"), "{stderr}");
    assert_eq!(checkpoint(&mut dst, &cfg).await.role, Role::Primary);
}

/// `keys` keys under `prefix`, mirrored by a daemon that then stops: the link is synced and no
/// agent runs when the test goes on. Returns a source client and the link's config.
async fn synced_then_stopped(
    source: &EtcdCluster,
    target: &EtcdCluster,
    link: &str,
    prefix: &str,
    keys: usize,
) -> (Client, AgentConfig) {
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, prefix, keys, 16).await.unwrap();
    let cfg = scenario::fast_config(source, target, link, prefix);
    let mut daemon = AgentProcess::start(&cfg).await.unwrap();
    daemon
        .wait_for("synced", SYNC_TIMEOUT, |s| s.condition(mirror_core::ConditionType::InitialSyncComplete))
        .await
        .unwrap();
    daemon.terminate().await.unwrap();
    (src, cfg)
}
