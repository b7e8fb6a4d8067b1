//! The alert rules shipped in deploy/prometheus: valid, and each one provoked by
//! `alerts.test.yaml` under `promtool test rules`. That each stays quiet on healthy agents is
//! shown from real scrapes in metrics.rs.

use std::collections::BTreeSet;
use std::path::Path;

use harness::promtool::{alert_names, alert_rules, promtool};

fn rules_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/prometheus"))
}

/// The alerts that some `alert_rule_test` of a promtool test file expects to fire.
fn provoked(tests: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut current: Option<String> = None;
    for line in tests.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("alertname:") {
            current = Some(name.trim().to_owned());
        } else if let Some(rest) = line.strip_prefix("exp_alerts:") {
            if rest.trim() != "[]" {
                out.extend(current.take());
            }
        }
    }
    out
}

#[test]
fn rules_are_valid() {
    let out = promtool(rules_dir(), &["check", "rules", "alerts.yaml"]).unwrap();
    assert!(out.contains("SUCCESS"), "{out}");
}

#[test]
fn every_rule_is_provoked_by_its_unit_test() {
    let rules = std::fs::read_to_string(alert_rules()).unwrap();
    let tests = std::fs::read_to_string(rules_dir().join("alerts.test.yaml")).unwrap();
    let names = alert_names(&rules);
    assert!(names.len() >= 20, "alert names not found in alerts.yaml: {names:?}");
    let provoked = provoked(&tests);
    let unprovoked: Vec<&String> = names.iter().filter(|n| !provoked.contains(*n)).collect();
    assert!(unprovoked.is_empty(), "alerts.test.yaml never makes these fire: {unprovoked:?}");

    let out = promtool(rules_dir(), &["test", "rules", "alerts.test.yaml"]).unwrap();
    assert!(out.contains("SUCCESS"), "{out}");
}

/// The checker above would pass a test file that expects nothing: it must see an expectation.
#[test]
fn an_empty_expectation_does_not_count_as_provoked() {
    let tests = "alertname: A\n  exp_alerts: []\nalertname: B\n  exp_alerts:\n   - exp_labels: {}\n";
    assert_eq!(provoked(tests), BTreeSet::from(["B".to_owned()]));
}
