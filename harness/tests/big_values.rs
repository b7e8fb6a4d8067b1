//! Values of 200 KiB: 150 of them are 30 MB, far over gRPC's default 4 MiB answer. Before the
//! byte-aware pager the first scan page was refused by the client and classed permanent; the
//! reconcile, verify and drain readers had no byte adaptation at all, and repair batches could
//! pass the target's request limit.

use mirror_core::Reason;
use std::time::Duration;

use etcd_client::Client;
use harness::scenario::{self, caught_up, synced};
use harness::{agent_command, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion, G3};
use rstest::rstest;

const VALUE: usize = 200 << 10;

fn value(i: usize, salt: u8) -> Vec<u8> {
    let mut v = vec![b'a' + (i % 26) as u8; VALUE];
    v[0] = salt;
    v
}

async fn put_big(client: &mut Client, prefix: &str, n: usize, salt: u8) {
    for i in 0..n {
        client.put(format!("{prefix}{i:04}"), value(i, salt), None).await.unwrap();
    }
}

#[rstest]
#[case::v3_5_30(EtcdVersion::V3_5_30)]
#[case::v3_5_1(EtcdVersion::V3_5_1)]
#[case::v3_4_23(EtcdVersion::V3_4_23)]
#[tokio::test]
async fn large_values_sync_reconcile_verify_and_cut_over(#[case] version: EtcdVersion) {
    let source = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let (mut src, mut dst) = (source.client().await.unwrap(), target.client().await.unwrap());
    put_big(&mut src, "/blob/", 150, b'0').await;

    let cfg =
        scenario::fast_config(&source, &target, "blobs", "/blob/").with("[reconcile]\ninterval = \"2s\"");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await.unwrap();
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 150, .. }));

    // Live: a few more large puts, one source Txn of five (1 MB).
    let ops: Vec<etcd_client::TxnOp> =
        (0..5).map(|i| etcd_client::TxnOp::put(format!("/blob/txn-{i}"), value(i, b'1'), None)).collect();
    src.txn(etcd_client::Txn::new().and_then(ops)).await.unwrap();
    caught_up(&agent, &mut src).await.unwrap();

    // Divergent values written behind the agent's back; the periodic passes repair them. 40
    // puts of 200 KiB may outlast the 2 s interval on a loaded machine, so a pass can run while
    // they are written: the passes seen (each read once, a pass is at least 2 s from the next)
    // add up to 40 divergent keys found and 40 repaired.
    put_big(&mut dst, "/blob/", 40, b'X').await;
    // Each pass by when it ended and how long it took: (divergent, repaired).
    let passes = std::cell::RefCell::new(std::collections::BTreeMap::new());
    let status = agent
        .wait_for("reconcile passes that repaired 40 divergent keys", Duration::from_secs(60), |s| {
            let Some(r) = &s.last_reconcile else { return false };
            let mut passes = passes.borrow_mut();
            passes.insert((r.time.clone(), r.duration_seconds.to_bits()), (r.divergent, r.repaired));
            let divergent: u64 = passes.values().map(|p| p.0).sum();
            let repaired: u64 = passes.values().map(|p| p.1).sum();
            divergent == 40 && repaired == 40
        })
        .await
        .unwrap();
    assert!(status.last_error.is_none(), "{:?}", status.last_error);
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 155, .. }));

    let out = agent_command(&cfg, "verify", &[]).await.unwrap();
    assert!(
        out.status.success(),
        "verify: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let out = agent_command(&cfg, "cutover", &["--wait"]).await.unwrap();
    assert!(
        out.status.success(),
        "cutover: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let status = agent.status().await.unwrap();
    assert!(
        status.last_error.as_ref().is_none_or(|e| e.class != mirror_core::ErrorClass::Permanent),
        "{:?}",
        status.last_error
    );
}

/// Issue #20 defect 5: a value the source accepted under the same `--max-request-bytes` (64 KiB
/// on both sides) no longer fits beside the checkpoint put. In the scan (the value sits among
/// 300 others, so it lands in the middle of a chunk) and in the tail it is written alone, the
/// checkpoint following; the target ends equal. Before, the scan failed with a permanent error
/// naming no key, or only when the value fell in the last chunk of a scan span, and the tail stopped
/// with RevisionTooLarge.
#[tokio::test]
async fn a_value_at_the_request_limit_is_mirrored_in_scan_and_tail() {
    let version = EtcdVersion::V3_5_30;
    let limit = "--max-request-bytes=65536";
    let source = EtcdCluster::start(ClusterSpec::new(version).arg(limit)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(version).arg(limit)).await.unwrap();
    let (mut src, mut dst) = (source.client().await.unwrap(), target.client().await.unwrap());
    let near_limit = |salt: u8| vec![b'a' + salt; 65_300];
    for i in 0..300 {
        src.put(format!("/lim/k-{i:03}"), format!("small-{i}"), None).await.unwrap();
    }
    src.put("/lim/k-150-big", near_limit(0), None).await.expect("the source takes it");
    let cfg = scenario::fast_config(&source, &target, "limit", "/lim/");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await.unwrap();
    src.put("/lim/k-200-big", near_limit(1), None).await.expect("the source takes it");
    caught_up(&agent, &mut src).await.unwrap();
    for key in ["/lim/k-150-big", "/lim/k-200-big"] {
        let got = dst.get(key, None).await.unwrap();
        assert_eq!(got.kvs().first().map(|kv| kv.value().len()), Some(65_300), "{key}");
    }
    let status = agent.status().await.unwrap();
    assert!(status.last_error.is_none(), "{:?}", status.last_error);
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 302, .. }));
    assert!(agent.log().contains("written alone, the checkpoint follows"));
}

