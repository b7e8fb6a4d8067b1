//! The scenario file format of SPEC §8, parsed strictly: an unknown key or step kind is an
//! error that names its line, so a typo never turns a check into a no-op.
//!
//! Additions beyond SPEC §8, all optional, so files written to SPEC §8 run unchanged:
//! - `wait until = "background"` waits for every background step to finish; `until =
//!   "caught_up"` until the agent's watermark reaches the source's head revision (equal
//!   contents can come a revision earlier, when that revision rewrote a value unchanged);
//!   `until = "log:TEXT"` until a line of the agent's log contains TEXT;
//! - any step may say `g3_checker = false` (or `true`) to pause (or resume) the continuous G3
//!   checker from that step on;
//! - `expect sole_writer_after = "ID"` reads the checkpoint key's history: once agent ID first
//!   wrote it, nobody else did;
//! - `load`, `put` and `del` take `side = "target"` (keys relative to `target.prefix`), and
//!   `put`/`del` take `checkpoint = true` for the link's checkpoint key (a corrupt-checkpoint
//!   scenario writes it);
//! - `load` takes `lease = ID` (and `lease_every = N`: every Nth key) to put keys under a source
//!   lease, and `revoke lease = ID` revokes it (etcd deletes its keys in one revision; with
//!   `side = "target"` the target's copy, as a lease lapsing there);
//!   `del` and `revoke` take `target_revisions = N`: the agent applies that source revision as
//!   exactly N target revisions (1: atomically);
//! - `check_perf` runs `etcdctl check perf` (`load`, `prefix`) against the source;
//! - `expect` also takes `target_has` / `target_lacks` (keys that must or must not be in the
//!   target), `min_scan_restarts` / `max_scan_restarts`, `min_watch_restarts` /
//!   `max_watch_restarts` (the agent's `watch_restarts`), `max_peak_rss_mib` (the agent's own
//!   `peak_rss_bytes`), `max_lag_revisions` with `during`, `last_error` (a reason), and
//!   `log_once` (texts each in exactly one line of the agent's log);
//! - `snapshot` / `restore` (`side`, `name`) save a side and later put it back, as an operator
//!   restoring a cluster from a snapshot would; `restore from = "source"` restores the target
//!   from the source's snapshot (an exact replica's seed, SPEC §10).
//! - exact mode (`[agent] toml` with `sync.revisions = "exact"`, `source.prefix = ""`):
//!   `expect exact = true` and `wait until = "exact"`: the target's revision is the source's and
//!   every key outside the reserved namespace agrees in value, create and mod revision, version
//!   and lease;
//! - `load keyspace = N`: the `keys` puts cycle over N distinct keys, the later overwriting (many
//!   revisions of large values that both sides still read in one response);
//! - `failover` (SPEC §8: `args`, `expect`) also takes `within` (the command's time) and
//!   `max_confirmed_age` (the age of the `confirmed_time` it prints); `expect` also takes
//!   `checkpoint_role` and `target_still_for` (the target's revision does not move for that long).
//! - `start_agent reverse = true` starts the reverse link's agent (target to source, link
//!   `<name>-reverse`: a failback); `cutover` and `wait` with its id then act on that link.
//! - `failback_plan` (`toml`, `expect`, `listed_from = "history" | "keys"`) runs
//!   `mirror-agent failback-plan` with the reverse link's config at the watermark in the
//!   target's checkpoint and holds the plan against the journal: what the file's own `put`,
//!   `del` and `txn` steps wrote to the source (`load`, `churn` and `revoke` are not recorded).
//! - `load lease_ttl = S` grants `lease` with that TTL when it does not exist yet; `expect
//!   leases_match = true` (every leased source key carries the same lease ID on the target, same
//!   granted TTL, remaining TTL at most 3 s lower) and `target_leases_gone = [ID, ...]`.
//! - `load_leased` (`keys`, `prefix`, `first`, `count`, `ttl`, `ttl_max`: keys round-robin over
//!   `count` source leases of rising TTLs), `keep_leases` (`side`, `first`, `count`, `for`: a
//!   client keeping them alive, usually `background = true`), `grant` (`side`, `lease`, `ttl`);
//!   `expect leases_match` with `during` samples 20 times over it; `target_leases_alive`;
//!   `leases_within` lets both lease lists take that long to hold (default: read once).
//! - `put outside_prefix = true`: `key` is the whole key, outside the side's prefix (another
//!   application's write to the same cluster).
//! - `[source] least_privilege = true` (or `[target]`): auth on, the agent a user with exactly
//!   the documented rights on that side (`read` on the source prefix, `readwrite` on the target
//!   prefix), the harness root;
//! - `put lease = ID` puts the key under an existing lease;
//! - `stop_agent within = "2s"`: a SIGTERM'd agent has exited within that;
//! - `agent_backend = "container"` (top level) runs every agent as a container of the image
//!   `scripts/image.sh` builds, on the etcd containers' networks; network faults (`cut`, `heal`,
//!   `delay`) act on the fault proxies, which such agents bypass, so they are refused there.

