//! Runs a [`Scenario`]: clusters up, agents through fault proxies, steps in order, a continuous
//! G3 checker alongside, one line per step.
//!
//! The agents reach both sides through [`crate::Proxies`], so `partition` and `delay` act
//! between the agents and a side while the harness itself still reads both directly.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use etcd_client::{AlarmAction, AlarmOptions, AlarmType, Client, DeleteOptions, Txn, TxnOp};
use tokio::sync::RwLock;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::file::{MemberRef, RevisionRef, Scenario, SideName, Signal, Step, StepAt, Until};
use super::FAST_SYNC_TOML;
use crate::{
    agent_command, check_g3, difference_now, load_leased_keys, AgentBackend, AgentConfig, AgentProcess,
    Backend, Churn, ClusterSpec, EtcdCluster, EtcdVersion, G3Violation, Proxies, G3,
};

/// How a run is done.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Overrides the file's `seed`.
    pub seed: Option<u64>,
    /// On failure, leave the clusters up and wait for Ctrl-C.
    pub keep: bool,
    /// Where etcd runs (default: detected).
    pub backend: Option<Backend>,
    /// Extra environment for every agent process (e.g. a debug-build failpoint).
    pub agent_env: Vec<(String, String)>,
    /// Overrides the file's `agent_backend`.
    pub agent_backend: Option<super::AgentKind>,
}

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
        let mut run = Run::start(scenario, seed, sv, tv, opts).await?;
        let outcome = run.steps().await;
        if let Err(e) = &outcome {
            run.report_failure(e).await;
            if opts.keep {
                run.keep().await;
            }
        }
        run.finish().await;
        outcome?;
    }
    println!("scenario {}: passed", scenario.name);
    Ok(())
}

/// One agent of the run.
struct Agent {
    process: AgentProcess,
    config: AgentConfig,
    /// The exit code of its last stop, if it stopped.
    exit: Option<Option<i32>>,
}

/// One background step.
struct Background {
    line: usize,
    what: String,
    handle: JoinHandle<anyhow::Result<String>>,
}

/// What the continuous G3 checker saw.
#[derive(Default)]
struct CheckerState {
    enabled: AtomicBool,
    holds: AtomicU64,
    unreadable: AtomicU64,
    violations: RwLock<Vec<String>>,
}

struct Run<'a> {
    scenario: &'a Scenario,
    seed: u64,
    started: Instant,
    source: EtcdCluster,
    target: EtcdCluster,
    source_proxies: Proxies,
    target_proxies: Proxies,
    src: Client,
    base: AgentConfig,
    agent_backend: AgentBackend,
    agents: BTreeMap<String, Agent>,
    stopped: HashSet<(bool, usize)>,
    background: Vec<Background>,
    checker: Arc<CheckerState>,
    checker_task: JoinHandle<()>,
}

