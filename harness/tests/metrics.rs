//! `/metrics` of a running agent: the exported families (snapshot) and the alert rules and
//! dashboard shipped in deploy/ referring only to names that exist.

use std::collections::BTreeSet;

use harness::scenario;
use harness::{load_keys, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion};

async fn scrape(agent: &AgentProcess) -> String {
    reqwest::get(format!("{}/metrics", agent.url())).await.unwrap().text().await.unwrap()
}

/// Every `etcd_mirror_…` name in `text`.
fn referenced_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("etcd_mirror_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

/// The families and their types, and that the alert rules and dashboard use only those names.
#[tokio::test]
async fn metric_families_are_stable_and_deploy_files_match() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/met/", 300, 8).await.unwrap();
    let cfg = scenario::fast_config(&source, &target, "metrics", "/met/");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&agent).await.unwrap();
    src.put("/met/live", "1", None).await.unwrap();
    let status = scenario::caught_up(&agent, &mut src).await.unwrap();

    let text = scrape(&agent).await;
    let types = |text: &str| -> BTreeSet<String> {
        text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).map(str::to_owned).collect()
    };
    let families: Vec<String> = types(&text).into_iter().collect();
    // Without [ha]: no ha_leader (EtcdMirrorNoHALeader would page every such deployment).
    insta::assert_snapshot!("metric_families", families.join("\n"));

    // Values agree with /statusz.
    assert!(text.contains(&format!("etcd_mirror_watermark {}", status.watermark)), "{text}");
    assert!(text.contains("etcd_mirror_phase{phase=\"syncing\"} 1"), "{text}");
    assert!(text.contains("etcd_mirror_apply_latency_seconds_count"), "{text}");

    // With [ha]: the same families and ha_leader, 1 on the leader.
    let mut agent = agent;
    agent.terminate().await.unwrap();
    let ha = cfg.clone().overlay("[ha]\nenabled = true\nlease_ttl = \"2s\"");
    let agent = AgentProcess::start(&ha).await.unwrap();
    agent
        .wait_for("leading", scenario::SYNC_TIMEOUT, |s| s.ha.as_ref().is_some_and(|h| h.leader))
        .await
        .unwrap();
    let ha_text = scrape(&agent).await;
    let with_ha: Vec<String> = types(&ha_text).into_iter().collect();
    let only_with_ha: Vec<&String> = with_ha.iter().filter(|f| !families.contains(f)).collect();
    assert_eq!(only_with_ha, [&"etcd_mirror_ha_leader gauge".to_owned()], "{ha_text}");
    assert!(ha_text.contains("etcd_mirror_ha_leader 1"), "{ha_text}");

    let mut valid = BTreeSet::new();
    for f in &with_ha {
        let name = f.split_whitespace().next().unwrap();
        for suffix in ["", "_total", "_bucket", "_sum", "_count", "_created"] {
            valid.insert(format!("{name}{suffix}"));
        }
    }
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
    for file in ["prometheus/alerts.yaml", "grafana/dashboard.json"] {
        let text = std::fs::read_to_string(format!("{root}/{file}")).unwrap();
        let used = referenced_names(&text);
        assert!(!used.is_empty(), "{file} references no metric");
        let unknown: Vec<_> = used.difference(&valid).collect();
        assert!(unknown.is_empty(), "{file} references metrics the agent does not export: {unknown:?}");
    }
}
