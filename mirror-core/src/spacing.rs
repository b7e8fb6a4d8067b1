//! Spacing between Txns sent behind one another (the exact tail's, SPEC §11). Two requests
//! that reach etcd together often reach raft in the opposite order (measured; our reading, not
//! traced in etcd's code, is a goroutine per request with the later one run first), so the
//! second fails its fence compare and is sent again. Sent a few tens of microseconds apart they keep their order: `harness bench`'s
//! probe, two in flight, resent 41 % back to back, 17 % 30 us apart, 5 % 100 us apart, and
//! landed 1.5 x the serial rate at 100 us (3.5.30, 2 cores). tokio's timer counts milliseconds,
//! so the wait is a timerfd in the runtime's reactor: no thread sleeps.

use std::io;
use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec,
};
use tokio::io::unix::AsyncFd;
use tokio::time::Instant;
use tracing::warn;

/// Keeps sends at least `gap` apart.
pub struct Spacer {
    gap: Duration,
    /// When the last send went, if one did.
    last: Option<Instant>,
    /// The timer, created on the first wait that needs one.
    timer: Option<AsyncFd<OwnedFd>>,
}

impl Spacer {
    /// Sends at least `gap` apart (zero: no wait).
    pub fn new(gap: Duration) -> Spacer {
        Spacer { gap, last: None, timer: None }
    }

    /// Counts now as a send. `behind`: another is still in flight, so this one first waits
    /// until `gap` has passed since the last send; with none in flight there is nothing to
    /// overtake and it goes at once. Without a timer (the system refused one) sends are no
    /// longer spaced: they stay correct (a Txn etcd ran too early goes again), only slower.
    pub async fn send(&mut self, behind: bool) {
        let left = match self.last {
            Some(last) if behind => self.gap.saturating_sub(last.elapsed()),
            _ => Duration::ZERO,
        };
        if !left.is_zero() {
            if let Err(e) = self.wait(left).await {
                warn!("no timer for spacing Txns in flight ({e}); they go unspaced");
                self.gap = Duration::ZERO;
            }
        }
        self.last = Some(Instant::now());
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

    use super::Spacer;

    /// A send behind another waits out the gap (at least, and not for ever); the first, and one
    /// with nothing in flight, go at once.
    #[tokio::test]
    async fn sends_are_kept_apart_by_the_gap() {
        let gap = Duration::from_micros(300);
        let mut spacer = Spacer::new(gap);
        let start = tokio::time::Instant::now();
        spacer.send(false).await;
        assert!(start.elapsed() < gap, "the first send waited");
        let mut gaps = Vec::new();
        for _ in 0..20 {
            let before = tokio::time::Instant::now();
            spacer.send(true).await;
            gaps.push(before.elapsed());
        }
        assert!(gaps.iter().all(|g| *g >= gap - Duration::from_micros(20)), "{gaps:?}");
        gaps.sort();
        assert!(gaps[10] < Duration::from_millis(5), "median {:?}", gaps[10]);
        let before = tokio::time::Instant::now();
        spacer.send(false).await;
        assert!(before.elapsed() < gap, "a send with nothing in flight waited");
    }
}
