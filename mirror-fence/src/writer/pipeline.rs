//! Commits sent before the one before them answered (compact mode's `sync.txns_in_flight`).
//!
//! ## Why a value compare fences a Txn sent behind another
//! The mod revision the checkpoint will have once the Txn before lands is not known when the
//! next one is sent (in compact mode other keyspaces share the target's revisions). What is
//! known is the record that Txn stores, and every record carries a commit id unique to this
//! writer and commit ([`crate::commit_id`]). So a Txn sent behind another is guarded by
//! `Value(checkpoint_key) == the bytes the one before stores`:
//! 1. It lands only after the one before it landed, and only if nothing wrote the checkpoint
//!    since: another writer's record (a claim, a cutover, an operator) never holds this
//!    writer's commit id, so every Txn behind fails its compare as it would on the mod revision.
//! 2. One that etcd ran before the one before it (etcd reorders concurrent requests, SPEC §11)
//!    fails its compare and lands nothing; the applier sends it again, in order.
//! 3. One that landed proves every one before it landed, whether or not their answers came.
//!
//! The first Txn of a run of them compares the mod revision, as every commit does.

use std::future::Future;

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnResponse};
use mirror_core::{unary, EtcdError, Side};

use super::{guarded, FencedWriter};
use crate::commit_id::next_commit_id;
use crate::{Checkpoint, FenceError};

/// A commit built to be sent while others are in flight ([`FencedWriter::prepare`]).
pub struct Prepared {
    txn: Txn,
    /// The record as the caller gave it.
    given: Checkpoint,
    /// The record as stored: `given` with this commit's id.
    stored: Checkpoint,
    /// `stored`, encoded: what the next Txn behind this one compares the checkpoint with.
    bytes: Vec<u8>,
}

impl Prepared {
    /// The checkpoint's value once this Txn landed.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The record as the caller gave it (without its commit id).
    pub fn given(&self) -> &Checkpoint {
        &self.given
    }
}

impl FencedWriter {
    /// `ops` with the checkpoint put of `next`, as one Txn to send before the one before it
    /// answered: guarded by the checkpoint's value being `after` (the bytes the Txn before it
    /// stores, [`Prepared::bytes`]) or, with `after = None`, by the mod revision as every
    /// commit. Nothing of the writer changes until [`FencedWriter::prepared_landed`].
    pub fn prepare(
        &self,
        ops: Vec<TxnOp>,
        next: Checkpoint,
        after: Option<&[u8]>,
    ) -> Result<Prepared, FenceError> {
        let mut stored = next.clone();
        stored.commit = next_commit_id(&self.nonce);
        let bytes = stored.encode().map_err(FenceError::InvalidRecord)?;
        let all = self.with_checkpoint_put(ops, Some(&bytes))?;
        let txn = match after {
            None => guarded(&self.key, self.mod_revision, all),
            Some(before) => {
                let compare = Compare::value(self.key.clone(), CompareOp::Equal, before.to_vec());
                Txn::new().when([compare]).and_then(all)
            }
        };
        Ok(Prepared { txn, given: next, stored, bytes })
    }

    /// Sends `prepared`; the future holds nothing of the writer.
    pub fn send(
        &self,
        prepared: &Prepared,
    ) -> impl Future<Output = Result<TxnResponse, EtcdError>> + Send + 'static {
        let (mut kv, txn, timeout) = (self.kv.clone(), prepared.txn.clone(), self.timeout);
        async move { unary("fenced txn", Side::Target, timeout, kv.txn(txn)).await }
    }

    /// `prepared` landed at target revision `revision` (its answer said so, or one sent behind
    /// it landed): the fence holds its record.
    pub fn prepared_landed(&mut self, prepared: Prepared, revision: i64) {
        self.mod_revision = revision;
        self.unsettled = None;
        self.hold(prepared.stored);
    }

    /// `prepared` may have landed (its answer was lost): a commit of the same record sends the
    /// same bytes, so a landed one is adopted, as after any lost answer.
    pub fn prepared_unsettled(&mut self, prepared: &Prepared) {
        self.unsettled = Some((prepared.given.clone(), prepared.stored.commit.clone()));
    }
}
