//! What proves a restored target is the snapshot when the source has already compacted past
//! its revision R0: a digest of every key at R0 (value, create and mod revision, version,
//! lease; reserved keys left out) that `snapshot save` takes from the source right after the
//! snapshot and writes beside it (`FILE.json`), and the agent takes again from the target.

use std::path::{Path, PathBuf};

use etcd_client::Client;
use mirror_core::{Config, EtcdError, KeyRange, PagerOptions, Side, RESERVED_MARKER};
use mirror_reconcile::RangeReader;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// A keyspace at one revision, digested.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Digest {
    /// The revision it was read at.
    pub revision: i64,
    /// Keys read (reserved ones left out).
    pub keys: u64,
    /// SHA-256 over every key's fields, length-prefixed, hex.
    pub sha256: String,
}

/// Reads every key of `client`'s cluster at `revision` and digests it.
pub(crate) async fn digest_at(
    cfg: &Config,
    client: &Client,
    side: Side,
    revision: i64,
) -> Result<Digest, EtcdError> {
    let page = PagerOptions::new(
        "digest",
        cfg.sync.page_key_limit,
        cfg.sync.page_bytes.bytes() as usize,
        cfg.sync.request_timeout.get(),
    )
    .at_revision(revision);
    let all = vec![KeyRange { start: vec![0], end: vec![0] }];
    let mut reader = RangeReader::new(client.kv_client(), side, all, page);
    let mut hash = Sha256::new();
    let mut keys = 0;
    while let Some(kv) = reader.next().await? {
        if kv.key().starts_with(RESERVED_MARKER.as_bytes()) {
            continue;
        }
        for bytes in [kv.key(), kv.value()] {
            hash.update((bytes.len() as u64).to_be_bytes());
            hash.update(bytes);
        }
        for n in [kv.create_revision(), kv.mod_revision(), kv.version(), kv.lease()] {
            hash.update(n.to_be_bytes());
        }
        keys += 1;
    }
    Ok(Digest { revision, keys, sha256: hex::encode(hash.finalize()) })
}

/// `FILE.json` beside a snapshot `snapshot save` wrote.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SeedFile {
    /// The link it was saved for.
    pub link_uid: String,
    /// The source's cluster ID.
    pub source_cluster_id: u64,
    /// The source at the snapshot's revision R0 (`None`: compacted before it could be read).
    pub digest: Option<Digest>,
    /// The first revision in the spool.
    pub spool_from: i64,
}

impl SeedFile {
    /// `FILE.json`.
    pub fn path(snapshot: &Path) -> PathBuf {
        with_suffix(snapshot, ".json")
    }

    /// Reads `FILE.json`.
    pub fn read(snapshot: &Path) -> anyhow::Result<SeedFile> {
        let path = SeedFile::path(snapshot);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }
}

/// `FILE.spool`.
pub(crate) fn spool_path(snapshot: &Path) -> PathBuf {
    with_suffix(snapshot, ".spool")
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}
