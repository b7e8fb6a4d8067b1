//! Writing test data into the source: a fast bulk load (batched Txns) and an open-loop churn of
//! random puts, overwrites, deletes, multi-key Txns, range deletes and (optionally) leased puts.

use std::time::Duration;

use etcd_client::{Client, DeleteOptions, LeaseGrantOptions, PutOptions, Txn, TxnOp};

/// Puts `n` keys `prefix + "key-%08d"` with `value_size`-byte values, up to 128 per Txn and
/// about 1 MiB per Txn (so values of hundreds of KiB load too); returns the revision after the
/// last write.
pub async fn load_keys(
    client: &mut Client,
    prefix: &str,
    n: usize,
    value_size: usize,
) -> anyhow::Result<i64> {
    load_leased_keys(client, prefix, n, value_size, None).await
}

/// [`load_keys`] with every `every`-th key (from the first) under source lease `id`, granted
/// with a 600 s TTL unless it exists: `every = 2` interleaves keys a revoke deletes with keys
/// that survive it.
pub async fn load_leased_keys(
    client: &mut Client,
    prefix: &str,
    n: usize,
    value_size: usize,
    lease: Option<(i64, usize)>,
) -> anyhow::Result<i64> {
    load_cycling(client, prefix, n, value_size, lease, n).await
}

/// [`load_leased_keys`] with the keys cycling over `keyspace` distinct ones: put `i` writes key
/// `i % keyspace`, the later puts overwriting (a Txn never names a key twice, which etcd
/// refuses).
pub async fn load_cycling(
    client: &mut Client,
    prefix: &str,
    n: usize,
    value_size: usize,
    lease: Option<(i64, usize)>,
    keyspace: usize,
) -> anyhow::Result<i64> {
    let keyspace = keyspace.max(1);
    if let Some((id, _)) = lease {
        let known = client.lease_time_to_live(id, None).await?.ttl() > 0;
        if !known {
            client.lease_grant(600, Some(LeaseGrantOptions::new().with_id(id))).await?;
        }
    }
    let opts = |i: usize| match lease {
        Some((id, every)) if i.is_multiple_of(every) => Some(PutOptions::new().with_lease(id)),
        _ => None,
    };
    // Up to 128 puts and about 1 MiB per Txn: etcd's defaults refuse more ops or bytes.
    const TXN_BYTES: usize = 1 << 20;
    let per_txn = (TXN_BYTES / (value_size + 32).max(1)).clamp(1, 128).min(keyspace);
    let mut rev = 0;
    let value = vec![b'v'; value_size];
    for start in (0..n).step_by(per_txn) {
        let ops: Vec<TxnOp> = (start..(start + per_txn).min(n))
            .map(|i| TxnOp::put(format!("{prefix}key-{:08}", i % keyspace), value.clone(), opts(i)))
            .collect();
        let resp = client.txn(Txn::new().and_then(ops)).await?;
        rev = resp.header().map_or(rev, |h| h.revision());
    }
    Ok(rev)
}

/// What a churn writes.
#[derive(Clone, Debug)]
pub struct Churn {
    /// Keys are `prefix + "c-%07d"`, below `keyspace`.
    pub prefix: String,
    /// Operations in all.
    pub ops: usize,
    /// Offered operations per second (open loop: a slow server does not lower it).
    pub rate: u32,
    /// Distinct keys touched.
    pub keyspace: usize,
    /// Bytes per value.
    pub value_size: usize,
    /// Seed of the op sequence.
    pub seed: u64,
    /// Count failed operations instead of stopping at the first (members and leaders fail).
    pub tolerant: bool,
    /// Make some puts lease-backed, on short leases that expire while the churn runs.
    pub leases: bool,
}

impl Churn {
    /// `ops` operations at `rate` per second over `keyspace` keys under `prefix`, seed 1.
    pub fn new(prefix: &str, ops: usize, rate: u32, keyspace: usize) -> Churn {
        Churn {
            prefix: prefix.to_owned(),
            ops,
            rate,
            keyspace,
            value_size: 64,
            seed: 1,
            tolerant: false,
            leases: false,
        }
    }

    /// Another value size.
    pub fn value_size(mut self, bytes: usize) -> Churn {
        self.value_size = bytes;
        self
    }

    /// Another seed.
    pub fn seed(mut self, seed: u64) -> Churn {
        self.seed = seed;
        self
    }

