//! `mirror-agent failover --config F [--force] [--seen-revision R]`: the source is lost;
//! promote the target without it (SPEC §5, Failover; an exact link's: `exact/failover.rs`).
//!
//! It never reads the source's data. It claims the fence with the stored epoch + 1 and role
//! `primary` in one compare-and-swap, carrying the watermark and `confirmed_time` the running
//! agent last committed, so every agent of the link (HA replicas included) stands by with
//! `TargetPromoted` at its next write or claim, and none writes again, whether or not the source
//! comes back. It prints the data-loss window: the watermark, when the source was last confirmed
//! at or below it, and how long ago that was.
//!
//! While any source endpoint still answers, a failover would throw away writes a drain could
//! carry: it refuses (exit 1, nothing written) and points at `cutover --wait`, unless `--force`.

use crate::exit::Exit;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use mirror_core::{connect_reachable, connect_to, unary, Config, HumanDuration, Side};
use mirror_fence::{read_checkpoint, Checkpoint, FenceError, FencedWriter, Observed, Role};

/// How long a source endpoint has to answer before it counts as lost.
const SOURCE_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs the failover; `seen_revision` (exact links only) is the highest source revision a
/// client may have seen, as the operator knows it.
pub async fn failover(config: Config, force: bool, seen_revision: Option<i64>) -> ExitCode {
    if seen_revision.is_some() && !config.exact() {
        eprintln!(
            "mirror-agent failover: refused, nothing written: --seen-revision is for exact links \
             (sync.revisions = \"exact\"); a compact link's target revisions are its own, and its \
             clients relist after a failover anyway"
        );
        return ExitCode::from(Exit::No);
    }
    let probing = tokio::time::Instant::now();
    let answering = answering_source_endpoint(&config).await;
    eprintln!(
        "failover: probed {} source endpoint(s) at once in {:.2} s: {}",
        config.source.endpoints.len(),
        probing.elapsed().as_secs_f64(),
        answering.as_deref().map_or("none answered".to_owned(), |e| format!("{e} answers")),
    );
    if let Some(endpoint) = answering {
        if !force {
            eprintln!(
                "mirror-agent failover: refused, nothing written: the source answers at {endpoint}.\n\
                 A failover throws away what the source took after the watermark; with the source up, \
                 `mirror-agent cutover --config F --wait` drains it instead. If the source must be \
                 abandoned anyway (split brain, corrupt data), run again with --force."
            );
            return ExitCode::from(Exit::No);
        }
        eprintln!("failover: the source answers at {endpoint}; promoting anyway (--force)");
    }
    if config.exact() {
        return crate::exact::failover::failover(&config, seen_revision).await;
    }
    match promote(&config).await {
        Ok(Promotion::Done { record, previous_epoch }) => {
            print_window(&config, &record, Some(previous_epoch));
            ExitCode::from(Exit::Done)
        }
        Ok(Promotion::Already(record)) => {
            println!("already promoted: the target is primary (epoch {})", record.epoch);
            print_window(&config, &record, None);
            ExitCode::from(Exit::Done)
        }
        Err(Failure::Refused(why)) => {
            eprintln!("mirror-agent failover: refused: {why}");
            ExitCode::from(Exit::No)
        }
        Err(Failure::Error(why)) => {
            eprintln!("mirror-agent failover: {why:#}");
            ExitCode::from(Exit::CannotStart)
        }
    }
}

/// A source endpoint that serves a read within [`SOURCE_PROBE_TIMEOUT`], if any. Every endpoint
/// is asked at once, so a blackholed member costs one probe timeout, not one per member; the
/// first to answer is returned.
async fn answering_source_endpoint(config: &Config) -> Option<String> {
    use futures::StreamExt as _;
    let mut sync = config.sync.clone();
    sync.dial_timeout = HumanDuration(SOURCE_PROBE_TIMEOUT);
    sync.request_timeout = HumanDuration(SOURCE_PROBE_TIMEOUT);
    // etcd refuses an empty key: the whole keyspace (exact mode's prefix "") starts at "\0".
    let key = mirror_core::KeyRange::prefix(config.source.prefix.as_bytes()).start;
    let (sync, key) = (&sync, key);
    let mut probes: futures::stream::FuturesUnordered<_> = config
        .source
        .endpoints
        .iter()
        .map(|endpoint| {
            let key = key.clone();
            async move {
                let probe = async {
                    let client =
                        connect_to(Side::Source, &config.source, sync, std::slice::from_ref(endpoint))
                            .await?;
                    let opts = etcd_client::GetOptions::new().with_count_only().with_limit(1);
                    unary(
                        "failover probe",
                        Side::Source,
                        SOURCE_PROBE_TIMEOUT,
                        client.kv_client().get(key, Some(opts)),
                    )
                    .await
                };
                matches!(tokio::time::timeout(SOURCE_PROBE_TIMEOUT * 2, probe).await, Ok(Ok(_)))
                    .then(|| endpoint.clone())
            }
        })
        .collect();
    while let Some(answer) = probes.next().await {
        if answer.is_some() {
            return answer;
        }
    }
    None
}

