//! # mirror-reconcile
//!
//! Comparing the source range with the destination range, key by key, in bounded memory: the
//! engine of the periodic diff-and-repair pass, of the drain verification, and of
//! `mirror-agent verify`.
//!
//! ## What it guarantees
//! - **Two pages at most.** [`Differ`] merges one source page with the matching target page;
//!   the rewrite preserves key order (it swaps one fixed prefix for another), so a merge-join of
//!   two sorted streams finds every difference without holding either side (G6).
//! - **Same scope as the mirror.** The source is read through the scan windows (excludes cut out
//!   server-side, the source's reserved namespace skipped); the target through the target
//!   windows (this link's reserved namespace skipped). Target keys that map to no source key in
//!   scope (under an excluded prefix) are *foreign*: counted, never reported as orphans.
//! - **Pinned reads.** Each side may be pinned to a revision (the source at the watermark), so
//!   a comparison is of two consistent snapshots.
//! - **Fingerprints.** [`Counts::source_digest`] and [`Counts::target_digest`] are SHA-256 over
//!   the ordered (target key, value) pairs of each side, length-prefixed, so equal digests mean
//!   equal ranges.
//! - **Linear, byte-bounded reads.** Both sides are read with [`mirror_core::Pager`]: bounded
//!   key windows (etcd's per-request count walk stays near the page size, so a pass is linear in
//!   the keys), pages bounded by keys and bytes, and an answer too large for the client halves
//!   the page instead of failing the pass.
//!
//! - **Sweep.** [`Sweep`] yields the orphans a prune must delete, never another link's keys.
//! - **Repairs.** [`Repairs`] turns a comparison into Txn-sized chunks of repairs under the
//!   caller's orphan scope: the one repair loop of the reconcile and settle passes.
//!
//! ## What it deliberately does not do
//! It never writes: repairs are returned as [`Difference`]s for the agent to commit through its
//! fenced writer, paced as configured.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use etcd_client::KvClient;
use mirror_core::{EtcdError, KeyRange, KeyRewriter, Op, Pager, PagerOptions, Side};
use sha2::{Digest, Sha256};

mod links;
mod repairs;

pub use links::{find_foreign_link, find_reverse_link, foreign_dest_prefixes, ForeignLink};
pub use repairs::Repairs;

/// One key/value read from a side, its key in *target* form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The key as it is (or would be) in the target.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// The key's lease on the side it was read from (0: none).
    pub lease: i64,
    /// The key's mod revision on the side it was read from.
    pub mod_revision: i64,
}

/// Reads a list of windows of one side in key order, one key at a time, paged by keys and
/// bytes ([`Pager`]).
pub struct RangeReader {
    pager: Pager,
    page: VecDeque<etcd_client::KeyValue>,
}

impl RangeReader {
    /// Reads `windows` of `side` as `opts` says (pinned or not, page limits, keys only).
    pub fn new(kv: KvClient, side: Side, windows: Vec<KeyRange>, opts: PagerOptions) -> Self {
        RangeReader { pager: Pager::new(kv, side, windows, opts), page: VecDeque::new() }
    }

    /// The next key/value, or `None` at the end.
    pub async fn next(&mut self) -> Result<Option<etcd_client::KeyValue>, EtcdError> {
        loop {
            if let Some(kv) = self.page.pop_front() {
                return Ok(Some(kv));
            }
            match self.pager.next_page().await? {
                Some(kvs) => self.page.extend(kvs),
                None => return Ok(None),
            }
        }
    }
}

/// A difference between the sides, keys in target form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Difference {
    /// In the source, not in the target.
    Missing(Entry),
    /// In both, values differ; carries the source's entry.
    Divergent(Entry),
    /// In the target only.
    Orphan {
        /// The target key.
        key: Vec<u8>,
        /// Its mod revision in the target (at or below the checkpoint's create revision: it was
        /// there before this link wrote).
        mod_revision: i64,
    },
}

impl Difference {
    /// The target key concerned.
    pub fn key(&self) -> &[u8] {
        match self {
            Difference::Missing(e) | Difference::Divergent(e) => &e.key,
            Difference::Orphan { key, .. } => key,
        }
    }

