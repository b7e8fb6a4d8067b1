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
use mirror_core::{unary, ErrorClass, EtcdError, Side};

use crate::checkpoint::{Checkpoint, DecodeError, Role};

/// A random nonce for one writer (a claim and the commits of the writer it makes): every
/// commit id it sends starts with it, so a stored record tells whether this writer wrote it.
fn writer_nonce() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    // Each RandomState has fresh keys (seeded from the OS's randomness, then stepped).
    format!("{:016x}", std::collections::hash_map::RandomState::new().build_hasher().finish())
}

/// A commit id unique to this attempt: the writer's nonce and a counter.
fn next_commit_id(nonce: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    format!("{nonce}-{}", COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// Whether `commit` is an id made with `nonce`.
fn made_with(commit: &str, nonce: &str) -> bool {
    commit.strip_prefix(nonce).is_some_and(|rest| rest.starts_with('-'))
}

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

/// A deliberately broken writer, to prove the harness catches one (issue #12): in debug
/// builds only, `MIRROR_FAILPOINT_DROP_CHECKPOINT_EVERY=N` drops the checkpoint put from every
/// Nth commit. Release builds compile it to `false`.
mod failpoint {
    #[cfg(debug_assertions)]
    pub(super) fn drop_checkpoint_put() -> bool {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::OnceLock;
        static EVERY: OnceLock<u64> = OnceLock::new();
        static COMMITS: AtomicU64 = AtomicU64::new(0);
        let every = *EVERY.get_or_init(|| {
            std::env::var("MIRROR_FAILPOINT_DROP_CHECKPOINT_EVERY")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        });
        every > 0 && (COMMITS.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(every)
    }

    #[cfg(not(debug_assertions))]
    pub(super) fn drop_checkpoint_put() -> bool {
        false
    }
}

/// What a claim plans from: everything in a stored record but who wrote it (epoch, agent,
/// commit id).
fn replication_state(observed: &Observed) -> Option<Checkpoint> {
    match observed {
        Observed::Absent => None,
        Observed::Present { record, .. } => {
            let mut state = record.clone();
            state.epoch = 0;
            state.agent_id.clear();
            state.commit.clear();
            Some(state)
        }
    }
}

/// Whether a linearizable read of the checkpoint (store at `head`, key last written at `seen`,
/// 0 if absent) shows a target older than this writer's own commit at `committed`. No writer
/// can move a key's mod revision backwards, and a linearizable read sees every acknowledged
/// write: so the member that answered lost writes it had acknowledged, or the target was
/// restored from an older snapshot.
fn went_back(committed: i64, head: i64, seen: i64) -> bool {
    head < committed || (seen > 0 && seen < committed)
}

/// etcd's default `--max-txn-ops`.
const DEFAULT_MAX_TXN_OPS: usize = 128;

/// Why a fenced write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// A writer with a newer epoch holds the fence: cold standby.
    #[error("fenced by epoch {stored} (this agent has epoch {ours})")]
    FencedByNewerEpoch {
        /// Epoch in the checkpoint.
        stored: u64,
        /// Our epoch.
        ours: u64,
    },
    /// An older or equal epoch wrote after we held the fence: someone runs with a stale config.
    #[error(
        "epoch regressed: {agent:?} wrote the checkpoint with epoch {stored} while this agent (epoch {ours}) holds or claims it; another agent runs with this epoch: give the one that should write a higher epoch"
    )]
    EpochRegressed {
        /// Epoch in the checkpoint.
        stored: u64,
        /// Our epoch.
        ours: u64,
        /// The writer named in the record.
        agent: String,
    },
    /// The checkpoint belongs to another link: two links write one range.
    #[error("checkpoint belongs to link {stored:?}, not {ours:?}")]
    PrefixConflict {
        /// Link in the checkpoint.
        stored: String,
        /// Our link.
        ours: String,
    },
    /// The target was promoted: nobody mirrors into it any more.
    #[error("the target was cut over (checkpoint role is primary)")]
    CutOver,
    /// The checkpoint key was deleted under us.
    #[error("the checkpoint key was deleted: fence lost")]
    FenceLost,
    /// A read shows the target older than a write it acknowledged to this writer: a member
    /// lost applied writes (etcd 3.5.0-3.5.2 can, when killed under load: etcd-io/etcd#13766,
    /// fixed in 3.5.3) or the target was restored from an older snapshot. Its answers, compare
    /// results included, can no longer be trusted: fail closed.
    #[error("the target went back: a linearizable read shows revision {head} with the checkpoint written at {seen}, older than this writer's own commit at {committed}; a target member lost writes it had acknowledged (etcd 3.5.0-3.5.2 do when killed under load, etcd-io/etcd#13766; fixed in 3.5.3) or the target was restored from an older snapshot. Writes stopped: compare `etcdctl endpoint status --cluster` revisions, replace the member that is behind (member remove, wipe, add), then restart the agent")]
    TargetWentBack {
        /// The checkpoint's mod revision this writer committed.
        committed: i64,
        /// The revision of the store that answered.
        head: i64,
        /// The checkpoint's mod revision in that answer (0 if absent).
        seen: i64,
    },
    /// A guard of [`FencedWriter::commit_guarded`] failed while the fence held: nothing
    /// landed; read again and retry.
    #[error("a guarded write found its range changed since it was read; nothing was written")]
    GuardFailed,
    /// The checkpoint cannot be decoded; fail closed.
    #[error("checkpoint is corrupt: {0}")]
    Corrupt(#[from] DecodeError),
    /// A claim lost a race to a writer that moved the replication state (watermark, scan, ...)
    /// the claim was planned from: plan again from a fresh read. Claiming anyway with the old
    /// plan would rewind the checkpoint below data the other writer had already applied.
    /// Also: a commit found its own earlier, timed-out attempt landed under a different batch.
    #[error("the checkpoint moved under this writer (a claim race, or an earlier commit of ours whose answer was lost landed); planning again from a fresh read")]
    Raced,
    /// The Txn itself failed.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    /// The ops cannot be laid out under the target's `max_txn_ops` even with nesting.
    #[error(transparent)]
    TooManyOps(crate::nest::TooManyOps),
}

impl FenceError {
    /// The class of SPEC §5: etcd errors keep theirs; every fence outcome is permanent for
    /// this writer (standby outcomes are told apart by [`FenceError::standby_reason`]).
    pub fn class(&self) -> ErrorClass {
        match self {
            FenceError::Etcd(e) => e.class(),
            FenceError::Raced | FenceError::GuardFailed => ErrorClass::Transient,
            _ => ErrorClass::Permanent,
        }
    }

    /// For outcomes that mean "another writer legitimately holds the fence": the `Fenced`
    /// condition's reason. The agent goes to cold standby instead of failing.
    pub fn standby_reason(&self) -> Option<&'static str> {
        match self {
            FenceError::FencedByNewerEpoch { .. } => Some("FencedByNewerEpoch"),
            FenceError::EpochRegressed { .. } => Some("EpochRegressed"),
            FenceError::CutOver => Some("TargetPromoted"),
            _ => None,
        }
    }

    /// CamelCase reason for status.
    pub fn reason(&self) -> &'static str {
        match self {
            FenceError::FencedByNewerEpoch { .. } => "FencedByNewerEpoch",
            FenceError::EpochRegressed { .. } => "EpochRegressed",
            FenceError::PrefixConflict { .. } => "PrefixConflict",
            FenceError::CutOver => "TargetPromoted",
            FenceError::FenceLost => "FenceLost",
            FenceError::TargetWentBack { .. } => "TargetWentBack",
            FenceError::Raced => "FenceRaced",
            FenceError::GuardFailed => "GuardFailed",
            FenceError::Corrupt(_) => "CorruptCheckpoint",
            FenceError::Etcd(_) => "EtcdError",
            FenceError::TooManyOps(_) => "RevisionTooLarge",
        }
    }
}

