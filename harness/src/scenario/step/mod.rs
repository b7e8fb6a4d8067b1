//! The step kinds of a scenario file (SPEC §8 and the extensions listed in `file.rs`).
//!
//! Each kind is a type of its own, in the file of its family: `data` (writes to a side),
//! `agent` (start, stop, reload, one-shot commands), `member` (members and whole sides:
//! kill, pause, compact, snapshot, defrag), `network` (the fault proxies), `check` (sleep,
//! wait, expect). A kind's `impl Step` carries its name (`#[typetag::serde(name = "...")]`,
//! the `do` of the file), its field rules and how it runs, so adding a kind touches its family's
//! file only (and the SPEC).

use std::fmt;

use anyhow::bail;
use etcd_client::Client;
use mirror_core::HumanDuration;
use serde::{Deserialize, Serialize};

use super::world::World;

mod agent;
mod check;
mod data;
mod member;
mod network;

pub use agent::{Cutover, ReloadAgent, StartAgent, StopAgent, Verify};
pub use check::{parse_condition, parse_until, ConditionIs, Expect, Sleep, Until, Wait};
pub use data::{CheckPerf, Churn, Del, Load, Put, Revoke, Txn};
pub use member::{
    AlarmDisarm, Compact, Defrag, KillMember, PauseMember, Restore, ResumeMember, Snapshot, StartMember,
    StopMember,
};
pub use network::{Delay, Heal, Partition};

/// One step kind. Keys in data steps are relative to the side's prefix.
#[async_trait::async_trait]
#[typetag::serde(tag = "do")]
pub trait Step: fmt::Debug + Send + Sync {
    /// Field rules serde cannot express.
    fn check(&self) -> anyhow::Result<()> {
        Ok(())
    }

    /// Whether it acts on the fault proxies between the agents and a side (which container
    /// agents bypass).
    fn acts_on_proxies(&self) -> bool {
        false
    }

    /// Whether it may run in the background: it only talks to the clusters
    /// ([`Step::run_detached`]).
    fn detachable(&self) -> bool {
        false
    }

    /// Runs it in the foreground; returns a note for its progress line. `seed` is the run's
    /// seed plus the step's index.
    async fn run(&self, world: &mut World, seed: u64) -> anyhow::Result<String>;

    /// Runs it in the background, with clients of its own.
    async fn run_detached(&self, sides: Sides, seed: u64) -> anyhow::Result<String> {
        let _ = (sides, seed);
        bail!("this step cannot run in the background")
    }
}

/// The `do` name of a step.
pub fn kind(step: &dyn Step) -> String {
    fields(step).and_then(|t| t.get("do").and_then(|v| v.as_str().map(str::to_owned))).unwrap_or_default()
}

/// The step's fields as a TOML table, `do` included.
fn fields(step: &dyn Step) -> Option<toml::Table> {
    toml::Table::try_from(step).ok()
}

/// A step as one line of TOML fields, for progress lines.
pub struct Line<'a>(pub &'a dyn Step);

impl fmt::Display for Line<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let table = fields(self.0).ok_or(fmt::Error)?;
        let rest: Vec<String> =
            table.iter().filter(|(k, _)| *k != "do").map(|(k, v)| format!("{k}={v}")).collect();
        write!(f, "{} {}", kind(self.0), rest.join(" "))
    }
}

/// Both sides of the link, for a step that only talks to the clusters.
pub struct Sides {
    /// A client of the source.
    pub source: Client,
    /// A client of the target.
    pub target: Client,
    /// `source.prefix`.
    pub source_prefix: String,
    /// `target.prefix`.
    pub target_prefix: String,
    /// The link's checkpoint key in the target.
    pub checkpoint: Vec<u8>,
}

impl Sides {
    /// The client of `side` and its prefix.
    pub fn of(&mut self, side: SideName) -> (&mut Client, &str) {
        match side {
            SideName::Source => (&mut self.source, &self.source_prefix),
            SideName::Target => (&mut self.target, &self.target_prefix),
        }
    }
}

/// Which side of the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SideName {
    /// The source cluster.
    Source,
    /// The target cluster.
    Target,
}

/// A member: its index, or `"leader"`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum MemberRef {
    /// By index, from 0.
    Index(usize),
    /// `"leader"`: whichever member leads when the step runs.
    Named(String),
}

impl MemberRef {
    /// The leader, whichever member it is when the step runs.
    pub fn leader() -> MemberRef {
        MemberRef::Named("leader".into())
    }

    fn check(&self) -> anyhow::Result<()> {
        match self {
            MemberRef::Named(n) if n != "leader" => bail!("member: {n:?} (an index or \"leader\")"),
            _ => Ok(()),
        }
    }
}

/// A signal for `stop_agent`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum Signal {
    /// SIGTERM, then wait for the exit code.
    #[default]
    #[serde(rename = "TERM")]
    Term,
    /// SIGKILL.
    #[serde(rename = "KILL")]
    Kill,
    /// SIGSTOP: frozen, not stopped.
    #[serde(rename = "STOP")]
    Stop,
    /// SIGCONT.
    #[serde(rename = "CONT")]
    Cont,
}

/// `compact`'s revision: `"current"` or a number.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum RevisionRef {
    /// A revision number.
    At(i64),
    /// `"current"`.
    Named(String),
}

fn agent_a() -> String {
    "a".into()
}
fn value_100() -> usize {
    100
}
fn sixty() -> HumanDuration {
    HumanDuration::secs(60)
}
fn is_a(id: &String) -> bool {
    id == "a"
}
fn source_side() -> SideName {
    SideName::Source
}
fn is_source(side: &SideName) -> bool {
    *side == SideName::Source
}
fn is_false(b: &bool) -> bool {
    !*b
}
fn is_zero(n: &i32) -> bool {
    *n == 0
}
