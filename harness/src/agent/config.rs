//! The agent's config file as a test writes it, and the one-shot commands run with it.

use std::path::PathBuf;
use std::process::Stdio;

use anyhow::Context as _;
use tokio::process::Command;

/// The agent binary: `MIRROR_AGENT_BIN`, else the workspace's `target/debug/mirror-agent`
/// (`scripts/test.sh` builds it before the tests).
pub fn agent_binary() -> PathBuf {
    std::env::var_os("MIRROR_AGENT_BIN").map(PathBuf::from).unwrap_or_else(|| {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")));
        target.join("debug").join("mirror-agent")
    })
}

/// A generated agent config: the required parts plus any extra TOML.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// `link_uid`.
    pub link_uid: String,
    /// `epoch`.
    pub epoch: u64,
    /// Source endpoints.
    pub source: Vec<String>,
    /// Target endpoints.
    pub target: Vec<String>,
    /// `source.prefix`.
    pub source_prefix: String,
    /// `target.prefix`.
    pub target_prefix: String,
    /// Extra top-level keys, before any section (e.g. `mode = "drain"`).
    pub top: String,
    /// Extra sections, appended verbatim (e.g. `[sync]\nmax_txn_ops = 16`).
    pub extra: String,
    /// Environment variables for the agent process (e.g. a `password_env`).
    pub env: Vec<(String, String)>,
    /// Extra command-line arguments for `mirror-agent run`.
    pub args: Vec<String>,
    /// TOML documents merged over the rendered config, in order (tables merge key by key).
    pub overlays: Vec<String>,
}

impl AgentConfig {
    /// A link `link_uid` from `source` to `target` with the same prefix on both sides.
    pub fn new(link_uid: &str, source: Vec<String>, target: Vec<String>, prefix: &str) -> AgentConfig {
        AgentConfig {
            link_uid: link_uid.into(),
            epoch: 1,
            source,
            target,
            source_prefix: prefix.into(),
            target_prefix: prefix.into(),
            top: String::new(),
            extra: String::new(),
            env: Vec::new(),
            args: Vec::new(),
            overlays: Vec::new(),
        }
    }

    /// Appends TOML.
    pub fn with(mut self, toml: &str) -> AgentConfig {
        self.extra.push('\n');
        self.extra.push_str(toml);
        self
    }

    /// Adds a command-line argument to `mirror-agent run`.
    pub fn arg(mut self, arg: &str) -> AgentConfig {
        self.args.push(arg.into());
        self
    }

    /// Sets an environment variable for the agent process.
    pub fn env(mut self, name: &str, value: &str) -> AgentConfig {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Adds a top-level key (before every section).
    pub fn top(mut self, toml: &str) -> AgentConfig {
        self.top.push_str(toml);
        self.top.push('\n');
        self
    }

    /// Merges `toml` over the config when it is rendered: keys it sets replace the config's,
    /// tables merge key by key (unlike [`AgentConfig::with`], which appends text).
    pub fn overlay(mut self, toml: &str) -> AgentConfig {
        if !toml.trim().is_empty() {
            self.overlays.push(toml.to_owned());
        }
        self
    }

    /// The reverse link of this one, for a failback: the target becomes the source and the
    /// old source the target (endpoints and prefixes swapped), under its own `link_uid`
    /// (`<link_uid>-reverse`), every other setting kept.
    pub fn reversed(&self) -> AgentConfig {
        AgentConfig {
            link_uid: format!("{}-reverse", self.link_uid),
            source: self.target.clone(),
            target: self.source.clone(),
            source_prefix: self.target_prefix.clone(),
            target_prefix: self.source_prefix.clone(),
            ..self.clone()
        }
    }

    /// Sets the epoch.
    pub fn epoch(mut self, epoch: u64) -> AgentConfig {
        self.epoch = epoch;
        self
    }

    /// The TOML text, overlays merged.
    pub fn render(&self) -> String {
        let text = self.render_base();
        if self.overlays.is_empty() {
            return text;
        }
        let Ok(mut table) = text.parse::<toml::Table>() else { return text };
        for overlay in &self.overlays {
            if let Ok(over) = overlay.parse::<toml::Table>() {
                merge(&mut table, over);
            }
        }
        toml::to_string(&table).unwrap_or(text)
    }

    fn render_base(&self) -> String {
        let list = |e: &[String]| e.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", ");
        format!(
            "link_uid = {:?}\nepoch = {}\n{}\n[source]\nendpoints = [{}]\nprefix = {:?}\n\n[target]\nendpoints = [{}]\nprefix = {:?}\n{}\n",
            self.link_uid,
            self.epoch,
            self.top,
            list(&self.source),
            self.source_prefix,
            list(&self.target),
            self.target_prefix,
            self.extra
        )
    }

    /// The mirror-core view of this config (for the rewriter and checkpoint key).
    pub fn parsed(&self) -> anyhow::Result<mirror_core::Config> {
        Ok(mirror_core::Config::from_toml_str(&self.render())?)
    }
}

/// Merges `from` into `into`: tables key by key, everything else replaced.
fn merge(into: &mut toml::Table, from: toml::Table) {
    for (key, value) in from {
        match (into.get_mut(&key), value) {
            (Some(toml::Value::Table(a)), toml::Value::Table(b)) => merge(a, b),
            (_, value) => {
                into.insert(key, value);
            }
        }
    }
}

/// Runs a one-shot `mirror-agent SUBCOMMAND --config FILE ARGS...` (verify, cutover) with a
/// generated config and returns its output.
pub async fn agent_command(
    config: &AgentConfig,
    subcommand: &str,
    args: &[&str],
) -> anyhow::Result<std::process::Output> {
    let dir = tempfile::Builder::new().prefix("mirror-agent-cmd-").tempdir()?;
    let path = dir.path().join("mirror.toml");
    std::fs::write(&path, config.render())?;
    let out = Command::new(agent_binary())
        .arg(subcommand)
        .arg("--config")
        .arg(&path)
        .args(args)
        .envs(config.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running mirror-agent {subcommand}"))?;
    Ok(out)
}
