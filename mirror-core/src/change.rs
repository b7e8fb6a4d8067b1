//! One source change as exact mode (SPEC §10) replays it: the key, what the source wrote, and
//! what the source held just before, which is what the target must hold for the change to land
//! the same way.

/// One event of a source revision, with the source's view of its key before the revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// The source put `value` at `key`.
    Put {
        /// The key (exact mode does not rewrite keys).
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
        /// The source lease (0: none); the target holds a lease with the same ID.
        lease: i64,
        /// The key's version after the put: 1 when the put created it.
        version: i64,
        /// The key's create revision after the put.
        create_revision: i64,
        /// The lease the key had before (0: none, or the key was absent).
        prev_lease: i64,
    },
    /// The source deleted `key`.
    Delete {
        /// The key.
        key: Vec<u8>,
        /// The mod revision of the key before the delete (the event's prev_kv); `None` where
        /// the source could not say (prev_kv compacted away).
        prev_mod_revision: Option<i64>,
        /// The lease the key had before (0: none, or unknown).
        prev_lease: i64,
    },
}

impl Change {
    /// The key.
    pub fn key(&self) -> &[u8] {
        match self {
            Change::Put { key, .. } | Change::Delete { key, .. } => key,
        }
    }

    /// The lease the key leaves by this change (0: none): once the change landed, that lease
    /// may hold no key on the target any more.
    pub fn left_lease(&self) -> i64 {
        match self {
            Change::Put { lease, prev_lease, .. } if lease != prev_lease => *prev_lease,
            Change::Put { .. } => 0,
            Change::Delete { prev_lease, .. } => *prev_lease,
        }
    }

    /// Bytes this change adds to a Txn request (key + value + a small per-op overhead).
    pub fn size(&self) -> usize {
        const OVERHEAD: usize = 16;
        match self {
            Change::Put { key, value, .. } => key.len() + value.len() + OVERHEAD,
            Change::Delete { key, .. } => key.len() + OVERHEAD,
        }
    }
}

/// Every change of one source revision, in the source's order (its sub-revisions).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExactRevision {
    /// The source revision.
    pub revision: i64,
    /// Its changes; empty where every event fell in the source's reserved namespace.
    pub changes: Vec<Change>,
}

/// A stored revision could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a spooled revision is cut short or malformed at byte {at}")]
pub struct Malformed {
    /// Where decoding stopped.
    pub at: usize,
}

impl ExactRevision {
    /// Bytes its changes add to a Txn request, and about what the agent holds of it.
    pub fn size(&self) -> usize {
        self.changes.iter().map(Change::size).sum()
    }

    /// The revision as bytes (the spool's record): the revision, then each change as a tag
    /// (0 put, 1 delete) and its fields, byte strings length-prefixed, integers big-endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.size());
        out.extend(self.revision.to_be_bytes());
        out.extend((self.changes.len() as u32).to_be_bytes());
        let bytes = |out: &mut Vec<u8>, b: &[u8]| {
            out.extend((b.len() as u32).to_be_bytes());
            out.extend(b);
        };
        for change in &self.changes {
            match change {
                Change::Put { key, value, lease, version, create_revision, prev_lease } => {
                    out.push(0);
                    bytes(&mut out, key);
                    bytes(&mut out, value);
                    for n in [lease, version, create_revision, prev_lease] {
                        out.extend(n.to_be_bytes());
                    }
                }
                Change::Delete { key, prev_mod_revision, prev_lease } => {
                    out.push(1);
                    bytes(&mut out, key);
                    // -1: prev_kv unknown (mod revisions are positive).
                    out.extend(prev_mod_revision.unwrap_or(-1).to_be_bytes());
                    out.extend(prev_lease.to_be_bytes());
                }
            }
        }
        out
    }

    /// The revision [`ExactRevision::encode`] wrote; every byte must be used.
    pub fn decode(bytes: &[u8]) -> Result<ExactRevision, Malformed> {
        let mut r = Reader { bytes, at: 0 };
        let revision = r.i64()?;
        let n = r.u32()? as usize;
        let mut changes = Vec::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            let change = match r.take(1)?[0] {
                0 => Change::Put {
                    key: r.bytes()?,
                    value: r.bytes()?,
                    lease: r.i64()?,
                    version: r.i64()?,
                    create_revision: r.i64()?,
                    prev_lease: r.i64()?,
                },
                1 => Change::Delete {
                    key: r.bytes()?,
                    prev_mod_revision: Some(r.i64()?).filter(|m| *m >= 0),
                    prev_lease: r.i64()?,
                },
                _ => return Err(Malformed { at: r.at - 1 }),
            };
            changes.push(change);
        }
        if r.at != bytes.len() {
            return Err(Malformed { at: r.at });
        }
        Ok(ExactRevision { revision, changes })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let end =
            self.at.checked_add(n).filter(|e| *e <= self.bytes.len()).ok_or(Malformed { at: self.at })?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, Malformed> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn i64(&mut self) -> Result<i64, Malformed> {
        Ok(i64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn bytes(&mut self) -> Result<Vec<u8>, Malformed> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn change() -> impl Strategy<Value = Change> {
        let bytes = || proptest::collection::vec(any::<u8>(), 0..40);
        prop_oneof![
            (bytes(), bytes(), any::<i64>(), 1..1000i64, 1..1000i64, any::<i64>()).prop_map(
                |(key, value, lease, version, create_revision, prev_lease)| Change::Put {
                    key,
                    value,
                    lease,
                    version,
                    create_revision,
                    prev_lease
                }
            ),
            (bytes(), proptest::option::of(1..1000i64), any::<i64>()).prop_map(
                |(key, prev_mod_revision, prev_lease)| Change::Delete { key, prev_mod_revision, prev_lease }
            ),
        ]
    }

    proptest! {
        /// Every revision decodes to itself, and every proper prefix of its bytes is refused
        /// (a record cut short by a crash is never read as a smaller revision).
        #[test]
        fn a_revision_decodes_to_itself_and_a_cut_one_never(
            revision in 1..i64::MAX,
            changes in proptest::collection::vec(change(), 0..6),
            cut in any::<prop::sample::Index>(),
        ) {
            let rev = ExactRevision { revision, changes };
            let bytes = rev.encode();
            prop_assert_eq!(ExactRevision::decode(&bytes), Ok(rev));
            let cut = cut.index(bytes.len());
            prop_assert!(ExactRevision::decode(&bytes[..cut]).is_err());
        }
    }
}
