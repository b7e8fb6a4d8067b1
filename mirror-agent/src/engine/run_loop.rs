//! The outer loop of one link: connect, run, and on an error decide by class: back off and
//! reconnect, start a fresh genesis, park in `failed`, or go to cold standby.

use std::time::Duration;

use mirror_core::{
    connect, Action, ConditionType, Config, ErrorClass, LastError, Phase, Reason, RetryPolicy, Side,
};
use mirror_fence::{read_checkpoint, FenceError, Observed, Role};
use tokio::time::Instant;
use tracing::{error, info, warn};

use super::decide::{self, Decision};
use super::{Engine, EngineError, Pending, Progress};

/// How long a link has, once shutdown is asked for, to end by itself (between two steps)
/// before the step in flight is dropped: SIGTERM ends the agent within 2 s whatever RPC is in
/// flight, a silent target's included. A Txn cut off mid-flight landed whole or not at all
/// (etcd applies a Txn atomically), and the next start resumes from the checkpoint.
pub(super) const STOP_GRACE: Duration = Duration::from_millis(600);

/// Resolves [`STOP_GRACE`] after `shutdown`: a `select!` branch beside the link's run, which
/// then drops the run and with it the request in flight. (A branch, not a wrapper future: each
/// wrapper adds a poll frame to an already deep stack in debug builds.)
pub(super) async fn stop_grace_elapsed(shutdown: &tokio_util::sync::CancellationToken) {
    shutdown.cancelled().await;
    tokio::time::sleep(STOP_GRACE).await;
    warn!("the link did not stop within {STOP_GRACE:?} of shutdown: its request in flight is cancelled");
}

/// How a run of the link ended.
pub(super) enum LinkEnd {
    /// Shutdown (or, under HA, the end of this agent's term).
    Stopped,
    /// Under HA: the fence moved to another writer; the reason of the `Fenced` condition.
    Fenced(Reason, String),
}

impl Engine {
    /// Runs until shutdown: under HA, campaigns and runs the link while leading
    /// ([`Engine::run_ha`]); otherwise runs the link, parking in cold standby when fenced.
    pub async fn run(mut self) {
        if self.cfg.ha.enabled {
            self.run_ha().await;
        } else {
            let shutdown = self.shutdown.clone();
            tokio::select! {
                _ = self.run_link() => {}
                _ = stop_grace_elapsed(&shutdown) => {}
            }
        }
    }

