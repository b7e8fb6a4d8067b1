//! The staleness rule: from the watermark, the source revision and when progress was last
//! made, whether the link still counts as available (SPEC §7 `ReplicationLagExceeded`,
//! `Available`, and `InvariantsHeld` going stale). The agent's own policy, so it lives beside
//! its reporter, not in the status vocabulary every crate shares.

use std::time::{Duration, SystemTime};

use mirror_core::{ConditionType, Phase, Reason, Status};

/// Recomputes `s`'s lag figures and the staleness rule at `now` (see [`Freshness`]). Called
/// by the engine on every status change and by a once-a-second watchdog that does not
/// depend on the engine's loop, so a wedged loop cannot keep looking healthy.
pub fn refresh(s: &mut Status, now: SystemTime, rule: &Freshness) {
    let since = |at: Option<SystemTime>| at.and_then(|t| now.duration_since(t).ok()).unwrap_or_default();
    s.lag_revisions = (s.source_revision - s.watermark).max(0);
    if s.lag_revisions == 0 {
        s.behind_since = None;
    } else if s.behind_since.is_none() {
        s.behind_since = Some(now);
    }
    let lag = since(s.behind_since);
    let quiet = since(s.progress_at);
    s.lag_seconds = lag.as_secs_f64();
    s.seconds_since_progress = quiet.as_secs_f64();
    let confirmed = s.confirmed_time.as_deref().and_then(|t| humantime::parse_rfc3339_weak(t).ok());
    s.confirmed_age_seconds = since(confirmed).as_secs_f64();
    // A paused link trails by design: its lag is reported, never judged.
    let paused = s.phase == Phase::Paused;
    let exceeded = !paused && s.lag_revisions > 0 && (lag > rule.max_lag || quiet > rule.max_lag);
    let was = s.condition(ConditionType::ReplicationLagExceeded);
    // A paused link says so here too: the lag is not judged (not "no lag").
    if exceeded || was || paused {
        let message = format!(
            "watermark {} trails the source revision {} for {:.0}s; last progress {:.0}s ago (sync.max_lag {}s)",
            s.watermark,
            s.source_revision,
            lag.as_secs_f64(),
            quiet.as_secs_f64(),
            rule.max_lag.as_secs()
        );
        let reason = match (exceeded, paused) {
            (true, _) => Reason::LagOverMax,
            (false, true) => Reason::Paused,
            (false, false) => Reason::CaughtUp,
        };
        s.set_condition(ConditionType::ReplicationLagExceeded, exceeded, reason, message);
    }
    if s.phase == Phase::Syncing {
        let (ok, reason) =
            if exceeded { (false, Reason::ReplicationLagExceeded) } else { (true, Reason::Syncing) };
        if s.condition(ConditionType::Available) != ok {
            s.set_condition(ConditionType::Available, ok, reason, "");
        }
    }
    // A count older than two reconcile intervals no longer vouches for the invariants.
    if let (Some(stale_after), Some(last)) = (rule.reconcile_stale_after, &s.last_reconcile) {
        let at = last.time.as_deref().and_then(|t| humantime::parse_rfc3339(t).ok());
        let age = since(at);
        if s.condition(ConditionType::InvariantsHeld) && age > stale_after {
            s.set_condition(
                ConditionType::InvariantsHeld,
                false,
                Reason::Stale,
                format!("the last reconcile pass is {:.0}s old", age.as_secs_f64()),
            );
        }
    }
    // A link whose periodic pass never ran is not vouched for either: from twice the interval
    // after its initial sync completed (the checkpoint keeps that time across restarts).
    if let (Some(stale_after), None) = (rule.reconcile_stale_after, &s.last_reconcile) {
        let completed =
            s.initial_sync.completed.as_deref().and_then(|t| humantime::parse_rfc3339_weak(t).ok());
        let age = since(completed);
        let stale = completed.is_some() && age > stale_after;
        let said = s
            .conditions
            .iter()
            .any(|c| c.type_ == ConditionType::InvariantsHeld && c.reason == Reason::NeverReconciled);
        if stale && !said {
            s.set_condition(
                ConditionType::InvariantsHeld,
                false,
                Reason::NeverReconciled,
                format!(
                    "no reconcile pass in the {:.0}s since the initial sync completed (reconcile.interval {}s)",
                    age.as_secs_f64(),
                    stale_after.as_secs() / 2
                ),
            );
        }
    }
}

