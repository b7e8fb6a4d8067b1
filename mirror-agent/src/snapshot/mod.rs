//! `mirror-agent snapshot save FILE`: the seed of an exact replica with no deadline against
//! the source's compaction (SPEC §10, Seed).
//!
//! 1. Opens a watch of the source's whole keyspace at its current revision H + 1 and spools
//!    every revision to `FILE.spool` from then on ([`mirror_watch::SpoolWriter`]).
//! 2. Streams the source's snapshot to `FILE` (admin credentials: `--admin-user`), then reads
//!    its revision R0 from the file ([`bolt::revision`]); R0 >= H, so the spool covers R0 + 1.
//! 3. Digests the source at R0 into `FILE.json`, which proves a restore later even when the
//!    source has compacted past R0 by then.
//! 4. Prints R0 and the restore commands, and keeps spooling until the link's checkpoint on the
//!    target has passed the source's compacted revision: from then on the source's own history
//!    covers the link, and the spool is no longer needed.
//!
//! Ctrl-C (or SIGTERM) at any step exits 1: before step 3 ends, the partial files are removed
//! (a failed step removes them too); after it, the snapshot, seed file and spool stay.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use etcd_client::Client;
use mirror_core::{connect_reachable, read_head, read_password, Auth, Config, EtcdError, Head, Side};
use mirror_watch::{ExactDelivery, ExactWatch, SpoolWriter};
use tokio::io::AsyncWriteExt as _;
use tokio_util::task::AbortOnDropHandle;

use crate::exact::digest::{digest_at, spool_path, SeedFile};
use crate::exit::Exit;

pub mod bolt;

/// Admin credentials of their own for the Snapshot call (the link's source user may read only).
pub struct Admin {
    /// The etcd user.
    pub user: String,
    /// A file holding its password.
    pub password_file: PathBuf,
}

/// Runs `snapshot save`.
pub async fn save(cfg: Config, file: PathBuf, admin: Option<Admin>) -> ExitCode {
    crate::exit::reported("snapshot save", run(&cfg, &file, admin).await, Exit::No)
}

async fn run(cfg: &Config, file: &Path, admin: Option<Admin>) -> anyhow::Result<Exit> {
    if !cfg.exact() {
        eprintln!("mirror-agent snapshot save: the config's sync.revisions is not \"exact\"; a snapshot seeds only an exact replica");
        return Ok(Exit::Config);
    }
    let spool = spool_path(file);
    for path in [file.to_path_buf(), spool.clone(), SeedFile::path(file)] {
        if path.exists() {
            eprintln!("mirror-agent snapshot save: {} exists; it is never overwritten", path.display());
            return Ok(Exit::CannotStart);
        }
    }
    // From here on a Ctrl-C (or SIGTERM) ends the command with exit 1 and a word on what it
    // leaves: installed before the first step, so no stage dies of the default action.
    let mut stop = Stop::install()?;
    // A seed that did not complete is of no use and would block the next try ("never
    // overwritten"): its partial files go. None of them existed before this run.
    let partial = || {
        for path in [file.to_path_buf(), part_path(file), spool.clone(), SeedFile::path(file)] {
            let _ = std::fs::remove_file(path);
        }
    };
    let saved = tokio::select! {
        saved = seed(cfg, file, &spool, admin) => saved.inspect_err(|_| partial())?,
        () = stop.recv() => {
            partial();
            println!("Stopped before the seed was complete: its partial files are removed.");
            return Ok(Exit::No);
        }
    };
    let Some(Saved { spooler, spooled, r0, bytes, seed }) = saved else { return Ok(Exit::CannotStart) };

    // 4. What to do next, then spool until the link runs.
    print_next_steps(cfg, file, r0, bytes, &seed);
    let until = link_runs(cfg);
    tokio::select! {
        ended = spooler => {
            let err = ended.map_err(|e| anyhow::anyhow!("the spool task failed: {e}"))?;
            return Err(err.context("spooling stopped before the link ran; the seed's deadline is now the source's compaction"));
        }
        at = until => {
            let (last, size) = *spooled.borrow();
            println!(
                "The link runs at source revision {at}, past the source's compaction: the spool (up to revision {last}, \
                 {size} bytes) is no longer needed."
            );
        }
        () = stop.recv() => {
            let (last, _) = *spooled.borrow();
            println!("Stopped: the spool ends at source revision {last}; from there the seed's deadline is the source's compaction.");
            return Ok(Exit::No);
        }
    }
    Ok(Exit::Done)
}