    /// The write that repairs it: a missing or divergent key gets the source's value; an
    /// orphan is deleted when `delete_orphan(key, target mod revision)` says so (the caller's
    /// scope: every orphan, only this link's, or none), else nothing is written.
    pub fn repair(self, delete_orphan: impl FnOnce(&[u8], i64) -> bool) -> Option<Op> {
        match self {
            Difference::Missing(e) | Difference::Divergent(e) => {
                Some(Op::Put { key: e.key, value: e.value, lease: e.lease })
            }
            Difference::Orphan { key, mod_revision } => {
                delete_orphan(&key, mod_revision).then_some(Op::Delete { key })
            }
        }
    }
}

/// Running counts of a comparison.
#[derive(Clone, Debug, Default)]
pub struct Counts {
    /// Source keys in scope.
    pub source_keys: u64,
    /// Target keys in the destination range that mirror a source key in scope.
    pub target_keys: u64,
    /// Target keys under the destination prefix outside the mirrored scope (excluded prefixes).
    pub foreign_keys: u64,
    /// Source keys with a lease.
    pub leased_keys: u64,
    /// Missing in the target.
    pub missing: u64,
    /// Different values.
    pub divergent: u64,
    /// Only in the target.
    pub orphan: u64,
    source_hash: Sha256,
    target_hash: Sha256,
}

impl Counts {
    /// Whether no difference was seen.
    pub fn equal(&self) -> bool {
        self.missing == 0 && self.divergent == 0 && self.orphan == 0
    }

    /// SHA-256 of the source side's ordered (target key, value) pairs, hex.
    pub fn source_digest(&self) -> String {
        hex::encode(self.source_hash.clone().finalize())
    }

    /// SHA-256 of the target side's ordered (key, value) pairs, hex.
    pub fn target_digest(&self) -> String {
        hex::encode(self.target_hash.clone().finalize())
    }
}

fn feed(hash: &mut Sha256, key: &[u8], value: &[u8]) {
    hash.update((key.len() as u64).to_be_bytes());
    hash.update(key);
    hash.update((value.len() as u64).to_be_bytes());
    hash.update(value);
}

/// Merge-joins the source and the target range.
pub struct Differ {
    rewriter: KeyRewriter,
    source: RangeReader,
    target: RangeReader,
    s: Option<Entry>,
    t: Option<Entry>,
    started: bool,
    /// Source keys compared so far, shared with a progress display ([`Differ::progress`]).
    progress: Option<Arc<AtomicU64>>,
    /// A key whose target lease is not its source lease differs ([`Differ::with_leases`]).
    leases: bool,
    /// Counts so far.
    pub counts: Counts,
}

impl Differ {
    /// Compares the source read as `page` says (pinned at `page.revision`, 0 = latest) with the
    /// target as it is now; [`Differ::target_at`] pins the target too.
    pub fn new(rewriter: KeyRewriter, source: KvClient, target: KvClient, page: PagerOptions) -> Differ {
        let target_page = PagerOptions { revision: 0, ..page.clone() };
        let source = RangeReader::new(source, Side::Source, rewriter.scan_windows(), page);
        let target = RangeReader::new(target, Side::Target, rewriter.target_windows(), target_page);
        Differ {
            rewriter,
            source,
            target,
            s: None,
            t: None,
            started: false,
            progress: None,
            leases: false,
            counts: Counts::default(),
        }
    }

    /// With `leases` (`sync.leases = "preserve"`, where the target lease has the source's ID), a
    /// key whose target lease differs from its source lease is divergent; its repair puts it
    /// again under the source's lease.
    pub fn with_leases(mut self, leases: bool) -> Differ {
        self.leases = leases;
        self
    }

    /// Publishes the source keys compared so far into `counter` as the merge goes (a progress
    /// bar can read it while [`Differ::next_difference`] runs through equal keys).
    pub fn progress(mut self, counter: Arc<AtomicU64>) -> Differ {
        counter.store(0, Ordering::Relaxed);
        self.progress = Some(counter);
        self
    }

    /// Reads the target pinned at `revision` (0 = latest); call before the first difference.
    pub fn target_at(mut self, target: KvClient, revision: i64, page: PagerOptions) -> Differ {
        let page = PagerOptions { revision, ..page };
        self.target = RangeReader::new(target, Side::Target, self.rewriter.target_windows(), page);
        self
    }

    async fn next_source(&mut self) -> Result<Option<Entry>, EtcdError> {
        while let Some(kv) = self.source.next().await? {
            if let Some(key) = self.rewriter.to_target(kv.key()) {
                self.counts.source_keys += 1;
                if let Some(p) = &self.progress {
                    p.store(self.counts.source_keys, Ordering::Relaxed);
                }
                self.counts.leased_keys += u64::from(kv.lease() != 0);
                feed(&mut self.counts.source_hash, &key, kv.value());
                return Ok(Some(Entry {
                    key,
                    value: kv.value().to_vec(),
                    lease: kv.lease(),
                    mod_revision: kv.mod_revision(),
                }));
            }
        }
        Ok(None)
    }

