//! `harness`: start real etcd for people, not only for tests.
//!
//! `harness demo` starts a local source and target etcd and prints how to reach them and a
//! ready-to-use agent config. `harness scenario FILE` runs a scenario file (SPEC §8).
//! `harness bench` prints performance figures.

use clap::{Parser, Subcommand};
use harness::{ClusterSpec, EtcdCluster, EtcdVersion};

#[derive(Parser)]
#[command(name = "harness", about = "Real etcd clusters and scenarios for etcd-mirror")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a source and a target etcd and keep them up until Ctrl-C.
    Demo {
        /// Source etcd version (3.5.1 or 3.4.23).
        #[arg(long, default_value = "3.5.1")]
        source_version: String,
        /// Target etcd version (3.5.1 or 3.4.23).
        #[arg(long, default_value = "3.5.1")]
        target_version: String,
        /// Seed the source with this many keys under /demo/.
        #[arg(long, default_value_t = 1000)]
        keys: usize,
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
        /// Keys for etcdctl make-mirror (slow).
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
    },
}

fn version(v: &str) -> anyhow::Result<EtcdVersion> {
    match v {
        "3.5.1" => Ok(EtcdVersion::V3_5_1),
        "3.4.23" => Ok(EtcdVersion::V3_4_23),
        other => anyhow::bail!("unsupported etcd version {other:?} (use 3.5.1 or 3.4.23)"),
    }
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
        Command::Scenario { file, seed, keep, backend: b } => {
            let opts = harness::scenario::RunOptions {
                seed,
                keep,
                backend: b.as_deref().map(backend).transpose()?,
                ..Default::default()
            };
            if let Err(e) = harness::scenario::run_file(&file, &opts).await {
                eprintln!("scenario failed: {e:#}");
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Demo { source_version, target_version, keys } => {
            demo(version(&source_version)?, version(&target_version)?, keys).await
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
        Command::Bench { keys, value_size, make_mirror_keys, tail_rate, tail_seconds, nested, plot } => {
            harness::bench::run(harness::bench::BenchPlan {
                keys,
                value_size,
                make_mirror_keys,
                tail_rates: tail_rate,
                tail_seconds,
                nested,
                plot,
            })
            .await
            .map(drop)
        }
    }
}

async fn demo(source_version: EtcdVersion, target_version: EtcdVersion, keys: usize) -> anyhow::Result<()> {
    eprintln!("starting source etcd {source_version} and target etcd {target_version} ...");
    let source = EtcdCluster::start(ClusterSpec::new(source_version)).await?;
    let target = EtcdCluster::start(ClusterSpec::new(target_version)).await?;
    let mut client = source.client().await?;
    for i in 0..keys {
        client.put(format!("/demo/key-{i:06}"), format!("value-{i}"), None).await?;
    }
    println!("source: {} (etcd {source_version}, {keys} keys under /demo/)", source.endpoints().join(","));
    println!("target: {} (etcd {target_version}, empty)", target.endpoints().join(","));
    println!();
    println!("agent config:");
    println!("{}", demo_config(&source.endpoints(), &target.endpoints()));
    println!(
        "try: ETCDCTL_API=3 {} --endpoints={} get --prefix /demo/ --keys-only | head",
        source_version.etcdctl().display(),
        source.endpoints()[0]
    );
    println!();
    println!("Ctrl-C stops both clusters and removes their data.");
    // SIGTERM as well as Ctrl-C, so `timeout` or a service manager also removes the clusters.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!("stopping ...");
    drop((source, target));
    Ok(())
}

fn demo_config(source: &[String], target: &[String]) -> String {
    let list = |e: &[String]| e.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", ");
    format!(
        "link_uid = \"demo\"\n\n[source]\nendpoints = [{}]\nprefix = \"/demo/\"\n\n[target]\nendpoints = [{}]\nprefix = \"/demo/\"\n\n[http]\nlisten = \"127.0.0.1:8080\"\n",
        list(source),
        list(target)
    )
}
