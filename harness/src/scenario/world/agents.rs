//! The agents of a scenario's world: started and stopped by id, their status, and the one-shot
//! commands (`cutover`, `failover`, ...) run with their config.

use super::*;

impl World<'_> {
    pub(in crate::scenario) fn agent(&mut self, id: &str) -> anyhow::Result<&mut Agent> {
        self.agents.get_mut(id).with_context(|| format!("agent {id:?} was never started"))
    }

    pub(in crate::scenario) async fn start_agent(
        &mut self,
        id: &str,
        epoch: Option<u64>,
        toml: Option<&str>,
        reverse: bool,
    ) -> anyhow::Result<String> {
        if let Some(agent) = self.agents.get_mut(id) {
            if agent.reverse != reverse {
                bail!("agent {id:?} was started with reverse = {}", agent.reverse);
            }
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
        let base = if reverse { self.base.reversed() } else { self.base.clone() };
        let mut config = base.overlay(toml.unwrap_or_default());
        if let Some(e) = epoch {
            config = config.epoch(e);
        }
        let process = AgentProcess::start_on(&config, self.agent_backend.clone()).await?;
        let url = process.url();
        self.agents.insert(id.to_owned(), Agent { process, config, reverse, exit: None });
        Ok(url)
    }

    pub(in crate::scenario) async fn stop_agent(
        &mut self,
        id: &str,
        signal: Signal,
    ) -> anyhow::Result<String> {
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

    pub(in crate::scenario) async fn one_shot(
        &mut self,
        id: &str,
        command: &str,
        args: &[&str],
        expect: i32,
    ) -> anyhow::Result<String> {
        self.one_shot_output(id, command, args, expect).await?;
        Ok(format!("exit {expect}"))
    }

    /// Runs `mirror-agent COMMAND` with agent `id`'s config (the base config when it never
    /// started) and returns its stdout; fails unless it exits with `expect`.
    pub(in crate::scenario) async fn one_shot_output(
        &mut self,
        id: &str,
        command: &str,
        args: &[&str],
        expect: i32,
    ) -> anyhow::Result<String> {
        let (config, reverse) = match self.agents.get(id) {
            Some(a) => (a.config.clone(), a.reverse),
            None => (self.base.clone(), false),
        };
        self.one_shot_with(config, reverse, command, args, expect).await
    }

    /// The reverse link's config (`AgentConfig::reversed`) with `toml` merged over it, for a
    /// one-shot command before (or without) its agent.
    pub(in crate::scenario) fn reverse_config(&self, toml: &str) -> AgentConfig {
        self.base.reversed().overlay(toml)
    }

    /// Runs `mirror-agent COMMAND` with `config` (a reverse link's when `reverse`) and returns
    /// its stdout; fails unless it exits with `expect`.
    pub(in crate::scenario) async fn one_shot_with(
        &mut self,
        mut config: AgentConfig,
        reverse: bool,
        command: &str,
        args: &[&str],
        expect: i32,
    ) -> anyhow::Result<String> {
        // One-shot commands run on the host, so through the proxies even when the agents run
        // in containers (and see etcd by its container names).
        let (source, target) = (self.source_proxies.endpoints(), self.target_proxies.endpoints());
        (config.source, config.target) = if reverse { (target, source) } else { (source, target) };
        let out = agent_command(&config, command, args).await?;
        let code = out.status.code();
        if code != Some(expect) {
            bail!(
                "mirror-agent {command} exited {code:?}, expected {expect}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                String::from_utf8_lossy(&out.stdout),
                tail(&String::from_utf8_lossy(&out.stderr), 30)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub(in crate::scenario) async fn status(&mut self, id: &str) -> anyhow::Result<mirror_core::Status> {
        self.agent(id)?.process.status().await
    }
}
