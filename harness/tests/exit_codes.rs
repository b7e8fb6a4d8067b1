//! The exit codes of every command, provoked (docs/operations.md, "Exit codes"). Codes 0, the
//! refused failover and cutover's 4 are provoked where those commands are tested (cutover.rs,
//! the failover and failback scenarios); this file takes the rest.

use harness::scenario;
use harness::{AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion};

/// Runs `mirror-agent ARGS`; its exit code and everything it printed.
async fn exit_of(args: &[&str]) -> (i32, String) {
    exit_with(&[], args).await
}

/// [`exit_of`] with failpoints armed (`MIRROR_FAILPOINT_<NAME>=value`).
async fn exit_with(failpoints: &[(&str, &str)], args: &[&str]) -> (i32, String) {
    let mut command = tokio::process::Command::new(harness::agent_binary());
    for (name, value) in failpoints {
        command.env(format!("MIRROR_FAILPOINT_{name}"), value);
    }
    let out = command.args(args).output().await.unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// An invalid config file is exit 2 from every command that reads one, and the message names
/// the field; `status` of an address nobody serves is 1.
#[tokio::test]
async fn a_bad_config_exits_2_from_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(&dir, "bad.toml", "link_uid = \"\"\n[source]\n[target]\n");
    let out = dir.path().join("plan.jsonl").display().to_string();
    let commands: [&[&str]; 7] = [
        &["check-config", &bad],
        &["run", "--config", &bad],
        &["verify", "--config", &bad],
        &["cutover", "--config", &bad, "--wait"],
        &["failover", "--config", &bad],
        &["retire", "--config", &bad],
        &["failback-plan", "--config", &bad, "--promoted-watermark", "5", "--out", &out],
    ];
    for args in commands {
        let (code, text) = exit_of(args).await;
        assert_eq!(code, 2, "{args:?}: {text}");
        assert!(text.contains("link_uid"), "{args:?} names the field: {text}");
    }
    let (code, text) = exit_of(&["status", "--url", "http://127.0.0.1:9"]).await;
    assert_eq!(code, 1, "status of nobody: {text}");
}

/// Against real clusters: 3 when a command cannot start (no checkpoint, a side unreachable),
/// 1 when it ran and says no (sides differ, a refused plan, a cutover that ended in `failed`),
/// 2 from `run` when its HTTP address cannot be bound.
#[tokio::test]
async fn commands_exit_1_when_they_say_no_and_3_when_they_cannot_start() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let quick = "[sync]\ndial_timeout = \"1s\"\nrequest_timeout = \"2s\"";
    let cfg = scenario::fast_config(&source, &target, "codes", "/codes/").overlay(quick);
    let file = write(&dir, "codes.toml", &cfg.render());
    let plan = dir.path().join("plan.jsonl").display().to_string();

    // Nothing mirrored yet: no checkpoint to cut over or fail over.
    let (code, text) = exit_of(&["cutover", "--config", &file, "--wait"]).await;
    assert_eq!(code, 3, "cutover without a checkpoint: {text}");
    let (code, text) = exit_of(&["cutover", "--config", &file]).await;
    assert_eq!(code, 3, "cutover (no --wait) without a checkpoint: {text}");
    let (code, text) = exit_of(&["failover", "--config", &file, "--force"]).await;
    assert_eq!(code, 3, "failover without a checkpoint: {text}");

    // A key only the source has: verify says the sides differ.
    let put = source.client().await.unwrap().put("/codes/only-in-source", "v", None).await.unwrap();
    let at = put.header().unwrap().revision().to_string();
    let (code, text) = exit_of(&["verify", "--config", &file, "--revision", &at]).await;
    assert_eq!(code, 1, "verify of differing sides: {text}");
    let (code, text) =
        exit_of(&["failback-plan", "--config", &file, "--promoted-watermark", "0", "--out", &plan]).await;
    assert_eq!(code, 1, "failback-plan of revision 0: {text}");

    // A target nobody serves.
    let nowhere = AgentConfig::new("codes", source.endpoints(), vec!["http://127.0.0.1:9".into()], "/codes/")
        .with(scenario::FAST_SYNC_TOML)
        .overlay(quick);
    let nowhere = write(&dir, "nowhere.toml", &nowhere.render());
    let (code, text) = exit_of(&["verify", "--config", &nowhere]).await;
    assert_eq!(code, 3, "verify with the target unreachable: {text}");
    let (code, text) = exit_of(&["cutover", "--config", &nowhere, "--wait"]).await;
    assert_eq!(code, 3, "cutover with the target unreachable: {text}");
    let (code, text) = exit_of(&["retire", "--config", &nowhere]).await;
    assert_eq!(code, 3, "retire with the target unreachable: {text}");
    let (code, text) =
        exit_of(&["failback-plan", "--config", &nowhere, "--promoted-watermark", "5", "--out", &plan]).await;
    assert_eq!(code, 3, "failback-plan with a side unreachable: {text}");

    // `run` on an HTTP address another process holds: 2, before it connects to anything.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, text) = exit_of(&["run", "--config", &file, "--listen", &addr]).await;
    assert_eq!(code, 2, "run on an address in use: {text}");
    assert!(text.contains(&addr), "names the address: {text}");

    // Link `codes` mirrors; a cutover run with another link's config finds that link's
    // checkpoint where it would write: PrefixConflict, phase failed, exit 1, nothing promoted.
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&agent).await.unwrap();
    agent.terminate().await.unwrap();
    let other = scenario::fast_config(&source, &target, "other-link", "/codes/").overlay(quick);
    let other = write(&dir, "other.toml", &other.render());
    let (code, text) = exit_of(&["cutover", "--config", &other, "--wait"]).await;
    assert_eq!(code, 1, "cutover meeting another link's checkpoint: {text}");
    assert!(text.contains("PrefixConflict"), "{text}");
    // The same without --wait: the detached process ends refused before it claims, and the
    // command says so with its code and output.
    let (code, text) = exit_of(&["cutover", "--config", &other]).await;
    assert_eq!(code, 1, "cutover (no --wait) meeting another link's checkpoint: {text}");
    assert!(text.contains("PrefixConflict") && text.contains("ended before the drain started"), "{text}");
    let (code, text) = exit_of(&["verify", "--config", &file]).await;
    assert_eq!(code, 0, "the link's own target is untouched and equal: {text}");
}

