//! G6 in exact mode: what the agent holds of the source's revisions does not grow with how much
//! the seed's spool holds. Revisions received and not yet landed are held up to
//! `sync.watch_buffer_bytes`; the spool is read as they land. (A target frozen while the source
//! takes 200 MB: scenario `exact-frozen-target`, on 3.5.30 and 3.4.23.)

use std::time::Duration;

use harness::exact::{exact_config, SnapshotSave};
use harness::scenario::current_revision;
use harness::{load_keys, AgentProcess, EtcdVersion};

use super::{assert_exact, cluster};

/// Revisions of [`VALUE`] bytes the seed's spool takes: 200 MiB in all.
const REVISIONS: u32 = 800;
const VALUE: usize = 256 << 10;

/// The agent's peak RSS bound: 64 MiB beside twice `watch_buffer_bytes` (16 MiB), as compact
/// mode's catch-up (tests/big_values.rs).
const BOUND: u64 = (64 << 20) + 2 * (16 << 20);

/// Writes [`REVISIONS`] puts of [`VALUE`] bytes over 10 keys (each a revision of its own; the
/// keyspace stays readable in one response).
async fn large_revisions(src: &mut etcd_client::Client, prefix: &str) {
    for i in 0..REVISIONS {
        let value = vec![b'a' + (i % 26) as u8; VALUE];
        src.put(format!("{prefix}k-{:02}", i % 10), value, None).await.unwrap();
    }
}

fn peak_within_bound(agent: &AgentProcess, when: &str) {
    let peak = agent.peak_rss_bytes().expect("VmHWM from /proc");
    println!("{when}: peak RSS {} MiB (bound {} MiB)", peak >> 20, BOUND >> 20);
    assert!(peak < BOUND, "{when}: peak RSS {} MiB over {} MiB\n{}", peak >> 20, BOUND >> 20, agent.log());
}

/// A seed whose spool holds 200 MiB of revisions the source compacted before the link ran:
/// the tail reads the spool as revisions land, not all of it at once.
#[tokio::test]
async fn a_large_spool_is_replayed_within_the_bound() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 20, 16).await.unwrap();
    let config = exact_config(&source, &target, "k8s-dr");
    let save = SnapshotSave::start(&config).await.unwrap();
    large_revisions(&mut src, "/registry/configmaps/").await;
    // The source compacts only once `snapshot save` spooled every revision (it would fail).
    let spool = std::path::PathBuf::from(format!("{}.spool", save.file.display()));
    let spooled = async {
        while std::fs::metadata(&spool).map_or(0, |m| m.len()) < u64::from(REVISIONS) * VALUE as u64 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), spooled).await.expect("the spool holds every revision");
    let head = current_revision(&mut src).await.unwrap();
    src.compact(head, None).await.unwrap();
    target.restore_snapshot_file(&save.file).await.unwrap();
    let config = config.overlay(&format!("[sync]\nexact_seed = {:?}", save.file.display().to_string()));
    let agent = AgentProcess::start(&config).await.unwrap();
    let mut dst = target.client().await.unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the spool").await;
    peak_within_bound(&agent, "the spool replayed");
    drop(save);
}
