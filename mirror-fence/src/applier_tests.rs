//! The applier's retry decisions, round by round on paused time.

use std::time::Duration;

use mirror_core::{ErrorClass, RetryPolicy};
use tokio::time::Instant;

use super::{on_write_error, OnWriteError, WriteTrouble};

/// Each class of write error, round by round, run on paused time so the table states how
/// long after the first failure the operator sees each condition (default backoff: 1 s
/// doubling to 30 s; throttling from 2 s, threefold; a full target every 30 s).
#[tokio::test(start_paused = true)]
async fn every_write_error_class_round_by_round() {
    use ErrorClass::*;
    use WriteTrouble::*;
    let s = Duration::from_secs;
    // (class, tls changed, decision, seconds waited before this error's decision)
    let rounds: Vec<(ErrorClass, bool, OnWriteError, u64)> = vec![
        (Transient, false, retry(s(1), false, false, None), 0),
        (Transient, false, retry(s(2), false, false, None), 1),
        (Transient, false, retry(s(4), true, true, Some(Unreachable)), 3),
        (Transient, false, retry(s(8), false, false, None), 7),
        (Throttle, false, retry(s(2), false, false, Some(Throttled)), 0),
        (Throttle, false, retry(s(6), false, false, Some(Throttled)), 2),
        (Throttle, false, retry(s(18), true, false, Some(Throttled)), 8),
        (Quota, false, retry(s(30), false, true, Some(QuotaExhausted)), 0),
        (Quota, false, retry(s(30), false, false, None), 30),
        (Quota, false, retry(s(30), true, false, None), 60),
        (Transient, true, OnWriteError::Reconnect, 0),
        (Throttle, true, retry(s(2), false, false, Some(Throttled)), 0),
        (Permanent, false, OnWriteError::GiveUp, 0),
        (Resync, false, OnWriteError::GiveUp, 0),
    ];
    let mut policy = None;
    let mut last_class = None;
    let mut started = Instant::now();
    for (class, tls_changed, want, waited) in rounds {
        if last_class != Some(class) || tls_changed {
            // A new write: fresh policy, fresh clock.
            policy = Some(RetryPolicy::new(&mirror_core::SyncSection::default()));
            started = Instant::now();
        }
        last_class = Some(class);
        assert_eq!(started.elapsed(), s(waited), "{class:?}: time before this round");
        let got = on_write_error(class, tls_changed, policy.as_mut().expect("set above"));
        assert_eq!(got, want, "{class:?} after {waited} s (tls changed: {tls_changed})");
        if let OnWriteError::Retry { after, .. } = got {
            tokio::time::sleep(after).await;
        }
    }
}

fn retry(after: Duration, drop_watch: bool, degrade: bool, raise: Option<WriteTrouble>) -> OnWriteError {
    OnWriteError::Retry { after, drop_watch, degrade, raise }
}
