//! The one paged reader of a key range: every reader of etcd-mirror (genesis scan, reconcile,
//! verify, drain check, sweep, the harness's G3 check) pages through a side with it.
//!
//! ## What it guarantees
//! - **Bounded by keys and bytes.** A page asks for at most `limit` keys, starting small
//!   ([`START_LIMIT`]); the limit halves after a page over `page_bytes` and doubles (up to
//!   `key_limit`) after one under half of it, so a page stays near `page_bytes` whatever the
//!   value sizes (G6).
//! - **Too large is not fatal.** The client accepts responses up to [`RESPONSE_LIMIT`]; an
//!   answer over it (the client's "message length too large") halves the page and asks again.
//!   Only a single key over the limit is an error ([`Fault::ResponseTooLarge`]), naming where
//!   it lies (redacted).
//! - **Linear.** Each request covers a bounded key window ([`Stride`]), so etcd's count walk
//!   stays near the page size.
//! - **One Get at a time.** Reading ahead (up to three Gets in flight over half-page windows)
//!   was built and measured for the genesis scan: neutral at 100 000 keys and half the speed at
//!   1 000 000 keys with 512-key pages on etcd 3.5.30, so it was taken out again; larger pages
//!   (`sync.page_key_limit`) do more for the read chain.
//! - **Pinned or not.** `revision` 0 reads the latest state (the genesis scan, immune to
//!   compaction); any other revision reads one consistent snapshot.

use std::time::Duration;

use etcd_client::{GetOptions, GetResponse, KeyValue, KvClient};

use crate::connect::unary;
use crate::error::{EtcdError, Fault, Side};
use crate::keys::{key_after, redact_key, windows_after, KeyRange};
use crate::stride::Stride;

/// The largest response a reader's client accepts. Pages aim at `page_bytes` (1 MiB by
/// default); this only decides when an answer is refused instead of decoded.
pub const RESPONSE_LIMIT: usize = 64 << 20;

/// Keys asked for by the first page of a window: small, so a range of large values never
/// starts with a huge answer; the limit doubles quickly when values are small.
pub const START_LIMIT: i64 = 16;

/// How a [`Pager`] reads.
#[derive(Clone, Debug)]
pub struct PagerOptions {
    /// Pin every page to this revision; 0 reads the latest state.
    pub revision: i64,
    /// Most keys in one page (`sync.page_key_limit`).
    pub key_limit: i64,
    /// Bytes a page aims at (`sync.page_bytes`).
    pub page_bytes: usize,
    /// Ask for keys only (no values).
    pub keys_only: bool,
    /// Deadline of each Get.
    pub timeout: Duration,
    /// What the reads are for, in errors ("scan page", "reconcile page").
    pub op: &'static str,
}

impl PagerOptions {
    /// Latest state, values included, the given page limits and deadline.
    pub fn new(op: &'static str, key_limit: i64, page_bytes: usize, timeout: Duration) -> PagerOptions {
        PagerOptions { revision: 0, key_limit, page_bytes, keys_only: false, timeout, op }
    }

    /// Pinned at `revision` (0 = latest).
    pub fn at_revision(mut self, revision: i64) -> PagerOptions {
        self.revision = revision;
        self
    }

    /// Keys only.
    pub fn keys_only(mut self) -> PagerOptions {
        self.keys_only = true;
        self
    }
}

/// Pages through a list of key windows of one side, in key order.
pub struct Pager {
    kv: KvClient,
    side: Side,
    windows: Vec<KeyRange>,
    window: usize,
    next_key: Vec<u8>,
    stride: Stride,
    limit: i64,
    opts: PagerOptions,
}

