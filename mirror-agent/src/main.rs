//! `mirror-agent`: the etcd-mirror daemon and its command line (SPEC §4).
//!
//! - `run` (`daemon.rs`) drives the engine (`engine/`: connect → initial_sync → syncing, with degraded,
//!   standby, drained and failed; one file per phase, listed in `engine/mod.rs`, whose doc
//!   carries the argument for each guarantee) and serves `/statusz`, `/metrics`, `/healthz`,
//!   `/readyz` (`http.rs`, `metrics.rs`); the engine reports through `reporter.rs`, the one
//!   writer of status and histograms, and a watchdog refreshes lag and staleness every second
//!   independently of the engine. SIGTERM and SIGINT stop it within a step in any phase (exit
//!   0); SIGHUP reloads the config; a config error exits 2; an engine error never exits, it
//!   parks the engine in `failed` or `standby`.
//! - `check-config`, `status`, `verify` (`verify.rs`, read-only), `cutover` (`cutover.rs`) and
//!   `failover` (`failover.rs`: promote the target without the source) and `failback-plan`
//!   (`failback.rs`: what the old source took that the new primary never got, read-only) and
//!   `retire` (`retire.rs`: the link's reserved keys removed once no agent of it writes) are
//!   one-shot commands for operators and scripts.
//!
//! What it deliberately does not do: it never writes to the source, never writes outside the
//! destination range and its reserved keys, and never retries a failed fence compare blindly.

mod cutover;
mod daemon;
mod engine;
mod exact;
mod exit;
mod failback;
mod failover;
mod freshness;
mod http;
mod members;
mod metrics;
mod progress;
mod reporter;
mod retire;
mod snapshot;
mod summary;
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use exit::Exit;
use mirror_core::{Config, ConfigError};

#[derive(Parser)]
#[command(name = "mirror-agent", version, about = "One-way, fenced, resumable mirror of an etcd key range")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the mirror until SIGTERM/SIGINT.
    Run {
        /// The TOML config file.
        #[arg(long)]
        config: PathBuf,
        /// Override `http.listen`.
        #[arg(long)]
        listen: Option<String>,
        /// Log format.
        #[arg(long, value_enum, default_value = "human")]
        log_format: LogFormat,
    },
    /// Drain, verify and promote the target. With --wait, exit 0 only when verified; without
    /// it, return once the drain has started in a detached process.
    Cutover {
        /// The TOML config file.
        #[arg(long)]
        config: PathBuf,
        /// Run here until the cutover is verified or refused, and exit by its outcome. Without
        /// it: start it in a detached process and return once that holds the fence (the drain
        /// has started; every agent of the link stands by).
        #[arg(long)]
        wait: bool,
        /// Without --wait: the file the detached cutover writes its output to (default: a file
        /// in the temp directory, named when the command returns).
        #[arg(long, conflicts_with = "wait")]
        log: Option<PathBuf>,
        /// Exit 0 even if the source kept changing after the drain target revision.
        #[arg(long)]
        allow_moving_source: bool,
    },
    /// The source is lost: promote the target without it and print the data-loss window.
    /// Exit 0 once promoted (or already), 1 while the source answers (unless --force).
    Failover {
        /// The TOML config file.
        #[arg(long)]
        config: PathBuf,
        /// Promote even though a source endpoint answers (its writes after the watermark are
        /// abandoned).
        #[arg(long)]
        force: bool,
        /// Exact links: the highest source revision a client may have seen, when it may be
        /// above what the link saw (the source's last `etcd_debugging_mvcc_current_revision`
        /// from monitoring, say): the fillers and the compaction go past it too, so such a
        /// client relists. May be given to a run after a failover that went without it.
        #[arg(long, value_name = "REVISION", value_parser = clap::value_parser!(i64).range(1..))]
        seen_revision: Option<i64>,
    },
    /// After a failover: list, as JSON lines, the writes the old source took after the
    /// promoted watermark (read-only). The config is the reverse link's (new primary -> old
    /// source); take the plan before starting that link.
    FailbackPlan {
        /// The reverse link's TOML config file.
        #[arg(long)]
        config: PathBuf,
        /// The watermark `failover` printed (the source revision the new primary reflects).
        #[arg(long)]
        promoted_watermark: i64,
        /// Where to write the plan (JSON lines; written whole or not at all).
        #[arg(long)]
        out: PathBuf,
    },
    /// Remove this link's reserved keys (checkpoint, HA election keys) from the target once no
    /// agent of it can write (cut over, failed over, decommissioned). Exit 0 when done or
    /// nothing is left, 1 while an agent may still hold the fence (unless --force).
    Retire {
        /// The link's TOML config file.
        #[arg(long)]
        config: PathBuf,
        /// Skip the live-writer checks (an alive HA lease, a checkpoint that moves).
        #[arg(long)]
        force: bool,
    },
    /// Compare source and target (read-only); exit 0 only when equal.
    Verify {
        /// The TOML config file.
        #[arg(long)]
        config: PathBuf,
        /// Source revision to compare at (default: the target checkpoint's watermark).
        #[arg(long)]
        revision: Option<i64>,
        /// How many differing keys to list (redacted).
        #[arg(long, default_value_t = 10)]
        max_diffs: usize,
    },
    /// Seed an exact replica (`sync.revisions = "exact"`): save the source's snapshot to FILE,
    /// spool its revisions to FILE.spool until the link runs, and print the restore steps.
    Snapshot {
        #[command(subcommand)]
        action: SnapshotAction,
    },
    /// Summarize a running agent's /statusz (phase, lag, progress, unhealthy conditions).
    Status {
        /// Base URL of the agent's HTTP server.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
        /// Print the raw /statusz JSON instead.
        #[arg(long)]
        json: bool,
        /// Refresh every second until Ctrl-C.
        #[arg(long)]
        watch: bool,
    },
    /// Validate a config file and print the effective config with secrets redacted.
    CheckConfig {
        /// The TOML config file.
        file: PathBuf,
    },
}

