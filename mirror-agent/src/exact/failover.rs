//! `failover` of an exact link (SPEC §10, Failover): the source is lost; the target becomes the
//! primary with its revisions meaning what they meant.
//!
//! 1. **Promote.** The checkpoint is deleted and put again as `primary` at the stored epoch + 1
//!    (two Txns, the first guarded by the checkpoint as read): its version starts over, so no
//!    Txn of any agent of the link (whose compares expect version R-1-R0 at mod revision R-1)
//!    can land after it, and each stops with `TargetPromoted`.
//! 2. **Relist whoever saw more.** The target holds source revisions up to R; clients of the
//!    source may have seen up to Rs (the highest revision the link saw, in the record). When
//!    R < Rs, filler puts of a reserved key take the target to Rs + 2 and it is compacted
//!    there: a watch from any revision up to Rs + 1 is refused as compacted, so such a client
//!    relists instead of being served events unrelated to what it saw. When R = Rs it adds
//!    nothing but the promote.
//! 3. **Leases.** Each lease the link granted for `sync.exact_lease_hold` is swapped for one with
//!    the source's TTL (its record): granted, each key put again under it guarded by its mod
//!    revision, the old one revoked empty. Those keys get new revisions (the runbook says so).
//!
//! It prints R, Rs and the loss window.

use std::process::ExitCode;

use etcd_client::{Client, Compare, CompareOp, GetOptions, LeaseTimeToLiveOptions, PutOptions, Txn, TxnOp};
use mirror_core::{connect_reachable, unary, Config, Fault, Side};
use mirror_fence::{Checkpoint, Role};

use super::leases::lease_records;
use super::leases::record_key;
use crate::exit::Exit;

/// Runs the failover of an exact link (the source was probed and found lost, or `--force`).
pub(crate) async fn failover(config: &Config) -> ExitCode {
    crate::exit::reported("failover", run(config).await, Exit::CannotStart)
}

async fn run(config: &Config) -> anyhow::Result<Exit> {
    let t = config.sync.request_timeout.get();
    let target = connect_reachable(Side::Target, &config.target, &config.sync).await?;
    let key = config.checkpoint_key();
    let me = format!("failover/{}/{}", crate::engine::hostname(), std::process::id());
    let mut kv = target.kv_client();
    let (record, r, rs) = match promote(config, &target, &me).await? {
        Promoted::Now { record, r, rs } => (record, r, rs),
        Promoted::Already(record) => {
            println!("already promoted: the target is primary (epoch {})", record.epoch);
            return Ok(Exit::Done);
        }
    };
    println!("failover of link {:?}: the target is primary (epoch {})", config.link_uid, record.epoch + 1);

    // 2. Fillers and the compaction when clients may have seen more than the target holds.
    let promoted = current(&mut kv, &key, t).await?;
    if r < rs {
        let filler = [&key[..key.len() - b"checkpoint".len()], b"filler"].concat();
        let mut head = promoted;
        while head < rs + 2 {
            let guard = Compare::mod_revision(key.clone(), CompareOp::Equal, promoted);
            let put = Txn::new().when(vec![guard]).and_then(vec![TxnOp::put(
                filler.clone(),
                head.to_string(),
                None,
            )]);
            let resp = unary("failover filler", Side::Target, t, kv.txn(put)).await?;
            anyhow::ensure!(resp.succeeded(), "the checkpoint moved while fillers were written");
            head = resp.header().map_or(head + 1, |h| h.revision());
        }
        match unary("failover compaction", Side::Target, t, kv.compact(rs + 2, None)).await {
            Ok(_) => {}
            Err(e) if e.fault == Fault::Compacted => {}
            Err(e) => return Err(e.into()),
        }
        println!(
            "  revisions       the target holds source revisions up to R = {r}; the link had seen up to Rs = {rs}: \
             {} source revisions are lost",
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
    let (swapped, reput) = swap_leases(config, &target).await?;
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
    Ok(Exit::Done)
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
/// the version starts over, so no agent's Txn can land after it.
pub(super) async fn promote(config: &Config, target: &Client, me: &str) -> anyhow::Result<Promoted> {
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
        let (r, rs) = (record.watermark, record.source_seen.max(record.watermark));
        let next = record.failed_over(record.epoch + 1, me).encode()?;
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

/// The target's revision, read with the checkpoint key.
async fn current(kv: &mut etcd_client::KvClient, key: &[u8], t: std::time::Duration) -> anyhow::Result<i64> {
    let opts = GetOptions::new().with_count_only();
    Ok(unary("read revision", Side::Target, t, kv.get(key.to_vec(), Some(opts)))
        .await?
        .header()
        .map_or(0, |h| h.revision()))
}

/// Swaps every lease the link granted (one with a TTL record) for one with the recorded
/// source TTL; how many leases, and keys put again.
pub(super) async fn swap_leases(config: &Config, target: &Client) -> anyhow::Result<(usize, usize)> {
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
