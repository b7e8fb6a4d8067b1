//! The target leases of an exact replica (SPEC §10, Leases): the same IDs as the source's,
//! none of which may run out on the target while the link runs, for a lease that runs out
//! deletes its keys at a target revision of its own.
//! - Leases that came with the snapshot keep the TTL they have (etcd cannot lengthen one);
//!   leases the agent grants get `sync.exact_lease_hold` (or the source's TTL where longer),
//!   so they outlive an outage of every agent.
//! - Each lease the link grants has its source TTL recorded under the reserved namespace
//!   (`\0etcd-mirror/<link_uid>/leases/<id>`) in the Txn that first uses it, and the record is
//!   deleted in the Txn after its revoke: `failover` swaps each long lease for one of that TTL.
//! - Every one is kept alive at a third of its TTL, and revoked only once the Txn that took its
//!   last key has landed and a read of the lease shows it holds no key: a revoke then adds no
//!   revision. The keys each lease holds on the target are counted ([`Count`]: read when the
//!   agent adopts the lease, 0 when it grants one, then followed revision by revision), so a
//!   key leaving a lease that still holds others costs no read: on a Kubernetes control plane
//!   an event updated past the API server's lease-reuse window leaves a lease that may hold
//!   thousands of events, and listing them inline held up every revision behind it.
//! - One found gone that held keys deleted them at a revision the source never had: the tail's
//!   fence check names it as a foreign write. One gone without keys (revoked by another replica
//!   of the link) changed nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{Client, LeaseGrantOptions, LeaseTimeToLiveOptions, TxnOp};
use futures::StreamExt as _;
use mirror_core::{keep_alive_once, unary, Config, ErrorClass, EtcdError, ExactRevision, Fault, Side};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::Stop;

/// A target lease the link holds.
#[derive(Debug)]
struct Held {
    /// Its granted TTL, seconds.
    ttl: i64,
    /// When it was last kept alive.
    kept: Instant,
    /// It came with the snapshot (its TTL is the source's, not the hold).
    snapshot: bool,
    /// The keys it holds on the target, where known.
    keys: Option<Count>,
}

/// The keys a target lease holds, as of a target revision: read there when the agent adopts
/// the lease (its key list and the revision of the answer; none of the agent's Txns is in
/// flight then), or 0 at a grant, then followed by every revision landed after it
/// ([`Count::follow`]). Not taken from a read while Txns are in flight: etcd lists a lease's
/// keys and fills the answer's revision one after the other, and a Txn applied in between is
/// in one and not the other. Only ever a reason to skip a read: a lease is revoked only after a
/// read showed it empty, so a count that went wrong costs a read (too low: the count is then
/// dropped) or keeps an empty lease alive until the next run counts again (too high), never a
/// key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Count {
    keys: u64,
    /// The target revision it is as of: revisions up to it are in it.
    at: i64,
}

impl Count {
    /// The count after `revision`, which added `delta` keys to the lease ([`deltas`]); a
    /// revision the count already holds changes nothing.
    fn follow(self, revision: i64, delta: i64) -> Count {
        if revision <= self.at {
            return self;
        }
        Count { keys: (self.keys as i64 + delta).max(0) as u64, at: revision }
    }
}

/// What revision `rev`'s changes do to each lease's keys, in one pass: each key put under a
/// lease it was not under before adds one to it, each key that leaves a lease (deleted, or put
/// under another lease) takes one from it.
fn deltas(rev: &ExactRevision) -> BTreeMap<i64, i64> {
    let mut deltas = BTreeMap::new();
    let mut add = |lease: i64, n: i64| {
        if lease != 0 {
            *deltas.entry(lease).or_insert(0) += n;
        }
    };
    for change in &rev.changes {
        match change {
            mirror_core::Change::Put { lease, prev_lease, .. } if lease != prev_lease => {
                add(*lease, 1);
                add(*prev_lease, -1);
            }
            mirror_core::Change::Put { .. } => {}
            mirror_core::Change::Delete { prev_lease, .. } => add(*prev_lease, -1),
        }
    }
    deltas
}

