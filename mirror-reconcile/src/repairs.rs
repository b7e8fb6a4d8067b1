//! The repairs a comparison finds, in Txn-sized chunks: the one loop the periodic reconcile pass
//! and the settle pass share (the prune sweep feeds orphans alone, from [`crate::Sweep`]).

use mirror_core::{EtcdError, Op, OpChunker};

use crate::{Counts, Differ};

/// A [`Differ`] drained into chunks of repairs: a missing or divergent key becomes a put of the
/// source's value, an orphan a delete when `delete_orphan(key, target mod revision)` says so.
pub struct Repairs<F> {
    differ: Differ,
    chunker: OpChunker,
    delete_orphan: F,
    found: u64,
    ended: bool,
}

impl<F: FnMut(&[u8], i64) -> bool> Repairs<F> {
    /// Repairs of `differ`'s comparison, chunked by `chunker`.
    pub fn new(differ: Differ, chunker: OpChunker, delete_orphan: F) -> Repairs<F> {
        Repairs { differ, chunker, delete_orphan, found: 0, ended: false }
    }

    /// The next chunk of repairs, or `None` once the comparison has ended and every repair was
    /// handed out. A read error ends the comparison for the caller to judge (a compacted pin,
    /// a source that went back).
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<Op>>, EtcdError> {
        while !self.ended {
            let Some(difference) = self.differ.next_difference().await? else {
                self.ended = true;
                break;
            };
            let delete_orphan = &mut self.delete_orphan;
            if let Some(op) = difference.repair(|key, mod_revision| delete_orphan(key, mod_revision)) {
                self.found += 1;
                if let Some(full) = self.chunker.push(op) {
                    return Ok(Some(full));
                }
            }
        }
        Ok(self.chunker.take())
    }

    /// Repairs found so far (handed out or pending).
    pub fn found(&self) -> u64 {
        self.found
    }

    /// The comparison's counts so far (final once [`Repairs::next_chunk`] returned `None`).
    pub fn counts(&self) -> &Counts {
        &self.differ.counts
    }
}
