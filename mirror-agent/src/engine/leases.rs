//! Leases preserved on the target (`sync.leases = "preserve"`, SPEC §5 Leases).
//!
//! For every source lease that holds a key of the range the target gets a lease with the same
//! ID and granted TTL before the first Txn that writes one of its keys ([`Leases::ensure`]);
//! those puts carry it. While the tail runs, [`Leases::tick`] lists the source's live leases
//! (one `LeaseLeases` call), keeps each of ours whose source lease lives alive on one
//! keep-alive stream (every request names its ID; no task per lease) at least every third of
//! its TTL and every `progress_interval`, so the target's remaining TTL never falls more than
//! that below the source's, and revokes ours once the source's is gone and the watermark has
//! passed the revision at which it was seen gone: the expiry's deletes are applied in order
//! first, so the revoke deletes nothing the source still held.
//!
//! Keep-alives and revokes run only on the engine's own task while it holds the fence (the
//! tail every second, and the initial scan, the prune sweep after it and a reconcile pass
//! beside their reads and writes, at least once a second, so a pass longer than a TTL does not
//! let the leases already granted lapse and take their keys on the target): after a cutover
//! or failover, or in standby, nothing keeps the leases alive, and they run out on their TTL
//! unless a client keeps the same IDs alive on the target.
//!
//! A target lease with the same ID and another TTL is not this link's: `LeaseConflict`.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use etcd_client::{Client, LeaseGrantOptions, LeaseKeeper};
use futures::StreamExt as _;
use mirror_core::{unary, EtcdError, Op, Side};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

use super::{EngineError, Refusal, Run};

/// One target lease this link granted (or adopted).
#[derive(Debug)]
struct Granted {
    ttl: i64,
    kept: Instant,
}

/// The task reading the keep-alive answers, aborted with the run.
#[derive(Debug)]
struct Drain(JoinHandle<()>);

impl Drop for Drain {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The target leases of this run.
#[derive(Debug, Default)]
pub(super) struct Leases {
    enabled: bool,
    granted: BTreeMap<i64, Granted>,
    /// Source leases found gone, with the source revision they were seen gone at.
    gone: Vec<(i64, i64)>,
    keeper: Option<LeaseKeeper>,
    /// Reads the keep-alive answers; aborted with the run.
    drain: Option<Drain>,
    /// Grants since the agent started.
    pub granted_total: u64,
    /// Revokes since the agent started.
    pub revoked_total: u64,
    /// The longest time since a live lease was last kept alive, at the last tick.
    pub keepalive_lag: Duration,
    /// Not before this does the next tick run (a second apart, whoever calls).
    next_tick: Option<Instant>,
    /// Whether [`Leases::adopt`] ran: only then is `granted` what this run keeps.
    adopted: bool,
}

impl Leases {
    /// `enabled`: `sync.leases = "preserve"`.
    pub fn new(enabled: bool) -> Leases {
        Leases { enabled, ..Leases::default() }
    }

    /// Whether puts of source lease `id` carry it to the target.
    pub fn attached(&self, id: i64) -> bool {
        self.enabled && self.granted.contains_key(&id)
    }

    /// Leases this run keeps on the target.
    pub fn preserved(&self) -> usize {
        self.granted.len()
    }

    /// At start: adopts the target leases a previous run granted (same ID and TTL as a live
    /// source lease), so they are kept alive although no write names them again. Returns those
    /// of `held` (what the last run of this process kept) whose source lease lives but that the
    /// target no longer holds: they ran out there meanwhile.
    pub async fn adopt(
        &mut self,
        source: &Client,
        target: &Client,
        held: &std::collections::BTreeSet<i64>,
        timeout: Duration,
    ) -> Result<Vec<i64>, EngineError> {
        if !self.enabled {
            return Ok(Vec::new());
        }
        let live = list(source, Side::Source, timeout).await?.0;
        let there = list(target, Side::Target, timeout).await?.0;
        let lapsed = held.iter().filter(|id| live.contains(id) && !there.contains(id)).copied().collect();
        for id in live.intersection(&there) {
            let (Some(s), Some(t)) = (
                ttl_of(source, Side::Source, *id, timeout).await?,
                ttl_of(target, Side::Target, *id, timeout).await?,
            ) else {
                continue;
            };
            if s == t {
                self.granted.insert(*id, Granted { ttl: s, kept: Instant::now() });
            }
        }
        if !self.granted.is_empty() {
            info!(leases = self.granted.len(), "adopted the target leases of an earlier run");
        }
        self.adopted = true;
        Ok(lapsed)
    }

