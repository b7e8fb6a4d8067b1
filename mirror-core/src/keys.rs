//! Which keys are mirrored and where they land (SPEC §3).
//!
//! One anchored formula, never a substring replace:
//! `target_key = destination_prefix + key[len(source.prefix)..]`
//! where `destination_prefix = target.prefix + sync.dest_prefix`.
//!
//! Why the rewrite is safe:
//! 1. *Injective on scope.* Every in-scope key starts with `source.prefix`; stripping a fixed
//!    prefix and prepending another fixed one is a bijection between the two prefixed sets.
//! 2. *Never reserved.* The reserved namespace is `destination_prefix + "\0etcd-mirror/"`. The
//!    only source keys that would land there are `source.prefix + "\0etcd-mirror/..."`, which is
//!    the source's own reserved namespace (other links' checkpoints); it is always excluded.
//! 3. *Excludes are cut out, not filtered.* [`KeyRewriter::scan_windows`] subtracts each excluded
//!    prefix from the source range so Gets never fetch excluded keys; [`KeyRewriter::to_target`]
//!    still refuses them for watch events, which arrive for the whole prefix.

use std::cmp::Ordering;

use sha2::{Digest, Sha256};

/// Marks the reserved namespace under a prefix: `prefix + RESERVED_MARKER`.
pub const RESERVED_MARKER: &str = "\u{0}etcd-mirror/";

/// A link's destination range as the overlap rule sees it: every target key under `prefix`
/// but those under one of `excludes` (the link's `dest_excludes`). Two links may share a target
/// only where their ranges share no key.
#[derive(Clone, Copy, Debug)]
pub struct DestRange<'a> {
    /// The destination prefix.
    pub prefix: &'a [u8],
    /// Prefixes under `prefix` the link never writes.
    pub excludes: &'a [Vec<u8>],
}

impl DestRange<'_> {
    /// Whether some key is in both ranges. Prefix ranges either nest or are disjoint: disjoint
    /// ones share nothing; nested ones share the inner range unless the outer excludes a prefix
    /// of the inner's (a finite set of excludes covers all of the inner range only that way).
    /// Equal prefixes always overlap; "adjacent" prefixes such as `/a` and `/ab` nest as bytes.
    pub fn overlaps(&self, other: &DestRange<'_>) -> bool {
        let (outer, inner) = if other.prefix.starts_with(self.prefix) {
            (self, other)
        } else if self.prefix.starts_with(other.prefix) {
            (other, self)
        } else {
            return false;
        };
        !outer.excludes.iter().any(|e| inner.prefix.starts_with(e))
    }
}

/// A half-open key range `[start, end)` in etcd's convention: `end == [0]` means "to the end of
/// the keyspace".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRange {
    /// First key of the range.
    pub start: Vec<u8>,
    /// First key after the range, or `[0]` for unbounded.
    pub end: Vec<u8>,
}

impl KeyRange {
    /// The range of every key starting with `prefix`.
    pub fn prefix(prefix: &[u8]) -> KeyRange {
        // etcd rejects an empty key; "\0" is the smallest key there is.
        let start = if prefix.is_empty() { vec![0] } else { prefix.to_vec() };
        KeyRange { start, end: prefix_end(prefix) }
    }

    /// Whether `key` lies in the range.
    pub fn contains(&self, key: &[u8]) -> bool {
        key >= self.start.as_slice() && cmp_end(key, &self.end) == Ordering::Less
    }
}

/// Compares a key with a range end, treating `[0]` as +infinity.
fn cmp_end(key: &[u8], end: &[u8]) -> Ordering {
    if end == [0] {
        Ordering::Less
    } else {
        key.cmp(end)
    }
}

/// The first key after every key that starts with `prefix`, as etcd computes it: drop trailing
/// 0xff bytes, increment the last byte; `[0]` (unbounded) when nothing is left.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(&last) = end.last() {
        if last < 0xff {
            *end.last_mut().expect("non-empty") += 1;
            return end;
        }
        end.pop();
    }
    vec![0]
}

/// The smallest key greater than `key`: `key` followed by a zero byte. A range starting here
/// resumes strictly after `key`; a range ending here (exclusive) ends with `key` included.
pub fn key_after(key: &[u8]) -> Vec<u8> {
    [key, &[0u8]].concat()
}

