//! Proving that a source range did not change between two revisions, without the watch.
//!
//! ## Why
//! A watch on a quiet prefix of a busy cluster delivers nothing, so the watermark only moves
//! with progress notifications. etcd before 3.5.8 / 3.4.25 may send a progress notification
//! ahead of events still to be delivered, so the agent does not trust them there (see the
//! agent's engine doc). Without another proof the watermark froze on such servers: `lag` grew
//! with the rest of the cluster's writes, `ReplicationLagExceeded` turned true on a link that
//! was perfectly current, and a restart after the source compacted past the frozen watermark was
//! a full forced resync (a Kubernetes API server compacts every 5 minutes).
//!
//! ## The proof
//! For a range, a watermark `W` (the target equals the source at `W`) and a later revision `X`:
//! 1. the range's key count at `W` equals its key count at `X`, and
//! 2. no key of the range at `X` has `mod_revision > W`.
//!
//! Then the range's state at `X` is its state at `W`: by (2) every key present at `X` was last
//! written at or before `W`, so it existed at `W` with the same value; the keys at `X` are thus
//! a subset of the keys at `W`, and by (1) the same set. Events in `(W, X]` may still have
//! happened (a key created and deleted again), but their net effect is nothing, so moving the
//! watermark to `X` in a checkpoint-only Txn keeps G3, and events at or below `X` that the watch
//! delivers later are dropped as below the watermark, which is right for the same reason.
//!
//! ## How, and what it costs
//! etcd ignores `min_mod_revision` for a count-only Get: the filter prunes the returned keys
//! after the count is taken (`applierV3backend.Range`), so a count-only Get with
//! `min_mod_revision = W + 1` counts the whole range and proves nothing. It also ignores
//! `limit` whenever a revision filter is set, reading the whole range into the server's memory
//! at once. So (2) is checked by paging the range keys-only at `X` with the agent's bounded
//! pager ([`mirror_core::Pager`]: a page by keys and bytes, no values) and looking at each
//! key's `mod_revision`; that pass also yields the count at `X`. (1)'s count at `W` is one
//! count-only Get. The cost is one keys-only read of the range; the caller runs it only after
//! two progress replies in a row found the range idle, and spaces proofs out (see the agent's
//! tail).
//!
//! A `W` the source has compacted cannot be counted: the proof then reports
//! [`IdleProof::Compacted`], and the caller falls back to what it did before (a settle pass by
//! comparison during genesis or drain, or waiting for the next event in the tail).

use std::time::Duration;

use etcd_client::{GetOptions, KvClient};
use mirror_core::{unary, ErrorClass, EtcdError, KeyRange, Pager, PagerOptions, Side};

/// What [`prove_unchanged`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleProof {
    /// The range's state at `to` equals its state at `from`.
    Unchanged,
    /// Something in the range changed in `(from, to]`: its events are on their way.
    Changed,
    /// `from` was compacted away: no count at it can be taken.
    Compacted,
}

/// Proves (or not) that `range` of the source is the same at `to` as at `from` (module doc).
/// `pager` sets the page limits and deadline; its revision is replaced by `to`, and it reads
/// keys only.
pub async fn prove_unchanged(
    kv: &KvClient,
    range: &KeyRange,
    from: i64,
    to: i64,
    pager: PagerOptions,
    timeout: Duration,
) -> Result<IdleProof, EtcdError> {
    if to <= from {
        return Ok(IdleProof::Unchanged);
    }
    let mut kv = kv.clone();
    let opts = GetOptions::new().with_range(range.end.clone()).with_count_only().with_revision(from);
    let before =
        match unary("idle proof count", Side::Source, timeout, kv.get(range.start.clone(), Some(opts))).await
        {
            Ok(resp) => resp.count().max(0) as u64,
            Err(e) if e.class() == ErrorClass::Resync => return Ok(IdleProof::Compacted),
            Err(e) => return Err(e),
        };
    let mut pages = Pager::new(kv, Side::Source, vec![range.clone()], pager.at_revision(to).keys_only());
    let mut after = 0u64;
    while let Some(page) = pages.next_page().await? {
        if page.iter().any(|k| k.mod_revision() > from) {
            return Ok(IdleProof::Changed);
        }
        after += page.len() as u64;
    }
    Ok(if after == before { IdleProof::Unchanged } else { IdleProof::Changed })
}