impl<'a> Run<'a> {
    async fn start(
        scenario: &'a Scenario,
        seed: u64,
        sv: EtcdVersion,
        tv: EtcdVersion,
        opts: &RunOptions,
    ) -> anyhow::Result<Run<'a>> {
        let spec = |v, side: &super::SideSpec| {
            let mut spec = ClusterSpec::new(v).members(side.members);
            for arg in &side.args {
                spec = spec.arg(arg.clone());
            }
            match opts.backend {
                Some(b) => spec.backend(b),
                None => spec,
            }
        };
        let source = EtcdCluster::start(spec(sv, &scenario.source)).await.context("starting the source")?;
        let target = EtcdCluster::start(spec(tv, &scenario.target)).await.context("starting the target")?;
        let (source_proxies, target_proxies) = (source.proxies().await?, target.proxies().await?);
        let link: String = scenario
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' })
            .collect();
        let (agent_backend, source_endpoints, target_endpoints) =
            match opts.agent_backend.unwrap_or(scenario.agent_backend) {
                super::AgentKind::Process => {
                    (AgentBackend::Process, source_proxies.endpoints(), target_proxies.endpoints())
                }
                super::AgentKind::Container => {
                    let (Some(s), Some(t)) = (source.network_endpoints(), target.network_endpoints()) else {
                        bail!("agent_backend = \"container\" needs etcd in containers (--backend container)");
                    };
                    let networks = [&source, &target].iter().filter_map(|c| c.docker_network()).collect();
                    (AgentBackend::Container { networks }, s, t)
                }
            };
        let mut base = AgentConfig::new(&link, source_endpoints, target_endpoints, scenario.source_prefix());
        base.target_prefix = scenario.target_prefix().to_owned();
        let mut base = base.overlay(FAST_SYNC_TOML).overlay(&scenario.agent_toml);
        base.env.extend(opts.agent_env.iter().cloned());
        let parsed = base.parsed().context("the generated agent config")?;
        let src = source.client().await?;
        let checker = Arc::new(CheckerState { enabled: AtomicBool::new(true), ..CheckerState::default() });
        let checker_task = tokio::spawn(check_continuously(
            src.clone(),
            target.client().await?,
            parsed.rewriter(),
            parsed.checkpoint_key(),
            checker.clone(),
        ));
        Ok(Run {
            scenario,
            seed,
            started: Instant::now(),
            source,
            target,
            source_proxies,
            target_proxies,
            src,
            base,
            agent_backend,
            agents: BTreeMap::new(),
            stopped: HashSet::new(),
            background: Vec::new(),
            checker,
            checker_task,
        })
    }

    /// Runs every step, then waits for the background ones, then judges the checker.
    async fn steps(&mut self) -> anyhow::Result<()> {
        let total = self.scenario.steps.len();
        for (i, at) in self.scenario.steps.iter().enumerate() {
            if let Some(on) = at.g3_checker {
                self.checker.enabled.store(on, Ordering::Relaxed);
            }
            let began = Instant::now();
            let label = format!("step {}/{total} (line {}) {}", i + 1, at.line, at.step);
            if at.background {
                let handle = self.spawn_background(i, at).await.with_context(|| label.clone())?;
                self.background.push(Background { line: at.line, what: label.clone(), handle });
                println!("[{:>8.2}s] {label}: started in the background", self.elapsed());
                continue;
            }
            match self.step(i, at).await {
                Ok(note) => println!(
                    "[{:>8.2}s] {label}: ok ({:.2}s){}",
                    self.elapsed(),
                    began.elapsed().as_secs_f64(),
                    if note.is_empty() { String::new() } else { format!(" {note}") }
                ),
                Err(e) => {
                    println!("[{:>8.2}s] {label}: FAILED", self.elapsed());
                    return Err(e.context(label));
                }
            }
            self.judge_violations(&label).await?;
        }
        self.join_background().await?;
        self.judge_violations("the end").await?;
        let (holds, unreadable) =
            (self.checker.holds.load(Ordering::Relaxed), self.checker.unreadable.load(Ordering::Relaxed));
        println!(
            "[{:>8.2}s] continuous G3: held at {holds} checks ({unreadable} could not read a side)",
            self.elapsed()
        );
        Ok(())
    }

    fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    async fn judge_violations(&self, when: &str) -> anyhow::Result<()> {
        if let Some(v) = self.checker.violations.read().await.first() {
            bail!("the continuous G3 checker found a violation (seen by {when}): {v}");
        }
        Ok(())
    }

    async fn join_background(&mut self) -> anyhow::Result<()> {
        for bg in self.background.drain(..) {
            let note = bg
                .handle
                .await
                .map_err(anyhow::Error::from)
                .and_then(|r| r)
                .with_context(|| format!("background {} (line {})", bg.what, bg.line))?;
            println!("[{:>8.2}s] {}: done {note}", self.started.elapsed().as_secs_f64(), bg.what);
        }
        Ok(())
    }

    /// A step that only talks to the clusters, as a task.
    async fn spawn_background(
        &self,
        index: usize,
        at: &StepAt,
    ) -> anyhow::Result<JoinHandle<anyhow::Result<String>>> {
        let (step, mut src, seed) = (at.step.clone(), self.src.clone(), self.seed + index as u64);
        let mut dst = self.target.client().await?;
        let prefix = self.scenario.source_prefix().to_owned();
        let target_prefix = self.scenario.target_prefix().to_owned();
        let checkpoint = self.base.parsed()?.checkpoint_key();
        Ok(tokio::spawn(async move {
            match step {
                Step::Compact { side: SideName::Target, revision } => compact(&mut dst, &revision).await,
                Step::Compact { side: SideName::Source, revision } => compact(&mut src, &revision).await,
                Step::Sleep { for_ } => {
                    tokio::time::sleep(for_.get()).await;
                    Ok(String::new())
                }
                step @ (Step::Load { side: SideName::Target, .. }
                | Step::Put { side: SideName::Target, .. }
                | Step::Del { side: SideName::Target, .. }) => {
                    write_step(&mut dst, &target_prefix, &checkpoint, seed, &step).await
                }
                step => write_step(&mut src, &prefix, &checkpoint, seed, &step).await,
            }
        }))
    }

    /// Runs one step in the foreground; returns a note for its line.
    async fn step(&mut self, index: usize, at: &StepAt) -> anyhow::Result<String> {
        let seed = self.seed + index as u64;
        match &at.step {
            step @ (Step::Load { side: SideName::Target, .. }
            | Step::Put { side: SideName::Target, .. }
            | Step::Del { side: SideName::Target, .. }) => {
                let prefix = self.scenario.target_prefix().to_owned();
                let checkpoint = self.base.parsed()?.checkpoint_key();
                let mut dst = self.target.client().await?;
                write_step(&mut dst, &prefix, &checkpoint, seed, step).await
            }
            step @ (Step::Load { .. }
            | Step::Churn { .. }
            | Step::Put { .. }
            | Step::Del { .. }
            | Step::Txn { .. }
            | Step::Revoke { .. }) => {
                let prefix = self.scenario.source_prefix().to_owned();
                let checkpoint = self.base.parsed()?.checkpoint_key();
                let (Step::Del { target_revisions: Some(want), .. }
                | Step::Revoke { target_revisions: Some(want), .. }) = step
                else {
                    return write_step(&mut self.src, &prefix, &checkpoint, seed, step).await;
                };
                // The agent's whole application of this one source revision: from caught up
                // before it to caught up after it, nothing else writes the target.
                let mut src = self.src.clone();
                let mut dst = self.target.client().await?;
                super::caught_up(&self.agent("a")?.process, &mut src).await?;
                let before = super::current_revision(&mut dst).await?;
                let note = write_step(&mut src, &prefix, &checkpoint, seed, step).await?;
                super::caught_up(&self.agent("a")?.process, &mut src).await?;
                let moved = super::current_revision(&mut dst).await? - before;
                if moved != *want {
                    bail!("{note}: applied as {moved} target revisions, expected {want}");
                }
                Ok(format!("{note}, applied as {moved} target revision(s)"))
            }
            Step::StartAgent { id, epoch, toml } => self.start_agent(id, *epoch, toml.as_deref()).await,
            Step::StopAgent { id, signal } => self.stop_agent(id, *signal).await,
            Step::ReloadAgent { id, toml, epoch } => {
                let agent = self.agent(id)?;
                let mut config = agent.config.clone().overlay(toml);
                if let Some(e) = epoch {
                    config = config.epoch(*e);
                }
                agent.config = config.clone();
                agent.process.reload(config)?;
                Ok(String::new())
            }
            Step::Cutover { id, args, expect } => {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                self.one_shot(id, "cutover", &args, *expect).await
            }
            Step::Verify { id, expect } => self.one_shot(id, "verify", &[], *expect).await,
            Step::KillMember { side, member } => {
                let i = self.member(*side, member).await?;
                self.cluster(*side).node(i).kill().await?;
                self.stopped.insert((*side == SideName::Source, i));
                self.members_changed(*side).await?;
                Ok(format!("member {i}"))
            }
            Step::StopMember { side, member } => {
                let i = self.member(*side, member).await?;
                self.cluster(*side).node(i).stop().await?;
                self.stopped.insert((*side == SideName::Source, i));
                self.members_changed(*side).await?;
                Ok(format!("member {i}"))
            }
            Step::StartMember { side, member } => {
                let key = *side == SideName::Source;
                let which: Vec<usize> = match member {
                    Some(m) => vec![self.member(*side, m).await?],
                    None => self.stopped.iter().filter(|(s, _)| *s == key).map(|(_, i)| *i).collect(),
                };
                for &i in &which {
                    self.cluster(*side).node(i).start().await?;
                    self.stopped.remove(&(key, i));
                }
                self.members_changed(*side).await?;
                Ok(format!("members {which:?}"))
            }
            Step::PauseMember { side, member } => {
                let i = self.member(*side, member).await?;
                self.cluster(*side).node(i).pause().await?;
                Ok(format!("member {i}"))
            }
            Step::ResumeMember { side, member } => {
                let i = self.member(*side, member).await?;
                self.cluster(*side).node(i).unpause().await?;
                Ok(format!("member {i}"))
            }
            Step::Partition { side } => {
                self.proxies(*side).cut();
                Ok(String::new())
            }
            Step::Heal { side } => {
                self.proxies(*side).heal();
                Ok(String::new())
            }
            Step::Delay { side, ms } => {
                self.proxies(*side).delay(Duration::from_millis(*ms));
                Ok(String::new())
            }
            Step::Compact { side, revision } => {
                let mut client = self.cluster(*side).client().await?;
                compact(&mut client, revision).await
            }
            Step::CheckPerf { load, prefix } => {
                let prefix = format!("{}{prefix}", self.scenario.source_prefix());
                check_perf(&self.source, load, &prefix).await
            }
            Step::Snapshot { side, name } => {
                let bytes = self.cluster(*side).save_snapshot(name).await?;
                Ok(format!("{bytes} bytes"))
            }
            Step::Restore { side, name } => {
                self.cluster(*side).restore_snapshot(name).await?;
                let key = *side == SideName::Source;
                self.stopped.retain(|(s, _)| *s != key);
                self.members_changed(*side).await?;
                Ok(String::new())
            }
            Step::Defrag { side } => {
                let key = *side == SideName::Source;
                let cluster = self.cluster(*side);
                let mut done = 0;
                for i in 0..cluster.nodes().len() {
                    if self.stopped.contains(&(key, i)) {
                        continue;
                    }
                    let endpoint = self.cluster(*side).node(i).endpoint();
                    let mut c = Client::connect([endpoint], None).await?;
                    c.defragment().await?;
                    done += 1;
                }
                Ok(format!("{done} members"))
            }
            Step::AlarmDisarm { side } => {
                // As `etcdctl alarm disarm` does: each raised alarm by its member id.
                let mut client = self.cluster(*side).client().await?;
                let alarms = client.alarm(AlarmAction::Get, AlarmType::None, None).await?;
                for a in alarms.alarms() {
                    let mut opts = AlarmOptions::new();
                    opts.with_member(a.member_id());
                    client.alarm(AlarmAction::Deactivate, AlarmType::Nospace, Some(opts)).await?;
                }
                Ok(format!("{} alarms", alarms.alarms().len()))
            }
            Step::Sleep { for_ } => {
                tokio::time::sleep(for_.get()).await;
                Ok(String::new())
            }
            Step::Wait { until, timeout, agent } => self.wait(until, timeout.get(), agent).await,
            Step::Expect { .. } => self.expect(&at.step).await,
        }
    }

    fn cluster(&mut self, side: SideName) -> &mut EtcdCluster {
        match side {
            SideName::Source => &mut self.source,
            SideName::Target => &mut self.target,
        }
    }

    fn proxies(&self, side: SideName) -> &Proxies {
        match side {
            SideName::Source => &self.source_proxies,
            SideName::Target => &self.target_proxies,
        }
    }

    async fn member(&mut self, side: SideName, member: &MemberRef) -> anyhow::Result<usize> {
        let cluster = self.cluster(side);
        match member {
            MemberRef::Index(i) if *i < cluster.nodes().len() => Ok(*i),
            MemberRef::Index(i) => {
                bail!("member {i}: the {side:?} side has {} members", cluster.nodes().len())
            }
            MemberRef::Named(_) => cluster.leader_index(Duration::from_secs(30)).await,
        }
    }

    fn agent(&mut self, id: &str) -> anyhow::Result<&mut Agent> {
        self.agents.get_mut(id).with_context(|| format!("agent {id:?} was never started"))
    }

    async fn start_agent(
        &mut self,
        id: &str,
        epoch: Option<u64>,
        toml: Option<&str>,
    ) -> anyhow::Result<String> {
        if let Some(agent) = self.agents.get_mut(id) {
            if agent.process.is_running() {
                bail!("agent {id:?} is already running");
            }
            if let Some(t) = toml {
                agent.config = agent.config.clone().overlay(t);
            }
            if let Some(e) = epoch {
                agent.config = agent.config.clone().epoch(e);
            }
            agent.process.set_config(agent.config.clone());
            agent.process.restart().await?;
            agent.exit = None;
            return Ok("restarted".into());
        }
        let mut config = self.base.clone().overlay(toml.unwrap_or_default());
        if let Some(e) = epoch {
            config = config.epoch(e);
        }
        let process = AgentProcess::start_on(&config, self.agent_backend.clone()).await?;
        let url = process.url();
        self.agents.insert(id.to_owned(), Agent { process, config, exit: None });
        Ok(url)
    }

    async fn stop_agent(&mut self, id: &str, signal: Signal) -> anyhow::Result<String> {
        let agent = self.agent(id)?;
        match signal {
            Signal::Term => {
                let code = agent.process.terminate().await?;
                agent.exit = Some(code);
                Ok(format!("exit {code:?}"))
            }
            Signal::Kill => {
                agent.process.kill9().await?;
                agent.exit = Some(None);
                Ok(String::new())
            }
            Signal::Stop | Signal::Cont => {
                let sig = if signal == Signal::Stop { libc::SIGSTOP } else { libc::SIGCONT };
                agent.process.signal(sig).with_context(|| format!("agent {id:?}"))?;
                Ok(String::new())
            }
        }
    }

    async fn one_shot(
        &mut self,
        id: &str,
        command: &str,
        args: &[&str],
        expect: i32,
    ) -> anyhow::Result<String> {
        let mut config = match self.agents.get(id) {
            Some(a) => a.config.clone(),
            None => self.base.clone(),
        };
        // One-shot commands run on the host, so through the proxies even when the agents run
        // in containers (and see etcd by its container names).
        config.source = self.source_proxies.endpoints();
        config.target = self.target_proxies.endpoints();
        let out = agent_command(&config, command, args).await?;
        let code = out.status.code();
        if code != Some(expect) {
            bail!(
                "mirror-agent {command} exited {code:?}, expected {expect}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                String::from_utf8_lossy(&out.stdout),
                tail(&String::from_utf8_lossy(&out.stderr), 30)
            );
        }
        Ok(format!("exit {expect}"))
    }

    async fn status(&mut self, id: &str) -> anyhow::Result<mirror_core::Status> {
        self.agent(id)?.process.status().await
    }

    /// After a member of `side` went away or came back: the runner's own source client is
    /// made again over the members that answer now, as the agent does (a client of a stopped
    /// member keeps sending it a share of the requests, and the checks fail on those).
    async fn members_changed(&mut self, side: SideName) -> anyhow::Result<()> {
        if side == SideName::Source {
            self.src = self.source.client().await?;
        }
        Ok(())
    }

    /// Whether `until` holds now: `Ok(None)` when it does, `Ok(Some(why not))` otherwise.
    async fn holds(&mut self, until: &Until, id: &str) -> anyhow::Result<Option<String>> {
        match until {
            Until::Phase(p) => {
                let s = self.status(id).await?;
                let phase = phase_name(&s);
                Ok((phase != *p).then(|| format!("phase is {phase}")))
            }
            Until::Condition(t, want, reason) => {
                let s = self.status(id).await?;
                let c = s.conditions.iter().find(|c| c.type_ == *t);
                let now = c.map(|c| c.status);
                let reason_ok = reason.as_ref().is_none_or(|r| c.is_some_and(|c| c.reason == *r));
                Ok((now != Some(*want) || !reason_ok).then(|| match c {
                    Some(c) => format!("{t}={} ({}: {})", c.status_name(), c.reason, c.message),
                    None => format!("{t} not reported"),
                }))
            }
            Until::LastError(want) => {
                let s = self.status(id).await?;
                let got = s.last_error.as_ref().map(|e| e.reason.as_str());
                Ok((got != Some(want.as_str())).then(|| match &s.last_error {
                    Some(e) => format!("last_error is {} ({})", e.reason, e.message),
                    None => "no last_error".to_owned(),
                }))
            }
            Until::Equal => {
                let parsed = self.base.parsed()?;
                let mut dst = self.target.client().await?;
                difference_now(&mut self.src, &mut dst, &parsed.rewriter()).await
            }
            Until::Background => {
                self.join_background().await?;
                Ok(None)
            }
            Until::CaughtUp => {
                let head = super::current_revision(&mut self.src).await?;
                let s = self.status(id).await?;
                Ok((s.watermark < head)
                    .then(|| format!("watermark {} below source head {head}", s.watermark)))
            }
        }
    }

    async fn wait(&mut self, until: &str, timeout: Duration, id: &str) -> anyhow::Result<String> {
        let until = super::parse_until(until)?;
        self.poll_until(&until, id, Instant::now() + timeout)
            .await
            .map_err(|why| anyhow::anyhow!("not reached within {timeout:?}: {why}"))?;
        Ok(String::new())
    }

    /// Polls `until` every 200 ms; `Err(why it does not hold)` once `deadline` passed.
    async fn poll_until(&mut self, until: &Until, id: &str, deadline: Instant) -> Result<(), String> {
        loop {
            let why = match self.holds(until, id).await {
                Ok(None) => return Ok(()),
                Ok(Some(why)) => why,
                Err(e) => format!("{e:#}"),
            };
            if Instant::now() >= deadline {
                return Err(why);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn expect(&mut self, step: &Step) -> anyhow::Result<String> {
        let Step::Expect {
            equal,
            phase,
            condition,
            forced_resyncs,
            g3,
            last_error,
            agent_exit,
            sole_writer_after,
            target_has,
            target_lacks,
            min_scan_restarts,
            max_scan_restarts,
            max_peak_rss_mib,
            max_lag_revisions,
            max_watch_restarts,
            during,
            agent,
            timeout,
        } = step
        else {
            unreachable!("expect() is called with an expect step");
        };
        if let Some(most) = max_lag_revisions {
            let until = Instant::now() + during.map_or(Duration::ZERO, |d| d.get());
            let mut reads = 0u32;
            let mut worst = 0i64;
            loop {
                let s = self.status(agent).await?;
                reads += 1;
                worst = worst.max(s.lag_revisions);
                if s.lag_revisions > *most {
                    bail!(
                        "lag_revisions {} > {most} (watermark {}, source revision {}) at read {reads}",
                        s.lag_revisions,
                        s.watermark,
                        s.source_revision
                    );
                }
                if s.condition(mirror_core::ConditionType::ReplicationLagExceeded) {
                    bail!("ReplicationLagExceeded is True at read {reads} (lag {} s)", s.lag_seconds);
                }
                if Instant::now() >= until {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            println!("           lag_revisions at most {worst} over {reads} status reads");
        }
        if let Some(most) = max_watch_restarts {
            let got = self.status(agent).await?.watch_restarts;
            if got > *most {
                bail!("the source watch was re-opened {got} times, expected at most {most}");
            }
        }
        let mut note = String::new();
        let mut eventually = Vec::new();
        if let Some(p) = phase {
            eventually.push(Until::Phase(p.clone()));
        }
        if let Some(c) = condition {
            let (t, v, reason) = super::parse_condition(c)?;
            eventually.push(Until::Condition(t, v, reason));
        }
        if let Some(r) = last_error {
            eventually.push(Until::LastError(r.clone()));
        }
        if *equal == Some(true) {
            eventually.push(Until::Equal);
        }
        let deadline = Instant::now() + timeout.get();
        for until in &eventually {
            if let Err(why) = self.poll_until(until, agent, deadline).await {
                bail!("expected {until:?} within {:?}: {why}", timeout.get());
            }
        }
        if *equal == Some(false) {
            let parsed = self.base.parsed()?;
            let mut dst = self.target.client().await?;
            if difference_now(&mut self.src, &mut dst, &parsed.rewriter()).await?.is_none() {
                bail!("expected the sides to differ, they are equal");
            }
        }
        if let Some(most) = max_peak_rss_mib {
            let peak = self.status(agent).await?.peak_rss_bytes;
            println!("           agent peak RSS {} MiB (at most {most} MiB expected)", peak >> 20);
            if peak == 0 {
                bail!("the agent reports no peak_rss_bytes (no /proc?)");
            }
            if peak > most << 20 {
                bail!("agent peak RSS {} MiB > {most} MiB", peak >> 20);
            }
        }
        if min_scan_restarts.is_some() || max_scan_restarts.is_some() {
            let got = self.status(agent).await?.scan_restarts;
            if min_scan_restarts.is_some_and(|least| got < least) {
                bail!("expected at least {} genesis restarts, saw {got}", min_scan_restarts.unwrap_or(0));
            }
            if max_scan_restarts.is_some_and(|most| got > most) {
                bail!("expected at most {} genesis restarts, saw {got}", max_scan_restarts.unwrap_or(0));
            }
        }
        // One read per key named, present or absent as asked.
        let named: Vec<(&String, bool)> =
            target_has.iter().map(|k| (k, true)).chain(target_lacks.iter().map(|k| (k, false))).collect();
        if !named.is_empty() {
            let prefix = self.scenario.target_prefix().to_owned();
            let mut dst = self.target.client().await?;
            for (key, want) in named {
                let full = format!("{prefix}{key}");
                let there = !dst.get(full.as_bytes(), None).await?.kvs().is_empty();
                match (want, there) {
                    (true, false) => bail!("expected {full:?} in the target, it is gone"),
                    (false, true) => bail!("expected {full:?} gone from the target, it is there"),
                    _ => {}
                }
            }
        }
        if let Some(n) = forced_resyncs {
            let got = self.status(agent).await?.forced_resyncs;
            if got.count != *n {
                bail!("expected {n} forced resyncs, saw {} ({:?})", got.count, got.by_reason);
            }
        }
        if g3.is_some() {
            self.judge_violations("expect").await?;
            // And one check now, so a short scenario is judged at its end too.
            let parsed = self.base.parsed()?;
            let mut dst = self.target.client().await?;
            match check_g3(&mut self.src, &mut dst, &parsed.rewriter(), &parsed.checkpoint_key()).await? {
                G3::Holds { keys, watermark } => {
                    self.checker.holds.fetch_add(1, Ordering::Relaxed);
                    note = format!("G3 held ({keys} keys at {watermark})");
                }
                G3::NotYet => bail!("expected G3 held, but there is no checkpoint outside a scan"),
            }
        }
        if let Some(id) = sole_writer_after {
            let writer = self.status(id).await?.agent_id;
            let (writes, after) = self.checkpoint_writers_after(&writer).await?;
            note = format!(
                "{writes} checkpoint writes by {writer} since its first, none by another agent{note}"
            );
            if let Some(other) = after {
                bail!("after agent {id:?} ({writer}) first wrote the checkpoint, {other} wrote it again");
            }
        }
        if let Some(code) = agent_exit {
            let a = self.agent(agent)?;
            let exit = match a.exit {
                Some(e) => e,
                None => match a.process.is_running() {
                    true => bail!("expected agent {agent:?} to have exited with {code}, it is running"),
                    false => a.process.terminate().await?,
                },
            };
            if exit != Some(*code) {
                bail!("expected agent {agent:?} to exit with {code}, it exited with {exit:?}");
            }
        }
        Ok(note)
    }

    /// Reads the checkpoint key's whole history (a watch from revision 1): how many times
    /// `writer` wrote it since its first write, and the first other writer after that, if any.
    async fn checkpoint_writers_after(&mut self, writer: &str) -> anyhow::Result<(usize, Option<String>)> {
        let key = self.base.parsed()?.checkpoint_key();
        let mut dst = self.target.client().await?;
        let now = dst.get(key.clone(), None).await?;
        let last = now.kvs().first().map(|kv| kv.mod_revision()).context("no checkpoint")?;
        let mut stream =
            dst.watch(key, Some(etcd_client::WatchOptions::new().with_start_revision(1))).await?;
        let (mut seen, mut writes) = (false, 0usize);
        loop {
            let resp = tokio::time::timeout(Duration::from_secs(10), stream.message())
                .await
                .context("the checkpoint history did not arrive")??
                .context("the history watch ended")?;
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                let by = mirror_fence::Checkpoint::decode(kv.value()).map(|r| r.agent_id).unwrap_or_default();
                if by == writer {
                    seen = true;
                    writes += 1;
                } else if seen && ev.event_type() == etcd_client::EventType::Put {
                    return Ok((writes, Some(format!("{by} (at target revision {})", kv.mod_revision()))));
                }
                if kv.mod_revision() >= last {
                    anyhow::ensure!(seen, "agent {writer} never wrote the checkpoint");
                    return Ok((writes, None));
                }
            }
        }
    }

    /// Prints the failure with what an operator would look at first.
    async fn report_failure(&mut self, e: &anyhow::Error) {
        println!("FAILED: {e:#}");
        for (name, cluster) in [("source", &self.source), ("target", &self.target)] {
            if let Some(report) = cluster.members_disagree().await {
                println!("--- {name} etcd: {report} ---");
            }
        }
        for (id, agent) in &self.agents {
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
    async fn keep(&mut self) {
        println!("--keep: the clusters stay up until Ctrl-C");
        println!("source: {}", self.source.endpoints().join(","));
        println!("target: {}", self.target.endpoints().join(","));
        for (id, agent) in &self.agents {
            println!("agent {id}: {} (config below)\n{}", agent.process.url(), agent.config.render());
        }
        let _ = tokio::signal::ctrl_c().await;
    }

    async fn finish(mut self) {
        self.checker_task.abort();
        for bg in self.background.drain(..) {
            bg.handle.abort();
        }
        for agent in self.agents.values_mut() {
            let _ = agent.process.signal(libc::SIGCONT);
            let _ = agent.process.kill9().await;
        }
        // Agent containers leave the clusters' networks before the clusters remove them.
        self.agents.clear();
        for cluster in [&mut self.source, &mut self.target] {
            for node in cluster.nodes() {
                let _ = node.unpause().await;
            }
        }
    }
}

/// The phase as the status JSON names it.
fn phase_name(s: &mirror_core::Status) -> String {
    serde_json::to_value(s.phase).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

async fn compact(client: &mut Client, revision: &RevisionRef) -> anyhow::Result<String> {
    let rev = match revision {
        RevisionRef::At(r) => *r,
        RevisionRef::Named(_) => super::current_revision(client).await?,
    };
    client.compact(rev, None).await?;
    Ok(format!("at {rev}"))
}

/// Steps that write one side (`client`, keys under `prefix`): `load`, `churn`, `put`, `del`,
/// `txn`.
async fn write_step(
    src: &mut Client,
    prefix: &str,
    checkpoint: &[u8],
    seed: u64,
    step: &Step,
) -> anyhow::Result<String> {
    let key = |k: &Option<String>| match k {
        Some(k) => format!("{prefix}{k}").into_bytes(),
        None => checkpoint.to_vec(),
    };
    let value = |n: usize| "v".repeat(n);
    match step {
        Step::Load { keys, value_size, prefix: sub, lease, lease_every, .. } => {
            let lease = lease.map(|id| (id, lease_every.unwrap_or(1)));
            let rev = load_leased_keys(src, &format!("{prefix}{sub}"), *keys, *value_size, lease).await?;
            Ok(format!("to revision {rev}"))
        }
        Step::Revoke { lease, .. } => {
            let rev = src.lease_revoke(*lease).await?.header().map_or(0, |h| h.revision());
            Ok(format!("lease {lease} revoked at {rev}"))
        }
        Step::Churn { ops, rate, keyspace, value_size, prefix: sub } => {
            let report = Churn::new(&format!("{prefix}{sub}"), *ops, *rate, *keyspace)
                .value_size(*value_size)
                .seed(seed)
                .tolerant()
                .with_leases()
                .spawn(src.clone())
                .await??;
            Ok(format!("{} ops acknowledged, {} failed", report.ops, report.failed))
        }
        Step::Put { key: k, value: v, value_size, .. } => {
            let v = v.clone().unwrap_or_else(|| value(*value_size));
            let rev = src.put(key(k), v, None).await?.header().map_or(0, |h| h.revision());
            Ok(format!("at {rev}"))
        }
        Step::Del { key: k, prefix: sub, .. } => {
            let resp = match sub {
                Some(p) => {
                    src.delete(format!("{prefix}{p}"), Some(DeleteOptions::new().with_prefix())).await?
                }
                None => src.delete(key(k), None).await?,
            };
            Ok(format!("{} keys deleted", resp.deleted()))
        }
        Step::Txn { ops, value_size, prefix: sub } => {
            let puts: Vec<TxnOp> = (0..*ops)
                .map(|i| TxnOp::put(format!("{prefix}{sub}txn-{seed}-{i:05}"), value(*value_size), None))
                .collect();
            let rev = src.txn(Txn::new().and_then(puts)).await?.header().map_or(0, |h| h.revision());
            Ok(format!("{ops} puts at {rev}"))
        }
        other => bail!("{} does not write the source", other.kind()),
    }
}

/// Runs `etcdctl check perf` against `source` and returns its verdict lines.
async fn check_perf(source: &EtcdCluster, load: &str, prefix: &str) -> anyhow::Result<String> {
    let out = tokio::process::Command::new(source.spec().version.etcdctl())
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={}", source.endpoints().join(",")))
        .args(["check", "perf", &format!("--load={load}"), &format!("--prefix={prefix}")])
        .kill_on_drop(true)
        .output()
        .await
        .context("running etcdctl check perf")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let verdict: Vec<&str> =
        text.lines().filter(|l| l.starts_with("PASS") || l.starts_with("FAIL")).collect();
    anyhow::ensure!(
        !verdict.is_empty(),
        "etcdctl check perf gave no verdict ({}): {}{}",
        out.status,
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(verdict.join("; "))
}

/// Checks G3 every 300 ms while enabled, counting holds, unreadable sides and violations.
async fn check_continuously(
    mut src: Client,
    mut dst: Client,
    rewriter: mirror_core::KeyRewriter,
    checkpoint_key: Vec<u8>,
    state: Arc<CheckerState>,
) {
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        if !state.enabled.load(Ordering::Relaxed) {
            continue;
        }
        let check = tokio::time::timeout(
            Duration::from_secs(20),
            check_g3(&mut src, &mut dst, &rewriter, &checkpoint_key),
        )
        .await;
        match check {
            Ok(Ok(G3::Holds { .. })) => drop(state.holds.fetch_add(1, Ordering::Relaxed)),
            Ok(Ok(G3::NotYet)) => {}
            Ok(Err(e)) if e.downcast_ref::<G3Violation>().is_some() => {
                state.violations.write().await.push(format!("{e:#}"))
            }
            Ok(Err(_)) | Err(_) => drop(state.unreadable.fetch_add(1, Ordering::Relaxed)),
        }
    }
}
