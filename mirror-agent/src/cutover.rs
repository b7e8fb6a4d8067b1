//! `mirror-agent cutover --config F [--wait]`: drain, verify and promote from a shell.
//!
//! It claims the fence with the stored epoch + 1, so a running daemon of the link becomes a
//! standby at its next write and writes nothing more; then it runs the engine in drain mode in
//! this process: catch up to the drain target revision, compare both sides (one repair pass if
//! they differ), and promote the target (checkpoint role `primary`). With `--wait` it prints the
//! cutover block and exits 0 only when verified. Without it ([`start`]) the same runs in a
//! detached process, and the command returns once that process holds the fence: the drain has
//! started and no agent of the link writes any more; the outcome is in its log and, once
//! promoted, in the checkpoint (`verify` then exits 0).

use crate::exit::Exit;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use mirror_core::{connect_reachable, Config, Mode, Phase, Side, Status};
use mirror_fence::{read_checkpoint, Checkpoint, Observed, Role};
use tokio_util::sync::CancellationToken;

use crate::engine::Engine;

/// With `ha.enabled`, holds the link's cutover key until released (the HA replicas stand by).
async fn hold_cutover_key(config: &Config) -> anyhow::Result<Option<mirror_fence::election::CutoverHold>> {
    if !config.ha.enabled {
        return Ok(None);
    }
    let target = connect_reachable(Side::Target, &config.target, &config.sync).await?;
    let reserved = config.rewriter().reserved_prefix();
    let me = format!("cutover/{}/{}", crate::engine::hostname(), std::process::id());
    let ttl = config.ha.lease_ttl.get();
    let timeout = config.sync.request_timeout.get();
    Ok(Some(mirror_fence::election::hold_cutover(&target, &reserved, &me, ttl, timeout).await?))
}

/// The link's stored checkpoint, or the exit code that ends the command: 3 when there is none
/// or it cannot be read, 0 when the target is primary already (said on stdout).
async fn stored_record(config: &Config) -> Result<Checkpoint, ExitCode> {
    let timeout = config.sync.request_timeout.get();
    let stored = async {
        let target = connect_reachable(Side::Target, &config.target, &config.sync).await?;
        anyhow::Ok(read_checkpoint(&mut target.kv_client(), &config.checkpoint_key(), timeout).await?)
    }
    .await;
    let record = match stored {
        Ok(Observed::Present { record, .. }) => record,
        Ok(Observed::Absent) => {
            eprintln!(
                "mirror-agent cutover: no checkpoint in the target: nothing has been mirrored to cut over"
            );
            return Err(ExitCode::from(Exit::CannotStart));
        }
        Err(e) => {
            eprintln!("mirror-agent cutover: cannot read the checkpoint: {e:#}");
            return Err(ExitCode::from(Exit::CannotStart));
        }
    };
    if record.role == Role::Primary {
        println!("already cut over: the target is primary (watermark {})", record.watermark);
        return Err(ExitCode::SUCCESS);
    }
    Ok(record)
}

/// How long a detached cutover has to claim the fence before [`start`] gives up waiting.
const DETACHED_CLAIM_WAIT: Duration = Duration::from_secs(60);

