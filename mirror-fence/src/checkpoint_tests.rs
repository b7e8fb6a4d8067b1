use proptest::prelude::*;
use rstest::rstest;
use serde_json::{json, Value};

use super::*;

fn sample() -> Checkpoint {
    Checkpoint {
        link_uid: "orders-dr".into(),
        epoch: 3,
        role: Role::Mirror,
        watermark: 1234,
        scanning: true,
        scan_cursor: b"/registry/pods/\0x".to_vec(),
        prune_pending: true,
        source_cluster_id: u64::MAX,
        target_cluster_id: 14841639068965178418,
        agent_id: "host-a/42".into(),
        commit: "0123456789abcdef-7".into(),
        range: "sha256:00ff".into(),
        confirmed_time: "2026-12-01T17:00:00Z".into(),
        forced_resyncs: 2,
        scan_restarts: 5,
        initial_sync_completed: "2026-12-01T16:00:00Z".into(),
        excludes: vec![b"/copy/nested/".to_vec(), b"/copy/\xff/".to_vec()],
        source_seen: 1234,
    }
}

fn sample_json() -> Value {
    serde_json::from_slice(&sample().encode().unwrap()).unwrap()
}

/// The encoding has exactly the fields of SPEC §6, cluster ids as decimal strings.
#[test]
fn encoding_matches_spec_fields() {
    let v = sample_json();
    assert_eq!(v["v"], 1);
    assert_eq!(v["role"], "mirror");
    assert_eq!(v["source_cluster_id"], "18446744073709551615");
    assert_eq!(v.as_object().unwrap().len(), FIELDS.len());
}

fn commit_bytes(s: u64) -> Vec<u8> {
    s.to_be_bytes().to_vec()
}

fn arb_checkpoint() -> impl Strategy<Value = Checkpoint> {
    (
        "[a-z0-9._-]{1,20}",
        1u64..=u64::MAX,
        prop_oneof![Just(Role::Mirror), Just(Role::Primary)],
        0i64..=i64::MAX,
        any::<bool>(),
        prop::collection::vec(any::<u8>(), 0..40),
        any::<bool>(),
        any::<u64>(),
        any::<u64>(),
        ".{0,20}",
    )
        .prop_map(
            |(link_uid, epoch, role, watermark, scanning, cursor, prune_pending, s, t, agent_id)| {
                Checkpoint {
                    link_uid,
                    epoch,
                    role,
                    watermark,
                    scanning,
                    scan_cursor: if scanning { cursor } else { vec![] },
                    prune_pending,
                    source_cluster_id: s,
                    target_cluster_id: t,
                    agent_id,
                    commit: format!("{s:016x}-{t}"),
                    range: String::new(),
                    confirmed_time: if scanning { String::new() } else { "2026-12-01T17:00:00Z".into() },
                    forced_resyncs: s % 4,
                    scan_restarts: t % 3,
                    initial_sync_completed: if scanning {
                        String::new()
                    } else {
                        "2026-12-01T16:00:00Z".into()
                    },
                    excludes: if prune_pending { vec![commit_bytes(s), vec![0xff, 0]] } else { Vec::new() },
                    source_seen: if prune_pending { (s % (1 << 40)) as i64 } else { 0 },
                }
            },
        )
}

proptest! {
    /// decode(encode(c)) == c for every valid record.
    #[test]
    fn round_trip(c in arb_checkpoint()) {
        prop_assert_eq!(Checkpoint::decode(&c.encode().unwrap()).unwrap(), c);
    }
}