/// The target leases of the link, with the clients that grant, keep and revoke them.
pub(super) struct TargetLeases {
    source: Client,
    target: Client,
    hold: i64,
    timeout: Duration,
    held: BTreeMap<i64, Held>,
    /// The reserved namespace's `leases/` prefix: one record per granted lease, its source TTL.
    records: Vec<u8>,
    /// Record puts and deletes for the next Txn to carry.
    riders: Vec<TxnOp>,
    /// Rounds of keep-alives in a row with a transient failure ([`TargetLeases::keep_due`]).
    failed_rounds: u32,
}

/// Rounds of keep-alives in a row with a transient failure after which the run ends.
const FAILED_ROUNDS_TOLERATED: u32 = 3;

/// The prefix of the link's lease TTL records: `\0etcd-mirror/<link_uid>/leases/`.
pub(crate) fn lease_records(cfg: &Config) -> Vec<u8> {
    let checkpoint = cfg.checkpoint_key();
    let link = &checkpoint[..checkpoint.len() - b"checkpoint".len()];
    [link, b"leases/"].concat()
}

/// The key of lease `id`'s TTL record under `prefix`.
pub(crate) fn record_key(prefix: &[u8], id: i64) -> Vec<u8> {
    [prefix, format!("{id:016x}").as_bytes()].concat()
}

impl TargetLeases {
    /// Takes over every lease the target holds now and keeps each alive at once (a restored
    /// target's leases start over at their TTL when it elects a leader; Kubernetes' master
    /// leases live 15 s).
    pub(super) async fn adopt(
        source: Client,
        target: Client,
        hold: Duration,
        timeout: Duration,
        records: Vec<u8>,
    ) -> Result<TargetLeases, Stop> {
        let hold = hold.as_secs() as i64;
        let listed =
            unary("list target leases", Side::Target, timeout, target.lease_client().leases()).await?;
        let mut leases = TargetLeases {
            source,
            target,
            hold,
            timeout,
            held: BTreeMap::new(),
            records,
            riders: Vec::new(),
            failed_rounds: 0,
        };
        for lease in listed.leases() {
            let id = lease.id();
            let ttl = leases.ttl_of_target(id).await?.unwrap_or(0);
            leases.held.insert(id, Held { ttl, kept: Instant::now(), snapshot: ttl < hold, keys: None });
            match leases.keep(id).await {
                Ok(true) => {}
                Ok(false) => {
                    leases.held.remove(&id);
                }
                // Due at the first round, a second from now ([`TargetLeases::keep_due`]).
                Err(Stop::Etcd(e)) if e.class() == ErrorClass::Transient => {
                    warn!(lease = id, error = %e, "a target keep-alive failed: retrying at the first round");
                    if let Some(h) = leases.held.get_mut(&id) {
                        let due = Duration::from_secs(ttl.max(1) as u64);
                        h.kept = h.kept.checked_sub(due).unwrap_or(h.kept);
                    }
                }
                Err(stop) => return Err(stop),
            }
        }
        leases.count_held().await?;
        info!(leases = leases.held.len(), "target leases adopted and kept alive");
        Ok(leases)
    }

    /// Counts the keys of every lease held, once each kept alive: a lease of many keys takes a
    /// while to list, and the keep-alives due meanwhile go out every second.
    async fn count_held(&mut self) -> Result<(), Stop> {
        let ids: Vec<i64> = self.held.keys().copied().collect();
        let mut kept = Instant::now();
        for id in ids {
            let count = self.read(id).await?;
            if let Some(h) = self.held.get_mut(&id) {
                h.keys = count;
            }
            if kept.elapsed() >= Duration::from_secs(1) {
                // A lease found gone here is the tail's to find: its revision check names it.
                self.keep_due().await?;
                kept = Instant::now();
            }
        }
        Ok(())
    }

    /// The TTL record writes the next Txn carries (taken: a Txn carries each once).
    pub(super) fn take_riders(&mut self) -> Vec<TxnOp> {
        std::mem::take(&mut self.riders)
    }

    /// Target leases held now.
    pub(super) fn held(&self) -> usize {
        self.held.len()
    }

    /// Leases that came with the snapshot and are still held, and the shortest TTL among them.
    pub(super) fn snapshot_leases(&self) -> (usize, Option<i64>) {
        let snap = self.held.values().filter(|h| h.snapshot);
        (snap.clone().count(), snap.map(|h| h.ttl).min())
    }

