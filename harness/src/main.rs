//! `harness`: start real etcd for people, not only for tests.
//!
//! `harness demo` runs the main job on an embedded default (what `scripts/demo.sh` runs).
//! `harness scenario FILE` runs a scenario file (SPEC §8). `harness bench` prints performance
//! figures.

use clap::{Parser, Subcommand};
use harness::EtcdVersion;

#[derive(Parser)]
#[command(name = "harness", about = "Real etcd clusters and scenarios for etcd-mirror")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The main job on an embedded default: a source and a target etcd, a seeded source, the
    /// real agent mirroring with progress and a live tail view; Ctrl-C verifies and stops.
    Demo {
        /// Source etcd version (3.5.30, 3.5.16, 3.5.1 or 3.4.23).
        #[arg(long, default_value = "3.5.30")]
        source_version: String,
        /// Target etcd version (3.5.30, 3.5.16, 3.5.1 or 3.4.23).
        #[arg(long, default_value = "3.5.30")]
        target_version: String,
        /// Seed the source with this many keys under /demo/ before the agent starts.
        #[arg(long, default_value_t = 100_000)]
        keys: usize,
        /// Bytes per seeded value.
        #[arg(long, default_value_t = 100)]
        value_size: usize,
        /// Writes per second of the paced writer during the live view.
        #[arg(long, default_value_t = 200)]
        rate: u32,
        /// No writer: the live view shows an idle link.
        #[arg(long)]
        no_writer: bool,
        /// End the live view after this long (e.g. 10s) instead of at Ctrl-C.
        #[arg(long)]
        duration: Option<humantime::Duration>,
        /// After the verify, leave everything running and print how to reach it (until Ctrl-C).
        #[arg(long)]
        keep: bool,
        /// Where etcd runs: process or container (default: container when Docker answers).
        #[arg(long)]
        backend: Option<String>,
    },
    /// Run a scenario file (SPEC §8); exit 0 only when every step and check passed.
    Scenario {
        /// The scenario file.
        file: std::path::PathBuf,
        /// Overrides the file's seed.
        #[arg(long)]
        seed: Option<u64>,
        /// On failure, leave the clusters up and print how to reach them (until Ctrl-C).
        #[arg(long)]
        keep: bool,
        /// Where etcd runs: process or container (default: container when Docker answers).
        #[arg(long)]
        backend: Option<String>,
        /// Where the agents run: process or container (overrides the file's agent_backend).
        #[arg(long)]
        agent_backend: Option<String>,
    },
    /// Random faults over churn, from a seed; ends healed with expect equal and verify. On
    /// failure the schedule is written to chaos-SEED.toml for `harness scenario`.
    Chaos {
        /// The seed of the schedule.
        #[arg(long)]
        seed: u64,
        /// How long the faults go on (e.g. 60s, 5m).
        #[arg(long, default_value = "60s")]
        duration: humantime::Duration,
        /// Faults to pick from, comma-separated (default: all).
        #[arg(long, value_delimiter = ',')]
        faults: Vec<String>,
        /// Where etcd runs: process or container (default: container when Docker answers).
        #[arg(long)]
        backend: Option<String>,
    },
    /// Print performance figures, each next to a baseline measured in the same run.
    Bench {
        /// Keys for the write ceiling and the agent's initial sync.
        #[arg(long, default_value_t = 100_000)]
        keys: usize,
        /// Value size in bytes.
        #[arg(long, default_value_t = 100)]
        value_size: usize,
        /// Keys for etcdctl make-mirror (slow; 0 skips make-mirror and its tail rounds).
        #[arg(long, default_value_t = 3_000)]
        make_mirror_keys: usize,
        /// Tail write rates per second, open loop, comma-separated (each measured in turn).
        #[arg(long, value_delimiter = ',', default_values_t = [500u32, 2_000, 10_000])]
        tail_rate: Vec<u32>,
        /// Tail duration in seconds, per rate.
        #[arg(long, default_value_t = 10)]
        tail_seconds: u64,
        /// Inner Txns per nested Txn whose write ceiling is measured, comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = [4usize, 8, 16])]
        nested: Vec<usize>,
        /// Draw the lag distributions and throughput bars into this SVG file.
        #[arg(long)]
        plot: Option<std::path::PathBuf>,
        /// TOML merged over the agent's config, e.g. '[sync]\npage_key_limit = 2048'.
        #[arg(long, default_value = "")]
        agent_toml: String,
        /// Stop after the agent's initial sync (ceiling, copier and agent only).
        #[arg(long)]
        sync_only: bool,
        /// Rounds of the flat ceiling, the copier and the agent's initial sync, back to back;
        /// each figure is the median of its rounds (the machine is shared and noisy).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// etcd version of every cluster of the run (3.5.30, 3.5.16, 3.5.1 or 3.4.23).
        #[arg(long, default_value = "3.5.30")]
        version: String,
        /// Also sync the keys under this many source leases, leases stripped and preserved
        /// (0: skip).
        #[arg(long, default_value_t = 0)]
        leases: usize,
        /// Writes/s (open loop) the source takes during the loaded case: an initial sync of
        /// `--keys` keys, the minute after it, and a reconcile pass (0: skip the case).
        #[arg(long, default_value_t = 2_000)]
        load_rate: u32,
        /// Source revisions/s of the exact tail, comma-separated (empty: skip the exact section).
        #[arg(long, value_delimiter = ',', default_values_t = [500u32, 1_000])]
        exact_rate: Vec<u32>,
        /// Only the exact section (ceilings, exact tail, compact tail beside it).
        #[arg(long)]
        exact_only: bool,
    },
}

