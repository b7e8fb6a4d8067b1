//! Other links' checkpoints found where this link reads or writes: a foreign link under the
//! destination range (nested or overlapping), and a link that writes back into this source.

use etcd_client::KvClient;
use mirror_core::{EtcdError, KeyRewriter, Pager, PagerOptions, Side};

/// Another link whose reserved namespace lies inside this link's destination range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForeignLink {
    /// Its `link_uid` as its checkpoint says, or `"unknown"` when the checkpoint is absent or
    /// unreadable.
    pub link_uid: String,
    /// Its reserved namespace (a target key).
    pub namespace: Vec<u8>,
}

/// The first other link found inside the destination range of `rewriter`, by a keys-only pass
/// over the target windows. Prunes and orphan deletes run only when there is none: such a
/// link's data looks like orphans of ours.
pub async fn find_foreign_link(
    kv: KvClient,
    rewriter: &KeyRewriter,
    page: PagerOptions,
) -> Result<Option<ForeignLink>, EtcdError> {
    let timeout = page.timeout;
    let mut pager = Pager::new(kv.clone(), Side::Target, rewriter.target_windows(), page);
    while let Some(kvs) = pager.next_page().await? {
        let Some(namespace) = kvs.iter().find_map(|kv| rewriter.foreign_namespace(kv.key())) else {
            continue;
        };
        let key = [namespace.as_slice(), b"checkpoint"].concat();
        let mut kv = kv;
        let resp =
            mirror_core::unary("read other checkpoint", Side::Target, timeout, kv.get(key, None)).await?;
        let link_uid = resp
            .kvs()
            .first()
            .and_then(|kv| mirror_fence::Checkpoint::decode(kv.value()).ok())
            .map_or_else(|| "unknown".to_owned(), |record| record.link_uid);
        return Ok(Some(ForeignLink { link_uid, namespace }));
    }
    Ok(None)
}

/// The destination prefixes of every other link nested in the destination range of `rewriter`
/// (each found by its reserved namespace, by a keys-only pass over the target windows). Every
/// key under one of them is that link's: no pass of ours may delete it, whatever its mod
/// revision says.
pub async fn foreign_dest_prefixes(
    kv: KvClient,
    rewriter: &KeyRewriter,
    page: PagerOptions,
) -> Result<Vec<Vec<u8>>, EtcdError> {
    let marker = mirror_core::RESERVED_MARKER.len();
    let mut prefixes: Vec<Vec<u8>> = Vec::new();
    let mut pager = Pager::new(kv, Side::Target, rewriter.target_windows(), page);
    while let Some(kvs) = pager.next_page().await? {
        for namespace in kvs.iter().filter_map(|kv| rewriter.foreign_namespace(kv.key())) {
            let prefix = namespace[..namespace.len() - marker].to_vec();
            if !prefixes.contains(&prefix) {
                prefixes.push(prefix);
            }
        }
    }
    Ok(prefixes)
}

/// A link writing *into* this link's source range from this link's target cluster: together the
/// two would echo every write back and forth forever.
///
/// Its checkpoint lies at `P + "\0etcd-mirror/checkpoint"` in our source cluster for some
/// prefix `P` of our source prefix (its destination covers our source range), and names our
/// target cluster as its source and our source cluster as its target, and it is not promoted
/// (role `primary`: a failback's forward link). Every such `P` is read
/// in one Txn of point Gets: no scan. (A link whose destination is nested strictly inside our
/// source range is not looked for here; its checkpoint is never replicated either way.)
pub async fn find_reverse_link(
    source: &mut KvClient,
    rewriter: &KeyRewriter,
    source_cluster: u64,
    target_cluster: u64,
    timeout: std::time::Duration,
) -> Result<Option<ForeignLink>, EtcdError> {
    let prefix = rewriter.source_prefix();
    let keys: Vec<Vec<u8>> = (0..=prefix.len())
        .map(|n| [&prefix[..n], mirror_core::RESERVED_MARKER.as_bytes(), b"checkpoint"].concat())
        .collect();
    let records = match read_points(source, &keys, timeout).await {
        Ok(records) => records,
        // A user limited to its range may not read the keys above it: ask one by one and skip
        // what it may not read (no link it cannot see can be writing into its range through
        // its own credentials' view).
        Err(e) if e.fault == mirror_core::Fault::PermissionDenied => {
            let mut records = Vec::new();
            for key in &keys {
                match read_points(source, std::slice::from_ref(key), timeout).await {
                    Ok(mut one) => records.append(&mut one),
                    Err(e) if e.fault == mirror_core::Fault::PermissionDenied => records.push(None),
                    Err(e) => return Err(e),
                }
            }
            records
        }
        Err(e) => return Err(e),
    };
    for (key, value) in keys.iter().zip(records) {
        let Some(record) = value.and_then(|v| mirror_fence::Checkpoint::decode(&v).ok()) else { continue };
        // A promoted link (cut over or failed over) never writes again: nothing echoes, and
        // mirroring back from its target is exactly a failback.
        if record.role == mirror_fence::Role::Primary {
            continue;
        }
        if record.source_cluster_id == target_cluster && record.target_cluster_id == source_cluster {
            let namespace = key[..key.len() - b"checkpoint".len()].to_vec();
            return Ok(Some(ForeignLink { link_uid: record.link_uid, namespace }));
        }
    }
    Ok(None)
}

/// The values of `keys` (None where absent), in one Txn of point Gets.
async fn read_points(
    kv: &mut KvClient,
    keys: &[Vec<u8>],
    timeout: std::time::Duration,
) -> Result<Vec<Option<Vec<u8>>>, EtcdError> {
    let gets: Vec<etcd_client::TxnOp> =
        keys.iter().map(|k| etcd_client::TxnOp::get(k.clone(), None)).collect();
    let resp = mirror_core::unary(
        "read points",
        Side::Source,
        timeout,
        kv.txn(etcd_client::Txn::new().and_then(gets)),
    )
    .await?;
    Ok(resp
        .op_responses()
        .into_iter()
        .map(|op| match op {
            etcd_client::TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        })
        .collect())
}
