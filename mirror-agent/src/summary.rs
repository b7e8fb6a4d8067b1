//! `mirror-agent status`: the agent's `/statusz` as an operator reads it at a terminal.
//!
//! One screen: what the agent is doing (phase, role, epoch), how far the target trails the
//! source, the initial sync's progress, the last reconcile and error, the HA leader, and only
//! the conditions that are *not* in their healthy state. Colour only when asked (on a
//! terminal); `--json` keeps the raw document for scripts.

use std::fmt::Write as _;

use mirror_core::{Phase, Reason, Status};

/// ANSI styles, or nothing.
struct Paint(bool);

impl Paint {
    fn wrap(&self, code: &str, text: &str) -> String {
        if self.0 {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }
    fn good(&self, text: &str) -> String {
        self.wrap("32", text)
    }
    fn warn(&self, text: &str) -> String {
        self.wrap("33", text)
    }
    fn bad(&self, text: &str) -> String {
        self.wrap("31;1", text)
    }
    fn bold(&self, text: &str) -> String {
        self.wrap("1", text)
    }
}

/// `n` with thousands separators.
fn grouped(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// The summary of `s`; `colour` adds ANSI styles.
pub fn render(s: &Status, colour: bool) -> String {
    let p = Paint(colour);
    let mut out = String::new();
    let phase = match s.phase {
        Phase::Syncing | Phase::Drained => p.good(s.phase.as_str()),
        Phase::Failed => p.bad(s.phase.as_str()),
        _ => p.warn(s.phase.as_str()),
    };
    let _ = writeln!(
        out,
        "{} {}  phase {phase}  role {}  epoch {}  agent {}",
        p.bold("link"),
        s.link_uid,
        s.role,
        s.epoch,
        s.agent_id
    );
    let side = |name: &str, v: &mirror_core::SideStatus| {
        let version = if v.version.is_empty() { "unknown version" } else { v.version.as_str() };
        let mut line = format!("{name:<7}etcd {version}");
        if !v.cluster_id.is_empty() {
            let _ = write!(line, ", cluster {}", v.cluster_id);
        }
        if !v.unreachable_endpoints.is_empty() {
            let _ =
                write!(line, ", {}", p.warn(&format!("unreachable: {}", v.unreachable_endpoints.join(", "))));
        }
        line
    };
    let _ = writeln!(out, "{}", side("source", &s.source));
    let _ = writeln!(out, "{}", side("target", &s.target));
    let lag = if s.lag_revisions == 0 {
        p.good("caught up")
    } else {
        let text = format!("{} revisions, {:.1} s behind", grouped(s.lag_revisions), s.lag_seconds);
        if s.lag_seconds > 60.0 {
            p.warn(&text)
        } else {
            text
        }
    };
    let _ = writeln!(
        out,
        "progress watermark {} of source revision {} ({lag}); {} keys applied",
        grouped(s.watermark),
        grouped(s.source_revision),
        grouped(s.keys_applied_total as i64)
    );
    let sync = &s.initial_sync;
    let initial = match (&sync.completed, sync.total_keys) {
        (Some(at), _) => format!("complete ({at})"),
        (None, 0) if sync.started.is_none() => "not started".to_owned(),
        (None, total) => {
            let pct = if total == 0 { 100.0 } else { sync.keys as f64 * 100.0 / total as f64 };
            format!("{} / {} keys ({pct:.0}%)", grouped(sync.keys as i64), grouped(total as i64))
        }
    };
    let _ = writeln!(out, "initial sync {initial}");
    if let Some(at) = &s.confirmed_time {
        // What a failover now would lose at most: the source's writes since then.
        let _ =
            writeln!(out, "confirmed   source at the watermark {:.0} s ago ({at})", s.confirmed_age_seconds);
    }
    let reconcile = match &s.last_reconcile {
        None => "none yet".to_owned(),
        Some(r) => format!(
            "{}: {} missing, {} divergent, {} orphans, {} repaired ({} keys in {:.1} s)",
            r.time.as_deref().unwrap_or("?"),
            r.missing,
            r.divergent,
            r.orphan,
            r.repaired,
            grouped(r.keys_compared as i64),
            r.duration_seconds
        ),
    };
    let _ = writeln!(out, "last reconcile {reconcile}");
    if s.forced_resyncs.count > 0 {
        let _ = writeln!(
            out,
            "forced resyncs {} (last: {})",
            s.forced_resyncs.count,
            s.forced_resyncs.last_reason.map_or("?", Reason::as_str)
        );
    }
    match &s.last_error {
        None => {}
        Some(e) => {
            let _ =
                writeln!(out, "last error {}", p.bad(&format!("{} {}: {}", e.class, e.reason, e.message)));
        }
    }
    if let Some(e) = &s.exact {
        let _ = writeln!(
            out,
            "exact       target revision {} = source revision landed; {} landed here, {} by another replica",
            grouped(e.target_revision),
            grouped(e.landed_here as i64),
            grouped(e.landed_elsewhere as i64)
        );
        let leases = match e.shortest_snapshot_lease_ttl_seconds {
            Some(ttl) => p.warn(&format!(
                "{} snapshot leases left, shortest TTL {ttl} s: an outage of every agent longer loses the replica",
                e.snapshot_leases
            )),
            None => "no snapshot lease left".to_owned(),
        };
        let _ = writeln!(
            out,
            "            {leases}; spool {} bytes; target compacted at {}",
            e.spool_bytes, e.compacted_revision
        );
    }
    if let Some(ha) = &s.ha {
        let leader = match (&ha.leader_agent_id, ha.leader) {
            (_, true) => p.good("this agent"),
            (Some(id), false) => id.clone(),
            (None, false) => p.warn("none"),
        };
        let _ = writeln!(out, "ha leader {leader}, term {}, lease {:x}", ha.term, ha.lease_id);
    }
    let unhealthy: Vec<String> = s
        .conditions
        .iter()
        .filter(|c| c.type_.healthy_when().is_some_and(|healthy| c.status != healthy))
        .map(|c| {
            let detail = if c.message.is_empty() {
                c.reason.to_string()
            } else {
                format!("{}: {}", c.reason, c.message)
            };
            format!("  {}={} ({detail})", c.type_, c.status_name())
        })
        .collect();
    if unhealthy.is_empty() {
        let _ = writeln!(out, "conditions {}", p.good("all healthy"));
    } else {
        let _ = writeln!(out, "conditions not healthy:");
        for line in unhealthy {
            let _ = writeln!(out, "{}", p.warn(&line));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use mirror_core::{
        AgentRole, ConditionType, HaStatus, InitialSyncStatus, LastError, LastReconcile, SideStatus,
    };

    fn base(phase: Phase) -> Status {
        let mut s = Status {
            phase,
            link_uid: "orders-dr".into(),
            epoch: 3,
            role: AgentRole::Mirror,
            agent_id: "mirror-0/1".into(),
            source: SideStatus {
                version: "3.5.1".into(),
                cluster_id: "1333158611033757246".into(),
                ..Default::default()
            },
            target: SideStatus {
                version: "3.5.1".into(),
                cluster_id: "14946375542958973280".into(),
                ..Default::default()
            },
            watermark: 1_204_511,
            source_revision: 1_204_511,
            keys_applied_total: 2_500_000,
            initial_sync: InitialSyncStatus {
                keys: 1_000_000,
                total_keys: 1_000_000,
                started: Some("2026-11-30T08:00:00Z".into()),
                completed: Some("2026-11-30T08:00:21Z".into()),
            },
            last_reconcile: Some(LastReconcile {
                time: Some("2026-11-30T09:00:00Z".into()),
                keys_compared: 1_000_000,
                duration_seconds: 12.5,
                ..Default::default()
            }),
            ..Default::default()
        };
        for c in [ConditionType::Available, ConditionType::SourceReachable, ConditionType::TargetReachable] {
            s.set_condition(c, true, Reason::Probe, "");
        }
        s.set_condition(ConditionType::InitialSyncComplete, true, Reason::Complete, "");
        s.set_condition(ConditionType::Fenced, false, Reason::HoldingFence, "");
        s
    }

    /// A healthy, caught-up agent: one screen, no conditions listed.
    #[test]
    fn healthy() {
        insta::assert_snapshot!(render(&base(Phase::Syncing), false));
    }

    /// An exact replica: the target's revision is the source's, who landed the revisions, and
    /// the snapshot lease whose TTL bounds an outage, flagged.
    #[test]
    fn exact() {
        let mut s = base(Phase::Syncing);
        s.exact = Some(mirror_core::ExactStatus {
            target_revision: 1_234_567,
            snapshot_leases: 2,
            shortest_snapshot_lease_ttl_seconds: Some(15),
            spool_bytes: 4096,
            landed_here: 900,
            landed_elsewhere: 12,
            compacted_revision: 1_200_000,
            resent: 3,
        });
        insta::assert_snapshot!(render(&s, false));
    }

    /// An HA standby: who leads, and the Fenced condition with its reason.
    #[test]
    fn standby() {
        let mut s = base(Phase::Standby);
        s.role = AgentRole::Standby;
        s.set_condition(
            ConditionType::Fenced,
            true,
            Reason::AwaitingElection,
            "another agent of this link leads",
        );
        s.ha = Some(HaStatus {
            leader: false,
            leader_agent_id: Some("mirror-1/1".into()),
            lease_id: 0x694d,
            term: 0,
        });
        insta::assert_snapshot!(render(&s, false));
    }

    /// A failed agent: the last error and the condition that says why.
    #[test]
    fn failed() {
        let mut s = base(Phase::Failed);
        s.initial_sync = InitialSyncStatus::default();
        s.set_condition(ConditionType::InitialSyncComplete, false, Reason::Connecting, "");
        s.set_condition(
            ConditionType::EmptyTargetViolation,
            true,
            Reason::EmptyTargetViolation,
            "5 keys in the target",
        );
        s.last_error = Some(LastError {
            class: mirror_core::ErrorClass::Permanent,
            reason: Reason::EmptyTargetViolation,
            message: "initial_sync.mode = require_empty but the target range holds 5 keys".into(),
            fix: None,
        });
        insta::assert_snapshot!(render(&s, false));
    }

    /// A degraded agent mid-scan and behind: progress, lag and the failing conditions.
    #[test]
    fn degraded() {
        let mut s = base(Phase::Degraded);
        s.initial_sync.completed = None;
        s.initial_sync.keys = 250_000;
        s.watermark = 1_100_000;
        s.lag_revisions = 104_511;
        s.lag_seconds = 95.0;
        s.target.unreachable_endpoints = vec!["https://etcd-b-2.etcd-b:2379".into()];
        s.set_condition(ConditionType::InitialSyncComplete, false, Reason::Scanning, "");
        s.set_condition(
            ConditionType::TargetQuotaExhausted,
            true,
            Reason::NoSpace,
            "database space exceeded",
        );
        s.set_condition(ConditionType::MemberUnreachable, true, Reason::ProbeFailed, "1 of 3 target members");
        insta::assert_snapshot!(render(&s, false));
    }

    /// Colour is added only when asked.
    #[test]
    fn colour_only_when_asked() {
        let s = base(Phase::Failed);
        assert!(!render(&s, false).contains('\x1b'));
        assert!(render(&s, true).contains("\x1b[31;1mfailed\x1b[0m"));
        assert_eq!(grouped(1_204_511), "1 204 511");
        assert_eq!(grouped(-1_000), "-1 000");
    }
}
