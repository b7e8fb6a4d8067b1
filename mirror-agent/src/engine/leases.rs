//! Leases preserved on the target (`sync.leases = "preserve"`, SPEC §5 Leases, §11).
//!
//! For every source lease that holds a key of the range the target gets a lease with the same
//! ID and granted TTL before the first Txn that writes one of its keys ([`LeaseKeeper::txn_ops`]);
//! those puts carry it. Lease IDs come only from the `lease` field of the keys the scan and the
//! watch deliver, and each new lease's TTL from one `LeaseTimeToLive` without keys: the least
//! privilege etcd allows. Since 3.5.28 / 3.4.42 `LeaseLeases` and keep-alives are refused to a
//! user who may not read (write) every key attached, and a source lease may carry keys outside
//! the prefix, so the agent never lists leases and never keeps a source lease alive.
//!
//! While the link holds the fence, the keeper's task looks every second at each lease this run
//! keeps that is due (every third of its TTL at least, and every `progress_interval`): one `TimeToLive`
//! without keys on the source, and, while the source's lives, one keep-alive on the target, so
//! the target's remaining TTL never falls more than that below the source's. A keep-alive is a
//! stream opened for one request and its answer (etcd-client's supported API; no field of its
//! types is reached into): the answer is read every time, and a TTL of 0 (the target no longer
//! knows the lease) is acted on at once. A source lease found gone is revoked on the target once
//! the watermark has passed the revision at which it was seen gone: the expiry's deletes are
//! applied in order first, so the revoke deletes nothing the source still held.
//!
//! What the link holds is rebuilt at every start ([`LeaseKeeper::claim`]), not remembered: from a
//! keys-only read of the source range at the watermark (of the latest state when that is
//! compacted) and of the target range, so a new process after any downtime finds a target lease
//! that ran out meanwhile, grants it again and owes the reconcile pass that puts its keys back.
//!
//! Keep-alives and revokes run on the keeper's own task, started at the claim and ended with
//! the run, so only while this process holds the fence, and whatever the engine does meanwhile
//! (a scan, a prune sweep or a reconcile pass longer than a TTL, a Txn waiting on a slow
//! target): a lease already granted never lapses for want of a look. Revokes wait for the
//! fenced writer's watermark ([`mirror_fence::FencedWriter::watermarks`]). After a cutover or
//! failover, or in standby, nothing keeps the leases alive, and they run out on their TTL
//! unless a client keeps the same IDs alive on the target.
//!
//! A target lease with the same ID and another TTL is not this link's: `LeaseConflict`.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::Client;
use mirror_core::{
    ErrorClass, EtcdError, Fault, KeyRange, LeaseMode, Op, Pager, PagerOptions, Side, StatusHandle,
    SyncSection,
};
use mirror_fence::Checkpoint;
use tokio::sync::mpsc;
use tracing::warn;

mod held;

use held::Leases;

use super::EngineError;

