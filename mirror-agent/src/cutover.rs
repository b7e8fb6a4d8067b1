//! `mirror-agent cutover --config F --wait`: drain, verify and promote from a shell.
//!
//! It claims the fence with the stored epoch + 1, so a running daemon of the link becomes a
//! standby at its next write and writes nothing more; then it runs the engine in drain mode in
//! this process: catch up to the drain target revision, compare both sides (one repair pass if
//! they differ), and promote the target (checkpoint role `primary`). It prints the cutover block
//! and exits 0 only when verified.

use std::process::ExitCode;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use etcd_client::GetOptions;
use mirror_core::{connect_reachable, Config, Mode, Phase, Side, Status};
use mirror_fence::{read_checkpoint, Observed, Role};
use tokio_util::sync::CancellationToken;

use crate::engine::Engine;

/// Verification failed, or another writer holds the fence.
const EXIT_FAILED: u8 = 1;
/// Could not start (no checkpoint, unreachable target).
const EXIT_ERROR: u8 = 3;
/// Verified, but the source kept changing after the drain target (writers were not stopped).
const EXIT_SOURCE_MOVED: u8 = 4;

/// Runs the cutover.
pub async fn cutover(mut config: Config, allow_moving_source: bool) -> ExitCode {
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
            return ExitCode::from(EXIT_ERROR);
        }
        Err(e) => {
            eprintln!("mirror-agent cutover: cannot read the checkpoint: {e:#}");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    if record.role == Role::Primary {
        println!("already cut over: the target is primary (watermark {})", record.watermark);
        return ExitCode::SUCCESS;
    }
    config.mode = Mode::Drain;
    config.epoch = record.epoch as i64 + 1;
    eprintln!(
        "cutover: claiming the fence with epoch {} (a running agent of epoch {} stands by)",
        config.epoch, record.epoch
    );

    let status = Arc::new(RwLock::new(Status::default()));
    let shutdown = CancellationToken::new();
    let engine = tokio::spawn(Engine::new(config.clone(), status.clone(), shutdown.clone()).run());
    let final_status = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let s = status.read().expect("status lock").clone();
        if matches!(s.phase, Phase::Drained | Phase::Failed | Phase::Standby) {
            break s;
        }
    };
    shutdown.cancel();
    let _ = engine.await;

    if final_status.phase != Phase::Drained {
        let why = final_status.last_error.map(|e| format!("{}: {}", e.reason, e.message)).unwrap_or_default();
        eprintln!("mirror-agent cutover: not cut over (phase {}): {why}", final_status.phase.as_str());
        return ExitCode::from(EXIT_FAILED);
    }
    let block = final_status.cutover.clone().unwrap_or_default();
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({ "cutover": block })).unwrap_or_default()
    );

    match changed_after(&config, block.drain_target_revision).await {
        Ok((0, _)) => ExitCode::SUCCESS,
        Ok((keys, now)) => {
            eprintln!(
                "mirror-agent cutover: the source kept changing: {keys} keys in range were written after the drain target revision {} (source now at {now}, {} revisions later); stop the writers first{}",
                block.drain_target_revision,
                now - block.drain_target_revision,
                if allow_moving_source { " (allowed by --allow-moving-source)" } else { "" }
            );
            if allow_moving_source {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_SOURCE_MOVED)
            }
        }
        Err(e) => {
            eprintln!(
                "mirror-agent cutover: verified, but could not check the source for later writes: {e:#}"
            );
            ExitCode::from(EXIT_ERROR)
        }
    }
}

/// In-scope source keys modified after `revision`, and the source's current revision.
async fn changed_after(config: &Config, revision: i64) -> anyhow::Result<(i64, i64)> {
    let source = connect_reachable(Side::Source, &config.source, &config.sync).await?;
    let mut kv = source.kv_client();
    let mut keys = 0;
    let mut now = 0;
    for w in config.rewriter().scan_windows() {
        // etcd's count ignores mod-revision filters, so count the (key-only) survivors instead;
        // only keys written after the drain target come back.
        let opts = GetOptions::new().with_range(w.end).with_keys_only().with_min_mod_revision(revision + 1);
        let resp = kv.get(w.start, Some(opts)).await?;
        keys += resp.kvs().len() as i64;
        now = now.max(resp.header().map_or(0, |h| h.revision()));
    }
    Ok((keys, now))
}
