use proptest::prelude::*;

use super::*;

fn rewriter() -> KeyRewriter {
    KeyRewriter::new(b"/registry/", b"/dr/", [&b"events/"[..], b"leases/", b"events/x/"])
}

/// The anchored formula replaces only the leading prefix, never a later occurrence.
#[test]
fn rewrite_is_anchored() {
    let r = KeyRewriter::new(b"/a/", b"/b/", []);
    assert_eq!(r.to_target(b"/a/x/a/y").unwrap(), b"/b/x/a/y".to_vec());
    assert_eq!(r.to_target(b"/ab"), None);
    assert_eq!(r.to_source(b"/b/x/a/y").unwrap(), b"/a/x/a/y".to_vec());
}

/// prefix_end follows etcd: increment the last byte below 0xff; all-0xff and empty are unbounded.
#[test]
fn prefix_end_matches_etcd() {
    assert_eq!(prefix_end(b"/a/"), b"/a0".to_vec());
    assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
    assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    assert_eq!(prefix_end(b""), vec![0]);
}

/// Nested and duplicate excludes collapse; the source reserved namespace is always excluded.
#[test]
fn excludes_are_normalised() {
    let r = rewriter();
    let ex: Vec<&[u8]> = r.excludes().iter().map(Vec::as_slice).collect();
    assert_eq!(ex, [&b"/registry/\0etcd-mirror/"[..], b"/registry/events/", b"/registry/leases/"]);
}

/// Scan windows are the source range minus each excluded prefix, in key order.
#[test]
fn scan_windows_cut_out_excludes() {
    let w = rewriter().scan_windows();
    let pairs: Vec<(&[u8], &[u8])> = w.iter().map(|r| (r.start.as_slice(), r.end.as_slice())).collect();
    assert_eq!(
        pairs,
        [
            (&b"/registry/"[..], &b"/registry/\0etcd-mirror/"[..]),
            (b"/registry/\0etcd-mirror0", b"/registry/events/"),
            (b"/registry/events0", b"/registry/leases/"),
            (b"/registry/leases0", b"/registry0"),
        ]
    );
}

/// An empty source prefix scans the whole keyspace, still minus its reserved namespace.
#[test]
fn whole_keyspace_windows() {
    let r = KeyRewriter::new(b"", b"/copy/", []);
    let w = r.scan_windows();
    assert_eq!(w.len(), 2);
    assert_eq!(w[0], KeyRange { start: vec![0], end: b"\0etcd-mirror/".to_vec() });
    assert_eq!(w[1], KeyRange { start: b"\0etcd-mirror0".to_vec(), end: vec![0] });
    assert!(w[1].contains(b"zzz"));
}

/// Target windows exclude exactly the reserved namespace.
#[test]
fn target_windows_skip_reserved() {
    let r = rewriter();
    let w = r.target_windows();
    assert!(w.iter().any(|w| w.contains(b"/dr/pods/a")));
    assert!(!w.iter().any(|w| w.contains(&r.default_checkpoint_key())));
    assert!(r.is_reserved(&r.default_checkpoint_key()));
    assert!(r.election_prefix().starts_with(&r.reserved_prefix()));
}

/// Redaction keeps the configured prefix, hides the rest, and is stable.
#[test]
fn redaction_hides_the_key() {
    let r = rewriter();
    let red = r.redact(b"/registry/secrets/db-password");
    assert!(red.starts_with("/registry/…"), "{red}");
    assert!(!red.contains("secrets"), "{red}");
    assert_eq!(red.len(), "/registry/…".len() + 8);
    assert_eq!(red, r.redact(b"/registry/secrets/db-password"));
}

/// Keys built from fragments that make collisions and reserved look-alikes likely.
fn key_strategy() -> impl Strategy<Value = Vec<u8>> {
    let frag = prop_oneof![
        Just(b"/registry/".to_vec()),
        Just(b"events/".to_vec()),
        Just(b"leases/".to_vec()),
        Just(b"\0etcd-mirror/".to_vec()),
        Just(b"\0".to_vec()),
        Just(b"x/".to_vec()),
        Just(b"/dr/".to_vec()),
        Just(vec![0xff]),
        any::<u8>().prop_map(|b| vec![b]),
    ];
    prop::collection::vec(frag, 0..6).prop_map(|parts| parts.concat())
}

