//! Where the target stands when a run starts: a fresh restore of the source (proven to be the
//! source at its revision R0, or refused), or a replica this link already writes (resumed from
//! its checkpoint, or refused when something else wrote it since).

use etcd_client::{Client, GetOptions};
use mirror_core::{read_head, unary, Config, ExactRevision, Fault, Reason, Side};
use mirror_fence::{Checkpoint, ExactFence, Stamp};
use mirror_watch::SpoolReader;
use tracing::info;

use super::compare::compare_at;
use super::digest::{digest_at, SeedFile};
use super::{timeout, Stop};

/// Where the tail starts.
#[derive(Debug)]
pub(super) struct Placed {
    /// The fence of the link's Txns.
    pub fence: ExactFence,
    /// The last source revision the target holds.
    pub watermark: i64,
    /// The target's cluster ID, written into every record.
    pub target_cluster: u64,
    /// The source's cluster ID.
    pub source_cluster: u64,
    /// When the source was last known at or below the watermark (the record's
    /// `confirmed_time`; empty for a fresh seed).
    pub confirmed: String,
    /// Resumed from the link's checkpoint (else a fresh restore, proven).
    pub resumed: bool,
}

/// Reads the target's checkpoint and decides.
pub(super) async fn place(cfg: &Config, source: &Client, target: &Client) -> Result<Placed, Stop> {
    let key = cfg.checkpoint_key();
    let t = timeout(cfg);
    let (mut tkv, mut skv) = (target.kv_client(), source.kv_client());
    let resp = unary("read checkpoint", Side::Target, t, tkv.get(key.clone(), None)).await?;
    let head = resp.header().map_or(0, |h| h.revision());
    let target_cluster = resp.header().map_or(0, |h| h.cluster_id());
    let src = read_head(&mut skv, vec![0], "source revision", Side::Source, t).await?;
    let (source_head, source_cluster) = (src.revision, src.cluster_id);
    let placed = |fence, watermark, confirmed, resumed| Placed {
        fence,
        watermark,
        target_cluster,
        source_cluster,
        confirmed,
        resumed,
    };
    let Some(kv) = resp.kvs().first() else {
        prove_restore(cfg, source, target, head, source_head, source_cluster).await?;
        info!(r0 = head, "the target is the source's snapshot at its revision: the replica starts there");
        return Ok(placed(ExactFence::new(key, head), head, String::new(), false));
    };
    let record = Checkpoint::decode(kv.value()).map_err(|e| {
        Stop::lost(Reason::CorruptCheckpoint, format!("the checkpoint record cannot be read: {e}"))
    })?;
    if record.role == mirror_fence::Role::Primary {
        return Err(promoted(&record));
    }
    if record.link_uid != cfg.link_uid {
        return Err(Stop::lost(
            Reason::CheckpointTaken,
            format!("the checkpoint key holds link {:?}'s record", record.link_uid),
        ));
    }
    if record.target_cluster_id != target_cluster {
        return Err(Stop::lost(
            Reason::ReseedRequired,
            format!(
                "the target already holds this link's checkpoint, written to cluster {:x}, and is cluster {target_cluster:x}: \
                 it was restored from a snapshot of a replica, not of the source; restore it from `mirror-agent snapshot \
                 save` of the source",
                record.target_cluster_id
            ),
        ));
    }
    let stamp = Stamp { mod_revision: kv.mod_revision(), version: kv.version() };
    if record.watermark != stamp.mod_revision || head != stamp.mod_revision {
        return Err(Stop::lost(
            Reason::ForeignWrite,
            format!(
                "the target is at revision {head} and its checkpoint names source revision {} at target revision {}: \
                 something other than this link wrote the target",
                record.watermark, stamp.mod_revision
            ),
        ));
    }
    if source_head < head {
        return Err(Stop::lost(
            Reason::ReseedRequired,
            format!("the source is at revision {source_head}, behind the replica's {head}: it went back (restored?)"),
        ));
    }
    info!(watermark = head, "resuming the exact replica from its checkpoint");
    Ok(placed(ExactFence::from_stamp(key, stamp), head, record.confirmed_time, true))
}

/// Stops the link when the target's checkpoint says it was promoted (failover, cutover).
pub(super) async fn not_promoted(cfg: &Config, target: &Client) -> Result<(), Stop> {
    let mut kv = target.kv_client();
    let resp =
        unary("read checkpoint", Side::Target, timeout(cfg), kv.get(cfg.checkpoint_key(), None)).await?;
    match resp.kvs().first().map(|kv| Checkpoint::decode(kv.value())) {
        Some(Ok(record)) if record.role == mirror_fence::Role::Primary => Err(promoted(&record)),
        _ => Ok(()),
    }
}

/// The seed's spool (`sync.exact_seed`), read one revision at a time from the one after the
/// last received, as the tail has room for them (G6: a spool of minutes of a busy source is
/// never in memory at once). A gap is loss.
pub(super) struct SpoolReplay {
    path: std::path::PathBuf,
    reader: SpoolReader,
    /// The last revision read, or received before the replay started.
    last: i64,
    /// Revisions read.
    pub read: u64,
}

impl SpoolReplay {
    /// The spool, to be read after revision `received`; `None` without a seed.
    pub(super) fn open(cfg: &Config, received: i64) -> Result<Option<SpoolReplay>, Stop> {
        if cfg.sync.exact_seed.is_empty() {
            return Ok(None);
        }
        let path = super::digest::spool_path(std::path::Path::new(&cfg.sync.exact_seed));
        let reader = SpoolReader::open(&path).map_err(|e| spool_error(&path, e))?;
        Ok(Some(SpoolReplay { path, reader, last: received, read: 0 }))
    }