/// Issue #20 defect 5, the truly unfittable case: a 100 KB value against a target limited to
/// 64 KiB (the source has etcd's default 1.5 MiB) is a permanent ValueTooLarge in the scan and
/// RevisionTooLarge in the tail, each naming the key, its size and the flag to raise.
#[tokio::test]
async fn a_value_over_the_targets_limit_names_key_size_and_flag() {
    let version = EtcdVersion::V3_5_30;
    let source = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let target =
        EtcdCluster::start(ClusterSpec::new(version).arg("--max-request-bytes=65536")).await.unwrap();
    let mut src = source.client().await.unwrap();
    for i in 0..100 {
        src.put(format!("/over/k-{i:03}"), "small", None).await.unwrap();
    }
    src.put("/over/k-050-huge", vec![b'x'; 100_000], None).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "over", "/over/");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = agent
        .wait_for("failed", Duration::from_secs(60), |s| s.phase == mirror_core::Phase::Failed)
        .await
        .unwrap();
    let error = status.last_error.expect("a last_error");
    assert_eq!(error.reason, Reason::ValueTooLarge, "{error:?}");
    // The key is redacted to its prefix and a digest; the size counts key, value and overhead.
    for part in ["key /over/", "100032 bytes", "--max-request-bytes"] {
        assert!(error.message.contains(part), "{part:?} missing from {:?}", error.message);
    }
}

/// Issue #20 defect 6: a catch-up of 2 000 revisions of 200 KiB (the agent was down while they
/// were written) stays within G6. etcd bundles up to 1 000 revisions into one catch-up response
/// (200 MB here), which the agent used to decode whole; the watch asks for fragments now, so
/// no response is larger than the source's request limit. Peak RSS of the restarted agent
/// stays under 64 MiB + 2 x watch_buffer_bytes (16 MiB), and the target ends equal.
#[tokio::test]
async fn a_catch_up_of_large_values_stays_within_the_memory_bound() {
    let version = EtcdVersion::V3_5_30;
    let source = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(version)).await.unwrap();
    let mut src = source.client().await.unwrap();
    src.put("/cu/first", "v", None).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "catch-up", "/cu/");
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await.unwrap();
    assert_eq!(agent.terminate().await.unwrap(), Some(0));

    for i in 0..2_000u32 {
        let value = vec![b'a' + (i % 26) as u8; 200 << 10];
        src.put(format!("/cu/k-{:02}", i % 50), value, None).await.unwrap();
    }
    let agent = AgentProcess::start(&cfg).await.unwrap();
    caught_up(&agent, &mut src).await.unwrap();
    let peak = agent.peak_rss_bytes().expect("VmHWM from /proc");
    let bound = (64u64 << 20) + 2 * (16u64 << 20);
    println!("peak RSS {} MiB during a catch-up of 2 000 x 200 KiB (bound {} MiB)", peak >> 20, bound >> 20);
    assert!(peak < bound, "peak RSS {} MiB over {} MiB", peak >> 20, bound >> 20);
    assert!(matches!(scenario::g3_of(&source, &target, &cfg).await.unwrap(), G3::Holds { keys: 51, .. }));
}
