//! The step kinds of a scenario file (SPEC §8 and the extensions listed in `file.rs`).
//!
//! Each kind is a type of its own, in the file of its family: `data` (writes to a side), `lease`
//! (leases as a registry's clients use them),
//! `agent` (start, stop, reload, one-shot commands), `member` (members and whole sides:
//! kill, pause, compact, snapshot, defrag), `network` (the fault proxies), `check` (sleep,
//! wait, expect). A kind's `impl Step` carries its name (`#[typetag::serde(name = "...")]`,
//! the `do` of the file), its field rules and how it runs, so adding a kind touches its family's
//! file only (and the SPEC).

use std::fmt;

use anyhow::bail;
use mirror_core::HumanDuration;

use super::world::World;

mod agent;
mod check;
mod data;
mod delete;
mod lease;
mod member;
mod network;
mod until;
mod wait;

pub use crate::scenario::sides::{Journal, MemberRef, RevisionRef, SideName, Sides, Signal};
pub use agent::{
    Cutover, FailbackPlan, Failover, ReloadAgent, Retire, RunFix, StartAgent, StopAgent, Verify,
};
pub use check::Expect;
pub use data::{CheckPerf, Churn, Load, Put, Revoke, Txn};
pub use delete::Del;
pub use lease::{Grant, KeepLeases, LoadLeased};
pub use member::{
    AlarmDisarm, Compact, Defrag, KillMember, PauseMember, Restore, ResumeMember, Snapshot, StartMember,
    StopMember,
};
pub use network::{Delay, Heal, Partition};
pub use until::{parse_condition, parse_until, ConditionIs, Until};
pub use wait::{Sleep, Wait};

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
fn is_true(b: &bool) -> bool {
    *b
}
fn yes() -> bool {
    true
}
fn is_zero(n: &i32) -> bool {
    *n == 0
}
