//! One randomized chaos run with a fixed seed, as CI runs it: 60 s of faults of every kind over
//! churn on 3-member clusters, ending healed, equal and verified (`harness chaos --seed 42`).
//! A failure leaves the schedule as `chaos-42.toml` in the system temp directory.

use std::time::Duration;

use harness::chaos::{self, Fault};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_seed_42_for_60_seconds() {
    let faults: Vec<Fault> = Fault::ALL.iter().map(|(f, _)| *f).collect();
    let dir = std::env::temp_dir();
    let outcome =
        chaos::run(42, Duration::from_secs(60), &faults, dir, &harness::scenario::RunOptions::default())
            .await;
    if let Err(e) = outcome {
        panic!("chaos seed 42: {e:#}");
    }
}

/// A deliberately broken agent is caught: with the failpoint that drops the checkpoint put
/// from one fenced Txn in 50, the same chaos run fails (the agent's own fence no longer
/// matches what it wrote, or the sides diverge), so a passing chaos run means something. The
/// failpoint exists only with `mirror-core`'s `failpoints` feature, which the harness turns on
/// for the workspace's test build; the agent built alone has none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_catches_an_agent_that_drops_checkpoint_puts() {
    let faults: Vec<Fault> = Fault::ALL.iter().map(|(f, _)| *f).collect();
    let opts = harness::scenario::RunOptions {
        agent_env: vec![("MIRROR_FAILPOINT_DROP_CHECKPOINT_EVERY".into(), "50".into())],
        ..Default::default()
    };
    let outcome = chaos::run(42, Duration::from_secs(20), &faults, std::env::temp_dir(), &opts).await;
    let err = outcome.expect_err("the chaos run must catch the broken agent");
    println!("caught: {err:#}");
}

/// The runner's verdict on an agent that failed comes as soon as it is sure, not at the end of
/// the step's timeout: a wait for another phase of an agent that stays in phase `failed` (here
/// a checkpoint that does not decode) ends within seconds, naming the agent's error. The
/// chaos run above that catches the broken agent in its last `expect` waited out 3 minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_another_phase_of_a_failed_agent_ends_naming_the_error() {
    let text = r#"
name = "failed-for-good"
[source]
prefix = "/app/"
[[step]]
do = "load"
keys = 10
[[step]]
do = "start_agent"
[[step]]
do = "wait"
until = "condition:InitialSyncComplete=True"
[[step]]
do = "stop_agent"
[[step]]
do = "put"
g3_checker = false
side = "target"
checkpoint = true
value = "{not json"
[[step]]
do = "start_agent"
[[step]]
do = "expect"
phase = "syncing"
timeout = "10m"
"#;
    let scenario = harness::scenario::Scenario::parse(text).unwrap();
    let err = harness::scenario::run(&scenario, &harness::scenario::RunOptions::default())
        .await
        .expect_err("an agent in phase failed never reaches syncing");
    let err = format!("{err:#}");
    assert!(err.contains("stays in phase failed (CorruptCheckpoint"), "{err}");
}