enum Promotion {
    Done { record: Checkpoint, previous_epoch: u64 },
    Already(Checkpoint),
}

enum Failure {
    Refused(String),
    Error(anyhow::Error),
}

/// Claims the fence as primary over the newest stored record; a running agent that commits in
/// between only moves the record the claim is built from (re-read, claimed again).
async fn promote(config: &Config) -> Result<Promotion, Failure> {
    let timeout = config.sync.request_timeout.get();
    let target = connect_reachable(Side::Target, &config.target, &config.sync)
        .await
        .map_err(|e| Failure::Error(anyhow::anyhow!("cannot reach the target: {e}")))?;
    let key = config.checkpoint_key();
    let me = format!("failover/{}/{}", crate::engine::hostname(), std::process::id());
    for _ in 0..10 {
        let observed = read_checkpoint(&mut target.kv_client(), &key, timeout)
            .await
            .map_err(|e| Failure::Error(anyhow::anyhow!("cannot read the checkpoint: {e}")))?;
        let stored = match &observed {
            Observed::Absent => {
                return Err(Failure::Error(anyhow::anyhow!(
                    "no checkpoint in the target: nothing has been mirrored to fail over to"
                )))
            }
            Observed::Present { record, .. } => record.clone(),
        };
        if stored.role == Role::Primary {
            return Ok(Promotion::Already(stored));
        }
        let next = stored.failed_over(stored.epoch + 1, &me);
        if failpoint::move_fence_before_claim() {
            // A running agent applies one more revision between the read and the claim.
            let moved = Checkpoint { watermark: stored.watermark + 1, ..stored.clone() };
            let value = moved.encode().map_err(|e| Failure::Error(e.into()))?;
            target.kv_client().put(key.clone(), value, None).await.map_err(|e| Failure::Error(e.into()))?;
        }
        match FencedWriter::claim(target.kv_client(), key.clone(), observed, next, timeout).await {
            Ok(writer) => {
                return Ok(Promotion::Done { record: writer.record().clone(), previous_epoch: stored.epoch })
            }
            Err(FenceError::Raced | FenceError::EpochRegressed { .. }) => continue,
            Err(FenceError::CutOver) => {
                let record = match read_checkpoint(&mut target.kv_client(), &key, timeout).await {
                    Ok(Observed::Present { record, .. }) => record,
                    _ => stored,
                };
                return Ok(Promotion::Already(record));
            }
            Err(e) => return Err(Failure::Refused(e.to_string())),
        }
    }
    Err(Failure::Refused(
        "the checkpoint kept moving under ten claims in a row: is an agent with a newer epoch writing?"
            .into(),
    ))
}

/// Test hooks, armed only with the `failpoints` feature (`mirror_core::failpoint`).
mod failpoint {
    /// `MIRROR_FAILPOINT_FAILOVER_MOVE_FENCE=1`: before every claim, move the checkpoint's
    /// watermark on by one, as a running agent racing the failover would (the "kept moving"
    /// refusal).
    pub(super) fn move_fence_before_claim() -> bool {
        mirror_core::failpoint::armed("FAILOVER_MOVE_FENCE").is_some()
    }
}

/// The data-loss window and what to do next.
fn print_window(config: &Config, record: &Checkpoint, previous_epoch: Option<u64>) {
    let confirmed = humantime::parse_rfc3339_weak(&record.confirmed_time).ok();
    let age = confirmed.and_then(|at| SystemTime::now().duration_since(at).ok());
    println!("failover of link {:?}: the target is primary", config.link_uid);
    match previous_epoch {
        Some(was) => println!(
            "  epoch           {} (was {was}: every agent of the link stands by, TargetPromoted)",
            record.epoch
        ),
        None => println!("  epoch           {}", record.epoch),
    }
    println!("  watermark       {} (the source revision the target reflects)", record.watermark);
    match (confirmed, age) {
        (Some(_), Some(age)) => println!(
            "  confirmed_time  {} ({}s ago): the source held nothing past the watermark then; writes it took after that are not in the target",
            record.confirmed_time,
            age.as_secs()
        ),
        _ => println!(
            "  confirmed_time  unknown: the source was never confirmed at the watermark (an older record, or a sync that never caught up); the loss window is unbounded"
        ),
    }
    println!("next steps:");
    println!(
        "  1. point the applications at the target ({}) and keep the old source's clients off it",
        config.target.endpoints.join(",")
    );
    println!("  2. leave the agents of this link as they are: they stand by and never write again");
    println!(
        "  3. when the old source is back, list what it took after the watermark before anything overwrites it: mirror-agent failback-plan --config REVERSE.toml --promoted-watermark {} --out plan.jsonl",
        record.watermark
    );
    println!(
        "  4. then mirror the new primary into it with that reverse link (its own link_uid, sides swapped, initial_sync.mode = \"overwrite_and_prune\") and cut over when ready (docs/operations.md, 3b)"
    );
}
