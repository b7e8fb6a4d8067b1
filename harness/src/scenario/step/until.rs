//! The states `wait` waits for and `expect` retries: parsed when the file is read, evaluated
//! against the [`World`] while the scenario runs.

use std::fmt;
use std::time::Duration;

use anyhow::bail;
use mirror_core::{ConditionType, Phase, Reason};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::scenario::world::World;

/// What a `wait` waits for.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub enum Until {
    /// The agent's phase.
    Phase(Phase),
    /// A condition's status, and its reason when given (`TYPE=True/REASON`).
    Condition(ConditionIs),
    /// Target == source.
    Equal,
    /// Exact mode (SPEC §10): the target's revision is the source's and every key outside the
    /// reserved namespace agrees in value, create and mod revision, version and lease.
    Exact,
    /// Every background step has finished.
    Background,
    /// The agent's `last_error.reason` (`"last_error:REASON"`).
    LastError(String),
    /// The agent's watermark has reached the source's head revision: it has applied (or proved
    /// idle) everything written so far and has nothing left to commit.
    CaughtUp,
    /// The agent's log holds a line containing this text (`"log:TEXT"`): for what the agent
    /// only says, such as a watch it cancelled.
    Log(String),
}

impl TryFrom<String> for Until {
    type Error = anyhow::Error;

    fn try_from(until: String) -> anyhow::Result<Until> {
        parse_until(&until)
    }
}

impl From<Until> for String {
    fn from(until: Until) -> String {
        until.to_string()
    }
}

impl fmt::Display for Until {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Until::Phase(p) => write!(f, "phase:{}", p.as_str()),
            Until::Condition(c) => write!(f, "condition:{c}"),
            Until::Equal => f.write_str("equal"),
            Until::Exact => f.write_str("exact"),
            Until::Background => f.write_str("background"),
            Until::LastError(r) => write!(f, "last_error:{r}"),
            Until::CaughtUp => f.write_str("caught_up"),
            Until::Log(t) => write!(f, "log:{t}"),
        }
    }
}

/// Parses `until`.
pub fn parse_until(until: &str) -> anyhow::Result<Until> {
    if let Some(p) = until.strip_prefix("phase:") {
        let phase = Phase::ALL.into_iter().find(|x| x.as_str() == p);
        return phase.map(Until::Phase).ok_or_else(|| anyhow::anyhow!("phase: {p:?} is no phase"));
    }
    if let Some(c) = until.strip_prefix("condition:") {
        return parse_condition(c).map(Until::Condition);
    }
    if let Some(r) = until.strip_prefix("last_error:") {
        if !matches!(r, "none" | "any") {
            known_reason(r)?;
        }
        return Ok(Until::LastError(r.to_owned()));
    }
    if let Some(t) = until.strip_prefix("log:") {
        anyhow::ensure!(!t.is_empty(), "until: \"log:\" needs the text to find");
        return Ok(Until::Log(t.to_owned()));
    }
    match until {
        "equal" => Ok(Until::Equal),
        "exact" => Ok(Until::Exact),
        "background" => Ok(Until::Background),
        "caught_up" => Ok(Until::CaughtUp),
        other => bail!(
            "until: {other:?} (\"phase:P\", \"condition:TYPE=True|False\", \"last_error:REASON\", \"log:TEXT\", \"equal\", \"exact\", \"caught_up\" or \"background\")"
        ),
    }
}

/// A condition's expected status, and its reason when given: `TYPE=True|False[/REASON]`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub struct ConditionIs {
    /// The condition.
    pub type_: ConditionType,
    /// Its status.
    pub on: bool,
    /// Its reason, when it matters.
    pub reason: Option<Reason>,
}

impl TryFrom<String> for ConditionIs {
    type Error = anyhow::Error;

    fn try_from(c: String) -> anyhow::Result<ConditionIs> {
        parse_condition(&c)
    }
}

impl From<ConditionIs> for String {
    fn from(c: ConditionIs) -> String {
        c.to_string()
    }
}

impl fmt::Display for ConditionIs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.type_, if self.on { "True" } else { "False" })?;
        match &self.reason {
            Some(r) => write!(f, "/{r}"),
            None => Ok(()),
        }
    }
}

/// A reason the agent can give, by name: a misspelt one in a scenario file is an error at read,
/// not a wait that never ends.
pub fn known_reason(name: &str) -> anyhow::Result<Reason> {
    match name.parse::<Reason>() {
        Ok(Reason::Unknown) | Err(_) => bail!("{name:?} is no reason the agent gives (mirror_core::Reason)"),
        Ok(reason) => Ok(reason),
    }
}

