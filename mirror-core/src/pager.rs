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
//! - **Read ahead, on request.** With [`PagerOptions::read_ahead`] above 1 (the genesis scan
//!   only), up to that many Gets are in flight at once over disjoint windows of about half a
//!   page each ([`Stride::within_a_page`]); answers are still consumed in key order, and a
//!   window whose answer says `more` is continued before the windows after it. Readers that
//!   must stay one independent sequential read (the G3 checker, verify) keep the default of 1.
//! - **Pinned or not.** `revision` 0 reads the latest state (the genesis scan, immune to
//!   compaction); any other revision reads one consistent snapshot.

use std::collections::VecDeque;
use std::time::Duration;

use etcd_client::{GetOptions, GetResponse, KeyValue, KvClient};
use tokio::task::JoinHandle;

use crate::connect::unary;
use crate::error::{EtcdError, Fault, Side};
use crate::keys::{redact_key, KeyRange};
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
    /// Most Gets in flight at once (1: one after another).
    pub read_ahead: usize,
}

impl PagerOptions {
    /// Latest state, values included, the given page limits and deadline.
    pub fn new(op: &'static str, key_limit: i64, page_bytes: usize, timeout: Duration) -> PagerOptions {
        PagerOptions { revision: 0, key_limit, page_bytes, keys_only: false, timeout, op, read_ahead: 1 }
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

    /// Up to `gets` Gets in flight at once over disjoint windows (1: one after another).
    pub fn read_ahead(mut self, gets: usize) -> PagerOptions {
        self.read_ahead = gets.max(1);
        self
    }
}

/// A Get asked for ahead of the reader: the window `[from, end)` of one key window.
struct Ahead {
    from: Vec<u8>,
    end: Vec<u8>,
    limit: i64,
    answer: JoinHandle<Result<GetResponse, EtcdError>>,
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
    /// Read-ahead only: Gets in flight, in key order; `window` / `next_key` is where the next
    /// one starts.
    ahead: VecDeque<Ahead>,
}

impl Drop for Pager {
    /// A reader given up early does not leave its Gets running.
    fn drop(&mut self) {
        self.abort_ahead();
    }
}

impl Pager {
    /// Reads `windows` of `side` from their start.
    pub fn new(kv: KvClient, side: Side, windows: Vec<KeyRange>, opts: PagerOptions) -> Pager {
        let next_key = windows.first().map(|w| w.start.clone()).unwrap_or_default();
        let opts = PagerOptions {
            key_limit: opts.key_limit.max(1),
            page_bytes: opts.page_bytes.max(1),
            read_ahead: opts.read_ahead.max(1),
            ..opts
        };
        let stride = stride_for(windows.first(), &opts);
        Pager {
            kv: kv.max_decoding_message_size(RESPONSE_LIMIT),
            side,
            windows,
            window: 0,
            next_key,
            stride,
            limit: START_LIMIT.min(opts.key_limit),
            opts,
            ahead: VecDeque::new(),
        }
    }

    /// Continues strictly after `cursor` (an empty cursor means from the start).
    pub fn resume_after(mut self, cursor: &[u8]) -> Pager {
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
        self.stride = stride_for(self.windows.get(self.window), &self.opts);
        self
    }

    /// The current page size in keys.
    pub fn limit(&self) -> i64 {
        self.limit
    }