/// The staleness rule of [`refresh`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Freshness {
    /// `sync.max_lag`: longer lag, or longer without progress while behind, raises
    /// `ReplicationLagExceeded` and drops `Available`.
    pub max_lag: Duration,
    /// `InvariantsHeld` turns false when the last reconcile pass is older than this (twice the
    /// interval); `None` when periodic passes are off.
    pub reconcile_stale_after: Option<Duration>,
}

impl Freshness {
    /// The rule of a config.
    pub fn of(cfg: &mirror_core::Config) -> Freshness {
        let interval = cfg.reconcile.interval.get();
        Freshness {
            max_lag: cfg.sync.max_lag.get(),
            reconcile_stale_after: (!interval.is_zero()).then(|| interval * 2),
        }
    }
}

/// How long before a TLS certificate's `notAfter` the log warns, as the alert
/// `EtcdMirrorTlsCertExpiringSoon` does (deploy/prometheus/alerts.yaml): 14 days.
pub const CERT_WARNING_LEAD: Duration = Duration::from_secs(14 * 86_400);

/// The log's side of the certificate lead window: each loaded certificate file (side, kind,
/// `notAfter`) that is within [`CERT_WARNING_LEAD`] of expiring, or expired, is reported once
/// per process; a rotated file (another `notAfter`) in the window is reported again. Read from
/// the status once a second, so a link connected long ago still warns when its window opens.
#[derive(Debug, Default)]
pub struct CertWarnings {
    said: std::collections::BTreeSet<(&'static str, String, i64)>,
}

impl CertWarnings {
    /// The warnings not said yet at `now`.
    pub fn due(&mut self, s: &Status, now: SystemTime) -> Vec<String> {
        let now = now.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        let lead = CERT_WARNING_LEAD.as_secs() as i64;
        let mut out = Vec::new();
        for (side, info) in [("source", &s.source), ("target", &s.target)] {
            for cert in info.tls_cert_expiry.iter().filter(|c| c.not_after - now < lead) {
                if self.said.insert((side, cert.kind.clone(), cert.not_after)) {
                    let left = cert.not_after - now;
                    out.push(if left <= 0 {
                        format!("the {side} TLS {} certificate has expired; rotate it", cert.kind)
                    } else {
                        format!(
                            "the {side} TLS {} certificate expires in {:.1} days; rotate it",
                            cert.kind,
                            left as f64 / 86_400.0
                        )
                    });
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mirror_core::tls::CertExpiry;
    use mirror_core::LastReconcile;

    /// Upstream #115: 60 days out is silent, inside the window warns once, a rotated file
    /// inside the window warns again, an expired one says so.
    #[test]
    fn a_certificate_in_its_lead_window_is_warned_of_once() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000);
        let at = |days: i64| 2_000_000_000 + days * 86_400;
        let mut s = Status::default();
        s.source.tls_cert_expiry = vec![CertExpiry { kind: "client".into(), not_after: at(60) }];
        let mut warnings = CertWarnings::default();
        assert!(warnings.due(&s, t0).is_empty(), "60 days out");
        let day = Duration::from_secs(86_400);
        let first = warnings.due(&s, t0 + day * 53);
        assert_eq!(first, ["the source TLS client certificate expires in 7.0 days; rotate it"]);
        assert!(warnings.due(&s, t0 + day * 54).is_empty(), "said once");
        s.source.tls_cert_expiry[0].not_after = at(57);
        assert_eq!(warnings.due(&s, t0 + day * 54).len(), 1, "a new certificate in the window");
        s.target.tls_cert_expiry = vec![CertExpiry { kind: "ca".into(), not_after: at(1) }];
        assert_eq!(warnings.due(&s, t0 + day * 54), ["the target TLS ca certificate has expired; rotate it"]);
    }

    fn rule() -> Freshness {
        Freshness {
            max_lag: Duration::from_secs(300),
            reconcile_stale_after: Some(Duration::from_secs(7200)),
        }
    }

    /// A loop that stopped moving the watermark while the source went on is reported: after
    /// max_lag, ReplicationLagExceeded is True and Available False; catching up clears both
    /// (defect #10 of issue 10: neither had a freshness term).
    #[test]
    fn a_wedged_loop_stops_looking_available() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut s = Status { phase: Phase::Syncing, watermark: 10, source_revision: 10, ..Status::default() };
        s.set_condition(ConditionType::Available, true, Reason::Syncing, "");
        s.progress_at = Some(t0);
        refresh(&mut s, t0, &rule());
        assert!(s.condition(ConditionType::Available) && !s.condition(ConditionType::ReplicationLagExceeded));
        s.source_revision = 50;
        refresh(&mut s, t0 + Duration::from_secs(10), &rule());
        assert!(s.condition(ConditionType::Available), "10 s behind is within max_lag");
        refresh(&mut s, t0 + Duration::from_secs(400), &rule());
        assert!(s.condition(ConditionType::ReplicationLagExceeded) && !s.condition(ConditionType::Available));
        assert_eq!(s.lag_seconds, 390.0);
        assert_eq!(s.seconds_since_progress, 400.0);
        s.watermark = 50;
        s.progress_at = Some(t0 + Duration::from_secs(401));
        refresh(&mut s, t0 + Duration::from_secs(401), &rule());
        assert!(s.condition(ConditionType::Available) && !s.condition(ConditionType::ReplicationLagExceeded));
        assert_eq!(s.lag_seconds, 0.0);
    }

    /// A link that never completed a pass stops being vouched for twice the interval after its
    /// initial sync completed (it used to look healthy forever).
    #[test]
    fn no_pass_at_all_is_stale_after_twice_the_interval() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut s = Status::default();
        refresh(&mut s, t0 + Duration::from_secs(100_000), &rule());
        assert!(s.conditions.is_empty(), "no initial sync yet: nothing to judge");
        s.initial_sync.completed = Some(humantime::format_rfc3339_seconds(t0).to_string());
        refresh(&mut s, t0 + Duration::from_secs(7200), &rule());
        assert!(s.conditions.is_empty(), "within twice the interval");
        refresh(&mut s, t0 + Duration::from_secs(7201), &rule());
        let held = s.conditions.iter().find(|c| c.type_ == ConditionType::InvariantsHeld).unwrap();
        assert_eq!((held.status, held.reason), (false, Reason::NeverReconciled));
        let off = Freshness { reconcile_stale_after: None, ..rule() };
        let mut quiet = Status { initial_sync: s.initial_sync.clone(), ..Status::default() };
        refresh(&mut quiet, t0 + Duration::from_secs(100_000), &off);
        assert!(quiet.conditions.is_empty(), "periodic passes off: no rule");
    }

    /// InvariantsHeld from a pass older than twice the interval is stale.
    #[test]
    fn old_counts_stop_vouching() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut s = Status {
            last_reconcile: Some(LastReconcile {
                time: Some(humantime::format_rfc3339_seconds(t0).to_string()),
                ..LastReconcile::default()
            }),
            ..Status::default()
        };
        s.set_condition(ConditionType::InvariantsHeld, true, Reason::CountsEqual, "");
        refresh(&mut s, t0 + Duration::from_secs(3600), &rule());
        assert!(s.condition(ConditionType::InvariantsHeld));
        refresh(&mut s, t0 + Duration::from_secs(7201), &rule());
        assert!(!s.condition(ConditionType::InvariantsHeld));
    }
}
