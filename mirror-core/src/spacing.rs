//! Spacing between Txns sent behind one another (the exact tail's, SPEC §11). Two requests
//! that reach etcd together often reach raft in the opposite order (measured; our reading, not
//! traced in etcd's code, is a goroutine per request with the later one run first), so the
//! second fails its fence compare and is sent again. Sent a few tens of microseconds apart
//! they keep their order: `harness bench`'s probe, two in flight, resent 41 % back to back, 17 % 30 us apart, 5 % 100 us apart, and
//! landed 1.5 x the serial rate at 100 us (3.5.30, 2 cores).
//!
//! Paced ([`Spacer::paced`]), the gap also grows to the time a Txn recently took divided by the
//! Txns in flight, so a full window's Txns are spread evenly over one Txn's time: as many are
//! in flight as before (the rate stays a window per Txn time), but they reach etcd as far
//! apart as they can be. Where the target is slow because the machine is busy, a fixed 100 us
//! still let about one Txn sent in four overtake its predecessor, each one a wasted Txn on a
//! target with no capacity to spare; paced, about one in thirty did, and the exact tail landed 1.07-1.16 x
//! as many revisions per second (alternating runs, 3.5.30 on 2 cores shared with the source,
//! README).
//!
//! tokio's timer counts milliseconds, so the wait is a timerfd in the runtime's reactor: no
//! thread sleeps.

use std::io;
use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec,
};
use tokio::io::unix::AsyncFd;
use tokio::time::Instant;
use tracing::warn;

/// The longest a paced gap grows (`sync.exact_txn_spacing`'s own bound): a Txn slowed by a
/// hiccup must not hold the ones behind it back for long once the target is fast again.
pub(crate) const MAX_GAP: Duration = Duration::from_millis(10);

/// Of each new Txn time, the share the paced average takes (1/8: a few Txns follow a change).
const TOOK_WEIGHT: u32 = 8;

/// Keeps sends at least `gap` apart.
pub struct Spacer {
    /// The least gap; zero: sends are not spaced at all, paced or not.
    gap: Duration,
    /// Paced: the Txns in flight over which the gap spreads a Txn's time.
    window: Option<u32>,
    /// How long a Txn took recently, sent to answered (a moving average).
    took: Option<Duration>,
    /// When the last send went, if one did.
    last: Option<Instant>,
    /// The timer, created on the first wait that needs one.
    timer: Option<AsyncFd<OwnedFd>>,
}

impl Spacer {
    /// Sends at least `gap` apart (zero: no wait).
    pub fn new(gap: Duration) -> Spacer {
        Spacer { gap, window: None, took: None, last: None, timer: None }
    }

    /// Sends at least `gap` apart and, with `window` Txns in flight at most, at least the
    /// time a Txn recently took ([`Spacer::took`]) over `window` apart, up to [`MAX_GAP`]. A
    /// zero `gap` turns spacing off, pacing with it.
    pub fn paced(gap: Duration, window: usize) -> Spacer {
        Spacer { window: Some(window.max(1) as u32), ..Spacer::new(gap) }
    }

    /// A Txn took `took` from its send to its answer.
    pub fn took(&mut self, took: Duration) {
        let avg = self.took.map_or(took, |avg| (avg * (TOOK_WEIGHT - 1) + took) / TOOK_WEIGHT);
        self.took = Some(avg);
    }

    /// The gap a send behind another keeps now.
    pub fn gap(&self) -> Duration {
        match (self.window, self.took) {
            _ if self.gap.is_zero() => Duration::ZERO,
            (Some(window), Some(took)) => self.gap.max((took / window).min(MAX_GAP)),
            _ => self.gap,
        }
    }

    /// How long a send now still waits: the gap less the time since the last send when
    /// `behind` another in flight (there is nothing to overtake otherwise: zero). The caller
    /// waits it out with [`Spacer::pause`], beside whatever else it does meanwhile (such as take
    /// the answer that leaves the send no longer behind), then counts the send with
    /// [`Spacer::sent`].
    pub fn left(&self, behind: bool) -> Duration {
        match self.last {
            Some(last) if behind => self.gap().saturating_sub(last.elapsed()),
            _ => Duration::ZERO,
        }
    }

    /// Counts now as a send.
    pub fn sent(&mut self) {
        self.last = Some(Instant::now());
    }

    /// Waits `left` (at once when zero) on the timer. Without a timer (the system refused one)
    /// sends are no longer spaced: they stay correct (a Txn etcd ran too early goes again), only
    /// slower.
    pub async fn pause(&mut self, left: Duration) {
        if left.is_zero() {
            return;
        }
        if let Err(e) = self.wait(left).await {
            warn!("no timer for spacing Txns in flight ({e}); they go unspaced");
            self.gap = Duration::ZERO;
        }
    }