/// The lease keeper of one connected run: the target leases the link holds ([`Leases`]), the
/// two clients it asks, and the `[sync]` settings it needs (handed over at construction and at
/// every reload, [`LeaseKeeper::configure`]). The engine asks it for the etcd ops of each Txn
/// ([`LeaseKeeper::txn_ops`]: the leases they need granted first); from the claim on, its own
/// task keeps the leases alive and revokes those whose expiry the watermark has passed, every
/// second, whatever the engine is doing (a scan, a sweep, a reconcile pass, a Txn waiting on a
/// slow target). What it tells back ([`LeaseKeeper::news`]) is whether keys were lost on the
/// target that a reconcile pass must put back, or why it stopped. The task ends with the keeper,
/// which is dropped with the run: only the fence holder keeps leases. It reports `leases` of
/// the status itself.
pub(super) struct LeaseKeeper {
    shared: Arc<Shared>,
    /// What the task has to say; none before the claim.
    news: Option<mpsc::UnboundedReceiver<LeaseNews>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// What the task says.
#[derive(Debug)]
pub(super) enum LeaseNews {
    /// A keep-alive found a target lease run out; it is granted again, and a reconcile pass is
    /// owed to put back the keys its expiry deleted.
    RepairOwed,
    /// A round failed; the task has stopped (the run ends with this error, as a failed write
    /// would).
    Failed(EngineError),
}

/// What the engine's calls and the task share.
struct Shared {
    held: tokio::sync::Mutex<Leases>,
    source: Client,
    target: Client,
    /// The settings in force; a reload replaces them.
    sync: tokio::sync::watch::Sender<SyncSection>,
    status: StatusHandle,
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl LeaseKeeper {
    /// A keeper holding nothing yet; it does anything only under `sync.leases = "preserve"`.
    pub fn new(sync: &SyncSection, source: Client, target: Client, status: StatusHandle) -> LeaseKeeper {
        let held = tokio::sync::Mutex::new(Leases::new(sync.leases == LeaseMode::Preserve));
        let sync = tokio::sync::watch::Sender::new(sync.clone());
        LeaseKeeper {
            shared: Arc::new(Shared { held, source, target, sync, status }),
            news: None,
            task: None,
        }
    }

    /// A reload's `[sync]`: deadlines, the keep-alive spacing and page sizes apply from the
    /// next call or round (the mode itself cannot change live).
    pub fn configure(&self, sync: &SyncSection) {
        self.shared.sync.send_replace(sync.clone());
    }

    /// The etcd ops of `ops`, each put with its lease where the target holds it, after granting
    /// on the target every lease they need that it does not hold yet.
    pub async fn txn_ops(&self, ops: &[Op]) -> Result<Vec<etcd_client::TxnOp>, EngineError> {
        let shared = &self.shared;
        let timeout = shared.timeout();
        let mut held = shared.held.lock().await;
        held.ensure(&shared.source, &shared.target, ops, timeout).await?;
        let txn = ops.iter().map(|op| op.to_txn_op_with(|id| held.attached(id))).collect();
        shared.report(&held);
        Ok(txn)
    }

    /// At the claim of `record`: what the link holds on the target ([`Leases::adopt`]), from
    /// keys-only reads of the source range where the target holds a copy (`windows`, cut at
    /// the scan cursor) and of the whole destination range (`target_windows`). Leases that ran
    /// out there meanwhile are granted again; true when so, and a reconcile pass is owed before
    /// the tail reports caught up. Then starts the task, which reads the watermark from
    /// `watermarks` (the fenced writer's).
    pub async fn claim(
        &mut self,
        record: &Checkpoint,
        windows: &[KeyRange],
        target_windows: Vec<KeyRange>,
        watermarks: tokio::sync::watch::Receiver<i64>,
    ) -> Result<bool, EngineError> {
        let shared = self.shared.clone();
        if shared.sync().leases != LeaseMode::Preserve {
            return Ok(false);
        }
        let watermark = record.watermark;
        let copied = copied_windows(windows, record.scanning, &record.scan_cursor);
        let in_source = match shared.leases_in(Side::Source, copied.clone(), watermark).await {
            Err(e) if e.fault == Fault::Compacted => shared.leases_in(Side::Source, copied, 0).await?,
            found => found?,
        };
        let in_target = shared.leases_in(Side::Target, target_windows, 0).await?;
        let timeout = shared.timeout();
        let mut held = shared.held.lock().await;
        let lapsed = held.adopt(&shared.source, &shared.target, &in_source, &in_target, timeout).await?;
        let owed = !lapsed.is_empty();
        if owed {
            shared.regrant(&mut held, lapsed, "found at start").await?;
        }
        shared.report(&held);
        drop(held);
        let (tell, news) = mpsc::unbounded_channel();
        self.news = Some(news);
        self.task = Some(tokio::spawn(keep(shared, watermarks, tell)));
        Ok(owed)
    }

    /// A write met `requested lease not found`: a target lease of `ops` ran out. Grants them
    /// again (the retry then lands, its keys under the same IDs); a reconcile pass is owed (the
    /// returned true): the expiry deleted every target key under the lease, and this write puts
    /// back only its own.
    pub async fn lapsed(&self, ops: &[Op]) -> Result<bool, EngineError> {
        let mut held = self.shared.held.lock().await;
        let lapsed = held.lapsed(ops);
        self.shared.regrant(&mut held, lapsed, "a write met 'requested lease not found'").await?;
        self.shared.report(&held);
        Ok(true)
    }

    /// The task's next news; never, before the claim or once the task has said why it stopped.
    pub async fn news(&mut self) -> LeaseNews {
        match self.news.as_mut() {
            Some(news) => match news.recv().await {
                Some(said) => said,
                None => std::future::pending().await,
            },
            None => std::future::pending().await,
        }
    }
}

/// The task: a round every [`LEASE_ROUND`] at the fenced writer's watermark, until a round
/// fails for good or the keeper is dropped.
///
/// A round that fails for a transient cause (a keep-alive with no answer in time, a target
/// briefly without a leader) is retried at once, then at each round, the leases it did not keep
/// still due; only [`FAILED_ROUNDS_TOLERATED`] in a row, or a permanent cause, end the run. Ending
/// the run for one lost answer cost more than it saved: the restart's claim re-reads both
/// ranges, and a lease with a TTL of a few seconds ran out on the target meanwhile, its keys
/// deleted there until a reconcile pass put them back.
async fn keep(
    shared: Arc<Shared>,
    watermarks: tokio::sync::watch::Receiver<i64>,
    tell: mpsc::UnboundedSender<LeaseNews>,
) {
    let mut every = tokio::time::interval(LEASE_ROUND);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failed = 0;
    loop {
        every.tick().await;
        let watermark = *watermarks.borrow();
        match shared.round(watermark).await {
            Ok(owed) => {
                failed = 0;
                if owed && tell.send(LeaseNews::RepairOwed).is_err() {
                    return;
                }
            }
            Err(e) if e.class() == ErrorClass::Transient && failed + 1 < FAILED_ROUNDS_TOLERATED => {
                failed += 1;
                warn!(error = %e, failed, "a lease round failed: retrying, the leases it did not keep still due");
                if failed == 1 {
                    every.reset_immediately();
                }
            }
            Err(e) => {
                let _ = tell.send(LeaseNews::Failed(e));
                return;
            }
        }
    }
}

/// How often the task looks at the leases: each is kept alive when due (every third of its TTL,
/// at most `progress_interval` apart), so a second is the resolution.
const LEASE_ROUND: Duration = Duration::from_secs(1);

/// Rounds failed in a row for a transient cause after which the run ends (its restart connects
/// afresh): the first is retried at once, the second a round later.
const FAILED_ROUNDS_TOLERATED: u32 = 3;

impl Shared {
    fn sync(&self) -> SyncSection {
        self.sync.borrow().clone()
    }