/// The two refusals no real cluster provokes on demand, each by its failpoint: `failover` says
/// no (1) when the checkpoint moves (a running agent applying) under every one of its ten claims, and `cutover` without
/// `--wait` says no (1) when its detached process has not claimed within the wait (here 2 s
/// instead of a minute: the process cannot reach the source). Neither promotes anything.
#[tokio::test]
async fn failover_and_detached_cutover_exit_1_when_they_cannot_claim() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let quick = "[sync]\ndial_timeout = \"1s\"\nrequest_timeout = \"2s\"";
    let cfg = scenario::fast_config(&source, &target, "claims", "/claims/").overlay(quick);
    let file = write(&dir, "claims.toml", &cfg.render());
    source.client().await.unwrap().put("/claims/a", "v", None).await.unwrap();
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&agent).await.unwrap();
    agent.terminate().await.unwrap();
    let key = cfg.parsed().unwrap().checkpoint_key();
    let checkpoint = || async {
        let mut kv = target.client().await.unwrap();
        let got = kv.get(key.clone(), None).await.unwrap();
        let kv = got.kvs().first().expect("the link's checkpoint").clone();
        (kv.mod_revision(), String::from_utf8_lossy(kv.value()).into_owned())
    };
    let (_, before) = checkpoint().await;
    assert!(before.contains("\"role\":\"mirror\""), "{before}");

    let (code, text) =
        exit_with(&[("FAILOVER_MOVE_FENCE", "1")], &["failover", "--config", &file, "--force"]).await;
    assert_eq!(code, 1, "failover under a moving checkpoint: {text}");
    assert!(text.contains("kept moving under ten claims"), "{text}");
    let (_, after) = checkpoint().await;
    assert!(
        after.contains("\"role\":\"mirror\"") && after.contains("\"epoch\":1,"),
        "not promoted, the epoch unchanged (the failpoint only moved the watermark): {after}"
    );

    // The source nobody serves: the detached process keeps connecting and never claims.
    let lost = AgentConfig::new("claims", vec!["http://127.0.0.1:9".into()], target.endpoints(), "/claims/")
        .with(scenario::FAST_SYNC_TOML)
        .overlay(quick);
    let lost = write(&dir, "lost.toml", &lost.render());
    let log = dir.path().join("cutover.log").display().to_string();
    let (code, text) =
        exit_with(&[("DETACHED_CLAIM_WAIT", "2s")], &["cutover", "--config", &lost, "--log", &log]).await;
    assert_eq!(code, 1, "cutover whose process has not claimed: {text}");
    assert!(text.contains("has not claimed the fence within 2s"), "{text}");
    let pid: u32 = text
        .split("`kill ")
        .nth(1)
        .and_then(|rest| rest.split('`').next())
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("the message names the process to stop: {text}"));
    // It keeps trying, as the message says; stopped here, it ends without having claimed.
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists(), "process {pid} still runs");
    harness::send_signal(pid, libc::SIGTERM);
    let (_, claimed) = checkpoint().await;
    assert_eq!(claimed, after, "nothing claimed: {}", std::fs::read_to_string(&log).unwrap_or_default());
}
