//! The tail's fence: each revision's Txn with the checkpoint record it puts, and the check
//! between Txns that nothing but the link wrote the target.

use mirror_core::{unary, ExactRevision, Reason, Side};
use mirror_fence::{Checkpoint, RevisionTxn, Role};

use super::super::{timeout, Stop};
use super::Tail;

impl Tail<'_> {
    /// The check that nothing but the link wrote the target since its last Txn: the target's
    /// revision is still the one its checkpoint was put at (another replica's Txns included),
    /// and that is not behind what this agent landed. `also` names what prompted it.
    pub(super) async fn check_fence(&mut self, also: &str) -> Result<(), Stop> {
        let key = self.placed.fence.key().to_vec();
        let mut kv = self.target.kv_client();
        let resp = unary("read checkpoint", Side::Target, timeout(self.cfg), kv.get(key, None)).await?;
        let head = resp.header().map_or(0, |h| h.revision());
        let record = resp.kvs().first().and_then(|kv| Checkpoint::decode(kv.value()).ok());
        if let Some(record) = record.filter(|r| r.role == Role::Primary) {
            return Err(super::super::seed::promoted(&record));
        }
        let at = resp.kvs().first().map_or(self.placed.fence.seed(), |kv| kv.mod_revision());
        if head != at || at < self.placed.watermark {
            return Err(Stop::lost(
                Reason::ForeignWrite,
                format!(
                    "the target is at revision {head}, its checkpoint at {at}, and this agent landed up to source \
                     revision {}: something other than the link wrote the target{also}",
                    self.placed.watermark
                ),
            ));
        }
        Ok(())
    }

    /// Txn `rev.revision`, with the lease records `riders` carries.
    pub(super) fn build(
        &self,
        rev: &ExactRevision,
        riders: Vec<etcd_client::TxnOp>,
    ) -> Result<RevisionTxn, Stop> {
        let record = self.record(rev.revision).encode().map_err(|e| {
            Stop::lost(
                Reason::InvalidCheckpointRecord,
                format!("the checkpoint record cannot be written: {e}"),
            )
        })?;
        let per_level = mirror_fence::ops_per_level(self.cfg.sync.max_txn_ops);
        self.placed.fence.txn(rev, record, riders, per_level).map_err(|e| {
            Stop::lost(Reason::RevisionTooLarge, format!("source revision {}: {e}", rev.revision))
        })
    }

    /// The record Txn `revision` puts.
    fn record(&self, revision: i64) -> Checkpoint {
        let cfg = self.cfg;
        Checkpoint {
            link_uid: cfg.link_uid.clone(),
            epoch: cfg.epoch as u64,
            role: Role::Mirror,
            watermark: revision,
            scanning: false,
            scan_cursor: Vec::new(),
            prune_pending: false,
            source_cluster_id: self.placed.source_cluster,
            target_cluster_id: self.placed.target_cluster,
            agent_id: self.me.clone(),
            commit: String::new(),
            range: self.range.clone(),
            confirmed_time: self.confirmed_at(revision),
            forced_resyncs: 0,
            scan_restarts: 0,
            initial_sync_completed: String::new(),
            excludes: Vec::new(),
            source_seen: self.seen.max(revision),
        }
    }
}
