//! `cutover` of an exact link (SPEC §10): the source stopped taking writes; the agents land
//! every revision it took, the sides are verified equal at that revision, and the target is
//! promoted with the failover's promote (the checkpoint deleted and put again as `primary`, so
//! no agent's Txn lands after it) and its lease swap (the leases the link granted for
//! `sync.exact_lease_hold` get the source's TTL). The agents of the link keep running until
//! then: it is they who land the revisions.
//!
//! Exit codes as compact mode's `cutover --wait`: 0 promoted with the source unchanged since
//! the drain target, 1 not promoted (the sides differ), 3 nothing happened, 4 promoted but the
//! source took writes after the drain target; and 6 promoted, but the lease swap after the
//! promote failed: run again, it finds its own promote and finishes the swap.

use std::process::ExitCode;
use std::time::Duration;

use mirror_core::{connect_reachable, read_head, unary, Config, Side};
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
    let drain = head(config, &source).await?;
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
            return resume(config, &source, &target, &record).await;
        }
        if record.watermark >= drain {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let found = compare_at(config, &source, &target, drain, 10, 0).await?;
    if found.differences() > 0 {
        eprintln!("mirror-agent cutover: not promoted: the sides differ at source revision {drain}:");
        for line in found.shown {
            eprintln!("  {line}");
        }
        return Ok(Exit::No);
    }
    let me = format!("{CUTOVER}{}/{}", crate::engine::hostname(), std::process::id());
    let record = match promote(config, &target, &me, None).await? {
        Promoted::Now { record, .. } => record,
        Promoted::Already(record) => return resume(config, &source, &target, &record).await,
    };
    println!("cutover of link {:?}: the target is primary (epoch {})", config.link_uid, record.epoch + 1);
    println!("  revisions       source revision {drain} verified equal ({} keys); target revision = source revision", found.equal);
    finish(config, &source, &target, drain).await
}

/// Whose record a cutover's promote writes (`cutover/HOST/PID`): a second run that finds it
/// finishes the steps after the promote.
const CUTOVER: &str = "cutover/";

/// The target is primary already: promoted by a cutover that stopped after its promote (the
/// lease swap failed, the target was lost), whose steps this run finishes, or by another
/// command, which leaves nothing to do.
async fn resume(
    config: &Config,
    source: &etcd_client::Client,
    target: &etcd_client::Client,
    record: &Checkpoint,
) -> anyhow::Result<Exit> {
    if !record.agent_id.starts_with(CUTOVER) {
        println!("already promoted: the target is primary (epoch {})", record.epoch);
        return Ok(Exit::Done);
    }
    println!(
        "cutover of link {:?}: already promoted by a cutover (epoch {}) at source revision {}; finishing its steps",
        config.link_uid, record.epoch, record.watermark
    );
    finish(config, source, target, record.watermark).await
}

/// The steps after the promote, each of which may run again: the lease swap, then whether the
/// source moved past the drain target.
async fn finish(
    config: &Config,
    source: &etcd_client::Client,
    target: &etcd_client::Client,
    drain: i64,
) -> anyhow::Result<Exit> {
    let (swapped, reput) = match swap_leases(config, target).await {
        Ok(done) => done,
        Err(e) => {
            eprintln!(
                "mirror-agent cutover: the target is promoted, but the lease swap after the promote failed: {e:#}\n\
                 run `mirror-agent cutover` again once the cause is fixed: it finishes the swap"
            );
            return Ok(Exit::PromotedIncomplete);
        }
    };
    println!(
        "  leases          {swapped} swapped for their source TTL ({reput} keys put again: new revisions)"
    );
    let after = head(config, source).await?;
    if after > drain {
        println!("  the source took writes after the drain target ({drain} -> {after}): they are not in the target");
        return Ok(Exit::PromotedSourceMoved);
    }
    println!("next: point the clients at the target: {}", config.target.endpoints.join(","));
    Ok(Exit::Done)
}

/// The source's current revision.
async fn head(config: &Config, source: &etcd_client::Client) -> anyhow::Result<i64> {
    let t = config.sync.request_timeout.get();
    Ok(read_head(&mut source.kv_client(), vec![0], "read revision", Side::Source, t).await?.revision)
}
