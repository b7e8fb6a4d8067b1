//! Steps on the agents: `start_agent`, `stop_agent`, `reload_agent`, and the one-shot
//! commands `cutover` and `verify`.

use std::time::Duration;

use anyhow::Context as _;
use mirror_core::HumanDuration;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{agent_a, is_a, is_false, is_zero, Signal, Step};
use crate::scenario::world::World;

/// Starts (or restarts) agent `id`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StartAgent {
    /// Agent id.
    #[serde(default = "agent_a", skip_serializing_if = "is_a")]
    pub id: String,
    /// Its epoch (default 1, or what it had).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// TOML merged over `[agent] toml` for this agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toml: Option<String>,
    /// Extension: the reverse link's agent (target to source, `<link>-reverse`): a failback.
    #[serde(default, skip_serializing_if = "is_false")]
    pub reverse: bool,
}

#[async_trait::async_trait]
#[typetag::serde(name = "start_agent")]
impl Step for StartAgent {
    fn check(&self) -> anyhow::Result<()> {
        check_toml(self.toml.as_deref().unwrap_or_default())
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        world.start_agent(&self.id, self.epoch, self.toml.as_deref(), self.reverse).await
    }
}

/// Signals agent `id`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StopAgent {
    /// Agent id.
    #[serde(default = "agent_a", skip_serializing_if = "is_a")]
    pub id: String,
    /// TERM (default), KILL, STOP or CONT.
    #[serde(default)]
    pub signal: Signal,
    /// Extension: the agent has exited within this of the signal (TERM only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub within: Option<HumanDuration>,
}

#[async_trait::async_trait]
#[typetag::serde(name = "stop_agent")]
impl Step for StopAgent {
    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.within.is_none() || self.signal == Signal::Term,
            "stop_agent: `within` is for signal = \"TERM\""
        );
        Ok(())
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let started = Instant::now();
        let note = world.stop_agent(&self.id, self.signal).await?;
        let took = started.elapsed();
        if let Some(within) = self.within {
            anyhow::ensure!(
                took <= within.get(),
                "agent {:?} took {took:?} to exit, more than {within:?}",
                self.id
            );
        }
        Ok(format!("{note} in {:.2}s", took.as_secs_f64()))
    }
}

/// Merges `toml` into agent `id`'s config and sends SIGHUP.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReloadAgent {
    /// Agent id.
    #[serde(default = "agent_a", skip_serializing_if = "is_a")]
    pub id: String,
    /// TOML merged over its config.
    #[serde(default)]
    pub toml: String,
    /// A new epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
}

#[async_trait::async_trait]
#[typetag::serde(name = "reload_agent")]
impl Step for ReloadAgent {
    fn check(&self) -> anyhow::Result<()> {
        check_toml(&self.toml)
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let agent = world.agent(&self.id)?;
        let mut config = agent.config.clone().overlay(&self.toml);
        if let Some(e) = self.epoch {
            config = config.epoch(e);
        }
        agent.config = config.clone();
        agent.process.reload(config)?;
        Ok(String::new())
    }
}

/// `mirror-agent cutover` with agent `id`'s config.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Cutover {
    /// Agent id whose config is used.
    #[serde(default = "agent_a", skip_serializing_if = "is_a")]
    pub id: String,
    /// Extra arguments, e.g. `["--wait"]`.
    #[serde(default)]
    pub args: Vec<String>,
    /// Expected exit code.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub expect: i32,
}

#[async_trait::async_trait]
#[typetag::serde(name = "cutover")]
impl Step for Cutover {
    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        world.one_shot(&self.id, "cutover", &args, self.expect).await
    }
}

/// `mirror-agent failover` with agent `id`'s config: promote the target without the source
/// (SPEC §5, Failover).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Failover {
    /// Agent id whose config is used.
    #[serde(default = "agent_a", skip_serializing_if = "is_a")]
    pub id: String,
    /// Extra arguments, e.g. `["--force"]`.
    #[serde(default)]
    pub args: Vec<String>,
    /// Expected exit code.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub expect: i32,
    /// Extension: the command returns within this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub within: Option<HumanDuration>,
    /// Extension: the `confirmed_time` it prints is at most this old (the data-loss window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_confirmed_age: Option<HumanDuration>,
}

#[async_trait::async_trait]
#[typetag::serde(name = "failover")]
impl Step for Failover {
    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let started = Instant::now();
        let out = world.one_shot_output(&self.id, "failover", &args, self.expect).await?;
        let took = started.elapsed();
        if let Some(within) = self.within {
            anyhow::ensure!(took <= within.get(), "failover took {took:?}, more than {within:?}\n{out}");
        }
        let line =
            |name: &str| out.lines().find(|l| l.trim_start().starts_with(name)).map(str::trim).unwrap_or("");
        if let Some(most) = self.max_confirmed_age {
            let age = line("confirmed_time")
                .split_once(" (")
                .and_then(|(_, rest)| rest.split_once("s ago"))
                .and_then(|(n, _)| n.parse::<u64>().ok())
                .ok_or_else(|| anyhow::anyhow!("failover printed no confirmation age:\n{out}"))?;
            anyhow::ensure!(
                Duration::from_secs(age) <= most.get(),
                "the source was last confirmed {age}s before the failover, more than {most:?}\n{out}"
            );
        }
        Ok(format!(
            "exit {} in {:.1}s; {}; {}",
            self.expect,
            took.as_secs_f64(),
            line("watermark"),
            line("confirmed_time")
        ))
    }
}

