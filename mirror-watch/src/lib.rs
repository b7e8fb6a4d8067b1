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
//!   to grow past `watch_buffer_bytes`; the engine restarts genesis instead. It holds revisions
//!   encoded and counts those bytes, so the limit is what it takes in memory. No watch response
//!   is decoded above [`WATCH_RESPONSE_LIMIT`]: past it the agent watches again asking for
//!   fragments, each at most the source's `--max-request-bytes`; [`Fragments`] joins a revision
//!   that spans pieces and holds a revision of many deletes as runs, not keys, once its ops
//!   pass an eighth of `watch_buffer_bytes` ([`held_revision_bytes`]). So what one response or
//!   one revision costs is bounded by these limits, `watch_buffer_bytes` and the source's
//!   request limit, never by the revision.
//! - **Coalescing is exact.** [`Coalescer`] turns a revision's deletes into range deletes only
//!   over keys adjacent *in the target* (read at one revision), never across a key the revision
//!   keeps or puts; the agent commits them guarded by "nothing in the span changed since".
//! - **The revision source** ([`Watch::next`]): the tail reads the open watch as values, a
//!   [`Delivery`] each (whole revisions, a reply without events, a cancel), with every data
//!   response already waiting taken in the same read (group commit). It judges nothing: what a
//!   reply proves is the agent's rule.
//! - [`open_watch`] watches the whole source range from a revision, with progress
//!   notifications; the client's require-leader metadata (set at connect) makes a member cut
//!   off from its quorum end the watch instead of going silent.
//! - [`prove_unchanged`] proves that the source range is the same at a later revision as at
//!   the watermark without the watch (count at both, no key written since), so an idle prefix
//!   advances on servers whose progress notifications are not trusted (module `idle`).
//! - [`Forwarder`] keeps the watch read into a bounded [`ReplayBuffer`] while the agent runs a
//!   long pass (scan, sweep, reconcile), so etcd never finds the watcher stuck behind a
//!   compaction; it stops by itself on overflow, compaction or a broken watch, and says which.
//! - [`read_history`] reads every write of a range between two revisions, and says what proved
//!   it had all of them (the failback plan, module `history`).
//!
//! - [`ExactWatch`] (exact mode, SPEC §10) reads a watch of the whole keyspace with prev_kv as
//!   whole revisions, each the one after the last: a revision number skipped is reported as
//!   loss, never passed over. [`SpoolWriter`] / [`SpoolReader`] keep such revisions on disk
//!   (checksummed records, read whole while the file grows) for a seed that outlives the
//!   source's compaction.
//!
//! ## What it deliberately does not do
//! It writes nothing: committing batches under the fence is the agent's job.

mod batch;
mod buffer;
mod coalesce;
mod events;
mod exact;
mod forward;
mod history;
mod idle;
mod source;
mod spool;

use etcd_client::{Client, WatchOptions, WatchStream};
use mirror_core::{EtcdError, KeyRewriter, Side};

pub use batch::{Batch, Revision, RevisionBatcher};
pub use buffer::{Buffered, Overflow, ReplayBuffer};
pub use coalesce::Coalescer;
pub use events::{
    convert_events, fold_delete_runs, held_revision_bytes, Converted, Fragments, HELD_DELETE_BYTES,
};
pub use exact::{exact_revisions, ExactDelivery, ExactError, ExactWatch};
pub use forward::{ForwardError, Forwarder, Watch};
pub use history::{read_history, History, HistoryEnd, HistoryError, Next, Reading, Written};
pub use idle::{prove_unchanged, IdleProof};
/// Re-exported: the unit of every batch (it lives in mirror-core, shared with the scan and the
/// reconcile).
pub use mirror_core::{Op, OpChunker};
pub use source::{Deliveries, Delivery, WatchEnd};
pub use spool::{SpoolError, SpoolReader, SpoolWriter};

/// The largest unfragmented watch response the client accepts. Most responses are far
/// smaller; a catch-up after downtime bundles up to 1 000 revisions (200 MB of 200 KiB values)
/// and would be decoded whole. Past this the watch is opened again asking for fragments
/// ([`open_watch`]). Not fragmenting by default is deliberate: etcd cuts fragments by
/// recomputing the message size after each event it adds, which is quadratic in the events of
/// one piece; a revision of 300 000 deletes then takes the source minutes of CPU to send.
/// Up to this size the agent's client holds a response encoded and cuts it into pieces of
/// 1 MiB before it is decoded ([`mirror_core::watch_split`]): a response of small delete events
/// decodes to about six times its wire size (300 000 deletes: 10.5 MB on the wire, 60 MiB
/// decoded whole, the agent at 93-98 MiB RSS; cut, 59 MiB).
pub const WATCH_RESPONSE_LIMIT: usize = mirror_core::watch_split::RAW_LIMIT;

/// The largest response of a fragmented watch: a piece is at most the source's
/// `--max-request-bytes` (1.5 MiB by default; etcd recommends at most 10 MiB).
pub const FRAGMENT_RESPONSE_LIMIT: usize = 128 << 20;

/// Opens a watch on the whole source range (excludes are filtered per event) from `start`;
/// with `fragment`, etcd cuts every response at its own request limit ([`Fragments`] joins
/// the pieces).
pub async fn open_watch(
    client: &mut Client,
    rewriter: &KeyRewriter,
    start: i64,
    fragment: bool,
) -> Result<WatchStream, EtcdError> {
    let range = rewriter.source_range();
    let mut opts =
        WatchOptions::new().with_range(range.end).with_start_revision(start).with_progress_notify();
    let mut limit = WATCH_RESPONSE_LIMIT;
    if fragment {
        opts = opts.with_fragment();
        limit = FRAGMENT_RESPONSE_LIMIT;
    }
    client
        .watch_client()
        .max_decoding_message_size(limit)
        .watch(range.start, Some(opts))
        .await
        .map_err(|e| EtcdError::new("open watch", Side::Source, e))
}
