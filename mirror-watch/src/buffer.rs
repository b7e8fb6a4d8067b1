//! The replay buffer: source revisions that arrived while a long pass ran (the genesis scan,
//! its sweep, a reconcile pass).
//!
//! Revisions are held *encoded*, one after another in chunks of bytes, and counted by their
//! encoded length, so `watch_buffer_bytes` is what the buffer takes in memory. Held as
//! [`Revision`] values they took up to eight times what they counted: a put of a short key and
//! a one-byte value is a queue slot, a vector of ops with room for four, and two small heap
//! blocks, about 370 bytes for 45 counted; a reconcile pass of 1.8 M keys under 2 000 writes/s
//! peaked at 120 MiB with the default 16 MiB buffer. Draining hands the chunks over whole and
//! decodes one revision at a time ([`Buffered`]), freeing each chunk once it is read, so
//! applying a full buffer never holds it twice.

use std::collections::VecDeque;

use mirror_core::Op;

use crate::batch::Revision;

/// Bytes a chunk is allocated with; a revision larger than that gets a chunk of its own size.
const CHUNK_BYTES: usize = 64 << 10;

/// The buffer passed `watch_buffer_bytes`; genesis restarts from a fresh R0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overflow {
    /// The limit that was passed.
    pub limit: usize,
}

/// Revisions held for replay, bounded in bytes of memory (G6).
#[derive(Debug)]
pub struct ReplayBuffer {
    limit: usize,
    held: Buffered,
}

impl ReplayBuffer {
    /// A buffer of at most `limit` bytes of encoded revisions.
    pub fn new(limit: usize) -> ReplayBuffer {
        ReplayBuffer { limit, held: Buffered::default() }
    }

    /// Appends revisions; fails (and keeps nothing new) when the limit would be passed.
    pub fn push(&mut self, revisions: Vec<Revision>) -> Result<(), Overflow> {
        let add: usize = revisions.iter().map(encoded_len).sum();
        if self.held.bytes + add > self.limit {
            return Err(Overflow { limit: self.limit });
        }
        for revision in &revisions {
            self.held.append(revision);
        }
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.held.bytes
    }

    /// Hands over everything, in order; the buffer starts again from zero bytes.
    pub fn drain(&mut self) -> Buffered {
        std::mem::take(&mut self.held)
    }
}

/// Buffered revisions, decoded one at a time in revision order; each chunk is freed once read.
#[derive(Debug, Default)]
pub struct Buffered {
    chunks: VecDeque<Vec<u8>>,
    /// Read position in the front chunk.
    at: usize,
    /// Revisions not yet read.
    left: usize,
    /// Encoded bytes not yet read.
    bytes: usize,
}

impl Buffered {
    fn append(&mut self, revision: &Revision) {
        let len = encoded_len(revision);
        let fits = self.chunks.back().is_some_and(|c| c.capacity() - c.len() >= len);
        if !fits {
            self.chunks.push_back(Vec::with_capacity(len.max(CHUNK_BYTES)));
        }
        let chunk = self.chunks.back_mut().expect("a chunk with room");
        encode(revision, chunk);
        self.left += 1;
        self.bytes += len;
    }
}

impl Iterator for Buffered {
    type Item = Revision;

    fn next(&mut self) -> Option<Revision> {
        let chunk = self.chunks.front()?;
        let mut reader = Reader { bytes: chunk, at: self.at };
        let revision = reader.revision();
        self.at = reader.at;
        self.bytes -= encoded_len(&revision);
        self.left -= 1;
        if self.at == chunk.len() {
            self.chunks.pop_front();
            self.at = 0;
        }
        Some(revision)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for Buffered {}

// The encoding, little-endian: revision i64, op count u32, then each op as a tag byte and its
// fields, byte strings as a u32 length and the bytes.
const PUT: u8 = 0;
const DELETE: u8 = 1;
const DELETE_RANGE: u8 = 2;
const DELETE_RUN: u8 = 3;

/// Bytes `revision` takes encoded.
fn encoded_len(revision: &Revision) -> usize {
    let op = |op: &Op| match op {
        Op::Put { key, value, .. } => 1 + 8 + 4 + key.len() + 4 + value.len(),
        Op::Delete { key } => 1 + 4 + key.len(),
        Op::DeleteRange { key, end } => 1 + 4 + key.len() + 4 + end.len(),
        Op::DeleteRun { key, last, .. } => 1 + 4 + key.len() + 4 + last.len() + 8,
    };
    8 + 4 + revision.ops.iter().map(op).sum::<usize>()
}

fn encode(revision: &Revision, out: &mut Vec<u8>) {
    let bytes = |out: &mut Vec<u8>, b: &[u8]| {
        out.extend_from_slice(&u32::try_from(b.len()).expect("a key or value under 4 GiB").to_le_bytes());
        out.extend_from_slice(b);
    };
    out.extend_from_slice(&revision.revision.to_le_bytes());
    out.extend_from_slice(&u32::try_from(revision.ops.len()).expect("ops under 2^32").to_le_bytes());
    for op in &revision.ops {
        match op {
            Op::Put { key, value, lease } => {
                out.push(PUT);
                out.extend_from_slice(&lease.to_le_bytes());
                bytes(out, key);
                bytes(out, value);
            }
            Op::Delete { key } => {
                out.push(DELETE);
                bytes(out, key);
            }
            Op::DeleteRange { key, end } => {
                out.push(DELETE_RANGE);
                bytes(out, key);
                bytes(out, end);
            }
            Op::DeleteRun { key, last, count } => {
                out.push(DELETE_RUN);
                bytes(out, key);
                bytes(out, last);
                out.extend_from_slice(&count.to_le_bytes());
            }
        }
    }
}

/// Decodes what [`encode`] wrote; only ever reads this module's own bytes, so a short read is
/// a bug, not input.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let out = self.bytes[self.at..self.at + N].try_into().expect("N bytes");
        self.at += N;
        out
    }

