//! The members of both sides, as status names them (`MemberUnreachable`,
//! `unreachable_endpoints`): set from the probe each connect makes, and kept current by
//! [`watch_members`] while a tail runs, compact or exact, so a member that went down or came
//! back shows without a reconnect. A run's clients keep the members that served when it
//! started: a member down since fails that run's calls to it, and one back is used from the
//! next run on.

use std::time::Duration;

use mirror_core::{probe_members, ConditionType, Config, Probe, Reason, Side, Status};
use tokio_util::task::AbortOnDropHandle;

use crate::reporter::Reporter;

/// How often a tail probes every member of both sides in the background.
pub(crate) const MEMBER_CHECK_INTERVAL: Duration = Duration::from_secs(10);
/// How often it probes while a member does not answer (or a side cannot be probed), so
/// `MemberUnreachable` clears within a few seconds of the member answering again.
pub(crate) const MEMBER_RECHECK_INTERVAL: Duration = Duration::from_secs(2);

/// Lists the endpoints that did not answer and sets `MemberUnreachable` accordingly.
pub(crate) fn members_reachable(s: &mut Status, source: &Probe, target: &Probe) {
    let down: Vec<String> = [(Side::Source, source), (Side::Target, target)]
        .iter()
        .flat_map(|(side, probe)| {
            probe.unreachable.iter().map(move |(url, why)| format!("{side} {url}: {why}"))
        })
        .collect();
    s.source.unreachable_endpoints = source.unreachable.iter().map(|(url, _)| url.clone()).collect();
    s.target.unreachable_endpoints = target.unreachable.iter().map(|(url, _)| url.clone()).collect();
    if down.is_empty() {
        s.set_condition(ConditionType::MemberUnreachable, false, Reason::AllMembersAnswer, "");
    } else {
        s.set_condition(ConditionType::MemberUnreachable, true, Reason::ProbeFailed, down.join("; "));
    }
}

/// Probes every member of both sides (at once) every [`MEMBER_CHECK_INTERVAL`], every
/// [`MEMBER_RECHECK_INTERVAL`] while one does not answer or a side cannot be probed, and says
/// so in status, on a task that ends when the handle is dropped. The connect probed them as
/// the run started, so the first probe is a recheck's wait away.
pub(crate) fn watch_members(cfg: Config, reporter: Reporter) -> AbortOnDropHandle<()> {
    AbortOnDropHandle::new(tokio::spawn(async move {
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
