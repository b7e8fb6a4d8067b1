//! Settling the target against the source pinned at a revision, for an initial sync or a drain
//! that ends on an idle source (see the engine module doc).

use mirror_core::ErrorClass;
use mirror_reconcile::Repairs;
use tracing::{info, warn};

use super::Tail;
use crate::engine::link::Link;
use crate::engine::{EngineError, DRAIN_SETTLE_ATTEMPTS};

impl Tail {
    /// Brings the target to the source's state at `end` by comparison, then moves the watermark
    /// to `end` (module doc: "Why genesis and drain completion do not rest on an untrusted
    /// progress reply"). Genesis repairs what differs; a drain only compares, and repairs after
    /// [`DRAIN_SETTLE_ATTEMPTS`] comparisons in a row found the target behind (something other
    /// than undelivered events keeps it different; the verification after the drain repairs
    /// such keys anyway).
    pub(super) async fn settle_at(&mut self, link: &mut Link<'_>, end: i64) -> Result<(), EngineError> {
        let genesis = self.scan_end.is_some();
        // The sweep's rule (issue #20 defect 2); keys of a nested link are never ours to delete
        // (issue #19: a settle pass deleted a nested link's keys).
        let prune = link.writer().record().prune_pending;
        let scope = link.orphan_scope(prune).await?;
        let repair = genesis || self.drain_settles + 1 >= DRAIN_SETTLE_ATTEMPTS;
        info!(end, genesis, repair, "source idle: settling the target against the source pinned at {end}");
        let page = link.page_options("settle page").at_revision(end);
        let differ = mirror_reconcile::Differ::new(
            link.engine.rewriter.clone(),
            link.source.kv_client(),
            link.target_kv.clone(),
            page,
        );
        let mut repairs =
            Repairs::new(differ, link.chunker(), |key: &[u8], mod_revision| scope.deletes(key, mod_revision));
        loop {
            link.engine.stop_if_shutting_down()?;
            let chunk = match repairs.next_chunk().await {
                Ok(chunk) => chunk,
                Err(e) if e.class() == ErrorClass::Resync => {
                    // `end` was compacted away while comparing: settle at the current revision
                    // next time; the watch still delivers everything in between.
                    let now = link.source_revision().await?;
                    warn!(end, now, "source compacted past the settle revision; settling at {now} next");
                    if let Some(e) = self.scan_end.as_mut() {
                        *e = now;
                    } else {
                        self.drain_target = Some(now);
                    }
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            };
            let Some(chunk) = chunk else { break };
            if repair {
                link.commit_keep(&chunk).await?;
            }
        }
        let differences = repairs.found();
        if differences > 0 && !repair {
            self.drain_settles += 1;
            info!(end, differences, "target still behind the source at {end}; waiting for the watch");
            return Ok(());
        }
        self.drain_settles = 0;
        info!(end, repaired = differences, "target settled at the source's state at {end}");
        self.advance_to(link, end).await
    }
}