/// What is left of `windows` (disjoint, in key order) strictly after `cursor`: windows that
/// end at or before it are dropped, and the one that goes on past it starts just after it. An
/// empty cursor (nothing scanned yet) leaves them all.
pub fn windows_after(windows: &[KeyRange], cursor: &[u8]) -> Vec<KeyRange> {
    if cursor.is_empty() {
        return windows.to_vec();
    }
    let after = key_after(cursor);
    windows
        .iter()
        .filter(|w| cmp_end(&after, &w.end) == Ordering::Less)
        .map(|w| KeyRange { start: w.start.clone().max(after.clone()), end: w.end.clone() })
        .collect()
}

/// Sorts relative exclude prefixes and drops those nested under another (and duplicates).
pub fn normalize_excludes<'a>(excludes: impl IntoIterator<Item = &'a [u8]>) -> Vec<Vec<u8>> {
    let mut all: Vec<Vec<u8>> = excludes.into_iter().map(<[u8]>::to_vec).collect();
    all.sort();
    let mut out: Vec<Vec<u8>> = Vec::with_capacity(all.len());
    for p in all {
        if !out.last().is_some_and(|kept| p.starts_with(kept)) {
            out.push(p);
        }
    }
    out
}

/// Redacts a key for logs and errors: `prefix + "…" + first 8 hex digits of SHA-256(key)`.
/// The prefix is shown (it is configuration, not data); the rest of the key never is.
pub fn redact_key(prefix: &[u8], key: &[u8]) -> String {
    let shown = if key.starts_with(prefix) { prefix } else { b"" };
    let digest = Sha256::digest(key);
    format!("{}…{}", String::from_utf8_lossy(shown).escape_debug(), &hex::encode(digest)[..8])
}

/// Maps source keys to target keys for one link and knows the reserved namespace.
#[derive(Clone, Debug)]
pub struct KeyRewriter {
    source_prefix: Vec<u8>,
    dest_prefix: Vec<u8>,
    /// Absolute source prefixes that are never mirrored, normalised; includes the source's own
    /// reserved namespace.
    excludes: Vec<Vec<u8>>,
    reserved: Vec<u8>,
}