/// `snapshot` subcommands.
#[derive(Subcommand)]
enum SnapshotAction {
    /// Save the snapshot, spool, print R0 and the restore commands, spool until the link runs.
    Save {
        /// Where the snapshot goes (FILE.spool and FILE.json beside it); never overwritten.
        file: PathBuf,
        /// The TOML config file of the exact link.
        #[arg(long)]
        config: PathBuf,
        /// An etcd user allowed to take a snapshot (root), instead of the config's source user.
        #[arg(long, requires = "admin_password_file")]
        admin_user: Option<String>,
        /// File holding that user's password.
        #[arg(long, requires = "admin_user")]
        admin_password_file: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { file } => check_config(&file),
        Command::Run { config, listen, log_format } => daemon::run(&config, listen, log_format),
        Command::Status { url, json, watch } => status(&url, json, watch),
        // An exact link's cutover waits for its agents to land the drain target, with or
        // without --wait (docs/exact-revisions.md).
        Command::Cutover { config, .. } if Config::load(&config).is_ok_and(|c| c.exact()) => {
            one_shot(&config, |c| async move { exact::cutover::cutover(&c).await })
        }
        Command::Cutover { config, wait: true, allow_moving_source, .. } => {
            one_shot(&config, |c| cutover::cutover(c, allow_moving_source))
        }
        Command::Cutover { config, wait: false, allow_moving_source, log } => {
            one_shot(&config, |c| cutover::start(c, config.clone(), allow_moving_source, log))
        }
        Command::Failover { config, force, seen_revision } => {
            one_shot(&config, |c| failover::failover(c, force, seen_revision))
        }
        Command::FailbackPlan { config, promoted_watermark, out } => {
            one_shot(&config, |c| failback::failback_plan(c, promoted_watermark, out))
        }
        Command::Retire { config, force } => one_shot(&config, |c| retire::retire(c, force)),
        Command::Verify { config, revision, max_diffs } => {
            one_shot(&config, |c| verify::verify(c, revision, max_diffs))
        }
        Command::Snapshot {
            action: SnapshotAction::Save { file, config, admin_user, admin_password_file },
        } => {
            let admin = admin_user
                .zip(admin_password_file)
                .map(|(user, password_file)| snapshot::Admin { user, password_file });
            one_shot(&config, |c| snapshot::save(c, file, admin))
        }
    }
}

