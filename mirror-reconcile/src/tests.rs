use super::*;

fn entry(key: &str, value: &str) -> Entry {
    Entry { key: key.as_bytes().to_vec(), value: value.as_bytes().to_vec(), lease: 0, mod_revision: 1 }
}

/// Replays the merge-join over two in-memory sorted sides, as `Differ` does over pages.
fn merge(source: &[Entry], target: &[Entry]) -> Vec<(Step, String)> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    loop {
        let step = merge_step(source.get(i), target.get(j), false);
        match step {
            Step::Done => return out,
            Step::Missing => {
                out.push((step, String::from_utf8_lossy(&source[i].key).into_owned()));
                i += 1;
            }
            Step::Orphan => {
                out.push((step, String::from_utf8_lossy(&target[j].key).into_owned()));
                j += 1;
            }
            Step::Same | Step::Divergent => {
                if step == Step::Divergent {
                    out.push((step, String::from_utf8_lossy(&source[i].key).into_owned()));
                }
                i += 1;
                j += 1;
            }
        }
    }
}

/// Every kind of difference is found once, in key order, whatever lies between.
#[test]
fn merge_join_finds_each_difference_once() {
    let source = [entry("/a", "1"), entry("/b", "2"), entry("/d", "4"), entry("/e", "5")];
    let target = [entry("/a", "1"), entry("/c", "3"), entry("/d", "X"), entry("/f", "6")];
    let found = merge(&source, &target);
    let expected: Vec<(Step, String)> = [
        (Step::Missing, "/b"),
        (Step::Orphan, "/c"),
        (Step::Divergent, "/d"),
        (Step::Missing, "/e"),
        (Step::Orphan, "/f"),
    ]
    .iter()
    .map(|(s, k)| (*s, (*k).to_owned()))
    .collect();
    assert_eq!(found, expected);
}

/// Equal sides give no difference; one empty side makes every key of the other one.
#[test]
fn empty_and_equal_sides() {
    let side = [entry("/a", "1"), entry("/b", "2")];
    assert!(merge(&side, &side).is_empty());
    assert_eq!(merge(&side, &[]).len(), 2);
    assert!(merge(&[], &side).iter().all(|(s, _)| *s == Step::Orphan));
    assert_eq!(merge_step(None, None, false), Step::Done);
}

/// Where leases are preserved, the same value under another lease (or none) differs; where
/// they are stripped, leases are not compared.
#[test]
fn leases_differ_only_where_preserved() {
    let leased = |lease| Entry { lease, ..entry("/a", "1") };
    assert_eq!(merge_step(Some(&leased(7)), Some(&leased(7)), true), Step::Same);
    assert_eq!(merge_step(Some(&leased(7)), Some(&leased(0)), true), Step::Divergent);
    assert_eq!(merge_step(Some(&leased(7)), Some(&leased(8)), true), Step::Divergent);
    assert_eq!(merge_step(Some(&leased(7)), Some(&leased(0)), false), Step::Same);
}

/// Digests are equal exactly when the ordered (key, value) pairs are: the length prefix keeps
/// ("ab","c") apart from ("a","bc").
#[test]
fn digests_separate_keys_from_values() {
    let (mut a, mut b) = (Counts::default(), Counts::default());
    feed(&mut a.source_hash, b"ab", b"c");
    feed(&mut b.source_hash, b"a", b"bc");
    assert_ne!(a.source_digest(), b.source_digest());
    let (mut c, mut d) = (Counts::default(), Counts::default());
    feed(&mut c.source_hash, b"k", b"v");
    feed(&mut d.target_hash, b"k", b"v");
    assert_eq!(c.source_digest(), d.target_digest());
}

/// A missing or divergent key is repaired with the source's value whatever the scope; an
/// orphan only when the scope says so, and the scope sees its key and target mod revision.
#[test]
fn repairs_follow_the_orphan_scope() {
    let put = Some(Op::Put { key: b"k".to_vec(), value: b"v".to_vec(), lease: 0 });
    assert_eq!(Difference::Missing(entry("k", "v")).repair(|_, _| false), put);
    assert_eq!(Difference::Divergent(entry("k", "v")).repair(|_, _| false), put);
    let orphan = || Difference::Orphan { key: b"o".to_vec(), mod_revision: 7 };
    assert_eq!(orphan().repair(|k, rev| k == b"o" && rev == 7), Some(Op::Delete { key: b"o".to_vec() }));
    assert_eq!(orphan().repair(|_, rev| rev > 7), None);
}