use std::fmt;
use std::sync::Arc;

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};

use super::step::{kind, Step};
use crate::EtcdVersion;

/// A parsed scenario file.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// `name`.
    pub name: String,
    /// `about`.
    pub about: String,
    /// `seed`: the randomness of load and churn.
    pub seed: u64,
    /// (source, target) version of each run.
    pub versions: Vec<(EtcdVersion, EtcdVersion)>,
    /// `[source]`.
    pub source: SideSpec,
    /// `[target]`.
    pub target: SideSpec,
    /// `[agent] toml`: merged into every generated agent config.
    pub agent_toml: String,
    /// `agent_backend`: where the agents run.
    pub agent_backend: AgentKind,
    /// The steps, in order.
    pub steps: Vec<StepAt>,
}

/// One `[[step]]` and where it is written.
#[derive(Clone, Debug)]
pub struct StepAt {
    /// 1-based line of the step's `[[step]]` table.
    pub line: usize,
    /// Runs alongside the following steps.
    pub background: bool,
    /// `g3_checker`: pauses (false) or resumes (true) the continuous checker from here on.
    pub g3_checker: Option<bool>,
    /// What it does.
    pub step: Arc<dyn Step>,
}

/// `[source]` or `[target]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SideSpec {
    /// 1 or 3.
    #[serde(default = "one")]
    pub members: usize,
    /// Extra etcd flags.
    #[serde(default)]
    pub args: Vec<String>,
    /// The side's prefix (the target's defaults to the source's).
    #[serde(default)]
    pub prefix: Option<String>,
    /// Extension: auth on, and the agent (and its one-shot commands) logs in as a user holding
    /// exactly the permissions docs/operations.md lists for the side: `read` on the source
    /// prefix, `readwrite` on the target prefix. The harness's own clients log in as root.
    #[serde(default)]
    pub least_privilege: bool,
}

impl Default for SideSpec {
    fn default() -> Self {
        SideSpec { members: 1, args: Vec::new(), prefix: None, least_privilege: false }
    }
}

fn one() -> usize {
    1
}

/// Where a scenario's agents run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentKind {
    /// Child processes of the harness, reaching etcd through fault proxies.
    #[default]
    Process,
    /// Containers of `etcd-mirror/agent:dev`, reaching etcd on its Docker networks.
    Container,
}

