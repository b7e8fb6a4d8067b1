//! Writing test data into the source quickly (batched Txns), and a steady writer.

use etcd_client::{Client, Txn, TxnOp};

/// Puts `n` keys `prefix + "key-%08d"` with `value_size`-byte values in 128-op Txns; returns the
/// revision after the last write.
pub async fn load_keys(
    client: &mut Client,
    prefix: &str,
    n: usize,
    value_size: usize,
) -> anyhow::Result<i64> {
    let mut rev = 0;
    let value = vec![b'v'; value_size];
    for start in (0..n).step_by(128) {
        let ops: Vec<TxnOp> = (start..(start + 128).min(n))
            .map(|i| TxnOp::put(format!("{prefix}key-{i:08}"), value.clone(), None))
            .collect();
        let resp = client.txn(Txn::new().and_then(ops)).await?;
        rev = resp.header().map_or(rev, |h| h.revision());
    }
    Ok(rev)
}