/// One malformed field per row: decoding fails and the error names that field.
#[rstest]
#[case::v_missing("v", None)]
#[case::v_two("v", Some(json!(2)))]
#[case::v_string("v", Some(json!("1")))]
#[case::link_uid_missing("link_uid", None)]
#[case::link_uid_empty("link_uid", Some(json!("")))]
#[case::link_uid_number("link_uid", Some(json!(7)))]
#[case::epoch_zero("epoch", Some(json!(0)))]
#[case::epoch_negative("epoch", Some(json!(-1)))]
#[case::epoch_float("epoch", Some(json!(1.5)))]
#[case::epoch_missing("epoch", None)]
#[case::role_unknown("role", Some(json!("leader")))]
#[case::role_missing("role", None)]
#[case::watermark_negative("watermark", Some(json!(-3)))]
#[case::watermark_string("watermark", Some(json!("12")))]
#[case::watermark_overflow("watermark", Some(json!(u64::MAX)))]
#[case::watermark_missing("watermark", None)]
#[case::scanning_string("scanning", Some(json!("true")))]
#[case::scanning_missing("scanning", None)]
#[case::scan_cursor_not_base64("scan_cursor", Some(json!("%%%")))]
#[case::scan_cursor_null("scan_cursor", Some(Value::Null))]
#[case::scan_cursor_missing("scan_cursor", None)]
#[case::prune_pending_number("prune_pending", Some(json!(1)))]
#[case::prune_pending_missing("prune_pending", None)]
#[case::source_cluster_id_number("source_cluster_id", Some(json!(5)))]
#[case::source_cluster_id_hex("source_cluster_id", Some(json!("0x5")))]
#[case::source_cluster_id_overflow("source_cluster_id", Some(json!("18446744073709551616")))]
#[case::source_cluster_id_missing("source_cluster_id", None)]
#[case::target_cluster_id_empty("target_cluster_id", Some(json!("")))]
#[case::target_cluster_id_negative("target_cluster_id", Some(json!("-1")))]
#[case::target_cluster_id_missing("target_cluster_id", None)]
#[case::agent_id_number("agent_id", Some(json!(1)))]
#[case::agent_id_missing("agent_id", None)]
#[case::commit_number("commit", Some(json!(1)))]
#[case::range_null("range", Some(Value::Null))]
#[case::confirmed_time_not_a_time("confirmed_time", Some(json!("yesterday")))]
#[case::confirmed_time_number("confirmed_time", Some(json!(1733072400)))]
fn malformed_field_fails_closed(#[case] field: &str, #[case] value: Option<Value>) {
    let mut v = sample_json();
    let obj = v.as_object_mut().unwrap();
    match value {
        Some(x) => obj.insert(field.into(), x),
        None => obj.remove(field),
    };
    let err = Checkpoint::decode(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert!(err.to_string().contains(&format!("`{field}`")), "{err}");
}

/// A cursor while not scanning is contradictory and refused.
#[test]
fn cursor_without_scanning_fails_closed() {
    let mut v = sample_json();
    v["scanning"] = json!(false);
    let err = Checkpoint::decode(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert!(err.to_string().contains("`scan_cursor`"), "{err}");
}

/// Unknown fields, non-objects and garbage bytes are refused.
#[rstest]
#[case::unknown_field(br#"{"v":1,"extra":true}"#.to_vec())]
#[case::array(b"[1,2]".to_vec())]
#[case::garbage(b"\xff\x00not json".to_vec())]
#[case::empty(Vec::new())]
fn non_records_fail_closed(#[case] bytes: Vec<u8>) {
    assert!(Checkpoint::decode(&bytes).is_err());
}

/// A record written before `commit` and `range` existed still decodes, both empty: an upgraded
/// agent resumes an older link.
#[test]
fn records_without_the_later_fields_decode() {
    let mut v = sample_json();
    let obj = v.as_object_mut().unwrap();
    obj.remove("commit");
    obj.remove("range");
    let record = Checkpoint::decode(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert_eq!((record.commit.as_str(), record.range.as_str()), ("", ""));
}

/// A record without the counts (written before they existed) decodes with them at 0 and no
/// completion time, and encodes without them again; a bad count or time is refused by name.
#[test]
fn the_counts_are_optional_and_checked() {
    let mut v = sample_json();
    let obj = v.as_object_mut().unwrap();
    for field in ["forced_resyncs", "scan_restarts", "initial_sync_completed", "excludes", "source_seen"] {
        obj.remove(field);
    }
    let old = Checkpoint::decode(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert_eq!(
        old,
        Checkpoint {
            forced_resyncs: 0,
            scan_restarts: 0,
            initial_sync_completed: String::new(),
            excludes: Vec::new(),
            source_seen: 0,
            ..sample()
        }
    );
    let again: Value = serde_json::from_slice(&old.encode().unwrap()).unwrap();
    for field in ["forced_resyncs", "scan_restarts", "initial_sync_completed", "excludes"] {
        assert!(again.get(field).is_none(), "{field}: {again}");
    }
    for (field, bad) in [
        ("forced_resyncs", json!(-1)),
        ("scan_restarts", json!("3")),
        ("initial_sync_completed", json!("yesterday")),
        ("excludes", json!("L2Mv")),
        ("excludes", json!(["not base64!"])),
    ] {
        let mut v = sample_json();
        v[field] = bad;
        let err = Checkpoint::decode(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(matches!(err, DecodeError::Invalid { field: f, .. } if f == field), "{field}: {err}");
    }
}

/// A record without `confirmed_time` (written before it existed, or never confirmed) decodes
/// with it empty, and encodes without the field again.
#[test]
fn confirmed_time_is_optional() {
    let mut v = sample_json();
    v.as_object_mut().unwrap().remove("confirmed_time");
    let old = Checkpoint::decode(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert_eq!(old, Checkpoint { confirmed_time: String::new(), ..sample() });
    let again: Value = serde_json::from_slice(&old.encode().unwrap()).unwrap();
    assert!(again.get("confirmed_time").is_none(), "{again}");
}

/// A record that decode would refuse is never written: encode refuses it, naming the field.
#[rstest]
#[case::empty_link("link_uid", |c: &mut Checkpoint| c.link_uid.clear())]
#[case::epoch_zero("epoch", |c: &mut Checkpoint| c.epoch = 0)]
#[case::negative_watermark("watermark", |c: &mut Checkpoint| c.watermark = -1)]
#[case::cursor_without_scan("scan_cursor", |c: &mut Checkpoint| {
    c.scanning = false;
    c.scan_cursor = b"/k".to_vec();
})]
#[case::bad_confirmed_time("confirmed_time", |c: &mut Checkpoint| c.confirmed_time = "yesterday".into())]
#[case::bad_completion_time("initial_sync_completed", |c: &mut Checkpoint| {
    c.initial_sync_completed = "soon".into();
})]
fn encode_refuses_what_decode_would(#[case] field: &str, #[case] spoil: fn(&mut Checkpoint)) {
    let mut record = sample();
    record.encode().expect("the sample is valid");
    spoil(&mut record);
    match record.encode() {
        Err(DecodeError::Invalid { field: named, .. }) => assert_eq!(named, field),
        other => panic!("{field}: expected a refusal, got {other:?}"),
    }
}