    /// The next non-empty page, or `None` when every window is done.
    pub async fn next_page(&mut self) -> Result<Option<Vec<KeyValue>>, EtcdError> {
        if self.opts.read_ahead > 1 {
            return self.next_page_ahead().await;
        }
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
                Some(last) if more => self.next_key = [last.key(), &[0u8]].concat(),
                // The probe is drained but the window goes on past it.
                _ if !self.stride.is_window_end(&end) => self.next_key = end,
                _ => {
                    self.window += 1;
                    if let Some(next) = self.windows.get(self.window) {
                        self.next_key = next.start.clone();
                    }
                    self.stride = stride_for(self.windows.get(self.window), &self.opts);
                }
            }
            if !kvs.is_empty() {
                return Ok(Some(kvs));
            }
        }
        Ok(None)
    }

    /// [`Pager::next_page`] with up to `read_ahead` Gets in flight. The windows asked for are
    /// disjoint and consumed in key order; an answer that says `more` is continued right
    /// after it, before any later window's answer is used.
    async fn next_page_ahead(&mut self) -> Result<Option<Vec<KeyValue>>, EtcdError> {
        loop {
            self.ask_ahead();
            let Some(front) = self.ahead.pop_front() else { return Ok(None) };
            let answer = match front.answer.await {
                Ok(answer) => answer,
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            };
            let mut resp = match answer {
                Ok(resp) => resp,
                Err(e) => {
                    // Whatever follows is asked again from the failed window's start.
                    self.abort_ahead();
                    self.next_key = front.from;
                    if e.fault == Fault::ResponseTooLarge && front.limit > 1 {
                        self.limit = self.limit.min(front.limit / 2).max(1);
                        continue;
                    }
                    if e.fault == Fault::ResponseTooLarge {
                        return Err(self.key_too_large(e));
                    }
                    return Err(e);
                }
            };
            let (kvs, more) = self.take_answer(&mut resp, front.limit);
            if let Some(last) = kvs.last().filter(|_| more) {
                let after = [last.key(), &[0u8]].concat();
                if self.ahead.is_empty() && self.next_key == front.end {
                    // Nothing was asked for past this window: carve on from here.
                    self.next_key = after;
                } else {
                    let answer = self.get(after.clone(), front.end.clone());
                    self.ahead.push_front(Ahead { from: after, end: front.end, limit: self.limit, answer });
                }
            }
            if !kvs.is_empty() {
                return Ok(Some(kvs));
            }
        }
    }

    /// Asks for windows ahead until `read_ahead` are in flight. One key window at a time: the
    /// next one starts once every Get of this one is answered. Until the key density is
    /// known, a probe is the whole window, so it goes alone.
    fn ask_ahead(&mut self) {
        while self.window < self.windows.len() && self.ahead.len() < self.opts.read_ahead {
            if self.stride.is_window_end(&self.next_key) {
                if !self.ahead.is_empty() {
                    return;
                }
                self.window += 1;
                if let Some(next) = self.windows.get(self.window) {
                    self.next_key = next.start.clone();
                }
                self.stride = stride_for(self.windows.get(self.window), &self.opts);
                continue;
            }
            if !self.stride.knows_density() && !self.ahead.is_empty() {
                return;
            }
            let from = std::mem::take(&mut self.next_key);
            let end = self.stride.probe_end(&from);
            let answer = self.get(from.clone(), end.clone());
            self.next_key = end.clone();
            self.ahead.push_back(Ahead { from, end, limit: self.limit, answer });
        }
    }

    /// One Get of `[from, end)` at the current limit, running on its own.
    fn get(&self, from: Vec<u8>, end: Vec<u8>) -> JoinHandle<Result<GetResponse, EtcdError>> {
        let mut get = GetOptions::new().with_range(end).with_limit(self.limit);
        if self.opts.revision > 0 {
            get = get.with_revision(self.opts.revision);
        }
        if self.opts.keys_only {
            get = get.with_keys_only();
        }
        let (mut kv, op, side, timeout) = (self.kv.clone(), self.opts.op, self.side, self.opts.timeout);
        tokio::spawn(async move { unary(op, side, timeout, kv.get(from, Some(get))).await })
    }

    fn abort_ahead(&mut self) {
        for ahead in self.ahead.drain(..) {
            ahead.answer.abort();
        }
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

/// The stride of `window` for a reader with these options: aimed under a page when reading
/// ahead.
fn stride_for(window: Option<&KeyRange>, opts: &PagerOptions) -> Stride {
    let stride = Stride::for_window(window);
    if opts.read_ahead > 1 {
        stride.within_a_page()
    } else {
        stride
    }
}

#[cfg(test)]
#[path = "pager_tests.rs"]
mod tests;
