//! The exact replica's periodic pass (`reconcile.interval`): both sides read at the last
//! revision landed and compared key by key, value, create and mod revision, version and lease
//! ([`compare_at`]). It only reads (SPEC §10: a repair would write a revision the source never
//! had). The fence catches what writes the target; the pass catches what no fence can: a
//! replica that holds the source's revision number but not its content (a target restored
//! from another snapshot under a copied checkpoint, storage that lost a write, a defect of
//! the agent). It runs on a task of its own beside the tail, and says what it found as compact
//! mode's pass does: `last_reconcile`, `DriftDetected`, `InvariantsHeld`, the key counts, and
//! `etcd_mirror_drift_keys` (the alert `EtcdMirrorDrift`).

use std::pin::Pin;
use std::time::Duration;

use etcd_client::Client;
use mirror_core::{now_rfc3339, ConditionType, Config, EtcdError, LastReconcile, Reason, Status};
use tokio::time::{Instant, Sleep};
use tokio_util::task::AbortOnDropHandle;
use tracing::{error, info, warn};

use crate::exact::compare::{compare_at, Comparison};

/// Differences a pass names in the log and in the condition's message, at most.
const SHOWN: usize = 5;

/// How soon a pass that could not read (a side down, a compaction past its revision) is tried
/// again, at most.
const RETRY: Duration = Duration::from_secs(60);

/// One pass's outcome.
pub(super) struct Pass {
    /// The revision both sides were read at.
    revision: i64,
    found: Result<Comparison, EtcdError>,
    took: Duration,
}

/// When the next pass is due, and the one running.
pub(super) struct Audit {
    /// `reconcile.interval`; `None`: off.
    every: Option<Duration>,
    due: Pin<Box<Sleep>>,
    running: Option<AbortOnDropHandle<Pass>>,
}

impl Audit {
    /// Passes every `reconcile.interval` (none when zero), the first one interval after the
    /// last pass `status` holds (this process's), or after now.
    pub(super) fn new(cfg: &Config, status: &Status) -> Audit {
        let every = Some(cfg.reconcile.interval.get()).filter(|d| !d.is_zero());
        let since_last = status
            .last_reconcile
            .as_ref()
            .and_then(|r| r.time.as_deref())
            .and_then(|t| humantime::parse_rfc3339(t).ok())
            .and_then(|t| t.elapsed().ok());
        let wait = every.map_or(Duration::MAX, |every| every.saturating_sub(since_last.unwrap_or_default()));
        let due = Instant::now().checked_add(wait).unwrap_or_else(far_future);
        Audit { every, due: Box::pin(tokio::time::sleep_until(due)), running: None }
    }

    /// Whether passes run at all (`reconcile.interval` not zero).
    pub(super) fn on(&self) -> bool {
        self.every.is_some()
    }

    /// The next event: a pass due (start one with [`Audit::start`]), or the running pass's
    /// outcome. Cancel-safe: awaited beside the tail's other work.
    pub(super) async fn next(&mut self) -> Event {
        let Some(task) = self.running.as_mut() else {
            self.due.as_mut().await;
            return Event::Due;
        };
        let pass = task.await.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        self.running = None;
        // The next one an interval on; sooner after one that could not read.
        let every = self.every.unwrap_or(Duration::MAX);
        self.wait(if pass.found.is_ok() { every } else { every.min(RETRY) });
        Event::Finished(pass)
    }

    /// Starts a pass reading both sides at `revision` (landed on the target).
    pub(super) fn start(&mut self, cfg: &Config, source: &Client, target: &Client, revision: i64) {
        let (cfg, source, target) = (cfg.clone(), source.clone(), target.clone());
        info!(revision, "exact replica: periodic comparison of both sides at the last revision landed");
        self.running = Some(AbortOnDropHandle::new(tokio::spawn(async move {
            let started = Instant::now();
            let found = compare_at(&cfg, &source, &target, revision, SHOWN, 0).await;
            Pass { revision, found, took: started.elapsed() }
        })));
    }

    fn wait(&mut self, wait: Duration) {
        self.due.as_mut().reset(Instant::now().checked_add(wait).unwrap_or_else(far_future));
    }
}

/// What [`Audit::next`] brings.
pub(super) enum Event {
    /// A pass is due.
    Due,
    /// A pass ended.
    Finished(Pass),
}

