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