    /// Runs the link until shutdown. Transient errors back off and reconnect; permanent ones
    /// park the engine in `failed` (HTTP keeps serving); fence losses park it in `standby`, or
    /// under HA end the run so the agent campaigns again.
    pub(super) async fn run_link(&mut self) -> LinkEnd {
        let mut pending = Pending::Resume;
        let mut policy = RetryPolicy::new(&self.cfg.sync);
        let mut last_reconnect: Option<Instant> = None;
        loop {
            if self.shutdown.is_cancelled() {
                return LinkEnd::Stopped;
            }
            if self.cfg.paused && !self.paused().await {
                return LinkEnd::Stopped;
            }
            let result = self.connect_and_run(pending).await;
            pending = Pending::Resume;
            // What the run achieved resets the waits (defect #1 of issue 10: they never reset).
            match std::mem::take(&mut self.progress) {
                Progress::None => {}
                Progress::Healthy => policy.on_success(),
                Progress::Live => policy.on_live_progress(),
            }
            let err = match result {
                Ok(()) | Err(EngineError::Shutdown) => return LinkEnd::Stopped,
                // Not an error: the loop's top holds the link paused.
                Err(EngineError::Paused) => continue,
                Err(e) => e,
            };
            let decision = decide::on_run_error(&err);
            if let Decision::Reconnect { fragments } = decision {
                if fragments {
                    warn!("a watch response was over the decode limit; watching in fragments from now on");
                    self.fragment_watch = true;
                }
                info!(why = %err, "reconnecting both sides with the current settings and files");
                // Immediate once; a reconnect that asks for another within seconds (a
                // server that takes the handshake but then refuses) waits the initial backoff.
                if last_reconnect.is_some_and(|at| at.elapsed() < Duration::from_secs(10)) {
                    tokio::select! {
                        _ = self.shutdown.cancelled() => return LinkEnd::Stopped,
                        _ = tokio::time::sleep(self.cfg.sync.backoff.initial.get()) => {}
                    }
                }
                last_reconnect = Some(Instant::now());
                continue;
            }
            let class = err.class();
            // Standing by for another writer (a newer epoch, a cutover) is not an error: the
            // `Fenced` condition says why. Recording it as a permanent last_error read as a
            // failure to dashboards and to the cutover tests that look for none.
            if !matches!(decision, Decision::StandBy(_)) {
                self.update(|s| {
                    s.last_error = Some(LastError {
                        class,
                        reason: err.reason(),
                        message: err.to_string(),
                        fix: err.fix(),
                    })
                });
            }
            match decision {
                Decision::Reconnect { .. } => unreachable!("handled above"),
                Decision::StandBy(reason) => {
                    if self.cfg.ha.enabled {
                        return LinkEnd::Fenced(reason, err.to_string());
                    }
                    error!(
                        reason = reason.as_str(),
                        "fenced: {err}; entering cold standby, no further writes"
                    );
                    if self.standby(reason, &err.to_string()).await {
                        self.update(|s| {
                            s.set_condition(ConditionType::Fenced, false, Reason::TakingOver, "")
                        });
                        continue;
                    }
                    return LinkEnd::Stopped;
                }
                Decision::Fail { condition } => {
                    error!(reason = %err.reason(), "permanent error, writes stopped: {err}");
                    self.set_phase(Phase::Failed);
                    if let Some((condition, reason)) = condition {
                        self.update(|s| s.set_condition(condition, true, reason, err.to_string()));
                    }
                    self.shutdown.cancelled().await;
                    return LinkEnd::Stopped;
                }
                Decision::FreshGenesis { reason, forced } => {
                    self.note_resync(reason, forced);
                    pending = Pending::FreshGenesis;
                }
                Decision::Retry => {}
            }
            let delay = match policy.on_error(class) {
                Action::RetryAfter(delay) => {
                    warn!(class = %class, reason = %err.reason(), "{err}; retrying in {delay:?}");
                    delay
                }
                Action::FreshGenesisAfter(delay) => {
                    if !delay.is_zero() {
                        warn!(reason = %err.reason(), "fresh genesis in {delay:?} (resyncs in a row back off)");
                    }
                    delay
                }
                Action::Stop => Duration::ZERO,
            };
            // Never connected yet: still connecting (not ready). Lost a working link:
            // degraded (ready, and saying so) while it reconnects.
            if self.ever_connected && pending == Pending::Resume {
                self.set_phase(Phase::Degraded);
            }
            tokio::select! {
                _ = self.shutdown.cancelled() => return LinkEnd::Stopped,
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// Paused by config: no watch, no writes, HTTP serving, until a reload sets `paused =
    /// false` (true: resume from the watermark, as after a restart, so a compaction past it
    /// meanwhile is a forced resync and nothing else is) or shutdown (false).
    async fn paused(&mut self) -> bool {
        self.set_phase(Phase::Paused);
        info!(
            "paused by config: the watch is closed and nothing is written until a reload sets paused = false"
        );
        while self.cfg.paused {
            tokio::select! {
                _ = self.shutdown.cancelled() => return false,
                _ = super::waits::reload_changed(&mut self.reload) => {
                    // Settings that need a reconnect take effect at the resume's connect.
                    let _ = self.adopt_reload();
                }
            }
        }
        info!("unpaused: resuming from the watermark");
        true
    }

    /// Records a forced resync (history lost: fresh genesis with prune) or a genesis restart
    /// (buffer overflow or compaction while scanning). Both count towards the loop detector:
    /// three in a row with no live apply between latch `ResyncLoopDetected`, which a live apply
    /// clears.
    pub(super) fn note_resync(&mut self, reason: Reason, forced: bool) {
        self.resyncs_in_a_row += 1;
        let looping = self.resyncs_in_a_row >= 3;
        if forced {
            warn!(
                reason = reason.as_str(),
                in_a_row = self.resyncs_in_a_row,
                "forced resync: fresh genesis with prune"
            );
        } else {
            warn!(
                reason = reason.as_str(),
                in_a_row = self.resyncs_in_a_row,
                "restarting genesis from a fresh R0"
            );
        }
        let mut latched_now = false;
        self.update(|s| {
            // In the same update as the count: nobody may see a resync counted while the
            // initial sync still reads complete (a full CI run caught a test doing just that).
            s.set_condition(ConditionType::InitialSyncComplete, false, Reason::Resyncing, reason.as_str());
            if forced {
                s.forced_resyncs.count += 1;
                *s.forced_resyncs.by_reason.entry(reason).or_default() += 1;
                s.forced_resyncs.last_reason = Some(reason);
            } else {
                s.scan_restarts += 1;
            }
            if looping && !s.condition(ConditionType::ResyncLoopDetected) {
                latched_now = true;
                s.set_condition(
                    ConditionType::ResyncLoopDetected,
                    true,
                    reason,
                    "3 resyncs or genesis restarts in a row with no live apply between",
                );
            }
        });
        if latched_now {
            error!(
                reason = reason.as_str(),
                "resync loop: the source changes or compacts faster than the agent can scan"
            );
        }
    }

    /// Cold standby: no writes; watch the fence and report it until shutdown, or until a
    /// reloaded config raises our epoch above the stored one (then returns true: take over).
    pub(super) async fn standby(&mut self, mut reason: Reason, message: &str) -> bool {
        self.set_phase(Phase::Standby);
        self.update(|s| s.set_condition(ConditionType::Fenced, true, reason, message));
        // Keep the fence visible in status; log only on change.
        let mut last: Option<(u64, String)> = None;
        // The target may be down just now: keep trying (defect #7 of issue 10: a failed
        // connect here parked the standby until shutdown, so it could never take over).
        let mut wait = RetryPolicy::new(&self.cfg.sync);
        let client = loop {
            match connect(Side::Target, &self.cfg.target, &self.cfg.sync).await {
                Ok(client) => break client,
                Err(e) => {
                    let Action::RetryAfter(delay) = wait.on_error(ErrorClass::Transient) else {
                        return false;
                    };
                    warn!("standby cannot reach the target ({e}); retrying in {delay:?}");
                    tokio::select! {
                        _ = self.shutdown.cancelled() => return false,
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        };
        let (kv, key, timeout) =
            (client.kv_client(), self.cfg.checkpoint_key(), self.cfg.sync.request_timeout.get());
        // Sequenced reads: a slow answer never takes the reported holder backwards.
        let fence = mirror_fence::FenceObserver::new(move || {
            let (mut kv, key) = (kv.clone(), key.clone());
            async move { read_checkpoint(&mut kv, &key, timeout).await }
        });
        loop {
            self.take_reload();
            if let Ok(Some(Observed::Present { record, .. })) = fence.observe().await {
                if record.role == Role::Mirror && self.cfg.epoch as u64 > record.epoch {
                    info!(
                        ours = self.cfg.epoch,
                        stored = record.epoch,
                        "epoch raised above the fence; taking over"
                    );
                    return true;
                }
                let now = (record.epoch, record.agent_id.clone());
                if last.as_ref() != Some(&now) {
                    info!(epoch = record.epoch, holder = %record.agent_id, "fence held by another writer");
                    self.update(|s| s.watermark = record.watermark);
                    last = Some(now);
                }
                if record.role == Role::Primary && reason != Reason::TargetPromoted {
                    // Fenced by a cutover's claim (a newer epoch) before it promoted: once it
                    // has, the standby says so, as an agent that meets the promotion does.
                    reason = Reason::TargetPromoted;
                    warn!(epoch = record.epoch, "the target was promoted while this agent stood by");
                    let said = FenceError::CutOver.to_string();
                    self.update(|s| s.set_condition(ConditionType::Fenced, true, reason, said));
                }
            }
            tokio::select! {
                _ = self.shutdown.cancelled() => return false,
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
        }
    }

    /// Adopts a reloaded config if one arrived and was not yet adopted.
    pub(super) fn take_reload(&mut self) {
        if self.reload.as_ref().is_some_and(|rx| rx.has_changed().unwrap_or(false)) {
            // A standby's only connection is re-made on its next loop; nothing to do here.
            let _ = self.adopt_reload();
        }
    }

    /// Adopts the latest reloaded config inside a running link: new connection settings end
    /// the run with a reconnect, `paused = true` with [`EngineError::Paused`]; anything else
    /// applies in place.
    pub(super) fn apply_reload(&mut self) -> Result<(), EngineError> {
        if self.adopt_reload() {
            return Err(EngineError::Reconnect(super::ReconnectCause::ConnectionSettingsReloaded));
        }
        if self.cfg.paused {
            return Err(EngineError::Paused);
        }
        Ok(())
    }

    /// Adopts the latest reloaded config; true when it changed how a side is reached
    /// (endpoints, TLS, auth), which takes a reconnect.
    ///
    /// The epoch never goes down while running: under HA the running epoch is the term's
    /// (the configured one raised to the election revision), and putting the configured value
    /// back made the leader meet its own higher epoch at the next reconnect and abdicate
    /// (`FencedByNewerEpoch`). A raised epoch is taken (a standby takes over with it).
    pub(super) fn adopt_reload(&mut self) -> bool {
        let Some(rx) = self.reload.as_mut() else { return false };
        let mut new = rx.borrow_and_update().clone();
        if new.epoch < self.cfg.epoch {
            if !self.cfg.ha.enabled {
                warn!(
                    configured = new.epoch,
                    running = self.cfg.epoch,
                    "reload lowers the epoch: keeping the running one (restart to lower it)"
                );
            }
            new.epoch = self.cfg.epoch;
        }
        info!(
            epoch = new.epoch,
            max_ops_per_second = new.sync.max_ops_per_second,
            reconcile_interval = %new.reconcile.interval,
            "config reloaded"
        );
        self.update(|s| s.epoch = new.epoch as u64);
        let reach = |c: &Config| {
            [&c.source, &c.target].map(|side| (side.endpoints.clone(), side.tls.clone(), side.auth.clone()))
        };
        let reconnect = reach(&self.cfg) != reach(&new);
        self.reporter.set_freshness(crate::freshness::Freshness::of(&new));
        self.cfg = new;
        reconnect
    }
}

#[cfg(test)]
mod tests {
    use mirror_core::{ConditionType, Config, Reason, StatusHandle};
    use tokio_util::sync::CancellationToken;

    use super::Engine;

    /// An engine on the minimal config that never runs, and the status it reports into.
    fn engine() -> (Engine, StatusHandle) {
        let cfg = Config::from_toml_str(mirror_core::testing::MINIMAL_CONFIG).unwrap();
        let status = StatusHandle::default();
        (Engine::new(cfg, status.clone(), CancellationToken::new()), status)
    }

    /// Upstream #14: forced resyncs after compactions, three in a row with no live apply,
    /// latch `ResyncLoopDetected` with their cause; more of them keep it latched (it does not
    /// clear itself while the loop goes on, and keeps the first cause). Only a live apply
    /// clears it (the test below; at agent level `resync-loop-latch.toml`).
    #[test]
    fn consecutive_compaction_resyncs_latch_and_stay_latched() {
        let (mut engine, status) = engine();
        let latch = || {
            let s = status.read().unwrap();
            let c = s.conditions.iter().find(|c| c.type_ == ConditionType::ResyncLoopDetected);
            c.filter(|c| c.status).map(|c| c.reason)
        };
        engine.note_resync(Reason::SourceCompacted, true);
        engine.note_resync(Reason::WatchCompacted, true);
        assert_eq!(latch(), None, "two in a row are not a loop yet");
        engine.note_resync(Reason::SourceCompacted, true);
        assert_eq!(latch(), Some(Reason::SourceCompacted));
        for _ in 0..3 {
            engine.note_resync(Reason::WatchCompacted, true);
            assert_eq!(latch(), Some(Reason::SourceCompacted), "still latched, first cause kept");
        }
        let s = status.read().unwrap();
        assert_eq!(s.forced_resyncs.count, 6);
        assert!(!s.condition(ConditionType::InitialSyncComplete));
    }

    /// Upstream #23: the latch trips even when every resync's replay applies events (a replay
    /// is part of the loop, not steady state), stays through more replays, and only a live
    /// apply clears it, through the engine's own bookkeeping of applied batches.
    #[test]
    fn replays_inside_the_loop_neither_hold_off_nor_clear_the_latch() {
        let (mut engine, status) = engine();
        let latched = || status.read().unwrap().condition(ConditionType::ResyncLoopDetected);
        let mut revision = 100;
        for round in 1..=3 {
            engine.note_resync(Reason::WatchBufferOverflow, false);
            revision += 10;
            engine.note_applied(true, revision, 25);
            assert_eq!(latched(), round == 3, "after resync {round} and its replay");
        }
        engine.note_resync(Reason::WatchBufferOverflow, false);
        engine.note_applied(true, revision + 10, 25);
        assert!(latched(), "a replay does not clear it");
        engine.note_applied(false, revision + 20, 0);
        assert!(latched(), "a commit without data is no evidence");
        engine.note_applied(false, revision + 21, 1);
        assert!(!latched(), "a live apply clears it");
        assert_eq!(status.read().unwrap().scan_restarts, 4);
        engine.note_resync(Reason::WatchBufferOverflow, false);
        assert!(!latched(), "the count started over at the live apply");
    }
}
