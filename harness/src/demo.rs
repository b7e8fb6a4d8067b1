//! `harness demo` (what `scripts/demo.sh` runs): the main job on an embedded default.
//!
//! A source and a target etcd start, the source is seeded under `/demo/`, and the real
//! `mirror-agent run` starts as a child process on a config file written for it (its path is
//! printed). A progress bar follows the initial sync from the agent's `/statusz`; then a paced,
//! open-loop writer changes the source while a live line shows the agent's phase, the source
//! revision, the watermark, the lag and the keys applied per second. Ctrl-C (or `--duration`)
//! stops the writer, waits for the agent to catch up, runs `mirror-agent verify` and prints
//! `mirror-agent status`; then everything stops (or, with `--keep`, stays up until the next
//! Ctrl-C, with directions printed).
//!
//! On a terminal the progress is drawn with `indicatif`; elsewhere (a test, a log) it is one
//! plain line per second, so the output can be read back.

use std::io::IsTerminal as _;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};
use mirror_core::{Phase, Status};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::scenario::current_revision;
use crate::{
    agent_binary, load_keys, AgentConfig, AgentProcess, Backend, Churn, ClusterSpec, EtcdCluster, EtcdVersion,
};

/// The key range the demo mirrors (the same on both sides).
pub const PREFIX: &str = "/demo/";

/// What the demo runs.
#[derive(Clone, Debug)]
pub struct DemoPlan {
    /// Source etcd version.
    pub source_version: EtcdVersion,
    /// Target etcd version.
    pub target_version: EtcdVersion,
    /// Where etcd runs (default: detected).
    pub backend: Option<Backend>,
    /// Keys seeded into the source before the agent starts.
    pub keys: usize,
    /// Bytes per seeded value.
    pub value_size: usize,
    /// Writes per second of the paced writer; `None` for no writer.
    pub writer_rate: Option<u32>,
    /// Stop the live view after this long (default: at Ctrl-C).
    pub duration: Option<Duration>,
    /// After the verify, keep everything running until Ctrl-C and print how to reach it.
    pub keep: bool,
}

/// How the demo ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DemoEnd {
    /// The agent caught up and `mirror-agent verify` said EQUAL.
    Verified,
    /// `mirror-agent verify` did not say EQUAL (its report is printed).
    Different,
    /// Interrupted before the initial sync finished: nothing to verify yet.
    Interrupted,
}

/// Runs the demo until Ctrl-C, SIGTERM or `plan.duration`.
pub async fn run(plan: DemoPlan) -> anyhow::Result<DemoEnd> {
    let stop = stop_on_signals()?;
    let tty = std::io::stdout().is_terminal();

    let spec = |v| {
        let spec = ClusterSpec::new(v);
        match plan.backend {
            Some(b) => spec.backend(b),
            None => spec,
        }
    };
    eprintln!("starting source etcd {} and target etcd {} ...", plan.source_version, plan.target_version);
    let source = EtcdCluster::start(spec(plan.source_version)).await.context("starting the source etcd")?;
    let target = EtcdCluster::start(spec(plan.target_version)).await.context("starting the target etcd")?;
    println!("source: {}  (etcd {})", source.endpoints().join(","), plan.source_version);
    println!("target: {}  (etcd {})", target.endpoints().join(","), plan.target_version);

    let mut src = source.client().await?;
    seed(&mut src, plan.keys, plan.value_size, tty).await?;

    let config = AgentConfig::new("demo", source.endpoints(), target.endpoints(), PREFIX);
    let mut agent = AgentProcess::start(&config).await?;
    let bin = agent_binary().canonicalize().unwrap_or_else(|_| agent_binary());
    println!("agent:  {} run --config {}", bin.display(), agent.config_path().display());
    println!("        status {}  log {}", agent.url(), agent.log_path().display());

    let end = match initial_sync(&agent, &stop, tty).await? {
        false => DemoEnd::Interrupted,
        true => {
            let writer = plan.writer_rate.map(|rate| {
                println!("writer: {rate} writes/s to the source (puts, deletes, Txns, range deletes)");
                Churn::new(PREFIX, usize::MAX, rate, 10_000).tolerant().spawn(src.clone())
            });
            tail_view(&agent, &mut src, &stop, plan.duration, tty).await;
            if let Some(w) = writer {
                w.abort();
            }
            finish(&agent, &mut src).await?
        }
    };

    if plan.keep {
        keep(&plan, &source, &target, &agent).await;
    }
    eprintln!("stopping the agent and both etcd servers ...");
    match agent.terminate().await? {
        Some(0) => {}
        code => {
            eprintln!("the agent exited with {code:?} on SIGTERM (expected 0); its log:\n{}", agent.log())
        }
    }
    drop((source, target));
    Ok(end)
}

