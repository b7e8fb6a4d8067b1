//! The replication engine: connect → initial_sync → syncing, with degraded, standby and failed.
//!
//! ## Invariants this module upholds
//! - **G1** Reads go to the source client only; writes only through the [`mirror_fence::FencedWriter`] of the
//!   target, and only to keys the [`KeyRewriter`] produced or the checkpoint key.
//! - **G2** Target Txns are built from [`mirror_watch::Batch`]es of whole revisions; a Txn the target refuses
//!   as too big is retried one revision at a time; a single revision still refused is
//!   permanent, named by its first key (redacted).
//! - **G3** The checkpoint moves in the same Txn as the data it describes, so the target never
//!   reflects a revision the checkpoint does not name. `scanning` stays true until the replay
//!   has passed `scan_end`, the source revision after the last page was read; only then does the
//!   target equal the source at the watermark.
//! - **G5** Every restart resumes from the checkpoint: mid-scan from `scan_cursor`, in the tail
//!   from `watermark + 1`. Only a compaction past the needed revision forces a fresh genesis,
//!   and that one always ends with a mark-and-sweep prune (of this link's keys only, unless
//!   the mode is `overwrite_and_prune`: `Link::sweep`).
//! - **G7** A corrupt checkpoint, another link's checkpoint, a newer epoch or role primary
//!   stop all writes.
//!
//! ## Where each phase lives
//! One connected run is a loop over phases ([`link::Link::drive`]): [`start::Start`] ->
//! [`genesis::Genesis`] -> [`tail::Tail`]. Each phase is a type holding only its own state
//! (the start plan's cause; R0, the scan cursor and the count beside the scan; `scan_end`, the
//! drain, the idle proofs' spacing, member probes and confirm reads), runs against the
//! [`link::Link`] it is handed, and hands back the next [`link::Step`].
//! - `run_loop`: the outer loop (reconnect, backoff, fresh genesis, failed, cold standby).
//! - `probe`: connecting both sides, member probes, version, cluster and direction checks.
//! - `link`: [`link::Link`], the link while connected (clients, lease keeper, fenced applier,
//!   watch and its replay buffer), the helpers every phase shares, and the loop over phases.
//! - `plan`: the pure start planner (stored checkpoint, pending cause, clusters, range, mode ->
//!   what to do first), unit-tested branch by branch.
//! - `start`: the [`start::Start`] phase: carrying the plan out; the fence claim.
//! - `genesis`: the [`genesis::Genesis`] phase: the buffered watch, the pipelined scan, the
//!   prune sweep and the replay.
//! - `tail`: the [`tail::Tail`] phase: watch responses, progress, timers (fence, members, TLS
//!   files, reconcile), the drain.
//! - `apply`: how the tail lands whole revisions in fenced Txns, with retries by error class;
//!   big revisions.
//! - `settle`: how the tail completes an initial sync or a drain on an idle source by
//!   comparison.
//! - `repair`: the tail's periodic reconcile pass and drain verification and promotion; the
//!   comparisons and repairs any phase may ask of the link (the prune sweep among them).
//! - `error`: [`EngineError`], how a run ends (class, reason, fix).
//! - `waits`: what the phases' `select!` loops wait on beside their work (a reloaded config, a
//!   spawned task's result, a deadline that may not be set).
//! - `buffering`: the [`buffering::Buffering`], a component of its own: the watch read into a
//!   replay buffer while a long pass runs.
//! - `confirm`: the [`confirm::Confirmer`], a component of its own: `confirmed_time`, when the
//!   source was last seen at or below the watermark.
//! - `leases`: the [`leases::LeaseKeeper`], a component of its own: it owns the target leases
//!   of a run, its two clients and its settings, and from the claim on keeps them alive on a
//!   task of its own; the engine asks it for each Txn's etcd ops, and it tells the tail when a
//!   reconcile pass is owed or why it stopped.
//!
//! ## Why `scan_end` and not R0 ends the initial sync
//! Pages are read unpinned, so a page may hold values newer than R0, and a key deleted after R0
//! may be missing. Every such difference is a source change at a revision in (R0, scan_end],
//! and the watch opened at R0 + 1 delivers each of them. Once the replay has applied every
//! revision up to scan_end, the target equals the source at the watermark.
//!
//! The watch is read by a forwarder from R0 + 1 through the scan, the sweep and the replay
//! itself (`genesis::replay_buffered`): a backlog of a minute of writes takes seconds to apply,
//! and a watch left unread that long is one etcd cancels at its next compaction.
//!
//! ## Why genesis and drain completion do not rest on an untrusted progress reply
//! "Every revision up to X has been delivered" is proven in one of two ways only:
//! 1. An *event* above X arrived on the watch. etcd sends one watcher's events in revision
//!    order, so every event at or below X came before it.
//! 2. On a server whose progress notifications are trusted (3.4.25+, 3.5.8+, or configured),
//!    a progress notification at or above X.
//!
//! Older servers answer a progress request from a control queue that the send loop drains in
//! random order with the watcher's event queue, and a slow watcher's events (one parked
//! server-side while nobody read the stream, e.g. during a sweep) are re-read from the backend
//! later still. So the reply's header can be ahead of events still to come; taking it as
//! proof dropped those events as "at or below the watermark" and lost data (issue #9,
//! reproduced in `harness/tests/progress_order.rs` and `engine_progress.rs`).
//!
//! On such servers an idle range (a progress reply above the watermark) is moved to the
//! reply's revision X by the *idle proof* of [`mirror_watch::prove_unchanged`]: the range's
//! count at the watermark W equals its count at X and no key at X was written after W, so the
//! state at X is the state at W and a checkpoint-only Txn moves W to X. This runs in the tail
//! as well as at the end of genesis or a drain, so an idle prefix of a busy cluster keeps its
//! lag near zero and a restart after a compaction at the head resumes instead of resyncing.
//! When W itself was compacted (no count at W can be taken), genesis and drain fall back to
//! settling by *comparison*: [`tail::Tail::settle_at`] merges the source pinned at X with
//! the target. Target state is only ever moved toward the source's state at X:
//! 1. Each difference is a change at a revision in (watermark, X] whose event has not been
//!    applied yet; writing the source's value at X (or deleting) is exactly what applying the
//!    rest of the events up to X would have produced.
//! 2. Orphans are ours to delete when a prune is owed, or when their target mod revision is
//!    above the checkpoint's create revision (this link wrote them); older keys were there
//!    before the link (mode `overwrite`) and are left alone. Keys inside another link's
//!    destination range (a nested link, found by its checkpoint) are never ours, whatever
//!    their mod revision: that link wrote them after our checkpoint was created.
//! 3. After the comparison the watermark moves to X in a fenced Txn; events at or below X that
//!    arrive later are dropped, which is right because the target already holds the state at X.
//!
//! Genesis repairs at once (G3 is not claimed while `scanning`). Drain, where G3 is claimed,
//! only compares: when equal it moves the watermark; otherwise the missing events are still on
//! their way and the next idle reply compares again.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use mirror_core::{AgentRole, Config, KeyRewriter, Phase, Status};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