fn version(v: &str) -> anyhow::Result<EtcdVersion> {
    v.parse()
}

fn backend(b: &str) -> anyhow::Result<harness::Backend> {
    match b {
        "process" => Ok(harness::Backend::Process),
        "container" => Ok(harness::Backend::Container),
        other => anyhow::bail!("unknown backend {other:?} (process or container)"),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Scenario { file, seed, keep, backend: b, agent_backend } => {
            let opts = harness::scenario::RunOptions {
                seed,
                keep,
                backend: b.as_deref().map(backend).transpose()?,
                agent_backend: agent_backend
                    .as_deref()
                    .map(harness::scenario::AgentKind::parse)
                    .transpose()?,
                ..Default::default()
            };
            if let Err(e) = harness::scenario::run_file(&file, &opts).await {
                eprintln!("scenario failed: {e:#}");
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Demo {
            source_version,
            target_version,
            keys,
            value_size,
            rate,
            no_writer,
            duration,
            keep,
            backend: b,
        } => {
            let plan = harness::demo::DemoPlan {
                source_version: version(&source_version)?,
                target_version: version(&target_version)?,
                backend: b.as_deref().map(backend).transpose()?,
                keys,
                value_size,
                writer_rate: (!no_writer).then_some(rate),
                duration: duration.map(Into::into),
                keep,
            };
            match harness::demo::run(plan).await? {
                harness::demo::DemoEnd::Verified => Ok(()),
                harness::demo::DemoEnd::Different => std::process::exit(1),
                harness::demo::DemoEnd::Interrupted => std::process::exit(130),
            }
        }
        Command::Chaos { seed, duration, faults, backend: b } => {
            let faults = if faults.is_empty() {
                harness::chaos::Fault::ALL.iter().map(|(f, _)| *f).collect()
            } else {
                faults.iter().map(|f| harness::chaos::Fault::parse(f)).collect::<anyhow::Result<Vec<_>>>()?
            };
            let opts = harness::scenario::RunOptions {
                backend: b.as_deref().map(backend).transpose()?,
                ..Default::default()
            };
            let dir = std::env::current_dir()?;
            if let Err(e) = harness::chaos::run(seed, *duration, &faults, dir, &opts).await {
                eprintln!("chaos failed: {e:#}");
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Bench {
            keys,
            value_size,
            make_mirror_keys,
            tail_rate,
            tail_seconds,
            nested,
            plot,
            agent_toml,
            sync_only,
            rounds,
            version: v,
            leases,
            load_rate,
            exact_rate,
            exact_only,
        } => harness::bench::run(harness::bench::BenchPlan {
            version: version(&v)?,
            keys,
            value_size,
            make_mirror_keys,
            tail_rates: tail_rate,
            tail_seconds,
            nested,
            plot,
            agent_toml: agent_toml.replace("\\n", "\n"),
            sync_only,
            rounds,
            leases,
            load_rate,
            exact_rates: exact_rate,
            exact_only,
        })
        .await
        .map(drop),
    }
}
