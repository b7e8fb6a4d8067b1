//! Progress notifications on servers without etcd's fix (3.4 < 3.4.25, 3.5 < 3.5.8) can
//! overtake events already queued for the watcher. This is the server behaviour the engine's
//! completion rule (`mirror-agent` crate doc, "Why genesis completion does not rest on a
//! progress reply") is built around; the agent-level reproduction of the data loss it caused is
//! `harness/tests/engine_progress.rs`.
//!
//! Both versions we run predate the fix, so on both a watcher that stopped reading during a
//! burst gets a progress reply whose header is at or past revisions whose events it has not yet
//! received.

use etcd_client::{EventType, GetOptions, WatchOptions};
use harness::{ClusterSpec, EtcdCluster, EtcdVersion};
use rstest::rstest;

/// Events of revisions at or below the first progress reply's header that arrived only after
/// that reply: on an unfixed server, the reply overtakes them.
async fn events_overtaken_by_progress(version: EtcdVersion) -> (usize, i64, i64) {
    let cluster = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let mut client = cluster.client().await.unwrap();
    let (mut watcher, mut stream) =
        client.watch("/burst/", Some(WatchOptions::new().with_prefix())).await.unwrap().split();
    // A burst large enough to fill the gRPC window and the server's watcher channel while
    // nobody reads the stream (the watcher becomes a "victim" server-side).
    let value = vec![b'x'; 1024];
    for i in 0..3_000 {
        client.put(format!("/burst/{i:05}"), value.clone(), None).await.unwrap();
    }
    let end = client.get("/", Some(GetOptions::new().with_count_only())).await.unwrap();
    let end = end.header().unwrap().revision();
    watcher.request_progress().await.unwrap();

    let mut highest_event = 0;
    let mut progress_at = None;
    let mut overtaken = 0;
    while highest_event < end {
        let resp = stream.message().await.unwrap().expect("watch stream open");
        if resp.created() {
            continue;
        }
        if resp.events().is_empty() {
            let header = resp.header().unwrap().revision();
            if progress_at.is_none() && header >= end {
                progress_at = Some((header, highest_event));
            }
            continue;
        }
        for ev in resp.events() {
            assert_eq!(ev.event_type(), EventType::Put);
            let rev = ev.kv().unwrap().mod_revision();
            if progress_at.is_some_and(|(header, _)| rev <= header) {
                overtaken += 1;
            }
            highest_event = highest_event.max(rev);
        }
    }
    let (header, delivered_before) = progress_at.expect("a progress reply arrived");
    (overtaken, header, delivered_before)
}

/// The reply to a progress request reaches a slow watcher before events of revisions it
/// covers. A client that took such a reply as "everything up to here was delivered" would drop
/// those events as already applied.
#[rstest]
#[case::v3_5_1(EtcdVersion::V3_5_1)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn progress_reply_overtakes_queued_events(#[case] version: EtcdVersion) {
    let (overtaken, header, delivered_before) = events_overtaken_by_progress(version).await;
    eprintln!(
        "{version}: progress reply at header {header} arrived when events up to {delivered_before} had been \
         delivered; {overtaken} events at or below the header came after it"
    );
    assert!(
        overtaken > 0,
        "{version}: expected the unfixed server's progress reply to overtake queued events"
    );
}