impl Pager {
    /// Reads `windows` of `side` from their start.
    pub fn new(kv: KvClient, side: Side, windows: Vec<KeyRange>, opts: PagerOptions) -> Pager {
        let next_key = windows.first().map(|w| w.start.clone()).unwrap_or_default();
        let opts =
            PagerOptions { key_limit: opts.key_limit.max(1), page_bytes: opts.page_bytes.max(1), ..opts };
        let stride = Stride::for_window(windows.first());
        Pager {
            kv: kv.max_decoding_message_size(RESPONSE_LIMIT),
            side,
            windows,
            window: 0,
            next_key,
            stride,
            limit: START_LIMIT.min(opts.key_limit),
            opts,
        }
    }

    /// Continues strictly after `cursor` (an empty cursor means from the start).
    pub fn resume_after(mut self, cursor: &[u8]) -> Pager {
        self.windows = windows_after(&self.windows[self.window..], cursor);
        self.window = 0;
        self.next_key = self.windows.first().map(|w| w.start.clone()).unwrap_or_default();
        self.stride = Stride::for_window(self.windows.first());
        self
    }

    /// The current page size in keys.
    pub fn limit(&self) -> i64 {
        self.limit
    }

    /// The next non-empty page, or `None` when every window is done.
    pub async fn next_page(&mut self) -> Result<Option<Vec<KeyValue>>, EtcdError> {
        while self.window < self.windows.len() {
            let end = self.stride.probe_end(&self.next_key);
            let mut get = GetOptions::new().with_range(end.clone()).with_limit(self.limit);
            if self.opts.revision > 0 {
                get = get.with_revision(self.opts.revision);
            }
            if self.opts.keys_only {
                get = get.with_keys_only();
            }
            let answer = unary(
                self.opts.op,
                self.side,
                self.opts.timeout,
                self.kv.get(self.next_key.clone(), Some(get)),
            )
            .await;
            let mut resp = match answer {
                Ok(resp) => resp,
                Err(e) if e.fault == Fault::ResponseTooLarge && self.limit > 1 => {
                    self.limit = (self.limit / 2).max(1);
                    continue;
                }
                Err(e) if e.fault == Fault::ResponseTooLarge => return Err(self.key_too_large(e)),
                Err(e) => return Err(e),
            };
            let (kvs, more) = self.take_answer(&mut resp, self.limit);
            match kvs.last() {
                Some(last) if more => self.next_key = key_after(last.key()),
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
                return Ok(Some(kvs));
            }
        }
        Ok(None)
    }

    /// The keys of an answer asked with `limit`, and whether the window holds more; the
    /// stride learns the density and the page size follows the bytes.
    fn take_answer(&mut self, resp: &mut GetResponse, limit: i64) -> (Vec<KeyValue>, bool) {
        let (more, count) = (resp.more(), resp.count());
        let kvs = resp.take_kvs();
        let bytes: usize = kvs.iter().map(|kv| kv.key().len() + kv.value().len()).sum();
        let (first, last) = (kvs.first().map(KeyValue::key), kvs.last().map(KeyValue::key));
        self.stride.learn(first, last, kvs.len(), count, limit);
        self.adapt(bytes);
        (kvs, more)
    }

    fn adapt(&mut self, bytes: usize) {
        if bytes > self.opts.page_bytes {
            self.limit = (self.limit / 2).max(1);
        } else if bytes < self.opts.page_bytes / 2 {
            self.limit = (self.limit * 2).min(self.opts.key_limit);
        }
    }

    /// One key alone is over [`RESPONSE_LIMIT`]: say where, redacted.
    fn key_too_large(&self, e: EtcdError) -> EtcdError {
        let prefix = self.windows.get(self.window).map(|w| w.start.clone()).unwrap_or_default();
        let message = format!(
            "{} {}: the first key at or after {} alone is larger than the {} MiB response limit ({})",
            self.side,
            self.opts.op,
            redact_key(&prefix, &self.next_key),
            RESPONSE_LIMIT >> 20,
            e.source
        );
        EtcdError {
            op: self.opts.op,
            side: self.side,
            fault: Fault::ResponseTooLarge,
            source: etcd_client::Error::InvalidArgs(message),
        }
    }
}

#[cfg(test)]
#[path = "pager_tests.rs"]
mod tests;
