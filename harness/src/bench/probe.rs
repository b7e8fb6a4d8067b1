//! The target's own ceiling for ordered fenced single-revision Txns, measured by a probe
//! independent of the agent (issue #46): it sends revision R's Txn after R-1's, as an exact
//! link with no work of its own would, in one of two shapes ([`Shape`]).

use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, KvClient, Txn, TxnOp};
use futures::stream::FuturesOrdered;
use futures::StreamExt as _;
use tokio::time::Instant;

use mirror_core::{now_rfc3339, Change, ExactRevision, Spacer};
use mirror_fence::{ops_per_level, Checkpoint, ExactFence, RevisionTxn, Role};

/// How long each ceiling probe sends.
pub(super) const PROBE_SECONDS: u64 = 5;

/// The Txn the probe sends for each revision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shape {
    /// SPEC §11's pattern: compare the fence key's mod revision with R-1, put one key and the
    /// fence key (a few bytes).
    Spec,
    /// What the exact tail sends for a revision that creates one key, built by the same code
    /// ([`ExactFence::txn`]): the checkpoint's mod revision and version compared, the key's
    /// version compared with 0, the key put, then the link's whole checkpoint record (JSON, the
    /// fields the tail writes), and a read of the checkpoint should a compare fail.
    Tail,
}

impl Shape {
    /// How it reads in a line of the bench.
    pub(super) fn named(self) -> &'static str {
        match self {
            Shape::Spec => "SPEC §11 shape",
            Shape::Tail => "the tail's own shape",
        }
    }
}

/// A probe's fence on one target: what it compares, from which revision on.
struct Probe {
    shape: Shape,
    fence: ExactFence,
    /// The revision before the first Txn.
    head: i64,
    /// The bytes of the last record built (the tail shape's checkpoint record).
    record_bytes: usize,
}

impl Probe {
    /// Sets the fence up on `kv`: SPEC's fence key is put first (its mod revision is then the
    /// head); the tail's checkpoint is absent before its first Txn, as after a seed.
    async fn start(kv: &mut KvClient, shape: Shape) -> anyhow::Result<Probe> {
        let head = match shape {
            Shape::Spec => kv.put(b"/probe/fence".to_vec(), "0", None).await?,
            Shape::Tail => kv.put(b"/probe/head".to_vec(), "0", None).await?,
        };
        let head = head.header().map_or(0, |h| h.revision());
        let fence = ExactFence::new(b"\0etcd-mirror/bench-probe/checkpoint".to_vec(), head);
        Ok(Probe { shape, fence, head, record_bytes: 0 })
    }

    /// Revision `r`'s Txn.
    fn txn(&mut self, r: i64) -> anyhow::Result<Txn> {
        let key = format!("/probe/{r}");
        if self.shape == Shape::Spec {
            let fence = b"/probe/fence".to_vec();
            return Ok(Txn::new()
                .when(vec![Compare::mod_revision(fence.clone(), CompareOp::Equal, r - 1)])
                .and_then(vec![TxnOp::put(key, "x", None), TxnOp::put(fence, r.to_string(), None)]));
        }
        Ok(self.tail_txn(r)?.to_txn(self.fence.key()))
    }

    /// The tail shape's Txn for revision `r`, as the fence builds it.
    fn tail_txn(&mut self, r: i64) -> anyhow::Result<RevisionTxn> {
        let change = Change::Put {
            key: format!("/probe/{r}").into_bytes(),
            value: b"x".to_vec(),
            lease: 0,
            version: 1,
            create_revision: r,
            prev_lease: 0,
        };
        let rev = ExactRevision { revision: r, changes: vec![change] };
        let record = record(r).encode()?;
        self.record_bytes = record.len();
        Ok(self.fence.txn(&rev, record, Vec::new(), ops_per_level(128))?)
    }
}

/// A checkpoint record as the tail writes it at revision `r` (the fields it sets, of the
/// lengths they have there: a link name, cluster IDs, host/pid, the range fingerprint, now).
fn record(r: i64) -> Checkpoint {
    Checkpoint {
        link_uid: "bench-exact".into(),
        epoch: 1,
        role: Role::Mirror,
        watermark: r,
        scanning: false,
        scan_cursor: Vec::new(),
        prune_pending: false,
        source_cluster_id: 0x8e9e_05c5_2164_694d,
        target_cluster_id: 0x5a1f_0e3c_77b2_41d9,
        agent_id: format!("{}/{}", gethostname(), std::process::id()),
        commit: String::new(),
        range: format!("sha256:{}", "0".repeat(32)),
        confirmed_time: now_rfc3339(),
        forced_resyncs: 0,
        scan_restarts: 0,
        initial_sync_completed: String::new(),
        excludes: Vec::new(),
        source_seen: r,
    }
}

/// This machine's host name, as the agent's ID holds it.
fn gethostname() -> String {
    std::fs::read_to_string("/etc/hostname").map_or_else(|_| "localhost".into(), |h| h.trim().to_owned())
}

/// A probe's ceiling: Txns/s landed, the share sent again, and the tail shape's record size.
pub(super) struct Ceiling {
    pub rate: f64,
    pub resent: f64,
    pub record_bytes: usize,
}

