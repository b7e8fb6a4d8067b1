//! The alert rules in `deploy/prometheus/` under `promtool` (Debian's, unpacked by
//! `scripts/setup.sh` into `.tools/promtool/`).
//!
//! [`rules_test`] turns `/metrics` scrapes of real agents into a promtool unit test that expects
//! every rule quiet: the samples are held constant for [`QUIET_FOR`], longer than the longest
//! `for:` of any rule, so a rule that would fire on a healthy agent does.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};

use crate::tools_dir;

/// `deploy/prometheus/alerts.yaml`.
pub fn alert_rules() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/prometheus/alerts.yaml"))
}

/// How long [`rules_test`] holds a scrape: above the longest `for:` in the rules (12 h).
pub const QUIET_FOR: Duration = Duration::from_secs(13 * 3600);

/// Runs `promtool ARGS` in `dir`; its output, or an error carrying it.
pub fn promtool(dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    let bin = tools_dir().join("promtool/promtool");
    let out = Command::new(&bin)
        .args(args)
        .current_dir(dir)
        .output()
        .with_context(|| format!("{} (run scripts/setup.sh)", bin.display()))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("promtool {} failed:\n{text}", args.join(" "));
    }
    Ok(text)
}

/// The `- alert: NAME` entries of a rules file, in order.
pub fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
        .map(|name| name.trim().to_owned())
        .collect()
}

/// One scrape of an agent's `/metrics`, taken at `at`.
pub struct Scrape {
    /// The `instance` label its samples get.
    pub instance: String,
    /// The exposition text.
    pub text: String,
    /// When it was taken (Unix timestamps in it are read against this).
    pub at: SystemTime,
}

impl Scrape {
    /// A scrape taken just now.
    pub fn now(instance: &str, text: String) -> Scrape {
        Scrape { instance: instance.to_owned(), text, at: SystemTime::now() }
    }
}

/// Runs every shipped alert rule ([`alert_rules`]) over `scrapes` held for [`QUIET_FOR`]
/// ([`rules_test`]): Ok when none fires, else promtool's words.
pub fn every_rule_quiet(scrapes: &[Scrape]) -> anyhow::Result<()> {
    let rules = alert_rules();
    let names = alert_names(&std::fs::read_to_string(&rules)?);
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("quiet.test.yaml"), rules_test(&rules, scrapes, &names)?)?;
    let out = promtool(dir.path(), &["test", "rules", "quiet.test.yaml"])?;
    anyhow::ensure!(out.contains("SUCCESS"), "{out}");
    Ok(())
}

/// A promtool unit test (YAML) over `rules`: every sample of every scrape held for
/// [`QUIET_FOR`] under `job="etcd-mirror"` and the scrape's instance, with `up` at 1, and no
/// alert of `alerts` expected at the end. Unix timestamps (`…_timestamp_seconds`) are moved so
/// that they stand as far from promtool's clock (0 at the start) as from the scrape.
pub fn rules_test(rules: &Path, scrapes: &[Scrape], alerts: &[String]) -> anyhow::Result<String> {
    let minutes = QUIET_FOR.as_secs() / 60;
    let end = QUIET_FOR.as_secs_f64();
    let mut yaml = format!(
        "rule_files:\n  - '{}'\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n",
        rules.display()
    );
    for scrape in scrapes {
        let now = scrape.at.duration_since(UNIX_EPOCH)?.as_secs_f64();
        let job = format!("job=\"etcd-mirror\", instance=\"{}\"", scrape.instance);
        yaml.push_str(&format!("      - series: 'up{{{job}}}'\n        values: '1x{minutes}'\n"));
        for line in scrape.text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
            let (series, value) = line.rsplit_once(' ').with_context(|| format!("sample line {line:?}"))?;
            let mut value: f64 = value.parse().with_context(|| format!("sample value in {line:?}"))?;
            let (name, labels) = match series.split_once('{') {
                Some((name, labels)) => (name, labels.trim_end_matches('}')),
                None => (series, ""),
            };
            if name.ends_with("_timestamp_seconds") && value > 0.0 {
                value = value - now + end;
            }
            let labels = if labels.is_empty() { job.clone() } else { format!("{labels}, {job}") };
            yaml.push_str(&format!(
                "      - series: '{name}{{{labels}}}'\n        values: '{value}x{minutes}'\n"
            ));
        }
    }
    yaml.push_str("    alert_rule_test:\n");
    for alert in alerts {
        yaml.push_str(&format!(
            "      - eval_time: {minutes}m\n        alertname: {alert}\n        exp_alerts: []\n"
        ));
    }
    Ok(yaml)
}