    /// Grants every lease the puts of `rev` name that the target does not hold yet, with the
    /// same ID: for `sync.exact_lease_hold`, or the source's TTL where longer. "Already exists"
    /// is an earlier grant whose answer was lost: it is held.
    pub(super) async fn ensure(&mut self, rev: &ExactRevision) -> Result<(), Stop> {
        for change in &rev.changes {
            let mirror_core::Change::Put { lease, .. } = change else { continue };
            if *lease == 0 || self.held.contains_key(lease) {
                continue;
            }
            let id = *lease;
            let source_ttl = unary(
                "lease ttl",
                Side::Source,
                self.timeout,
                self.source.lease_client().time_to_live(id, None),
            )
            .await?
            .granted_ttl();
            let ttl = self.hold.max(source_ttl);
            let opts = LeaseGrantOptions::new().with_id(id);
            let mut client = self.target.lease_client();
            // A fresh lease holds no key (the Txns that name it are built after this); one
            // granted before (an answer lost, or another replica's) is counted when a key
            // leaves it.
            let (ttl, keys) =
                match unary("lease grant", Side::Target, self.timeout, client.grant(ttl, Some(opts))).await {
                    Ok(_) => (ttl, Some(Count { keys: 0, at: 0 })),
                    Err(e) if e.fault == Fault::LeaseExists => {
                        (self.ttl_of_target(id).await?.unwrap_or(ttl), None)
                    }
                    Err(e) => return Err(e.into()),
                };
            debug!(lease = id, ttl, "target lease granted");
            self.held.insert(id, Held { ttl, kept: Instant::now(), snapshot: false, keys });
            if source_ttl > 0 {
                // The source's TTL, for the swap at cutover and failover.
                let key = record_key(&self.records, id);
                self.riders.push(TxnOp::put(key, source_ttl.to_string(), None));
            }
        }
        Ok(())
    }

    /// After Txn `rev` landed (here or by another replica): every count follows it, then each
    /// lease one of its changes left is revoked if it holds no key on the target any more (no
    /// key: the revoke adds no revision) and no revision waiting or in flight puts a key under
    /// it (`needed`). A lease counted to hold keys still is left as it is without a read; any
    /// other is read, and revoked only when the read shows it empty. A lease already gone was
    /// revoked by another replica, or lapsed holding no key: nothing to do either way (one that
    /// lapsed holding keys deleted them at a revision of its own, which the fence finds).
    pub(super) async fn release(
        &mut self,
        rev: &ExactRevision,
        needed: &std::collections::BTreeSet<i64>,
    ) -> Result<(), Stop> {
        self.follow(rev);
        let left: std::collections::BTreeSet<i64> = rev
            .changes
            .iter()
            .map(mirror_core::Change::left_lease)
            .filter(|l| *l != 0 && !needed.contains(l))
            .collect();
        for id in left {
            if self.holds_keys(id) {
                continue;
            }
            let Some(count) = self.read(id).await? else {
                self.held.remove(&id);
                continue;
            };
            if count.keys > 0 {
                // Counted 0 (or never counted), yet it holds keys: read at each leaving from
                // here on, as without a count.
                if let Some(h) = self.held.get_mut(&id).filter(|h| h.keys.is_some()) {
                    debug!(lease = id, counted = ?h.keys, held = count.keys, "a lease's key count was wrong: dropped");
                    h.keys = None;
                }
                continue;
            }
            let mut client = self.target.lease_client();
            match unary("lease revoke", Side::Target, self.timeout, client.revoke(id)).await {
                Ok(_) => debug!(lease = id, "target lease revoked: its last key is gone"),
                Err(e) if e.fault == Fault::LeaseNotFound => {}
                Err(e) => return Err(e.into()),
            }
            if self.held.remove(&id).is_some_and(|h| !h.snapshot) {
                self.riders.push(TxnOp::delete(record_key(&self.records, id), None));
            }
        }
        Ok(())
    }

    /// Keeps alive every lease a third of whose TTL has passed since it was last kept, and
    /// waits for the answers ([`TargetLeases::start_round`], then [`TargetLeases::kept`]); the
    /// leases found gone, each named (the caller checks whether their keys went with them).
    pub(super) async fn keep_due(&mut self) -> Result<Vec<String>, Stop> {
        let answers = self.start_round().await;
        self.kept(answers)
    }