    /// Counts failed operations instead of stopping at the first.
    pub fn tolerant(mut self) -> Churn {
        self.tolerant = true;
        self
    }

    /// Puts some keys on 5-second leases (their expiry deletes them in the source).
    pub fn with_leases(mut self) -> Churn {
        self.leases = true;
        self
    }

    fn key(&self, i: u64) -> String {
        format!("{}c-{:07}", self.prefix, i % self.keyspace.max(1) as u64)
    }

    /// The `n`th operation of the sequence: 55% puts (5 of them leased with `leases`), 20%
    /// deletes, 15% Txns of 2-8 puts, 10% range deletes of up to 16 neighbouring keys.
    fn op(&self, rng: &mut SplitMix64, n: usize) -> ChurnOp {
        let value = format!("{n}:{}", "v".repeat(self.value_size.saturating_sub(8)));
        let k = rng.next();
        match rng.next() % 100 {
            0..5 if self.leases => ChurnOp::LeasedPut(self.key(k), value),
            0..55 => ChurnOp::Put(self.key(k), value),
            55..75 => ChurnOp::Delete(self.key(k)),
            75..90 => {
                let width = 2 + rng.next() % 7;
                ChurnOp::Txn((0..width).map(|j| (self.key(k + j * 7919), value.clone())).collect())
            }
            _ => {
                let from = k % self.keyspace.max(1) as u64;
                let to = (from + 1 + rng.next() % 16).min(self.keyspace as u64);
                ChurnOp::DeleteRange(self.key(from), format!("{}c-{:07}", self.prefix, to))
            }
        }
    }

    /// Starts the churn on its own task; it ends after `ops` operations. Each operation is sent
    /// at its scheduled time on a task of its own, whether or not earlier ones returned.
    pub fn spawn(self, client: Client) -> tokio::task::JoinHandle<anyhow::Result<ChurnReport>> {
        tokio::spawn(async move {
            let mut rng = SplitMix64(self.seed);
            let period = Duration::from_secs_f64(1.0 / f64::from(self.rate.max(1)));
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut tasks = tokio::task::JoinSet::new();
            let mut failed = 0;
            let mut judge = |done: Result<anyhow::Result<()>, tokio::task::JoinError>| match done? {
                Err(_) if self.tolerant => {
                    failed += 1;
                    anyhow::Ok(())
                }
                other => other,
            };
            for n in 0..self.ops {
                tick.tick().await;
                let op = self.op(&mut rng, n);
                let mut c = client.clone();
                tasks.spawn(async move { op.run(&mut c).await });
                while let Some(done) = tasks.try_join_next() {
                    judge(done)?;
                }
            }
            while let Some(done) = tasks.join_next().await {
                judge(done)?;
            }
            Ok(ChurnReport { ops: self.ops - failed, failed })
        })
    }
}

/// What a finished churn did.
#[derive(Clone, Debug)]
pub struct ChurnReport {
    /// Operations that were acknowledged.
    pub ops: usize,
    /// Operations that failed (only a tolerant churn counts them; they may or may not have
    /// landed).
    pub failed: usize,
}

enum ChurnOp {
    Put(String, String),
    LeasedPut(String, String),
    Delete(String),
    Txn(Vec<(String, String)>),
    DeleteRange(String, String),
}

impl ChurnOp {
    async fn run(self, c: &mut Client) -> anyhow::Result<()> {
        match self {
            ChurnOp::Put(k, v) => drop(c.put(k, v, None).await?),
            ChurnOp::LeasedPut(k, v) => {
                let lease = c.lease_grant(5, None).await?.id();
                drop(c.put(k, v, Some(PutOptions::new().with_lease(lease))).await?)
            }
            ChurnOp::Delete(k) => drop(c.delete(k, None).await?),
            ChurnOp::Txn(puts) => {
                // One key once per Txn (etcd refuses duplicates).
                let mut seen = std::collections::HashSet::new();
                let ops: Vec<TxnOp> = puts
                    .into_iter()
                    .filter(|(k, _)| seen.insert(k.clone()))
                    .map(|(k, v)| TxnOp::put(k, v, None))
                    .collect();
                drop(c.txn(Txn::new().and_then(ops)).await?)
            }
            ChurnOp::DeleteRange(from, to) => {
                drop(c.delete(from, Some(DeleteOptions::new().with_range(to))).await?)
            }
        }
        Ok(())
    }
}

/// SplitMix64: a seeded, reproducible op sequence is all the churn needs from randomness.
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}
