//! The world a scenario acts on: both clusters, the fault proxies, the agents, the
//! continuous G3 checker and the background steps. Steps (`step/`) act on it; the runner
//! (`run.rs`) orders them and prints.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use etcd_client::Client;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::checker::{check_continuously, CheckerState};
use super::file::Scenario;
use super::sides::{Journal, MemberRef, SideName, Sides, Signal};
use super::FAST_SYNC_TOML;
use crate::{
    agent_command, difference_now, AgentBackend, AgentConfig, AgentProcess, Backend, ClusterSpec,
    EtcdCluster, EtcdVersion, Proxies,
};

mod agents;

/// One agent of the run.
pub(in crate::scenario) struct Agent {
    pub process: AgentProcess,
    pub config: AgentConfig,
    /// A reverse link's agent (target to source: a failback).
    pub reverse: bool,
    /// The exit code of its last stop, if it stopped.
    pub exit: Option<Option<i32>>,
}

/// One background step.
pub(in crate::scenario) struct Background {
    pub line: usize,
    pub what: String,
    pub handle: JoinHandle<anyhow::Result<String>>,
}

/// How a run is done.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Overrides the file's `seed`.
    pub seed: Option<u64>,
    /// On failure, leave the clusters up and wait for Ctrl-C.
    pub keep: bool,
    /// Where etcd runs (default: detected).
    pub backend: Option<Backend>,
    /// Extra environment for every agent process (e.g. a failpoint of `mirror_core::failpoint`).
    pub agent_env: Vec<(String, String)>,
    /// Overrides the file's `agent_backend`.
    pub agent_backend: Option<super::AgentKind>,
}

/// The members each side has stopped (killed, stopped, restored members excepted).
#[derive(Default)]
pub(in crate::scenario) struct StoppedMembers(BTreeSet<(bool, usize)>);

impl StoppedMembers {
    /// Member `i` of `side` went down.
    pub fn stopped(&mut self, side: SideName, i: usize) {
        self.0.insert((side == SideName::Source, i));
    }

    /// Member `i` of `side` runs again.
    pub fn started(&mut self, side: SideName, i: usize) {
        self.0.remove(&(side == SideName::Source, i));
    }

    /// The stopped members of `side`, in order.
    pub fn of(&self, side: SideName) -> Vec<usize> {
        let key = side == SideName::Source;
        self.0.iter().filter(|(s, _)| *s == key).map(|(_, i)| *i).collect()
    }
}

/// Clusters, proxies, agents and checker of one run of a scenario.
pub struct World<'a> {
    pub(in crate::scenario) scenario: &'a Scenario,
    pub(in crate::scenario) seed: u64,
    pub(in crate::scenario) started: Instant,
    pub(in crate::scenario) source: EtcdCluster,
    pub(in crate::scenario) target: EtcdCluster,
    pub(in crate::scenario) source_proxies: Proxies,
    pub(in crate::scenario) target_proxies: Proxies,
    /// The runner's own source client, made again over the answering members after a member
    /// change.
    pub(in crate::scenario) src: Client,
    /// The generated agent config every agent starts from.
    pub(in crate::scenario) base: AgentConfig,
    pub(in crate::scenario) agent_backend: AgentBackend,
    pub(in crate::scenario) agents: BTreeMap<String, Agent>,
    pub(in crate::scenario) members: StoppedMembers,
    pub(in crate::scenario) background: Vec<Background>,
    pub(in crate::scenario) checker: Arc<CheckerState>,
    pub(in crate::scenario) checker_task: JoinHandle<()>,
    /// What the steps wrote to the source.
    pub(in crate::scenario) journal: Journal,
}

