use super::*;

/// A condition keeps its `since` while its status is unchanged.
#[test]
fn condition_since_moves_only_on_flip() {
    let mut s = Status::default();
    s.set_condition(ConditionType::Available, true, Reason::Syncing, "");
    let since = s.conditions[0].since.clone();
    s.set_condition(ConditionType::Available, true, Reason::Syncing, "still");
    assert_eq!(s.conditions[0].since, since);
    assert!(s.condition(ConditionType::Available));
    s.set_condition(ConditionType::Available, false, Reason::FencedByNewerEpoch, "");
    assert!(!s.condition(ConditionType::Available));
}

/// Conditions keep SPEC §7's wire form (`"type": "Available"`, `"status": "True"`) while
/// typed in code; a condition type this build does not know is dropped on read, not fatal.
#[test]
fn conditions_are_typed_in_code_and_named_on_the_wire() {
    let mut s = Status::default();
    s.set_condition(ConditionType::TargetReachable, false, Reason::Unavailable, "down");
    s.last_error = Some(LastError {
        class: ErrorClass::Throttle,
        reason: Reason::TooManyRequests,
        message: String::new(),
        fix: None,
    });
    let wire = serde_json::to_value(&s).unwrap();
    assert_eq!(wire["conditions"][0]["type"], "TargetReachable");
    assert_eq!(wire["conditions"][0]["status"], "False");
    assert_eq!(wire["last_error"]["class"], "throttle");
    let mut newer = wire.clone();
    let mut unknown = newer["conditions"][0].clone();
    unknown["type"] = "SomethingNewer".into();
    newer["conditions"].as_array_mut().unwrap().push(unknown);
    let read: Status = serde_json::from_value(newer).unwrap();
    assert_eq!(read, s);
    let mut bad = wire;
    bad["conditions"][0]["status"] = "Unknown".into();
    assert!(serde_json::from_value::<Status>(bad).is_err(), "a status is True or False");
}

/// Phases serialise to the names of SPEC §7.
#[test]
fn phase_names() {
    for p in Phase::ALL {
        assert_eq!(serde_json::to_value(p).unwrap(), p.as_str());
    }
}
