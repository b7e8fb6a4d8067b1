//! The start planner: from what the checkpoint says and what this run knows, what to do first.
//! Pure (no I/O), so every branch is unit-tested; `start.rs` carries the plan out.

use mirror_core::{InitialSyncMode, Reason};
use mirror_fence::Checkpoint;

use super::Pending;

/// What the planner looks at.
#[derive(Clone, Debug)]
pub struct StartFacts<'a> {
    /// The stored checkpoint, if any (already judged claimable).
    pub stored: Option<&'a Checkpoint>,
    /// What the run loop asks for (resume, or a fresh genesis after a resync).
    pub pending: Pending,
    /// Cluster ids connected now.
    pub source_cluster: u64,
    /// Cluster ids connected now.
    pub target_cluster: u64,
    /// This config's range fingerprint.
    pub range: &'a str,
    /// `initial_sync.mode`.
    pub mode: InitialSyncMode,
    /// `initial_sync.start_revision`.
    pub start_revision: i64,
}

/// What to do first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartPlan {
    /// Tail from `watermark + 1`.
    Tail {
        /// The stored watermark.
        watermark: i64,
    },
    /// Resume the scan in progress after its cursor.
    ResumeScan,
    /// Tail from `initial_sync.start_revision`, no scan (first start only).
    TailFromStartRevision {
        /// The revision to watch from.
        start: i64,
    },
    /// A new genesis from a fresh R0.
    FreshGenesis {
        /// Check the destination range is empty first (first start, or the target was
        /// replaced, with `require_empty`).
        require_empty: bool,
        /// A prune is owed at the end.
        prune: bool,
        /// Why, when it is a forced resync the operator should see (`RangeChanged`).
        forced: Option<Reason>,
    },
}

/// Decides the first step. The rules, in order:
/// 1. Stored cluster ids that differ from the connected ones mean a rebuilt or restored cluster:
///    a forced resync (`ClusterChanged`, SPEC §6) with `require_empty` re-armed where the mode
///    asks for it, and, like every forced resync, a prune: keys the new source does not hold
///    must not survive in the target while `InitialSyncComplete` is claimed, whatever the mode
///    (issue #20, defect 1: `overwrite` used to keep them).
/// 2. A pending fresh genesis (after a resync): genesis with prune.
/// 3. A stored range fingerprint that differs from ours: a forced resync with prune
///    (`RangeChanged`); records without one are taken as unchanged.
/// 4. Otherwise resume: tail, or resume the scan in progress.
/// 5. No checkpoint at all: `start_revision` tails from it; else a first genesis.
pub fn plan_start(f: &StartFacts<'_>) -> StartPlan {
    let first = |mode: InitialSyncMode| StartPlan::FreshGenesis {
        require_empty: mode == InitialSyncMode::RequireEmpty,
        prune: mode == InitialSyncMode::OverwriteAndPrune,
        forced: None,
    };
    let Some(stored) = f.stored else {
        if f.pending == Pending::Resume && f.start_revision > 0 {
            return StartPlan::TailFromStartRevision { start: f.start_revision };
        }
        return first(f.mode);
    };
    if stored.source_cluster_id != f.source_cluster || stored.target_cluster_id != f.target_cluster {
        return StartPlan::FreshGenesis {
            require_empty: f.mode == InitialSyncMode::RequireEmpty,
            prune: true,
            forced: Some(Reason::ClusterChanged),
        };
    }
    if f.pending == Pending::FreshGenesis {
        return StartPlan::FreshGenesis { require_empty: false, prune: true, forced: None };
    }
    if !stored.range.is_empty() && stored.range != f.range {
        return StartPlan::FreshGenesis {
            require_empty: false,
            prune: true,
            forced: Some(Reason::RangeChanged),
        };
    }
    if stored.scanning {
        StartPlan::ResumeScan
    } else {
        StartPlan::Tail { watermark: stored.watermark }
    }
}

#[cfg(test)]
mod tests {
    use mirror_core::{InitialSyncMode, Reason};
    use mirror_fence::{Checkpoint, Role};

