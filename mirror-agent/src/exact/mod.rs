//! Exact mode (`sync.revisions = "exact"`, SPEC §10): source revision R lands as target
//! revision R. A loop over two states, each a type holding only its own state:
//! - `seed::place`: where the target stands. A fresh restore is proven to be the source at
//!   its revision R0 (or refused, naming what differs); a target the link already writes
//!   resumes from its checkpoint.
//! - `tail::Tail`: one fenced Txn per source revision ([`mirror_fence::ExactFence`]), fed by
//!   the watch of the whole keyspace ([`mirror_watch::ExactWatch`]); the target leases are
//!   held by [`leases::TargetLeases`], and the target's compaction follows the source's
//!   ([`compaction::Following`]); revisions the source compacted come from the seed's spool
//!   ([`seed::SpoolReplay`]), read as revisions land; every `reconcile.interval` both sides
//!   are compared at the last revision landed, read only (`tail/audit.rs`).
//!
//! What stops the link for good (`failed`, nothing more written): a foreign write, a missing
//! revision, a target that is not a restore of this source or whose history the source
//! compacted (`ReseedRequired`). A transient error retries the run from the checkpoint.
//!
//! A reload (SIGHUP) ends the run and starts the next from the checkpoint with the new config:
//! a Txn in flight then has landed or not, and the fence tells which. With `paused = true` the
//! run holds the target leases alive and writes nothing, its watch closed, until a reload
//! unpauses it (a source compaction past the checkpoint meanwhile is `ReseedRequired`, unless
//! the seed's spool holds the revisions).

use std::time::Duration;

use mirror_core::{
    connect_probed, now_rfc3339, ConditionType, Config, ErrorClass, EtcdError, ExponentialBackoff, Fault,
    LastError, Phase, Reason, Side,
};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::engine::ReconnectCause;
use crate::reporter::Reporter;

mod compaction;
pub(crate) mod compare;
pub(crate) mod cutover;
pub(crate) mod digest;
pub(crate) mod failover;
mod flight;
mod leases;
mod replica;
mod seed;
mod tail;

pub(crate) use compaction::compacted_revision;

/// Why a run of the exact link ended.
#[derive(Debug)]
pub(crate) enum Stop {
    /// An etcd call failed: try the run again from the checkpoint.
    Etcd(EtcdError),
    /// The replica cannot go on: stop writing (phase `failed`).
    Lost {
        /// Why, as status names it.
        reason: Reason,
        /// What differs, keys redacted.
        message: String,
    },
    /// SIGTERM/SIGINT.
    Shutdown,
    /// The run must connect afresh (its settings on disk changed): at once, no error.
    Reconnect(ReconnectCause),
}

impl From<EtcdError> for Stop {
    fn from(e: EtcdError) -> Stop {
        Stop::Etcd(e)
    }
}

impl Stop {
    fn lost(reason: Reason, message: impl Into<String>) -> Stop {
        Stop::Lost { reason, message: message.into() }
    }
}

/// Runs the exact link until `shutdown`: a run per connect, retried after transient errors,
/// started again with the new config at a reload.
pub async fn run(
    mut cfg: Config,
    reporter: Reporter,
    shutdown: CancellationToken,
    mut reload: tokio::sync::watch::Receiver<Config>,
) {
    let sync = &cfg.sync;
    let mut backoff = ExponentialBackoff::new(sync.backoff.initial.get(), sync.backoff.max.get(), 2);
    // Whether this process ever opened a source watch: later ones count as `watch_restarts`,
    // as in compact mode (a watch that keeps ending restarts the run each time, which
    // `EtcdMirrorWatchFlapping` is there to page on).
    let mut watch_opened = false;
    loop {
        reporter.set_phase(Phase::Connecting, Reason::Connecting);
        let ended = tokio::select! {
            _ = shutdown.cancelled() => return,
            Ok(()) = reload.changed() => {
                cfg = reload.borrow_and_update().clone();
                info!(paused = cfg.paused, "config reloaded: the exact link starts its run again from the checkpoint");
                continue;
            }
            ended = run_once(&cfg, &reporter, &shutdown, &mut backoff, &mut watch_opened) => ended,
        };
        // A permanent etcd error (a refused request, wrong credentials) parks the link as in
        // compact mode: retried, it would only be refused again, a run restart every backoff.
        let ended = match ended {
            Stop::Etcd(e) if e.class() == ErrorClass::Permanent => {
                Stop::lost(e.fault.into(), format!("{e}: not retried; fix the cause and restart the agent"))
            }
            ended => ended,
        };
        match ended {
            Stop::Shutdown => return,
            Stop::Reconnect(why) => {
                info!(%why, "reconnecting both sides with the current settings and files");
                continue;
            }
            Stop::Lost { reason, message } => {
                error!(reason = reason.as_str(), "exact replica stopped: {message}");
                reporter.update(|s| {
                    s.last_error =
                        Some(LastError { class: ErrorClass::Permanent, reason, message, fix: None })
                });
                reporter.set_phase(Phase::Failed, reason);
                shutdown.cancelled().await;
                return;
            }
            Stop::Etcd(e) => {
                let delay = backoff.next_delay();
                warn!("exact link run ended, retrying in {delay:?}: {e}");
                if e.side == Side::Target && e.fault == Fault::QuotaExceeded {
                    // As compact mode raises it (and the alert on it pages): the run starts
                    // again until the operator frees space; the next revision landed clears it.
                    error!("target out of space; retrying until it takes writes again");
                    let message = e.to_string();
                    reporter.update(|s| {
                        s.set_condition(ConditionType::TargetQuotaExhausted, true, Reason::NoSpace, message)
                    });
                }
                reporter.update(|s| {
                    s.last_error = Some(LastError {
                        class: e.class(),
                        reason: e.fault.into(),
                        message: format!("{e}; retrying in {delay:?}"),
                        fix: None,
                    })
                });
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                    // A reload is applied by the next run, at once.
                    Ok(()) = reload.changed() => {}
                }
            }
        }
    }
}