/// Parses `"TYPE=True|False"`, optionally `/REASON`.
pub fn parse_condition(c: &str) -> anyhow::Result<ConditionIs> {
    let (c, reason) = match c.split_once('/') {
        Some((c, reason)) => (c, Some(known_reason(reason)?)),
        None => (c, None),
    };
    let (t, on) = match c.split_once('=') {
        Some((t, "True")) => (t, true),
        Some((t, "False")) => (t, false),
        _ => bail!("condition: {c:?} (TYPE=True or TYPE=False, optionally /REASON)"),
    };
    Ok(ConditionIs { type_: t.parse()?, on, reason })
}

impl World<'_> {
    /// Whether `until` holds now: `Ok(None)` when it does, `Ok(Some(why not))` otherwise.
    pub(in crate::scenario) async fn holds(
        &mut self,
        until: &Until,
        id: &str,
    ) -> anyhow::Result<Option<String>> {
        match until {
            Until::Phase(p) => {
                let s = self.status(id).await?;
                Ok((s.phase != *p).then(|| format!("phase is {}", s.phase.as_str())))
            }
            Until::Condition(want) => {
                let s = self.status(id).await?;
                let c = s.conditions.iter().find(|c| c.type_ == want.type_);
                let reason_ok = want.reason.as_ref().is_none_or(|r| c.is_some_and(|c| c.reason == *r));
                Ok((c.map(|c| c.status) != Some(want.on) || !reason_ok).then(|| match c {
                    Some(c) => format!("{}={} ({}: {})", c.type_, c.status_name(), c.reason, c.message),
                    None => format!("{} not reported", want.type_),
                }))
            }
            Until::LastError(want) => {
                let s = self.status(id).await?;
                // `none`: no last error; `any`: some last error; else its reason.
                let got = s.last_error.as_ref().map_or("none", |e| e.reason.as_str());
                let holds = match want.as_str() {
                    "any" => s.last_error.is_some(),
                    want => got == want,
                };
                Ok((!holds).then(|| match &s.last_error {
                    Some(e) => format!("last_error is {} ({})", e.reason, e.message),
                    None => "no last_error".to_owned(),
                }))
            }
            Until::Equal => self.difference().await,
            Until::Exact => {
                let mut dst = self.target.client().await?;
                let source = crate::exact::keyspace(&mut self.src).await?;
                let target = crate::exact::keyspace(&mut dst).await?;
                Ok(crate::exact::keyspace_difference(&source, &target))
            }
            Until::Background => {
                self.join_background().await?;
                Ok(None)
            }
            Until::CaughtUp => {
                let head = crate::scenario::current_revision(&mut self.src).await?;
                let s = self.status(id).await?;
                Ok((s.watermark < head)
                    .then(|| format!("watermark {} below source head {head}", s.watermark)))
            }
            Until::Log(text) => {
                let log = self.agent(id)?.process.log();
                Ok((!log.lines().any(|l| l.contains(text.as_str()))).then(|| {
                    format!("no line of the agent's log ({} lines) holds {text:?}", log.lines().count())
                }))
            }
        }
    }

    /// Polls `until` every 200 ms; `Err(why it does not hold)` once `deadline` passed, or
    /// sooner when it cannot hold any more (a wait for another phase of an agent that stays in
    /// phase `failed`).
    pub(in crate::scenario) async fn poll_until(
        &mut self,
        until: &Until,
        id: &str,
        deadline: Instant,
    ) -> Result<(), String> {
        let mut failed_since = None;
        loop {
            let why = match self.holds(until, id).await {
                Ok(None) => return Ok(()),
                Ok(Some(why)) => why,
                Err(e) => format!("{e:#}"),
            };
            if Instant::now() >= deadline {
                return Err(why);
            }
            if let Some(stuck) = self.failed_for_good(until, id, &mut failed_since).await {
                return Err(format!("{why}: {stuck}"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// For a wait on a phase other than `failed`: why it cannot succeed, once the agent has
    /// been in phase `failed` for [`FAILED_IS_FINAL`]. The agent leaves that phase only when
    /// it is restarted or reloaded, which no step does while another waits, so the rest of the
    /// timeout would only delay the verdict (a chaos run that caught a broken agent waited out
    /// the 3 minutes of its last `expect`).
    async fn failed_for_good(
        &mut self,
        until: &Until,
        id: &str,
        since: &mut Option<Instant>,
    ) -> Option<String> {
        let Until::Phase(want) = until else { return None };
        if *want == Phase::Failed {
            return None;
        }
        let Some(s) = self.status(id).await.ok().filter(|s| s.phase == Phase::Failed) else {
            *since = None;
            return None;
        };
        let at = *since.get_or_insert_with(Instant::now);
        (at.elapsed() >= FAILED_IS_FINAL).then(|| {
            let error = s
                .last_error
                .as_ref()
                .map_or_else(|| "no last_error".to_owned(), |e| format!("{}: {}", e.reason, e.message));
            format!("the agent stays in phase failed ({error}); only a restart or a reload ends that")
        })
    }
}

/// How long an agent is seen in phase `failed` before a wait for another phase gives up.
const FAILED_IS_FINAL: Duration = Duration::from_secs(2);