/// What the checkpoint key holds now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observed {
    /// No checkpoint: a new link.
    Absent,
    /// A decodable record and its mod revision.
    Present {
        /// The record.
        record: Checkpoint,
        /// Its mod revision, the fence token.
        mod_revision: i64,
        /// The target revision that created the key: every key this link wrote has a mod
        /// revision above it.
        create_revision: i64,
    },
}

impl Observed {
    /// The mod revision to compare against (0 matches an absent key in etcd).
    pub fn mod_revision(&self) -> i64 {
        match self {
            Observed::Absent => 0,
            Observed::Present { mod_revision, .. } => *mod_revision,
        }
    }
}

/// Reads and decodes the checkpoint; undecodable bytes are an error (fail closed).
pub async fn read_checkpoint(
    kv: &mut KvClient,
    key: &[u8],
    timeout: Duration,
) -> Result<Observed, FenceError> {
    read_checkpoint_since(kv, key, timeout, 0).await
}

/// [`read_checkpoint`] by a writer that already committed the checkpoint at target revision
/// `committed` (0: never): a store that answers from before it (a member that lost acknowledged
/// writes, a target restored from an older snapshot) is [`FenceError::TargetWentBack`] at once,
/// at connect, not only once a later compare fails. Resuming from the older record it holds
/// would otherwise look like a normal restart.
pub async fn read_checkpoint_since(
    kv: &mut KvClient,
    key: &[u8],
    timeout: Duration,
    committed: i64,
) -> Result<Observed, FenceError> {
    let resp = unary("read checkpoint", Side::Target, timeout, kv.get(key, None)).await?;
    let seen = resp.kvs().first().map_or(0, |kv| kv.mod_revision());
    let head = resp.header().map_or(0, |h| h.revision());
    if committed > 0 && went_back(committed, head, seen) {
        return Err(FenceError::TargetWentBack { committed, head, seen });
    }
    match resp.kvs().first() {
        None => Ok(Observed::Absent),
        Some(kv) => Ok(Observed::Present {
            record: Checkpoint::decode(kv.value())?,
            mod_revision: kv.mod_revision(),
            create_revision: kv.create_revision(),
        }),
    }
}

