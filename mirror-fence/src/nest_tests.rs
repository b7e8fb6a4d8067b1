use proptest::prelude::*;

use super::*;

/// Checks etcd's rule on a layout: each level holds at most its budget, a nested level's budget
/// is its parent's minus the parent's own count. Returns the ops carried.
fn carried(slots: &[Slot], budget: usize, reserved: usize) -> usize {
    let own = slots.len() + reserved;
    assert!(own <= budget, "a level holds {own} ops over its budget {budget}");
    slots
        .iter()
        .map(|slot| match slot {
            Slot::Op => 1,
            Slot::Txn(children) => carried(children, budget - own, 0),
        })
        .sum()
}

/// What fits stays flat: a 127-op revision plus the checkpoint is one plain Txn at 128.
#[test]
fn fitting_ops_stay_flat() {
    assert_eq!(plan(127, 128, 1).unwrap(), vec![Slot::Op; 127]);
}

/// A 128-op source Txn plus the checkpoint put, and a 5 000-key `del --prefix`, each fit one
/// Txn at etcd's default limit of 128.
#[test]
fn big_revisions_fit_the_default_limit() {
    for n in [128, 2_000, 5_000, 20_000] {
        let slots = plan(n, 128, 1).unwrap();
        assert_eq!(carried(&slots, 128, 1), n);
    }
}

/// SPEC §5's measured shape is reachable: 8 nested Txns of 100 at limit 128 need 2 levels.
#[test]
fn eight_hundred_ops_need_one_nested_level() {
    let slots = plan(800, 128, 1).unwrap();
    assert!(slots.iter().all(|s| matches!(s, Slot::Txn(c) if c.iter().all(|c| *c == Slot::Op))));
}

/// A limit of 2 (the smallest the config allows) still carries a checkpoint and one op, and
/// refuses what cannot be laid out at all.
#[test]
fn tiny_limits() {
    assert_eq!(plan(1, 2, 1).unwrap(), vec![Slot::Op]);
    assert!(plan(5, 2, 1).is_err());
}

/// A 5 000-op revision at 128 takes three levels, not a chain of single children.
#[test]
fn five_thousand_ops_take_three_levels() {
    fn depth(slots: &[Slot]) -> usize {
        1 + slots.iter().map(|s| if let Slot::Txn(c) = s { depth(c) } else { 0 }).max().unwrap_or(0)
    }
    assert_eq!(depth(&plan(5_000, 128, 1).unwrap()), 3);
    assert_eq!(depth(&plan(4_000, 128, 1).unwrap()), 2);
}

/// A Txn of nested Txns is as full as etcd accepts beside the checkpoint put, and never
/// smaller than a flat Txn, whatever `max_txn_ops` the target has.
#[test]
fn nested_capacity_lays_out_at_every_limit() {
    assert_eq!(nested_txn_capacity(128), 8 * 119);
    for limit in [2i64, 3, 4, 16, 17, 64, 128, 1000] {
        let n = nested_txn_capacity(limit);
        assert!(n >= limit as usize - 1, "{limit}: {n}");
        // etcd's rule, with the checkpoint put beside the children at the top level.
        let slots = plan(n, limit as usize, 1).unwrap_or_else(|e| panic!("{limit}: {n} ops: {e}"));
        assert_eq!(carried(&slots, limit as usize, 1), n);
    }
}

proptest! {
    /// Every layout obeys etcd's per-level rule and carries every op exactly once; from a
    /// limit of 48 on, 30 000 ops always fit.
    #[test]
    fn layouts_obey_the_per_level_rule(n in 0usize..30_000, limit in 8usize..256) {
        match plan(n, limit, 1) {
            Ok(slots) => prop_assert_eq!(carried(&slots, limit, 1), n),
            Err(e) => prop_assert!(limit < 48, "{e}"),
        }
    }

    /// `holds` answers what `plan` would, without building the layout.
    #[test]
    fn holds_is_whether_a_plan_exists(n in 0usize..5_000, limit in 2usize..64, reserved in 0usize..2) {
        prop_assert_eq!(holds(n, limit, reserved), plan(n, limit, reserved).is_ok());
    }
}