/// A token cancelled by the first Ctrl-C or SIGTERM.
fn stop_on_signals() -> anyhow::Result<CancellationToken> {
    let token = CancellationToken::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let set = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        set.cancel();
    });
    Ok(token)
}

/// A bar on a terminal, hidden elsewhere.
fn bar(len: u64, template: &str, tty: bool) -> ProgressBar {
    if !tty {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar
}

/// Seeds `keys` keys in steps, so the bar moves.
async fn seed(
    src: &mut etcd_client::Client,
    keys: usize,
    value_size: usize,
    tty: bool,
) -> anyhow::Result<()> {
    const STEP: usize = 10_000;
    let bar = bar(keys as u64, "seeding  {bar:40} {pos}/{len} keys {per_sec}", tty);
    let mut done = 0;
    while done < keys {
        let n = STEP.min(keys - done);
        load_keys(src, &format!("{PREFIX}s{:04}-", done / STEP), n, value_size).await?;
        done += n;
        bar.set_position(done as u64);
    }
    bar.finish_and_clear();
    println!("seeded: {keys} keys of {value_size} bytes under {PREFIX}");
    Ok(())
}

/// Follows the initial sync until the agent tails; false when stopped first.
async fn initial_sync(agent: &AgentProcess, stop: &CancellationToken, tty: bool) -> anyhow::Result<bool> {
    let started = Instant::now();
    let bar = bar(0, "initial sync {bar:40} {pos}/{len} keys {per_sec} eta {eta} {msg}", tty);
    let mut last_line = Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                bar.abandon();
                println!("interrupted before the initial sync finished: nothing to verify");
                return Ok(false);
            }
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
        let Ok(s) = agent.status().await else { continue };
        if s.phase == Phase::Failed {
            bar.abandon();
            let why = s.last_error.map(|e| format!("{}: {}", e.reason, e.message)).unwrap_or_default();
            anyhow::bail!(
                "the agent failed during the initial sync: {why}\n--- agent log ---\n{}",
                agent.log()
            );
        }
        bar.set_length(s.initial_sync.total_keys.max(s.initial_sync.keys));
        bar.set_position(s.initial_sync.keys);
        bar.set_message(s.phase.as_str());
        if !tty && last_line.elapsed() >= Duration::from_secs(1) {
            last_line = Instant::now();
            println!(
                "initial sync: {}/{} keys ({})",
                s.initial_sync.keys,
                s.initial_sync.total_keys,
                s.phase.as_str()
            );
        }
        if s.phase == Phase::Syncing && s.condition(mirror_core::ConditionType::InitialSyncComplete) {
            bar.finish_and_clear();
            let secs = started.elapsed().as_secs_f64();
            println!(
                "initial sync: done, {} keys in {secs:.1} s ({:.0} keys/s); tailing from revision {}",
                s.initial_sync.keys,
                s.initial_sync.keys as f64 / secs.max(0.001),
                s.watermark
            );
            return Ok(true);
        }
    }
}

