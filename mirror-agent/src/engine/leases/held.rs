//! The target leases of one run, as the [`super::LeaseKeeper`] holds them: what is granted
//! (or adopted), what is gone on the source and waits for the watermark, and the etcd calls
//! that grant, look at and revoke them. The keeper serializes every use of it.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use etcd_client::{Client, LeaseGrantOptions};
use futures::StreamExt as _;
use mirror_core::{keep_alive_once, unary, EtcdError, Fault, Op, Side};
use tokio::time::Instant;
use tracing::info;

use super::super::{EngineError, Refusal};

/// One target lease this link granted (or adopted).
#[derive(Debug)]
struct Granted {
    ttl: i64,
    kept: Instant,
}

/// The target leases of this run: the keeper's state.
#[derive(Debug, Default)]
pub(super) struct Leases {
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

/// What a look at one lease found ([`look`]).
pub(super) enum Looked {
    /// Kept alive on the target.
    Kept(i64),
    /// The source's is gone, seen at this source revision.
    Gone(i64, i64),
    /// The source's lives; the target no longer knows it (a keep-alive answered TTL 0).
    Lapsed(i64),
}

impl Leases {
    /// `enabled`: `sync.leases = "preserve"`.
    pub(super) fn new(enabled: bool) -> Leases {
        Leases { enabled, ..Leases::default() }
    }

    /// Whether puts of source lease `id` carry it to the target.
    pub(super) fn attached(&self, id: i64) -> bool {
        self.enabled && self.granted.contains_key(&id)
    }

    /// Leases this run keeps on the target.
    pub(super) fn preserved(&self) -> usize {
        self.granted.len()
    }