    fn timeout(&self) -> Duration {
        self.sync.borrow().request_timeout.get()
    }

    /// The leases the keys of `windows` on `side` carry, read keys-only (at `revision`; 0 for
    /// the latest state).
    async fn leases_in(
        &self,
        side: Side,
        windows: Vec<KeyRange>,
        revision: i64,
    ) -> Result<BTreeSet<i64>, EtcdError> {
        let sync = self.sync();
        let opts =
            PagerOptions::new("lease scan", sync.page_key_limit, sync.page_bytes.0 as usize, self.timeout())
                .at_revision(revision)
                .keys_only();
        let client = if side == Side::Source { &self.source } else { &self.target };
        let mut pager = Pager::new(client.kv_client(), side, windows, opts);
        let mut found = BTreeSet::new();
        while let Some(page) = pager.next_page().await? {
            found.extend(page.iter().map(|kv| kv.lease()).filter(|id| *id != 0));
        }
        Ok(found)
    }

    /// Target leases `lapsed` ran out (`how` it was seen): grant them again.
    async fn regrant(&self, held: &mut Leases, lapsed: Vec<i64>, how: &str) -> Result<(), EngineError> {
        warn!(
            ?lapsed,
            how,
            "a target lease ran out (cut off from the target, or stopped, for longer than its TTL): \
             granting it again; a reconcile pass puts back the keys its expiry deleted"
        );
        held.ensure_ids(&self.source, &self.target, lapsed, self.timeout()).await
    }

