//! The fenced writer: every target write of the agent goes through [`FencedWriter::commit`].
//!
//! ## Why a mod-revision compare is the whole fence (G4)
//! 1. Every write that claims or moves the checkpoint puts the checkpoint key, which gives it a
//!    new mod revision.
//! 2. Every Txn, data-only or not, is guarded by `ModRevision(checkpoint_key) == cached`.
//! 3. So once any other writer (a newer epoch, a cutover, an operator) touches the key, every
//!    Txn this writer still has in flight or will send fails its compare, atomically, in the
//!    target itself; no clock, lease or side channel is involved.
//!
//! A Txn sent before the one before it answered compares the checkpoint's value instead, with
//! the same effect (the `pipeline` module says why).
//!
//! ## Retry ownership
//! A Txn whose answer was lost (timeout, broken connection) may or may not have landed. The
//! caller retries the *same* commit, and the writer sends it with the same commit id, so with
//! the same bytes. If it had landed, the retry's compare fails; the writer then re-reads the key
//! and, finding exactly the bytes it wrote, adopts them as committed (the ambiguous-commit rule
//! of SPEC §6). Data-only Txns are idempotent puts and deletes of whole
//! revisions, so re-applying them is harmless.
//!
//! ## Compare failures
//! Re-read the key: deleted → fence lost; other link → prefix conflict; role primary → cut
//! over; higher epoch → fenced; a record this writer wrote (its commit id carries the writer's
//! nonce) → one of its lost answers landed under another batch: `Raced`, plan again from the
//! checkpoint; otherwise a lower or equal epoch → taken over only before this writer's first
//! successful commit, after it the epoch regressed and the writer stops.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, KvClient, Txn, TxnOp};
use mirror_core::{unary, Side};

use crate::checkpoint::{Checkpoint, Role};
use crate::commit_id::{made_with, next_commit_id, writer_nonce};
use crate::observed::{may_claim, read_checkpoint, replication_state, went_back, Observed};
use crate::FenceError;

mod pipeline;
pub use pipeline::Prepared;

/// A Txn of `ops` that runs only while the checkpoint key's mod revision is `mod_revision`
/// (0 matches an absent key): the fence of every target write (G4).
fn guarded(key: &[u8], mod_revision: i64, ops: Vec<TxnOp>) -> Txn {
    guarded_by(key, mod_revision, Vec::new(), ops)
}

/// [`guarded`] with more compares beside the fence's.
fn guarded_by(key: &[u8], mod_revision: i64, mut guards: Vec<Compare>, ops: Vec<TxnOp>) -> Txn {
    guards.insert(0, Compare::mod_revision(key.to_vec(), CompareOp::Equal, mod_revision));
    Txn::new().when(guards).and_then(ops)
}

/// Whether a failed guarded Txn's `else` read shows the checkpoint still at `mod_revision`:
/// then the fence held and only a guard failed.
fn fence_unmoved(resp: &etcd_client::TxnResponse, mod_revision: i64) -> bool {
    resp.op_responses().iter().any(|r| match r {
        etcd_client::TxnOpResponse::Get(get) => {
            get.kvs().first().is_some_and(|kv| kv.mod_revision() == mod_revision)
        }
        _ => false,
    })
}