/// What steps 1-3 leave: the spool task, its progress (last revision, bytes), and the seed.
struct Saved {
    spooler: AbortOnDropHandle<anyhow::Error>,
    spooled: tokio::sync::watch::Receiver<(i64, u64)>,
    r0: i64,
    bytes: u64,
    seed: SeedFile,
}

/// Steps 1-3: the spool from H + 1, the snapshot, the digest at R0 and the seed file. `None`
/// when the source cannot be reached (said on stderr).
async fn seed(
    cfg: &Config,
    file: &Path,
    spool: &Path,
    admin: Option<Admin>,
) -> anyhow::Result<Option<Saved>> {
    let mut side = cfg.source.clone();
    if let Some(admin) = &admin {
        let auth = Auth {
            username: admin.user.clone(),
            password_file: Some(admin.password_file.clone()),
            password_env: None,
            password: None,
        };
        // Read now, so a bad file fails before anything is written.
        read_password(&auth).map_err(|e| anyhow::anyhow!("--admin-password-file: {e}"))?;
        side.auth = Some(auth);
    }
    let mut source = match connect_reachable(Side::Source, &side, &cfg.sync).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mirror-agent snapshot save: {e}");
            return Ok(None);
        }
    };
    let t = cfg.sync.request_timeout.get();
    let Head { revision: h, cluster_id: cluster } =
        read_head(&mut source.kv_client(), vec![0], "source revision", Side::Source, t).await?;

    // 1. The spool, from H + 1, before the snapshot starts.
    let watch = ExactWatch::open(&mut source, h + 1).await?;
    let writer = SpoolWriter::create(spool)?;
    let (spooled_tx, spooled) = tokio::sync::watch::channel((h, 0u64));
    let spooler = AbortOnDropHandle::new(tokio::spawn(spool_forever(watch, writer, spooled_tx)));

    // 2. The snapshot.
    let bytes = stream_snapshot(&mut source, file).await?;
    let image = tokio::fs::read(file).await?;
    let r0 = bolt::revision(&image)?.unwrap_or(0);
    drop(image);
    anyhow::ensure!(r0 >= h, "the snapshot's revision {r0} is below {h}, read before it started");

    // 3. The digest at R0 (the source may compact past it any time: then none).
    let digest = match digest_at(cfg, &source, Side::Source, r0).await {
        Ok(d) => Some(d),
        Err(e) if e.fault == mirror_core::Fault::Compacted => None,
        Err(e) => return Err(e.into()),
    };
    let seed =
        SeedFile { link_uid: cfg.link_uid.clone(), source_cluster_id: cluster, digest, spool_from: h + 1 };
    std::fs::write(SeedFile::path(file), serde_json::to_vec_pretty(&seed)?)?;
    Ok(Some(Saved { spooler, spooled, r0, bytes, seed }))
}

/// SIGINT and SIGTERM, caught from the moment [`Stop::install`] returns.
struct Stop {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Stop {
    fn install() -> std::io::Result<Stop> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Stop { int: signal(SignalKind::interrupt())?, term: signal(SignalKind::terminate())? })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
    }
}

/// Appends every revision the watch delivers to the spool, synced after each response.
async fn spool_forever(
    mut watch: ExactWatch,
    mut spool: SpoolWriter,
    spooled: tokio::sync::watch::Sender<(i64, u64)>,
) -> anyhow::Error {
    loop {
        match watch.next().await {
            Ok(ExactDelivery::Revisions { revisions, .. }) => {
                for rev in &revisions {
                    if let Err(e) = spool.append(rev) {
                        return anyhow::anyhow!("writing the spool (is its disk full?): {e}");
                    }
                }
                if let Err(e) = spool.sync() {
                    return anyhow::anyhow!("syncing the spool (is its disk full?): {e}");
                }
                let last = revisions.last().map_or(spooled.borrow().0, |r| r.revision);
                spooled.send_replace((last, spool.bytes()));
            }
            Ok(ExactDelivery::Reply(_)) => {}
            Ok(ExactDelivery::Compacted(at)) => {
                return anyhow::anyhow!("the source compacted to {at} before the spool read that far")
            }
            Err(e) => return anyhow::anyhow!("{e}"),
        }
    }
}

