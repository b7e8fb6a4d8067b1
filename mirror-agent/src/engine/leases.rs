//! Leases preserved on the target (`sync.leases = "preserve"`, SPEC §5 Leases, §11).
//!
//! For every source lease that holds a key of the range the target gets a lease with the same
//! ID and granted TTL before the first Txn that writes one of its keys ([`LeaseKeeper::ensure`]);
//! those puts carry it. Lease IDs come only from the `lease` field of the keys the scan and the
//! watch deliver, and each new lease's TTL from one `LeaseTimeToLive` without keys: the least
//! privilege etcd allows. Since 3.5.28 / 3.4.42 `LeaseLeases` and keep-alives are refused to a
//! user who may not read (write) every key attached, and a source lease may carry keys outside
//! the prefix, so the agent never lists leases and never keeps a source lease alive.
//!
//! While the link holds the fence, [`LeaseKeeper::round`] looks at each lease this run keeps when it
//! is due (every third of its TTL at least, and every `progress_interval`): one `TimeToLive`
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
//! Keep-alives and revokes run only on the engine's own task while it holds the fence (the
//! tail every second, and the initial scan, the prune sweep after it and a reconcile pass
//! beside their reads and writes, at least once a second, so a pass longer than a TTL does not
//! let the leases already granted lapse and take their keys on the target): after a cutover
//! or failover, or in standby, nothing keeps the leases alive, and they run out on their TTL
//! unless a client keeps the same IDs alive on the target.
//!
//! A target lease with the same ID and another TTL is not this link's: `LeaseConflict`.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use etcd_client::{Client, LeaseGrantOptions};
use futures::StreamExt as _;
use mirror_core::{
    unary, EtcdError, Fault, KeyRange, LeaseMode, Op, Pager, PagerOptions, Side, StatusHandle, SyncSection,
};
use mirror_fence::Checkpoint;
use tokio::time::Instant;
use tracing::{info, warn};

use super::{EngineError, Refusal};

/// One target lease this link granted (or adopted).
#[derive(Debug)]
struct Granted {
    ttl: i64,
    kept: Instant,
}

/// The target leases of this run: the keeper's state.
#[derive(Debug, Default)]
struct Leases {
    enabled: bool,
    granted: BTreeMap<i64, Granted>,
    /// Source leases found gone, with the source revision they were seen gone at.
    gone: Vec<(i64, i64)>,
    /// Grants since the agent started.
    pub granted_total: u64,
    /// Revokes since the agent started.
    pub revoked_total: u64,
    /// The longest time since a live lease was last kept alive, at the last tick.
    pub keepalive_lag: Duration,
    /// Not before this does the next tick run (a second apart, whoever calls).
    next_tick: Option<Instant>,
}

/// What a look at one lease found ([`Leases::tick`]).
enum Looked {
    /// Kept alive on the target.
    Kept(i64),
    /// The source's is gone, seen at this source revision.
    Gone(i64, i64),
    /// The source's lives; the target no longer knows it (a keep-alive answered TTL 0).
    Lapsed(i64),
}

impl Leases {
    /// `enabled`: `sync.leases = "preserve"`.
    fn new(enabled: bool) -> Leases {
        Leases { enabled, ..Leases::default() }
    }

    /// Whether puts of source lease `id` carry it to the target.
    fn attached(&self, id: i64) -> bool {
        self.enabled && self.granted.contains_key(&id)
    }

    /// Leases this run keeps on the target.
    fn preserved(&self) -> usize {
        self.granted.len()
    }