/// The probe's Txns arriving at `rate`/s for `seconds` (open loop: arrival i is due at i/rate
/// whether or not earlier ones landed) and sent one at a time in order, as an exact link with
/// no work of its own would: each one's time from its arrival to its landing, sorted.
pub(super) async fn probe_lag(client: &Client, rate: u32, seconds: u64) -> anyhow::Result<Vec<Duration>> {
    let mut kv = client.kv_client();
    let mut probe = Probe::start(&mut kv, Shape::Spec).await?;
    let total = rate as u64 * seconds;
    let start = Instant::now();
    let mut lags = Vec::with_capacity(total as usize);
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / rate.max(1) as f64);
        tokio::time::sleep_until(due).await;
        let r = probe.head + 1 + i as i64;
        anyhow::ensure!(kv.txn(probe.txn(r)?).await?.succeeded(), "the probe's Txn {r} failed its compare");
        lags.push(Instant::now() - due);
    }
    lags.sort();
    Ok(lags)
}

/// Txns/s of ordered fenced single-revision Txns of `shape` with `window` in flight for
/// [`PROBE_SECONDS`], each sent after the one before as `spacer` has it while that one is in
/// flight (as the agent's [`Spacer`], told each Txn's time; at once when the one ahead was
/// answered first), and the share sent again (etcd
/// ran a later one first: it failed its compare, and it and those behind it were sent again
/// in order).
pub(super) async fn probe_ceiling(
    client: &Client,
    shape: Shape,
    window: usize,
    mut spacer: Spacer,
) -> anyhow::Result<Ceiling> {
    let mut kv = client.kv_client();
    let mut probe = Probe::start(&mut kv, shape).await?;
    let (start, until) = (Instant::now(), Instant::now() + Duration::from_secs(PROBE_SECONDS));
    let head = probe.head;
    let (mut landed, mut next, mut sent, mut again) = (head, head + 1, 0u64, 0u64);
    let mut flight = FuturesOrdered::new();
    while Instant::now() < until {
        // Room for another: it goes now unless it must keep the gap behind the one in flight;
        // then it goes when the gap has passed or that one's answer came, whichever is first
        // (as the tail sends).
        let left = if flight.len() < window { Some(spacer.left(!flight.is_empty())) } else { None };
        if left == Some(Duration::ZERO) {
            // Sent now, on a task of its own, not when the flight is next polled.
            spacer.sent();
            let mut kv = kv.clone();
            let t = probe.txn(next)?;
            let at = Instant::now();
            let sending =
                tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move { kv.txn(t).await }));
            flight.push_back(async move { anyhow::Ok((sending.await??, at.elapsed())) });
            next += 1;
            sent += 1;
            continue;
        }
        let answer = tokio::select! {
            answer = flight.next() => answer.expect("in flight"),
            _ = spacer.pause(left.unwrap_or_default()), if left.is_some() => continue,
        };
        let (answer, took) = answer?;
        spacer.took(took);
        if answer.succeeded() {
            landed += 1;
        } else {
            // Sent before its predecessor landed: it and those behind it go again, in order.
            while let Some(answer) = flight.next().await {
                if answer?.0.succeeded() {
                    landed += 1;
                }
            }
            again += (next - (landed + 1)) as u64;
            next = landed + 1;
        }
    }
    while let Some(answer) = flight.next().await {
        if answer?.0.succeeded() {
            landed += 1;
        }
    }
    let rate = (landed - head) as f64 / start.elapsed().as_secs_f64();
    Ok(Ceiling { rate, resent: again as f64 / sent.max(1) as f64, record_bytes: probe.record_bytes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mirror_fence::Guard;

    /// The tail shape's Txn is the one the tail builds: the checkpoint's mod revision and
    /// version, then the key's version (absent before), the key and the record put.
    #[test]
    fn the_tail_shape_is_the_fences_txn_for_one_created_key() {
        let key = b"\0etcd-mirror/bench-probe/checkpoint".to_vec();
        let fence = ExactFence::new(key.clone(), 10);
        let mut probe = Probe { shape: Shape::Tail, fence, head: 10, record_bytes: 0 };
        // The first Txn after the seed finds the checkpoint absent; later ones at R-1.
        assert_eq!(
            probe.tail_txn(11).expect("builds").guards,
            vec![Guard::Version(key.clone(), 0), Guard::Version(b"/probe/11".to_vec(), 0)]
        );
        assert_eq!(
            probe.tail_txn(13).expect("builds").guards,
            vec![
                Guard::ModRevision(key.clone(), 12),
                Guard::Version(key, 2),
                Guard::Version(b"/probe/13".to_vec(), 0)
            ]
        );
        let decoded = Checkpoint::decode(&record(13).encode().expect("encodes")).expect("a valid record");
        assert_eq!((decoded.watermark, decoded.source_seen), (13, 13));
        assert!(
            probe.record_bytes > 200,
            "a record of the tail's size, not a few bytes: {}",
            probe.record_bytes
        );
    }
}
