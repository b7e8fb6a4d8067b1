//! The members of both sides, probed in the background while the tail runs, as compact mode's
//! tail does: status names those that do not answer (`MemberUnreachable`, `unreachable_endpoints`)
//! and clears them once they answer again. The run's clients keep the members that served when
//! it started: a member down since ends the run at its first failed Txn (`Tail::verdict`), and
//! one back is used from the next run on.

use mirror_core::{probe_members, Config, Side};

use super::compaction::AbortOnDrop;
use crate::engine::{members_reachable, MEMBER_CHECK_INTERVAL, MEMBER_RECHECK_INTERVAL};
use crate::reporter::Reporter;

/// Probes every member of both sides every [`MEMBER_CHECK_INTERVAL`] (every
/// [`MEMBER_RECHECK_INTERVAL`] while one does not answer, or a side cannot be probed) and says
/// so in status, on a task that ends when the handle is dropped. The run probed them as it
/// started, so the first probe is a recheck's wait away.
pub(super) fn watch_members(cfg: Config, reporter: Reporter) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(async move {
        let mut every = MEMBER_RECHECK_INTERVAL;
        loop {
            tokio::time::sleep(every).await;
            let (source, target) = futures::join!(
                probe_members(Side::Source, &cfg.source, &cfg.sync),
                probe_members(Side::Target, &cfg.target, &cfg.sync)
            );
            every = match (source, target) {
                (Ok(source), Ok(target)) => {
                    reporter.update(|s| members_reachable(s, &source, &target));
                    let down = !source.unreachable.is_empty() || !target.unreachable.is_empty();
                    if down {
                        MEMBER_RECHECK_INTERVAL
                    } else {
                        MEMBER_CHECK_INTERVAL
                    }
                }
                // A side that cannot be probed at all fails the run's own calls, which say why.
                _ => MEMBER_RECHECK_INTERVAL,
            };
        }
    }))
}
