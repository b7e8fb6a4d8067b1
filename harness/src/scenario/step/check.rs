//! The step that checks: `expect` (`sleep` and `wait` are in `wait.rs`). Its states (`condition`)
//! are parsed into typed values when the file is read, so a typo fails the file, not the run.

use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{bail, Context as _};
use mirror_core::{ConditionType, HumanDuration, Phase};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{agent_a, is_a, sixty, ConditionIs, Step, Until};
use crate::scenario::world::World;
use crate::{check_g3, G3};

/// Checks every given fact; `equal`, `exact`, `phase`, `condition` and `last_error` are
/// retried until `timeout`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// Target == source (latest on both, through the key rewrite).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equal: Option<bool>,
    /// Extension: exact mode's target == source (`until = "exact"`: the same revision, every
    /// key's value, create and mod revision, version and lease).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<bool>,
    /// The agent's phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// `"TYPE=True"` or `"TYPE=False"`, optionally `/REASON`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition: Option<ConditionIs>,
    /// The agent's forced resync count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forced_resyncs: Option<u64>,
    /// `"held"`: every continuous G3 check so far held, and at least one ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub g3: Option<String>,
    /// Extension: the agent's `last_error.reason` (e.g. `"SourceWentBack"`); retried until
    /// `timeout` like `phase`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The exit code of the agent's last `stop_agent` (or of its own exit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_exit: Option<i32>,
    /// Extension: from the checkpoint key's history, once this agent first wrote it, no other
    /// agent wrote it again (a fenced-out writer landed nothing after the takeover).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sole_writer_after: Option<String>,
    /// Extension: the agent's `initial_sync.completed` is at least this old (a restarted agent
    /// reports when the sync completed, not when it restarted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_sync_completed_older_than: Option<HumanDuration>,
    /// Extension: the agent restarted its genesis (`scan_restarts`) at least this often.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_scan_restarts: Option<u64>,
    /// Extension: the agent restarted its genesis (`scan_restarts`) at most this often.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_scan_restarts: Option<u64>,
    /// Extension: the agent's own `peak_rss_bytes` (VmHWM, also
    /// `etcd_mirror_resident_memory_peak_bytes`) is at most this many MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_peak_rss_mib: Option<u64>,
    /// Extension: these keys (relative to `target.prefix`) exist in the target, e.g. keys that
    /// were there before the link and that no prune of it may delete.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target_has: Vec<String>,
    /// Extension: these keys (relative to `target.prefix`) do not exist in the target.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target_lacks: Vec<String>,
    /// Extension: the agent's `lag_revisions` is at most this and `ReplicationLagExceeded` is
    /// not True; with `during`, at every status read (every 500 ms) for that long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lag_revisions: Option<i64>,
    /// Extension: the agent re-opened its source watch at least this many times
    /// (`watch_restarts` in status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_watch_restarts: Option<u64>,
    /// Extension: the agent re-opened its source watch at most this many times
    /// (`watch_restarts` in status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_watch_restarts: Option<u64>,
    /// Extension: how long `max_lag_revisions` must hold, or over how long `leases_match` is
    /// sampled 20 times (default: one read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub during: Option<HumanDuration>,
    /// Extension: the link's checkpoint has this role (`"primary"` after a cutover or failover).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_role: Option<mirror_fence::Role>,
    /// Extension: nothing writes the target for this long (its revision does not move): no
    /// agent of a promoted link writes again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_still_for: Option<HumanDuration>,
    /// Extension (`sync.leases = "preserve"`): every leased source key of the range carries the
    /// same lease ID on the target, each such lease has the same granted TTL on both sides, and
    /// the target's remaining TTL is at most 3 s (progress_interval + 2 s) below the source's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leases_match: Option<bool>,
    /// Extension: these lease IDs do not exist on the target (revoked after the source's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target_leases_gone: Vec<i64>,
    /// Extension: these lease IDs live on the target and still hold keys.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target_leases_alive: Vec<i64>,
    /// Extension: how long `target_leases_gone` and `target_leases_alive` may take to hold
    /// (read every 250 ms); default: read once, so a step after a `sleep` is a bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leases_within: Option<HumanDuration>,
    /// Extension: each text is in exactly one line of the agent's log so far (an event said
    /// once, not once per retry or per status read).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub log_once: Vec<String>,
    /// Agent id.
    #[serde(default = "agent_a", skip_serializing_if = "is_a")]
    pub agent: String,
    /// How long `equal`, `phase` and `condition` may take to hold.
    #[serde(default = "sixty")]
    pub timeout: HumanDuration,
}