mod buffering;
mod causes;
mod commit;
pub(crate) mod confirm;
mod decide;
mod error;
mod genesis;
mod ha;
mod leases;
mod link;
mod plan;
mod probe;
mod refusal;
mod repair;
mod run_loop;
mod start;
mod tail;
mod waits;

pub use causes::{ReconnectCause, Restart, ResyncCause};
pub use error::EngineError;

pub(crate) use probe::{reachability, tls_expiry, tls_fingerprint};
pub use refusal::Refusal;

/// Data-only scan Txns in flight at once.
const SCAN_TXNS_IN_FLIGHT: usize = 4;
/// Chunks the scan's reader may run ahead of the writer (memory: about this many Txns).
const SCAN_READ_AHEAD: usize = 16;
/// Txns per scan span; the last one of each carries the checkpoint. Every span ends with the
/// writes waiting for each other (the checkpoint moves the mod revision the others compare), so
/// a longer span writes faster. Measured on a 1 000 000-key sync (3.5.30, 2 cores, ~130 Txns/s):
/// 64 ended 17 spans and spent 490-590 ms of 8.9-9.2 s draining and checkpointing; at 256 the
/// time bound ends them (8 spans, 250-280 ms of 7.4-7.7 s). A restart redoes at most one span.
const SCAN_SPAN_TXNS: usize = 256;
/// Bytes that end a scan span early (large values), so a restart redoes at most this much.
const SCAN_SPAN_BYTES: usize = 32 << 20;
/// Time that ends a scan span (a paced or slow scan), so a restart redoes at most this much
/// writing. `initial_sync.keys` moves with every Txn that lands and the keep-alives run on the
/// lease keeper's own task, so neither waits for a span end. It was 1 s while they did: a
/// 100 000 x 256 B sync (1.5 s) then paid 61-98 ms at its one mid-scan span end, the writes
/// drained and the checkpoint alone in flight.
const SCAN_SPAN_TIME: Duration = Duration::from_secs(5);

/// Comparisons in a row that find a draining target behind before [`tail::Tail::settle_at`] repairs.
const DRAIN_SETTLE_ATTEMPTS: u32 = 5;

/// How often an idle tail re-reads the fence.
const FENCE_CHECK_INTERVAL: Duration = Duration::from_secs(2);
/// How often the tail looks at the TLS files for a rotation (exact mode's too).
pub(crate) const TLS_CHECK_INTERVAL: Duration = Duration::from_secs(5);

pub use mirror_core::StatusHandle;

/// What the next connect should do about genesis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Pending {
    /// Follow the checkpoint.
    #[default]
    Resume,
    /// Start a new genesis owing a prune (forced resync or restart).
    FreshGenesis,
}