    /// At start: what the link holds, from the leases the keys of both ranges carry
    /// (`in_source`: source keys at the watermark; `in_target`: target keys now; module doc).
    /// A target lease with the same ID and TTL as a live source lease is adopted and kept
    /// alive from now on; one whose source lease is gone is revoked once the watermark passes
    /// the revision it was seen gone at. Returns the source leases that live and carry keys of
    /// the range but that the target does not hold: they ran out there meanwhile (or were never
    /// granted, after a switch from `strip`); the caller grants them and puts their keys back.
    async fn adopt(
        &mut self,
        source: &Client,
        target: &Client,
        in_source: &BTreeSet<i64>,
        in_target: &BTreeSet<i64>,
        timeout: Duration,
    ) -> Result<Vec<i64>, EngineError> {
        if !self.enabled {
            return Ok(Vec::new());
        }
        let ids: BTreeSet<i64> = in_source.union(in_target).copied().collect();
        let looks: Vec<(i64, Result<BothTtls, EtcdError>)> = futures::stream::iter(ids)
            .map(|id| async move {
                let both = async {
                    Ok((
                        ttl_of(source, Side::Source, id, timeout).await?,
                        ttl_of(target, Side::Target, id, timeout).await?,
                    ))
                };
                (id, both.await)
            })
            .buffer_unordered(LOOKS_IN_FLIGHT)
            .collect()
            .await;
        let mut lapsed = Vec::new();
        for (id, look) in looks {
            match look? {
                (Ttl { granted: Some(s), .. }, Ttl { granted: Some(t), .. }) if s == t => {
                    self.granted.insert(id, Granted { ttl: s, kept: Instant::now() });
                }
                // Another TTL: not this link's; a write under it meets `LeaseConflict`.
                (Ttl { granted: Some(_), .. }, Ttl { granted: Some(_), .. }) => {}
                (Ttl { granted: Some(_), .. }, Ttl { granted: None, .. }) if in_source.contains(&id) => {
                    lapsed.push(id)
                }
                (Ttl { granted: None, at }, Ttl { granted: Some(_), .. }) => self.gone.push((id, at)),
                _ => {}
            }
        }
        lapsed.sort_unstable();
        if !self.granted.is_empty() {
            info!(leases = self.granted.len(), "adopted the target leases of an earlier run");
        }
        Ok(lapsed)
    }

    /// Grants on the target every source lease `ops` put keys under that it does not hold yet.
    /// A source lease already gone is not granted: its keys go without it, and its expiry's
    /// deletes follow.
    async fn ensure(
        &mut self,
        source: &Client,
        target: &Client,
        ops: &[Op],
        timeout: Duration,
    ) -> Result<(), EngineError> {
        let ids: Vec<i64> = leases_of(ops).collect();
        self.ensure_ids(source, target, ids, timeout).await
    }