/// One status line per second until stopped or `duration` passed.
async fn tail_view(
    agent: &AgentProcess,
    src: &mut etcd_client::Client,
    stop: &CancellationToken,
    duration: Option<Duration>,
    tty: bool,
) {
    let spinner = if tty {
        let s = ProgressBar::new_spinner();
        s.set_style(
            ProgressStyle::with_template("{spinner} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        s.enable_steady_tick(Duration::from_millis(120));
        s
    } else {
        ProgressBar::hidden()
    };
    if duration.is_none() {
        println!("live view: Ctrl-C stops the writer, verifies and stops everything");
    }
    let deadline = duration.map(|d| Instant::now() + d);
    let mut previous: Option<(Instant, u64)> = None;
    loop {
        let until_deadline = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = until_deadline => break,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        let (Ok(s), Ok(rev)) = (agent.status().await, current_revision(src).await) else { continue };
        let now = Instant::now();
        let rate = previous.map_or(0.0, |(at, applied)| {
            s.keys_applied_total.saturating_sub(applied) as f64 / (now - at).as_secs_f64().max(0.001)
        });
        previous = Some((now, s.keys_applied_total));
        let line = tail_line(&s, rev, rate);
        if tty {
            spinner.set_message(line);
        } else {
            println!("{line}");
        }
    }
    spinner.finish_and_clear();
}

/// `syncing  source rev 1234  watermark 1230  lag 4 rev / 0.012 s  applied 210 keys/s`.
fn tail_line(s: &Status, source_revision: i64, applied_per_second: f64) -> String {
    format!(
        "{:<9} source rev {source_revision}  watermark {}  lag {} rev / {:.3} s  applied {applied_per_second:.0} keys/s",
        s.phase.as_str(),
        s.watermark,
        (source_revision - s.watermark).max(0),
        s.lag_seconds
    )
}

/// Waits for the agent to reach the source's revision, then verifies and shows the status.
async fn finish(agent: &AgentProcess, src: &mut etcd_client::Client) -> anyhow::Result<DemoEnd> {
    println!("stopped the writer; waiting for the agent to catch up ...");
    let s = crate::scenario::caught_up(agent, src).await?;
    println!("caught up: watermark {} = source revision", s.watermark);
    println!("$ mirror-agent verify --config {}", agent.config_path().display());
    let verify = tokio::process::Command::new(agent_binary())
        .arg("verify")
        .arg("--config")
        .arg(agent.config_path())
        .stdin(Stdio::null())
        .status()
        .await
        .context("running mirror-agent verify")?;
    println!("$ mirror-agent status --url {}", agent.url());
    let _ = tokio::process::Command::new(agent_binary())
        .args(["status", "--url", &agent.url()])
        .stdin(Stdio::null())
        .status()
        .await;
    if verify.success() {
        println!("verify: passed, the target equals the source");
        Ok(DemoEnd::Verified)
    } else {
        println!("verify: FAILED ({verify})");
        Ok(DemoEnd::Different)
    }
}

/// `--keep`: prints how to reach everything and waits for Ctrl-C or SIGTERM.
async fn keep(plan: &DemoPlan, source: &EtcdCluster, target: &EtcdCluster, agent: &AgentProcess) {
    let etcdctl = plan.source_version.etcdctl();
    println!("--keep: everything stays up until Ctrl-C");
    for (side, cluster) in [("source", source), ("target", target)] {
        println!(
            "  {side}: ETCDCTL_API=3 {} --endpoints={} get --prefix {PREFIX} --keys-only | head",
            etcdctl.display(),
            cluster.endpoints().join(",")
        );
    }
    println!("  agent:  {} status --url {} --watch", agent_binary().display(), agent.url());
    println!("  config: {}", agent.config_path().display());
    println!("  log:    {}", agent.log_path().display());
    // A fresh token: the first Ctrl-C already ended the live view.
    if let Ok(again) = stop_on_signals() {
        again.cancelled().await;
    }
}
