//! The G3 checker: the target range equals the source range as of the checkpoint watermark.
//!
//! One consistent read of the target (the checkpoint key first, then every target window pinned
//! to that read's revision) gives the watermark W and the range; the source is then read pinned
//! at W and rewritten. Callable at any moment, also while the agent writes.

use anyhow::Context as _;
use etcd_client::Client;
use mirror_core::{KeyRange, KeyRewriter, Pager, PagerOptions, Side};
use mirror_fence::Checkpoint;

/// What a check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum G3 {
    /// The initial sync is still running (no claim to check), or no checkpoint yet.
    NotYet,
    /// Target == source at this watermark; `keys` keys compared.
    Holds {
        /// The watermark checked.
        watermark: i64,
        /// Keys compared.
        keys: usize,
    },
}

/// Reads every key of `window` at `revision` (0 = latest), paged by keys and bytes like the
/// agent's own readers ([`mirror_core::Pager`]), so ranges of large values are readable.
pub async fn read_window(
    client: &mut Client,
    window: &KeyRange,
    revision: i64,
) -> anyhow::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    read_window_with(client, window, revision, false).await
}

/// [`read_window`]; with `leases`, each leased key's value is followed by its lease ID (so
/// a comparison sees a key under another lease as different).
async fn read_window_with(
    client: &mut Client,
    window: &KeyRange,
    revision: i64,
    leases: bool,
) -> anyhow::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let opts = PagerOptions::new("g3 check page", 2000, 4 << 20, std::time::Duration::from_secs(30))
        .at_revision(revision);
    let mut pager = Pager::new(client.kv_client(), Side::Target, vec![window.clone()], opts);
    let mut out = Vec::new();
    while let Some(kvs) = pager.next_page().await? {
        out.extend(kvs.into_iter().map(|kv| {
            let mut value = kv.value().to_vec();
            if leases && kv.lease() != 0 {
                value.extend_from_slice(format!("\0lease {:x}", kv.lease()).as_bytes());
            }
            (kv.key().to_vec(), value)
        }));
    }
    Ok(out)
}

/// The error [`check_g3`] returns when the sides differ (other errors are reads that failed):
/// downcast to tell a violation from a check that could not run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct G3Violation(pub String);

impl std::fmt::Display for G3Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for G3Violation {}

/// Checks G3 once. A violation is a [`G3Violation`] describing the first differences.
pub async fn check_g3(
    source: &mut Client,
    target: &mut Client,
    rewriter: &KeyRewriter,
    checkpoint_key: &[u8],
) -> anyhow::Result<G3> {
    check_g3_leases(source, target, rewriter, checkpoint_key, false).await
}

/// [`check_g3`]; with `leases` (`sync.leases = "preserve"`), every key must also carry the same
/// lease ID on both sides.
pub async fn check_g3_leases(
    source: &mut Client,
    target: &mut Client,
    rewriter: &KeyRewriter,
    checkpoint_key: &[u8],
    leases: bool,
) -> anyhow::Result<G3> {
    let cp = target.get(checkpoint_key, None).await?;
    let at = cp.header().context("no header")?.revision();
    let Some(kv) = cp.kvs().first() else { return Ok(G3::NotYet) };
    let record = Checkpoint::decode(kv.value())?;
    if record.scanning {
        return Ok(G3::NotYet);
    }
    let w = record.watermark;
    let mut target_kvs = read_target(target, rewriter, at, leases).await?;
    let source_kvs = read_source(source, rewriter, w, leases).await?;
    if let Some(diff) = difference(source_kvs, &mut target_kvs) {
        return Err(G3Violation(format!("G3 violated at watermark {w} (target read at {at}): {diff}")).into());
    }
    Ok(G3::Holds { watermark: w, keys: target_kvs.len() })
}

/// Whether the target range equals the source range now (each read at its latest revision,
/// through the key rewrite): `None` when equal, else the first differences. Meaningful once the
/// source is quiet and the agent caught up.
pub async fn difference_now(
    source: &mut Client,
    target: &mut Client,
    rewriter: &KeyRewriter,
) -> anyhow::Result<Option<String>> {
    let source_kvs = read_source(source, rewriter, 0, false).await?;
    let mut target_kvs = read_target(target, rewriter, 0, false).await?;
    Ok(difference(source_kvs, &mut target_kvs))
}

/// The link's source range at `revision` (0 = latest), keys rewritten to the target's.
async fn read_source(
    source: &mut Client,
    rewriter: &KeyRewriter,
    revision: i64,
    leases: bool,
) -> anyhow::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut kvs = Vec::new();
    for window in rewriter.scan_windows() {
        for (k, v) in read_window_with(source, &window, revision, leases).await? {
            if let Some(t) = rewriter.to_target(&k) {
                kvs.push((t, v));
            }
        }
    }
    Ok(kvs)
}

/// The link's target range at `revision` (0 = latest).
async fn read_target(
    target: &mut Client,
    rewriter: &KeyRewriter,
    revision: i64,
    leases: bool,
) -> anyhow::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut kvs = Vec::new();
    for window in rewriter.target_windows() {
        kvs.extend(read_window_with(target, &window, revision, leases).await?);
    }
    Ok(kvs)
}

/// Sorts both and describes how they differ, if they do.
fn difference(
    mut source_kvs: Vec<(Vec<u8>, Vec<u8>)>,
    target_kvs: &mut [(Vec<u8>, Vec<u8>)],
) -> Option<String> {
    source_kvs.sort();
    target_kvs.sort();
    if source_kvs == target_kvs {
        return None;
    }
    let only_in = |a: &[(Vec<u8>, Vec<u8>)], b: &[(Vec<u8>, Vec<u8>)]| -> Vec<String> {
        a.iter()
            .filter(|kv| b.binary_search(kv).is_err())
            .take(5)
            .map(|(k, _)| String::from_utf8_lossy(k).into_owned())
            .collect()
    };
    Some(format!(
        "source has {} keys, target {}; missing/different in target: {:?}; extra/different in target: {:?}",
        source_kvs.len(),
        target_kvs.len(),
        only_in(&source_kvs, target_kvs),
        only_in(target_kvs, &source_kvs)
    ))
}
