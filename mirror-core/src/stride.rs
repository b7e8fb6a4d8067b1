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
//! A read-ahead reader ([`Stride::within_a_page`]) aims each probe at about half a page
//! instead, so most answers hold their whole window and the next windows can be asked for
//! before the answer is back (narrower when a probe counted more than a page, wider when it
//! held under a quarter of one).
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
    /// Keys a probe aims at, in quarters of a page: 8 (two pages) for a sliding reader, 2
    /// (half a page) for a read-ahead one.
    quarters: u128,
}

impl Stride {
    /// A stride over `[start, end)`; `end == [0]` means "to the end of the keyspace".
    pub fn new(start: &[u8], end: &[u8]) -> Stride {
        let common = start.iter().zip(end).take_while(|(a, b)| a == b).count();
        Stride { prefix: start[..common].to_vec(), end: end.to_vec(), span: None, quarters: 8 }
    }

    /// The stride of `window`, or an inert one when there is no window left.
    pub fn for_window(window: Option<&crate::KeyRange>) -> Stride {
        window.map_or_else(|| Stride::new(&[], &[0]), |w| Stride::new(&w.start, &w.end))
    }

    /// Probes aimed at half a page, for a reader that asks for the next windows before the
    /// answer to this one is back: most answers then hold their whole window.
    pub fn within_a_page(mut self) -> Stride {
        self.quarters = 2;
        self
    }

    /// Whether a key density has been learned (until then a probe is the whole window).
    pub fn knows_density(&self) -> bool {
        self.span.is_some()
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
                    self.span = Some(per_key.saturating_mul(limit * self.quarters / 4).max(1));
                }
            }
            Some(span) => {
                // Narrower above twice the aim, wider at or below half of it.
                let quarters = count.max(0) as u128 * 4;
                if quarters > limit * self.quarters * 2 {
                    self.span = Some((span / 2).max(1));
                } else if quarters * 2 <= limit * self.quarters {
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

    /// A read-ahead stride aims at half a page: it narrows above one page and widens at or
    /// below a quarter of one.
    #[test]
    fn a_read_ahead_stride_aims_under_a_page() {
        let key = |i: u32| format!("/a/key-{i:08}").into_bytes();
        let mut sliding = Stride::new(b"/a/", b"/a0");
        let mut ahead = Stride::new(b"/a/", b"/a0").within_a_page();
        assert!(!ahead.knows_density());
        sliding.learn(Some(&key(0)), Some(&key(99)), 100, 1_000, 100);
        ahead.learn(Some(&key(0)), Some(&key(99)), 100, 1_000, 100);
        assert!(ahead.knows_density());
        assert_eq!(ahead.span.unwrap() * 4, sliding.span.unwrap(), "half a page against two");
        let span = ahead.span.unwrap();
        ahead.learn(None, None, 100, 101, 100);
        assert_eq!(ahead.span, Some(span / 2), "over a page narrows");
        ahead.learn(None, None, 25, 25, 100);
        assert_eq!(ahead.span, Some(span), "a quarter of a page widens");
        ahead.learn(None, None, 60, 60, 100);
        assert_eq!(ahead.span, Some(span), "half a page is the aim");
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