    /// A round at `watermark`: keep-alives due, revokes the watermark has passed (those the
    /// looks found gone included), and leases a keep-alive found lapsed granted again (then
    /// true: a reconcile pass is owed). The lock is taken only between the calls
    /// ([`Leases::start_round`]): a keep-alive waiting for its answer holds up no write. A
    /// failure ends the round with an error, unless leases were found lapsed: then the repair
    /// is owed first (the keeper's task retries the failure at once).
    async fn round(&self, watermark: i64) -> Result<bool, EngineError> {
        let sync = self.sync();
        let (every, timeout) = (sync.progress_interval.get(), sync.request_timeout.get());
        let Some(round) = self.held.lock().await.start_round(every) else { return Ok(false) };
        let looks = held::look(&self.source, &self.target, round.due.clone(), timeout).await;
        let (lapsed, looked, ready) = {
            let mut held = self.held.lock().await;
            let (lapsed, looked) = held.end_looks(&round, looks);
            (lapsed, looked, held.take_ready(watermark))
        };
        let revokes = held::revoke(&self.target, &ready, timeout).await;
        let mut held = self.held.lock().await;
        let failed = looked.or(held.end_revokes(revokes));
        let owed = !lapsed.is_empty();
        if owed {
            // The repair is owed whatever the grant does: its writes grant what is still
            // missing ([`LeaseKeeper::txn_ops`]), so a failed grant must not lose the news.
            if let Err(e) = self.regrant(&mut held, lapsed, "a keep-alive answered TTL 0").await {
                warn!(error = %e, "granting them again failed: the owed reconcile pass grants them");
            }
        }
        self.report(&held);
        match failed {
            Some(e) if !owed => Err(e),
            _ => Ok(owed),
        }
    }

    /// `leases` of the status.
    fn report(&self, held: &Leases) {
        let now = mirror_core::LeaseStatus {
            preserved: held.preserved() as u64,
            granted_total: held.granted_total,
            revoked_total: held.revoked_total,
            keepalive_lag_seconds: held.keepalive_lag.as_secs_f64(),
        };
        self.status.write().expect("status lock").leases = now;
    }
}

/// The part of the source range the target already holds a copy of: all of it once the
/// initial sync is complete, up to the scan cursor while it runs (`scanning`), nothing before
/// its first chunk. Only there can a target lease have lapsed and taken keys with it; leases of
/// keys not copied yet are granted as the scan reaches them.
fn copied_windows(windows: &[KeyRange], scanning: bool, cursor: &[u8]) -> Vec<KeyRange> {
    if !scanning {
        return windows.to_vec();
    }
    if cursor.is_empty() {
        return Vec::new();
    }
    let end = mirror_core::key_after(cursor);
    let cut = |w: &KeyRange| if w.end == [0] || w.end > end { end.clone() } else { w.end.clone() };
    windows
        .iter()
        .filter(|w| w.start < end)
        .map(|w| KeyRange { start: w.start.clone(), end: cut(w) })
        .collect()
}

#[cfg(test)]
mod tests {
    use mirror_core::KeyRange;

    use super::copied_windows;

    fn range(start: &[u8], end: &[u8]) -> KeyRange {
        KeyRange { start: start.to_vec(), end: end.to_vec() }
    }

    /// Where a start looks for lapsed leases: the whole range after the initial sync, the part
    /// up to and including the cursor during it, nothing before its first chunk.
    #[test]
    fn lapses_are_looked_for_only_where_the_target_holds_a_copy() {
        let windows = [range(b"/a/", b"/a/m"), range(b"/a/n", b"/a0"), range(b"/z/", &[0])];
        assert_eq!(copied_windows(&windows, false, b""), windows.to_vec());
        assert!(copied_windows(&windows, true, b"").is_empty(), "nothing copied yet");
        assert_eq!(
            copied_windows(&windows, true, b"/a/p"),
            [range(b"/a/", b"/a/m"), range(b"/a/n", b"/a/p\0")]
        );
        assert_eq!(
            copied_windows(&windows, true, b"/z/q")[2],
            range(b"/z/", b"/z/q\0"),
            "an unbounded window is cut"
        );
    }
}