    /// [`Leases::ensure`] for lease IDs.
    async fn ensure_ids(
        &mut self,
        source: &Client,
        target: &Client,
        ids: impl IntoIterator<Item = i64>,
        timeout: Duration,
    ) -> Result<(), EngineError> {
        if !self.enabled {
            return Ok(());
        }
        let wanted: HashSet<i64> = ids.into_iter().filter(|id| !self.granted.contains_key(id)).collect();
        // Concurrently: a grant is a raft proposal, and a chunk of a scan can name a thousand
        // leases; one at a time they cost more than the chunk's own Txn.
        let outcomes: Vec<(i64, Result<Option<Grant>, EngineError>)> = futures::stream::iter(wanted)
            .map(|id| async move { (id, grant_same(source, target, id, timeout).await) })
            .buffer_unordered(LOOKS_IN_FLIGHT)
            .collect()
            .await;
        let mut first_error = None;
        for (id, outcome) in outcomes {
            match outcome {
                Ok(Some(grant)) => {
                    self.granted_total += u64::from(grant.new);
                    self.granted.insert(id, Granted { ttl: grant.ttl, kept: Instant::now() });
                }
                Ok(None) => {}
                Err(e) => first_error = first_error.or(Some(e)),
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The target answered that a lease `ops` put keys under does not exist: it ran out there
    /// (the target cut off, or the agent stopped, for longer than its TTL). Forgets every lease
    /// of `ops` (the answer does not say which), so [`Leases::ensure`] grants them again, and
    /// returns their IDs.
    fn lapsed(&mut self, ops: &[Op]) -> Vec<i64> {
        let named: HashSet<i64> = leases_of(ops).collect();
        self.granted.retain(|id, _| !named.contains(id));
        let mut named: Vec<i64> = named.into_iter().collect();
        named.sort_unstable();
        named
    }

    /// Looks at the leases that are due (module doc): keeps alive those whose source lease
    /// lives, marks the others gone, and revokes those the watermark has passed. Returns the
    /// leases a keep-alive found lapsed on the target, forgotten here: the caller grants them
    /// again and puts their keys back.
    async fn tick(
        &mut self,
        source: &Client,
        target: &Client,
        watermark: i64,
        every: Duration,
        timeout: Duration,
    ) -> Result<Vec<i64>, EngineError> {
        let now = Instant::now();
        if !self.enabled
            || (self.granted.is_empty() && self.gone.is_empty())
            || self.next_tick.is_some_and(|next| now < next)
        {
            return Ok(Vec::new());
        }
        self.next_tick = Some(now + Duration::from_secs(1));
        let mut lag = Duration::ZERO;
        let mut due = Vec::new();
        for (id, g) in &self.granted {
            let spacing = every.min(Duration::from_secs(g.ttl.max(1) as u64) / 3);
            if now.duration_since(g.kept) >= spacing {
                due.push(*id);
            }
            lag = lag.max(now.duration_since(g.kept));
        }
        self.keepalive_lag = lag;
        let looks: Vec<Result<Looked, EngineError>> = futures::stream::iter(due)
            .map(|id| look_at(source, target, id, timeout))
            .buffer_unordered(LOOKS_IN_FLIGHT)
            .collect()
            .await;
        let mut lapsed = Vec::new();
        let mut first_error = None;
        for look in looks {
            match look {
                Ok(Looked::Kept(id)) => {
                    if let Some(g) = self.granted.get_mut(&id) {
                        g.kept = now;
                    }
                }
                Ok(Looked::Gone(id, at)) => {
                    self.granted.remove(&id);
                    self.gone.push((id, at));
                }
                Ok(Looked::Lapsed(id)) => {
                    self.granted.remove(&id);
                    lapsed.push(id);
                }
                Err(e) => first_error = first_error.or(Some(e)),
            }
        }
        let (ready, waiting): (Vec<_>, Vec<_>) = self.gone.drain(..).partition(|(_, at)| *at <= watermark);
        self.gone = waiting;
        for (id, _) in ready {
            match unary("lease revoke", Side::Target, timeout, target.lease_client().revoke(id)).await {
                Ok(_) => self.revoked_total += 1,
                Err(e) if e.fault == Fault::LeaseNotFound => {}
                Err(e) => return Err(e.into()),
            }
        }
        lapsed.sort_unstable();
        match first_error {
            // The lapsed are forgotten: say so before the error ends the round.
            Some(e) if lapsed.is_empty() => Err(e),
            _ => Ok(lapsed),
        }
    }
}

/// One due lease: its source TTL, then one keep-alive on the target while the source's lives.
async fn look_at(
    source: &Client,
    target: &Client,
    id: i64,
    timeout: Duration,
) -> Result<Looked, EngineError> {
    let ttl = ttl_of(source, Side::Source, id, timeout).await?;
    if ttl.granted.is_none() {
        return Ok(Looked::Gone(id, ttl.at));
    }
    // A stream for one request: etcd-client sends the request, reads the answer and fails
    // with "lease not found" on a TTL of 0.
    match unary("lease keep-alive", Side::Target, timeout, target.lease_client().keep_alive(id)).await {
        Ok(_) => Ok(Looked::Kept(id)),
        Err(e) if e.fault == Fault::LeaseNotFound => Ok(Looked::Lapsed(id)),
        Err(e) => Err(e.into()),
    }
}

/// The lease keeper of one connected run: the target leases the link holds ([`Leases`]), the
/// two clients it asks, and the `[sync]` settings it needs (handed over at construction and at
/// every reload, [`LeaseKeeper::configure`]). The engine hands it the ops of each Txn before the
/// Txn is sent and the watermark at each round; what it tells back is whether keys were lost on
/// the target that a reconcile pass must put back. It reports `leases` of the status itself.
pub(super) struct LeaseKeeper {
    held: Leases,
    source: Client,
    target: Client,
    sync: SyncSection,
    status: StatusHandle,
}

impl LeaseKeeper {
    /// A keeper holding nothing yet; it does anything only under `sync.leases = "preserve"`.
    pub fn new(sync: &SyncSection, source: Client, target: Client, status: StatusHandle) -> LeaseKeeper {
        let held = Leases::new(sync.leases == LeaseMode::Preserve);
        LeaseKeeper { held, source, target, sync: sync.clone(), status }
    }

    /// A reload's `[sync]`: deadlines, the keep-alive spacing and page sizes apply from the
    /// next call (the mode itself cannot change live).
    pub fn configure(&mut self, sync: &SyncSection) {
        self.sync = sync.clone();
    }

    fn timeout(&self) -> Duration {
        self.sync.request_timeout.get()
    }

    /// Grants the leases `ops` need on the target before they are written.
    pub async fn ensure(&mut self, ops: &[Op]) -> Result<(), EngineError> {
        let timeout = self.timeout();
        self.held.ensure(&self.source, &self.target, ops, timeout).await?;
        self.report();
        Ok(())
    }

    /// At the claim of `record`: what the link holds on the target ([`Leases::adopt`]), from
    /// keys-only reads of the source range where the target holds a copy (`windows`, cut at
    /// the scan cursor) and of the whole destination range (`target_windows`). Leases that ran
    /// out there meanwhile are granted again; true when so, and a reconcile pass is owed before
    /// the tail reports caught up.
    pub async fn claim(
        &mut self,
        record: &Checkpoint,
        windows: &[KeyRange],
        target_windows: Vec<KeyRange>,
    ) -> Result<bool, EngineError> {
        if self.sync.leases != LeaseMode::Preserve {
            return Ok(false);
        }
        let watermark = record.watermark;
        let copied = copied_windows(windows, record.scanning, &record.scan_cursor);
        let in_source = match self.leases_in(Side::Source, copied.clone(), watermark).await {
            Err(e) if e.fault == Fault::Compacted => self.leases_in(Side::Source, copied, 0).await?,
            found => found?,
        };
        let in_target = self.leases_in(Side::Target, target_windows, 0).await?;
        let timeout = self.timeout();
        let lapsed = self.held.adopt(&self.source, &self.target, &in_source, &in_target, timeout).await?;
        let owed = !lapsed.is_empty();
        if owed {
            self.regrant(lapsed, "found at start").await?;
        }
        self.report();
        Ok(owed)
    }

    /// The leases the keys of `windows` on `side` carry, read keys-only (at `revision`; 0 for
    /// the latest state).
    async fn leases_in(
        &self,
        side: Side,
        windows: Vec<KeyRange>,
        revision: i64,
    ) -> Result<BTreeSet<i64>, EtcdError> {
        let sync = &self.sync;
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

    /// A write met `requested lease not found`: a target lease of `ops` ran out. Grants them
    /// again (the retry then lands, its keys under the same IDs); a reconcile pass is owed (the
    /// returned true): the expiry deleted every target key under the lease, and this write puts
    /// back only its own.
    pub async fn lapsed(&mut self, ops: &[Op]) -> Result<bool, EngineError> {
        let lapsed = self.held.lapsed(ops);
        self.regrant(lapsed, "a write met 'requested lease not found'").await?;
        Ok(true)
    }

    /// Target leases `lapsed` ran out (`how` it was seen): grant them again.
    async fn regrant(&mut self, lapsed: Vec<i64>, how: &str) -> Result<(), EngineError> {
        warn!(
            ?lapsed,
            how,
            "a target lease ran out (cut off from the target, or stopped, for longer than its TTL): \
             granting it again; a reconcile pass puts back the keys its expiry deleted"
        );
        let timeout = self.timeout();
        self.held.ensure_ids(&self.source, &self.target, lapsed, timeout).await?;
        self.report();
        Ok(())
    }

    /// A round at `watermark`: keep-alives due, revokes the watermark has passed, and leases a
    /// keep-alive found lapsed granted again (then true: a reconcile pass is owed).
    pub async fn round(&mut self, watermark: i64) -> Result<bool, EngineError> {
        let (every, timeout) = (self.sync.progress_interval.get(), self.timeout());
        let lapsed = self.held.tick(&self.source, &self.target, watermark, every, timeout).await?;
        let owed = !lapsed.is_empty();
        if owed {
            self.regrant(lapsed, "a keep-alive answered TTL 0").await?;
        }
        self.report();
        Ok(owed)
    }

    /// `leases` of the status.
    fn report(&self) {
        let l = &self.held;
        let now = mirror_core::LeaseStatus {
            preserved: l.preserved() as u64,
            granted_total: l.granted_total,
            revoked_total: l.revoked_total,
            keepalive_lag_seconds: l.keepalive_lag.as_secs_f64(),
        };
        self.status.write().expect("status lock").leases = now;
    }

    /// The etcd ops of `ops`, each put with its lease where the target holds it.
    pub fn txn_ops(&self, ops: &[Op]) -> Vec<etcd_client::TxnOp> {
        ops.iter().map(|op| op.to_txn_op_with(|id| self.held.attached(id))).collect()
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

/// The source leases the puts of `ops` name (with repeats).
fn leases_of(ops: &[Op]) -> impl Iterator<Item = i64> + '_ {
    ops.iter().filter_map(|op| match op {
        Op::Put { lease, .. } if *lease != 0 => Some(*lease),
        _ => None,
    })
}

/// Lease grants and looks in flight at once.
const LOOKS_IN_FLIGHT: usize = 128;

/// A target lease as [`grant_same`] left it.
struct Grant {
    ttl: i64,
    /// Granted now, not found there already.
    new: bool,
}

/// Grants on the target source lease `id` with its granted TTL; `None` when the source lease
/// is already gone. The same ID already there with the same TTL is ours (an earlier grant whose
/// answer was lost, or an earlier run's); with another TTL it is a `LeaseConflict`.
async fn grant_same(
    source: &Client,
    target: &Client,
    id: i64,
    timeout: Duration,
) -> Result<Option<Grant>, EngineError> {
    let Some(ttl) = ttl_of(source, Side::Source, id, timeout).await?.granted else { return Ok(None) };
    let opts = LeaseGrantOptions::new().with_id(id);
    match unary("lease grant", Side::Target, timeout, target.lease_client().grant(ttl, Some(opts))).await {
        Ok(_) => Ok(Some(Grant { ttl, new: true })),
        Err(e) if e.fault == Fault::LeaseExists => {
            let theirs = ttl_of(target, Side::Target, id, timeout).await?.granted.unwrap_or(0);
            if theirs != ttl {
                return Err(Refusal::LeaseConflict { id, source_ttl: ttl, target_ttl: theirs }.into());
            }
            Ok(Some(Grant { ttl, new: false }))
        }
        Err(e) => Err(e.into()),
    }
}

/// A lease's TTL on the source and on the target.
type BothTtls = (Ttl, Ttl);

/// One `LeaseTimeToLive` answer.
struct Ttl {
    /// The lease's granted TTL; `None` when the side does not know it.
    granted: Option<i64>,
    /// The revision the answer was made at.
    at: i64,
}

/// A lease's granted TTL on a side, asked without keys (needs only authentication, SPEC §11).
async fn ttl_of(client: &Client, side: Side, id: i64, timeout: Duration) -> Result<Ttl, EtcdError> {
    let resp = unary("lease ttl", side, timeout, client.lease_client().time_to_live(id, None)).await?;
    let at = resp.header().map_or(0, |h| h.revision());
    Ok(Ttl { granted: (resp.ttl() >= 0).then_some(resp.granted_ttl()), at })
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