/// A deliberately broken writer, to prove the harness catches one (issue #12): with the
/// `failpoints` feature (`mirror_core::failpoint`), `MIRROR_FAILPOINT_DROP_CHECKPOINT_EVERY=N`
/// drops the checkpoint put from every Nth commit.
mod failpoint {
    pub(super) fn drop_checkpoint_put() -> bool {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::OnceLock;
        static EVERY: OnceLock<u64> = OnceLock::new();
        static COMMITS: AtomicU64 = AtomicU64::new(0);
        let every = *EVERY.get_or_init(|| {
            mirror_core::failpoint::armed("DROP_CHECKPOINT_EVERY").and_then(|v| v.parse().ok()).unwrap_or(0)
        });
        every > 0 && (COMMITS.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(every)
    }
}

/// etcd's default `--max-txn-ops`.
const DEFAULT_MAX_TXN_OPS: usize = 128;

/// The only way the agent writes to the target.
pub struct FencedWriter {
    kv: KvClient,
    key: Vec<u8>,
    mod_revision: i64,
    create_revision: i64,
    record: Checkpoint,
    timeout: Duration,
    /// The target's `--max-txn-ops` per nesting level.
    max_txn_ops: usize,
    /// The last commit whose Txn failed without an answer that settles it (timeout, lost
    /// connection): the record as the caller gave it and the commit id it was sent with.
    unsettled: Option<(Checkpoint, String)>,
    /// Starts every commit id of this writer (see [`writer_nonce`]).
    nonce: String,
    /// The watermark of the record held, published to whoever acts on it beside the writes
    /// (the lease keeper revokes a lease only once the watermark passed its expiry).
    watermark: tokio::sync::watch::Sender<i64>,
}

impl FencedWriter {
    /// Takes the fence: writes `record` if the key still is what `observed` saw. A lower or
    /// equal stored epoch is taken over; a concurrent change is re-read and judged once more.
    pub async fn claim(
        mut kv: KvClient,
        key: Vec<u8>,
        mut observed: Observed,
        mut record: Checkpoint,
        timeout: Duration,
    ) -> Result<FencedWriter, FenceError> {
        // Lost races are retried: three times against a writer of our epoch (then it is an
        // active duplicate: EpochRegressed), for as long as it takes against a lower epoch
        // (ours wins; giving up there reported a regression that was not one).
        let mut pause =
            mirror_core::ExponentialBackoff::new(Duration::from_millis(50), Duration::from_secs(1), 2);
        let mut races = 0u32;
        let planned_from = replication_state(&observed);
        let nonce = writer_nonce();
        loop {
            let lower_epoch_racing =
                matches!(&observed, Observed::Present { record: stored, .. } if stored.epoch < record.epoch);
            if races >= 3 && !lower_epoch_racing {
                break;
            }
            if races > 0 {
                tokio::time::sleep(pause.next_delay()).await;
            }
            races += 1;
            may_claim(&observed, &record)?;
            record.commit = next_commit_id(&nonce);
            let bytes = record.encode().map_err(FenceError::InvalidRecord)?;
            let txn =
                guarded(&key, observed.mod_revision(), vec![TxnOp::put(key.clone(), bytes.clone(), None)]);
            let resp = unary("claim fence", Side::Target, timeout, kv.txn(txn)).await?;
            if resp.succeeded() {
                let mod_revision = resp.header().map_or(0, |h| h.revision());
                let create_revision = match &observed {
                    Observed::Present { create_revision, .. } => *create_revision,
                    Observed::Absent => mod_revision,
                };
                let revisions = (mod_revision, create_revision);
                return Ok(FencedWriter::holding(kv, key, revisions, record, timeout, nonce));
            }
            observed = read_checkpoint(&mut kv, &key, timeout).await?;
            if let Observed::Present { record: stored, mod_revision, create_revision } = &observed {
                if stored.encode().is_ok_and(|stored| stored == bytes) {
                    // Our own earlier attempt landed.
                    let revisions = (*mod_revision, *create_revision);
                    return Ok(FencedWriter::holding(kv, key, revisions, record, timeout, nonce));
                }
            }
            if replication_state(&observed) != planned_from {
                // Found by `harness chaos --seed 42`: a fence bump whose claim raced the
                // running writer rewrote the checkpoint with the watermark it had read before,
                // below what that writer had applied since (G3 broke until the replay caught up).
                // Never claim with a stale plan: a lower epoch is raced (plan again and win); a
                // writer of our own epoch that is moving the state is an active duplicate.
                may_claim(&observed, &record)?;
                return match &observed {
                    Observed::Present { record: stored, .. } if stored.epoch == record.epoch => {
                        Err(FenceError::EpochRegressed {
                            stored: stored.epoch,
                            ours: record.epoch,
                            agent: stored.agent_id.clone(),
                        })
                    }
                    _ => Err(FenceError::Raced),
                };
            }
        }
        // Three lost races in a row against a writer of our own epoch.
        match observed {
            Observed::Present { record: stored, .. } => Err(FenceError::EpochRegressed {
                stored: stored.epoch,
                ours: record.epoch,
                agent: stored.agent_id,
            }),
            Observed::Absent => Err(FenceError::FenceLost),
        }
    }

    /// The writer that holds the fence at (mod revision, create revision) of the key.
    fn holding(
        kv: KvClient,
        key: Vec<u8>,
        (mod_revision, create_revision): (i64, i64),
        record: Checkpoint,
        timeout: Duration,
        nonce: String,
    ) -> FencedWriter {
        let record_watermark = record.watermark;
        FencedWriter {
            kv,
            key,
            mod_revision,
            create_revision,
            record,
            timeout,
            max_txn_ops: DEFAULT_MAX_TXN_OPS,
            unsettled: None,
            nonce,
            watermark: tokio::sync::watch::Sender::new(record_watermark),
        }
    }

    /// Lays out Txns for a target whose `--max-txn-ops` is `max_txn_ops` (default 128).
    pub fn with_max_txn_ops(mut self, max_txn_ops: usize) -> FencedWriter {
        self.set_max_txn_ops(max_txn_ops);
        self
    }

