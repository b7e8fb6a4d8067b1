//! HA (SPEC §6, `ha.enabled`): campaign for the link's election on the target, run the link
//! while leading, stand by while another agent leads.
//!
//! The election decides who *tries*; the checkpoint fence decides who *writes*
//! (`mirror_fence::election`). Each term runs the link under a child of the process's shutdown
//! token; losing the lease cancels it, so the leader stops writing at once and campaigns again.
//! Leaving on SIGTERM revokes the lease, so a standby takes over at once instead of after
//! `lease_ttl` (a rolling restart costs one claim, not a TTL of silence).

use std::time::Duration;

use mirror_core::HaStatus;
use mirror_core::{
    connect, Action, AgentRole, ConditionType, ErrorClass, EtcdError, Phase, Reason, RetryPolicy, Side,
};
use mirror_fence::election::{self, Leadership};
use tracing::{error, info, warn};

use super::probe::Warm;
use super::run_loop::{stop_grace_elapsed, LinkEnd};
use super::Engine;

/// How long the lease revoke of a stopping leader may take (the rest of the 2 s a SIGTERM has,
/// after [`super::run_loop::STOP_GRACE`]).
const RESIGN_ON_STOP: Duration = Duration::from_millis(800);

/// How often a standby refreshes the leader it reports.
const LEADER_REFRESH: Duration = Duration::from_secs(2);

