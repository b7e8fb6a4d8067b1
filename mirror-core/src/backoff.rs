//! How long to wait after an error, by class: one small backoff type and one policy.
//!
//! ## What it guarantees
//! - [`ExponentialBackoff`] grows by its factor from `initial` up to `max` and starts over after
//!   [`ExponentialBackoff::reset`]: a link that blipped a few times over days waits `initial` after its
//!   next error, not the maximum.
//! - [`RetryPolicy::on_error`] maps (error class, attempts so far) to one [`Action`]:
//!   transient errors follow `sync.backoff`; throttling has its own, steeper curve
//!   (`TargetThrottled`: the target asked us to slow down, so the first wait is already twice
//!   the transient one, capped at `backoff.max`, and grows threefold); a full target is probed at a fixed
//!   `min(backoff.max, 60s)`; a fresh genesis (forced resync or genesis restart) starts at once
//!   the first time and then backs off like a transient error, so a resync loop never spins;
//!   permanent errors stop.
//! - [`RetryPolicy::on_success`] resets the transient curve after a success;
//!   [`RetryPolicy::on_live_progress`] (a live tail apply) resets the resync curve too.
//! - The throttle curve survives success (upstream #41): one write that gets through a
//!   throttling target does not send the next one in after the shortest wait again. It starts
//!   over only after a throttle-free stretch of `backoff.max`, and it is carried from one write
//!   to the next ([`ThrottleState`]), so a throttled target is not hammered anew by every Txn.
//!
//! ## What it deliberately does not do
//! It never sleeps: callers sleep, so they can also watch for shutdown.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::SyncSection;
use crate::error::ErrorClass;

/// An exponential backoff that resets after success.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExponentialBackoff {
    initial: Duration,
    max: Duration,
    factor: u32,
    attempt: u32,
}

impl ExponentialBackoff {
    /// Waits `initial`, then `initial * factor`, ... never more than `max`.
    pub fn new(initial: Duration, max: Duration, factor: u32) -> ExponentialBackoff {
        ExponentialBackoff { initial, max: max.max(initial), factor: factor.max(1), attempt: 0 }
    }

    /// The wait before the next attempt; counts the attempt.
    pub fn next_delay(&mut self) -> Duration {
        let grown = (0..self.attempt.min(32))
            .try_fold(self.initial, |d, _| d.checked_mul(self.factor).filter(|d| *d < self.max))
            .unwrap_or(self.max);
        self.attempt = self.attempt.saturating_add(1);
        grown.min(self.max)
    }

    /// Attempts since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// Starts over at `initial`.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// What to do after an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Wait, then try the same thing again (reconnect, re-send the Txn).
    RetryAfter(Duration),
    /// Wait, then start a fresh genesis (forced resync or genesis restart).
    FreshGenesisAfter(Duration),
    /// Stop writing: phase `failed`.
    Stop,
}

/// Where the throttle curve stands: carried from one write's policy to the next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThrottleState {
    attempts: u32,
    last: Option<Instant>,
}

/// The one decision of "what now" after an error, by class; see the module doc.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    transient: ExponentialBackoff,
    throttle: ExponentialBackoff,
    /// When the target last throttled; the curve starts over after `backoff.max` without.
    throttled_at: Option<Instant>,
    throttle_quiet: Duration,
    resync: ExponentialBackoff,
    quota: Duration,
    rounds: u32,
}

impl RetryPolicy {
    /// The curves of `sync.backoff`.
    pub fn new(sync: &SyncSection) -> RetryPolicy {
        let (initial, max) = (sync.backoff.initial.get(), sync.backoff.max.get());
        RetryPolicy {
            transient: ExponentialBackoff::new(initial, max, 2),
            // Twice the transient start, but never above `max`: under tight bounds (initial =
            // max) the first throttle wait is `max`, not twice it.
            throttle: ExponentialBackoff::new((initial * 2).min(max), max, 3),
            throttled_at: None,
            throttle_quiet: max,
            resync: ExponentialBackoff::new(initial, max, 2),
            quota: max.min(Duration::from_secs(60)),
            rounds: 0,
        }
    }

    /// The action after one more error of `class`.
    pub fn on_error(&mut self, class: ErrorClass) -> Action {
        if matches!(class, ErrorClass::Transient | ErrorClass::Throttle | ErrorClass::Quota) {
            self.rounds = self.rounds.saturating_add(1);
        }
        match class {
            ErrorClass::Transient => Action::RetryAfter(self.transient.next_delay()),
            ErrorClass::Throttle => {
                if self.throttled_at.is_some_and(|at| at.elapsed() >= self.throttle_quiet) {
                    self.throttle.reset();
                }
                self.throttled_at = Some(Instant::now());
                Action::RetryAfter(self.throttle.next_delay())
            }
            ErrorClass::Quota => Action::RetryAfter(self.quota),
            ErrorClass::Resync => {
                let first = self.resync.attempts() == 0;
                let delay = self.resync.next_delay();
                Action::FreshGenesisAfter(if first { Duration::ZERO } else { delay })
            }
            ErrorClass::Permanent => Action::Stop,
        }
    }

    /// A call succeeded (a connect that reached the tail, a landed Txn): the transient wait
    /// starts over. The throttle curve does not (it starts over after `backoff.max` without
    /// throttling), nor does the resync one: a genesis that scans and then restarts has not
    /// escaped its loop.
    pub fn on_success(&mut self) {
        self.transient.reset();
        self.rounds = 0;
    }

    /// Where the throttle curve stands, for the next write's policy.
    pub fn throttle_state(&self) -> ThrottleState {
        ThrottleState { attempts: self.throttle.attempt, last: self.throttled_at }
    }

    /// Continues the throttle curve of an earlier policy.
    pub fn with_throttle_state(mut self, state: ThrottleState) -> RetryPolicy {
        self.throttle.attempt = state.attempts;
        self.throttled_at = state.last;
        self
    }

    /// A live revision was applied in the tail: every curve starts over, the resync one too.
    pub fn on_live_progress(&mut self) {
        self.on_success();
        self.resync.reset();
    }

    /// Retried errors (transient, throttle, quota) since the last success: what "3 rounds on
    /// one write" decisions count.
    pub fn rounds(&self) -> u32 {
        self.rounds
    }
}

#[cfg(test)]
#[path = "backoff_tests.rs"]
mod tests;