    /// A round of keep-alives for every lease due, all at once, as a future that holds nothing
    /// of `self`: the tail awaits it beside the watch and the Txns in flight, so a keep-alive
    /// that waits for its answer (up to `request_timeout`) holds up no revision.
    pub(super) fn start_round(&self) -> impl std::future::Future<Output = Round> + Send + 'static {
        let due: Vec<i64> = self
            .held
            .iter()
            .filter(|(_, h)| h.kept.elapsed() >= Duration::from_secs((h.ttl / 3).max(1) as u64))
            .map(|(id, _)| *id)
            .collect();
        let (target, timeout) = (self.target.clone(), self.timeout);
        async move {
            let sent = Instant::now();
            let answers = futures::stream::iter(due)
                .map(|id| {
                    let target = target.clone();
                    async move { (id, keep_alive_once(&target, id, timeout).await) }
                })
                .buffer_unordered(KEEP_ALIVES_IN_FLIGHT)
                .collect()
                .await;
            Round { sent, answers }
        }
    }

    /// Takes in the answers of a round: a lease kept counts as kept when the round was sent; one
    /// found gone is forgotten and named. A lease no longer held (revoked meanwhile) or granted
    /// again since the round was sent is passed over. A keep-alive that failed for a transient cause leaves its lease due for the next
    /// round; only [`FAILED_ROUNDS_TOLERATED`] rounds in a row with such a failure end the run
    /// (its restart connects afresh), as in compact mode: one lost answer is not worth a
    /// restart that lets short leases run out meanwhile.
    pub(super) fn kept(&mut self, round: Round) -> Result<Vec<String>, Stop> {
        let mut gone = Vec::new();
        let mut first_error = None;
        for (id, answer) in round.answers {
            // Revoked meanwhile, or granted again after the round was sent: not this answer's.
            if self.held.get(&id).is_none_or(|h| h.kept > round.sent) {
                continue;
            }
            match answer {
                Ok(true) => {
                    if let Some(h) = self.held.get_mut(&id) {
                        h.kept = round.sent;
                    }
                }
                Ok(false) => {
                    gone.push(self.describe(id));
                    self.held.remove(&id);
                }
                Err(e) if e.class() == ErrorClass::Transient => first_error = first_error.or(Some(e)),
                Err(e) => return Err(e.into()),
            }
        }
        match first_error {
            None => self.failed_rounds = 0,
            Some(e) => {
                self.failed_rounds += 1;
                if self.failed_rounds >= FAILED_ROUNDS_TOLERATED {
                    return Err(e.into());
                }
                warn!(error = %e, failed = self.failed_rounds, "a target keep-alive failed: retrying at the next round");
            }
        }
        Ok(gone)
    }

    /// One keep-alive; false when the lease is gone.
    async fn keep(&mut self, id: i64) -> Result<bool, Stop> {
        let kept = keep_alive_once(&self.target, id, self.timeout).await?;
        if let (true, Some(h)) = (kept, self.held.get_mut(&id)) {
            h.kept = Instant::now();
        }
        Ok(kept)
    }

    /// A lease in words, for a message.
    fn describe(&self, id: i64) -> String {
        match self.held.get(&id) {
            Some(h) if h.snapshot => {
                format!("target lease {id:x} (it came with the snapshot, TTL {} s)", h.ttl)
            }
            _ => format!("target lease {id:x} (granted by the link)"),
        }
    }

    /// Every count follows landed revision `rev` ([`Count::follow`]).
    fn follow(&mut self, rev: &ExactRevision) {
        for (id, delta) in deltas(rev) {
            if let Some(count) = self.held.get_mut(&id).and_then(|h| h.keys.as_mut()) {
                *count = count.follow(rev.revision, delta);
            }
        }
    }

    /// Lease `id` is counted to hold a key on the target still: no read needed to leave it be.
    fn holds_keys(&self, id: i64) -> bool {
        self.held.get(&id).and_then(|h| h.keys).is_some_and(|c| c.keys > 0)
    }

    /// Lease `id`'s keys on the target as of the answer's revision, or None when it is gone.
    async fn read(&self, id: i64) -> Result<Option<Count>, Stop> {
        let opts = LeaseTimeToLiveOptions::new().with_keys();
        let mut client = self.target.lease_client();
        let resp =
            unary("lease keys", Side::Target, self.timeout, client.time_to_live(id, Some(opts))).await?;
        if resp.ttl() < 0 {
            return Ok(None);
        }
        let at = resp.header().map_or(0, |h| h.revision());
        Ok(Some(Count { keys: resp.keys().len() as u64, at }))
    }

    async fn ttl_of_target(&self, id: i64) -> Result<Option<i64>, Stop> {
        let resp =
            unary("lease ttl", Side::Target, self.timeout, self.target.lease_client().time_to_live(id, None))
                .await?;
        Ok((resp.ttl() >= 0).then_some(resp.granted_ttl()))
    }
}