    fn bytes(&mut self) -> Vec<u8> {
        let len = u32::from_le_bytes(self.take()) as usize;
        let out = self.bytes[self.at..self.at + len].to_vec();
        self.at += len;
        out
    }

    fn revision(&mut self) -> Revision {
        let revision = i64::from_le_bytes(self.take());
        let n = u32::from_le_bytes(self.take()) as usize;
        let mut ops = Vec::with_capacity(n);
        for _ in 0..n {
            let [tag] = self.take();
            ops.push(match tag {
                PUT => {
                    let lease = i64::from_le_bytes(self.take());
                    let key = self.bytes();
                    Op::Put { key, value: self.bytes(), lease }
                }
                DELETE => Op::Delete { key: self.bytes() },
                DELETE_RANGE => {
                    let key = self.bytes();
                    Op::DeleteRange { key, end: self.bytes() }
                }
                DELETE_RUN => {
                    let key = self.bytes();
                    let last = self.bytes();
                    Op::DeleteRun { key, last, count: u64::from_le_bytes(self.take()) }
                }
                other => unreachable!("replay buffer op tag {other}"),
            });
        }
        Revision { revision, ops }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn put(r: i64, value: usize) -> Revision {
        Revision { revision: r, ops: vec![Op::Put { key: b"k".to_vec(), value: vec![0; value], lease: 0 }] }
    }

    /// The byte bound is enforced on encoded bytes, an overflowing push keeps nothing of
    /// itself, and draining resets the count.
    #[test]
    fn bounded_by_bytes() {
        // 8 + 4 + (1 + 8 + 4 + 1 + 4 + 40) = 70 bytes each.
        assert_eq!(encoded_len(&put(1, 40)), 70);
        let mut b = ReplayBuffer::new(150);
        b.push(vec![put(1, 40), put(2, 40)]).unwrap();
        assert_eq!(b.bytes(), 140);
        assert_eq!(b.push(vec![put(3, 40)]), Err(Overflow { limit: 150 }));
        assert_eq!(b.bytes(), 140);
        let drained: Vec<Revision> = b.drain().collect();
        assert_eq!(drained, [put(1, 40), put(2, 40)]);
        assert_eq!(b.bytes(), 0);
        b.push(vec![put(3, 40)]).unwrap();
    }

    /// A revision larger than a chunk gets one of its own, between ordinary ones; the drained
    /// iterator counts down and frees what it has read.
    #[test]
    fn a_revision_over_a_chunk_stays_whole() {
        let mut b = ReplayBuffer::new(1 << 20);
        b.push(vec![put(1, 10), put(2, CHUNK_BYTES * 2), put(3, 10)]).unwrap();
        let mut drained = b.drain();
        assert_eq!(drained.len(), 3);
        assert_eq!(drained.chunks.len(), 3);
        assert_eq!(drained.next(), Some(put(1, 10)));
        assert_eq!(drained.chunks.len(), 2, "the first chunk is freed once read");
        assert_eq!(drained.next(), Some(put(2, CHUNK_BYTES * 2)));
        assert_eq!(drained.len(), 1);
        assert_eq!(drained.next(), Some(put(3, 10)));
        assert_eq!((drained.next(), drained.bytes, drained.chunks.len()), (None, 0, 0));
    }

    fn bytes() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 0..40)
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (bytes(), bytes(), any::<i64>()).prop_map(|(key, value, lease)| Op::Put { key, value, lease }),
            bytes().prop_map(|key| Op::Delete { key }),
            (bytes(), bytes()).prop_map(|(key, end)| Op::DeleteRange { key, end }),
            (bytes(), bytes(), any::<u64>()).prop_map(|(key, last, count)| Op::DeleteRun {
                key,
                last,
                count
            }),
        ]
    }

    proptest! {
        /// Every op kind, empty revisions included, comes back exactly as it went in, in
        /// order, and the bytes counted are the bytes written.
        #[test]
        fn revisions_come_back_as_they_went_in(
            revisions in proptest::collection::vec(
                (any::<i64>(), proptest::collection::vec(op(), 0..6))
                    .prop_map(|(revision, ops)| Revision { revision, ops }),
                0..200,
            )
        ) {
            let mut b = ReplayBuffer::new(usize::MAX);
            b.push(revisions.clone()).unwrap();
            let written: usize = b.held.chunks.iter().map(Vec::len).sum();
            prop_assert_eq!(b.bytes(), written);
            let back: Vec<Revision> = b.drain().collect();
            prop_assert_eq!(back, revisions);
        }
    }
}