#[async_trait::async_trait]
#[typetag::serde(name = "expect")]
impl Step for Expect {
    fn check(&self) -> anyhow::Result<()> {
        match &self.g3 {
            Some(g) if g != "held" => bail!("g3: {g:?} (only \"held\")"),
            _ => Ok(()),
        }
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let agent = self.agent.as_str();
        if let Some(most) = self.max_lag_revisions {
            self.lag_stays_under(world, most).await?;
        }
        if self.min_watch_restarts.is_some() || self.max_watch_restarts.is_some() {
            let got = world.status(agent).await?.watch_restarts;
            let (least, most) = (self.min_watch_restarts.unwrap_or(0), self.max_watch_restarts);
            let expected = match most {
                Some(most) => format!("at least {least} and at most {most}"),
                None => format!("at least {least}"),
            };
            anyhow::ensure!(
                got >= least && most.is_none_or(|most| got <= most),
                "the source watch was re-opened {got} times, expected {expected}"
            );
        }
        let mut eventually = Vec::new();
        eventually.extend(self.phase.map(Until::Phase));
        eventually.extend(self.condition.clone().map(Until::Condition));
        eventually.extend(self.last_error.clone().map(Until::LastError));
        if self.equal == Some(true) {
            eventually.push(Until::Equal);
        }
        if self.exact == Some(true) {
            eventually.push(Until::Exact);
        }
        let deadline = Instant::now() + self.timeout.get();
        for until in &eventually {
            if let Err(why) = world.poll_until(until, agent, deadline).await {
                bail!("expected {until} within {:?}: {why}", self.timeout.get());
            }
        }
        if self.equal == Some(false) && world.difference().await?.is_none() {
            bail!("expected the sides to differ, they are equal");
        }
        if let Some(most) = self.max_peak_rss_mib {
            let peak = world.status(agent).await?.peak_rss_bytes;
            println!("           agent peak RSS {} MiB (at most {most} MiB expected)", peak >> 20);
            anyhow::ensure!(peak > 0, "the agent reports no peak_rss_bytes (no /proc?)");
            anyhow::ensure!(peak <= most << 20, "agent peak RSS {} MiB > {most} MiB", peak >> 20);
        }
        if let Some(age) = self.initial_sync_completed_older_than {
            let completed = world.status(agent).await?.initial_sync.completed;
            let at = completed.as_deref().map(humantime::parse_rfc3339_weak).transpose()?;
            let Some(at) = at else { bail!("the agent reports no initial_sync.completed") };
            let old = std::time::SystemTime::now().duration_since(at).unwrap_or_default();
            anyhow::ensure!(
                old >= age.get(),
                "initial_sync.completed {completed:?} is {old:?} old, expected at least {age}"
            );
        }
        if self.min_scan_restarts.is_some() || self.max_scan_restarts.is_some() {
            let got = world.status(agent).await?.scan_restarts;
            if let Some(least) = self.min_scan_restarts.filter(|least| got < *least) {
                bail!("expected at least {least} genesis restarts, saw {got}");
            }
            if let Some(most) = self.max_scan_restarts.filter(|most| got > *most) {
                bail!("expected at most {most} genesis restarts, saw {got}");
            }
        }
        self.named_keys(world).await?;
        if self.leases_match == Some(true) {
            // With `during`: 20 samples, the first now and the last at its end.
            let samples: u32 = if self.during.is_some() { 20 } else { 1 };
            let span = self.during.map_or(Duration::ZERO, |d| d.get());
            let start = Instant::now();
            for k in 0..samples {
                tokio::time::sleep_until(start + span * k / (samples - 1).max(1)).await;
                leases_match(world).await.with_context(|| format!("leases_match, sample {}", k + 1))?;
            }
            println!("           leases matched at {samples} samples");
        }
        if !self.log_once.is_empty() {
            let log = world.agent(agent)?.process.log();
            for text in &self.log_once {
                let n = log.lines().filter(|l| l.contains(text.as_str())).count();
                anyhow::ensure!(n == 1, "expected one line of the agent's log to hold {text:?}, found {n}");
            }
        }
        if !self.target_leases_gone.is_empty() || !self.target_leases_alive.is_empty() {
            let within = self.leases_within.map_or(Duration::ZERO, |d| d.get());
            let deadline = Instant::now() + within;
            loop {
                match self.target_leases_hold(world).await {
                    Ok(()) => break,
                    Err(_) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    Err(e) if within.is_zero() => return Err(e),
                    Err(e) => return Err(e.context(format!("target leases, within {within:?}"))),
                }
            }
        }
        if let Some(role) = self.checkpoint_role {
            let key = world.base.parsed()?.checkpoint_key();
            let resp = world.target.client().await?.get(key, None).await?;
            let stored =
                resp.kvs().first().map(|kv| mirror_fence::Checkpoint::decode(kv.value())).transpose()?;
            let got = stored.as_ref().map(|r| r.role);
            anyhow::ensure!(got == Some(role), "expected the checkpoint's role {role:?}, found {got:?}");
        }
        if let Some(quiet) = self.target_still_for {
            let mut dst = world.target.client().await?;
            let before = crate::scenario::current_revision(&mut dst).await?;
            tokio::time::sleep(quiet.get()).await;
            let after = crate::scenario::current_revision(&mut dst).await?;
            anyhow::ensure!(
                after == before,
                "the target moved from revision {before} to {after} within {quiet:?}"
            );
        }
        if let Some(n) = self.forced_resyncs {
            let got = world.status(agent).await?.forced_resyncs;
            anyhow::ensure!(
                got.count == n,
                "expected {n} forced resyncs, saw {} ({:?})",
                got.count,
                got.by_reason
            );
        }
        let mut note = String::new();
        if self.g3.is_some() {
            note = self.g3_held(world).await?;
        }
        if let Some(id) = &self.sole_writer_after {
            let writer = world.status(id).await?.agent_id;
            let (writes, after) = checkpoint_writers_after(world, &writer).await?;
            note = format!(
                "{writes} checkpoint writes by {writer} since its first, none by another agent{note}"
            );
            if let Some(other) = after {
                bail!("after agent {id:?} ({writer}) first wrote the checkpoint, {other} wrote it again");
            }
        }
        if let Some(code) = self.agent_exit {
            let a = world.agent(agent)?;
            let exit = match a.exit {
                Some(e) => e,
                None if a.process.is_running() => {
                    bail!("expected agent {agent:?} to have exited with {code}, it is running")
                }
                None => a.process.terminate().await?,
            };
            anyhow::ensure!(
                exit == Some(code),
                "expected agent {agent:?} to exit with {code}, it exited with {exit:?}"
            );
        }
        Ok(note)
    }
}