    async fn wait(&mut self, left: Duration) -> io::Result<()> {
        let timer = match &mut self.timer {
            Some(timer) => timer,
            None => {
                let fd = timerfd_create(
                    TimerfdClockId::Monotonic,
                    TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
                )?;
                // Deprecated for a `T` whose descriptor may change or close under the reactor;
                // an `OwnedFd` owns one descriptor for its whole life, which `register` (unsafe,
                // and the workspace denies unsafe code) asks the caller to promise.
                #[allow(deprecated)]
                let timer = AsyncFd::new(fd)?;
                self.timer.insert(timer)
            }
        };
        let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
        let value = Timespec { tv_sec: left.as_secs() as _, tv_nsec: left.subsec_nanos() as _ };
        timerfd_settime(
            timer.get_ref(),
            TimerfdTimerFlags::empty(),
            &Itimerspec { it_interval: zero, it_value: value },
        )?;
        loop {
            let mut ready = timer.readable().await?;
            let mut expirations = [0u8; 8];
            match ready.try_io(|fd| Ok(rustix::io::read(fd.get_ref(), &mut expirations)?)) {
                Ok(read) => return read.map(drop),
                Err(_would_block) => continue,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Spacer, MAX_GAP};

    /// A send as a caller with nothing else to do makes it: wait what is left, then send.
    async fn send(spacer: &mut Spacer, behind: bool) {
        spacer.pause(spacer.left(behind)).await;
        spacer.sent();
    }

    /// A send behind another waits out the gap (at least, and not for ever); the first, and one
    /// with nothing in flight, go at once.
    #[tokio::test]
    async fn sends_are_kept_apart_by_the_gap() {
        // Judged by the send times the spacer keeps, not by how long each call took: a test
        // thread descheduled between two sends (a loaded CI machine) waits less in the next.
        let gap = Duration::from_micros(300);
        let mut spacer = Spacer::new(gap);
        send(&mut spacer, false).await;
        let mut sent = vec![spacer.last.expect("sent")];
        for _ in 0..20 {
            send(&mut spacer, true).await;
            sent.push(spacer.last.expect("sent"));
        }
        let mut gaps: Vec<Duration> = sent.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().all(|g| *g >= gap), "{gaps:?}");
        gaps.sort();
        assert!(gaps[10] < Duration::from_millis(5), "median {:?}", gaps[10]);

        // With nothing in flight a send goes at once, however long the gap.
        let mut slow = Spacer::new(Duration::from_secs(1));
        for _ in 0..2 {
            let before = tokio::time::Instant::now();
            send(&mut slow, false).await;
            assert!(before.elapsed() < Duration::from_millis(500), "a send with nothing in flight waited");
        }
    }

    /// What a send still waits: the gap since the last send when behind another, nothing when
    /// not behind or once the gap has passed.
    #[tokio::test]
    async fn left_is_the_gap_still_to_wait_behind_a_send() {
        let gap = Duration::from_millis(200);
        let mut spacer = Spacer::new(gap);
        assert_eq!(spacer.left(true), Duration::ZERO, "nothing sent yet");
        spacer.sent();
        let left = spacer.left(true);
        assert!(left > Duration::ZERO && left <= gap, "{left:?}");
        assert_eq!(spacer.left(false), Duration::ZERO, "nothing in flight to overtake");
        spacer.pause(left).await;
        assert_eq!(spacer.left(true), Duration::ZERO, "the gap has passed");
    }

    #[test]
    fn a_paced_gap_spreads_a_txns_time_over_the_window() {
        let us = Duration::from_micros;
        let mut paced = Spacer::paced(us(100), 2);
        assert_eq!(paced.gap(), us(100), "no Txn time known yet: the least gap");
        paced.took(us(1_200));
        assert_eq!(paced.gap(), us(600), "a Txn's time over 2 in flight");
        for _ in 0..40 {
            paced.took(us(100));
        }
        assert_eq!(paced.gap(), us(100), "fast Txns again: back to the least gap");
        paced.took(Duration::from_secs(5));
        assert_eq!(paced.gap(), MAX_GAP, "a hiccup holds the next Txn back 10ms at most");

        let mut off = Spacer::paced(Duration::ZERO, 2);
        off.took(us(1_200));
        assert_eq!(off.gap(), Duration::ZERO, "no spacing means no pacing either");
        let mut fixed = Spacer::new(us(100));
        fixed.took(us(1_200));
        assert_eq!(fixed.gap(), us(100), "not paced: the gap stays");
    }

    #[tokio::test]
    async fn a_paced_send_waits_the_paced_gap() {
        let mut paced = Spacer::paced(Duration::from_micros(100), 2);
        paced.took(Duration::from_millis(4));
        send(&mut paced, false).await;
        let first = paced.last.expect("sent");
        send(&mut paced, true).await;
        let apart = paced.last.expect("sent") - first;
        assert!(apart >= Duration::from_millis(2), "sent {apart:?} apart");
    }
}