/// The key after `k` is `k` and a zero byte: the empty key's successor is `[0]`, a key ending
/// in 0xff gets no carry (that is `prefix_end`'s job, a different bound).
#[test]
fn key_after_appends_a_zero_byte() {
    assert_eq!(key_after(b"/a/x"), b"/a/x\0".to_vec());
    assert_eq!(key_after(b""), vec![0]);
    assert_eq!(key_after(b"a\xff"), b"a\xff\0".to_vec());
    assert!(key_after(b"/a/") < prefix_end(b"/a/"));
}

proptest! {
    /// `key_after(k)` is the immediate successor of `k` in etcd's byte order: greater than `k`,
    /// and no key lies strictly between (every key above `k` is at or above it).
    #[test]
    fn key_after_is_the_immediate_successor(k in key_strategy(), other in key_strategy()) {
        let next = key_after(&k);
        prop_assert!(next > k);
        if other > k {
            prop_assert!(other >= next);
        }
        let longer = [&k[..], &other[..]].concat();
        if longer > k {
            prop_assert!(longer >= next, "a key extending k is at or after its successor");
        }
    }

    /// The scan's Get windows are exactly the keys in scope, for any set of excludes (nested,
    /// equal, adjacent, or covering the whole prefix): no window overlaps an excluded range and
    /// no in-scope key is left out. The windows are in key order and disjoint.
    #[test]
    fn scan_windows_are_exactly_the_keys_in_scope(
        excludes in prop::collection::vec(key_strategy(), 0..5),
        keys in prop::collection::vec(key_strategy(), 1..20),
    ) {
        let excludes: Vec<Vec<u8>> = excludes.iter().map(|e| [&b"/registry/"[..], e].concat()).collect();
        let r = KeyRewriter::new(b"/registry/", b"/dr/", excludes.iter().map(Vec::as_slice));
        let windows = r.scan_windows();
        for pair in windows.windows(2) {
            prop_assert!(pair[0].end <= pair[1].start, "disjoint and in order: {:?}", pair);
        }
        // The excludes' own keys too: the edge of every cut.
        let probes = keys.iter().chain(&excludes).flat_map(|k| [k.clone(), [&b"/registry/"[..], k].concat()]);
        for k in probes {
            let fetched = windows.iter().filter(|w| w.contains(&k)).count();
            prop_assert_eq!(fetched, usize::from(r.in_scope(&k)), "key {:?}", k);
        }
    }

    /// Distinct in-scope source keys never share a target key, and the inverse recovers them.
    #[test]
    fn rewrite_is_injective_on_scope(a in key_strategy(), b in key_strategy()) {
        let r = rewriter();
        let (a, b) = ([&b"/registry/"[..], &a].concat(), [&b"/registry/"[..], &b].concat());
        if let (Some(ta), Some(tb)) = (r.to_target(&a), r.to_target(&b)) {
            prop_assert_eq!(ta == tb, a == b);
            prop_assert_eq!(r.to_source(&ta), Some(a.clone()));
        }
    }

    /// No source key, in scope or not, is ever mapped into the reserved namespace.
    #[test]
    fn rewrite_never_yields_reserved(k in key_strategy()) {
        let r = rewriter();
        for key in [k.clone(), [&b"/registry/"[..], &k].concat()] {
            if let Some(t) = r.to_target(&key) {
                prop_assert!(!r.is_reserved(&t));
                prop_assert!(r.target_windows().iter().any(|w| w.contains(&t)));
            }
        }
    }

    /// A key under any excluded prefix is never mapped, and no scan window contains it.
    #[test]
    fn rewrite_never_maps_excluded(rest in key_strategy(), which in 0usize..3) {
        let r = rewriter();
        let ex = [&b"events/"[..], b"leases/", b"\0etcd-mirror/"][which];
        let key = [&b"/registry/"[..], ex, &rest].concat();
        prop_assert_eq!(r.to_target(&key), None);
        prop_assert!(!r.scan_windows().iter().any(|w| w.contains(&key)));
    }

    /// Scan windows contain exactly the in-scope keys.
    #[test]
    fn windows_agree_with_scope(k in key_strategy()) {
        let r = rewriter();
        let key = [&b"/registry/"[..], &k].concat();
        prop_assert_eq!(r.scan_windows().iter().any(|w| w.contains(&key)), r.in_scope(&key));
    }
}