/// The answers of one round of keep-alives ([`TargetLeases::start_round`]).
pub(super) struct Round {
    /// When the round was sent: a lease it kept lives a TTL from then at least.
    sent: Instant,
    answers: Vec<(i64, Result<bool, EtcdError>)>,
}

/// Keep-alives of one round in flight at once.
const KEEP_ALIVES_IN_FLIGHT: usize = 64;

/// Keeps `leases` alive every second until a keep-alive fails (then the reason); for a caller
/// busy with something else (the seed's proof) to race against.
pub(super) async fn keep_meanwhile(leases: &mut TargetLeases) -> Stop {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        if let Err(stop) = leases.keep_due().await {
            return stop;
        }
    }
}

#[cfg(test)]
mod tests {
    use mirror_core::{Change, ExactRevision};

    use super::{deltas, Count};

    /// Lease `id`'s count after `rev`, as the tail follows it.
    fn after(count: Count, id: i64, rev: &ExactRevision) -> Count {
        count.follow(rev.revision, deltas(rev).get(&id).copied().unwrap_or(0))
    }

    fn put(key: &str, lease: i64, prev_lease: i64) -> Change {
        Change::Put { key: key.into(), value: Vec::new(), lease, version: 2, create_revision: 1, prev_lease }
    }

    fn delete(key: &str, prev_lease: i64) -> Change {
        Change::Delete { key: key.into(), prev_mod_revision: Some(1), prev_lease }
    }

    fn rev(revision: i64, changes: Vec<Change>) -> ExactRevision {
        ExactRevision { revision, changes }
    }

    /// A key put under the lease adds one, a key put again under it changes nothing, a key
    /// moved to another lease or deleted takes one; changes of other leases are not its own.
    #[test]
    fn a_count_follows_the_keys_that_come_and_leave() {
        let count = Count { keys: 3, at: 10 };
        let moved = rev(11, vec![put("/a", 7, 0), put("/b", 7, 7), put("/c", 9, 7), put("/d", 9, 0)]);
        assert_eq!(after(count, 7, &moved), Count { keys: 3, at: 11 });
        assert_eq!(after(Count { keys: 0, at: 10 }, 9, &moved), Count { keys: 2, at: 11 });
        let expiry = rev(12, vec![delete("/a", 7), delete("/b", 7), delete("/x", 9)]);
        assert_eq!(after(after(count, 7, &moved), 7, &expiry), Count { keys: 1, at: 12 });
    }

    /// A revision the count was read after is in it already: following it changes nothing (a
    /// read answered at revision 12 holds what revisions 11 and 12 did).
    #[test]
    fn a_revision_the_count_already_holds_is_not_counted_twice() {
        let read = Count { keys: 5, at: 12 };
        assert_eq!(after(read, 7, &rev(11, vec![delete("/a", 7)])), read);
        assert_eq!(after(read, 7, &rev(12, vec![put("/b", 7, 0)])), read);
        assert_eq!(after(read, 7, &rev(13, vec![delete("/a", 7)])), Count { keys: 4, at: 13 });
    }

    /// A count that went wrong never goes below zero: it then reads as "no key" and the lease
    /// is read before anything is revoked.
    #[test]
    fn a_count_stops_at_zero() {
        let gone = rev(2, vec![delete("/a", 7), delete("/b", 7)]);
        assert_eq!(after(Count { keys: 1, at: 1 }, 7, &gone), Count { keys: 0, at: 2 });
    }
}