/// `cutover` without `--wait`: starts `cutover --wait` as a detached process (its own process
/// group, so the shell's signals and exit leave it running; stdout and stderr to `log`) and
/// returns once it holds the fence at a newer epoch than the stored one, the drain started.
/// Exit 0 then; the detached process's own exit code if it ends first (3: nothing happened,
/// 1: refused); 1 if it has not claimed within [`DETACHED_CLAIM_WAIT`] (it keeps running).
pub async fn start(
    config: Config,
    file: PathBuf,
    allow_moving_source: bool,
    log: Option<PathBuf>,
) -> ExitCode {
    let record = match stored_record(&config).await {
        Ok(record) => record,
        Err(code) => return code,
    };
    let log = log.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("mirror-cutover-{}-{}.log", config.link_uid, std::process::id()))
    });
    let spawned = (|| {
        let out = std::fs::File::create(&log)?;
        let mut command = std::process::Command::new(std::env::current_exe()?);
        command.arg("cutover").arg("--config").arg(std::path::absolute(&file)?).arg("--wait");
        if allow_moving_source {
            command.arg("--allow-moving-source");
        }
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        command.stdin(std::process::Stdio::null()).stdout(out.try_clone()?).stderr(out).spawn()
    })();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            eprintln!("mirror-agent cutover: cannot start the cutover process (log {}): {e}", log.display());
            return ExitCode::from(Exit::CannotStart);
        }
    };
    let pid = child.id();
    let (timeout, key) = (config.sync.request_timeout.get(), config.checkpoint_key());
    let started = tokio::time::Instant::now();
    let mut target = None;
    let claim_wait = failpoint::detached_claim_wait().unwrap_or(DETACHED_CLAIM_WAIT);
    while started.elapsed() < claim_wait {
        if let Ok(Some(status)) = child.try_wait() {
            let said = std::fs::read_to_string(&log).unwrap_or_default();
            eprint!("{said}");
            eprintln!(
                "mirror-agent cutover: the cutover process {pid} ended before the drain started ({status})"
            );
            return ExitCode::from(status.code().and_then(|c| u8::try_from(c).ok()).unwrap_or(1));
        }
        if target.is_none() {
            target = connect_reachable(Side::Target, &config.target, &config.sync).await.ok();
        }
        if let Some(client) = target.as_ref() {
            if let Ok(Observed::Present { record: now, .. }) =
                read_checkpoint(&mut client.kv_client(), &key, timeout).await
            {
                if now.epoch > record.epoch || now.role == Role::Primary {
                    println!(
                        "cutover started: process {pid} holds the fence at epoch {} (was {}); it drains, \
                         verifies and promotes on its own, output in {}. The target is primary once \
                         `mirror-agent verify --config {}` exits 0 and the checkpoint's role is primary.",
                        now.epoch,
                        record.epoch,
                        log.display(),
                        file.display()
                    );
                    return ExitCode::SUCCESS;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "mirror-agent cutover: process {pid} has not claimed the fence within {claim_wait:?}; it keeps \
         trying (output in {}); `kill {pid}` stops it",
        log.display()
    );
    ExitCode::from(Exit::No)
}

/// Test hooks, armed only with the `failpoints` feature (`mirror_core::failpoint`).
mod failpoint {
    use std::time::Duration;

    /// `MIRROR_FAILPOINT_DETACHED_CLAIM_WAIT=2s`: how long `cutover` (no `--wait`) waits for its
    /// process to claim, instead of a minute.
    pub(super) fn detached_claim_wait() -> Option<Duration> {
        humantime::parse_duration(&mirror_core::failpoint::armed("DETACHED_CLAIM_WAIT")?).ok()
    }
}

/// Runs the cutover (`--wait`).
pub async fn cutover(mut config: Config, allow_moving_source: bool) -> ExitCode {
    let timeout = config.sync.request_timeout.get();
    let record = match stored_record(&config).await {
        Ok(record) => record,
        Err(code) => return code,
    };
    config.mode = Mode::Drain;
    config.epoch = record.epoch as i64 + 1;
    // The cutover claims the fence outright; it never campaigns (a running HA leader is
    // fenced by the higher epoch like any other writer, and a promoted target stops them all).
    // It holds the link's cutover key meanwhile, so no HA replica claims the fence back while
    // it drains (mirror_fence::election, "A cutover in progress").
    let hold = match hold_cutover_key(&config).await {
        Ok(hold) => hold,
        Err(e) => {
            eprintln!("mirror-agent cutover: cannot hold the cutover key for the HA replicas: {e:#}");
            return ExitCode::from(Exit::CannotStart);
        }
    };
    config.ha.enabled = false;
    eprintln!(
        "cutover: claiming the fence with epoch {} (a running agent of epoch {} stands by)",
        config.epoch, record.epoch
    );

    let status = Arc::new(RwLock::new(Status::default()));
    let shutdown = CancellationToken::new();
    let engine = Engine::new(config.clone(), status.clone(), shutdown.clone());
    let compared = engine.comparison_progress();
    let engine = tokio::spawn(engine.run());
    let mut progress = crate::progress::Progress::new("cutover", 0);
    let final_status = loop {
        let s = status.read().expect("status lock").clone();
        if matches!(s.phase, Phase::Drained | Phase::Failed | Phase::Standby) {
            break s;
        }
        progress.set(0, stage(&s, compared.load(std::sync::atomic::Ordering::Relaxed)));
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    progress.finish();
    shutdown.cancel();
    let _ = engine.await;
    if let Some(hold) = hold {
        hold.release(timeout).await;
    }

    if final_status.phase != Phase::Drained {
        let why = final_status.last_error.map(|e| format!("{}: {}", e.reason, e.message)).unwrap_or_default();
        eprintln!("mirror-agent cutover: not cut over (phase {}): {why}", final_status.phase.as_str());
        return ExitCode::from(Exit::No);
    }
    let block = final_status.cutover.clone().unwrap_or_default();
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({ "cutover": block })).unwrap_or_default()
    );

    match changed_after(&config, block.drained_revision).await {
        Ok(moved) if moved.total() == 0 => ExitCode::SUCCESS,
        Ok(moved) => {
            eprintln!(
                "mirror-agent cutover: the source kept changing after the drained revision {}: {} keys in range \
                 were written and {} deleted by revision {} ({} revisions later); stop the writers first{}",
                block.drained_revision,
                moved.written,
                moved.deleted,
                moved.now,
                moved.now - block.drained_revision,
                if allow_moving_source { " (allowed by --allow-moving-source)" } else { "" }
            );
            if allow_moving_source {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(Exit::PromotedSourceMoved)
            }
        }
        Err(e) => {
            eprintln!(
                "mirror-agent cutover: verified and promoted (the target is primary), but could not check \
                 the source for writes after the drained revision: {e:#}"
            );
            ExitCode::from(Exit::PromotedUnchecked)
        }
    }
}

/// The cutover's stage, for the progress line: what comes before its `:` names the stage.
fn stage(s: &Status, compared: u64) -> String {
    let drain_target = s.cutover.as_ref().map_or(0, |c| c.drain_target_revision);
    match s.phase {
        Phase::Connecting => "connecting: claiming the fence".to_owned(),
        Phase::InitialSync => {
            format!("initial-sync: {}/{} keys copied", s.initial_sync.keys, s.initial_sync.total_keys)
        }
        Phase::Degraded => format!(
            "degraded: {}",
            s.last_error.as_ref().map(|e| e.reason.as_str()).unwrap_or("waiting to retry")
        ),
        _ if drain_target == 0 => {
            format!("catching-up: watermark {} (source {})", s.watermark, s.source_revision)
        }
        _ if s.watermark < drain_target => {
            format!("draining: watermark {} of drain target {drain_target}", s.watermark)
        }
        _ => format!("verifying: {compared} source keys compared at revision {}", s.watermark),
    }
}

/// What changed in the source range after the drained revision.
struct Moved {
    /// Keys put (created or overwritten) after it and still present.
    written: u64,
    /// Keys present at it and gone now.
    deleted: u64,
    /// The source revision compared against.
    now: i64,
}

impl Moved {
    fn total(&self) -> u64 {
        self.written + self.deleted
    }
}

/// Merge-joins the source range pinned at `drained` with the same range pinned at the current
/// revision, keys only, paged ([`mirror_reconcile::RangeReader`]): a key only in the later read
/// or with a later mod revision was written, a key only in the earlier one was deleted. (A
/// min_mod_revision Get could not see deletes, and answered in one unpaged response.)
async fn changed_after(config: &Config, drained: i64) -> anyhow::Result<Moved> {
    let source = connect_reachable(Side::Source, &config.source, &config.sync).await?;
    let timeout = config.sync.request_timeout.get();
    let windows = config.rewriter().scan_windows();
    let (_, now) = mirror_scan::count(&mut source.kv_client(), &windows, None, Side::Source, timeout).await?;
    let page = |at: i64| {
        mirror_core::PagerOptions::new(
            "cutover history page",
            config.sync.page_key_limit,
            config.sync.page_bytes.bytes() as usize,
            timeout,
        )
        .at_revision(at)
        .keys_only()
    };
    let reader = |at: i64| {
        mirror_reconcile::RangeReader::new(source.kv_client(), Side::Source, windows.clone(), page(at))
    };
    let (mut before, mut after) = (reader(drained), reader(now));
    let mut moved = Moved { written: 0, deleted: 0, now };
    let (mut b, mut a) = (before.next().await?, after.next().await?);
    loop {
        match (&b, &a) {
            (None, None) => return Ok(moved),
            (Some(_), None) => {
                moved.deleted += 1;
                b = before.next().await?;
            }
            (None, Some(_)) => {
                moved.written += 1;
                a = after.next().await?;
            }
            (Some(x), Some(y)) => match x.key().cmp(y.key()) {
                std::cmp::Ordering::Less => {
                    moved.deleted += 1;
                    b = before.next().await?;
                }
                std::cmp::Ordering::Greater => {
                    moved.written += 1;
                    a = after.next().await?;
                }
                std::cmp::Ordering::Equal => {
                    moved.written += u64::from(y.mod_revision() > drained);
                    b = before.next().await?;
                    a = after.next().await?;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(phase: Phase, watermark: i64, drain_target: i64) -> Status {
        Status {
            phase,
            watermark,
            source_revision: 120,
            cutover: (drain_target > 0).then(|| mirror_core::CutoverStatus {
                drain_target_revision: drain_target,
                ..Default::default()
            }),
            ..Status::default()
        }
    }

    #[test]
    fn the_stage_follows_the_drain() {
        assert_eq!(stage(&status(Phase::Connecting, 0, 0), 0), "connecting: claiming the fence");
        assert_eq!(stage(&status(Phase::Syncing, 90, 0), 0), "catching-up: watermark 90 (source 120)");
        assert_eq!(stage(&status(Phase::Syncing, 90, 100), 0), "draining: watermark 90 of drain target 100");
        assert_eq!(
            stage(&status(Phase::Syncing, 100, 100), 42),
            "verifying: 42 source keys compared at revision 100"
        );
        assert!(stage(&status(Phase::Degraded, 90, 100), 0).starts_with("degraded: "));
    }
}