/// The engine of one link.
pub struct Engine {
    cfg: Config,
    rewriter: KeyRewriter,
    reporter: crate::reporter::Reporter,
    shutdown: CancellationToken,
    agent_id: String,
    /// Consecutive forced resyncs with no live apply between.
    resyncs_in_a_row: u32,
    /// The throttle curve of target writes, carried from one Txn to the next (upstream #41).
    throttle: mirror_core::ThrottleState,
    /// Validated configs from SIGHUP; only fields that may change live differ (the caller
    /// refuses the rest).
    reload: Option<tokio::sync::watch::Receiver<Config>>,
    /// Whether both sides ever answered; until then failures keep the phase `connecting`.
    ever_connected: bool,
    /// What the current run achieved; the run loop resets its waits by it.
    progress: Progress,
    /// Source keys compared so far by the running comparison (reconcile pass, drain verify).
    compared: Arc<AtomicU64>,
    /// Whether this process ever opened a source watch (later ones count as `watch_restarts`).
    watch_opened: bool,
    /// Watch asking for fragments: set once a watch response was over the client's decode limit
    /// (mirror-watch's `WATCH_RESPONSE_LIMIT`), for the rest of the process.
    fragment_watch: bool,
    /// The target revision of this process's latest checkpoint commit (0: none yet). A target
    /// that answers from before it at a reconnect went back (`TargetWentBack`).
    target_committed: i64,
    /// Under HA, a standby's connection to both sides, refreshed while it waits for the
    /// election ([`probe::Warm`]), so that once elected it claims without dialing or probing.
    warm: Option<probe::Warm>,
    /// When this agent last won the HA election, until its claim (logged then as
    /// `fence_after_election_ms`).
    elected_at: Option<Instant>,
    /// A target lease ran out ([`leases::LeaseKeeper`] says so), or one was found run out at a run's start: the tail runs
    /// a reconcile pass as soon as it can, whatever `reconcile.interval` says, to put back the
    /// keys its expiry deleted.
    repair_owed: bool,
}

/// How far a run got, for resetting the retry waits ([`mirror_core::RetryPolicy`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
enum Progress {
    /// Nothing succeeded.
    #[default]
    None,
    /// A Txn landed or the tail ran: the transient and throttle waits start over.
    Healthy,
    /// A live revision was applied: the resync wait starts over too.
    Live,
}

impl Engine {
    /// Source keys compared so far by the running comparison (a reconcile pass or the drain's
    /// verification); starts at 0 with each one. `cutover --wait` draws its progress from it.
    pub fn comparison_progress(&self) -> Arc<AtomicU64> {
        self.compared.clone()
    }

    /// A new engine; `run` drives it until `shutdown`.
    pub fn new(cfg: Config, status: StatusHandle, shutdown: CancellationToken) -> Engine {
        let rewriter = cfg.rewriter();
        let agent_id = format!("{}/{}", hostname(), std::process::id());
        let reporter = crate::reporter::Reporter::new(status, crate::freshness::Freshness::of(&cfg));
        reporter.update(|s| {
            s.link_uid = cfg.link_uid.clone();
            s.epoch = cfg.epoch as u64;
            s.role = AgentRole::Mirror;
            s.agent_id = agent_id.clone();
        });
        Engine {
            cfg,
            rewriter,
            reporter,
            shutdown,
            agent_id,
            resyncs_in_a_row: 0,
            throttle: mirror_core::ThrottleState::default(),
            reload: None,
            ever_connected: false,
            progress: Progress::None,
            compared: Arc::default(),
            watch_opened: false,
            target_committed: 0,
            repair_owed: false,
            warm: None,
            elected_at: None,
            fragment_watch: false,
        }
    }

    /// Takes live config changes (rates, reconcile interval, epoch, endpoints at the next
    /// connect) from `reload`.
    pub fn with_reload(mut self, reload: tokio::sync::watch::Receiver<Config>) -> Engine {
        self.reload = Some(reload);
        self
    }

    /// Observes apply latency and batch size into `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Engine {
        self.reporter = self.reporter.with_metrics(metrics);
        self
    }

    fn update(&self, f: impl FnOnce(&mut Status)) {
        self.reporter.update(f);
    }

    /// The link's counts as status holds them: forced resyncs, genesis restarts, and when the
    /// last initial sync completed (kept in the checkpoint record across restarts).
    fn counts(&self) -> (u64, u64, String) {
        self.reporter.read(|s| {
            (s.forced_resyncs.count, s.scan_restarts, s.initial_sync.completed.clone().unwrap_or_default())
        })
    }

    /// Records progress of the current run (never lowers it).
    fn made_progress(&mut self, progress: Progress) {
        self.progress = self.progress.max(progress);
    }

    /// Fails with [`EngineError::Shutdown`] once SIGTERM/SIGINT arrived: long loops call it each
    /// step so the process exits within a step of the signal.
    fn stop_if_shutting_down(&self) -> Result<(), EngineError> {
        if self.shutdown.is_cancelled() {
            return Err(EngineError::Shutdown);
        }
        Ok(())
    }

    fn set_phase(&self, phase: Phase) {
        self.reporter.set_phase(phase, phase.reason());
    }
}

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown-host".into())
}
