use std::time::Duration;

use mirror_core::{ConditionType, HumanDuration, Phase};

use super::super::step::Churn;
use super::super::step::{
    kind, parse_condition, parse_until, Compact, ConditionIs, Del, Delay, Expect, FailbackPlan, Grant,
    KeepLeases, KillMember, Load, LoadLeased, MemberRef, Put, Restore, RevisionRef, Revoke, SideName, Signal,
    Sleep, Snapshot, StartAgent, Step, StopAgent, Until,
};
use super::*;

const SPEC_EXAMPLE: &str = r#"
name = "compaction-mid-scan"
about = "the source is compacted while the initial scan pages"
seed = 7                      # randomness of load/churn; --seed overrides
versions = ["3.5.30", "3.4.23"] # run once per source/target version (default ["3.5.30"])

[source]                      # each side: a cluster
members = 1                   # 1 or 3
args = []                     # extra etcd flags, e.g. ["--quota-backend-bytes=16777216"]
prefix = "/app/"
[target]
members = 3
prefix = "/copy/"

[agent]                       # extra TOML merged into the generated agent config
toml = '''
[sync]
max_txn_ops = 64
'''

[[step]]                      # steps run in order; `background = true` runs one alongside
do = "load"                   # keys, value_size, prefix (relative to source.prefix)
keys = 20000
value_size = 256
[[step]]
do = "start_agent"            # id (default "a"); epoch; toml (overrides for this agent)
[[step]]
do = "wait"                   # until: "phase:P" | "condition:TYPE=True|False" | "equal"
until = "phase:initial_sync"  # timeout (default "60s"); agent (default "a")
[[step]]
do = "compact"                # side ("source"|"target"), revision ("current" default)
side = "source"
[[step]]
do = "expect"                 # any of: equal = true; phase = "P"; condition = "TYPE=True";
equal = true                  # forced_resyncs = N; g3 = "held"; agent_exit = CODE
forced_resyncs = 0
"#;

/// SPEC §8's own example parses as written.
#[test]
fn the_spec_example_parses() {
    let s = Scenario::parse(SPEC_EXAMPLE).unwrap();
    assert_eq!(s.name, "compaction-mid-scan");
    assert_eq!(s.seed, 7);
    assert_eq!(s.versions.len(), 2);
    assert_eq!((s.source.members, s.target.members), (1, 3));
    assert_eq!((s.source_prefix(), s.target_prefix()), ("/app/", "/copy/"));
    assert!(s.agent_toml.contains("max_txn_ops = 64"));
    let kinds: Vec<String> = s.steps.iter().map(|s| kind(s.step.as_ref())).collect();
    assert_eq!(kinds, ["load", "start_agent", "wait", "compact", "expect"]);
    assert_eq!(s.steps[0].line, 21, "the line of its [[step]] header");
    let load = Load {
        side: SideName::Source,
        keys: 20_000,
        value_size: 256,
        prefix: String::new(),
        lease: None,
        lease_every: None,
        lease_ttl: None,
        keyspace: None,
    };
    assert_eq!(shown(s.steps[0].step.as_ref()), shown(&load));
    let compact = Compact { side: SideName::Source, revision: RevisionRef::Named("current".into()), keep: 0 };
    assert_eq!(shown(s.steps[3].step.as_ref()), shown(&compact));
}

/// A step as its TOML form: what a file says and what chaos writes.
fn shown(step: &dyn Step) -> String {
    toml::to_string(step).unwrap()
}

fn error_of(text: &str) -> String {
    format!("{:#}", Scenario::parse(text).unwrap_err())
}

const HEAD: &str = "name = \"x\"\n[source]\nprefix = \"/a/\"\n";

