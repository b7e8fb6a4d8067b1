//! `docs/configuration.md` and `deploy/mirror.example.toml` against the config and status
//! types: every field is listed, nothing is listed that does not exist, and every default is
//! the one the code fills in. A field added, renamed or given another default fails here until
//! the reference says so.

use std::collections::{BTreeMap, BTreeSet};

use crate::condition::ConditionType;
use crate::config::Config;
use crate::error::ErrorClass;
use crate::reload::Applies;
use crate::status::{CutoverStatus, ExcludedKeys, HaStatus, LastError, LastReconcile, Status};
use crate::testing::MINIMAL_CONFIG;
use crate::tls::CertExpiry;

const REFERENCE: &str = include_str!("../../docs/configuration.md");
const EXAMPLE: &str = include_str!("../../deploy/mirror.example.toml");

/// The text of the reference between the `## ` heading starting with `from` and the next `## `.
fn section(from: &str) -> &'static str {
    let start = REFERENCE.find(&format!("\n## {from}")).unwrap_or_else(|| panic!("no section {from}"));
    let rest = &REFERENCE[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |i| i + 3);
    &rest[..end]
}

/// The table rows of a section whose first cell names fields: (names in that cell, cells).
fn rows(text: &str) -> Vec<(Vec<String>, Vec<String>)> {
    text.lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<String> = l.trim_matches('|').split(" | ").map(|c| c.trim().to_owned()).collect();
            let names = cells[0].split('`').skip(1).step_by(2).map(str::to_owned).collect();
            (names, cells)
        })
        .collect()
}

/// Dotted paths of the leaves of a JSON value; arrays, empty objects and nulls are leaves.
fn json_leaves(prefix: &str, value: &serde_json::Value, out: &mut BTreeSet<String>) {
    match value {
        serde_json::Value::Object(o) if !o.is_empty() => {
            for (k, v) in o {
                let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                json_leaves(&path, v, out);
            }
        }
        _ => drop(out.insert(prefix.to_owned())),
    }
}

fn config_leaves(text: &str) -> BTreeMap<String, String> {
    crate::reload::leaves(&Config::from_toml_str(text).expect("parses"))
}

/// The minimal config with every optional table present, a password included: every field.
fn every_config_field() -> BTreeSet<String> {
    let side = |s: &str| {
        format!(
            "[{s}.tls]\nca_file = \"a\"\ncert_file = \"b\"\nkey_file = \"c\"\n\
             [{s}.auth]\nusername = \"u\"\npassword_file = \"p\"\npassword_env = \"E\"\npassword = \"x\"\n"
        )
    };
    config_leaves(&format!("{MINIMAL_CONFIG}{}{}", side("source"), side("target"))).into_keys().collect()
}

#[test]
fn every_config_field_is_listed_with_its_default() {
    // The smallest file that parses, with the optional tables present: every field at its
    // default, the required ones empty.
    let bare = "[source]\n[source.tls]\n[source.auth]\n[target]\n[target.tls]\n[target.auth]\n";
    let defaults = config_leaves(bare);
    let required = Config::from_toml_str(bare).unwrap().validate().unwrap_err().to_string();
    let mut listed = BTreeSet::new();
    for (names, cells) in rows(section("Config file")) {
        let documented = cells[1].trim_matches('`');
        for name in names {
            match documented {
                "required" => {
                    assert!(required.contains(&name), "{name} is listed as required but validates empty")
                }
                "none" => {
                    assert!(!defaults.contains_key(&name), "{name} is listed without a default but has one")
                }
                _ => assert_eq!(
                    defaults.get(&name).map(String::as_str),
                    Some(documented),
                    "default of {name} in docs/configuration.md"
                ),
            }
            assert!(listed.insert(name.clone()), "{name} is listed twice");
        }
    }
    let fields = every_config_field();
    let missing: Vec<_> = fields.difference(&listed).collect();
    let unknown: Vec<_> = listed.difference(&fields).collect();
    assert!(missing.is_empty(), "config fields missing from docs/configuration.md: {missing:?}");
    assert!(unknown.is_empty(), "docs/configuration.md lists fields the config does not have: {unknown:?}");
}

/// The SIGHUP column is what the agent does ([`Applies::of`], which its reload follows).
#[test]
fn the_sighup_column_is_what_a_reload_does() {
    for (names, cells) in rows(section("Config file")) {
        for name in names {
            let applies = Applies::of(&name).unwrap_or_else(|| panic!("{name}: no reload rule"));
            assert_eq!(cells[3], applies.as_str(), "SIGHUP column of {name} in docs/configuration.md");
        }
    }
}

