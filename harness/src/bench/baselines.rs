//! The baselines every agent figure stands beside: the target's raw write ceiling (flat and
//! nested Txns) and a naive copier.

use std::sync::Arc;

use anyhow::Context as _;

use etcd_client::{Client, GetOptions, Txn, TxnOp};
use tokio::time::Instant;

use super::{COPIER_WINDOW, FLAT_OPS, WRITERS};

pub(super) fn key(prefix: &str, i: usize) -> String {
    format!("{prefix}key-{i:08}")
}

/// Puts per inner Txn when a Txn holds `nested` of them: etcd checks `--max-txn-ops` per level
/// and gives an inner Txn only what its parent left unused.
pub(super) fn inner_ops(nested: usize) -> usize {
    FLAT_OPS - nested
}

/// Keys/s that [`WRITERS`] concurrent writers reach, each Txn holding `nested` inner Txns of
/// [`inner_ops`] puts (`nested == 1`: one flat Txn of `FLAT_OPS` puts).
pub(super) async fn write_ceiling(
    client: Client,
    keys: usize,
    value_size: usize,
    nested: usize,
) -> anyhow::Result<f64> {
    let inner = inner_ops(nested);
    let per_txn = if nested == 1 { FLAT_OPS } else { nested * inner };
    let txns: Vec<(usize, usize)> =
        (0..keys).step_by(per_txn).map(|start| (start, (start + per_txn).min(keys))).collect();
    let txns = Arc::new(tokio::sync::Mutex::new(txns.into_iter()));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..WRITERS {
        let (mut c, txns) = (client.clone(), txns.clone());
        let value = vec![b'c'; value_size];
        tasks.spawn(async move {
            loop {
                let Some((start, end)) = txns.lock().await.next() else { return anyhow::Ok(()) };
                let put = |i| TxnOp::put(key("/ceiling/", i), value.clone(), None);
                let ops: Vec<TxnOp> = if nested == 1 {
                    (start..end).map(put).collect()
                } else {
                    let starts: Vec<usize> = (start..end).step_by(inner).collect();
                    starts
                        .into_iter()
                        .map(|s| {
                            TxnOp::txn(
                                Txn::new().and_then((s..(s + inner).min(end)).map(put).collect::<Vec<_>>()),
                            )
                        })
                        .collect()
                };
                c.txn(Txn::new().and_then(ops)).await?;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(keys as f64 / started.elapsed().as_secs_f64())
}

/// The naive copier: one reader of exact [`COPIER_WINDOW`]-key windows of `/bench/` (it knows
/// the key names, so no Get walks the rest of the range), [`WRITERS`] writers of `FLAT_OPS`-op
/// Txns, no fence, no checkpoint. Keys/s to the last key written.
pub(super) async fn naive_copy(src: Client, dst: Client, keys: usize) -> anyhow::Result<f64> {
    let started = Instant::now();
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<TxnOp>>(4 * WRITERS);
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..WRITERS {
        let (mut c, rx) = (dst.clone(), rx.clone());
        tasks.spawn(async move {
            loop {
                let Some(ops) = rx.lock().await.recv().await else { return anyhow::Ok(0) };
                c.txn(Txn::new().and_then(ops)).await?;
            }
        });
    }
    let mut reader = src.clone();
    tasks.spawn(async move {
        let mut copied = 0usize;
        for start in (0..keys).step_by(COPIER_WINDOW) {
            let end = (start + COPIER_WINDOW).min(keys);
            let opts = GetOptions::new().with_range(key("/bench/", end)).with_limit(COPIER_WINDOW as i64);
            let resp = reader.get(key("/bench/", start), Some(opts)).await?;
            copied += resp.kvs().len();
            for chunk in resp.kvs().chunks(FLAT_OPS) {
                let ops = chunk.iter().map(|kv| TxnOp::put(kv.key(), kv.value(), None)).collect();
                tx.send(ops).await.context("copier writers stopped")?;
            }
        }
        anyhow::Ok(copied)
    });
    let mut copied = 0;
    while let Some(done) = tasks.join_next().await {
        copied += done??;
    }
    anyhow::ensure!(copied == keys, "the copier read {copied} of {keys} keys");
    Ok(keys as f64 / started.elapsed().as_secs_f64())
}
