//! Laying out many ops in one atomic Txn with nested Txns (SPEC §5 "Batching").
//!
//! etcd checks `--max-txn-ops` per nesting level: a Txn may hold `max_txn_ops` ops at its own
//! level (`max(compares, success ops, failure ops)`), and a Txn nested in it may hold
//! `max_txn_ops` minus the number its parent already used, and so on down. A nested Txn with no
//! compares always takes its success branch, and the whole tree commits as one revision. So a
//! source revision of thousands of ops (`etcdctl del --prefix`, a 128-op Txn plus our
//! checkpoint put, a lease revoke) still lands in one target Txn, atomically (G2).
//!
//! [`nest`] puts the ops flat when they fit; otherwise it uses the fewest children at the top
//! level that can hold them all, each child laid out the same way with the budget left to it.

use etcd_client::{Txn, TxnOp};

/// The ops could not be laid out within the limit at any depth (only when `limit` is tiny).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{ops} ops do not fit one Txn with max_txn_ops {limit}")]
pub struct TooManyOps {
    /// Ops asked for.
    pub ops: usize,
    /// The per-level limit.
    pub limit: usize,
}

/// Nested Txns the agent fills per Txn it builds (a merged tail batch, a scan Txn): 8 x 128 =
/// 1 024 ops fit two levels at etcd's default limit, and nested Txns write faster per key than
/// flat 128-op ones (measured by `harness bench`).
pub const NESTED_TXNS: usize = 8;

/// The one clamp of a per-level op limit (`sync.max_txn_ops`, or half of it after a target
/// refused it): at least 2, one slot for the checkpoint put and one for data.
pub fn ops_per_level(max_txn_ops: i64) -> usize {
    max_txn_ops.max(2) as usize
}

/// Ops one Txn of [`NESTED_TXNS`] nested Txns carries beside the checkpoint put: each child as
/// full as etcd allows under a parent holding that many ops (`max_txn_ops - n`), less one
/// top-level slot for the checkpoint; never fewer than a flat Txn holds. Independent ops (scan
/// puts, repairs, prune deletes) are chunked by it.
pub fn nested_txn_capacity(max_txn_ops: i64) -> usize {
    let limit = ops_per_level(max_txn_ops);
    let nested = NESTED_TXNS.min(limit / 2);
    (nested * (limit - nested - 1)).max(limit - 1)
}

/// Deepest layout tried; at a limit of 128, three levels already carry millions of ops.
const MAX_DEPTH: usize = 6;

/// How many ops a Txn level whose own op budget is `budget` can carry in at most `depth`
/// levels (1 = flat): `k` children each left with `budget - k`, or all flat. Memoised per
/// (budget, depth); budgets are at most the configured `max_txn_ops`.
fn capacity(budget: usize, depth: usize) -> usize {
    thread_local! {
        static MEMO: std::cell::RefCell<std::collections::HashMap<(usize, usize), usize>> =
            std::cell::RefCell::new(std::collections::HashMap::new());
    }
    if depth <= 1 || budget <= 1 {
        return budget;
    }
    if let Some(c) = MEMO.with(|m| m.borrow().get(&(budget, depth)).copied()) {
        return c;
    }
    let c =
        (1..budget).map(|k| k.saturating_mul(capacity(budget - k, depth - 1))).max().unwrap_or(0).max(budget);
    MEMO.with(|m| m.borrow_mut().insert((budget, depth), c));
    c
}

/// One top-level entry of a laid-out Txn: a plain op, or a nested Txn of entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slot {
    /// One op of the input, in order.
    Op,
    /// A nested Txn (no compares) holding these entries.
    Txn(Vec<Slot>),
}

/// The layout of `n` ops under a per-level limit of `limit`, with `reserved` slots at the top
/// level left free (the fence's checkpoint put): flat when they fit, else the fewest nested
/// children that hold them all.
pub fn plan(n: usize, limit: usize, reserved: usize) -> Result<Vec<Slot>, TooManyOps> {
    let depth = (1..=MAX_DEPTH).find(|&d| fits(n, limit, reserved, d)).ok_or(TooManyOps { ops: n, limit })?;
    Ok(plan_at(n, limit, reserved, depth))
}

/// Whether some layout of at most [`MAX_DEPTH`] levels holds `n` ops under `limit` with
/// `reserved` top-level slots: what [`plan`] would find, without building it.
pub fn holds(n: usize, limit: usize, reserved: usize) -> bool {
    fits(n, limit, reserved, MAX_DEPTH)
}

/// Whether `n` ops fit `depth` levels under `limit` with `reserved` top-level slots.
fn fits(n: usize, limit: usize, reserved: usize, depth: usize) -> bool {
    if n + reserved <= limit {
        return true;
    }
    depth > 1
        && (1..=limit.saturating_sub(reserved))
            .any(|k| k.saturating_mul(capacity(limit - reserved - k, depth - 1)) >= n)
}

/// The layout in `depth` levels (which [`fits`]): flat when possible, else the fewest children
/// at this level, shallow children first.
fn plan_at(n: usize, limit: usize, reserved: usize, depth: usize) -> Vec<Slot> {
    if n + reserved <= limit {
        return vec![Slot::Op; n];
    }
    let k = (1..=limit - reserved)
        .find(|&k| k.saturating_mul(capacity(limit - reserved - k, depth - 1)) >= n)
        .expect("fits() held");
    let budget = limit - reserved - k;
    let per_child = n.div_ceil(k);
    let mut out = Vec::with_capacity(k);
    let mut left = n;
    while left > 0 {
        let take = per_child.min(left);
        let child_depth = (1..depth).find(|&d| fits(take, budget, 0, d)).expect("k children hold n");
        out.push(Slot::Txn(plan_at(take, budget, 0, child_depth)));
        left -= take;
    }
    out
}

/// `ops` laid out by [`plan`]: the top-level ops of one atomic Txn.
pub fn nest(ops: Vec<TxnOp>, limit: usize, reserved: usize) -> Result<Vec<TxnOp>, TooManyOps> {
    let slots = plan(ops.len(), limit, reserved)?;
    let mut ops = ops.into_iter();
    Ok(fill(&slots, &mut ops))
}

fn fill(slots: &[Slot], ops: &mut impl Iterator<Item = TxnOp>) -> Vec<TxnOp> {
    slots
        .iter()
        .filter_map(|slot| match slot {
            Slot::Op => ops.next(),
            Slot::Txn(children) => Some(TxnOp::txn(Txn::new().and_then(fill(children, ops)))),
        })
        .collect()
}

#[cfg(test)]
#[path = "nest_tests.rs"]
mod tests;
