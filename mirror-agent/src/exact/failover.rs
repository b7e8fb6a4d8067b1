//! `failover` of an exact link (SPEC §10, Failover): the source is lost; the target becomes the
//! primary with its revisions meaning what they meant.
//!
//! 1. **Promote.** The checkpoint is deleted and put again as `primary` at the stored epoch + 1
//!    (two Txns, the first guarded by the checkpoint as read): its version starts over, so no
//!    Txn of any agent of the link (whose compares expect version R-1-R0 at mod revision R-1)
//!    can land after it, and each stops with `TargetPromoted`.
//! 2. **Relist whoever saw more.** The target holds source revisions up to R; clients of the
//!    source may have seen up to Rs (the highest revision the link saw, in the record; or the
//!    operator's `--seen-revision`, when higher: a source that died took revisions its
//!    watchers saw and the link never did, and only monitoring knows how far it got). When
//!    R < Rs, filler puts of a reserved key take the target to Rs + 2 and it is compacted
//!    there: a watch from any revision up to Rs + 1 is refused as compacted, so such a client
//!    relists instead of being served events unrelated to what it saw. When R = Rs it adds
//!    nothing but the promote.
//! 3. **Leases.** Each lease the link granted for `sync.exact_lease_hold` is swapped for one with
//!    the source's TTL (its record): granted, each key put again under it guarded by its mod
//!    revision, the old one revoked empty. Those keys get new revisions (the runbook says so).
//!
//! It prints R, Rs and the loss window. A step after the promote that fails (the compaction
//! refused to a user without the root role, the target lost) ends it with exit 6; run again, it
//! finds its own promote and finishes the steps, each of which may run twice.

use std::process::ExitCode;

use anyhow::Context as _;

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, KvClient, LeaseTimeToLiveOptions, PutOptions, Txn, TxnOp,
};
use mirror_core::{connect_reachable, unary, Config, Fault, Side};
use mirror_fence::{Checkpoint, Role};

use super::leases::lease_records;
use super::leases::record_key;
use crate::exit::Exit;

/// Runs the failover of an exact link (the source was probed and found lost, or `--force`).
/// `seen` is the operator's `--seen-revision`.
pub(crate) async fn failover(config: &Config, seen: Option<i64>) -> ExitCode {
    crate::exit::reported("failover", run(config, seen).await, Exit::CannotStart)
}

/// Fillers `--seen-revision` may ask for, at most: past it, the value is more likely a typo
/// than a revision (a million Txns take the target several minutes).
const MOST_FILLERS: i64 = 1_000_000;

async fn run(config: &Config, seen: Option<i64>) -> anyhow::Result<Exit> {
    let target = connect_reachable(Side::Target, &config.target, &config.sync).await?;
    let me = format!("{FAILOVER}{}/{}", crate::engine::hostname(), std::process::id());
    if let Some(seen) = seen {
        let head = target_revision(config, &target).await?;
        if seen - head > MOST_FILLERS {
            eprintln!(
                "mirror-agent failover: refused, nothing written: --seen-revision {seen} is {} revisions past \
                 the target's revision {head}; a failover writes one filler per revision, and more than \
                 {MOST_FILLERS} is more likely a wrong value than a revision a client saw (take it from the \
                 source's monitoring: its last etcd_debugging_mvcc_current_revision)",
                seen - head
            );
            return Ok(Exit::No);
        }
    }
    let (record, r, rs) = match promote(config, &target, &me, seen).await? {
        Promoted::Now { record, r, rs } => {
            let epoch = record.epoch + 1;
            println!("failover of link {:?}: the target is primary (epoch {epoch})", config.link_uid);
            (record, r, rs)
        }
        // A failover that stopped after its promote (a step refused, the target lost): the
        // record it wrote still holds R and Rs, and every step after the promote may run again.
        Promoted::Already(record) if record.agent_id.starts_with(FAILOVER) => {
            let (r, rs) = (record.watermark, seen_past(&record, seen));
            println!(
                "failover of link {:?}: already promoted by a failover (epoch {}); finishing its steps",
                config.link_uid, record.epoch
            );
            if rs > record.source_seen {
                keep_seen(config, &target, rs).await?;
            }
            (record, r, rs)
        }
        Promoted::Already(record) => {
            println!("already promoted: the target is primary (epoch {})", record.epoch);
            if seen.is_some() {
                // A cutover drained the source first: no client of it saw past the target.
                println!(
                    "  --seen-revision not used: the target was promoted by {}, not by a failover",
                    record.agent_id
                );
            }
            return Ok(Exit::Done);
        }
    };
    let rs = Seen { at: rs, link: seen_past(&record, None) };
    match finish(config, &target, &record, r, rs).await {
        Ok(()) => Ok(Exit::Done),
        Err(e) => {
            eprintln!(
                "mirror-agent failover: the target is promoted, but a step after the promote failed: {e:#}\n\
                 run `mirror-agent failover` again once the cause is fixed: it finishes the steps left"
            );
            Ok(Exit::PromotedIncomplete)
        }
    }
}

