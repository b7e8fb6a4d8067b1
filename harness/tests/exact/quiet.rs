//! An exact link's `/metrics` against the shipped alert rules (deploy/prometheus/alerts.yaml):
//! two healthy HA replicas, one landing revisions and one standing by, held for 13 hours, trip
//! none (`tests/metrics.rs` holds compact links to the same; `tests/alerts.rs` provokes each).

use harness::exact::{exact_config, seed};
use harness::promtool::{every_rule_quiet, Scrape};
use harness::scenario::{current_revision, SYNC_TIMEOUT};
use harness::{load_keys, AgentProcess, Churn, EtcdVersion};
use mirror_core::{AgentRole, ConditionType, Phase};

use super::{assert_exact, cluster};

#[tokio::test]
async fn healthy_exact_replicas_trip_no_alert() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 50, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr")
        .overlay("[reconcile]\ninterval = \"2s\"")
        .overlay("[ha]\nenabled = true");
    let agents = [AgentProcess::start(&cfg).await.unwrap(), AgentProcess::start(&cfg).await.unwrap()];
    let mut dst = target.client().await.unwrap();
    Churn::new("/registry/configmaps/", 300, 300, 50).spawn(src.clone()).await.unwrap().unwrap();
    assert_exact(&agents[0], &mut src, &mut dst, "after the churn").await;
    let head = current_revision(&mut src).await.unwrap();
    let mut scrapes = Vec::new();
    let mut roles = Vec::new();
    for (i, agent) in agents.iter().enumerate() {
        let healthy = agent
            .wait_for("caught up, synced, a clean pass", SYNC_TIMEOUT, |s| {
                s.phase == Phase::Syncing
                    && s.watermark == head
                    && s.condition(ConditionType::InitialSyncComplete)
                    && s.condition(ConditionType::InvariantsHeld)
                    && s.last_reconcile.is_some()
            })
            .await
            .unwrap_or_else(|e| panic!("replica {i}: {e}\n{}", agent.log()));
        roles.push(healthy.role);
        let text = reqwest::get(format!("{}/metrics", agent.url())).await.unwrap().text().await.unwrap();
        scrapes.push(Scrape::now(&format!("exact-{i}:9100"), text));
    }
    assert!(roles.contains(&AgentRole::Standby), "one replica stands by while the other lands: {roles:?}");

    every_rule_quiet(&scrapes).unwrap();
}
