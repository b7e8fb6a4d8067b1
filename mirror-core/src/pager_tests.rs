use std::time::Duration;

use super::*;
use crate::keys::KeyRewriter;
use crate::testing::lazy_kv;

fn opts(key_limit: i64, page_bytes: usize) -> PagerOptions {
    PagerOptions::new("test page", key_limit, page_bytes, Duration::from_secs(1))
}

/// The first page asks for few keys, so a range of large values never starts with a huge
/// answer; a small key limit wins.
#[tokio::test]
async fn starts_small() {
    let windows = KeyRewriter::new(b"/a/", b"/a/", []).scan_windows();
    assert_eq!(
        Pager::new(lazy_kv().await, Side::Source, windows.clone(), opts(512, 1 << 20)).limit(),
        START_LIMIT
    );
    assert_eq!(Pager::new(lazy_kv().await, Side::Source, windows, opts(4, 1 << 20)).limit(), 4);
}

/// Pages over `page_bytes` halve the limit (never below 1); pages under half of it double it
/// up to `key_limit`.
#[tokio::test]
async fn adapts_to_bytes() {
    let windows = KeyRewriter::new(b"/a/", b"/a/", []).scan_windows();
    let mut p = Pager::new(lazy_kv().await, Side::Source, windows, opts(64, 1000));
    p.adapt(100);
    p.adapt(100);
    assert_eq!(p.limit(), 64, "doubled from 16 and capped at 64");
    p.adapt(5000);
    assert_eq!(p.limit(), 32);
    for _ in 0..10 {
        p.adapt(5000);
    }
    assert_eq!(p.limit(), 1, "a single huge value still reads, one key at a time");
    p.adapt(700);
    assert_eq!(p.limit(), 1, "between half and full page: unchanged");
}

/// Resuming after a cursor continues strictly after it, in the window holding it; a cursor at
/// the end of a window moves to the next window (excludes cut the range into windows).
#[tokio::test]
async fn resumes_strictly_after_the_cursor_across_windows() {
    let rewriter = KeyRewriter::new(b"/a/", b"/a/", [&b"m/"[..]]);
    let windows = rewriter.scan_windows();
    assert!(windows.len() >= 2, "{windows:?}");
    let p =
        Pager::new(lazy_kv().await, Side::Source, windows.clone(), opts(16, 1 << 20)).resume_after(b"/a/c");
    assert_eq!((p.window, p.next_key.as_slice()), (0, &b"/a/c\0"[..]));
    assert_eq!(p.windows, windows_after(&windows, b"/a/c"), "what is left of the windows");
    // A cursor inside the excluded prefix resumes at the start of the window after it.
    let p = Pager::new(lazy_kv().await, Side::Source, windows.clone(), opts(16, 1 << 20))
        .resume_after(b"/a/m/zz");
    let after = windows.iter().position(|w| w.contains(b"/a/n")).expect("in some window");
    assert_eq!(p.next_key, windows[after].start);
    assert_eq!(p.windows, windows[after..]);
    let p = Pager::new(lazy_kv().await, Side::Source, windows, opts(16, 1 << 20)).resume_after(b"");
    assert_eq!((p.window, p.next_key.as_slice()), (0, &b"/a/"[..]));
}
