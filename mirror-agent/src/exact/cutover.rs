//! `cutover` of an exact link (SPEC §10): the source stopped taking writes; the agents land
//! every revision it took, the sides are verified equal at that revision, and the target is
//! promoted with the failover's promote (the checkpoint deleted and put again as `primary`, so
//! no agent's Txn lands after it) and its lease swap (the leases the link granted for
//! `sync.exact_lease_hold` get the source's TTL). The agents of the link keep running until
//! then: it is they who land the revisions.
//!
//! Exit codes as compact mode's `cutover --wait`: 0 promoted with the source unchanged since
//! the drain target, 1 not promoted (the sides differ), 3 nothing happened, 4 promoted but the
//! source took writes after the drain target.

use std::process::ExitCode;
use std::time::Duration;

use etcd_client::GetOptions;
use mirror_core::{connect_reachable, unary, Config, Side};
use mirror_fence::Checkpoint;

use super::compare::compare_at;
use super::failover::{promote, swap_leases, Promoted};
use crate::exit::Exit;

/// Runs the cutover of an exact link.
pub(crate) async fn cutover(config: &Config) -> ExitCode {
    crate::exit::reported("cutover", run(config).await, Exit::CannotStart)
}

async fn run(config: &Config) -> anyhow::Result<Exit> {
    let t = config.sync.request_timeout.get();
    let source = connect_reachable(Side::Source, &config.source, &config.sync).await?;
    let target = connect_reachable(Side::Target, &config.target, &config.sync).await?;
    let head = |client: &etcd_client::Client| {
        let mut kv = client.kv_client();
        async move {
            let opts = GetOptions::new().with_count_only();
            let resp = unary("read revision", Side::Source, t, kv.get(vec![0], Some(opts))).await?;
            anyhow::Ok(resp.header().map_or(0, |h| h.revision()))
        }
    };
    let drain = head(&source).await?;
    eprintln!("cutover: draining to source revision {drain}: waiting for the link's agents to land it");
    loop {
        let mut kv = target.kv_client();
        let read = unary("read checkpoint", Side::Target, t, kv.get(config.checkpoint_key(), None)).await?;
        let record = match read.kvs().first() {
            Some(kv) => Checkpoint::decode(kv.value())?,
            None if read.header().map_or(0, |h| h.revision()) >= drain => break,
            // A fresh seed: the first Txn is still to land.
            None => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        if record.role == mirror_fence::Role::Primary {
            println!("already promoted: the target is primary (epoch {})", record.epoch);
            return Ok(Exit::Done);
        }
        if record.watermark >= drain {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let found = compare_at(config, &source, &target, drain, 10, 0).await?;
    if found.differences > 0 {
        eprintln!("mirror-agent cutover: not promoted: the sides differ at source revision {drain}:");
        for line in found.shown {
            eprintln!("  {line}");
        }
        return Ok(Exit::No);
    }
    let me = format!("cutover/{}/{}", crate::engine::hostname(), std::process::id());
    let record = match promote(config, &target, &me).await? {
        Promoted::Now { record, .. } => record,
        Promoted::Already(record) => {
            println!("already promoted: the target is primary (epoch {})", record.epoch);
            return Ok(Exit::Done);
        }
    };
    let (swapped, reput) = swap_leases(config, &target).await?;
    println!("cutover of link {:?}: the target is primary (epoch {})", config.link_uid, record.epoch + 1);
    println!("  revisions       source revision {drain} verified equal ({} keys); target revision = source revision", found.equal);
    println!(
        "  leases          {swapped} swapped for their source TTL ({reput} keys put again: new revisions)"
    );
    let after = head(&source).await?;
    if after > drain {
        println!("  the source took writes after the drain target ({drain} -> {after}): they are not in the target");
        return Ok(Exit::PromotedSourceMoved);
    }
    println!("next: point the clients at the target: {}", config.target.endpoints.join(","));
    Ok(Exit::Done)
}