impl KeyRewriter {
    /// `excludes` are relative to `source_prefix`, in any order, possibly nested.
    pub fn new<'a>(
        source_prefix: &[u8],
        dest_prefix: &[u8],
        excludes: impl IntoIterator<Item = &'a [u8]>,
    ) -> KeyRewriter {
        let marker = RESERVED_MARKER.as_bytes();
        let absolute: Vec<Vec<u8>> = excludes
            .into_iter()
            .map(|rel| [source_prefix, rel].concat())
            .chain(std::iter::once([source_prefix, marker].concat()))
            .collect();
        KeyRewriter {
            source_prefix: source_prefix.to_vec(),
            dest_prefix: dest_prefix.to_vec(),
            excludes: normalize_excludes(absolute.iter().map(Vec::as_slice)),
            reserved: [dest_prefix, marker].concat(),
        }
    }

    /// The source prefix.
    pub fn source_prefix(&self) -> &[u8] {
        &self.source_prefix
    }

    /// The destination prefix (`target.prefix + dest_prefix`).
    pub fn dest_prefix(&self) -> &[u8] {
        &self.dest_prefix
    }

    /// The excluded prefixes as destination keys (the source's own reserved namespace left
    /// out): where this link never writes.
    pub fn dest_excludes(&self) -> Vec<Vec<u8>> {
        let own = [&self.source_prefix[..], RESERVED_MARKER.as_bytes()].concat();
        self.excludes
            .iter()
            .filter(|e| **e != own)
            .map(|e| [&self.dest_prefix[..], &e[self.source_prefix.len()..]].concat())
            .collect()
    }

    /// Absolute excluded source prefixes, sorted and non-nested.
    pub fn excludes(&self) -> &[Vec<u8>] {
        &self.excludes
    }

    /// Whether a source key is mirrored.
    pub fn in_scope(&self, source_key: &[u8]) -> bool {
        source_key.starts_with(&self.source_prefix)
            && !self.excludes.iter().any(|p| source_key.starts_with(p))
    }

    /// The target key of a source key, or `None` when the key is out of scope. Another link's
    /// reserved namespace anywhere under the source prefix (a nested destination) is out of
    /// scope too: its checkpoint is that link's, not data.
    pub fn to_target(&self, source_key: &[u8]) -> Option<Vec<u8>> {
        (self.in_scope(source_key) && !holds_marker(&source_key[self.source_prefix.len()..]))
            .then(|| [&self.dest_prefix[..], &source_key[self.source_prefix.len()..]].concat())
    }

    /// The source key a target key mirrors, or `None` for a reserved, foreign or out-of-range
    /// key. Keys of another link's reserved namespace nested in the destination range are
    /// foreign: never compared, never deleted.
    pub fn to_source(&self, target_key: &[u8]) -> Option<Vec<u8>> {
        if !target_key.starts_with(&self.dest_prefix) || self.is_reserved(target_key) {
            return None;
        }
        let relative = &target_key[self.dest_prefix.len()..];
        if holds_marker(relative) {
            return None;
        }
        let source = [&self.source_prefix[..], relative].concat();
        self.in_scope(&source).then_some(source)
    }

    /// For a target key inside another link's reserved namespace nested in the destination
    /// range, that namespace (`their destination prefix + "\0etcd-mirror/"`).
    pub fn foreign_namespace(&self, target_key: &[u8]) -> Option<Vec<u8>> {
        if !target_key.starts_with(&self.dest_prefix) || self.is_reserved(target_key) {
            return None;
        }
        let marker = RESERVED_MARKER.as_bytes();
        let relative = &target_key[self.dest_prefix.len()..];
        let at = relative.windows(marker.len()).position(|w| w == marker)?;
        Some(target_key[..self.dest_prefix.len() + at + marker.len()].to_vec())
    }

    /// Whether a target key is in this link's reserved namespace.
    pub fn is_reserved(&self, target_key: &[u8]) -> bool {
        target_key.starts_with(&self.reserved)
    }

    /// `destination_prefix + "\0etcd-mirror/"`.
    pub fn reserved_prefix(&self) -> Vec<u8> {
        self.reserved.clone()
    }

    /// The default checkpoint key: `R + "checkpoint"`.
    pub fn default_checkpoint_key(&self) -> Vec<u8> {
        [&self.reserved[..], b"checkpoint"].concat()
    }

    /// Prefix of the HA election keys: `R + "election/"`.
    pub fn election_prefix(&self) -> Vec<u8> {
        [&self.reserved[..], b"election/"].concat()
    }

    /// The whole source range, excludes included.
    pub fn source_range(&self) -> KeyRange {
        KeyRange::prefix(&self.source_prefix)
    }

    /// The whole destination range, reserved namespace included.
    pub fn target_range(&self) -> KeyRange {
        KeyRange::prefix(&self.dest_prefix)
    }

    /// The source range with every excluded prefix cut out, in key order: the Get windows of a
    /// scan, so excluded keys are never fetched.
    pub fn scan_windows(&self) -> Vec<KeyRange> {
        subtract(self.source_range(), &self.excludes)
    }

    /// The destination range without the reserved namespace, in key order: what counts, prunes,
    /// digests and the `require_empty` check look at.
    pub fn target_windows(&self) -> Vec<KeyRange> {
        subtract(self.target_range(), std::slice::from_ref(&self.reserved))
    }

    /// A fingerprint of what this rewriter mirrors (source prefix, destination prefix,
    /// excludes): equal fingerprints mean the same range.
    pub fn range_fingerprint(&self) -> String {
        let mut h = Sha256::new();
        for part in [&self.source_prefix, &self.dest_prefix].into_iter().chain(self.excludes.iter()) {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        format!("sha256:{}", &hex::encode(h.finalize())[..32])
    }

    /// Redacts a source or target key of this link (see [`redact_key`]).
    pub fn redact(&self, key: &[u8]) -> String {
        let prefix = [&self.source_prefix, &self.dest_prefix]
            .into_iter()
            .filter(|p| key.starts_with(p))
            .max_by_key(|p| p.len())
            .map_or(&b""[..], Vec::as_slice);
        redact_key(prefix, key)
    }
}

/// Whether a key (relative to a prefix) contains the reserved marker: it lies in some link's
/// reserved namespace.
fn holds_marker(relative: &[u8]) -> bool {
    let marker = RESERVED_MARKER.as_bytes();
    relative.windows(marker.len()).any(|w| w == marker)
}

/// `range` minus every prefix in `cuts` (sorted, non-nested).
fn subtract(range: KeyRange, cuts: &[Vec<u8>]) -> Vec<KeyRange> {
    let mut out = Vec::new();
    let mut cur = range.start;
    for cut in cuts {
        let cut_range = KeyRange::prefix(cut);
        if cmp_end(&cut_range.start, &range.end) != Ordering::Less {
            break;
        }
        if cut_range.start > cur {
            out.push(KeyRange { start: cur.clone(), end: cut_range.start.clone() });
        }
        if cut_range.end == [0] {
            return out;
        }
        cur = cur.max(cut_range.end);
    }
    if cmp_end(&cur, &range.end) == Ordering::Less {
        out.push(KeyRange { start: cur, end: range.end });
    }
    out
}

#[cfg(test)]
#[path = "keys_tests.rs"]
mod tests;