    /// At start: what the link holds, from the leases the keys of both ranges carry
    /// (`in_source`: source keys at the watermark; `in_target`: target keys now; module doc).
    /// A target lease with the same ID and TTL as a live source lease is adopted and kept
    /// alive from now on; one whose source lease is gone is revoked once the watermark passes
    /// the revision it was seen gone at. Returns the source leases that live and carry keys of
    /// the range but that the target does not hold: they ran out there meanwhile (or were never
    /// granted, after a switch from `strip`); the caller grants them and puts their keys back.
    pub(super) async fn adopt(
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
    pub(super) async fn ensure(
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
    pub(super) async fn ensure_ids(
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
    pub(super) fn lapsed(&mut self, ops: &[Op]) -> Vec<i64> {
        let named: HashSet<i64> = leases_of(ops).collect();
        self.granted.retain(|id, _| !named.contains(id));
        let mut named: Vec<i64> = named.into_iter().collect();
        named.sort_unstable();
        named
    }

    /// The start of a round (module doc): the leases due a look; `None` when nothing is held
    /// or the last round was less than a second ago. The round's calls run without the
    /// keeper's lock ([`look`], [`revoke`]): the engine's writes, which take it to attach
    /// leases, never wait for a keep-alive's answer. [`Leases::end_looks`] takes in what the
    /// looks found, [`Leases::take_ready`] the leases to revoke (those found gone included) and
    /// [`Leases::end_revokes`] which revokes failed.
    pub(super) fn start_round(&mut self, every: Duration) -> Option<Round> {
        let now = Instant::now();
        if !self.enabled
            || (self.granted.is_empty() && self.gone.is_empty())
            || self.next_tick.is_some_and(|next| now < next)
        {
            return None;
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
        Some(Round { sent: now, due })
    }

    /// What the looks of `round` found: the leases a keep-alive found lapsed on the target,
    /// forgotten here (the caller grants them again and puts their keys back), and the first
    /// failure. A look at a lease no longer held, or granted again since the round started (a
    /// write found it lapsed meanwhile), is passed over.
    pub(super) fn end_looks(
        &mut self,
        round: &Round,
        looks: Vec<Result<Looked, EngineError>>,
    ) -> (Vec<i64>, Option<EngineError>) {
        let mut lapsed = Vec::new();
        let mut first_error = None;
        // Granted (again) since the round started: what the look found is not about it.
        let looked_at = |held: &Leases, id: &i64| held.granted.get(id).is_some_and(|g| g.kept <= round.sent);
        for look in looks {
            match look {
                Ok(Looked::Kept(id)) => {
                    if let Some(g) = self.granted.get_mut(&id) {
                        g.kept = g.kept.max(round.sent);
                    }
                }
                Ok(Looked::Gone(id, at)) if looked_at(self, &id) => {
                    self.granted.remove(&id);
                    self.gone.push((id, at));
                }
                Ok(Looked::Lapsed(id)) if looked_at(self, &id) => {
                    self.granted.remove(&id);
                    lapsed.push(id);
                }
                Ok(Looked::Gone(..) | Looked::Lapsed(_)) => {}
                Err(e) => first_error = first_error.or(Some(e)),
            }
        }
        if first_error.is_some() {
            // What failed is due again at once: the keeper retries a transient failure.
            self.next_tick = None;
        }
        lapsed.sort_unstable();
        (lapsed, first_error)
    }

    /// The leases gone on the source whose expiry the watermark has passed, taken to be
    /// revoked (ID, revision seen gone): the revoke deletes nothing the source still holds.
    pub(super) fn take_ready(&mut self, watermark: i64) -> Vec<(i64, i64)> {
        let (ready, waiting): (Vec<_>, Vec<_>) = self.gone.drain(..).partition(|(_, at)| *at <= watermark);
        self.gone = waiting;
        ready
    }

    /// What the revokes did: a revoke that failed is owed still, at the next round, retried at
    /// once; the first failure.
    pub(super) fn end_revokes(&mut self, revokes: Revokes) -> Option<EngineError> {
        self.revoked_total += revokes.done;
        self.gone.extend(revokes.owed);
        if revokes.error.is_some() {
            self.next_tick = None;
        }
        revokes.error
    }
}

/// One round of the keeper ([`Leases::start_round`]).
pub(super) struct Round {
    /// When it started: a lease it kept alive lives a TTL from then at least.
    sent: Instant,
    /// The leases due a look.
    pub(super) due: Vec<i64>,
}

/// Looks at the leases of `ids` (below [`LOOKS_IN_FLIGHT`] at once), without the keeper's lock.
pub(super) async fn look(
    source: &Client,
    target: &Client,
    ids: Vec<i64>,
    timeout: Duration,
) -> Vec<Result<Looked, EngineError>> {
    futures::stream::iter(ids)
        .map(|id| look_at(source, target, id, timeout))
        .buffer_unordered(LOOKS_IN_FLIGHT)
        .collect()
        .await
}

/// What the revokes of a round did ([`revoke`]).
#[derive(Default)]
pub(super) struct Revokes {
    /// Revoked, or found gone already.
    done: u64,
    /// Not revoked (ID, revision seen gone): owed still, at the next round.
    owed: Vec<(i64, i64)>,
    /// The first failure.
    error: Option<EngineError>,
}

/// Revokes the target leases of `ready` (ID, revision seen gone), one after another, without
/// the keeper's lock; one that fails stays owed, so nothing ready is dropped.
pub(super) async fn revoke(target: &Client, ready: &[(i64, i64)], timeout: Duration) -> Revokes {
    let mut out = Revokes::default();
    for &(id, at) in ready {
        match unary("lease revoke", Side::Target, timeout, target.lease_client().revoke(id)).await {
            Ok(_) => out.done += 1,
            Err(e) if e.fault == Fault::LeaseNotFound => out.done += 1,
            Err(e) => {
                out.owed.push((id, at));
                out.error = out.error.or(Some(e.into()));
            }
        }
    }
    out
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
    match keep_alive_once(target, id, timeout).await? {
        true => Ok(Looked::Kept(id)),
        false => Ok(Looked::Lapsed(id)),
    }
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
