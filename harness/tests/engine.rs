//! The replication engine against real etcd, driven through the `mirror-agent` binary.

use std::time::Duration;

use etcd_client::{Client, GetOptions};
use harness::{check_g3, load_keys, AgentConfig, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion, G3};
use mirror_core::Phase;

const SYNC_TIMEOUT: Duration = Duration::from_secs(120);

struct Pair {
    source: EtcdCluster,
    target: EtcdCluster,
}

impl Pair {
    async fn start(source: EtcdVersion, target: EtcdVersion) -> Pair {
        Pair {
            source: EtcdCluster::start(ClusterSpec::new(source)).await.unwrap(),
            target: EtcdCluster::start(ClusterSpec::new(target)).await.unwrap(),
        }
    }

    fn config(&self, link: &str, prefix: &str) -> AgentConfig {
        AgentConfig::new(link, self.source.endpoints(), self.target.endpoints(), prefix)
    }

    async fn clients(&self) -> (Client, Client) {
        (self.source.client().await.unwrap(), self.target.client().await.unwrap())
    }
}

async fn g3(pair: &Pair, cfg: &AgentConfig) -> anyhow::Result<G3> {
    let parsed = cfg.parsed()?;
    let (mut s, mut t) = pair.clients().await;
    check_g3(&mut s, &mut t, &parsed.rewriter(), &parsed.checkpoint_key()).await
}

async fn synced(agent: &AgentProcess) -> mirror_core::Status {
    agent
        .wait_for("InitialSyncComplete", SYNC_TIMEOUT, |s| {
            s.phase == Phase::Syncing && s.condition("InitialSyncComplete")
        })
        .await
        .unwrap()
}

async fn count(client: &mut Client, prefix: &str) -> i64 {
    client.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await.unwrap().count()
}

/// Cold start: 50k keys land, the watermark equals R0, and the only extra target key is the
/// reserved checkpoint.
#[tokio::test]
async fn cold_start_lands_every_key() {
    let pair = Pair::start(EtcdVersion::V3_5_1, EtcdVersion::V3_5_1).await;
    let (mut src, mut dst) = pair.clients().await;
    let r0 = load_keys(&mut src, "/reg/", 50_000, 32).await.unwrap();
    let cfg = pair.config("cold", "/reg/");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    let status = synced(&agent).await;
    assert_eq!(status.watermark, r0, "watermark must equal R0 on an idle source");
    assert_eq!(status.initial_sync.total_keys, 50_000);
    assert_eq!(count(&mut dst, "/reg/").await, 50_001, "50k keys plus the checkpoint");
    let cp = cfg.parsed().unwrap().checkpoint_key();
    let stored = dst.get(cp, None).await.unwrap();
    let record = mirror_fence::Checkpoint::decode(stored.kvs()[0].value()).unwrap();
    assert_eq!(record.watermark, r0);
    assert!(!record.scanning);
    assert_eq!(g3(&pair, &cfg).await.unwrap(), G3::Holds { watermark: r0, keys: 50_000 });
}
