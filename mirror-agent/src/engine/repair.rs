//! Diff-and-repair: the prune sweep, the periodic reconcile pass, and drain verification.

use mirror_core::{now_rfc3339, AgentRole, ConditionType, ErrorClass, Fault, Phase, Reason, Side};
use mirror_reconcile::Repairs;
use mirror_watch::Op;
use tokio::time::Instant;
use tracing::{info, warn};

use super::decide::paced_repair_drops_watch;
use super::link::Link;
use super::tail::Tail;
use super::{EngineError, Refusal, Restart, ResyncCause};

impl Tail {
    /// The periodic reconcile pass of the tail with the watch buffered meanwhile
    /// ([`super::buffering::Buffering`]); afterwards the buffered revisions are applied. A full
    /// buffer does not cut the pass short (a paced repair may outlast any buffer): the watch is
    /// dropped then and re-opened from the watermark once the pass ends, as before buffering
    /// existed.
    pub(super) async fn reconcile_buffered(&mut self, link: &mut Link<'_>) -> Result<(), EngineError> {
        // The pass compares the source at the watermark with the target: nothing in flight.
        link.drain().await?;
        let delete_orphans = link.cfg().reconcile.delete_orphans;
        let Some(watch) = link.watch.take() else { return link.reconcile_pass(delete_orphans).await };
        let floor = link.writer().record().watermark;
        let limit = link.cfg().sync.watch_buffer_bytes.bytes() as usize;
        link.buffering.start(watch, floor, limit);
        let pass = link.reconcile_pass(delete_orphans).await;
        let buffered = link.buffering.stop().await;
        pass?;
        match buffered {
            Ok((watch, revisions)) => {
                link.watch = Some(watch);
                self.apply_revisions(link, revisions).await
            }
            Err(EngineError::RestartGenesis(Restart::WatchBufferOverflow)) => {
                warn!("the watch buffer filled during the reconcile pass; re-watching from the watermark");
                Ok(())
            }
            Err(EngineError::RestartGenesis(Restart::CompactedDuringScan)) => {
                Err(EngineError::Resync(ResyncCause::WatchCompacted))
            }
            Err(e) => Err(e),
        }
    }

    /// Drain, step 2 (SPEC §5): the watermark reached the drain target. Count both sides, repair
    /// once if they differ, refuse if they still differ, else promote the target: the fence's
    /// role becomes `primary`, so every later writer with the old view fails its compare.
    pub(super) async fn verify_and_promote(
        &mut self,
        link: &mut Link<'_>,
        drain_target: i64,
    ) -> Result<(), EngineError> {
        let mut counts = link.compare_at_watermark().await?;
        if !counts.equal() {
            warn!(
                missing = counts.missing,
                divergent = counts.divergent,
                orphan = counts.orphan,
                "drain: sides differ; one repair pass"
            );
            link.reconcile_pass(true).await?;
            counts = link.compare_at_watermark().await?;
        }
        if !counts.equal() {
            return Err(Refusal::DrainVerificationFailed {
                watermark: link.writer().record().watermark,
                missing: counts.missing,
                divergent: counts.divergent,
                orphan: counts.orphan,
            }
            .into());
        }
        let next = link.writer().record().promoted();
        let drained = next.watermark;
        link.commit_with_retry(&[], next).await?;
        info!(
            drained_revision = drained,
            source_keys = counts.source_keys,
            "cut over: the target is primary; no further writes"
        );
        link.watch = None;
        link.engine.update(|s| {
            s.role = AgentRole::Primary;
            s.source_keys = Some(counts.source_keys);
            s.target_keys = Some(counts.target_keys);
            s.lease_backed_keys = counts.leased_keys;
            s.cutover = Some(mirror_core::CutoverStatus {
                drain_target_revision: drain_target,
                drained_revision: drained,
                verified_time: Some(now_rfc3339()),
                source_keys: counts.source_keys,
                target_keys: counts.target_keys,
                leased_keys: counts.leased_keys,
            });
            s.set_condition(
                ConditionType::CutoverReady,
                true,
                Reason::Verified,
                format!("verified at source revision {drained}"),
            );
            s.set_condition(ConditionType::InvariantsHeld, true, Reason::CountsEqual, "");
        });
        link.engine.set_phase(Phase::Drained);
        Ok(())
    }
}

