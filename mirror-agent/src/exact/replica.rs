//! HA for an exact link (SPEC §10, HA): no election (it would write the target); the fence
//! decides which replica lands Txn R, and to spare raft a replica sends Txn R only when it
//! last landed one itself, or when the checkpoint has not reached R for [`STALL`] since R
//! arrived. A replica that sees R landed by another goes on; a lost race is judged
//! `AlreadyLanded` or `Behind` by the fence, never a foreign write.

use std::time::Duration;

use etcd_client::{Client, WatchOptions, WatchStream};
use mirror_core::{AgentRole, Config, EtcdError, Side};
use mirror_fence::Checkpoint;
use tokio::time::Instant;

use super::Stop;

/// How long a replica waits for another to land a revision it has before it sends it itself.
pub(super) const STALL: Duration = Duration::from_millis(500);

/// Who lands, until the checkpoint's records say (a Txn of this agent found R landed).
const ANOTHER: &str = "another replica";

/// What a replica does with revision R.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Turn {
    /// Send it.
    Send,
    /// Another replica landed it (and maybe more): go on.
    Landed,
}

/// The replicas of the link as the checkpoint shows them.
pub(super) struct Replicas {
    me: String,
    /// A watch of the checkpoint key (`None`: `ha.enabled` is off, this agent always sends).
    stream: Option<WatchStream>,
    landed: i64,
    writer: String,
}

impl Replicas {
    /// Watches the checkpoint key from after `landed` when `ha.enabled`.
    pub(super) async fn open(
        cfg: &Config,
        target: &Client,
        me: String,
        landed: i64,
    ) -> Result<Replicas, Stop> {
        let mut replicas = Replicas { me, stream: None, landed, writer: String::new() };
        if cfg.ha.enabled {
            let opts = WatchOptions::new().with_start_revision(landed + 1);
            let stream = target.watch_client().watch(cfg.checkpoint_key(), Some(opts)).await;
            replicas.stream = Some(stream.map_err(|e| EtcdError::new("watch checkpoint", Side::Target, e))?);
        }
        Ok(replicas)
    }

    /// Whether several replicas may write (`ha.enabled`): then one Txn at a time, each when it
    /// is this replica's turn.
    pub(super) fn active(&self) -> bool {
        self.stream.is_some()
    }

    /// This agent's role: `standby` while another replica lands the revisions.
    pub(super) fn role(&self) -> AgentRole {
        if self.stream.is_some() && !self.writer.is_empty() && self.writer != self.me {
            AgentRole::Standby
        } else {
            AgentRole::Mirror
        }
    }

    /// This agent landed `revision`.
    pub(super) fn landed_by_me(&mut self, revision: i64) {
        self.landed = self.landed.max(revision);
        self.writer = self.me.clone();
    }

    /// Another agent (or this one, on a lost answer) landed up to `revision`: from here this
    /// agent waits its turn, and the checkpoint's records say who lands.
    pub(super) fn landed_elsewhere(&mut self, revision: i64) {
        self.landed = self.landed.max(revision);
        if self.writer.is_empty() || self.writer == self.me {
            self.writer = ANOTHER.to_owned();
        }
    }

    /// Whether to send `revision` or go on: without HA always send; with it, send at once
    /// when this agent landed the last revision (or nobody has yet), else wait until another
    /// lands it or the checkpoint stands still for [`STALL`].
    pub(super) async fn turn(&mut self, revision: i64) -> Result<Turn, Stop> {
        let Some(stream) = self.stream.as_mut() else { return Ok(Turn::Send) };
        if self.landed >= revision {
            return Ok(Turn::Landed);
        }
        if self.writer.is_empty() || self.writer == self.me {
            return Ok(Turn::Send);
        }
        let mut deadline = Instant::now() + STALL;
        loop {
            tokio::select! {
                message = stream.message() => {
                    let resp = message
                        .map_err(|e| EtcdError::new("watch checkpoint", Side::Target, e))?
                        .ok_or_else(|| EtcdError::new("watch checkpoint", Side::Target, etcd_client::Error::WatchError("closed".into())))?;
                    for event in resp.events() {
                        let Some(kv) = event.kv() else { continue };
                        self.landed = self.landed.max(kv.mod_revision());
                        if let Ok(record) = Checkpoint::decode(kv.value()) {
                            self.writer = record.agent_id;
                        }
                        deadline = Instant::now() + STALL;
                    }
                    if self.landed >= revision {
                        return Ok(Turn::Landed);
                    }
                }
                _ = tokio::time::sleep_until(deadline) => return Ok(Turn::Send),
            }
        }
    }
}
