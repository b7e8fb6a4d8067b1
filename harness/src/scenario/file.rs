//! The scenario file format of SPEC §8, parsed strictly: an unknown key or step kind is an
//! error that names its line, so a typo never turns a check into a no-op.
//!
//! Additions beyond SPEC §8, all optional, so files written to SPEC §8 run unchanged:
//! - `wait until = "background"` waits for every background step to finish; `until =
//!   "caught_up"` until the agent's watermark reaches the source's head revision (equal
//!   contents can come a revision earlier, when that revision rewrote a value unchanged);
//! - any step may say `g3_checker = false` (or `true`) to pause (or resume) the continuous G3
//!   checker from that step on;
//! - `expect sole_writer_after = "ID"` reads the checkpoint key's history: once agent ID first
//!   wrote it, nobody else did;
//! - `load`, `put` and `del` take `side = "target"` (keys relative to `target.prefix`), and
//!   `put`/`del` take `checkpoint = true` for the link's checkpoint key (a corrupt-checkpoint
//!   scenario writes it);
//! - `load` takes `lease = ID` (and `lease_every = N`: every Nth key) to put keys under a source
//!   lease, and `revoke lease = ID` revokes it (etcd deletes its keys in one revision);
//!   `del` and `revoke` take `target_revisions = N`: the agent applies that source revision as
//!   exactly N target revisions (1: atomically);
//! - `check_perf` runs `etcdctl check perf` (`load`, `prefix`) against the source;
//! - `expect` also takes `target_has` / `target_lacks` (keys that must or must not be in the
//!   target), `min_scan_restarts` / `max_scan_restarts`, `max_peak_rss_mib` (the agent's own
//!   `peak_rss_bytes`), `max_lag_revisions` with `during`, and `last_error` (a reason);
//! - `snapshot` / `restore` (`side`, `name`) save a side and later put it back, as an operator
//!   restoring a cluster from a snapshot would.
//! - `agent_backend = "container"` (top level) runs every agent as a container of the image
//!   `scripts/image.sh` builds, on the etcd containers' networks; network faults (`cut`, `heal`,
//!   `delay`) act on the fault proxies, which such agents bypass, so they are refused there.

use std::fmt;

use anyhow::{bail, Context as _};
use mirror_core::{ConditionType, HumanDuration};
use serde::{Deserialize, Serialize};

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
    pub step: Step,
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
}