/// What every phase may ask of the link to compare and repair.
impl Link<'_> {
    /// Mark-and-sweep: delete target keys (outside the reserved namespace) whose source key does
    /// not exist now. Changes after R0 are replayed afterwards, so deleting by the source's
    /// current state is safe. The orphans come from [`mirror_reconcile::Sweep`] (a keys-only merge-join),
    /// so at most two pages are in memory; another link's reserved keys are never candidates.
    ///
    /// What is swept depends on the mode (issue #20, defect 2), never on why the prune is owed:
    /// - `overwrite_and_prune`: every orphan of the destination range; another link found inside
    ///   it stops the sweep before anything is deleted (`PrefixConflict`), as SPEC §5 asks.
    /// - otherwise only the orphans this link wrote: target mod revision after the checkpoint's
    ///   create revision, and not under a nested link's destination prefix (those keys are that
    ///   link's, whatever their revision). Keys that were there before the link stay, as
    ///   `overwrite` promises; a genesis restart after a watch-buffer overflow, or a forced
    ///   resync, no longer deletes them, and a nested link no longer turns it into a permanent
    ///   `NestedLink` failure. Every key that came from the source through this link was written
    ///   after the checkpoint was created, so no stale key of ours survives.
    pub(super) async fn sweep(&mut self, r0: i64) -> Result<(), EngineError> {
        let scope = self.orphan_scope(true).await?;
        let mut chunker = self.chunker();
        let mut sweep = mirror_reconcile::Sweep::new(
            self.engine.rewriter.clone(),
            self.source.kv_client(),
            self.target_kv.clone(),
            self.page_options("sweep page"),
        );
        let mut deleted = 0u64;
        info!("prune sweep started");
        loop {
            self.engine.stop_if_shutting_down()?;
            // A full watch buffer does not stop the sweep: the tail watches again from R0 + 1
            // after it (`Genesis::run`), where a restart would scan everything again.
            let orphan = sweep.next_orphan().await?;
            let done = orphan.is_none();
            let full = match orphan {
                Some((key, mod_revision)) if scope.deletes(&key, mod_revision) => {
                    chunker.push(Op::Delete { key })
                }
                Some(_) => None,
                None => chunker.take(),
            };
            if let Some(batch) = full {
                let next = self.writer().record().sweep_progress(r0);
                deleted += batch.len() as u64;
                self.commit_independent(&batch, next).await?;
            }
            if done && chunker.is_empty() {
                break;
            }
        }
        info!(deleted, "prune sweep done");
        Ok(())
    }

    /// Whether a prune deletes every orphan of the destination range (`overwrite_and_prune`), or
    /// only those this link wrote (see [`Link::sweep`]).
    pub(super) fn prunes_everything(&self) -> bool {
        self.cfg().initial_sync.mode == mirror_core::InitialSyncMode::OverwriteAndPrune
    }

    /// The orphans a repair may delete, one rule for the prune sweep and the settle pass (the
    /// settle pass once deleted every orphan while a prune was owed, in `overwrite` mode too,
    /// which took keys from before the link). With `prune` owed in `overwrite_and_prune` mode:
    /// every orphan, after refusing a nested link. Otherwise: orphans this link wrote, never a
    /// nested link's (see [`Link::sweep`]).
    pub(super) async fn orphan_scope(&mut self, prune: bool) -> Result<OrphanScope, EngineError> {
        if prune && self.prunes_everything() {
            self.refuse_foreign_links().await?;
            return Ok(OrphanScope { everything: true, ours_after: 0, theirs: Vec::new() });
        }
        let theirs = mirror_reconcile::foreign_dest_prefixes(
            self.target_kv.clone(),
            &self.engine.rewriter,
            self.page_options("foreign link check").keys_only(),
        )
        .await?;
        Ok(OrphanScope { everything: false, ours_after: self.writer().create_revision(), theirs })
    }

    /// Refuses to prune or delete orphans while another link's reserved namespace lies inside
    /// the destination range (a nested `dest_prefix`): its keys are not ours to judge.
    pub(super) async fn refuse_foreign_links(&mut self) -> Result<(), EngineError> {
        let page = self.page_options("foreign link check").keys_only();
        let found =
            mirror_reconcile::find_foreign_link(self.target_kv.clone(), &self.engine.rewriter, page).await?;
        let Some(other) = found else { return Ok(()) };
        // A namespace is configuration (a prefix and a link's name), not data: shown as is.
        let at = String::from_utf8_lossy(&other.namespace).escape_debug().to_string();
        let namespace = mirror_core::KeyRange::prefix(&other.namespace);
        let clear = mirror_core::delete_commands(&self.cfg().target.endpoints, &[namespace]).concat();
        Err(Refusal::NestedLink { other: other.link_uid, at, clear }.into())
    }

    /// A comparison of the source pinned at the watermark with the target as it is: while the
    /// tail is not writing, that is the state G3 says must be equal.
    pub(super) fn differ_at_watermark(&mut self) -> mirror_reconcile::Differ {
        let watermark = self.applier.as_ref().expect("fence claimed").record().watermark;
        let page = self.page_options("reconcile page").at_revision(watermark);
        mirror_reconcile::Differ::new(
            self.engine.rewriter.clone(),
            self.source.kv_client(),
            self.target_kv.clone(),
            page,
        )
        .progress(self.engine.compared.clone())
    }

    /// Counts and compares both sides with the source pinned at the watermark; no writes.
    pub(super) async fn compare_at_watermark(&mut self) -> Result<mirror_reconcile::Counts, EngineError> {
        let mut differ = self.differ_at_watermark();
        while differ.next_difference().await?.is_some() {}
        Ok(differ.counts)
    }

    /// One diff-and-repair pass (SPEC §5): the source pinned at the watermark against the target,
    /// merged page by page. Missing and divergent keys are repaired, orphans deleted when
    /// `delete_orphans`; every repair is a fenced Txn that also re-writes the checkpoint (same
    /// watermark), paced by `max_ops_per_second`. Counts, pass time and drift are published in
    /// one status update. A fence bump surfaces as a `FenceError` from the first repair after it
    /// and aborts the pass with nothing more written.
    pub(super) async fn reconcile_pass(&mut self, delete_orphans: bool) -> Result<(), EngineError> {
        let started = Instant::now();
        if delete_orphans {
            self.refuse_foreign_links().await?;
        }
        let watermark = self.writer().record().watermark;
        let sync = self.cfg().sync.clone();
        // Where leases are preserved, a key under another target lease (or none) is repaired
        // too. Only here: a drain verification would fail a cutover on a lease that expired
        // while it ran (its key written without it), which a later event repairs anyway.
        let preserve = sync.leases == mirror_core::LeaseMode::Preserve;
        let differ = self.differ_at_watermark().with_leases(preserve);
        let mut repairs = Repairs::new(differ, self.chunker(), |_: &[u8], _| delete_orphans);
        let mut repaired = 0u64;
        loop {
            self.engine.stop_if_shutting_down()?;
            // On a consistent range one `next_chunk` reads the whole of it (seconds to minutes
            // for millions of keys): the lease keeper's task keeps the leases alive meanwhile.
            let next = repairs.next_chunk().await;
            let chunk = match next {
                Ok(chunk) => chunk,
                Err(e) if e.side == Side::Source && e.fault == Fault::FutureRevision => {
                    // The watermark is ahead of the source: it went back (SPEC §6), not compacted.
                    let source_revision = self.source_revision().await?;
                    return Err(Refusal::SourceWentBack { watermark, source_revision }.into());
                }
                Err(e) if e.class() == ErrorClass::Resync => {
                    // The watermark was compacted in the source: nothing to compare against
                    // until the watermark moves; the data is not in doubt.
                    warn!("reconcile pass skipped: the source compacted past the watermark");
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            };
            let Some(batch) = chunk else { break };
            self.commit_keep(&batch).await?;
            repaired += batch.len() as u64;
            // commit_with_retry paced the repair; a long paced pass must not let the source's
            // events pile up in this process. Only the drain's repair pass still holds the open
            // watch here: a periodic pass reads it into the bounded forwarder buffer instead
            // (`reconcile_buffered`), which lets it go when full.
            if paced_repair_drops_watch(repaired, sync.max_ops_per_second) && self.watch.take().is_some() {
                info!("long paced repair: source watch cancelled; will re-watch from the watermark");
            }
        }
        let c = repairs.counts();
        let drift = !c.equal();
        let held = !drift && c.source_keys == c.target_keys;
        if drift {
            warn!(
                missing = c.missing,
                divergent = c.divergent,
                orphan = c.orphan,
                repaired,
                "reconcile pass found drift"
            );
        }
        self.note_excluded_in_target().await?;
        self.engine.update(|s| {
            s.source_keys = Some(c.source_keys);
            s.target_keys = Some(c.target_keys);
            s.lease_backed_keys = c.leased_keys;
            s.last_reconcile = Some(mirror_core::LastReconcile {
                time: Some(now_rfc3339()),
                missing: c.missing,
                divergent: c.divergent,
                orphan: c.orphan,
                repaired,
                keys_compared: c.source_keys,
                duration_seconds: started.elapsed().as_secs_f64(),
            });
            s.set_condition(
                ConditionType::DriftDetected,
                drift,
                if drift { Reason::Drift } else { Reason::NoDrift },
                format!(
                    "missing {}, divergent {}, orphan {}, repaired {repaired}",
                    c.missing, c.divergent, c.orphan
                ),
            );
            s.set_condition(
                ConditionType::InvariantsHeld,
                held,
                if held { Reason::CountsEqual } else { Reason::CountsDiffer },
                format!(
                    "source {} keys, target {} keys at watermark {watermark}",
                    c.source_keys, c.target_keys
                ),
            );
        });
        Ok(())
    }
}