    /// From now on, lays out Txns for `max_txn_ops` ops per level (a target that refused more).
    pub fn set_max_txn_ops(&mut self, max_txn_ops: usize) {
        self.max_txn_ops = crate::nest::ops_per_level(max_txn_ops as i64);
    }

    /// The watermark of the record this writer holds, from now on as each commit moves it.
    pub fn watermarks(&self) -> tokio::sync::watch::Receiver<i64> {
        self.watermark.subscribe()
    }

    /// Holds `next` as the record the fence now stores.
    fn hold(&mut self, next: Checkpoint) {
        self.watermark.send_replace(next.watermark);
        self.record = next;
    }

    /// The per-level op limit Txns are laid out for.
    pub fn max_txn_ops(&self) -> usize {
        self.max_txn_ops
    }

    /// The record this writer last committed.
    pub fn record(&self) -> &Checkpoint {
        &self.record
    }

    /// The fence token every Txn compares against.
    pub fn mod_revision(&self) -> i64 {
        self.mod_revision
    }

    /// The target revision that created the checkpoint key. Keys in the destination range with
    /// a mod revision at or below it were there before this link wrote anything.
    pub fn create_revision(&self) -> i64 {
        self.create_revision
    }

    /// The checkpoint key.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// A clone of the KV client (for reads that need no fence).
    pub fn kv(&self) -> KvClient {
        self.kv.clone()
    }

    /// One fenced Txn: `ops` and, when `next` is given, the checkpoint put, all or nothing.
    /// Returns the target revision of the Txn.
    pub async fn commit(&mut self, ops: Vec<TxnOp>, next: Option<Checkpoint>) -> Result<i64, FenceError> {
        self.commit_guarded(ops, next, Vec::new()).await
    }

    /// [`FencedWriter::commit`] that also requires every compare of `guards` (for example "no
    /// key of a range changed since the revision it was read at", before a range delete). When
    /// only a guard failed, nothing landed and the fence is still ours:
    /// [`FenceError::GuardFailed`]; the caller reads again and builds new ops. The checkpoint's
    /// mod revision comes back in the same failed Txn (its `else` branch), so telling a guard
    /// from the fence needs no second read that could race.
    pub async fn commit_guarded(
        &mut self,
        ops: Vec<TxnOp>,
        next: Option<Checkpoint>,
        guards: Vec<Compare>,
    ) -> Result<i64, FenceError> {
        // Each commit's bytes are unique to this process and commit, so adopting "our" ambiguous
        // commit is never a mistake. A retry of a commit whose answer was lost (the same record
        // again, right after the failure) is sent with the *same* commit id: if the first try
        // landed, the retry's compare fails and the re-read finds exactly these bytes. A fresh
        // id per try made that landed first try look like another writer of our epoch
        // (EpochRegressed), which parked a healthy agent in standby after a target stall.
        let given = next.clone();
        let next = next.map(|mut n| {
            n.commit = match &self.unsettled {
                Some((record, id)) if *record == n => id.clone(),
                _ => next_commit_id(&self.nonce),
            };
            n
        });
        let next_bytes =
            next.as_ref().map(Checkpoint::encode).transpose().map_err(FenceError::InvalidRecord)?;
        let all = self.with_checkpoint_put(ops, next_bytes.as_deref())?;
        let guarding = !guards.is_empty();
        let mut txn = guarded_by(&self.key, self.mod_revision, guards, all);
        if guarding {
            txn = txn.or_else([TxnOp::get(self.key.clone(), None)]);
        }
        let resp = match unary("fenced txn", Side::Target, self.timeout, self.kv.txn(txn)).await {
            Ok(resp) => resp,
            Err(e) => {
                // Reusing the id after a failure that did settle it (nothing landed) is
                // harmless: no stored bytes can match a write that never happened.
                self.unsettled = given.zip(next.map(|n| n.commit));
                return Err(e.into());
            }
        };
        let revision = resp.header().map_or(0, |h| h.revision());
        self.unsettled = None;
        if resp.succeeded() {
            if let Some(next) = next {
                self.mod_revision = revision;
                self.hold(next);
            }
            return Ok(revision);
        }
        if guarding && fence_unmoved(&resp, self.mod_revision) {
            return Err(FenceError::GuardFailed);
        }
        self.judge_failed_compare(next_bytes.as_deref(), next).await
    }

    /// Checks that the fence is still ours without writing: re-reads the key and, if anyone else
    /// touched it, names the outcome as a failed commit would. Lets an idle writer notice a
    /// takeover at once instead of at its next write.
    pub async fn verify_held(&mut self) -> Result<(), FenceError> {
        let resp =
            unary("check fence", Side::Target, self.timeout, self.kv.get(self.key.clone(), None)).await?;
        match resp.kvs().first() {
            Some(kv) if kv.mod_revision() == self.mod_revision => Ok(()),
            _ => self.judge_failed_compare(None, None).await.map(|_| ()),
        }
    }