/// Whose record a failover's promote writes (`failover/HOST/PID`): a second run that finds it
/// finishes the steps after the promote.
const FAILOVER: &str = "failover/";

/// The steps after the promote, each of which may run again: the fillers and the compaction
/// when clients may have seen more than the target holds, and the lease swap.
async fn finish(
    config: &Config,
    target: &Client,
    record: &Checkpoint,
    r: i64,
    seen: Seen,
) -> anyhow::Result<()> {
    let key = config.checkpoint_key();
    let mut kv = target.kv_client();
    let rs = seen.at;
    if r < rs {
        relist_past(config, &mut kv, &key, rs).await?;
        let (who, lost) = match seen.told() {
            false => ("the link had seen".to_owned(), "are"),
            true => (
                format!("clients may have seen (--seen-revision; the link had seen {})", seen.link),
                "may be",
            ),
        };
        println!(
            "  revisions       the target holds source revisions up to R = {r}; {who} up to Rs = {rs}: \
             {} source revisions {lost} lost",
            rs - r
        );
        println!(
            "  compacted at    {}: a client that saw a revision the target lacks is refused a watch from it \
             (\"compacted\") and relists",
            rs + 2
        );
    } else {
        println!("  revisions       the target holds every source revision the link saw: R = Rs = {r}");
    }
    let (swapped, reput) = swap_leases(config, target).await?;
    println!(
        "  leases          {swapped} swapped for their source TTL ({reput} keys put again: new revisions)"
    );
    match record.confirmed_time.as_str() {
        "" => println!("  confirmed_time  unknown"),
        at => println!("  confirmed_time  {at}: the link had landed the source's revisions up to then"),
    }
    println!(
        "next: point the API servers (or other clients) at the target: {}",
        config.target.endpoints.join(",")
    );
    Ok(())
}

/// A long run of fillers (an operator's `--seen-revision` far ahead) says how far it got every
/// this many.
const PROGRESS_EVERY: i64 = 10_000;

/// Rs as `finish` tells it.
struct Seen {
    /// The revision the fillers and the compaction go past.
    at: i64,
    /// What the link saw (its records).
    link: i64,
}

impl Seen {
    /// Whether Rs is the operator's `--seen-revision` (above what the link saw).
    fn told(&self) -> bool {
        self.at > self.link
    }
}

/// Rs: the highest source revision the link saw as `record` says it (the watermark at least),
/// raised to the operator's `seen`.
fn seen_past(record: &Checkpoint, seen: Option<i64>) -> i64 {
    record.source_seen.max(record.watermark).max(seen.unwrap_or(0))
}

/// Raises Rs in the promoted record to the operator's `--seen-revision`, given to a failover
/// run again (one Txn guarded by the record as read), so that a later run finds it there too.
async fn keep_seen(config: &Config, target: &Client, rs: i64) -> anyhow::Result<()> {
    let (t, key, mut kv) = (config.sync.request_timeout.get(), config.checkpoint_key(), target.kv_client());
    let read = unary("read checkpoint", Side::Target, t, kv.get(key.clone(), None)).await?;
    let stored = read.kvs().first().context("the promoted checkpoint is gone")?;
    let record = Checkpoint { source_seen: rs, ..Checkpoint::decode(stored.value())? };
    let unchanged = Compare::mod_revision(key.clone(), CompareOp::Equal, stored.mod_revision());
    let put = Txn::new().when(vec![unchanged]).and_then(vec![TxnOp::put(key, record.encode()?, None)]);
    let done = unary("record Rs", Side::Target, t, kv.txn(put)).await?.succeeded();
    anyhow::ensure!(done, "the promoted checkpoint changed while Rs was recorded in it; run failover again");
    Ok(())
}