/// Extension: `mirror-agent failback-plan` with the reverse link's config (`toml` merged over
/// it), at the promoted watermark (read from the target's checkpoint), into a file. With exit
/// 0 the plan must list exactly what the journal (`put`, `del`, `txn` steps) holds after the
/// watermark: every write in revision order from the history, or with `listed_from = "keys"`
/// (a compacted old source) the puts that survive, deletes unlisted.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FailbackPlan {
    /// TOML merged over the reverse link's config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toml: Option<String>,
    /// Expected exit code.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub expect: i32,
    /// `"history"` (default) or `"keys"`: where the plan must say it listed from.
    #[serde(default = "history")]
    pub listed_from: String,
}

fn history() -> String {
    "history".into()
}

#[async_trait::async_trait]
#[typetag::serde(name = "failback_plan")]
impl Step for FailbackPlan {
    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            ["history", "keys"].contains(&self.listed_from.as_str()),
            "failback_plan: listed_from {:?} (\"history\" or \"keys\")",
            self.listed_from
        );
        Ok(())
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let key = world.base.parsed()?.checkpoint_key();
        let resp = world.target.client().await?.get(key, None).await?;
        let record = resp
            .kvs()
            .first()
            .map(|kv| mirror_fence::Checkpoint::decode(kv.value()))
            .transpose()?
            .ok_or_else(|| anyhow::anyhow!("failback_plan: the target holds no checkpoint"))?;
        let watermark = record.watermark;
        let dir = tempfile::tempdir()?;
        let out = dir.path().join("plan.jsonl");
        let config = world.reverse_config(self.toml.as_deref().unwrap_or_default());
        let args = ["--promoted-watermark", &watermark.to_string(), "--out", &out.to_string_lossy()];
        let printed = world.one_shot_with(config, true, "failback-plan", &args, self.expect).await?;
        print!("{printed}");
        if self.expect != 0 {
            anyhow::ensure!(
                !out.exists(),
                "failback-plan exited {} but wrote {}",
                self.expect,
                out.display()
            );
            return Ok(format!("exit {}", self.expect));
        }
        let plan = crate::scenario::plan::Plan::read(&out)?;
        let rewriter = world.reverse_config(self.toml.as_deref().unwrap_or_default()).parsed()?.rewriter();
        plan.matches(&world.journal, &rewriter, watermark, &self.listed_from)
            .map_err(|e| e.context(format!("the plan at watermark {watermark}\n{printed}")))?;
        Ok(format!(
            "watermark {watermark}: {} puts, {} deletes listed from {}, as the journal says",
            plan.puts(),
            plan.deletes(),
            plan.listed_from
        ))
    }
}

/// `mirror-agent verify` with agent `id`'s config.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Verify {
    /// Agent id whose config is used.
    #[serde(default = "agent_a", skip_serializing_if = "is_a")]
    pub id: String,
    /// Expected exit code.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub expect: i32,
}

#[async_trait::async_trait]
#[typetag::serde(name = "verify")]
impl Step for Verify {
    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        world.one_shot(&self.id, "verify", &[], self.expect).await
    }
}

fn check_toml(text: &str) -> anyhow::Result<()> {
    text.parse::<toml::Table>().map_err(|e| anyhow::anyhow!("toml: {e}")).map(drop)
}

/// Runs the fix command of agent `id`'s `last_error` (`last_error.fix`) with bash, the target
/// version's `etcdctl` first on the PATH: what an operator pastes must do what it says.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RunFix {
    /// Agent id.
    #[serde(default = "agent_a", skip_serializing_if = "is_a")]
    pub id: String,
}

#[async_trait::async_trait]
#[typetag::serde(name = "run_fix")]
impl Step for RunFix {
    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let status = world.status(&self.id).await?;
        let error = status.last_error.context("the agent reports no last_error")?;
        let fix = error.fix.with_context(|| format!("last_error {} carries no fix command", error.reason))?;
        let etcdctl = world.target.spec().version.etcdctl();
        let dir = etcdctl.parent().context("etcdctl has a directory")?;
        let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default());
        let out = tokio::process::Command::new("bash")
            .args(["-c", &fix])
            .env("PATH", path)
            .env("ETCDCTL_API", "3")
            .kill_on_drop(true)
            .output()
            .await
            .context("running bash")?;
        anyhow::ensure!(
            out.status.success(),
            "{fix}: {} {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(format!("{fix} -> {}", String::from_utf8_lossy(&out.stdout).trim()))
    }
}

/// `mirror-agent retire` with agent `id`'s config.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Retire {
    /// Agent id whose config is used.
    #[serde(default = "agent_a", skip_serializing_if = "is_a")]
    pub id: String,
    /// `--force`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub force: bool,
    /// Expected exit code.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub expect: i32,
}

#[async_trait::async_trait]
#[typetag::serde(name = "retire")]
impl Step for Retire {
    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let args: &[&str] = if self.force { &["--force"] } else { &[] };
        world.one_shot(&self.id, "retire", args, self.expect).await
    }
}