impl Expect {
    /// `target_leases_gone` and `target_leases_alive`, as the target says now.
    async fn target_leases_hold(&self, world: &mut World<'_>) -> anyhow::Result<()> {
        let mut dst = world.target.client().await?;
        for id in &self.target_leases_gone {
            let ttl = dst.lease_time_to_live(*id, None).await?.ttl();
            anyhow::ensure!(ttl < 0, "target lease {id} still exists (ttl {ttl}s)");
        }
        for id in &self.target_leases_alive {
            let opts = etcd_client::LeaseTimeToLiveOptions::new().with_keys();
            let resp = dst.lease_time_to_live(*id, Some(opts)).await?;
            anyhow::ensure!(resp.ttl() > 0, "target lease {id} is gone");
            anyhow::ensure!(!resp.keys().is_empty(), "target lease {id} holds no key");
        }
        Ok(())
    }

    /// `max_lag_revisions` (and `ReplicationLagExceeded` not True) at every read for `during`.
    async fn lag_stays_under(&self, world: &mut World<'_>, most: i64) -> anyhow::Result<()> {
        let until = Instant::now() + self.during.map_or(Duration::ZERO, |d| d.get());
        let (mut reads, mut worst) = (0u32, 0i64);
        loop {
            let s = world.status(&self.agent).await?;
            reads += 1;
            worst = worst.max(s.lag_revisions);
            if s.lag_revisions > most {
                bail!(
                    "lag_revisions {} > {most} (watermark {}, source revision {}) at read {reads}",
                    s.lag_revisions,
                    s.watermark,
                    s.source_revision
                );
            }
            if s.condition(ConditionType::ReplicationLagExceeded) {
                bail!("ReplicationLagExceeded is True at read {reads} (lag {} s)", s.lag_seconds);
            }
            if Instant::now() >= until {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        println!("           lag_revisions at most {worst} over {reads} status reads");
        Ok(())
    }

    /// `target_has` and `target_lacks`: one read per key named, present or absent as asked.
    async fn named_keys(&self, world: &mut World<'_>) -> anyhow::Result<()> {
        let named: Vec<(&String, bool)> = self
            .target_has
            .iter()
            .map(|k| (k, true))
            .chain(self.target_lacks.iter().map(|k| (k, false)))
            .collect();
        if named.is_empty() {
            return Ok(());
        }
        let prefix = world.scenario.target_prefix().to_owned();
        let mut dst = world.target.client().await?;
        for (key, want) in named {
            let full = format!("{prefix}{key}");
            let there = !dst.get(full.as_bytes(), None).await?.kvs().is_empty();
            match (want, there) {
                (true, false) => bail!("expected {full:?} in the target, it is gone"),
                (false, true) => bail!("expected {full:?} gone from the target, it is there"),
                _ => {}
            }
        }
        Ok(())
    }

    /// `g3 = "held"`: the continuous checker saw no violation, and one check now holds (so a
    /// short scenario is judged at its end too).
    async fn g3_held(&self, world: &mut World<'_>) -> anyhow::Result<String> {
        world.judge_violations("expect").await?;
        let parsed = world.base.parsed()?;
        let mut dst = world.target.client().await?;
        match check_g3(&mut world.src, &mut dst, &parsed.rewriter(), &parsed.checkpoint_key()).await? {
            G3::Holds { keys, watermark } => {
                world.checker.holds.fetch_add(1, Ordering::Relaxed);
                Ok(format!("G3 held ({keys} keys at {watermark})"))
            }
            G3::NotYet => bail!("expected G3 held, but there is no checkpoint outside a scan"),
        }
    }
}

/// Reads the checkpoint key's whole history (a watch from revision 1): how many times
/// `writer` wrote it since its first write, and the first other writer after that, if any.
async fn checkpoint_writers_after(
    world: &mut World<'_>,
    writer: &str,
) -> anyhow::Result<(usize, Option<String>)> {
    let key = world.base.parsed()?.checkpoint_key();
    let mut dst = world.target.client().await?;
    let now = dst.get(key.clone(), None).await?;
    let last = now.kvs().first().map(|kv| kv.mod_revision()).context("no checkpoint")?;
    let mut stream = dst.watch(key, Some(etcd_client::WatchOptions::new().with_start_revision(1))).await?;
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

/// `expect leases_match` (see the field).
async fn leases_match(world: &mut World<'_>) -> anyhow::Result<()> {
    let rewriter = world.base.parsed()?.rewriter();
    let mut src = world.src.clone();
    let mut dst = world.target.client().await?;
    let range = rewriter.source_range();
    let opts = etcd_client::GetOptions::new().with_range(range.end.clone()).with_keys_only();
    let source = src.get(range.start.clone(), Some(opts)).await?;
    let mut leases = std::collections::BTreeSet::new();
    let mut checked = 0;
    for kv in source.kvs().iter().filter(|kv| kv.lease() != 0) {
        let Some(key) = rewriter.to_target(kv.key()) else { continue };
        let there = dst.get(key.clone(), Some(etcd_client::GetOptions::new().with_keys_only())).await?;
        let got = there.kvs().first().map(|t| t.lease());
        anyhow::ensure!(
            got == Some(kv.lease()),
            "target key {} carries lease {got:?}, the source's {}",
            String::from_utf8_lossy(&key),
            kv.lease()
        );
        leases.insert(kv.lease());
        checked += 1;
    }
    anyhow::ensure!(checked > 0, "no leased source key: the check proves nothing");
    for id in leases {
        let s = src.lease_time_to_live(id, None).await?;
        let t = dst.lease_time_to_live(id, None).await?;
        anyhow::ensure!(
            s.granted_ttl() == t.granted_ttl(),
            "lease {id}: granted TTL {}s on the source, {}s on the target",
            s.granted_ttl(),
            t.granted_ttl()
        );
        anyhow::ensure!(
            t.ttl() + 3 >= s.ttl(),
            "lease {id}: {}s left on the target, {}s on the source",
            t.ttl(),
            s.ttl()
        );
    }
    Ok(())
}