#[test]
fn every_status_field_and_condition_is_listed() {
    let expiry = vec![CertExpiry { kind: "ca".into(), not_after: 0 }];
    let mut status = Status {
        source_keys: Some(0),
        target_keys: Some(0),
        last_reconcile: Some(LastReconcile::default()),
        excluded_keys_in_target: vec![ExcludedKeys::default()],
        cutover: Some(CutoverStatus::default()),
        last_error: Some(LastError {
            class: ErrorClass::Transient,
            reason: crate::Reason::Unknown,
            message: String::new(),
            fix: Some(String::new()),
        }),
        ha: Some(HaStatus::default()),
        exact: Some(crate::ExactStatus::default()),
        ..Status::default()
    };
    status.source.tls_cert_expiry = expiry.clone();
    status.target.tls_cert_expiry = expiry;
    let mut fields = BTreeSet::new();
    json_leaves("", &serde_json::to_value(&status).unwrap(), &mut fields);
    let listed: BTreeSet<String> =
        rows(section("`/statusz`")).into_iter().flat_map(|(names, _)| names).collect();
    let missing: Vec<_> = fields.difference(&listed).collect();
    let unknown: Vec<_> = listed.difference(&fields).collect();
    assert!(missing.is_empty(), "/statusz fields missing from docs/configuration.md: {missing:?}");
    assert!(unknown.is_empty(), "docs/configuration.md lists /statusz fields that do not exist: {unknown:?}");

    let conditions: BTreeSet<String> = ConditionType::ALL.iter().map(|c| c.as_str().to_owned()).collect();
    let listed: BTreeSet<String> =
        rows(section("Conditions")).into_iter().flat_map(|(names, _)| names).collect();
    assert_eq!(listed, conditions, "conditions in docs/configuration.md");
}

/// The reasons section lists every reason the agent can give, once, with who gives it and what
/// it means as the code says (`Reason::group`, `Reason::meaning`), and nothing else.
#[test]
fn every_reason_is_listed_with_its_meaning() {
    let listed: Vec<(String, String, String)> = rows(section("Reasons"))
        .into_iter()
        .map(|(names, cells)| (names.concat(), cells[1].clone(), cells[2].clone()))
        .collect();
    let code: Vec<(String, String, String)> = crate::Reason::ALL
        .iter()
        .map(|r| (r.as_str().to_owned(), r.group().to_owned(), r.meaning().to_owned()))
        .collect();
    assert_eq!(listed, code, "reasons in docs/configuration.md (in declaration order)");
}

/// The example sets every field but the refused `password`, and is a valid config.
#[test]
fn the_example_config_sets_every_field_and_validates() {
    let config = Config::from_toml_str(EXAMPLE).expect("deploy/mirror.example.toml parses");
    config.validate().expect("deploy/mirror.example.toml validates");
    let set: BTreeSet<String> = config_leaves(EXAMPLE).into_keys().collect();
    let expected: BTreeSet<String> = every_config_field()
        .into_iter()
        .filter(|f| {
            !f.ends_with(".password") && !f.ends_with(".password_env") && !f.ends_with(".password_file")
        })
        .collect();
    let unset: Vec<_> = expected.difference(&set).collect();
    assert!(unset.is_empty(), "deploy/mirror.example.toml leaves out {unset:?}");
}

/// Every `FILE.rs::name` and `NAME.toml` that docs/upstream-coverage.md cites exists: a test
/// renamed or removed fails here until the table says where its coverage went.
#[test]
fn the_upstream_coverage_table_cites_tests_that_exist() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let table = std::fs::read_to_string(root.join("docs/upstream-coverage.md")).unwrap();
    let mut sources: BTreeMap<String, String> = BTreeMap::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() && name != "target" && !name.starts_with('.') {
                dirs.push(path);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                sources
                    .entry(stem.to_owned())
                    .or_default()
                    .push_str(&std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let mut missing = Vec::new();
    for span in table.split('`').skip(1).step_by(2) {
        if let Some((path, names)) = span.split_once(".rs::") {
            // `engine/probe.rs::x`, `mirror-core tls.rs::x`: the file's own name.
            let file = path.rsplit(['/', ' ']).next().unwrap_or(path);
            let text = sources.get(file).map_or("", String::as_str);
            let identifier = |n: &&str| {
                !n.is_empty() && n.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            };
            for name in names.trim_matches(['{', '}']).split(',').map(str::trim).filter(identifier) {
                if !text.contains(&format!("fn {name}(")) && !text.contains(&format!("fn {name}<")) {
                    missing.push(span.to_owned());
                }
            }
        } else if let Some(scenario) = span.strip_suffix(".toml").filter(|s| !s.contains(['/', ' '])) {
            if !root.join("harness/scenarios").join(format!("{scenario}.toml")).exists() {
                missing.push(span.to_owned());
            }
        }
    }
    assert!(missing.is_empty(), "docs/upstream-coverage.md cites what does not exist: {missing:?}");
}

/// The table's totals line counts its rows, and every row's status is one the legend defines.
#[test]
fn the_upstream_coverage_totals_count_the_rows() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let table = std::fs::read_to_string(root.join("docs/upstream-coverage.md")).unwrap();
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut rows = 0;
    for line in table.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // `| # | reference test | checks | status | covered by |`: a numbered row.
        if cells.len() > 5 && cells[1].parse::<u32>().is_ok() {
            rows += 1;
            *counts.entry(cells[4]).or_default() += 1;
        }
    }
    assert_eq!(rows, 141, "the reference has 141 tests");
    let known = ["yes", "differs", "partial", "no", "n/a"];
    assert!(counts.keys().all(|k| known.contains(k)), "unknown status in {counts:?}");
    let count = |k: &str| counts.get(k).copied().unwrap_or(0);
    let totals = format!(
        "{} yes, {} differs, {} partial, {} no, {} n/a, of 141.",
        count("yes"),
        count("differs"),
        count("partial"),
        count("no"),
        count("n/a")
    );
    assert!(table.contains(&totals), "the totals line should read {totals:?}");
}