/// The target's current revision (the header of a read of one key).
async fn target_revision(config: &Config, target: &Client) -> anyhow::Result<i64> {
    let t = config.sync.request_timeout.get();
    let mut kv = target.kv_client();
    let read = unary("read checkpoint", Side::Target, t, kv.get(config.checkpoint_key(), None)).await?;
    Ok(read.header().map_or(0, |h| h.revision()))
}

/// Filler puts of a reserved key until the target's revision passes Rs + 1, each guarded by
/// the promoted checkpoint, then a compaction at Rs + 2: a watch from any revision up to
/// Rs + 1 is refused as compacted. Refused to the link's user (etcd 3.5 lets only root
/// compact), the error says the command that does it.
async fn relist_past(config: &Config, kv: &mut KvClient, key: &[u8], rs: i64) -> anyhow::Result<()> {
    let t = config.sync.request_timeout.get();
    let read = unary("read checkpoint", Side::Target, t, kv.get(key.to_vec(), None)).await?;
    let promoted = read.kvs().first().map_or(0, |kv| kv.mod_revision());
    let mut head = read.header().map_or(0, |h| h.revision());
    let filler = [&key[..key.len() - b"checkpoint".len()], b"filler"].concat();
    if rs + 2 - head > PROGRESS_EVERY {
        eprintln!("failover: {} filler revisions to write, {head} to {}", rs + 2 - head, rs + 2);
    }
    while head < rs + 2 {
        if head % PROGRESS_EVERY == 0 {
            eprintln!("failover: fillers at target revision {head} of {}", rs + 2);
        }
        let guard = Compare::mod_revision(key.to_vec(), CompareOp::Equal, promoted);
        let put =
            Txn::new().when(vec![guard]).and_then(vec![TxnOp::put(filler.clone(), head.to_string(), None)]);
        let resp = unary("failover filler", Side::Target, t, kv.txn(put)).await?;
        anyhow::ensure!(resp.succeeded(), "the checkpoint moved while fillers were written");
        head = resp.header().map_or(head + 1, |h| h.revision());
    }
    // Done already (a failover run again, the compaction run by hand): a read at Rs + 1 is
    // refused. Asked first, since etcd checks the user's right to compact before it says so.
    let at = GetOptions::new().with_count_only().with_revision(rs + 1);
    match unary("read at Rs + 1", Side::Target, t, kv.get(key.to_vec(), Some(at))).await {
        Err(e) if e.fault == Fault::Compacted => return Ok(()),
        read => drop(read?),
    }
    match unary("failover compaction", Side::Target, t, kv.compact(rs + 2, None)).await {
        Ok(_) => Ok(()),
        Err(e) if e.fault == Fault::Compacted => Ok(()),
        Err(e) if e.fault == Fault::PermissionDenied => anyhow::bail!(
            "compacting the target at Rs + 2 = {} was refused to the link's user ({e}; etcd 3.5 lets only \
             root compact); until it is compacted there, a client that saw a revision the target lacks \
             may watch from it and be served unrelated events. Compact it as root: etcdctl \
             --endpoints={} --user root compact {}",
            rs + 2,
            config.target.endpoints.join(","),
            rs + 2
        ),
        Err(e) => Err(e.into()),
    }
}

/// What [`promote`] found.
pub(super) enum Promoted {
    /// Promoted now, over `record` (the last the link wrote): R and Rs.
    Now {
        /// The record it replaced.
        record: Checkpoint,
        /// The last source revision landed.
        r: i64,
        /// The highest source revision the link had seen.
        rs: i64,
    },
    /// It was primary already.
    Already(Checkpoint),
}

