//! Coalescing a revision's deletes into range deletes, as a pure fold over the target's keys.
//!
//! A revision too large for one Txn key by key (a `del --prefix`, a lease revoke) may still fit
//! when its runs of deleted keys become range deletes. A run is only a run *in the target*: a
//! range delete must remove exactly the keys the source revision deleted, so any target key in
//! between that the revision does not delete (an excluded, reserved or foreign key, one the
//! source kept) ends the run, and so does a key the revision puts. The agent reads the
//! target's keys over [`Coalescer::span`] at one revision, feeds them here in order, and
//! commits the result guarded by "no key of the span changed since that revision".

use std::collections::BTreeSet;
use std::ops::Bound;

use mirror_core::KeyRange;

use crate::Op;

/// Folds the target's keys over a revision's deletes into its ops with runs as range deletes.
#[derive(Debug)]
pub struct Coalescer<'a> {
    /// The revision's single deletes, sorted; `next` is the first not yet placed.
    deletes: Vec<&'a [u8]>,
    next: usize,
    /// Keys the revision puts: none may fall inside a range delete.
    puts: BTreeSet<&'a [u8]>,
    /// The run being built: deleted keys adjacent in the target.
    run: Vec<Vec<u8>>,
    out: Vec<Op>,
    /// Ops given, to tell whether coalescing saved any.
    given: usize,
}

impl<'a> Coalescer<'a> {
    /// A coalescer of `ops`, or `None` when they hold fewer than two single deletes (nothing to
    /// coalesce). Every op that is not a single delete (puts, range deletes already checked)
    /// is kept as it is.
    pub fn new(ops: &'a [Op]) -> Option<Coalescer<'a>> {
        let mut deletes: Vec<&[u8]> =
            ops.iter().filter(|op| matches!(op, Op::Delete { .. })).map(Op::key).collect();
        if deletes.len() < 2 {
            return None;
        }
        deletes.sort_unstable();
        let puts = ops.iter().filter(|op| matches!(op, Op::Put { .. })).map(Op::key).collect();
        let out = ops.iter().filter(|op| !matches!(op, Op::Delete { .. })).cloned().collect();
        Some(Coalescer { deletes, next: 0, puts, run: Vec::new(), out, given: ops.len() })
    }

    /// The target range to read: from the first deleted key to the last, inclusive.
    pub fn span(&self) -> KeyRange {
        let last = self.deletes[self.deletes.len() - 1];
        KeyRange { start: self.deletes[0].to_vec(), end: mirror_core::key_after(last) }
    }

    /// The next key the target holds in [`Coalescer::span`], in increasing order.
    pub fn target_key(&mut self, key: &[u8]) {
        // Deletes of keys the target does not hold (none, while G3 holds) stay single.
        while self.deletes.get(self.next).is_some_and(|d| *d < key) {
            self.close();
            self.out.push(Op::Delete { key: self.deletes[self.next].to_vec() });
            self.next += 1;
        }
        let deleted_here = self.deletes.get(self.next).is_some_and(|d| *d == key);
        let put_between = self.run.last().is_some_and(|last| {
            self.puts
                .range::<[u8], _>((Bound::Excluded(last.as_slice()), Bound::Excluded(key)))
                .next()
                .is_some()
        });
        if put_between {
            self.close();
        }
        if deleted_here {
            self.run.push(key.to_vec());
            self.next += 1;
        } else {
            self.close();
        }
    }

    /// The ops with runs coalesced, or `None` when that saved nothing.
    pub fn finish(mut self) -> Option<Vec<Op>> {
        self.close();
        let rest: Vec<Op> =
            self.deletes[self.next..].iter().map(|d| Op::Delete { key: d.to_vec() }).collect();
        self.out.extend(rest);
        (self.out.len() < self.given).then_some(self.out)
    }

    /// Ends the run: a lone key stays a delete, two or more become one range delete.
    fn close(&mut self) {
        match self.run.len() {
            0 => {}
            1 => self.out.push(Op::Delete { key: self.run.pop().expect("one") }),
            _ => {
                let key = self.run.first().expect("two").clone();
                let end = mirror_core::key_after(self.run.last().expect("two"));
                self.out.push(Op::DeleteRange { key, end });
                self.run.clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn del(k: &str) -> Op {
        Op::Delete { key: k.as_bytes().to_vec() }
    }

    fn range(a: &str, last: &str) -> Op {
        Op::DeleteRange { key: a.as_bytes().to_vec(), end: mirror_core::key_after(last.as_bytes()) }
    }

    fn coalesce(ops: &[Op], target: &[&str]) -> Option<Vec<Op>> {
        let mut c = Coalescer::new(ops)?;
        for k in target {
            c.target_key(k.as_bytes());
        }
        c.finish()
    }

    /// Deleted keys adjacent in the target become one range; a kept target key between them
    /// splits the run, and a lone deleted key stays a delete.
    #[test]
    fn a_kept_key_in_the_target_ends_a_run() {
        let ops = [del("a"), del("b"), del("c"), del("e"), del("f")];
        let out = coalesce(&ops, &["a", "b", "c", "d", "e", "f"]).unwrap();
        assert_eq!(out, vec![range("a", "c"), range("e", "f")]);
        let out = coalesce(&ops, &["a", "b", "bb", "c", "e", "f"]).unwrap();
        assert_eq!(out, vec![range("a", "b"), range("c", "f")], "no d in the target: c, e, f are adjacent");
        let out = coalesce(&ops, &["a", "b", "bb", "c", "d", "e", "f"]).unwrap();
        assert_eq!(out, vec![range("a", "b"), del("c"), range("e", "f")]);
    }

    /// A key the revision puts between two deleted keys ends the run (the range would delete
    /// it), and the put stays.
    #[test]
    fn a_put_between_deleted_keys_ends_a_run() {
        let put = Op::Put { key: b"bb".to_vec(), value: b"v".to_vec(), lease: 0 };
        let ops = [del("a"), del("b"), put.clone(), del("c"), del("d")];
        let out = coalesce(&ops, &["a", "b", "c", "d"]).unwrap();
        assert_eq!(out, vec![put, range("a", "b"), range("c", "d")]);
    }

    /// Deletes of keys the target does not hold stay single, in order; range deletes already
    /// in the revision are kept; nothing saved is `None`.
    #[test]
    fn absent_keys_stay_single_and_ranges_are_kept() {
        let kept = range("x", "y");
        let ops = [del("a"), del("b"), del("c"), kept.clone()];
        let out = coalesce(&ops, &["b", "c"]).unwrap();
        assert_eq!(out, vec![kept, del("a"), range("b", "c")]);
        assert_eq!(coalesce(&[del("a"), del("c")], &["a", "b", "c"]), None, "no two adjacent");
        assert!(Coalescer::new(&[del("a")]).is_none());
        let span = Coalescer::new(&[del("m"), del("c")]).unwrap().span();
        assert_eq!((span.start.as_slice(), span.end.as_slice()), (&b"c"[..], &b"m\0"[..]));
    }
}