    /// A handle for data-only Txns guarded by the fence compare, usable concurrently with
    /// others of its kind (they all compare the same mod revision, so they do not conflict with
    /// each other). It never moves the checkpoint: a takeover makes every one of them fail.
    pub fn data_writer(&self) -> DataWriter {
        DataWriter {
            kv: self.kv.clone(),
            key: self.key.clone(),
            mod_revision: self.mod_revision,
            max_txn_ops: self.max_txn_ops,
            timeout: self.timeout,
        }
    }

    /// `ops` laid out as the top level of one Txn, then the put of the checkpoint's `bytes`
    /// when given (unless the `DROP_CHECKPOINT_EVERY` failpoint drops it).
    fn with_checkpoint_put(&self, ops: Vec<TxnOp>, bytes: Option<&[u8]>) -> Result<Vec<TxnOp>, FenceError> {
        let mut all = self.lay_out(ops, usize::from(bytes.is_some()))?;
        if let Some(bytes) = bytes {
            if !failpoint::drop_checkpoint_put() {
                all.push(TxnOp::put(self.key.clone(), bytes.to_vec(), None));
            }
        }
        Ok(all)
    }

    /// `ops` as the top level of one Txn, nested where they exceed `max_txn_ops`.
    fn lay_out(&self, ops: Vec<TxnOp>, reserved: usize) -> Result<Vec<TxnOp>, FenceError> {
        crate::nest::nest(ops, self.max_txn_ops, reserved).map_err(FenceError::TooManyOps)
    }

    /// Re-reads the fence after a failed compare and names the outcome.
    async fn judge_failed_compare(
        &mut self,
        attempted: Option<&[u8]>,
        next: Option<Checkpoint>,
    ) -> Result<i64, FenceError> {
        let resp =
            unary("re-read checkpoint", Side::Target, self.timeout, self.kv.get(self.key.clone(), None))
                .await?;
        let seen = resp.kvs().first().map_or(0, |kv| kv.mod_revision());
        let head = resp.header().map_or(0, |h| h.revision());
        if went_back(self.mod_revision, head, seen) {
            return Err(FenceError::TargetWentBack { committed: self.mod_revision, head, seen });
        }
        let Some(kv) = resp.kvs().first() else { return Err(FenceError::FenceLost) };
        if let (Some(bytes), Some(next)) = (attempted, next) {
            if kv.value() == bytes {
                self.mod_revision = kv.mod_revision();
                self.hold(next);
                return Ok(kv.mod_revision());
            }
        }
        let stored = Checkpoint::decode(kv.value())?;
        if stored.link_uid != self.record.link_uid {
            return Err(FenceError::PrefixConflict {
                stored: stored.link_uid,
                ours: self.record.link_uid.clone(),
            });
        }
        if stored.role == Role::Primary {
            return Err(FenceError::CutOver);
        }
        if stored.epoch > self.record.epoch {
            return Err(FenceError::FencedByNewerEpoch { stored: stored.epoch, ours: self.record.epoch });
        }
        if made_with(&stored.commit, &self.nonce) {
            // One of this writer's commits whose answer was lost landed after all (any of
            // them: more answers may have been lost since, e.g. while a new target leader was
            // elected), and this try carries another batch: not a regression. Its data and
            // checkpoint landed together, so planning again from the checkpoint as it stands
            // is exact.
            return Err(FenceError::Raced);
        }
        Err(FenceError::EpochRegressed {
            stored: stored.epoch,
            ours: self.record.epoch,
            agent: stored.agent_id,
        })
    }
}

/// Data-only Txns under the fence compare of one [`FencedWriter`] state (see
/// [`FencedWriter::data_writer`]).
#[derive(Clone)]
pub struct DataWriter {
    kv: KvClient,
    key: Vec<u8>,
    mod_revision: i64,
    max_txn_ops: usize,
    timeout: Duration,
}

impl DataWriter {
    /// Sends `ops` as one fenced Txn; true when it landed. Anything else (a failed compare, an
    /// error) is false: the caller redoes the ops through [`FencedWriter::commit`], which judges
    /// what happened.
    pub async fn commit(&self, ops: Vec<TxnOp>) -> bool {
        let Ok(ops) = crate::nest::nest(ops, self.max_txn_ops, 0) else { return false };
        let txn = guarded(&self.key, self.mod_revision, ops);
        let mut kv = self.kv.clone();
        unary("fenced data txn", Side::Target, self.timeout, kv.txn(txn)).await.is_ok_and(|r| r.succeeded())
    }
}
