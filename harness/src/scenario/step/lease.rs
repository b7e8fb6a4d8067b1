//! Steps on leases, as the clients of a service registry use them: `load_leased` (keys spread
//! over many leases of different TTLs), `keep_leases` (a client keeping some of them alive, in
//! the background), `grant` (one lease on either side).

use std::time::Duration;

use anyhow::Context as _;
use etcd_client::{Client, LeaseGrantOptions, PutOptions, Txn, TxnOp};
use mirror_core::HumanDuration;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{is_source, source_side, SideName, Sides, Step};
use crate::scenario::world::World;

/// `keys` keys under `prefix` spread round-robin over `count` source leases with IDs
/// `first..first + count`, granted with TTLs rising evenly from `ttl` to `ttl_max` seconds
/// (the lease `first + i` gets `ttl + i * (ttl_max - ttl) / (count - 1)`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LoadLeased {
    /// How many keys.
    pub keys: usize,
    /// Under this sub-prefix of `source.prefix`.
    #[serde(default)]
    pub prefix: String,
    /// The first lease ID.
    pub first: i64,
    /// How many leases.
    pub count: i64,
    /// The shortest TTL, seconds.
    pub ttl: i64,
    /// The longest TTL, seconds.
    pub ttl_max: i64,
}

impl LoadLeased {
    fn ttl_of(&self, i: i64) -> i64 {
        if self.count <= 1 {
            self.ttl
        } else {
            self.ttl + i * (self.ttl_max - self.ttl) / (self.count - 1)
        }
    }
}

#[async_trait::async_trait]
#[typetag::serde(name = "load_leased")]
impl Step for LoadLeased {
    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.first > 0 && self.count > 0, "load_leased: first and count must be > 0");
        anyhow::ensure!(self.ttl >= 2 && self.ttl_max >= self.ttl, "load_leased: 2 <= ttl <= ttl_max");
        Ok(())
    }

    fn detachable(&self) -> bool {
        true
    }

    async fn run(&self, world: &mut World, seed: u64) -> anyhow::Result<String> {
        let sides = world.sides().await?;
        self.run_detached(sides, seed).await
    }

    async fn run_detached(&self, mut sides: Sides, _seed: u64) -> anyhow::Result<String> {
        let client = &mut sides.source;
        for i in 0..self.count {
            let opts = LeaseGrantOptions::new().with_id(self.first + i);
            client.lease_grant(self.ttl_of(i), Some(opts)).await.context("granting a lease")?;
        }
        let under = format!("{}{}", sides.source_prefix, self.prefix);
        let mut rev = 0;
        for start in (0..self.keys).step_by(128) {
            let ops: Vec<TxnOp> = (start..(start + 128).min(self.keys))
                .map(|i| {
                    let lease = self.first + (i as i64 % self.count);
                    TxnOp::put(format!("{under}key-{i:08}"), "v", Some(PutOptions::new().with_lease(lease)))
                })
                .collect();
            rev = client.txn(Txn::new().and_then(ops)).await?.header().map_or(rev, |h| h.revision());
        }
        Ok(format!("{} keys under {} leases, to revision {rev}", self.keys, self.count))
    }
}

/// A client keeping leases `first..first + count` of `side` alive for `for` (every second, on
/// one keep-alive stream), usually in the background; then it stops, as a client that died.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KeepLeases {
    /// Which side (default source).
    #[serde(default = "source_side", skip_serializing_if = "is_source")]
    pub side: SideName,
    /// The first lease ID.
    pub first: i64,
    /// How many leases.
    pub count: i64,
    /// For how long.
    #[serde(rename = "for")]
    pub for_: HumanDuration,
}

#[async_trait::async_trait]
#[typetag::serde(name = "keep_leases")]
impl Step for KeepLeases {
    fn detachable(&self) -> bool {
        true
    }

    async fn run(&self, world: &mut World, seed: u64) -> anyhow::Result<String> {
        let sides = world.sides().await?;
        self.run_detached(sides, seed).await
    }

    async fn run_detached(&self, mut sides: Sides, _seed: u64) -> anyhow::Result<String> {
        let (client, _) = sides.of(self.side);
        keep_alive(client, self.first, self.count, self.for_.get()).await
    }
}

/// Keeps the leases alive every second on one stream. A stream that breaks is opened again at
/// once, as a real client's lease keeper does, and said so on stdout: a step that failed
/// instead would let its leases run out while the scenario's later steps blame the agent.
async fn keep_alive(client: &mut Client, first: i64, count: i64, span: Duration) -> anyhow::Result<String> {
    let until = Instant::now() + span;
    let (mut rounds, mut reopened) = (0u32, 0u32);
    let (mut keeper, mut reader) = open_keeper(client, first).await?;
    while Instant::now() < until {
        for id in first..first + count {
            keeper.id = id;
            if let Err(e) = keeper.keep_alive().await {
                println!(
                    "keep_leases {first}..{}: the keep-alive stream broke ({e}); opening another",
                    first + count
                );
                reader.abort();
                (keeper, reader) = open_keeper(client, id).await?;
                reopened += 1;
            }
        }
        rounds += 1;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    reader.abort();
    Ok(format!("kept {count} leases alive for {span:?} ({rounds} rounds, {reopened} streams reopened)"))
}

/// A keep-alive stream (its first request keeps `id` alive) and the task reading its answers.
async fn open_keeper(
    client: &mut Client,
    id: i64,
) -> anyhow::Result<(etcd_client::LeaseKeeper, tokio::task::JoinHandle<()>)> {
    let (keeper, mut answers) = client.lease_keep_alive(id).await?;
    let reader = tokio::spawn(async move { while let Ok(Some(_)) = answers.message().await {} });
    Ok((keeper, reader))
}

/// One lease on `side` with this ID and TTL.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// Which side (default source).
    #[serde(default = "source_side", skip_serializing_if = "is_source")]
    pub side: SideName,
    /// The lease ID.
    pub lease: i64,
    /// Its TTL, seconds.
    pub ttl: i64,
}

#[async_trait::async_trait]
#[typetag::serde(name = "grant")]
impl Step for Grant {
    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let mut sides = world.sides().await?;
        let (client, _) = sides.of(self.side);
        client.lease_grant(self.ttl, Some(LeaseGrantOptions::new().with_id(self.lease))).await?;
        Ok(String::new())
    }
}
