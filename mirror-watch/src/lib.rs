//! # mirror-watch
//!
//! Turning the source's watch into target Txns.
//!
//! ## What it guarantees
//! - **G2, revision atomicity.** [`RevisionBatcher`] only ever packs *whole* revisions; a
//!   revision over the limits forms a batch alone and is never split. Batches carry at most
//!   the op limit they are built with minus one (the checkpoint put's slot; the agent passes
//!   8 x `max_txn_ops` and the fenced writer lays larger batches out as nested Txns), at most
//!   `txn_flush_bytes`, and never the same key twice (property-tested).
//! - **Duplicates are no-ops.** [`convert_events`] drops every revision at or below the
//!   watermark, so a replayed watch response changes nothing.
//! - **G6, bounded memory.** The [`ReplayBuffer`] holding events during the genesis scan refuses
//!   to grow past `watch_buffer_bytes`; the engine restarts genesis instead. The watch asks for
//!   fragments, so no response is larger than the source's `--max-request-bytes`, and
//!   [`Fragments`] joins a revision that spans pieces.
//! - [`open_watch`] watches the whole source range from a revision, with progress
//!   notifications; the client's require-leader metadata (set at connect) makes a member cut
//!   off from its quorum end the watch instead of going silent.
//! - [`prove_unchanged`] proves that the source range is the same at a later revision as at
//!   the watermark without the watch (count at both, no key written since), so an idle prefix
//!   advances on servers whose progress notifications are not trusted (module `idle`).
//!
//! ## What it deliberately does not do
//! It writes nothing: committing batches under the fence is the agent's job.

mod batch;
mod buffer;
mod idle;

use etcd_client::{Client, WatchOptions, WatchStream};
use mirror_core::{EtcdError, KeyRewriter, Side};

pub use batch::{convert_events, Batch, Converted, Fragments, Op, OpChunker, Revision, RevisionBatcher};
pub use buffer::{Overflow, ReplayBuffer};
pub use idle::{prove_unchanged, IdleProof};

/// The largest watch response the client accepts. The watch asks for fragments, so etcd cuts
/// every response at its own `--max-request-bytes` (1.5 MiB by default; a catch-up after a slow
/// spell used to bundle up to 1 000 revisions in one response, 200 MB of 200 KiB values,
/// decoded whole). One event is never larger than a request the source accepted, so this
/// leaves room for a source limit of up to 128 MiB, far above etcd's recommended 10 MiB.
pub const WATCH_RESPONSE_LIMIT: usize = 128 << 20;

/// Opens a watch on the whole source range (excludes are filtered per event) from `start`.
pub async fn open_watch(
    client: &mut Client,
    rewriter: &KeyRewriter,
    start: i64,
) -> Result<WatchStream, EtcdError> {
    let range = rewriter.source_range();
    let opts = WatchOptions::new()
        .with_range(range.end)
        .with_start_revision(start)
        .with_progress_notify()
        .with_fragment();
    client
        .watch_client()
        .max_decoding_message_size(WATCH_RESPONSE_LIMIT)
        .watch(range.start, Some(opts))
        .await
        .map_err(|e| EtcdError::new("open watch", Side::Source, e))
}