/// Unknown keys and kinds, at the top and in steps, are errors that name the line.
#[test]
fn unknown_keys_and_kinds_name_the_line() {
    let e = error_of(&format!("{HEAD}[[step]]\ndo = \"wait\"\nuntill = \"equal\"\n"));
    assert!(e.contains("line 4") && e.contains("untill"), "{e}");
    let e = error_of(&format!("{HEAD}[[step]]\ndo = \"load\"\nkeys = 1\n[[step]]\ndo = \"explode\"\n"));
    assert!(e.contains("line 7") && e.contains("explode"), "{e}");
    let e = error_of(&format!("{HEAD}colour = \"red\"\n"));
    assert!(e.contains("colour") && e.contains("line"), "{e}");
    let e =
        error_of(&format!("{HEAD}[[step]]\ndo = \"kill_member\"\nside = \"source\"\nmember = \"boss\"\n"));
    assert!(e.contains("line 4") && e.contains("leader"), "{e}");
    let e = error_of(&format!("{HEAD}[[step]]\ndo = \"wait\"\nuntil = \"phase\"\n"));
    assert!(e.contains("line 4") && e.contains("until"), "{e}");
    let e = error_of(&format!("{HEAD}[[step]]\ndo = \"start_agent\"\nbackground = true\n"));
    assert!(e.contains("background"), "{e}");
    let e = error_of(&format!("{HEAD}[[step]]\ndo = \"compact\"\nside = \"source\"\nkeep = -1\n"));
    assert!(e.contains("keep"), "{e}");
    let e = error_of("name = \"x\"\n[source]\nprefix = \"/a/\"\nmembers = 2\n");
    assert!(e.contains("source.members"), "{e}");
}

/// Every step kind round-trips through its TOML form (chaos writes schedules this way).
#[test]
fn steps_round_trip() {
    let steps: Vec<Box<dyn Step>> = vec![
        Box::new(Churn { ops: 10, rate: 5, keyspace: 3, value_size: 100, prefix: "c/".into(), leases: true }),
        Box::new(Del {
            side: SideName::Source,
            checkpoint: false,
            key: None,
            prefix: Some("big/".into()),
            target_revisions: Some(1),
        }),
        Box::new(Load {
            side: SideName::Source,
            keys: 10,
            value_size: 1,
            prefix: String::new(),
            lease: Some(7),
            lease_every: Some(2),
            lease_ttl: None,
            keyspace: Some(3),
        }),
        Box::new(Revoke { side: SideName::Source, lease: 7, target_revisions: None }),
        Box::new(Put {
            side: SideName::Target,
            key: None,
            checkpoint: true,
            value: Some("{".into()),
            value_size: 1,
            outside_prefix: false,
            lease: None,
        }),
        Box::new(StopAgent { id: "b".into(), signal: Signal::Stop, within: None }),
        Box::new(KillMember { side: SideName::Target, member: MemberRef::leader() }),
        Box::new(Sleep { for_: HumanDuration(Duration::from_millis(1500)) }),
        Box::new(Snapshot { side: SideName::Source, name: "before".into() }),
        Box::new(Restore { side: SideName::Target, name: "before".into(), from: Some(SideName::Source) }),
        Box::new(Delay { side: SideName::Source, ms: 200 }),
        Box::new(Compact {
            side: SideName::Source,
            revision: RevisionRef::Named("current".into()),
            keep: 2_000,
        }),
        Box::new(StartAgent { id: "r".into(), epoch: None, toml: None, reverse: true }),
        Box::new(LoadLeased { keys: 10, prefix: "l/".into(), first: 1, count: 5, ttl: 10, ttl_max: 60 }),
        Box::new(KeepLeases {
            side: SideName::Target,
            first: 1,
            count: 5,
            for_: HumanDuration(Duration::from_secs(30)),
        }),
        Box::new(Grant { side: SideName::Target, lease: 9, ttl: 30 }),
        Box::new(FailbackPlan { toml: None, expect: 0, listed_from: "keys".into() }),
        Box::new(Put {
            side: SideName::Source,
            key: Some("/elsewhere".into()),
            checkpoint: false,
            value: None,
            value_size: 3,
            outside_prefix: true,
            lease: None,
        }),
        Box::new(Expect {
            equal: Some(true),
            exact: Some(true),
            phase: Some(Phase::Syncing),
            condition: Some(parse_condition("Available=True").unwrap()),
            forced_resyncs: None,
            g3: Some("held".into()),
            last_error: Some("SourceWentBack".into()),
            agent_exit: None,
            sole_writer_after: Some("b".into()),
            target_has: vec!["before-the-link".into()],
            target_lacks: vec!["deleted".into()],
            initial_sync_completed_older_than: Some(HumanDuration::secs(3)),
            min_scan_restarts: Some(1),
            max_scan_restarts: Some(3),
            max_peak_rss_mib: Some(96),
            max_lag_revisions: Some(100),
            min_watch_restarts: Some(0),
            max_watch_restarts: Some(0),
            during: Some(HumanDuration(Duration::from_secs(2))),
            checkpoint_role: Some(mirror_fence::Role::Primary),
            target_still_for: Some(HumanDuration(Duration::from_secs(3))),
            leases_match: Some(true),
            target_leases_gone: vec![7],
            target_leases_alive: vec![8],
            leases_within: Some(HumanDuration::secs(5)),
            log_once: vec!["said once".into()],
            agent: "a".into(),
            timeout: HumanDuration::secs(60),
        }),
    ];
    let mut text = HEAD.to_owned();
    for s in &steps {
        text.push_str(&format!("[[step]]\n{}\n", shown(s.as_ref())));
    }
    let parsed = Scenario::parse(&text).unwrap();
    let back: Vec<String> = parsed.steps.iter().map(|s| shown(s.step.as_ref())).collect();
    let want: Vec<String> = steps.iter().map(|s| shown(s.as_ref())).collect();
    assert_eq!(back, want);
}

