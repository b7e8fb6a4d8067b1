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
//! - **Linear reads.** Pages ask for bounded key windows ([`mirror_core::Stride`]), so etcd's
//!   per-request count walk stays near the page size and a pass is linear in the keys.
//!
//! ## What it deliberately does not do
//! It never writes: repairs are returned as [`Difference`]s for the agent to commit through its
//! fenced writer, paced as configured.

use std::collections::VecDeque;
use std::time::Duration;

use etcd_client::{GetOptions, KeyValue, KvClient};
use mirror_core::{unary, EtcdError, KeyRange, KeyRewriter, Side, Stride};
use sha2::{Digest, Sha256};

/// One key/value read from a side, its key in *target* form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The key as it is (or would be) in the target.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// Whether the source key carries a lease (always false for the target).
    pub leased: bool,
}

/// Reads a list of windows of one side in key order, one page at a time.
pub struct RangeReader {
    kv: KvClient,
    side: Side,
    windows: Vec<KeyRange>,
    window: usize,
    next_key: Vec<u8>,
    /// Bounds each page's range so etcd's count walk stays near the page size.
    stride: Stride,
    revision: i64,
    limit: i64,
    timeout: Duration,
    page: VecDeque<etcd_client::KeyValue>,
    done_window: bool,
}

impl RangeReader {
    /// Reads `windows` of `side`, pinned at `revision` (0 = latest), `limit` keys per page.
    pub fn new(
        kv: KvClient,
        side: Side,
        windows: Vec<KeyRange>,
        revision: i64,
        limit: i64,
        timeout: Duration,
    ) -> Self {
        let next_key = windows.first().map(|w| w.start.clone()).unwrap_or_default();
        let stride = Stride::for_window(windows.first());
        RangeReader {
            kv,
            side,
            windows,
            window: 0,
            next_key,
            stride,
            revision,
            limit: limit.max(1),
            timeout,
            page: VecDeque::new(),
            done_window: false,
        }
    }

    /// The next key/value, or `None` at the end.
    pub async fn next(&mut self) -> Result<Option<etcd_client::KeyValue>, EtcdError> {
        loop {
            if let Some(kv) = self.page.pop_front() {
                return Ok(Some(kv));
            }
            if self.done_window {
                self.window += 1;
                self.done_window = false;
                self.stride = Stride::for_window(self.windows.get(self.window));
                match self.windows.get(self.window) {
                    Some(w) => self.next_key = w.start.clone(),
                    None => return Ok(None),
                }
            }
            if self.window >= self.windows.len() {
                return Ok(None);
            }
            let end = self.stride.probe_end(&self.next_key);
            let mut opts = GetOptions::new().with_range(end.clone()).with_limit(self.limit);
            if self.revision > 0 {
                opts = opts.with_revision(self.revision);
            }
            let mut resp = unary(
                "reconcile page",
                self.side,
                self.timeout,
                self.kv.get(self.next_key.clone(), Some(opts)),
            )
            .await?;
            let more = resp.more();
            let count = resp.count();
            let kvs = resp.take_kvs();
            let (first, last) = (kvs.first().map(KeyValue::key), kvs.last().map(KeyValue::key));
            self.stride.learn(first, last, kvs.len(), count, self.limit);
            match kvs.last() {
                Some(last) if more => self.next_key = [last.key(), &[0u8]].concat(),
                // The probe is drained but the window goes on past it.
                _ if !self.stride.is_window_end(&end) => self.next_key = end,
                _ => self.done_window = true,
            }
            self.page.extend(kvs);
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
    },
}

impl Difference {
    /// The target key concerned.
    pub fn key(&self) -> &[u8] {
        match self {
            Difference::Missing(e) | Difference::Divergent(e) => &e.key,
            Difference::Orphan { key } => key,
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
    /// Counts so far.
    pub counts: Counts,
}

impl Differ {
    /// Compares the source pinned at `source_revision` (0 = latest) with the target pinned at
    /// `target_revision` (0 = latest).
    pub fn new(
        rewriter: KeyRewriter,
        source: KvClient,
        target: KvClient,
        source_revision: i64,
        target_revision: i64,
        page_limit: i64,
        timeout: Duration,
    ) -> Differ {
        let source = RangeReader::new(
            source,
            Side::Source,
            rewriter.scan_windows(),
            source_revision,
            page_limit,
            timeout,
        );
        let target = RangeReader::new(
            target,
            Side::Target,
            rewriter.target_windows(),
            target_revision,
            page_limit,
            timeout,
        );
        Differ { rewriter, source, target, s: None, t: None, started: false, counts: Counts::default() }
    }

    async fn next_source(&mut self) -> Result<Option<Entry>, EtcdError> {
        while let Some(kv) = self.source.next().await? {
            if let Some(key) = self.rewriter.to_target(kv.key()) {
                self.counts.source_keys += 1;
                let leased = kv.lease() != 0;
                self.counts.leased_keys += u64::from(leased);
                feed(&mut self.counts.source_hash, &key, kv.value());
                return Ok(Some(Entry { key, value: kv.value().to_vec(), leased }));
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
            return Ok(Some(Entry { key: kv.key().to_vec(), value: kv.value().to_vec(), leased: false }));
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
            match (self.s.take(), self.t.take()) {
                (None, None) => return Ok(None),
                (Some(s), None) => {
                    self.s = self.next_source().await?;
                    self.counts.missing += 1;
                    return Ok(Some(Difference::Missing(s)));
                }
                (None, Some(t)) => {
                    self.t = self.next_target().await?;
                    self.counts.orphan += 1;
                    return Ok(Some(Difference::Orphan { key: t.key }));
                }
                (Some(s), Some(t)) => match s.key.cmp(&t.key) {
                    std::cmp::Ordering::Less => {
                        self.t = Some(t);
                        self.s = self.next_source().await?;
                        self.counts.missing += 1;
                        return Ok(Some(Difference::Missing(s)));
                    }
                    std::cmp::Ordering::Greater => {
                        self.s = Some(s);
                        self.t = self.next_target().await?;
                        self.counts.orphan += 1;
                        return Ok(Some(Difference::Orphan { key: t.key }));
                    }
                    std::cmp::Ordering::Equal => {
                        self.s = self.next_source().await?;
                        self.t = self.next_target().await?;
                        if s.value != t.value {
                            self.counts.divergent += 1;
                            return Ok(Some(Difference::Divergent(s)));
                        }
                    }
                },
            }
        }
    }
}