/// The runtime. Worker threads get 8 MiB of stack, not tokio's 2 MiB: the engine's futures nest
/// deeply (HA term, link run, phase, apply, lease round), and a debug build's poll frames
/// (the binary the test suite and its image run) overflowed 2 MiB in the HA tail once lease
/// adoption and the stop grace were added. The stack is address space; only touched pages cost
/// memory.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    runtime_with(None)
}

/// [`runtime`] with `workers` worker threads (None: tokio's default, one per core, or
/// `TOKIO_WORKER_THREADS`).
pub(crate) fn runtime_with(workers: Option<usize>) -> tokio::runtime::Runtime {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = workers {
        builder.worker_threads(workers);
    }
    builder.enable_all().thread_stack_size(8 << 20).build().expect("tokio runtime")
}

fn status(url: &str, json: bool, watch: bool) -> ExitCode {
    use std::io::IsTerminal as _;
    let url = format!("{}/statusz", url.trim_end_matches('/'));
    let terminal = std::io::stdout().is_terminal();
    runtime().block_on(async {
        loop {
            let result = async {
                let resp = reqwest::get(&url).await?.error_for_status()?;
                resp.json::<serde_json::Value>().await
            }
            .await;
            let text = match result {
                Ok(v) if json => serde_json::to_string_pretty(&v).unwrap_or_default(),
                Ok(v) => match serde_json::from_value::<mirror_core::Status>(v) {
                    Ok(s) => summary::render(&s, terminal),
                    Err(e) => format!("mirror-agent: {url} is not an agent status: {e}"),
                },
                Err(e) if !watch => {
                    eprintln!("mirror-agent: cannot read {url}: {e}");
                    return ExitCode::FAILURE;
                }
                Err(e) => format!("mirror-agent: cannot read {url}: {e}"),
            };
            if watch && terminal {
                // Clear the screen and home the cursor: one live view, not a scroll.
                print!("\x1b[2J\x1b[H");
            }
            println!("{}", text.trim_end());
            if !watch {
                return ExitCode::SUCCESS;
            }
            tokio::select! {
                _ = tokio::signal::ctrl_c() => return ExitCode::SUCCESS,
                _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            }
        }
    })
}

/// A one-shot command (`cutover`, `failover`, `failback-plan`, `retire`, `verify`): its config
/// loaded (exit 2 naming every violation otherwise), warnings and errors logged to stderr, run
/// to its end on a runtime of its own.
fn one_shot<F, Fut>(file: &std::path::Path, command: F) -> ExitCode
where
    F: FnOnce(Config) -> Fut,
    Fut: std::future::Future<Output = ExitCode>,
{
    let config = match Config::load(file) {
        Ok(c) => c,
        Err(e) => return config_error(file, &e),
    };
    let _ = tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter("warn").try_init();
    runtime().block_on(command(config))
}

pub(crate) fn config_error(file: &std::path::Path, e: &ConfigError) -> ExitCode {
    eprintln!("mirror-agent: {}: {e}", file.display());
    ExitCode::from(Exit::Config)
}

fn check_config(file: &std::path::Path) -> ExitCode {
    match Config::load(file) {
        Ok(config) => {
            print!("{}", config.to_redacted_toml());
            ExitCode::SUCCESS
        }
        Err(e) => config_error(file, &e),
    }
}