/// Whether `ours` may take the fence from what is stored (checked before the first commit).
pub fn may_claim(observed: &Observed, ours: &Checkpoint) -> Result<(), FenceError> {
    match observed {
        Observed::Absent => Ok(()),
        Observed::Present { record, .. } => {
            if record.link_uid != ours.link_uid {
                return Err(FenceError::PrefixConflict {
                    stored: record.link_uid.clone(),
                    ours: ours.link_uid.clone(),
                });
            }
            if record.role == Role::Primary {
                return Err(FenceError::CutOver);
            }
            if record.epoch > ours.epoch {
                return Err(FenceError::FencedByNewerEpoch { stored: record.epoch, ours: ours.epoch });
            }
            Ok(())
        }
    }
}

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
            let bytes = record.encode();
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
                if stored.encode() == bytes {
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
        }
    }

    /// Lays out Txns for a target whose `--max-txn-ops` is `max_txn_ops` (default 128).
    pub fn with_max_txn_ops(mut self, max_txn_ops: usize) -> FencedWriter {
        self.max_txn_ops = max_txn_ops.max(2);
        self
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
        let next_bytes = next.as_ref().map(Checkpoint::encode);
        let mut all = self.lay_out(ops, usize::from(next_bytes.is_some()))?;
        if let Some(bytes) = &next_bytes {
            if !failpoint::drop_checkpoint_put() {
                all.push(TxnOp::put(self.key.clone(), bytes.clone(), None));
            }
        }
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
                self.record = next;
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
                self.record = next;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A read older than our own commit is told apart from a newer writer (higher mod revision)
    /// and from a deleted key (current head, no key).
    #[test]
    fn a_read_older_than_our_commit_is_a_target_that_went_back() {
        assert!(went_back(612, 700, 431), "the key older than our commit");
        assert!(went_back(612, 500, 0), "the whole store older than our commit");
        assert!(!went_back(612, 700, 650), "another writer moved the key on");
        assert!(!went_back(612, 700, 0), "deleted after our commit");
        assert!(!went_back(612, 612, 612), "our own commit");
    }

    /// Commit ids never repeat and carry their writer's nonce; two writers (two pods with the
    /// same host name and pid, or two in one process) never share a nonce, so a writer never
    /// takes another's record for its own.
    #[test]
    fn commit_ids_are_unique_and_name_their_writer() {
        let (a, b) = (writer_nonce(), writer_nonce());
        assert_ne!(a, b);
        let ids: std::collections::HashSet<String> = (0..10_000).map(|_| next_commit_id(&a)).collect();
        assert_eq!(ids.len(), 10_000);
        assert!(ids.iter().all(|id| made_with(id, &a) && !made_with(id, &b)));
        assert!(!made_with(&format!("{a}0-1"), &a), "a longer nonce is another writer's");
    }

    /// may_claim: another link, a promoted target and a newer epoch refuse; older or equal
    /// epochs of our link may be taken over.
    #[test]
    fn claim_rules() {
        let record = crate::checkpoint::test_record;
        let stored = |r: Checkpoint| Observed::Present { record: r, mod_revision: 5, create_revision: 2 };
        let ours = record("l", 2, Role::Mirror);
        assert!(may_claim(&Observed::Absent, &ours).is_ok());
        assert!(may_claim(&stored(record("l", 1, Role::Mirror)), &ours).is_ok());
        assert!(may_claim(&stored(record("l", 2, Role::Mirror)), &ours).is_ok());
        assert!(matches!(
            may_claim(&stored(record("l", 3, Role::Mirror)), &ours),
            Err(FenceError::FencedByNewerEpoch { stored: 3, ours: 2 })
        ));
        assert!(matches!(may_claim(&stored(record("l", 1, Role::Primary)), &ours), Err(FenceError::CutOver)));
        assert!(matches!(
            may_claim(&stored(record("other", 1, Role::Mirror)), &ours),
            Err(FenceError::PrefixConflict { .. })
        ));
    }
}