impl<'a> World<'a> {
    pub(in crate::scenario) async fn start(
        scenario: &'a Scenario,
        seed: u64,
        sv: EtcdVersion,
        tv: EtcdVersion,
        opts: &RunOptions,
    ) -> anyhow::Result<World<'a>> {
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
        // Both at once: most of a start is Docker's (network, container, port), not etcd's.
        let (source, target) = tokio::join!(
            EtcdCluster::start(spec(sv, &scenario.source)),
            EtcdCluster::start(spec(tv, &scenario.target))
        );
        let mut source = source.context("starting the source")?;
        let mut target = target.context("starting the target")?;
        // The rights docs/operations.md lists ("Least privilege"), and nothing more.
        let mut auth_toml = String::new();
        for (name, side, cluster, prefix) in [
            ("source", &scenario.source, &mut source, scenario.source_prefix()),
            ("target", &scenario.target, &mut target, scenario.target_prefix()),
        ] {
            if !side.least_privilege {
                continue;
            }
            let perm = if name == "source" {
                etcd_client::Permission::read(prefix)
            } else {
                etcd_client::Permission::read_write(prefix)
            };
            let auth = cluster
                .enable_auth("mirror", vec![perm.with_prefix()])
                .await
                .with_context(|| format!("enabling auth on the {name}"))?;
            let file = auth.password_file.expect("enable_auth writes a password file");
            auth_toml.push_str(&format!(
                "[{name}.auth]\nusername = \"mirror\"\npassword_file = {:?}\n",
                file.display().to_string()
            ));
        }
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
        let mut base = base.overlay(FAST_SYNC_TOML).overlay(&scenario.agent_toml).overlay(&auth_toml);
        base.env.extend(opts.agent_env.iter().cloned());
        let parsed = base.parsed().context("the generated agent config")?;
        let src = source.client().await?;
        let checker = Arc::new(CheckerState { enabled: AtomicBool::new(true), ..CheckerState::default() });
        let checker_task = tokio::spawn(check_continuously(
            src.clone(),
            target.client().await?,
            parsed.rewriter(),
            parsed.checkpoint_key(),
            parsed.sync.leases == mirror_core::LeaseMode::Preserve,
            checker.clone(),
        ));
        Ok(World {
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
            members: StoppedMembers::default(),
            background: Vec::new(),
            checker,
            checker_task,
            journal: Journal::default(),
        })
    }

    pub(in crate::scenario) fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    pub(in crate::scenario) async fn judge_violations(&self, when: &str) -> anyhow::Result<()> {
        if let Some(v) = self.checker.violations.read().await.first() {
            bail!("the continuous G3 checker found a violation (seen by {when}): {v}");
        }
        Ok(())
    }

    pub(in crate::scenario) async fn join_background(&mut self) -> anyhow::Result<()> {
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

    /// Prints how each background step that has already ended went (with a failure: a
    /// background step that failed early, a client that stopped keeping its leases, is often
    /// why a later step failed, and would otherwise be said only at the end).
    pub(in crate::scenario) async fn report_ended_background(&mut self) {
        let (ended, running) = self.background.drain(..).partition(|bg| bg.handle.is_finished());
        self.background = running;
        for bg in ended {
            match bg.handle.await.map_err(anyhow::Error::from).and_then(|r| r) {
                Ok(note) => println!("--- background {} (line {}): had ended: {note}", bg.what, bg.line),
                Err(e) => println!("--- background {} (line {}): had FAILED: {e:#}", bg.what, bg.line),
            }
        }
    }

    pub(in crate::scenario) fn cluster(&mut self, side: SideName) -> &mut EtcdCluster {
        match side {
            SideName::Source => &mut self.source,
            SideName::Target => &mut self.target,
        }
    }

    pub(in crate::scenario) fn proxies(&self, side: SideName) -> &Proxies {
        match side {
            SideName::Source => &self.source_proxies,
            SideName::Target => &self.target_proxies,
        }
    }

    pub(in crate::scenario) async fn member(
        &mut self,
        side: SideName,
        member: &MemberRef,
    ) -> anyhow::Result<usize> {
        let cluster = self.cluster(side);
        match member {
            MemberRef::Index(i) if *i < cluster.nodes().len() => Ok(*i),
            MemberRef::Index(i) => {
                bail!("member {i}: the {side:?} side has {} members", cluster.nodes().len())
            }
            MemberRef::Named(_) => cluster.leader_index(Duration::from_secs(30)).await,
        }
    }

    /// After a member of `side` went away or came back: the runner's own source client is
    /// made again over the members that answer now, as the agent does (a client of a stopped
    /// member keeps sending it a share of the requests, and the checks fail on those).
    pub(in crate::scenario) async fn members_changed(&mut self, side: SideName) -> anyhow::Result<()> {
        // With every member of the source down (a lost source) no client can be made: the old
        // one stays, and fails like any would until a member is back.
        let all_down = self.members.of(side).len() == self.cluster(side).nodes().len();
        if side == SideName::Source && !all_down {
            self.src = self.source.client().await?;
        }
        Ok(())
    }

    /// Clients of both sides and the link's prefixes, for a step that only writes.
    pub(in crate::scenario) async fn sides(&self) -> anyhow::Result<Sides> {
        Ok(Sides {
            source: self.src.clone(),
            target: self.target.client().await?,
            source_prefix: self.scenario.source_prefix().to_owned(),
            target_prefix: self.scenario.target_prefix().to_owned(),
            checkpoint: self.base.parsed()?.checkpoint_key(),
            journal: self.journal.clone(),
        })
    }

    /// Runs `write` (a source write, not started until awaited here) and checks that agent `a`
    /// applied it as exactly `want` target revisions: from caught up before it to caught up
    /// after it, nothing else writes the target.
    pub(in crate::scenario) async fn applied_as(
        &mut self,
        want: i64,
        write: impl std::future::Future<Output = anyhow::Result<String>>,
    ) -> anyhow::Result<String> {
        let mut src = self.src.clone();
        let mut dst = self.target.client().await?;
        super::caught_up(&self.agent("a")?.process, &mut src).await?;
        let before = super::current_revision(&mut dst).await?;
        let note = write.await?;
        super::caught_up(&self.agent("a")?.process, &mut src).await?;
        let after = super::current_revision(&mut dst).await?;
        let checkpoint = self.base.parsed()?.checkpoint_key();
        let moved =
            super::data_revisions(&mut dst, self.scenario.target_prefix(), &checkpoint, before, after)
                .await?;
        if moved != want {
            bail!("{note}: applied as {moved} target revisions, expected {want}");
        }
        Ok(format!("{note}, applied as {moved} target revision(s)"))
    }

    /// How target and source differ now, if they do.
    pub(in crate::scenario) async fn difference(&mut self) -> anyhow::Result<Option<String>> {
        let parsed = self.base.parsed()?;
        let mut dst = self.target.client().await?;
        difference_now(&mut self.src, &mut dst, &parsed.rewriter()).await
    }

    /// Member `i` of `side` went down.
    pub(in crate::scenario) async fn member_stopped(
        &mut self,
        side: SideName,
        i: usize,
    ) -> anyhow::Result<()> {
        self.members.stopped(side, i);
        self.members_changed(side).await
    }

    /// The stopped members of `side`.
    pub(in crate::scenario) fn stopped_members(&self, side: SideName) -> Vec<usize> {
        self.members.of(side)
    }

    pub(in crate::scenario) async fn finish(mut self) {
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

/// The last `n` lines of `text`.
pub(in crate::scenario) fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
