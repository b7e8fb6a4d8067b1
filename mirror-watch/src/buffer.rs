//! The replay buffer: source revisions that arrived while the genesis scan ran.

use std::collections::VecDeque;

use crate::batch::Revision;

/// The buffer passed `watch_buffer_bytes`; genesis restarts from a fresh R0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overflow {
    /// The limit that was passed.
    pub limit: usize,
}

/// Revisions held for replay, bounded in bytes (G6).
#[derive(Debug)]
pub struct ReplayBuffer {
    limit: usize,
    bytes: usize,
    revisions: VecDeque<Revision>,
}

impl ReplayBuffer {
    /// A buffer of at most `limit` bytes of ops.
    pub fn new(limit: usize) -> ReplayBuffer {
        ReplayBuffer { limit, bytes: 0, revisions: VecDeque::new() }
    }

    /// Appends revisions; fails (and keeps nothing new) when the limit would be passed.
    pub fn push(&mut self, revisions: Vec<Revision>) -> Result<(), Overflow> {
        let add: usize = revisions.iter().map(|r| r.size() + 8).sum();
        if self.bytes + add > self.limit {
            return Err(Overflow { limit: self.limit });
        }
        self.bytes += add;
        self.revisions.extend(revisions);
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Drains everything, in order.
    pub fn drain(&mut self) -> Vec<Revision> {
        self.bytes = 0;
        self.revisions.drain(..).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mirror_core::Op;

    /// The byte bound is enforced and draining resets it.
    #[test]
    fn bounded_by_bytes() {
        let rev = |r| Revision {
            revision: r,
            ops: vec![Op::Put { key: b"k".to_vec(), value: vec![0; 40], lease: 0 }],
        };
        let mut b = ReplayBuffer::new(150);
        b.push(vec![rev(1), rev(2)]).unwrap();
        assert!(b.push(vec![rev(3)]).is_err());
        assert_eq!(b.drain().len(), 2);
        assert_eq!(b.bytes(), 0);
        b.push(vec![rev(3)]).unwrap();
    }
}
