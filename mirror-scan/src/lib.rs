//! # mirror-scan
//!
//! The genesis scan of SPEC §5: is the target empty, what is R0, and the source range page by
//! page in key order.
//!
//! ## Why mid-scan compaction cannot wedge the scan
//! 1. Pages are read *unpinned* (no revision): each Get reads the latest state, which a
//!    compaction never removes, so no page can fail with "compacted".
//! 2. A page may therefore be newer than R0. That is fine: the watch opened from R0 + 1 before
//!    the first page replays every change since R0 over the scanned base, in order, so the
//!    target converges to the source at the replay's end (the reflector pattern).
//! 3. Only the *watch* can hit a compaction (if R0 is compacted before it is opened, or the
//!    buffer overflows); the engine then restarts genesis from a fresh R0.
//!
//! ## What it guarantees
//! - Excluded prefixes are cut out of every Get window server-side; they are never fetched.
//! - Page size adapts: it halves when a page exceeds `page_bytes` and doubles (up to
//!   `page_key_limit`) when under half, so memory is bounded by about one page (G6).
//! - [`Scanner::resume_after`] continues strictly after a stored `scan_cursor`.
//! - Each page asks for a bounded key window ([`Stride`]), so etcd's per-request count walk
//!   stays near the page size instead of covering the rest of the range: the scan is linear in
//!   the number of keys, not quadratic.
//!
//! ## What it deliberately does not do
//! It writes nothing: pages are committed under the fence by the agent.

use std::time::Duration;

use etcd_client::{GetOptions, KeyValue, KvClient};
use mirror_core::{unary, EtcdError, KeyRange, KeyRewriter, Side, Stride};

/// One page of source keys, in key order.
#[derive(Debug)]
pub struct Page {
    /// The keys, values and metadata.
    pub kvs: Vec<KeyValue>,
    /// Bytes of keys and values.
    pub bytes: usize,
}

impl Page {
    /// The last key of the page: the next `scan_cursor`.
    pub fn last_key(&self) -> Option<&[u8]> {
        self.kvs.last().map(KeyValue::key)
    }
}

/// Counts keys in `windows` with count-only Gets; returns (count, header revision of the first
/// window). With `revision` the counts are pinned to it.
pub async fn count(
    kv: &mut KvClient,
    windows: &[KeyRange],
    revision: Option<i64>,
    side: Side,
    timeout: Duration,
) -> Result<(u64, i64), EtcdError> {
    let mut total = 0u64;
    let mut header = revision.unwrap_or(0);
    for w in windows {
        let mut opts = GetOptions::new().with_range(w.end.clone()).with_count_only();
        if header > 0 {
            // Pin every later window to the first one's revision: one consistent count.
            opts = opts.with_revision(header);
        }
        let resp = unary("count", side, timeout, kv.get(w.start.clone(), Some(opts))).await?;
        if header == 0 {
            header = resp.header().map_or(0, |h| h.revision());
        }
        total += resp.count().max(0) as u64;
    }
    Ok((total, header))
}

/// Pages through the source windows in key order.
pub struct Scanner {
    kv: KvClient,
    windows: Vec<KeyRange>,
    window: usize,
    next_key: Vec<u8>,
    stride: Stride,
    limit: i64,
    max_limit: i64,
    page_bytes: usize,
    timeout: Duration,
}

impl Scanner {
    /// A scan of every window of `rewriter` from the start.
    pub fn new(
        kv: KvClient,
        rewriter: &KeyRewriter,
        page_key_limit: i64,
        page_bytes: usize,
        timeout: Duration,
    ) -> Scanner {
        let windows = rewriter.scan_windows();
        let next_key = windows.first().map(|w| w.start.clone()).unwrap_or_default();
        let stride = Stride::for_window(windows.first());
        Scanner {
            kv,
            windows,
            window: 0,
            next_key,
            stride,
            limit: page_key_limit.max(1),
            max_limit: page_key_limit.max(1),
            page_bytes: page_bytes.max(1),
            timeout,
        }
    }

    /// Continues strictly after `cursor` (an empty cursor means from the start).
    pub fn resume_after(mut self, cursor: &[u8]) -> Scanner {
        if cursor.is_empty() {
            return self;
        }
        let after = [cursor, &[0u8]].concat();
        // The first window that still has keys at or after `after`.
        self.window = self
            .windows
            .iter()
            .position(|w| w.end == [0] || after.as_slice() < w.end.as_slice())
            .unwrap_or(self.windows.len());
        if let Some(w) = self.windows.get(self.window) {
            self.next_key = if after.as_slice() > w.start.as_slice() { after } else { w.start.clone() };
        }
        self.stride = Stride::for_window(self.windows.get(self.window));
        self
    }

    /// The current page size in keys.
    pub fn page_limit(&self) -> i64 {
        self.limit
    }

    /// The next non-empty page, or `None` when the scan is done.
    pub async fn next_page(&mut self) -> Result<Option<Page>, EtcdError> {
        while self.window < self.windows.len() {
            let end = self.stride.probe_end(&self.next_key);
            let opts = GetOptions::new().with_range(end.clone()).with_limit(self.limit);
            let resp = unary(
                "scan page",
                Side::Source,
                self.timeout,
                self.kv.get(self.next_key.clone(), Some(opts)),
            )
            .await?;
            let more = resp.more();
            let mut resp = resp;
            let count = resp.count();
            let kvs = resp.take_kvs();
            let bytes: usize = kvs.iter().map(|kv| kv.key().len() + kv.value().len()).sum();
            self.stride.learn(
                kvs.first().map(KeyValue::key),
                kvs.last().map(KeyValue::key),
                kvs.len(),
                count,
                self.limit,
            );
            self.adapt(bytes);
            match kvs.last() {
                Some(last) if more => self.next_key = [last.key(), &[0u8]].concat(),
                // The probe is drained but the window goes on past it.
                _ if !self.stride.is_window_end(&end) => self.next_key = end,
                _ => {
                    self.window += 1;
                    if let Some(next) = self.windows.get(self.window) {
                        self.next_key = next.start.clone();
                    }
                    self.stride = Stride::for_window(self.windows.get(self.window));
                }
            }
            if !kvs.is_empty() {
                return Ok(Some(Page { kvs, bytes }));
            }
        }
        Ok(None)
    }

    fn adapt(&mut self, bytes: usize) {
        if bytes > self.page_bytes {
            self.limit = (self.limit / 2).max(1);
        } else if bytes < self.page_bytes / 2 {
            self.limit = (self.limit * 2).min(self.max_limit);
        }
    }
}