/// One run: connect, place, tail until something stops it.
async fn run_once(
    cfg: &Config,
    reporter: &Reporter,
    shutdown: &CancellationToken,
    backoff: &mut ExponentialBackoff,
    watch_opened: &mut bool,
) -> Stop {
    // Each side through a probe of its members, connected to those that serve (a member that
    // is down would otherwise get a share of the requests; each one it fails ends the run, see
    // `Tail::verdict`), and the members down said in status (`MemberUnreachable`). The target
    // first: a promoted one stops the link even with the source gone. The TLS files are
    // digested first: a rotation from here on is seen by the tail.
    let tls_files = crate::engine::tls_fingerprint(cfg);
    // Each side's answer to its probe is `SourceReachable` / `TargetReachable`, as in compact
    // mode: a source lost (the failover case) shows as such, not only in last_error.
    let connected = connect_probed(Side::Target, &cfg.target, &cfg.sync).await;
    reporter.update(|s| crate::engine::reachability(s, ConditionType::TargetReachable, &connected));
    let (target_probe, target) = match connected {
        Ok(probed) => probed,
        Err(e) => return e.into(),
    };
    if let Err(stop) = seed::not_promoted(cfg, &target).await {
        return stop;
    }
    let connected = connect_probed(Side::Source, &cfg.source, &cfg.sync).await;
    reporter.update(|s| crate::engine::reachability(s, ConditionType::SourceReachable, &connected));
    let (source_probe, source) = match connected {
        Ok(probed) => probed,
        Err(e) => return e.into(),
    };
    reporter.update(|s| {
        crate::members::members_reachable(s, &source_probe, &target_probe);
        // What this connect loaded: the expiry gauge and its warning follow a rotation.
        s.source.tls_cert_expiry = crate::engine::tls_expiry(&cfg.source);
        s.target.tls_cert_expiry = crate::engine::tls_expiry(&cfg.target);
    });
    // Every target lease is kept alive from the run's first second, through the proof of the
    // seed too (a restored target's master leases live 15 s; a proof of many keys takes longer).
    let hold = cfg.sync.exact_lease_hold.get();
    let records = leases::lease_records(cfg);
    let adopted =
        leases::TargetLeases::adopt(source.clone(), target.clone(), hold, timeout(cfg), records).await;
    let mut leases = match adopted {
        Ok(leases) => leases,
        Err(stop) => return stop,
    };
    if cfg.paused {
        reporter.set_phase(Phase::Paused, Reason::Paused);
        info!("paused by config: the watch is closed and nothing is written, the target leases are kept alive, until a reload sets paused = false");
        return leases::keep_meanwhile(&mut leases).await;
    }
    let placing = async {
        tokio::select! {
            placed = seed::place(cfg, &source, &target) => placed,
            stop = leases::keep_meanwhile(&mut leases) => Err(stop),
        }
    };
    let placed = match placing.await {
        Ok(placed) => placed,
        Err(stop) => return stop,
    };
    backoff.reset();
    // The target is the source at the watermark (proven, or kept so by the fence since): what
    // `InitialSyncComplete` says in compact mode, and what the runbook tells operators to wait
    // for before failing over (and the alerts on a stale confirmation are gated on).
    let (reason, said) = if placed.resumed {
        (Reason::Resumed, format!("resumed at revision {} from the checkpoint", placed.watermark))
    } else {
        (
            Reason::Complete,
            format!("the target is the source's snapshot at revision {}, proven", placed.watermark),
        )
    };
    reporter.update(|s| {
        s.initial_sync.completed.get_or_insert_with(now_rfc3339);
        s.set_condition(ConditionType::InitialSyncComplete, true, reason, said);
    });
    let me = reporter.read(|s| s.agent_id.clone());
    tail::Tail::new(cfg, source, target, placed, me, tls_files, watch_opened)
        .run(leases, reporter, shutdown)
        .await
}

/// The deadline of one unary call.
fn timeout(cfg: &Config) -> Duration {
    cfg.sync.request_timeout.get()
}
