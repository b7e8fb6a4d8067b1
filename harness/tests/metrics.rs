//! `/metrics` of a running agent: the exported families (snapshot), the alert rules and
//! dashboard shipped in deploy/ referring only to names that exist, the `/statusz` key set
//! (snapshot), and every alert rule quiet on the samples of healthy agents (alerts.rs provokes
//! each one).

use std::collections::BTreeSet;

use harness::promtool::{every_rule_quiet, Scrape};
use harness::scenario;
use harness::{load_keys, AgentProcess, ClusterSpec, EtcdCluster, EtcdVersion};

async fn scrape(agent: &AgentProcess) -> String {
    agent.metrics().await.unwrap().text().to_owned()
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

/// Every key path of `value`, `a.b` for objects and `a[].b` for array elements, sorted, once.
fn key_paths(value: &serde_json::Value) -> Vec<String> {
    fn walk(value: &serde_json::Value, at: &str, out: &mut BTreeSet<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, inner) in map {
                    let path = if at.is_empty() { key.clone() } else { format!("{at}.{key}") };
                    out.insert(path.clone());
                    walk(inner, &path, out);
                }
            }
            serde_json::Value::Array(items) => {
                for item in items {
                    walk(item, &format!("{at}[]"), out);
                }
            }
            _ => {}
        }
    }
    let mut out = BTreeSet::new();
    walk(value, "", &mut out);
    out.into_iter().collect()
}

/// The families and their types, that the alert rules and dashboard use only those names, and
/// that no alert fires on a healthy plain link, HA leader or HA standby held for 13 hours; the
/// content types of `/statusz` and `/metrics`, both `no-store`.
#[tokio::test]
async fn metric_families_are_stable_and_deploy_files_match() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let target = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/met/", 300, 8).await.unwrap();
    // A healthy link has completed a reconcile pass (EtcdMirrorNeverReconciled says otherwise).
    let cfg =
        scenario::fast_config(&source, &target, "metrics", "/met/").with("[reconcile]\ninterval = \"2s\"");
    let agent = AgentProcess::start(&cfg).await.unwrap();
    scenario::synced(&agent).await.unwrap();
    src.put("/met/live", "1", None).await.unwrap();
    scenario::caught_up(&agent, &mut src).await.unwrap();
    let status = agent
        .wait_for("a reconcile pass", scenario::SYNC_TIMEOUT, |s| {
            s.last_reconcile.as_ref().is_some_and(|r| r.time.is_some())
        })
        .await
        .unwrap();

    // Both documents are fresh on every read: JSON and OpenMetrics, never cached.
    for (path, kind) in [("/statusz", "application/json"), ("/metrics", "application/openmetrics-text")] {
        let resp = reqwest::get(format!("{}{path}", agent.url())).await.unwrap();
        let header =
            |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        assert!(header("content-type").starts_with(kind), "{path}: {:?}", resp.headers());
        assert_eq!(header("cache-control"), "no-store", "{path}");
    }
    // The /statusz key set of a healthy plain link (SPEC §7 names are public interface).
    let json: serde_json::Value =
        reqwest::get(format!("{}/statusz", agent.url())).await.unwrap().json().await.unwrap();
    insta::assert_snapshot!("statusz_keys", key_paths(&json).join("\n"));
    let text = scrape(&agent).await;
    let mut healthy = vec![Scrape::now("plain:9100", text.clone())];
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
        .wait_for("leading, a reconcile pass done", scenario::SYNC_TIMEOUT, |s| {
            s.ha.as_ref().is_some_and(|h| h.leader)
                && s.last_reconcile.as_ref().is_some_and(|r| r.time.is_some())
        })
        .await
        .unwrap();
    let ha_text = scrape(&agent).await;
    let with_ha: Vec<String> = types(&ha_text).into_iter().collect();
    let only_with_ha: Vec<&String> = with_ha.iter().filter(|f| !families.contains(f)).collect();
    assert_eq!(only_with_ha, [&"etcd_mirror_ha_leader gauge".to_owned()], "{ha_text}");
    // Labelled with the link, so EtcdMirrorNoHALeader groups the replicas of each link.
    let leader_line = |v: u8| format!("etcd_mirror_ha_leader{{link_uid=\"{}\"}} {v}", status.link_uid);
    assert!(ha_text.contains(&leader_line(1)), "{ha_text}");
    healthy.push(Scrape::now("leader:9100", ha_text.clone()));
    let standby = AgentProcess::start(&ha).await.unwrap();
    standby
        .wait_for("standing by", scenario::SYNC_TIMEOUT, |s| s.ha.as_ref().is_some_and(|h| !h.leader))
        .await
        .unwrap();
    let standby_text = scrape(&standby).await;
    assert!(standby_text.contains(&leader_line(0)), "{standby_text}");
    healthy.push(Scrape::now("standby:9100", standby_text));

    every_rule_quiet(&healthy).unwrap();

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
