//! Runs a [`Scenario`]: clusters up, agents through fault proxies, steps in order (in the
//! foreground, or in the background when they only talk to the clusters), a continuous G3
//! checker alongside, one line per step. The [`World`] holds what the steps act on.
//!
//! The agents reach both sides through [`crate::Proxies`], so `partition` and `delay` act
//! between the agents and a side while the harness itself still reads both directly.

use std::path::Path;
use std::sync::atomic::Ordering;

use anyhow::Context as _;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::file::{Scenario, StepAt};
use super::step::Line;
pub use super::world::RunOptions;
use super::world::{tail, Background, World};

/// Parses and runs the scenario file at `path`; `Err` names the failed step.
pub async fn run_file(path: &Path, opts: &RunOptions) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let scenario = Scenario::parse(&text).with_context(|| format!("{}", path.display()))?;
    run(&scenario, opts).await
}

/// Runs `scenario` once per version pair.
pub async fn run(scenario: &Scenario, opts: &RunOptions) -> anyhow::Result<()> {
    let seed = opts.seed.unwrap_or(scenario.seed);
    println!("scenario {}: {} (seed {seed})", scenario.name, scenario.about);
    for &(sv, tv) in &scenario.versions {
        println!("== etcd {sv} -> {tv}");
        let mut world = World::start(scenario, seed, sv, tv, opts).await?;
        let outcome = steps(&mut world).await;
        if let Err(e) = &outcome {
            report_failure(&mut world, e).await;
            if opts.keep {
                keep(&world).await;
            }
        }
        world.finish().await;
        outcome?;
    }
    println!("scenario {}: passed", scenario.name);
    Ok(())
}

/// Runs every step, then waits for the background ones, then judges the checker.
async fn steps(world: &mut World<'_>) -> anyhow::Result<()> {
    let total = world.scenario.steps.len();
    for (i, at) in world.scenario.steps.iter().enumerate() {
        if let Some(on) = at.g3_checker {
            world.checker.enabled.store(on, Ordering::Relaxed);
        }
        let began = Instant::now();
        let label = format!("step {}/{total} (line {}) {}", i + 1, at.line, Line(at.step.as_ref()));
        if at.background {
            let handle = spawn_background(world, i, at).await.with_context(|| label.clone())?;
            world.background.push(Background { line: at.line, what: label.clone(), handle });
            println!("[{:>8.2}s] {label}: started in the background", world.elapsed());
            continue;
        }
        match at.step.run(world, world.seed + i as u64).await {
            Ok(note) => println!(
                "[{:>8.2}s] {label}: ok ({:.2}s){}",
                world.elapsed(),
                began.elapsed().as_secs_f64(),
                if note.is_empty() { String::new() } else { format!(" {note}") }
            ),
            Err(e) => {
                println!("[{:>8.2}s] {label}: FAILED", world.elapsed());
                return Err(e.context(label));
            }
        }
        world.judge_violations(&label).await?;
    }
    world.join_background().await?;
    world.judge_violations("the end").await?;
    let (holds, unreadable) =
        (world.checker.holds.load(Ordering::Relaxed), world.checker.unreadable.load(Ordering::Relaxed));
    println!(
        "[{:>8.2}s] continuous G3: held at {holds} checks ({unreadable} could not read a side)",
        world.elapsed()
    );
    Ok(())
}

/// A step that only talks to the clusters, as a task with clients of its own.
async fn spawn_background(
    world: &World<'_>,
    index: usize,
    at: &StepAt,
) -> anyhow::Result<JoinHandle<anyhow::Result<String>>> {
    let (step, seed) = (at.step.clone(), world.seed + index as u64);
    let sides = world.sides().await?;
    Ok(tokio::spawn(async move { step.run_detached(sides, seed).await }))
}

/// Prints the failure with what an operator would look at first.
async fn report_failure(world: &mut World<'_>, e: &anyhow::Error) {
    println!("FAILED: {e:#}");
    world.report_ended_background().await;
    for (name, cluster) in [("source", &world.source), ("target", &world.target)] {
        if let Some(report) = cluster.members_disagree().await {
            println!("--- {name} etcd: {report} ---");
        }
    }
    for (id, agent) in &world.agents {
        println!("--- agent {id}: last log lines ---\n{}", tail(&agent.process.log(), 40));
        match agent.process.status().await {
            Ok(s) => println!(
                "--- agent {id}: /statusz ---\n{}",
                serde_json::to_string_pretty(&s).unwrap_or_default()
            ),
            Err(e) => println!("--- agent {id}: /statusz unavailable: {e:#}"),
        }
    }
}

/// `--keep`: prints how to reach everything and waits for Ctrl-C.
async fn keep(world: &World<'_>) {
    println!("--keep: the clusters stay up until Ctrl-C");
    println!("source: {}", world.source.endpoints().join(","));
    println!("target: {}", world.target.endpoints().join(","));
    for (id, agent) in &world.agents {
        println!("agent {id}: {} (config below)\n{}", agent.process.url(), agent.config.render());
    }
    let _ = tokio::signal::ctrl_c().await;
}