    use super::super::Pending;
    use super::{plan_start, StartFacts, StartPlan};

    fn stored(scanning: bool, range: &str) -> Checkpoint {
        Checkpoint {
            link_uid: "l".into(),
            epoch: 1,
            role: Role::Mirror,
            watermark: 42,
            scanning,
            scan_cursor: if scanning { b"/a/k".to_vec() } else { Vec::new() },
            prune_pending: false,
            source_cluster_id: 1,
            target_cluster_id: 2,
            agent_id: "a".into(),
            commit: String::new(),
            range: range.into(),
            confirmed_time: String::new(),
            forced_resyncs: 0,
            scan_restarts: 0,
            initial_sync_completed: String::new(),
            excludes: Vec::new(),
            source_seen: 0,
        }
    }

    fn facts(stored: Option<&Checkpoint>, pending: Pending) -> StartFacts<'_> {
        StartFacts {
            stored,
            pending,
            source_cluster: 1,
            target_cluster: 2,
            range: "r1",
            mode: InitialSyncMode::RequireEmpty,
            start_revision: 0,
        }
    }

    /// A stored, finished record resumes the tail at its watermark; one mid-scan resumes the scan.
    #[test]
    fn resume_follows_the_record() {
        let tail = stored(false, "r1");
        assert_eq!(plan_start(&facts(Some(&tail), Pending::Resume)), StartPlan::Tail { watermark: 42 });
        let scanning = stored(true, "r1");
        assert_eq!(plan_start(&facts(Some(&scanning), Pending::Resume)), StartPlan::ResumeScan);
    }

    /// The first start follows the mode; `start_revision` tails with no scan, but only then.
    #[test]
    fn first_start_follows_the_mode() {
        assert_eq!(
            plan_start(&facts(None, Pending::Resume)),
            StartPlan::FreshGenesis { require_empty: true, prune: false, forced: None }
        );
        let mut f = facts(None, Pending::Resume);
        f.mode = InitialSyncMode::OverwriteAndPrune;
        assert_eq!(
            plan_start(&f),
            StartPlan::FreshGenesis { require_empty: false, prune: true, forced: None }
        );
        f.mode = InitialSyncMode::Overwrite;
        f.start_revision = 100;
        assert_eq!(plan_start(&f), StartPlan::TailFromStartRevision { start: 100 });
        let record = stored(false, "r1");
        let mut later = facts(Some(&record), Pending::FreshGenesis);
        later.start_revision = 100;
        assert_eq!(
            plan_start(&later),
            StartPlan::FreshGenesis { require_empty: false, prune: true, forced: None },
            "a resync never reuses start_revision (it may be compacted by now)"
        );
    }

    /// Other cluster ids force a resync with prune in every mode, `require_empty` re-armed where
    /// configured; another range forces a resync with prune; a record without a range is taken
    /// as unchanged.
    #[test]
    fn changed_clusters_and_ranges() {
        let mut moved = stored(false, "r1");
        moved.target_cluster_id = 9;
        assert_eq!(
            plan_start(&facts(Some(&moved), Pending::Resume)),
            StartPlan::FreshGenesis {
                require_empty: true,
                prune: true,
                forced: Some(Reason::ClusterChanged)
            }
        );
        let mut restored = stored(false, "r1");
        restored.source_cluster_id = 7;
        let mut overwrite = facts(Some(&restored), Pending::Resume);
        overwrite.mode = InitialSyncMode::Overwrite;
        assert_eq!(
            plan_start(&overwrite),
            StartPlan::FreshGenesis {
                require_empty: false,
                prune: true,
                forced: Some(Reason::ClusterChanged)
            },
            "a rebuilt source prunes in overwrite mode too"
        );
        let other_range = stored(false, "r0");
        assert_eq!(
            plan_start(&facts(Some(&other_range), Pending::Resume)),
            StartPlan::FreshGenesis { require_empty: false, prune: true, forced: Some(Reason::RangeChanged) }
        );
        let old_record = stored(false, "");
        assert_eq!(plan_start(&facts(Some(&old_record), Pending::Resume)), StartPlan::Tail { watermark: 42 });
    }
}
