//! The tail's check of the fence between Txns: that nothing but the link wrote the target.

use mirror_core::{unary, Reason, Side};
use mirror_fence::{Checkpoint, Role};

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
}
