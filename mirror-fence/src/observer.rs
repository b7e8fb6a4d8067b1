//! Watching the fence from more than one place (the tail's idle check, a standby, and with HA
//! an election task): observations must never go backwards.
//!
//! ## Why a sequence number
//! Reads of the checkpoint can finish out of order (a slow member answers the older one
//! last). An observer numbers each read when it starts and keeps the highest number applied;
//! a read that finishes after a later-started one was applied is stale and dropped, so the
//! reported holder, epoch and role only ever move forward.
//!
//! ## Why the first check is shared
//! Callers that ask for the first observation at the same time (a standby and an election
//! starting together) share one read instead of each issuing their own, so they start from
//! the same view.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use tokio::sync::OnceCell;

use crate::{FenceError, Observed};

/// A sequenced view of the checkpoint key, fed by `read`.
pub struct FenceObserver<R> {
    read: R,
    started: AtomicU64,
    applied: RwLock<(u64, Option<Observed>)>,
    first: OnceCell<Observed>,
}

impl<R, F> FenceObserver<R>
where
    R: Fn() -> F,
    F: Future<Output = Result<Observed, FenceError>>,
{
    /// An observer that reads the checkpoint with `read`.
    pub fn new(read: R) -> Self {
        FenceObserver {
            read,
            started: AtomicU64::new(0),
            applied: RwLock::new((0, None)),
            first: OnceCell::new(),
        }
    }

    /// Reads the checkpoint; `Some` with the observation when it is the newest applied so far,
    /// `None` when a read started later was applied first (this one is stale).
    pub async fn observe(&self) -> Result<Option<Observed>, FenceError> {
        let seq = self.started.fetch_add(1, Ordering::SeqCst) + 1;
        let observed = (self.read)().await?;
        let mut applied = self.applied.write().expect("observer lock");
        if seq <= applied.0 {
            return Ok(None);
        }
        *applied = (seq, Some(observed.clone()));
        Ok(Some(observed))
    }

    /// The first observation, read once and shared by every caller, also concurrent ones.
    pub async fn first(&self) -> Result<Observed, FenceError> {
        self.first
            .get_or_try_init(|| async {
                let observed = self.observe().await?;
                Ok(observed.unwrap_or_else(|| self.latest().expect("a later read was applied")))
            })
            .await
            .cloned()
    }

    /// The newest observation applied, if any.
    pub fn latest(&self) -> Option<Observed> {
        self.applied.read().expect("observer lock").1.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::checkpoint::{test_record, Role};

    fn at(epoch: u64) -> Observed {
        Observed::Present {
            record: test_record("l", epoch, Role::Mirror),
            mod_revision: epoch as i64,
            create_revision: 1,
        }
    }

    /// A read that started first but finished last is dropped: epoch 2 seen, then the late
    /// answer of epoch 1 does not take the view backwards (defect #15 of issue 10).
    #[tokio::test(start_paused = true)]
    async fn a_stale_observation_is_dropped() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let observer = FenceObserver::new(move || {
            let n = c.fetch_add(1, Ordering::SeqCst);
            async move {
                // The first read is slow and sees the old epoch; the second is fast and new.
                let (delay, epoch) = if n == 0 { (200, 1) } else { (10, 2) };
                tokio::time::sleep(Duration::from_millis(delay)).await;
                Ok(at(epoch))
            }
        });
        let (slow, fast) = tokio::join!(observer.observe(), async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            observer.observe().await
        });
        assert_eq!(fast.unwrap(), Some(at(2)));
        assert_eq!(slow.unwrap(), None, "the older read finished last and is stale");
        assert_eq!(observer.latest(), Some(at(2)));
    }

    /// Concurrent first checks share one read.
    #[tokio::test(start_paused = true)]
    async fn concurrent_first_checks_share_one_read() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let observer = FenceObserver::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
            async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok(at(3))
            }
        });
        let (a, b, d) = tokio::join!(observer.first(), observer.first(), observer.first());
        assert_eq!((a.unwrap(), b.unwrap(), d.unwrap()), (at(3), at(3), at(3)));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
