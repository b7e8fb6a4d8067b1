//! Bounded page windows for paged range reads.
//!
//! etcd answers a ranged Get with `limit` by walking the *whole* requested range in its index to
//! fill in `count` (3.4 and 3.5 both do), so paging through n keys as `[last + 1, range end)`
//! costs O(n) per page and O(n²) in all: a 300k-key scan ran at a third of the speed of a
//! 100k-key one. A [`Stride`] asks each page for `[from, probe end)` instead, where the probe end
//! lies about two pages ahead by the key density seen so far, so each walk stays near the page
//! size. Keys are projected onto numbers by their first 16 bytes after the window's common
//! prefix (an order-preserving map), densities are measured there, and the stride halves when a
//! probe counted more than four pages and doubles when it held less than one.
//!
//! Correctness never depends on the estimate: a probe end is only ever strictly after `from` and
//! at most the window's end, and a reader continues from the probe end once a probe is drained.

/// Width of the numeric projection of a key, in bytes.
const PROJECTED: usize = 16;

/// The adaptive probe of one key window `[start, end)`.
#[derive(Clone, Debug)]
pub struct Stride {
    prefix: Vec<u8>,
    end: Vec<u8>,
    span: Option<u128>,
}

impl Stride {
    /// A stride over `[start, end)`; `end == [0]` means "to the end of the keyspace".
    pub fn new(start: &[u8], end: &[u8]) -> Stride {
        let common = start.iter().zip(end).take_while(|(a, b)| a == b).count();
        Stride { prefix: start[..common].to_vec(), end: end.to_vec(), span: None }
    }

    /// The stride of `window`, or an inert one when there is no window left.
    pub fn for_window(window: Option<&crate::KeyRange>) -> Stride {
        window.map_or_else(|| Stride::new(&[], &[0]), |w| Stride::new(&w.start, &w.end))
    }

    fn unbounded(&self) -> bool {
        self.end == [0]
    }

    /// The range end to request when reading from `from`: strictly after `from`, never past
    /// the window's end (which it returns until the density is known).
    pub fn probe_end(&self, from: &[u8]) -> Vec<u8> {
        let Some(span) = self.span else { return self.end.clone() };
        let Some(at) = self.project(from) else { return self.end.clone() };
        let Some(n) = at.checked_add(span) else { return self.end.clone() };
        let mut end = self.prefix.clone();
        end.extend_from_slice(&n.to_be_bytes());
        if end.as_slice() <= from || (!self.unbounded() && end >= self.end) {
            return self.end.clone();
        }
        end
    }

    /// Whether `end` is the window's own end (the window is done once a probe to it drains).
    pub fn is_window_end(&self, end: &[u8]) -> bool {
        end == self.end.as_slice()
    }

    /// Learns from one answer: `returned` keys from `first` to `last`, of `count` keys etcd
    /// counted in the probed range, with page size `limit`.
    pub fn learn(
        &mut self,
        first: Option<&[u8]>,
        last: Option<&[u8]>,
        returned: usize,
        count: i64,
        limit: i64,
    ) {
        let limit = limit.max(1) as u128;
        match self.span {
            None => {
                let (Some(first), Some(last)) = (first, last) else { return };
                let (Some(a), Some(b)) = (self.project(first), self.project(last)) else { return };
                if returned >= 2 && b > a {
                    let per_key = ((b - a) / (returned as u128 - 1)).max(1);
                    // A probe aims at two pages.
                    self.span = Some(per_key.saturating_mul(limit * 2).max(1));
                }
            }
            Some(span) => {
                // Narrower above twice the aim (four pages), wider at or below half of it.
                let count = count.max(0) as u128;
                if count > limit * 4 {
                    self.span = Some((span / 2).max(1));
                } else if count <= limit {
                    self.span = Some(span.saturating_mul(2));
                }
            }
        }
    }

    /// The key's first [`PROJECTED`] bytes after the window's common prefix, zero-padded, as a
    /// number; `None` for a key outside the prefix (cannot happen inside the window).
    fn project(&self, key: &[u8]) -> Option<u128> {
        let rest = key.strip_prefix(self.prefix.as_slice())?;
        let mut bytes = [0u8; PROJECTED];
        let n = rest.len().min(PROJECTED);
        bytes[..n].copy_from_slice(&rest[..n]);
        Some(u128::from_be_bytes(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Until it has seen keys, a stride asks for the whole window.
    #[test]
    fn starts_with_the_whole_window() {
        let s = Stride::new(b"/a/", b"/a0");
        assert_eq!(s.probe_end(b"/a/x"), b"/a0");
        assert!(s.is_window_end(b"/a0"));
    }

    /// After a dense page it probes about two pages ahead, and adapts to the counts it sees.
    #[test]
    fn probes_ahead_by_density_and_adapts() {
        let key = |i: u32| format!("/a/key-{i:08}").into_bytes();
        let mut s = Stride::new(b"/a/", b"/a0");
        s.learn(Some(&key(0)), Some(&key(99)), 100, 1_000_000, 100);
        let from = [key(99), vec![0]].concat();
        let end = s.probe_end(&from);
        assert!(end.as_slice() > from.as_slice() && end.as_slice() < b"/a0".as_slice(), "{end:?}");
        let span = s.span.unwrap();
        s.learn(None, None, 100, 10_000, 100);
        assert_eq!(s.span, Some(span / 2), "a probe that counted 100 pages narrows");
        s.learn(None, None, 10, 10, 100);
        assert_eq!(s.span, Some(span), "a probe that held less than a page widens");
    }

    proptest! {
        /// A probe end is always strictly after `from` and never past the window's end, and
        /// the projection keeps key order.
        #[test]
        fn probe_ends_are_safe(
            keys in proptest::collection::btree_set(proptest::collection::vec(any::<u8>(), 0..24), 2..40),
            span in any::<u128>(),
        ) {
            let (start, end) = (b"/p/".to_vec(), b"/p0".to_vec());
            let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| [start.clone(), k].concat()).collect();
            let mut s = Stride::new(&start, &end);
            s.span = Some(span.max(1));
            for pair in keys.windows(2) {
                prop_assert!(s.project(&pair[0]) <= s.project(&pair[1]));
            }
            for k in &keys {
                let from = [k.clone(), vec![0]].concat();
                let probe = s.probe_end(&from);
                prop_assert!(probe.as_slice() > from.as_slice());
                prop_assert!(probe.as_slice() <= end.as_slice());
            }
        }
    }
}