    async fn next_target(&mut self) -> Result<Option<Entry>, EtcdError> {
        while let Some(kv) = self.target.next().await? {
            if self.rewriter.to_source(kv.key()).is_none() {
                self.counts.foreign_keys += 1;
                continue;
            }
            self.counts.target_keys += 1;
            feed(&mut self.counts.target_hash, kv.key(), kv.value());
            return Ok(Some(Entry {
                key: kv.key().to_vec(),
                value: kv.value().to_vec(),
                lease: kv.lease(),
                mod_revision: kv.mod_revision(),
            }));
        }
        Ok(None)
    }

    /// The next difference, or `None` when both sides are exhausted (counts are then final).
    pub async fn next_difference(&mut self) -> Result<Option<Difference>, EtcdError> {
        if !self.started {
            self.started = true;
            self.s = self.next_source().await?;
            self.t = self.next_target().await?;
        }
        loop {
            let step = merge_step(self.s.as_ref(), self.t.as_ref(), self.leases);
            let (s, t) = (self.s.take(), self.t.take());
            match step {
                Step::Done => return Ok(None),
                Step::Missing => {
                    self.t = t;
                    self.s = self.next_source().await?;
                    self.counts.missing += 1;
                    return Ok(s.map(Difference::Missing));
                }
                Step::Orphan => {
                    self.s = s;
                    self.t = self.next_target().await?;
                    self.counts.orphan += 1;
                    return Ok(t.map(|t| Difference::Orphan { key: t.key, mod_revision: t.mod_revision }));
                }
                Step::Same => {
                    self.s = self.next_source().await?;
                    self.t = self.next_target().await?;
                }
                Step::Divergent => {
                    self.s = self.next_source().await?;
                    self.t = self.next_target().await?;
                    self.counts.divergent += 1;
                    return Ok(s.map(Difference::Divergent));
                }
            }
        }
    }
}

/// What one step of the merge-join does with the current heads of both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// Both sides are exhausted.
    Done,
    /// The source head is not in the target: report it, advance the source.
    Missing,
    /// The target head is not in the source: report it, advance the target.
    Orphan,
    /// Same key, same value: advance both.
    Same,
    /// Same key, other value: report the source's, advance both.
    Divergent,
}

/// The merge-join's decision: both streams are in key order (the rewrite preserves order), so
/// the smaller head is the one the other side lacks; with `leases`, equal keys must carry the
/// same lease ID too.
fn merge_step(s: Option<&Entry>, t: Option<&Entry>, leases: bool) -> Step {
    match (s, t) {
        (None, None) => Step::Done,
        (Some(_), None) => Step::Missing,
        (None, Some(_)) => Step::Orphan,
        (Some(s), Some(t)) => match s.key.cmp(&t.key) {
            std::cmp::Ordering::Less => Step::Missing,
            std::cmp::Ordering::Greater => Step::Orphan,
            std::cmp::Ordering::Equal if s.value == t.value && (!leases || s.lease == t.lease) => Step::Same,
            std::cmp::Ordering::Equal => Step::Divergent,
        },
    }
}

/// The mark-and-sweep of a prune: target keys (this link's, outside its reserved namespace and
/// any other link's) whose source key does not exist now. A keys-only merge-join of both sides
/// through [`Differ`], so at most two pages are in memory; the source is read through the scan
/// windows, so excluded ranges are never fetched. It finds; the agent deletes under its fence.
pub struct Sweep {
    differ: Differ,
}

impl Sweep {
    /// A sweep of the destination range of `rewriter` against the source as it is now.
    pub fn new(rewriter: KeyRewriter, source: KvClient, target: KvClient, page: PagerOptions) -> Sweep {
        Sweep { differ: Differ::new(rewriter, source, target, page.keys_only()) }
    }

    /// The next orphan's target key and its target mod revision, or `None` when the range is
    /// done.
    pub async fn next_orphan(&mut self) -> Result<Option<(Vec<u8>, i64)>, EtcdError> {
        while let Some(diff) = self.differ.next_difference().await? {
            if let Difference::Orphan { key, mod_revision } = diff {
                return Ok(Some((key, mod_revision)));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