fn part_path(file: &Path) -> PathBuf {
    PathBuf::from(format!("{}.part", file.display()))
}

/// Streams the Snapshot to `FILE.part`, then renames it to `file`; shows a progress bar.
async fn stream_snapshot(source: &mut Client, file: &Path) -> anyhow::Result<u64> {
    let part = part_path(file);
    let mut out = tokio::fs::File::create(&part).await?;
    let mut stream = source.maintenance_client().snapshot().await?;
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("snapshot {bytes}/{total_bytes} {wide_bar} {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut written = 0u64;
    while let Some(part) = stream.message().await? {
        out.write_all(part.blob()).await?;
        written += part.blob().len() as u64;
        bar.set_length(written + part.remaining_bytes());
        bar.set_position(written);
    }
    out.sync_all().await?;
    drop(out);
    bar.finish_and_clear();
    tokio::fs::rename(&part, file).await?;
    Ok(written)
}

fn print_next_steps(cfg: &Config, file: &Path, r0: i64, bytes: u64, seed: &SeedFile) {
    let token = format!("{}-{}", cfg.link_uid, &crate::engine::hostname());
    let token = format!("{token}-{}", std::process::id());
    println!("Snapshot: {} ({bytes} bytes) at source revision R0 = {r0}.", file.display());
    println!(
        "Spool: {} holds every source revision from {} on, and grows until the link runs.",
        spool_path(file).display(),
        seed.spool_from
    );
    match &seed.digest {
        Some(d) => println!("Digest of the source at R0: {} keys, sha256 {}.", d.keys, d.sha256),
        None => println!("The source compacted past R0 before it could be digested: the restore is checked by revision only."),
    }
    println!("\nRestore every target member from it with a FRESH cluster token (the same URLs and token give the same cluster ID):");
    for (i, endpoint) in cfg.target.endpoints.iter().enumerate() {
        println!(
            "  # member {} ({endpoint}):\n  etcdutl snapshot restore {} --data-dir <data-dir> --name <member-{i}> \
             --initial-cluster <name=peer-url,...> --initial-advertise-peer-urls <peer-url> --initial-cluster-token {token}",
            i + 1,
            file.display()
        );
    }
    println!("  (etcd 3.4: ETCDCTL_API=3 etcdctl snapshot restore, same flags)");
    println!(
        "\nThen start the target members with --auto-compaction-retention=0 (the agent compacts the target where the source \
         does) and --max-request-bytes=33554432 (a lease running out lands as one Txn deleting all its keys), change the \
         target's credentials (the restore copied the source's users and roles; the link's user needs readwrite on every \
         key and, on etcd 3.5, the root role to compact), set sync.exact_seed = {:?} and start the agent. This command \
         keeps spooling until the link runs; Ctrl-C stops it.",
        file.display().to_string()
    );
}

/// Waits until the link's checkpoint on the target names a revision at or past the source's
/// compacted revision (the source's history then covers the link); returns that revision.
async fn link_runs(cfg: &Config) -> i64 {
    let key = cfg.checkpoint_key();
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let Ok(watermark) = watermark(cfg, &key).await else { continue };
        let Some(watermark) = watermark else { continue };
        let Ok(mut source) = connect_reachable(Side::Source, &cfg.source, &cfg.sync).await else { continue };
        let compacted = crate::exact::compacted_revision(&mut source, cfg).await.ok().flatten().unwrap_or(0);
        if watermark >= compacted {
            return watermark;
        }
    }
}

async fn watermark(cfg: &Config, key: &[u8]) -> Result<Option<i64>, EtcdError> {
    let mut target = connect_reachable(Side::Target, &cfg.target, &cfg.sync).await?;
    let resp = target
        .get(key.to_vec(), None)
        .await
        .map_err(|e| EtcdError::new("read checkpoint", Side::Target, e))?;
    Ok(resp
        .kvs()
        .first()
        .and_then(|kv| mirror_fence::Checkpoint::decode(kv.value()).ok())
        .map(|c| c.watermark))
}