/// An instant no pass waits for (about 30 years on).
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86400 * 365 * 30)
}

/// Says what `pass` found: in the log, and in status as compact mode's pass does.
pub(super) fn report(pass: Pass, status: &mut Status) {
    let Pass { revision, found, took } = pass;
    let found = match found {
        Ok(found) => found,
        Err(e) => {
            warn!(revision, "the periodic comparison could not read both sides at the revision ({e}); tried again within {RETRY:?}");
            return;
        }
    };
    let drift = found.differences() > 0;
    let shown = found.shown.join("; ");
    if drift {
        error!(
            revision,
            missing = found.missing,
            divergent = found.divergent,
            orphan = found.orphan,
            "the exact replica differs from its source at the same revision: {shown}; it is no longer a copy to \
             fail over to: re-seed the target (docs/exact-revisions.md)"
        );
    } else {
        info!(
            revision,
            keys = found.equal,
            took_ms = took.as_millis() as u64,
            "periodic comparison: every key equal"
        );
    }
    status.source_keys = Some(found.source_keys());
    status.target_keys = Some(found.target_keys());
    status.lease_backed_keys = found.leased;
    status.last_reconcile = Some(LastReconcile {
        time: Some(now_rfc3339()),
        missing: found.missing,
        divergent: found.divergent,
        orphan: found.orphan,
        repaired: 0,
        keys_compared: found.source_keys(),
        duration_seconds: took.as_secs_f64(),
    });
    let counts = format!(
        "at revision {revision}: {} keys equal, missing {}, divergent {}, orphan {} (nothing repaired: exact mode only reads)",
        found.equal, found.missing, found.divergent, found.orphan
    );
    let (drift_reason, held_reason) =
        if drift { (Reason::Drift, Reason::KeysDiffer) } else { (Reason::NoDrift, Reason::KeysEqual) };
    let said = if drift { format!("{counts}; first: {shown}") } else { counts };
    status.set_condition(ConditionType::DriftDetected, drift, drift_reason, said.clone());
    status.set_condition(ConditionType::InvariantsHeld, !drift, held_reason, said);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use mirror_core::{ConditionType, Reason, Status};

    use super::{report, Pass};
    use crate::exact::compare::Comparison;

    fn pass(found: Comparison) -> Pass {
        Pass { revision: 42, found: Ok(found), took: Duration::from_millis(5) }
    }

    fn condition(s: &Status, type_: ConditionType) -> (bool, Reason, String) {
        let c = s.conditions.iter().find(|c| c.type_ == type_).expect("set");
        (c.status, c.reason, c.message.clone())
    }

    /// A pass that finds keys differing raises `DriftDetected`, drops `InvariantsHeld`, and
    /// counts each kind as compact mode's pass does (the drift gauge); a clean pass after it
    /// clears both. Nothing is ever counted repaired.
    #[test]
    fn a_pass_reports_drift_and_a_clean_pass_clears_it() {
        let mut s = Status::default();
        let drifted = Comparison {
            equal: 10,
            missing: 1,
            divergent: 1,
            orphan: 1,
            leased: 4,
            shown: vec!["key /a differs in value".into()],
        };
        report(pass(drifted), &mut s);
        let last = s.last_reconcile.clone().expect("last_reconcile");
        assert_eq!((last.missing, last.divergent, last.orphan, last.repaired), (1, 1, 1, 0));
        assert_eq!((last.keys_compared, s.source_keys, s.target_keys), (12, Some(12), Some(12)));
        assert_eq!(s.lease_backed_keys, 4);
        let (raised, reason, message) = condition(&s, ConditionType::DriftDetected);
        assert!(
            raised && reason == Reason::Drift && message.contains("key /a differs in value"),
            "{message}"
        );
        assert!(message.contains("at revision 42"), "{message}");
        let (held, reason, _) = condition(&s, ConditionType::InvariantsHeld);
        assert!(!held && reason == Reason::KeysDiffer);

        report(pass(Comparison { equal: 12, ..Default::default() }), &mut s);
        assert!(!condition(&s, ConditionType::DriftDetected).0);
        let (held, reason, _) = condition(&s, ConditionType::InvariantsHeld);
        assert!(held && reason == Reason::KeysEqual);
        assert_eq!(s.last_reconcile.map(|r| r.divergent), Some(0));
    }
}