    /// The revision after the last one read; `None` where the spool ends (for now: `snapshot
    /// save` may still be appending).
    pub(super) fn next(&mut self) -> Result<Option<ExactRevision>, Stop> {
        while let Some(rev) = self.reader.read_next().map_err(|e| spool_error(&self.path, e))? {
            let want = self.last + 1;
            if rev.revision < want {
                continue;
            }
            if rev.revision > want {
                return Err(Stop::lost(
                    Reason::RevisionMissing,
                    format!(
                        "the spool {} holds revision {} after {}, not {want}",
                        self.path.display(),
                        rev.revision,
                        self.last
                    ),
                ));
            }
            self.last = rev.revision;
            self.read += 1;
            return Ok(Some(rev));
        }
        Ok(None)
    }

    /// The last revision read.
    pub(super) fn last(&self) -> i64 {
        self.last
    }
}

fn spool_error(path: &std::path::Path, e: mirror_watch::SpoolError) -> Stop {
    Stop::lost(Reason::ReseedRequired, format!("{}: {e}", path.display()))
}

/// The link stops: the target was promoted at `record`.
pub(super) fn promoted(record: &Checkpoint) -> Stop {
    Stop::lost(
        Reason::TargetPromoted,
        format!(
            "the target was promoted at source revision {} (epoch {}): this link writes it no more",
            record.watermark, record.epoch
        ),
    )
}

/// A target without the link's checkpoint must be the source's snapshot: its revision R0 is
/// one the source has reached and not compacted, and every key agrees at R0 in value, create
/// and mod revision, version and lease (reserved keys left out). Where the source compacted
/// past R0, the seed's digest of the source at R0 stands for the source ([`prove_by_seed`]).
async fn prove_restore(
    cfg: &Config,
    source: &Client,
    target: &Client,
    r0: i64,
    source_head: i64,
    source_cluster: u64,
) -> Result<(), Stop> {
    if source_head < r0 {
        return Err(Stop::lost(
            Reason::ReseedRequired,
            format!(
                "the target is at revision {r0}, ahead of the source at {source_head}: it is not a restore of this source"
            ),
        ));
    }
    if !cfg.sync.exact_seed.is_empty() && !source_holds(cfg, source, r0).await? {
        return prove_by_seed(cfg, target, r0, source_cluster).await;
    }
    let compacted = |e: mirror_core::EtcdError| {
        if e.fault == Fault::Compacted {
            Stop::lost(
                Reason::ReseedRequired,
                format!(
                    "the source compacted past the snapshot's revision {r0} before the link ran: its history from \
                     there is gone; save a new snapshot (mirror-agent snapshot save keeps it by spooling)"
                ),
            )
        } else {
            e.into()
        }
    };
    let found = compare_at(cfg, source, target, r0, 1, 1).await.map_err(compacted)?;
    if let Some(what) = found.shown.first() {
        return Err(Stop::lost(
            Reason::ReseedRequired,
            format!(
                "the target is at revision {r0} like the source there, but its content differs ({} keys agreed \
                 first): {what}; it is not a restore of this source's snapshot at {r0}",
                found.equal
            ),
        ));
    }
    let compared = found.equal;
    info!(keys = compared, r0, "every key agrees at the snapshot's revision");
    Ok(())
}

/// Whether the source still holds revision `r0` (a read there is not refused as compacted).
async fn source_holds(cfg: &Config, source: &Client, r0: i64) -> Result<bool, Stop> {
    let mut kv = source.kv_client();
    let read = kv.get(vec![0], Some(GetOptions::new().with_count_only().with_revision(r0)));
    match unary("source at R0", Side::Source, timeout(cfg), read).await {
        Ok(_) => Ok(true),
        Err(e) if e.fault == Fault::Compacted => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The source compacted past R0: the seed's digest, taken from the source at R0 when the
/// snapshot was saved, stands for it; the target at R0 must digest the same.
async fn prove_by_seed(cfg: &Config, target: &Client, r0: i64, source_cluster: u64) -> Result<(), Stop> {
    let path = std::path::Path::new(&cfg.sync.exact_seed);
    let seed = SeedFile::read(path).map_err(|e| Stop::lost(Reason::ReseedRequired, format!("{e:#}")))?;
    let refuse = |what: String| {
        Stop::lost(Reason::ReseedRequired, format!("the target is not the seed {}: {what}", path.display()))
    };
    if seed.link_uid != cfg.link_uid {
        return Err(refuse(format!("it was saved for link {:?}", seed.link_uid)));
    }
    if seed.source_cluster_id != source_cluster {
        return Err(refuse(format!(
            "it was saved from cluster {:x}, and the source is {source_cluster:x}",
            seed.source_cluster_id
        )));
    }
    let Some(digest) = seed.digest else {
        return Err(refuse("it holds no digest (the source compacted before it was taken)".into()));
    };
    if digest.revision != r0 {
        return Err(refuse(format!(
            "the target is at revision {r0} and the snapshot at {}",
            digest.revision
        )));
    }
    let ours = digest_at(cfg, target, Side::Target, r0).await?;
    if ours != digest {
        return Err(refuse(format!(
            "at revision {r0} the target holds {} keys with digest {}, the source held {} with {}",
            ours.keys, ours.sha256, digest.keys, digest.sha256
        )));
    }
    info!(r0, keys = ours.keys, "the target digests as the seed's source did at R0");
    Ok(())
}