/// Excludes map to the destination keys the link never writes (its own source reserved
/// namespace is not one): what a later nested link reads from the checkpoint to tell it does
/// not overlap.
#[test]
fn dest_excludes_are_the_excluded_prefixes_under_the_destination() {
    let r = KeyRewriter::new(b"/src/a/", b"/copy/", [&b"nested/"[..], &b"tmp/"[..]]);
    let mut got = r.dest_excludes();
    got.sort();
    assert_eq!(got, vec![b"/copy/nested/".to_vec(), b"/copy/tmp/".to_vec()]);
    assert!(KeyRewriter::new(b"/src/", b"/copy/", []).dest_excludes().is_empty());
}

/// A resumed scan reads (and counts) only what lies strictly after its cursor: windows that end
/// at or before it are gone, the one it falls in starts just after it, later ones are whole.
#[test]
fn windows_after_a_cursor_are_what_is_left_to_scan() {
    let windows = rewriter().scan_windows();
    assert_eq!(windows_after(&windows, b""), windows, "nothing scanned yet");
    // /registry/ minus the reserved namespace, events/ and leases/: four windows, the second
    // [/registry/\0etcd-mirror0, /registry/events/).
    assert_eq!(windows.len(), 4, "{windows:?}");
    let left = windows_after(&windows, b"/registry/apps");
    assert_eq!(left.len(), 3);
    assert_eq!(left[0], KeyRange { start: b"/registry/apps\0".to_vec(), end: windows[1].end.clone() });
    assert_eq!(left[1..], windows[2..]);
    // A cursor in an excluded gap (a record written before the exclude) resumes at the next
    // window, whole.
    assert_eq!(windows_after(&windows, b"/registry/events/x")[..], windows[2..]);
    assert!(windows_after(&windows, b"/registry0").is_empty(), "past the range: nothing left");
    // An unbounded window (the whole keyspace) is cut, never dropped.
    let all = [KeyRange::prefix(b"")];
    assert_eq!(windows_after(&all, b"\xff\xff"), [KeyRange { start: b"\xff\xff\0".to_vec(), end: vec![0] }]);
}

/// Upstream's TestEffectiveDestRangeOverlap: the overlap algebra of two links' destination
/// ranges (prefix, excludes), both ways round: nested, equal, disjoint, byte-adjacent, and an
/// inner range the outer excludes (exactly, or by a shorter exclude) or does not.
#[rstest::rstest]
#[case::disjoint("/a/", &[], "/b/", &[], false)]
#[case::equal("/a/", &[], "/a/", &[], true)]
#[case::equal_with_excludes("/a/", &["/a/x/"], "/a/", &["/a/y/"], true)]
#[case::nested("/a/", &[], "/a/b/", &[], true)]
#[case::nested_excluded_exactly("/a/", &["/a/b/"], "/a/b/", &[], false)]
#[case::nested_under_a_shorter_exclude("/a/", &["/a/b"], "/a/b/c/", &[], false)]
#[case::nested_exclude_elsewhere("/a/", &["/a/c/"], "/a/b/", &[], true)]
#[case::exclude_longer_than_the_inner("/a/", &["/a/b/c/"], "/a/b/", &[], true)]
#[case::inner_excludes_do_not_matter("/a/", &[], "/a/b/", &["/a/b/c/"], true)]
#[case::byte_adjacent_nest("/a", &[], "/ab", &[], true)]
#[case::siblings("/a/b", &[], "/a/c", &[], false)]
#[case::whole_keyspace("", &[], "/z/", &[], true)]
#[case::whole_keyspace_excluding("", &["/z/"], "/z/", &[], false)]
fn dest_range_overlap_algebra(
    #[case] a: &str,
    #[case] a_excludes: &[&str],
    #[case] b: &str,
    #[case] b_excludes: &[&str],
    #[case] overlap: bool,
) {
    let owned = |e: &[&str]| e.iter().map(|e| e.as_bytes().to_vec()).collect::<Vec<_>>();
    let (ea, eb) = (owned(a_excludes), owned(b_excludes));
    let a = crate::DestRange { prefix: a.as_bytes(), excludes: &ea };
    let b = crate::DestRange { prefix: b.as_bytes(), excludes: &eb };
    assert_eq!(a.overlaps(&b), overlap, "{a:?} vs {b:?}");
    assert_eq!(b.overlaps(&a), overlap, "symmetric: {b:?} vs {a:?}");
}
