//! The checkpoint's transitions: each record the engine commits is one of these, built from the
//! record it replaces, so a phase cannot set one field of a step and forget another.
//!
//! ```text
//! claim ──> scanning at R0 ──(scan chunk: cursor)──> … ──(sweep: prune owed)──> …
//!    │            └──(replay reaches scan_end)──> genesis_complete ──> applied_to(W) …
//!    └──(stored record, resumed by this agent)──> applied_to(W) … ──> promoted (cutover)
//! ```

use crate::Checkpoint;
use crate::Role;

impl Checkpoint {
    /// This agent carries a stored record on: its epoch, id and range, the rest as stored.
    pub fn resumed_by(&self, epoch: u64, agent_id: &str, range: &str) -> Checkpoint {
        Checkpoint { epoch, agent_id: agent_id.to_owned(), range: range.to_owned(), ..self.clone() }
    }

    /// An initial sync from `r0` has written every key up to `cursor` (empty: none yet);
    /// `prune` says whether a sweep is owed at its end.
    pub fn scan_progress(&self, r0: i64, cursor: Vec<u8>, prune: bool) -> Checkpoint {
        Checkpoint {
            watermark: r0,
            scanning: true,
            scan_cursor: cursor,
            prune_pending: prune,
            ..self.clone()
        }
    }

    /// A prune sweep after the scan from `r0` is under way: still scanning, the sweep still owed
    /// until the replay ends, the cursor as the scan left it.
    pub fn sweep_progress(&self, r0: i64) -> Checkpoint {
        Checkpoint { watermark: r0, scanning: true, prune_pending: true, ..self.clone() }
    }

    /// The target reflects the source at `revision`. During an initial sync that ends at
    /// `scan_end`, reaching it ends the scan as well ([`Checkpoint::genesis_complete`]).
    pub fn applied_to(&self, revision: i64, scan_end: Option<i64>) -> Checkpoint {
        let next = Checkpoint { watermark: revision, ..self.clone() };
        match scan_end {
            Some(end) if revision >= end => next.genesis_complete(),
            Some(_) => Checkpoint { scanning: true, ..next },
            None => next,
        }
    }

    /// The initial sync is over: the target equals the source at the watermark, no cursor,
    /// no prune owed.
    pub fn genesis_complete(&self) -> Checkpoint {
        Checkpoint { scanning: false, scan_cursor: Vec::new(), prune_pending: false, ..self.clone() }
    }

    /// The source was confirmed at or below the watermark at `time` (RFC 3339).
    pub fn confirmed_at(&self, time: String) -> Checkpoint {
        Checkpoint { confirmed_time: time, ..self.clone() }
    }

    /// Failed over by `agent_id` without the source: primary, under `epoch` (the stored one + 1,
    /// so every writer of the link is fenced), watermark and confirmation as they stood.
    pub fn failed_over(&self, epoch: u64, agent_id: &str) -> Checkpoint {
        Checkpoint { role: Role::Primary, epoch, agent_id: agent_id.to_owned(), ..self.clone() }
    }

    /// Cut over: the target is the primary now, at the drained watermark.
    pub fn promoted(&self) -> Checkpoint {
        Checkpoint { role: Role::Primary, ..self.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claimed(r0: i64) -> Checkpoint {
        Checkpoint { range: "r".into(), ..crate::checkpoint::test_record("l", 1, Role::Mirror) }
            .scan_progress(r0, Vec::new(), true)
    }

    /// A whole initial sync: scan chunks move the cursor, the sweep keeps it, the replay ends
    /// the scan exactly when it reaches scan_end, and the tail only moves the watermark.
    #[test]
    fn an_initial_sync_from_claim_to_tail() {
        let r0 = claimed(10);
        assert!(r0.scanning && r0.prune_pending && r0.scan_cursor.is_empty() && r0.watermark == 10);
        let scanned = r0.scan_progress(10, b"/a/k".to_vec(), true);
        assert_eq!(scanned.scan_cursor, b"/a/k");
        let swept = scanned.sweep_progress(10);
        assert_eq!((swept.scan_cursor.as_slice(), swept.prune_pending), (b"/a/k".as_slice(), true));
        let replaying = swept.applied_to(15, Some(20));
        assert!(replaying.scanning && replaying.prune_pending && replaying.watermark == 15);
        let done = replaying.applied_to(20, Some(20));
        assert!(!done.scanning && !done.prune_pending && done.scan_cursor.is_empty());
        assert_eq!(done.watermark, 20);
        let tail = done.applied_to(25, None);
        assert_eq!(tail, Checkpoint { watermark: 25, ..done.clone() });
    }

    /// A resumed record keeps its progress and takes this agent's identity; promotion changes
    /// the role only.
    #[test]
    fn resume_and_promotion_change_only_their_fields() {
        let stored = claimed(10).scan_progress(10, b"/a/k".to_vec(), false);
        let resumed = stored.resumed_by(4, "b", "r2");
        assert_eq!(resumed, Checkpoint { epoch: 4, agent_id: "b".into(), range: "r2".into(), ..stored });
        let promoted = resumed.genesis_complete().promoted();
        assert_eq!(promoted.role, Role::Primary);
        assert_eq!(promoted.watermark, 10);
    }
}