    /// The leases this run keeps on the target, once [`Leases::adopt`] ran (None before, and
    /// without `preserve`).
    pub fn held(&self) -> Option<std::collections::BTreeSet<i64>> {
        (self.enabled && self.adopted).then(|| self.granted.keys().copied().collect())
    }

    /// Grants on the target every source lease `ops` put keys under that it does not hold yet.
    /// A source lease already gone is not granted: its keys go without it, and its expiry's
    /// deletes follow.
    pub async fn ensure(
        &mut self,
        source: &Client,
        target: &Client,
        ops: &[Op],
        timeout: Duration,
    ) -> Result<(), EngineError> {
        if !self.enabled {
            return Ok(());
        }
        let wanted: HashSet<i64> = leases_of(ops).filter(|id| !self.granted.contains_key(id)).collect();
        // Concurrently: a grant is a raft proposal, and a chunk of a scan can name a thousand
        // leases; one at a time they cost more than the chunk's own Txn.
        let outcomes: Vec<(i64, Result<Option<Grant>, EngineError>)> = futures::stream::iter(wanted)
            .map(|id| async move { (id, grant_same(source, target, id, timeout).await) })
            .buffer_unordered(GRANTS_IN_FLIGHT)
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
    pub fn lapsed(&mut self, ops: &[Op]) -> Vec<i64> {
        let named: HashSet<i64> = leases_of(ops).collect();
        self.granted.retain(|id, _| !named.contains(id));
        let mut named: Vec<i64> = named.into_iter().collect();
        named.sort_unstable();
        named
    }

    /// Keeps alive the leases whose source lease lives and that are due; marks the others gone
    /// and revokes those the watermark has passed (module doc).
    pub async fn tick(
        &mut self,
        source: &Client,
        target: &Client,
        watermark: i64,
        every: Duration,
        timeout: Duration,
    ) -> Result<(), EngineError> {
        let now = Instant::now();
        if !self.enabled
            || (self.granted.is_empty() && self.gone.is_empty())
            || self.next_tick.is_some_and(|next| now < next)
        {
            return Ok(());
        }
        self.next_tick = Some(now + Duration::from_secs(1));
        let (live, at) = list(source, Side::Source, timeout).await?;
        let mut due = Vec::new();
        let mut lag = Duration::ZERO;
        self.granted.retain(|id, g| {
            if !live.contains(id) {
                self.gone.push((*id, at));
                return false;
            }
            let spacing = every.min(Duration::from_secs(g.ttl.max(1) as u64) / 3);
            if now.duration_since(g.kept) >= spacing {
                due.push(*id);
            }
            lag = lag.max(now.duration_since(g.kept));
            true
        });
        self.keepalive_lag = lag;
        for id in due {
            self.keep_alive(target, id).await?;
            if let Some(g) = self.granted.get_mut(&id) {
                g.kept = now;
            }
        }
        let (ready, waiting): (Vec<_>, Vec<_>) = self.gone.drain(..).partition(|(_, at)| *at <= watermark);
        self.gone = waiting;
        for (id, _) in ready {
            match unary("lease revoke", Side::Target, timeout, target.lease_client().revoke(id)).await {
                Ok(_) => self.revoked_total += 1,
                Err(e) if e.to_string().contains("not found") => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// One keep-alive request for `id` on the shared stream (opened on first use; a broken
    /// stream is opened again at the next call).
    async fn keep_alive(&mut self, target: &Client, id: i64) -> Result<(), EngineError> {
        if self.drain.as_ref().is_some_and(|d| d.0.is_finished()) {
            self.keeper = None;
        }
        if let Some(keeper) = &mut self.keeper {
            // One stream for every lease: each request names its ID.
            keeper.id = id;
            if keeper.keep_alive().await.is_ok() {
                return Ok(());
            }
            self.keeper = None;
        }
        let (keeper, mut stream) = target
            .lease_client()
            .keep_alive(id)
            .await
            .map_err(|e| EtcdError::new("lease keep-alive", Side::Target, e))?;
        // The answers only need reading: a lease the target no longer knows shows at the next
        // grant or revoke.
        self.drain = Some(Drain(tokio::spawn(async move {
            loop {
                match stream.message().await {
                    Ok(Some(_)) => {}
                    Ok(None) => return,
                    Err(e) => {
                        warn!("lease keep-alive stream ended: {e}");
                        return;
                    }
                }
            }
        })));
        self.keeper = Some(keeper);
        Ok(())
    }
}

impl Run<'_> {
    /// Grants the leases `ops` need on the target before they are written.
    pub(super) async fn ensure_leases(&mut self, ops: &[Op]) -> Result<(), EngineError> {
        let timeout = self.timeout();
        self.leases.ensure(&self.source, &self.target, ops, timeout).await?;
        self.report_leases();
        Ok(())
    }

    /// A write met `requested lease not found`: a target lease of `ops` ran out. Grants them
    /// again (the retry then lands, its keys under the same IDs) and owes a reconcile pass: the
    /// expiry deleted every target key under the lease, and this write puts back only its own.
    pub(super) async fn lease_lapsed(&mut self, ops: &[Op]) -> Result<(), EngineError> {
        let lapsed = self.leases.lapsed(ops);
        warn!(
            ?lapsed,
            "a target lease ran out (cut off from the target, or stopped, for longer than its TTL): \
             granting it again; a reconcile pass puts back the keys its expiry deleted"
        );
        self.engine.repair_owed = true;
        self.ensure_leases(ops).await
    }

    /// The tail's lease round: keep-alives due, revokes the watermark has passed.
    pub(super) async fn lease_round(&mut self) -> Result<(), EngineError> {
        let watermark = self.writer().record().watermark;
        let (every, timeout) = (self.cfg().sync.progress_interval.get(), self.timeout());
        self.leases.tick(&self.source, &self.target, watermark, every, timeout).await?;
        self.report_leases();
        Ok(())
    }

    /// `leases` of the status.
    pub(super) fn report_leases(&self) {
        let l = &self.leases;
        let now = mirror_core::LeaseStatus {
            preserved: l.preserved() as u64,
            granted_total: l.granted_total,
            revoked_total: l.revoked_total,
            keepalive_lag_seconds: l.keepalive_lag.as_secs_f64(),
        };
        self.engine.update(|s| s.leases = now);
    }

    /// The etcd ops of `ops`, each put with its lease where the target holds it.
    pub(super) fn txn_ops(&self, ops: &[Op]) -> Vec<etcd_client::TxnOp> {
        ops.iter().map(|op| op.to_txn_op_with(|id| self.leases.attached(id))).collect()
    }
}

/// The source leases the puts of `ops` name (with repeats).
fn leases_of(ops: &[Op]) -> impl Iterator<Item = i64> + '_ {
    ops.iter().filter_map(|op| match op {
        Op::Put { lease, .. } if *lease != 0 => Some(*lease),
        _ => None,
    })
}

/// Lease grants in flight at once in [`Leases::ensure`].
const GRANTS_IN_FLIGHT: usize = 128;

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
    let Some(ttl) = ttl_of(source, Side::Source, id, timeout).await? else { return Ok(None) };
    let opts = LeaseGrantOptions::new().with_id(id);
    match unary("lease grant", Side::Target, timeout, target.lease_client().grant(ttl, Some(opts))).await {
        Ok(_) => Ok(Some(Grant { ttl, new: true })),
        Err(e) if e.to_string().contains("lease already exists") => {
            let theirs = ttl_of(target, Side::Target, id, timeout).await?.unwrap_or(0);
            if theirs != ttl {
                return Err(Refusal::LeaseConflict { id, source_ttl: ttl, target_ttl: theirs }.into());
            }
            Ok(Some(Grant { ttl, new: false }))
        }
        Err(e) => Err(e.into()),
    }
}

/// The IDs of every lease of a side, and the revision the answer was made at.
async fn list(client: &Client, side: Side, timeout: Duration) -> Result<(HashSet<i64>, i64), EtcdError> {
    let resp = unary("lease list", side, timeout, client.lease_client().leases()).await?;
    let at = resp.header().map_or(0, |h| h.revision());
    Ok((resp.leases().iter().map(|l| l.id()).collect(), at))
}

/// A lease's granted TTL on a side, or `None` when the side does not know it.
async fn ttl_of(client: &Client, side: Side, id: i64, timeout: Duration) -> Result<Option<i64>, EtcdError> {
    let resp = unary("lease ttl", side, timeout, client.lease_client().time_to_live(id, None)).await?;
    Ok((resp.ttl() >= 0).then_some(resp.granted_ttl()))
}