/// Which target orphans (keys the source does not have) a repair deletes: see
/// [`Link::orphan_scope`].
#[derive(Debug)]
pub(super) struct OrphanScope {
    /// Every orphan (`overwrite_and_prune` with a prune owed; no nested link was found).
    everything: bool,
    /// Otherwise only keys written after this target revision (the checkpoint's creation)...
    ours_after: i64,
    /// ... and not under another link's destination prefix.
    theirs: Vec<Vec<u8>>,
}

impl OrphanScope {
    /// Whether the orphan `key`, last written at target `mod_revision`, is deleted.
    pub(super) fn deletes(&self, key: &[u8], mod_revision: i64) -> bool {
        self.everything || (mod_revision > self.ours_after && !self.theirs.iter().any(|p| key.starts_with(p)))
    }
}

#[cfg(test)]
mod tests {
    use super::OrphanScope;

    /// Outside a full prune only this link's writes go, and never a nested link's keys, however
    /// recent; a full prune takes every orphan.
    #[test]
    fn orphan_scope_deletes_only_what_the_mode_allows() {
        let ours =
            OrphanScope { everything: false, ours_after: 100, theirs: vec![b"/copy/nested/".to_vec()] };
        assert!(!ours.deletes(b"/copy/before-the-link", 40), "a key from before the link stays");
        assert!(!ours.deletes(b"/copy/x", 100), "the checkpoint's own revision is not after it");
        assert!(ours.deletes(b"/copy/x", 101));
        assert!(!ours.deletes(b"/copy/nested/k", 500), "a nested link's key is never ours");
        let all = OrphanScope { everything: true, ours_after: 0, theirs: Vec::new() };
        assert!(all.deletes(b"/copy/before-the-link", 40));
    }
}
