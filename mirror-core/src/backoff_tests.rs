use std::time::Duration;

use tokio::time::Instant;

use super::*;
use crate::config::{Backoff as BackoffSection, SyncSection};
use crate::units::HumanDuration;

fn sync(initial: u64, max: u64) -> SyncSection {
    SyncSection {
        backoff: BackoffSection {
            initial: HumanDuration(Duration::from_secs(initial)),
            max: HumanDuration(Duration::from_secs(max)),
        },
        ..SyncSection::default()
    }
}

fn secs(s: u64) -> Action {
    Action::RetryAfter(Duration::from_secs(s))
}

/// Sleeps what the policy says, as the engine does, and returns the virtual time it took.
async fn waited(policy: &mut RetryPolicy, class: ErrorClass, times: usize) -> Duration {
    let start = Instant::now();
    for _ in 0..times {
        match policy.on_error(class) {
            Action::RetryAfter(d) | Action::FreshGenesisAfter(d) => tokio::time::sleep(d).await,
            Action::Stop => break,
        }
    }
    start.elapsed()
}

/// Transient errors double from `initial` up to `max`, and start over after a success (defect
/// #1 of issue 10: the reconnect backoff used to stay at the maximum forever).
#[tokio::test(start_paused = true)]
async fn transient_doubles_to_max_and_resets_after_success() {
    let mut p = RetryPolicy::new(&sync(1, 30));
    assert_eq!(
        waited(&mut p, ErrorClass::Transient, 7).await,
        Duration::from_secs(1 + 2 + 4 + 8 + 16 + 30 + 30)
    );
    p.on_success();
    assert_eq!(p.on_error(ErrorClass::Transient), secs(1), "after a success the wait starts over");
}

/// Throttling has its own, steeper curve (defect #2: it shared the transient one).
#[tokio::test(start_paused = true)]
async fn throttle_has_its_own_curve() {
    let mut p = RetryPolicy::new(&sync(1, 30));
    let throttled: Vec<Action> = (0..4).map(|_| p.on_error(ErrorClass::Throttle)).collect();
    assert_eq!(throttled, vec![secs(2), secs(6), secs(18), secs(30)]);
    assert_eq!(p.on_error(ErrorClass::Transient), secs(1), "the transient curve is separate");
    assert_eq!(p.rounds(), 5);
}

/// One success under throttling does not reset the throttle curve, a later write's policy
/// carries it on, and it starts over only after `backoff.max` without throttling (upstream
/// #41: a throttled target was hammered again at the shortest wait after every success).
#[tokio::test(start_paused = true)]
async fn the_throttle_curve_survives_success_and_decays_after_a_quiet_max() {
    let cfg = sync(1, 30);
    let mut p = RetryPolicy::new(&cfg);
    assert_eq!(waited(&mut p, ErrorClass::Throttle, 2).await, Duration::from_secs(2 + 6));
    p.on_success();
    assert_eq!(p.on_error(ErrorClass::Throttle), secs(18), "a success does not reset it");
    p.on_success();
    let mut next_write = RetryPolicy::new(&cfg).with_throttle_state(p.throttle_state());
    assert_eq!(next_write.on_error(ErrorClass::Throttle), secs(30), "the next write carries it on");
    next_write.on_success();
    tokio::time::sleep(Duration::from_secs(29)).await;
    let mut p = RetryPolicy::new(&cfg).with_throttle_state(next_write.throttle_state());
    assert_eq!(p.on_error(ErrorClass::Throttle), secs(30), "29 s without throttling is not enough");
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(p.on_error(ErrorClass::Throttle), secs(2), "backoff.max without throttling starts it over");
    assert_eq!(RetryPolicy::new(&cfg).on_error(ErrorClass::Throttle), secs(2), "a fresh policy starts low");
}

/// Under tight bounds the throttle curve never waits longer than `backoff.max`, its first wait
/// included (upstream #39: initial = max = 1 s waited 2 s).
#[test]
fn the_first_throttle_wait_never_exceeds_the_max() {
    let mut p = RetryPolicy::new(&sync(1, 1));
    let throttled: Vec<Action> = (0..3).map(|_| p.on_error(ErrorClass::Throttle)).collect();
    assert_eq!(throttled, vec![secs(1), secs(1), secs(1)]);
    let mut p = RetryPolicy::new(&sync(1, 3));
    let throttled: Vec<Action> = (0..3).map(|_| p.on_error(ErrorClass::Throttle)).collect();
    assert_eq!(throttled, vec![secs(2), secs(3), secs(3)]);
}

/// A fresh genesis starts at once the first time and backs off after that, so a resync loop
/// never spins (defect #4).
#[tokio::test(start_paused = true)]
async fn resync_loops_back_off() {
    let mut p = RetryPolicy::new(&sync(1, 30));
    assert_eq!(p.on_error(ErrorClass::Resync), Action::FreshGenesisAfter(Duration::ZERO));
    assert_eq!(p.on_error(ErrorClass::Resync), Action::FreshGenesisAfter(Duration::from_secs(2)));
    assert_eq!(waited(&mut p, ErrorClass::Resync, 3).await, Duration::from_secs(4 + 8 + 16));
    p.on_success();
    assert_eq!(
        p.on_error(ErrorClass::Resync),
        Action::FreshGenesisAfter(Duration::from_secs(30)),
        "landed scan Txns are no way out of a resync loop"
    );
    p.on_live_progress();
    assert_eq!(p.on_error(ErrorClass::Resync), Action::FreshGenesisAfter(Duration::ZERO));
}

/// A full target is probed at min(backoff.max, 60 s); permanent errors stop.
#[tokio::test(start_paused = true)]
async fn quota_probes_at_a_fixed_pace_and_permanent_stops() {
    let mut p = RetryPolicy::new(&sync(1, 300));
    assert_eq!(waited(&mut p, ErrorClass::Quota, 3).await, Duration::from_secs(180));
    assert_eq!(p.on_error(ErrorClass::Permanent), Action::Stop);
}

/// The raw type: never past max, never below initial, factor 1 is constant.
#[test]
fn backoff_bounds() {
    let mut b = ExponentialBackoff::new(Duration::from_millis(200), Duration::from_secs(2), 2);
    let d: Vec<u128> = (0..6).map(|_| b.next_delay().as_millis()).collect();
    assert_eq!(d, vec![200, 400, 800, 1600, 2000, 2000]);
    let mut flat = ExponentialBackoff::new(Duration::from_secs(1), Duration::from_secs(1), 1);
    assert_eq!((flat.next_delay(), flat.next_delay()), (Duration::from_secs(1), Duration::from_secs(1)));
}