impl Default for SideSpec {
    fn default() -> Self {
        SideSpec { members: 1, args: Vec::new(), prefix: None }
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
fn load_s() -> String {
    "s".into()
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

/// Every step kind of SPEC §8. Keys in `load`, `put`, `del`, `txn` and `churn` are relative to
/// `source.prefix`.
// A scenario holds tens of steps, read once: `expect`'s size costs nothing worth boxing for.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(tag = "do", rename_all = "snake_case", deny_unknown_fields)]
pub enum Step {
    /// `keys` keys of `value_size` bytes under `prefix`, 128 per Txn.
    Load {
        /// Which side (default source).
        #[serde(default = "source_side", skip_serializing_if = "is_source")]
        side: SideName,
        /// How many.
        keys: usize,
        /// Bytes per value.
        #[serde(default = "value_100")]
        value_size: usize,
        /// Under this sub-prefix.
        #[serde(default)]
        prefix: String,
        /// Extension: keys go under the source lease with this ID (granted with a 600 s TTL
        /// unless it exists), every `lease_every`-th key from the first (default every key).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease: Option<i64>,
        /// Extension: see `lease`; 2 interleaves leased keys with keys that survive a revoke.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease_every: Option<usize>,
    },
    /// Extension: revokes a source lease (`lease`, from a `load`): etcd deletes its keys in one
    /// revision.
    Revoke {
        /// The lease ID.
        lease: i64,
        /// Extension, as on `del`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        target_revisions: Option<i64>,
    },
    /// Open-loop churn: puts, overwrites, deletes, multi-op Txns, range deletes, leased puts.
    Churn {
        /// Operations in all.
        ops: usize,
        /// Offered per second.
        rate: u32,
        /// Distinct keys.
        keyspace: usize,
        /// Bytes per value.
        #[serde(default = "value_100")]
        value_size: usize,
        /// Under this sub-prefix.
        #[serde(default)]
        prefix: String,
    },
    /// One put.
    Put {
        /// Which side (default source).
        #[serde(default = "source_side", skip_serializing_if = "is_source")]
        side: SideName,
        /// The key.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<String>,
        /// The checkpoint key instead of `key`.
        #[serde(default, skip_serializing_if = "is_false")]
        checkpoint: bool,
        /// The value (default: `value_size` bytes of `v`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        value: Option<String>,
        /// Bytes of the default value.
        #[serde(default = "value_100")]
        value_size: usize,
    },
    /// Delete one key or a prefix.
    Del {
        /// Which side (default source).
        #[serde(default = "source_side", skip_serializing_if = "is_source")]
        side: SideName,
        /// The checkpoint key.
        #[serde(default, skip_serializing_if = "is_false")]
        checkpoint: bool,
        /// One key.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<String>,
        /// Every key under this prefix (one revision).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prefix: Option<String>,
        /// Extension: the agent (`a`) applies this source revision as exactly this many target
        /// revisions (1: atomically); the step waits for it to catch up before and after.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        target_revisions: Option<i64>,
    },
    /// Extension: `etcdctl check perf` against the source, with the source version's etcdctl:
    /// etcd's own load check, as a user would run it (`load = "l"`: 500 clients writing for
    /// 60 s, then one revision deleting everything it wrote). Its pass/fail verdict is about
    /// the source on this machine, not the agent: the step reports it and never fails on it.
    CheckPerf {
        /// Workload model: s, m, l or xl (default s).
        #[serde(default = "load_s")]
        load: String,
        /// Its keys' sub-prefix under `source.prefix`.
        prefix: String,
    },
    /// `ops` puts in one source Txn.
    Txn {
        /// Puts in the Txn.
        ops: usize,
        /// Bytes per value.
        #[serde(default = "value_100")]
        value_size: usize,
        /// Under this sub-prefix.
        #[serde(default)]
        prefix: String,
    },
    /// Starts (or restarts) agent `id`.
    StartAgent {
        /// Agent id.
        #[serde(default = "agent_a", skip_serializing_if = "is_a")]
        id: String,
        /// Its epoch (default 1, or what it had).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        epoch: Option<u64>,
        /// TOML merged over `[agent] toml` for this agent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        toml: Option<String>,
    },
    /// Signals agent `id`.
    StopAgent {
        /// Agent id.
        #[serde(default = "agent_a", skip_serializing_if = "is_a")]
        id: String,
        /// TERM (default), KILL, STOP or CONT.
        #[serde(default)]
        signal: Signal,
    },
    /// Merges `toml` into agent `id`'s config and sends SIGHUP.
    ReloadAgent {
        /// Agent id.
        #[serde(default = "agent_a", skip_serializing_if = "is_a")]
        id: String,
        /// TOML merged over its config.
        #[serde(default)]
        toml: String,
        /// A new epoch.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        epoch: Option<u64>,
    },
    /// `mirror-agent cutover` with agent `id`'s config.
    Cutover {
        /// Agent id whose config is used.
        #[serde(default = "agent_a", skip_serializing_if = "is_a")]
        id: String,
        /// Extra arguments, e.g. `["--wait"]`.
        #[serde(default)]
        args: Vec<String>,
        /// Expected exit code.
        #[serde(default, skip_serializing_if = "is_zero")]
        expect: i32,
    },
    /// `mirror-agent verify` with agent `id`'s config.
    Verify {
        /// Agent id whose config is used.
        #[serde(default = "agent_a", skip_serializing_if = "is_a")]
        id: String,
        /// Expected exit code.
        #[serde(default, skip_serializing_if = "is_zero")]
        expect: i32,
    },
    /// SIGKILL a member.
    KillMember {
        /// Which side.
        side: SideName,
        /// Which member.
        member: MemberRef,
    },
    /// Stops a member cleanly.
    StopMember {
        /// Which side.
        side: SideName,
        /// Which member.
        member: MemberRef,
    },
    /// Starts a member, or every stopped member of the side.
    StartMember {
        /// Which side.
        side: SideName,
        /// Which member (default: every stopped one).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        member: Option<MemberRef>,
    },
    /// Freezes a member (docker pause or SIGSTOP).
    PauseMember {
        /// Which side.
        side: SideName,
        /// Which member.
        member: MemberRef,
    },
    /// Unfreezes a member.
    ResumeMember {
        /// Which side.
        side: SideName,
        /// Which member.
        member: MemberRef,
    },
    /// Blackholes the network between the agents and a side.
    Partition {
        /// Which side.
        side: SideName,
    },
    /// Ends a partition and a delay.
    Heal {
        /// Which side.
        side: SideName,
    },
    /// Delays every chunk between the agents and a side by `ms`.
    Delay {
        /// Which side.
        side: SideName,
        /// Milliseconds.
        ms: u64,
    },
    /// Compacts a side.
    Compact {
        /// Which side.
        side: SideName,
        /// `"current"` (default) or a revision.
        #[serde(default = "current")]
        revision: RevisionRef,
    },
    /// Saves a snapshot of a side (etcd's Maintenance Snapshot) under `name`.
    Snapshot {
        /// Which side.
        side: SideName,
        /// Its name, for `restore`.
        name: String,
    },
    /// Restores every member of a side from snapshot `name` (`etcdutl snapshot restore` with
    /// the same names, token and peer URLs: the same cluster id, back at the snapshot's
    /// revision) and starts them again.
    Restore {
        /// Which side.
        side: SideName,
        /// A snapshot saved by `snapshot`.
        name: String,
    },
    /// Defragments every running member of a side.
    Defrag {
        /// Which side.
        side: SideName,
    },
    /// Disarms a side's NOSPACE alarm.
    AlarmDisarm {
        /// Which side.
        side: SideName,
    },
    /// Sleeps.
    Sleep {
        /// How long.
        #[serde(rename = "for")]
        for_: HumanDuration,
    },
    /// Waits until `"phase:P"`, `"condition:TYPE=True|False"`, `"last_error:REASON"`,
    /// `"equal"`, `"caught_up"` or `"background"`.
    Wait {
        /// The state.
        until: String,
        /// Fails after this.
        #[serde(default = "sixty")]
        timeout: HumanDuration,
        /// Agent id.
        #[serde(default = "agent_a", skip_serializing_if = "is_a")]
        agent: String,
    },
    /// Checks every given fact; `equal`, `phase` and `condition` are retried until `timeout`.
    Expect {
        /// Target == source (latest on both, through the key rewrite).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        equal: Option<bool>,
        /// The agent's phase.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        phase: Option<String>,
        /// `"TYPE=True"` or `"TYPE=False"`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        condition: Option<String>,
        /// The agent's forced resync count.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        forced_resyncs: Option<u64>,
        /// `"held"`: every continuous G3 check so far held, and at least one ran.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        g3: Option<String>,
        /// Extension: the agent's `last_error.reason` (e.g. `"SourceWentBack"`); retried until
        /// `timeout` like `phase`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        last_error: Option<String>,
        /// The exit code of the agent's last `stop_agent` (or of its own exit).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent_exit: Option<i32>,
        /// Extension: from the checkpoint key's history, once this agent first wrote it, no
        /// other agent wrote it again (a fenced-out writer landed nothing after the takeover).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sole_writer_after: Option<String>,
        /// Extension: the agent restarted its genesis (`scan_restarts`) at least this often.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        min_scan_restarts: Option<u64>,
        /// Extension: the agent restarted its genesis (`scan_restarts`) at most this often.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_scan_restarts: Option<u64>,
        /// Extension: the agent's own `peak_rss_bytes` (VmHWM, also
        /// `etcd_mirror_resident_memory_peak_bytes`) is at most this many MiB.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_peak_rss_mib: Option<u64>,
        /// Extension: these keys (relative to `target.prefix`) exist in the target, e.g. keys
        /// that were there before the link and that no prune of it may delete.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        target_has: Vec<String>,
        /// Extension: these keys (relative to `target.prefix`) do not exist in the target.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        target_lacks: Vec<String>,
        /// Extension: the agent's `lag_revisions` is at most this and `ReplicationLagExceeded` is
        /// not True; with `during`, at every status read (every 500 ms) for that long.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_lag_revisions: Option<i64>,
        /// Extension: the agent re-opened its source watch at most this many times
        /// (`watch_restarts` in status).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_watch_restarts: Option<u64>,
        /// Extension: how long `max_lag_revisions` must hold (default: one read).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        during: Option<HumanDuration>,
        /// Agent id.
        #[serde(default = "agent_a", skip_serializing_if = "is_a")]
        agent: String,
        /// How long `equal`, `phase` and `condition` may take to hold.
        #[serde(default = "sixty")]
        timeout: HumanDuration,
    },
}

fn current() -> RevisionRef {
    RevisionRef::Named("current".into())
}

impl Step {
    /// The `do` name.
    pub fn kind(&self) -> &'static str {
        match self {
            Step::Load { .. } => "load",
            Step::Churn { .. } => "churn",
            Step::Put { .. } => "put",
            Step::Del { .. } => "del",
            Step::Txn { .. } => "txn",
            Step::Revoke { .. } => "revoke",
            Step::CheckPerf { .. } => "check_perf",
            Step::StartAgent { .. } => "start_agent",
            Step::StopAgent { .. } => "stop_agent",
            Step::ReloadAgent { .. } => "reload_agent",
            Step::Cutover { .. } => "cutover",
            Step::Verify { .. } => "verify",
            Step::KillMember { .. } => "kill_member",
            Step::StopMember { .. } => "stop_member",
            Step::StartMember { .. } => "start_member",
            Step::PauseMember { .. } => "pause_member",
            Step::ResumeMember { .. } => "resume_member",
            Step::Partition { .. } => "partition",
            Step::Heal { .. } => "heal",
            Step::Delay { .. } => "delay",
            Step::Compact { .. } => "compact",
            Step::Snapshot { .. } => "snapshot",
            Step::Restore { .. } => "restore",
            Step::Defrag { .. } => "defrag",
            Step::AlarmDisarm { .. } => "alarm_disarm",
            Step::Sleep { .. } => "sleep",
            Step::Wait { .. } => "wait",
            Step::Expect { .. } => "expect",
        }
    }

    /// Whether it acts on the fault proxies between the agents and a side.
    fn is_network_fault(&self) -> bool {
        matches!(self, Step::Partition { .. } | Step::Heal { .. } | Step::Delay { .. })
    }

    /// Whether it may run in the background: it only talks to the clusters.
    fn may_run_in_background(&self) -> bool {
        matches!(
            self,
            Step::Load { .. }
                | Step::Churn { .. }
                | Step::Put { .. }
                | Step::Del { target_revisions: None, .. }
                | Step::Txn { .. }
                | Step::Revoke { target_revisions: None, .. }
                | Step::Compact { .. }
                | Step::Sleep { .. }
        )
    }
}

impl fmt::Display for Step {
    /// The step as one line of TOML fields, for progress lines.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let table = toml::Table::try_from(self).map_err(|_| fmt::Error)?;
        let fields: Vec<String> =
            table.iter().filter(|(k, _)| *k != "do").map(|(k, v)| format!("{k}={v}")).collect();
        write!(f, "{} {}", self.kind(), fields.join(" "))
    }
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
            let step: Step = toml::Value::Table(table).try_into().map_err(|e| at(&e))?;
            if background && !step.may_run_in_background() {
                return Err(at(&format!(
                    "{} cannot run in the background (only load, churn, put, del, txn, revoke, compact, sleep; del and revoke without target_revisions)",
                    step.kind()
                )));
            }
            check_step(&step).map_err(|e| at(&e))?;
            if raw.agent_backend == AgentKind::Container && step.is_network_fault() {
                return Err(at(&format!(
                    "{} acts on the fault proxies, which container agents (agent_backend) bypass",
                    step.kind()
                )));
            }
            steps.push(StepAt { line, background, g3_checker, step });
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

/// Field rules serde cannot express.
fn check_step(step: &Step) -> anyhow::Result<()> {
    let member = |m: &MemberRef| match m {
        MemberRef::Named(n) if n != "leader" => bail!("member: {n:?} (an index or \"leader\")"),
        _ => Ok(()),
    };
    match step {
        Step::Del { key, prefix, checkpoint, .. }
            if usize::from(key.is_some()) + usize::from(prefix.is_some()) + usize::from(*checkpoint) != 1 =>
        {
            bail!("del: give exactly one of key, prefix and checkpoint = true")
        }
        Step::Del { side: SideName::Target, target_revisions: Some(_), .. } => {
            bail!("del: target_revisions is for a source write")
        }
        Step::CheckPerf { load, .. } if !["s", "m", "l", "xl"].contains(&load.as_str()) => {
            bail!("load: {load:?} (s, m, l or xl)")
        }
        Step::Load { lease: None, lease_every: Some(_), .. } => bail!("load: lease_every needs a lease"),
        Step::Load { lease_every: Some(0), .. } => bail!("load: lease_every must be > 0"),
        Step::Put { key, checkpoint, .. } if key.is_some() == *checkpoint => {
            bail!("put: give exactly one of key and checkpoint = true")
        }
        Step::KillMember { member: m, .. }
        | Step::StopMember { member: m, .. }
        | Step::PauseMember { member: m, .. }
        | Step::ResumeMember { member: m, .. }
        | Step::StartMember { member: Some(m), .. } => member(m),
        Step::Compact { revision: RevisionRef::Named(n), .. } if n != "current" => {
            bail!("revision: {n:?} (a number or \"current\")")
        }
        Step::Wait { until, .. } => parse_until(until).map(drop),
        Step::Expect { condition: Some(c), .. } => parse_condition(c).map(drop),
        Step::Expect { g3: Some(g), .. } if g != "held" => bail!("g3: {g:?} (only \"held\")"),
        Step::Churn { rate: 0, .. } => bail!("churn: rate must be > 0"),
        Step::StartAgent { toml: Some(t), .. } | Step::ReloadAgent { toml: t, .. } => {
            t.parse::<toml::Table>().map_err(|e| anyhow::anyhow!("toml: {e}")).map(drop)
        }
        _ => Ok(()),
    }
}

/// What a `wait` waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Until {
    /// The agent's phase.
    Phase(String),
    /// A condition's status, and its reason when given (`TYPE=True/REASON`).
    Condition(ConditionType, bool, Option<String>),
    /// Target == source.
    Equal,
    /// Every background step has finished.
    Background,
    /// The agent's `last_error.reason` (`"last_error:REASON"`).
    LastError(String),
    /// The agent's watermark has reached the source's head revision: it has applied (or
    /// proved idle) everything written so far and has nothing left to commit.
    CaughtUp,
}

/// Parses `until`.
pub fn parse_until(until: &str) -> anyhow::Result<Until> {
    if let Some(p) = until.strip_prefix("phase:") {
        return Ok(Until::Phase(p.to_owned()));
    }
    if let Some(c) = until.strip_prefix("condition:") {
        let (t, v, reason) = parse_condition(c)?;
        return Ok(Until::Condition(t, v, reason));
    }
    if let Some(r) = until.strip_prefix("last_error:") {
        return Ok(Until::LastError(r.to_owned()));
    }
    match until {
        "equal" => Ok(Until::Equal),
        "background" => Ok(Until::Background),
        "caught_up" => Ok(Until::CaughtUp),
        other => bail!(
            "until: {other:?} (\"phase:P\", \"condition:TYPE=True|False\", \"last_error:REASON\", \"equal\", \"caught_up\" or \"background\")"
        ),
    }
}

/// Parses `"TYPE=True|False"`.
pub fn parse_condition(c: &str) -> anyhow::Result<(ConditionType, bool, Option<String>)> {
    let (c, reason) = match c.split_once('/') {
        Some((c, reason)) => (c, Some(reason.to_owned())),
        None => (c, None),
    };
    let (t, on) = match c.split_once('=') {
        Some((t, "True")) => (t, true),
        Some((t, "False")) => (t, false),
        _ => bail!("condition: {c:?} (TYPE=True or TYPE=False, optionally /REASON)"),
    };
    Ok((t.parse()?, on, reason))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const SPEC_EXAMPLE: &str = r#"
name = "compaction-mid-scan"
about = "the source is compacted while the initial scan pages"
seed = 7                      # randomness of load/churn; --seed overrides
versions = ["3.5.30", "3.4.23"] # run once per source/target version (default ["3.5.30"])

[source]                      # each side: a cluster
members = 1                   # 1 or 3
args = []                     # extra etcd flags, e.g. ["--quota-backend-bytes=16777216"]
prefix = "/app/"
[target]
members = 3
prefix = "/copy/"

[agent]                       # extra TOML merged into the generated agent config
toml = '''
[sync]
max_txn_ops = 64
'''

[[step]]                      # steps run in order; `background = true` runs one alongside
do = "load"                   # keys, value_size, prefix (relative to source.prefix)
keys = 20000
value_size = 256
[[step]]
do = "start_agent"            # id (default "a"); epoch; toml (overrides for this agent)
[[step]]
do = "wait"                   # until: "phase:P" | "condition:TYPE=True|False" | "equal"
until = "phase:initial_sync"  # timeout (default "60s"); agent (default "a")
[[step]]
do = "compact"                # side ("source"|"target"), revision ("current" default)
side = "source"
[[step]]
do = "expect"                 # any of: equal = true; phase = "P"; condition = "TYPE=True";
equal = true                  # forced_resyncs = N; g3 = "held"; agent_exit = CODE
forced_resyncs = 0
"#;

    /// SPEC §8's own example parses as written.
    #[test]
    fn the_spec_example_parses() {
        let s = Scenario::parse(SPEC_EXAMPLE).unwrap();
        assert_eq!(s.name, "compaction-mid-scan");
        assert_eq!(s.seed, 7);
        assert_eq!(s.versions.len(), 2);
        assert_eq!((s.source.members, s.target.members), (1, 3));
        assert_eq!((s.source_prefix(), s.target_prefix()), ("/app/", "/copy/"));
        assert!(s.agent_toml.contains("max_txn_ops = 64"));
        let kinds: Vec<&str> = s.steps.iter().map(|s| s.step.kind()).collect();
        assert_eq!(kinds, ["load", "start_agent", "wait", "compact", "expect"]);
        assert_eq!(s.steps[0].line, 21, "the line of its [[step]] header");
        assert_eq!(
            s.steps[0].step,
            Step::Load {
                side: SideName::Source,
                keys: 20_000,
                value_size: 256,
                prefix: String::new(),
                lease: None,
                lease_every: None
            }
        );
        assert_eq!(
            s.steps[3].step,
            Step::Compact { side: SideName::Source, revision: RevisionRef::Named("current".into()) }
        );
    }

    fn error_of(text: &str) -> String {
        format!("{:#}", Scenario::parse(text).unwrap_err())
    }

    const HEAD: &str = "name = \"x\"\n[source]\nprefix = \"/a/\"\n";

    /// Unknown keys and kinds, at the top and in steps, are errors that name the line.
    #[test]
    fn unknown_keys_and_kinds_name_the_line() {
        let e = error_of(&format!("{HEAD}[[step]]\ndo = \"wait\"\nuntill = \"equal\"\n"));
        assert!(e.contains("line 4") && e.contains("untill"), "{e}");
        let e = error_of(&format!("{HEAD}[[step]]\ndo = \"load\"\nkeys = 1\n[[step]]\ndo = \"explode\"\n"));
        assert!(e.contains("line 7") && e.contains("explode"), "{e}");
        let e = error_of(&format!("{HEAD}colour = \"red\"\n"));
        assert!(e.contains("colour") && e.contains("line"), "{e}");
        let e = error_of(&format!(
            "{HEAD}[[step]]\ndo = \"kill_member\"\nside = \"source\"\nmember = \"boss\"\n"
        ));
        assert!(e.contains("line 4") && e.contains("leader"), "{e}");
        let e = error_of(&format!("{HEAD}[[step]]\ndo = \"wait\"\nuntil = \"phase\"\n"));
        assert!(e.contains("line 4") && e.contains("until"), "{e}");
        let e = error_of(&format!("{HEAD}[[step]]\ndo = \"start_agent\"\nbackground = true\n"));
        assert!(e.contains("background"), "{e}");
        let e = error_of("name = \"x\"\n[source]\nprefix = \"/a/\"\nmembers = 2\n");
        assert!(e.contains("source.members"), "{e}");
    }

    /// Every step kind round-trips through its TOML form (chaos writes schedules this way).
    #[test]
    fn steps_round_trip() {
        let steps = vec![
            Step::Churn { ops: 10, rate: 5, keyspace: 3, value_size: 100, prefix: "c/".into() },
            Step::Del {
                side: SideName::Source,
                checkpoint: false,
                key: None,
                prefix: Some("big/".into()),
                target_revisions: Some(1),
            },
            Step::Load {
                side: SideName::Source,
                keys: 10,
                value_size: 1,
                prefix: String::new(),
                lease: Some(7),
                lease_every: Some(2),
            },
            Step::Revoke { lease: 7, target_revisions: None },
            Step::Put {
                side: SideName::Target,
                key: None,
                checkpoint: true,
                value: Some("{".into()),
                value_size: 1,
            },
            Step::StopAgent { id: "b".into(), signal: Signal::Stop },
            Step::KillMember { side: SideName::Target, member: MemberRef::Named("leader".into()) },
            Step::Sleep { for_: HumanDuration(Duration::from_millis(1500)) },
            Step::Snapshot { side: SideName::Source, name: "before".into() },
            Step::Restore { side: SideName::Target, name: "before".into() },
            Step::Delay { side: SideName::Source, ms: 200 },
            Step::Expect {
                equal: Some(true),
                phase: None,
                condition: Some("Available=True".into()),
                forced_resyncs: None,
                g3: Some("held".into()),
                last_error: Some("SourceWentBack".into()),
                agent_exit: None,
                sole_writer_after: Some("b".into()),
                target_has: vec!["before-the-link".into()],
                target_lacks: vec!["deleted".into()],
                min_scan_restarts: Some(1),
                max_scan_restarts: Some(3),
                max_peak_rss_mib: Some(96),
                max_lag_revisions: Some(100),
                max_watch_restarts: Some(0),
                during: Some(HumanDuration(Duration::from_secs(2))),
                agent: "a".into(),
                timeout: sixty(),
            },
        ];
        let mut text = HEAD.to_owned();
        for s in &steps {
            text.push_str(&format!("[[step]]\n{}\n", toml::to_string(s).unwrap()));
        }
        let parsed = Scenario::parse(&text).unwrap();
        let back: Vec<Step> = parsed.steps.into_iter().map(|s| s.step).collect();
        assert_eq!(back, steps);
    }

    /// A condition may name its reason after a slash; bad statuses are errors.
    #[test]
    fn condition_with_reason() {
        assert_eq!(
            parse_until("condition:Fenced=True/TargetPromoted").unwrap(),
            Until::Condition(ConditionType::Fenced, true, Some("TargetPromoted".into()))
        );
        assert_eq!(parse_condition("Available=False").unwrap(), (ConditionType::Available, false, None));
        assert!(parse_condition("Fenced=Maybe/TargetPromoted").is_err());
        let typo = parse_condition("Availabel=True").unwrap_err().to_string();
        assert!(typo.contains("Availabel"), "{typo}");
    }

    /// Versions name all four releases, 3.5.30 by default, and source->target pairs.
    #[test]
    fn versions_default_and_pairs() {
        let none = Scenario::parse("name = \"x\"\nabout = \"y\"\n[source]\nprefix = \"/a/\"\n").unwrap();
        assert_eq!(none.versions, vec![(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30)]);
        let text = "name = \"x\"\nabout = \"y\"\nversions = [\"3.5.16\", \"3.4.23->3.5.30\"]\n[source]\nprefix = \"/a/\"\n";
        let pairs = Scenario::parse(text).unwrap().versions;
        assert_eq!(
            pairs,
            vec![(EtcdVersion::V3_5_16, EtcdVersion::V3_5_16), (EtcdVersion::V3_4_23, EtcdVersion::V3_5_30)]
        );
        let bad = Scenario::parse(
            "name = \"x\"\nabout = \"y\"\nversions = [\"3.6.0\"]\n[source]\nprefix = \"/a/\"\n",
        );
        assert!(format!("{:#}", bad.unwrap_err()).contains("3.5.30, 3.5.16, 3.5.1, 3.4.23"));
    }

    /// Every shipped scenario file parses (conditions, reasons and step kinds typed at read), so
    /// a typo fails here in a second rather than after the slow tests before it.
    #[test]
    fn every_scenario_file_parses() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let text = std::fs::read_to_string(&path).unwrap();
                Scenario::parse(&text).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
                n += 1;
            }
        }
        assert!(n > 40, "only {n} scenario files found in {}", dir.display());
    }
}