/// Deletes the checkpoint and puts it again as `primary` at the stored epoch + 1 (two Txns, the
/// first guarded by the checkpoint as read, retried over a record an agent moved meanwhile):
/// the version starts over, so no agent's Txn can land after it. The operator's `seen`
/// (`failover --seen-revision`) raises Rs, in the record too.
pub(super) async fn promote(
    config: &Config,
    target: &Client,
    me: &str,
    seen: Option<i64>,
) -> anyhow::Result<Promoted> {
    let t = config.sync.request_timeout.get();
    let key = config.checkpoint_key();
    let mut kv = target.kv_client();
    loop {
        let read = unary("read checkpoint", Side::Target, t, kv.get(key.clone(), None)).await?;
        let Some(stored) = read.kvs().first() else {
            anyhow::bail!(
                "no checkpoint of this link in the target: nothing has been mirrored to fail over to"
            );
        };
        let record = Checkpoint::decode(stored.value())?;
        if record.role == Role::Primary {
            return Ok(Promoted::Already(record));
        }
        let (r, rs) = (record.watermark, seen_past(&record, seen));
        let mut next = record.failed_over(record.epoch + 1, me);
        if seen.is_some() {
            // A failover run again finds Rs in its own record.
            next.source_seen = rs;
        }
        let next = next.encode()?;
        let unchanged = Compare::mod_revision(key.clone(), CompareOp::Equal, stored.mod_revision());
        let delete = Txn::new().when(vec![unchanged]).and_then(vec![TxnOp::delete(key.clone(), None)]);
        if !unary("promote: delete", Side::Target, t, kv.txn(delete)).await?.succeeded() {
            continue;
        }
        let absent = Compare::version(key.clone(), CompareOp::Equal, 0);
        let put = Txn::new().when(vec![absent]).and_then(vec![TxnOp::put(key.clone(), next, None)]);
        anyhow::ensure!(
            unary("promote: put", Side::Target, t, kv.txn(put)).await?.succeeded(),
            "the checkpoint was put by someone else between the promote's two Txns"
        );
        return Ok(Promoted::Now { record, r, rs });
    }
}

/// Swaps every lease the link granted (one with a TTL record) for one with the recorded
/// source TTL; how many leases, and keys put again.
pub(super) async fn swap_leases(config: &Config, target: &Client) -> anyhow::Result<(usize, usize)> {
    if let Some(why) = mirror_core::failpoint::armed("LEASE_SWAP_FAILS") {
        anyhow::bail!("failpoint LEASE_SWAP_FAILS: {why}");
    }
    let t = config.sync.request_timeout.get();
    let prefix = lease_records(config);
    let (mut kv, mut lease) = (target.kv_client(), target.lease_client());
    let records = unary(
        "lease records",
        Side::Target,
        t,
        kv.get(prefix.clone(), Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let (mut swapped, mut reput) = (0, 0);
    for record in records.kvs() {
        let id = i64::from_str_radix(std::str::from_utf8(&record.key()[prefix.len()..])?, 16)?;
        let ttl: i64 = std::str::from_utf8(record.value())?.parse()?;
        let held = unary(
            "lease keys",
            Side::Target,
            t,
            lease.time_to_live(id, Some(LeaseTimeToLiveOptions::new().with_keys())),
        )
        .await?;
        if held.ttl() < 0 || held.granted_ttl() == ttl {
            continue;
        }
        let new = unary("lease grant", Side::Target, t, lease.grant(ttl, None)).await?.id();
        for key in held.keys() {
            let now = unary("read leased key", Side::Target, t, kv.get(key.clone(), None)).await?;
            let Some(current) = now.kvs().first() else { continue };
            let same = Compare::mod_revision(key.clone(), CompareOp::Equal, current.mod_revision());
            let put =
                TxnOp::put(key.clone(), current.value().to_vec(), Some(PutOptions::new().with_lease(new)));
            if unary(
                "re-put under the source TTL",
                Side::Target,
                t,
                kv.txn(Txn::new().when(vec![same]).and_then(vec![put])),
            )
            .await?
            .succeeded()
            {
                reput += 1;
            }
        }
        let _ = unary("lease revoke", Side::Target, t, lease.revoke(id)).await;
        let _ = unary("lease record", Side::Target, t, kv.delete(record_key(&prefix, id), None)).await;
        swapped += 1;
    }
    Ok((swapped, reput))
}