impl Engine {
    /// The HA loop: campaign, lead, and on losing campaign again, until shutdown.
    pub(super) async fn run_ha(mut self) {
        let root = self.shutdown.clone();
        let name = election::election_name(&self.rewriter.reserved_prefix());
        let mut wait = RetryPolicy::new(&self.cfg.sync);
        let mut standby_reason =
            (Reason::AwaitingElection, "another agent of this link leads, or the election is open");
        self.update(|s| s.ha = Some(HaStatus::default()));
        loop {
            self.set_phase(Phase::Standby);
            self.update(|s| {
                s.role = AgentRole::Standby;
                s.set_condition(ConditionType::Fenced, true, standby_reason.0, standby_reason.1);
                if let Some(ha) = s.ha.as_mut() {
                    ha.leader = false;
                    ha.lease_id = 0;
                }
            });
            let leadership = tokio::select! {
                _ = root.cancelled() => return,
                elected = self.campaign(&name) => elected,
            };
            let mut leadership = match leadership {
                Ok((l, warm)) => {
                    self.elected_at = Some(tokio::time::Instant::now());
                    self.warm = warm;
                    l
                }
                Err(e) => {
                    let Action::RetryAfter(delay) = wait.on_error(e.class()) else { return };
                    warn!("HA campaign failed ({e}); campaigning again in {delay:?}");
                    tokio::select! {
                        _ = root.cancelled() => return,
                        _ = tokio::time::sleep(delay) => continue,
                    }
                }
            };
            wait.on_success();
            if let Some(holder) = self.cutover_running().await {
                // A cutover drains: claiming now would take the fence back from it.
                info!(holder, "elected, but a cutover of this link is running; resigning until it ends");
                leadership.resign(self.cfg.sync.request_timeout.get()).await;
                standby_reason =
                    (Reason::CutoverInProgress, "a cutover of this link holds the fence while it drains");
                self.update(|s| {
                    s.set_condition(ConditionType::Fenced, true, standby_reason.0, standby_reason.1)
                });
                tokio::select! {
                    _ = root.cancelled() => return,
                    _ = self.cutover_ended() => continue,
                }
            }
            // Every election key is newer than all earlier leaders' keys: so is our epoch. The
            // running epoch only grows (an earlier term's, or one raised by a reload).
            let epoch = self.cfg.epoch.max(leadership.revision);
            info!(epoch, lease = leadership.lease_id, "elected HA leader; claiming the fence");
            self.cfg.epoch = epoch;
            let (agent_id, lease_id) = (self.agent_id.clone(), leadership.lease_id);
            self.update(|s| {
                s.epoch = epoch as u64;
                s.role = AgentRole::Mirror;
                s.set_condition(ConditionType::Fenced, false, Reason::ElectedLeader, "");
                s.ha = Some(HaStatus {
                    leader: true,
                    leader_agent_id: Some(agent_id),
                    lease_id,
                    term: epoch as u64,
                });
            });
            let term = root.child_token();
            self.shutdown = term.clone();
            let end = {
                let run = self.run_link();
                tokio::pin!(run);
                tokio::select! {
                    end = &mut run => Some(end),
                    _ = stop_grace_elapsed(&root) => Some(LinkEnd::Stopped),
                    _ = leadership.lost() => {
                        term.cancel();
                        run.await;
                        None
                    }
                }
            };
            self.shutdown = root.clone();
            let timeout = self.cfg.sync.request_timeout.get();
            match end {
                _ if root.is_cancelled() => {
                    // Bounded so that SIGTERM ends the agent within 2 s: a target that does
                    // not answer leaves the lease to expire on its TTL instead.
                    info!("stopping: resigning the HA election so a standby takes over at once");
                    leadership.resign(timeout.min(RESIGN_ON_STOP)).await;
                    return;
                }
                None => {
                    error!(epoch, "HA lease lost: writes stopped; campaigning again");
                    standby_reason =
                        (Reason::LostElection, "this agent's election lease expired or was revoked");
                }
                Some(LinkEnd::Fenced(Reason::TargetPromoted, message)) => {
                    // Cut over: nobody may write any more; stay a standby, do not campaign.
                    leadership.resign(timeout).await;
                    error!("fenced: {message}; the target is promoted, standing by");
                    self.standby(Reason::TargetPromoted, &message).await;
                    return;
                }
                Some(LinkEnd::Fenced(reason, message)) => {
                    error!(
                        reason = reason.as_str(),
                        "fenced: {message}; resigning the HA election and campaigning again"
                    );
                    leadership.resign(timeout).await;
                    standby_reason = (reason, "another writer holds the fence");
                    let Action::RetryAfter(delay) = wait.on_error(ErrorClass::Transient) else { return };
                    tokio::select! {
                        _ = root.cancelled() => return,
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
                Some(LinkEnd::Stopped) => {
                    // The link stopped although neither shutdown nor the lease ended the term.
                    leadership.resign(timeout).await;
                }
            }
        }
    }

    /// Who holds the link's cutover key (`election::cutover_key`), if anyone; a read that fails
    /// counts as none (the claim's fence still protects the data).
    async fn cutover_running(&self) -> Option<String> {
        let cfg = &self.cfg;
        let client = match &self.warm {
            Some(w) => w.target.clone(),
            None => connect(Side::Target, &cfg.target, &cfg.sync).await.ok()?,
        };
        let reserved = self.rewriter.reserved_prefix();
        election::cutover_holder(&client, &reserved, cfg.sync.request_timeout.get()).await.ok().flatten()
    }

    /// Resolves once no cutover holds the link's cutover key.
    async fn cutover_ended(&self) {
        while self.cutover_running().await.is_some() {
            tokio::time::sleep(LEADER_REFRESH).await;
        }
    }

    /// Connects to the target and campaigns; meanwhile reports who leads and keeps both sides
    /// probed and connected ([`Engine::warm_up`], every [`LEADER_REFRESH`]), so that once
    /// elected the claim needs no dial and no probe. Returns the leadership and that connection
    /// (`None` if the last refresh failed: the run then connects as usual).
    async fn campaign(&self, name: &[u8]) -> Result<(Leadership, Option<Warm>), EtcdError> {
        let cfg = &self.cfg;
        let client = connect(Side::Target, &cfg.target, &cfg.sync).await?;
        let (ttl, timeout) = (cfg.ha.lease_ttl.get(), cfg.sync.request_timeout.get());
        let campaign = election::campaign(&client, name, &self.agent_id, ttl, timeout);
        tokio::pin!(campaign);
        let mut warm: Option<Warm> = None;
        loop {
            if let Ok(leader) = election::leader(&client, name, timeout).await {
                self.update(|s| {
                    if let Some(ha) = s.ha.as_mut() {
                        ha.leader_agent_id = leader;
                    }
                });
            }
            // The campaign is polled throughout: winning while a refresh is under way drops
            // the refresh and keeps the last one.
            let refresh = async {
                let fresh = self.warm_up(warm.as_ref()).await;
                tokio::time::sleep(LEADER_REFRESH).await;
                fresh
            };
            tokio::select! {
                elected = &mut campaign => return elected.map(|l| (l, warm)),
                fresh = refresh => warm = fresh.ok(),
            }
        }
    }
}
