//! The scan cut into Txn-sized chunks, read ahead of the writer (SPEC §9's pipelining hint).
//!
//! A reader task pages through the source ([`Scanner`]) and cuts the rewritten keys into
//! [`ScanChunk`]s with a [`ChunkCutter`]; chunks span pages, so every Txn is full. Each chunk
//! carries the *source* key it ends at: once it and every chunk before it landed, that key is
//! the `scan_cursor` a restart resumes after. The reader runs at most `ahead` chunks in front of
//! the writer, so memory stays that many chunks, the writer's Txns in flight and the chunk it
//! holds back for the cursor ([`Span`]).

use etcd_client::KeyValue;
use mirror_core::{EtcdError, KeyRewriter, Op, OpChunker};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::Scanner;

/// Scan puts for one Txn and the source key they end at.
#[derive(Debug)]
pub struct ScanChunk {
    /// The puts, rewritten to target keys.
    pub ops: Vec<Op>,
    /// The source key of the last put: the `scan_cursor` once this chunk and all before it
    /// landed.
    pub cursor: Vec<u8>,
    /// Lease-backed keys among them.
    pub leased: u64,
    /// Bytes of keys and values.
    pub bytes: usize,
}

/// Cuts scanned keys into [`ScanChunk`]s: pure, so the cursor rule is tested without etcd.
#[derive(Debug)]
pub struct ChunkCutter {
    chunker: OpChunker,
    rewriter: KeyRewriter,
    r0: i64,
    /// The last source key and the lease-backed keys of the chunk being filled.
    cursor: Vec<u8>,
    leased: u64,
    /// Keys skipped as not ours to mirror (another link's reserved keys) that existed at R0.
    uncounted: u64,
}

impl ChunkCutter {
    /// Chunks as `chunker` sizes them, of the keys `rewriter` maps, for a scan that started at
    /// `r0`.
    pub fn new(chunker: OpChunker, rewriter: KeyRewriter, r0: i64) -> ChunkCutter {
        ChunkCutter { chunker, rewriter, r0, cursor: Vec::new(), leased: 0, uncounted: 0 }
    }

    /// Adds one scanned key; returns the chunk it closed, which ends at the key before it.
    /// Takes the key and value by value: the value moves into its put and the source key
    /// becomes the cursor, so a key costs one new buffer (its target key), not three.
    pub fn push(&mut self, kv: KeyValue) -> Option<ScanChunk> {
        let (lease, mod_revision) = (kv.lease(), kv.mod_revision());
        let (key, value) = kv.into_key_value();
        self.push_key(key, value, lease, mod_revision)
    }

    fn push_key(&mut self, key: Vec<u8>, value: Vec<u8>, lease: i64, mod_revision: i64) -> Option<ScanChunk> {
        let Some(target) = self.rewriter.to_target(&key) else {
            // Another link's reserved key: never written, and not in the total once the scan
            // ends (the count at R0 could not leave it out).
            self.uncounted += u64::from(mod_revision <= self.r0);
            return None;
        };
        let closed = self.chunker.push(Op::Put { key: target, value, lease }).map(|ops| {
            // `key` opens the next chunk: the full one ends at the previous key.
            chunk(ops, std::mem::take(&mut self.cursor), std::mem::take(&mut self.leased))
        });
        self.leased += u64::from(lease != 0);
        self.cursor = key;
        closed
    }

    /// The last, partly filled chunk, once the scan has no more keys.
    pub fn finish(&mut self) -> Option<ScanChunk> {
        let ops = self.chunker.take()?;
        Some(chunk(ops, std::mem::take(&mut self.cursor), std::mem::take(&mut self.leased)))
    }

    /// Keys skipped as another link's that existed at R0.
    pub fn uncounted(&self) -> u64 {
        self.uncounted
    }
}

fn chunk(ops: Vec<Op>, cursor: Vec<u8>, leased: u64) -> ScanChunk {
    let bytes = ops.iter().map(Op::size).sum();
    ScanChunk { ops, cursor, leased, bytes }
}

/// The scan running in a reader task, yielding whole chunks in key order.
#[derive(Debug)]
pub struct ChunkedScan {
    chunks: mpsc::Receiver<Result<ScanChunk, EtcdError>>,
    reader: JoinHandle<u64>,
}

impl ChunkedScan {
    /// Starts the reader; it stays at most `ahead` chunks in front of [`ChunkedScan::next`].
    pub fn start(scanner: Scanner, cutter: ChunkCutter, ahead: usize) -> ChunkedScan {
        let (tx, chunks) = mpsc::channel(ahead.max(1));
        ChunkedScan { chunks, reader: tokio::spawn(read(scanner, cutter, tx)) }
    }

    /// The next chunk, a read error (the scan ends with it), or `None` at the end of the scan.
    pub async fn next(&mut self) -> Option<Result<ScanChunk, EtcdError>> {
        self.chunks.recv().await
    }

    /// After the last chunk: the keys the scan skipped as another link's that existed at R0
    /// (to come off a total counted at R0).
    pub async fn finish(mut self) -> u64 {
        self.chunks.close();
        (&mut self.reader).await.unwrap_or(0)
    }
}