/// A condition may name its reason after a slash; bad statuses are errors.
#[test]
fn condition_with_reason() {
    assert_eq!(
        parse_until("condition:Fenced=True/TargetPromoted").unwrap(),
        Until::Condition(ConditionIs {
            type_: ConditionType::Fenced,
            on: true,
            reason: Some(mirror_core::Reason::TargetPromoted)
        })
    );
    assert_eq!(
        parse_condition("Available=False").unwrap(),
        ConditionIs { type_: ConditionType::Available, on: false, reason: None }
    );
    assert_eq!(parse_until("phase:drained").unwrap(), Until::Phase(Phase::Drained));
    assert_eq!(parse_until("exact").unwrap(), Until::Exact);
    assert_eq!(Until::Exact.to_string(), "exact");
    assert!(parse_until("phase:synced").is_err(), "a phase is parsed when the file is read");
    assert!(parse_condition("Fenced=Maybe/TargetPromoted").is_err());
    let typo = parse_condition("Availabel=True").unwrap_err().to_string();
    assert!(typo.contains("Availabel"), "{typo}");
}

/// Versions name all four releases, 3.5.30 by default, and source->target pairs.
/// The defaults SPEC §8 gives: `churn` keyspace 1000 and rate 500 writes/s, not background.
#[test]
fn churn_takes_the_spec_defaults() {
    let text =
        "name = \"x\"\nabout = \"y\"\n[source]\nprefix = \"/a/\"\n[[step]]\ndo = \"churn\"\nops = 10\n";
    let s = Scenario::parse(text).unwrap();
    let want =
        Churn { ops: 10, rate: 500, keyspace: 1000, value_size: 100, prefix: String::new(), leases: true };
    assert_eq!(shown(s.steps[0].step.as_ref()), shown(&want));
    assert!(!s.steps[0].background);
}

#[test]
fn versions_default_and_pairs() {
    let none = Scenario::parse("name = \"x\"\nabout = \"y\"\n[source]\nprefix = \"/a/\"\n").unwrap();
    assert_eq!(none.versions, vec![(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30)]);
    let text = "name = \"x\"\nabout = \"y\"\nversions = [\"3.5.16\", \"3.4.23->3.5.30\"]\n[source]\nprefix = \"/a/\"\n";
    let pairs = Scenario::parse(text).unwrap().versions;
    assert_eq!(
        pairs,
        vec![(EtcdVersion::V3_5_16, EtcdVersion::V3_5_16), (EtcdVersion::V3_4_23, EtcdVersion::V3_5_30)]
    );
    let bad =
        Scenario::parse("name = \"x\"\nabout = \"y\"\nversions = [\"3.6.0\"]\n[source]\nprefix = \"/a/\"\n");
    assert!(format!("{:#}", bad.unwrap_err()).contains("3.5.30, 3.5.16, 3.5.1, 3.4.23"));
}

/// Every shipped scenario file parses (conditions, reasons and step kinds typed at read), so
/// a typo fails here in a second rather than after the slow tests before it.
#[test]
fn every_scenario_file_parses() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            Scenario::parse(&text).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            n += 1;
        }
    }
    assert!(n > 40, "only {n} scenario files found in {}", dir.display());
}