impl AgentKind {
    /// `process` or `container`.
    pub fn parse(text: &str) -> anyhow::Result<AgentKind> {
        match text {
            "process" => Ok(AgentKind::Process),
            "container" => Ok(AgentKind::Container),
            other => bail!("unknown agent backend {other:?} (process or container)"),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    name: String,
    #[serde(default)]
    about: String,
    #[serde(default = "default_seed")]
    seed: u64,
    #[serde(default)]
    versions: Option<Vec<String>>,
    #[serde(default)]
    source: SideSpec,
    #[serde(default)]
    target: SideSpec,
    #[serde(default)]
    agent: RawAgent,
    #[serde(default)]
    agent_backend: AgentKind,
    #[serde(default)]
    step: Vec<toml::Spanned<toml::Table>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAgent {
    #[serde(default)]
    toml: String,
}

fn default_seed() -> u64 {
    1
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].bytes().filter(|&b| b == b'\n').count() + 1
}

fn version(v: &str) -> anyhow::Result<EtcdVersion> {
    v.trim().parse()
}

impl Scenario {
    /// Parses the text of a scenario file; errors name the line.
    pub fn parse(text: &str) -> anyhow::Result<Scenario> {
        let raw: RawFile = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        let versions = match raw.versions {
            None => vec![(EtcdVersion::default(), EtcdVersion::default())],
            Some(list) if list.is_empty() => bail!("versions: give at least one version"),
            Some(list) => list
                .iter()
                .map(|v| match v.split_once("->") {
                    Some((s, t)) => Ok((version(s)?, version(t)?)),
                    None => version(v).map(|x| (x, x)),
                })
                .collect::<anyhow::Result<_>>()
                .context("versions")?,
        };
        for (name, side) in [("source", &raw.source), ("target", &raw.target)] {
            if side.members != 1 && side.members != 3 {
                bail!("{name}.members: {} (1 or 3)", side.members);
            }
        }
        if raw.source.prefix.is_none() {
            bail!("source.prefix is required");
        }
        if !raw.agent.toml.is_empty() {
            raw.agent.toml.parse::<toml::Table>().map_err(|e| anyhow::anyhow!("agent.toml: {e}"))?;
        }
        let mut steps = Vec::with_capacity(raw.step.len());
        for (i, spanned) in raw.step.into_iter().enumerate() {
            let line = line_of(text, spanned.span().start);
            let mut table = spanned.into_inner();
            let at = |e: &dyn fmt::Display| anyhow::anyhow!("line {line}: step {}: {e}", i + 1);
            let flag = |table: &mut toml::Table, key: &str| match table.remove(key) {
                None => Ok(None),
                Some(toml::Value::Boolean(b)) => Ok(Some(b)),
                Some(other) => Err(at(&format!("{key} must be true or false, not {other}"))),
            };
            let background = flag(&mut table, "background")?.unwrap_or(false);
            let g3_checker = flag(&mut table, "g3_checker")?;
            let step: Box<dyn Step> = toml::Value::Table(table).try_into().map_err(|e| at(&e))?;
            if background && !step.detachable() {
                return Err(at(&format!(
                    "{} cannot run in the background (only load, churn, put, del, txn, revoke, compact, sleep; del and revoke without target_revisions)",
                    kind(step.as_ref())
                )));
            }
            step.check().map_err(|e| at(&e))?;
            if raw.agent_backend == AgentKind::Container && step.acts_on_proxies() {
                return Err(at(&format!(
                    "{} acts on the fault proxies, which container agents (agent_backend) bypass",
                    kind(step.as_ref())
                )));
            }
            steps.push(StepAt { line, background, g3_checker, step: Arc::from(step) });
        }
        Ok(Scenario {
            name: raw.name,
            about: raw.about,
            seed: raw.seed,
            versions,
            source: raw.source,
            target: raw.target,
            agent_toml: raw.agent.toml,
            agent_backend: raw.agent_backend,
            steps,
        })
    }

    /// The source prefix.
    pub fn source_prefix(&self) -> &str {
        self.source.prefix.as_deref().unwrap_or("/")
    }

    /// The target prefix (the source's unless given).
    pub fn target_prefix(&self) -> &str {
        self.target.prefix.as_deref().unwrap_or_else(|| self.source_prefix())
    }
}

#[cfg(test)]
#[path = "file_tests.rs"]
mod tests;
