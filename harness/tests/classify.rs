//! Error classification (mirror-core `Fault`) against answers provoked from real etcd of both
//! versions: the strings and codes are theirs, not copies in a unit test.

use std::time::Duration;

use etcd_client::{Client, GetOptions, Txn, TxnOp, WatchOptions};
use harness::{ClusterSpec, EtcdCluster, EtcdVersion};
use mirror_core::{ErrorClass, Fault};
use rstest::rstest;

fn fault_of(err: &etcd_client::Error) -> Fault {
    Fault::of(err)
}

/// Compacted read, future revision, too many ops, request too large (etcd's check and gRPC's
/// receive limit) and a compacted watch, each classified from the server's own answer.
#[rstest]
#[case::v3_5_1(EtcdVersion::V3_5_1)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn server_answers_map_to_classes(#[case] version: EtcdVersion) {
    let cluster = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let mut c: Client = cluster.client().await.unwrap();
    for i in 0..5 {
        c.put(format!("/c/{i}"), "v", None).await.unwrap();
    }
    let rev = c.get("/c/", Some(GetOptions::new().with_prefix())).await.unwrap().header().unwrap().revision();

    // Compacted read.
    c.compact(rev, None).await.unwrap();
    let err = c.get("/c/0", Some(GetOptions::new().with_revision(rev - 2))).await.unwrap_err();
    assert_eq!(fault_of(&err), Fault::Compacted, "{err}");
    assert_eq!(fault_of(&err).class(), ErrorClass::Resync);

    // Future revision.
    let err = c.get("/c/0", Some(GetOptions::new().with_revision(rev + 1000))).await.unwrap_err();
    assert_eq!(fault_of(&err), Fault::FutureRevision, "{err}");
    assert_eq!(fault_of(&err).class(), ErrorClass::Resync);

    // Too many ops (default --max-txn-ops is 128).
    let ops: Vec<TxnOp> = (0..129).map(|i| TxnOp::put(format!("/c/t{i}"), "v", None)).collect();
    let err = c.txn(Txn::new().and_then(ops)).await.unwrap_err();
    assert_eq!(fault_of(&err), Fault::TooManyOps, "{err}");
    assert!(fault_of(&err).is_txn_too_big());
    assert_eq!(fault_of(&err).class(), ErrorClass::Permanent);

    // Over --max-request-bytes (1.5 MiB) but under gRPC's receive limit: etcd's own check.
    let err = c.put("/c/big", vec![b'x'; 1_700_000], None).await.unwrap_err();
    assert_eq!(fault_of(&err), Fault::RequestTooLarge, "{err}");
    assert_eq!(fault_of(&err).class(), ErrorClass::Permanent);

    // Over gRPC's receive limit (max-request-bytes + 512 KiB): the transport refuses it.
    let err = c.put("/c/huge", vec![b'x'; 3 << 20], None).await.unwrap_err();
    assert_eq!(fault_of(&err), Fault::RequestTooLarge, "{err}");

    // Compacted watch: the server cancels it and reports the compact revision.
    let mut stream =
        c.watch("/c/", Some(WatchOptions::new().with_prefix().with_start_revision(rev - 2))).await.unwrap();
    // The first response may be the creation notice; the cancel follows it.
    let mut resp = None;
    for _ in 0..3 {
        let r = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("watch answered")
            .unwrap()
            .expect("a response");
        if r.canceled() || r.compact_revision() > 0 {
            resp = Some(r);
            break;
        }
    }
    let resp = resp.expect("a compacted watch is cancelled");
    assert!(resp.canceled(), "{resp:?}");
    let fault = Fault::of_watch_cancel(resp.compact_revision(), resp.cancel_reason());
    assert_eq!(fault, Fault::Compacted, "{resp:?}");
    assert_eq!(fault.class(), ErrorClass::Resync);
}

/// A tiny backend quota ends in "database space exceeded", classified as quota.
#[rstest]
#[case::v3_5_1(EtcdVersion::V3_5_1)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn quota_exceeded_is_quota(#[case] version: EtcdVersion) {
    let cluster =
        EtcdCluster::start(ClusterSpec::new(version).arg("--quota-backend-bytes=1048576")).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    let value = vec![b'q'; 100 * 1024];
    let mut seen = None;
    for i in 0..200 {
        if let Err(e) = c.put(format!("/q/{i}"), value.clone(), None).await {
            seen = Some(e);
            break;
        }
    }
    let err = seen.expect("a 1 MiB quota must fill within 20 MiB of writes");
    assert_eq!(fault_of(&err), Fault::QuotaExceeded, "{err}");
    assert_eq!(fault_of(&err).class(), ErrorClass::Quota);
}

/// A stopped server is transient, whether the client finds the connection refused or its
/// deadline passes.
#[tokio::test]
async fn server_down_is_transient() {
    let mut cluster = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_1)).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    c.put("/d/a", "1", None).await.unwrap();
    cluster.node(0).stop().await.unwrap();
    let err =
        mirror_core::unary("get", mirror_core::Side::Source, Duration::from_secs(5), c.get("/d/a", None))
            .await
            .unwrap_err();
    assert_eq!(err.class(), ErrorClass::Transient, "{err}");
}