impl Drop for ChunkedScan {
    /// A scan given up early (shutdown, an error, a buffer overflow) stops its reader.
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// The reader task: pages until the scan ends, an error (sent too) or the receiver is gone.
async fn read(
    mut scanner: Scanner,
    mut cutter: ChunkCutter,
    tx: mpsc::Sender<Result<ScanChunk, EtcdError>>,
) -> u64 {
    loop {
        let page = match scanner.next_page().await {
            Ok(Some(page)) => page,
            Ok(None) => break,
            Err(e) => {
                let _ = tx.send(Err(e)).await;
                return cutter.uncounted();
            }
        };
        for kv in page.kvs {
            if let Some(chunk) = cutter.push(kv) {
                if tx.send(Ok(chunk)).await.is_err() {
                    return cutter.uncounted();
                }
            }
        }
    }
    if let Some(chunk) = cutter.finish() {
        let _ = tx.send(Ok(chunk)).await;
    }
    cutter.uncounted()
}

/// The chunks written since the last checkpoint. Each chunk is held until the next one comes:
/// the one it replaces goes out at once as a data-only Txn, and the one held when the span is
/// full (or the scan ends) goes out last, with the cursor, once every other has landed. Only
/// the held chunk stays in memory; the span's length sets how often the checkpoint moves,
/// which is the one point where the writes wait for each other.
#[derive(Debug, Default)]
pub struct Span {
    held: Option<ScanChunk>,
    chunks: usize,
    bytes: usize,
}

impl Span {
    /// Holds `chunk`; returns the chunk held before it, to be written data-only.
    pub fn push(&mut self, chunk: ScanChunk) -> Option<ScanChunk> {
        self.chunks += 1;
        self.bytes += chunk.bytes;
        self.held.replace(chunk)
    }

    /// Whether the span has reached `max_chunks` chunks or `max_bytes` bytes.
    pub fn is_full(&self, max_chunks: usize, max_bytes: usize) -> bool {
        self.chunks >= max_chunks || self.bytes >= max_bytes
    }

    /// Ends the span (it starts over empty): the held chunk, which carries the cursor, or
    /// `None` when it holds no chunk.
    pub fn close(&mut self) -> Option<ScanChunk> {
        std::mem::take(self).held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cutter(max_ops: usize) -> ChunkCutter {
        let rewriter = KeyRewriter::new(b"/a/", b"/b/", []);
        ChunkCutter::new(OpChunker::new(max_ops, 1 << 20), rewriter, 10)
    }

    fn keys(chunk: &ScanChunk) -> Vec<&[u8]> {
        chunk.ops.iter().map(Op::key).collect()
    }

    /// A full chunk ends at the key *before* the one that closed it: its cursor never names a
    /// key that has not landed.
    #[test]
    fn a_chunk_ends_at_its_own_last_source_key() {
        let mut c = cutter(2);
        assert!(c.push_key(b"/a/1".to_vec(), b"v".to_vec(), 0, 5).is_none());
        assert!(c.push_key(b"/a/2".to_vec(), b"v".to_vec(), 7, 5).is_none());
        let first = c.push_key(b"/a/3".to_vec(), b"v".to_vec(), 0, 5).expect("two puts fill a chunk");
        assert_eq!(keys(&first), [b"/b/1".as_slice(), b"/b/2"]);
        assert_eq!(first.cursor, b"/a/2");
        assert_eq!(first.leased, 1);
        assert_eq!(first.bytes, first.ops.iter().map(Op::size).sum::<usize>());
        let last = c.finish().expect("one put pending");
        assert_eq!(keys(&last), [b"/b/3".as_slice()]);
        assert_eq!((last.cursor.as_slice(), last.leased), (b"/a/3".as_slice(), 0));
        assert!(c.finish().is_none());
    }

    /// Another link's keys are skipped, and those that existed at R0 are counted as such.
    #[test]
    fn another_links_keys_are_skipped_and_counted() {
        let mut c = cutter(10);
        // A chain: an upstream link's checkpoint lies under our source prefix.
        let reserved = format!("/a/{}checkpoint", mirror_core::RESERVED_MARKER).into_bytes();
        assert!(c.push_key(reserved.clone(), b"v".to_vec(), 0, 9).is_none());
        assert!(c.push_key([reserved.as_slice(), b"2"].concat(), b"v".to_vec(), 0, 11).is_none());
        assert!(c.push_key(b"/a/y".to_vec(), b"v".to_vec(), 0, 11).is_none());
        assert_eq!(c.uncounted(), 1, "only the key at or below R0 was in the count");
        let last = c.finish().expect("one put");
        assert_eq!(keys(&last), [b"/b/y".as_slice()]);
        assert_eq!(last.cursor, b"/a/y");
    }

    /// A span holds only its newest chunk and hands back the one before it, to be written
    /// data-only; it is full by chunks or by bytes; closing it gives the held chunk (the one to
    /// carry the cursor), and starts it over.
    #[test]
    fn a_span_holds_its_newest_chunk_for_the_cursor() {
        let mut c = cutter(1);
        let mut span = Span::default();
        assert!(span.close().is_none());
        let mut sent = Vec::new();
        for (k, lease) in [(b"/a/1", 0), (b"/a/2", 7), (b"/a/3", 0), (b"/a/4", 0)] {
            if let Some(chunk) = c.push_key(k.to_vec(), vec![0; 100], lease, 1) {
                sent.extend(span.push(chunk).map(|data| data.cursor));
            }
        }
        // Chunks of one key each, closed by the key after them: /a/1, /a/2, /a/3.
        assert_eq!(sent, [b"/a/1".to_vec(), b"/a/2".to_vec()], "all but the newest go out");
        assert!(span.is_full(3, usize::MAX) && !span.is_full(4, usize::MAX));
        assert!(span.is_full(4, 300) && !span.is_full(4, 400));
        let last = span.close().expect("a held chunk");
        assert_eq!((last.cursor.as_slice(), last.leased), (&b"/a/3"[..], 0));
        assert!(span.close().is_none() && !span.is_full(1, 1), "a closed span starts over");
    }
}
