//! The replication engine: connect → initial_sync → syncing, with degraded, standby and failed.
//!
//! ## Invariants this module upholds
//! - **G1** Reads go to the source client only; writes only through the [`FencedWriter`] of the
//!   target, and only to keys the [`KeyRewriter`] produced or the checkpoint key.
//! - **G2** Target Txns are built from [`Batch`]es of whole revisions; a Txn the target refuses
//!   as too big is retried one revision at a time; a single revision still refused is
//!   permanent, named by its first key (redacted).
//! - **G3** The checkpoint moves in the same Txn as the data it describes, so the target never
//!   reflects a revision the checkpoint does not name. `scanning` stays true until the replay
//!   has passed `scan_end`, the source revision after the last page was read; only then does the
//!   target equal the source at the watermark.
//! - **G5** Every restart resumes from the checkpoint: mid-scan from `scan_cursor`, in the tail
//!   from `watermark + 1`. Only a compaction past the needed revision forces a fresh genesis,
//!   and that one always ends with a mark-and-sweep prune.
//! - **G7** A corrupt checkpoint, another link's checkpoint, a newer epoch or role primary
//!   stop all writes.
//!
//! ## Why `scan_end` and not R0 ends the initial sync
//! Pages are read unpinned, so a page may hold values newer than R0, and a key deleted after R0
//! may be missing. Every such difference is a source change at a revision in (R0, scan_end],
//! and the watch opened at R0 + 1 delivers each of them. Once the replay has applied every
//! revision up to scan_end, the target equals the source at the watermark.
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
//! On such servers an idle source (two progress replies at or above X with no event between)
//! is settled by *comparison* instead: [`Run::settle_at`] merges the source pinned at X with
//! the target. Target state is only ever moved toward the source's state at X:
//! 1. Each difference is a change at a revision in (watermark, X] whose event has not been
//!    applied yet; writing the source's value at X (or deleting) is exactly what applying the
//!    rest of the events up to X would have produced.
//! 2. Orphans are ours to delete when a prune is owed, or when their target mod revision is
//!    above the checkpoint's create revision (this link wrote them); older keys were there
//!    before the link (mode `overwrite`) and are left alone.
//! 3. After the comparison the watermark moves to X in a fenced Txn; events at or below X that
//!    arrive later are dropped, which is right because the target already holds the state at X.
//!
//! Genesis repairs at once (G3 is not claimed while `scanning`). Drain, where G3 is claimed,
//! only compares: when equal it moves the watermark; otherwise the missing events are still on
//! their way and the next idle reply compares again.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use etcd_client::{Client, GetOptions, KvClient, WatchRequestSender, WatchResponse, WatchResponseStream};
use futures::StreamExt as _;
use mirror_core::{
    connect, connect_to, now_rfc3339, parse_version, probe_members, progress_notify_trustworthy, unary,
    Config, ErrorClass, EtcdError, Fault, InitialSyncMode, KeyRewriter, LastError, Mode, Phase, Probe, Side,
    SideStatus, Status, TrustProgressNotify,
};
use mirror_fence::{read_checkpoint, Checkpoint, FenceError, FencedWriter, Observed, Role};
use mirror_scan::{count, Scanner};
use mirror_watch::{
    convert_events, open_watch, Batch, Op, OpChunker, ReplayBuffer, Revision, RevisionBatcher,
};
use tokio::sync::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Data-only scan Txns in flight at once.
const SCAN_TXNS_IN_FLIGHT: usize = 4;
/// Txns per scan cycle; the last one of each carries the checkpoint.
const SCAN_CYCLE_TXNS: usize = 16;
/// Pages the scan reader may fetch ahead of the writer: at least one cycle's worth at the
/// default page and Txn sizes, so a cycle never waits on reads it could have overlapped.
const SCAN_READ_AHEAD_PAGES: usize = 8;

/// Comparisons in a row that find a draining target behind before [`Run::settle_at`] repairs.
const DRAIN_SETTLE_ATTEMPTS: u32 = 5;

/// How often an idle tail re-reads the fence.
const FENCE_CHECK_INTERVAL: Duration = Duration::from_secs(2);
/// How often the tail probes every member of both sides in the background, so a member that
/// went down or came back shows in `MemberUnreachable` without a reconnect.
const MEMBER_CHECK_INTERVAL: Duration = Duration::from_secs(10);
/// How often the tail looks at the TLS files for a rotation.
const TLS_CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// Shared, readable by the HTTP server.
pub type StatusHandle = Arc<RwLock<Status>>;

/// How an engine run ended, as the outer loop sees it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// An etcd call failed.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    /// The fence said no.
    #[error(transparent)]
    Fence(#[from] FenceError),
    /// A rule of the product was broken (empty target, direction, version, oversized revision).
    #[error("{message}")]
    Refused {
        /// CamelCase reason (also the condition name where one exists).
        reason: &'static str,
        /// Human-readable, keys redacted.
        message: String,
    },
    /// Genesis must start over (buffer overflow, compacted watch mid-scan).
    #[error("genesis restart: {0}")]
    RestartGenesis(&'static str),
    /// History is gone: forced resync with prune.
    #[error("forced resync: {0}")]
    Resync(&'static str),
    /// The connection settings or TLS files changed: reconnect now, no backoff, no error.
    #[error("reconnect: {0}")]
    Reconnect(&'static str),
}

impl EngineError {
    fn class(&self) -> ErrorClass {
        match self {
            EngineError::Etcd(e) => e.class(),
            EngineError::Fence(f) => f.class(),
            EngineError::Refused { .. } => ErrorClass::Permanent,
            EngineError::RestartGenesis(_) | EngineError::Resync(_) => ErrorClass::Resync,
            EngineError::Reconnect(_) => ErrorClass::Transient,
        }
    }

    fn reason(&self) -> String {
        match self {
            EngineError::Etcd(e) | EngineError::Fence(FenceError::Etcd(e)) => format!("{:?}", e.fault),
            EngineError::Fence(f) => f.reason().to_owned(),
            EngineError::Refused { reason, .. } => (*reason).to_owned(),
            EngineError::RestartGenesis(r) | EngineError::Resync(r) | EngineError::Reconnect(r) => {
                (*r).to_owned()
            }
        }
    }
}

impl From<mirror_watch::Overflow> for EngineError {
    fn from(_: mirror_watch::Overflow) -> Self {
        EngineError::RestartGenesis("WatchBufferOverflow")
    }
}

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
    status: StatusHandle,
    shutdown: CancellationToken,
    agent_id: String,
    /// Consecutive forced resyncs with no live apply between.
    resyncs_in_a_row: u32,
    /// Since when the watermark trails the source revision (for `lag_seconds`).
    behind_since: RwLock<Option<Instant>>,
    /// Histograms observed per landed Txn, when served.
    metrics: Option<Arc<crate::metrics::Metrics>>,
    /// Validated configs from SIGHUP; only fields that may change live differ (the caller
    /// refuses the rest).
    reload: Option<tokio::sync::watch::Receiver<Config>>,
    /// Whether both sides ever answered; until then failures keep the phase `connecting`.
    ever_connected: bool,
}

impl Engine {
    /// A new engine; `run` drives it until `shutdown`.
    pub fn new(cfg: Config, status: StatusHandle, shutdown: CancellationToken) -> Engine {
        let rewriter = cfg.rewriter();
        let agent_id = format!("{}/{}", hostname(), std::process::id());
        {
            let mut s = status.write().expect("status lock");
            s.link_uid = cfg.link_uid.clone();
            s.epoch = cfg.epoch as u64;
            s.role = "mirror".into();
            s.agent_id = agent_id.clone();
        }
        Engine {
            cfg,
            rewriter,
            status,
            shutdown,
            agent_id,
            resyncs_in_a_row: 0,
            behind_since: RwLock::new(None),
            metrics: None,
            reload: None,
            ever_connected: false,
        }
    }

    /// Takes live config changes (rates, reconcile interval, epoch, endpoints at the next
    /// connect) from `reload`.
    pub fn with_reload(mut self, reload: tokio::sync::watch::Receiver<Config>) -> Engine {
        self.reload = Some(reload);
        self
    }

    /// Adopts a reloaded config if one arrived and was not yet adopted.
    fn take_reload(&mut self) {
        if self.reload.as_ref().is_some_and(|rx| rx.has_changed().unwrap_or(false)) {
            // A standby's only connection is re-made on its next loop; nothing to do here.
            let _ = self.adopt_reload();
        }
    }

    /// Adopts the latest reloaded config; true when it changed how a side is reached
    /// (endpoints, TLS, auth), which takes a reconnect.
    fn adopt_reload(&mut self) -> bool {
        let Some(rx) = self.reload.as_mut() else { return false };
        let new = rx.borrow_and_update().clone();
        info!(
            epoch = new.epoch,
            max_ops_per_second = new.sync.max_ops_per_second,
            reconcile_interval = %new.reconcile.interval,
            "config reloaded"
        );
        self.update(|s| s.epoch = new.epoch as u64);
        let reach = |c: &Config| {
            [&c.source, &c.target].map(|side| (side.endpoints.clone(), side.tls.clone(), side.auth.clone()))
        };
        let reconnect = reach(&self.cfg) != reach(&new);
        self.cfg = new;
        reconnect
    }

    /// Observes apply latency and batch size into `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Engine {
        self.metrics = Some(metrics);
        self
    }

    fn update(&self, f: impl FnOnce(&mut Status)) {
        let mut s = self.status.write().expect("status lock");
        f(&mut s);
        s.lag_revisions = (s.source_revision - s.watermark).max(0);
        let mut behind = self.behind_since.write().expect("lag lock");
        if s.lag_revisions == 0 {
            *behind = None;
            s.lag_seconds = 0.0;
        } else {
            s.lag_seconds = behind.get_or_insert_with(Instant::now).elapsed().as_secs_f64();
        }
    }

    fn set_phase(&self, phase: Phase) {
        let old = self.status.read().expect("status lock").phase;
        if old != phase {
            info!(from = old.as_str(), to = phase.as_str(), "phase");
            self.update(|s| {
                s.phase = phase;
                let available = matches!(phase, Phase::Syncing);
                s.set_condition("Available", available, phase_reason(phase), "");
            });
        }
    }

    /// Runs until shutdown. Transient errors back off and reconnect; permanent ones park the
    /// engine in `failed` (HTTP keeps serving); fence losses park it in `standby`.
    pub async fn run(mut self) {
        let mut pending = Pending::Resume;
        let mut backoff = self.cfg.sync.backoff.initial.get();
        let mut last_reconnect: Option<Instant> = None;
        loop {
            if self.shutdown.is_cancelled() {
                return;
            }
            let result = self.connect_and_run(pending).await;
            pending = Pending::Resume;
            let err = match result {
                Ok(()) => return,
                Err(EngineError::Reconnect(why)) => {
                    info!(why, "reconnecting both sides with the current settings and files");
                    // Immediate once; a reconnect that asks for another within seconds (a
                    // server that takes the handshake but then refuses) waits the initial backoff.
                    if last_reconnect.is_some_and(|at| at.elapsed() < Duration::from_secs(10)) {
                        tokio::select! {
                            _ = self.shutdown.cancelled() => return,
                            _ = tokio::time::sleep(self.cfg.sync.backoff.initial.get()) => {}
                        }
                    }
                    last_reconnect = Some(Instant::now());
                    continue;
                }
                Err(e) => e,
            };
            let class = err.class();
            self.update(|s| {
                s.last_error = Some(LastError {
                    class: class.to_string(),
                    reason: err.reason(),
                    message: err.to_string(),
                })
            });
            match &err {
                EngineError::Fence(f) if f.standby_reason().is_some() => {
                    let reason = f.standby_reason().unwrap_or("Fenced");
                    error!(reason, "fenced: {f}; entering cold standby, no further writes");
                    if self.standby(reason, &f.to_string()).await {
                        self.update(|s| s.set_condition("Fenced", false, "TakingOver", ""));
                        continue;
                    }
                    return;
                }
                EngineError::RestartGenesis(reason) => {
                    self.note_resync(reason, false);
                    pending = Pending::FreshGenesis;
                    continue;
                }
                EngineError::Resync(reason) => {
                    self.note_resync(reason, true);
                    pending = Pending::FreshGenesis;
                    continue;
                }
                EngineError::Etcd(_) if class == ErrorClass::Resync => {
                    self.note_resync("SourceCompacted", true);
                    pending = Pending::FreshGenesis;
                    continue;
                }
                _ => {}
            }
            match class {
                ErrorClass::Permanent => {
                    error!(reason = %err.reason(), "permanent error, writes stopped: {err}");
                    self.set_phase(Phase::Failed);
                    if let EngineError::Refused { reason, message } = &err {
                        if is_condition(reason) {
                            let (reason, message) = (*reason, message.clone());
                            self.update(|s| s.set_condition(reason, true, reason, message));
                        }
                    }
                    if let EngineError::Fence(FenceError::PrefixConflict { .. }) = &err {
                        self.update(|s| {
                            s.set_condition("PrefixConflict", true, "PrefixConflict", err.to_string())
                        });
                    }
                    self.shutdown.cancelled().await;
                    return;
                }
                _ => {
                    warn!(class = %class, reason = %err.reason(), "{err}; retrying in {backoff:?}");
                    // Never connected yet: still connecting (not ready). Lost a working link:
                    // degraded (ready, and saying so) while it reconnects.
                    if self.ever_connected {
                        self.set_phase(Phase::Degraded);
                    }
                    tokio::select! {
                        _ = self.shutdown.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(self.cfg.sync.backoff.max.get());
                }
            }
        }
    }

    /// Records a forced resync (history lost: fresh genesis with prune) or a genesis restart
    /// (buffer overflow or compaction while scanning). Both count towards the loop detector:
    /// three in a row with no live apply between latch `ResyncLoopDetected`, which a live apply
    /// clears.
    fn note_resync(&mut self, reason: &str, forced: bool) {
        self.resyncs_in_a_row += 1;
        let looping = self.resyncs_in_a_row >= 3;
        if forced {
            warn!(reason, in_a_row = self.resyncs_in_a_row, "forced resync: fresh genesis with prune");
        } else {
            warn!(reason, in_a_row = self.resyncs_in_a_row, "restarting genesis from a fresh R0");
        }
        let mut latched_now = false;
        self.update(|s| {
            if forced {
                s.forced_resyncs.count += 1;
                *s.forced_resyncs.by_reason.entry(reason.to_owned()).or_default() += 1;
                s.forced_resyncs.last_reason = Some(reason.to_owned());
            } else {
                s.scan_restarts += 1;
            }
            if looping && !s.condition("ResyncLoopDetected") {
                latched_now = true;
                s.set_condition(
                    "ResyncLoopDetected",
                    true,
                    reason,
                    "3 resyncs or genesis restarts in a row with no live apply between",
                );
            }
        });
        if latched_now {
            error!(reason, "resync loop: the source changes or compacts faster than the agent can scan");
        }
    }

    /// Cold standby: no writes; watch the fence and report it until shutdown, or until a
    /// reloaded config raises our epoch above the stored one (then returns true: take over).
    async fn standby(&mut self, reason: &str, message: &str) -> bool {
        self.set_phase(Phase::Standby);
        self.update(|s| s.set_condition("Fenced", true, reason, message));
        // Keep the fence visible in status; log only on change.
        let mut last: Option<(u64, String)> = None;
        let Ok(client) = connect(Side::Target, &self.cfg.target, &self.cfg.sync).await else {
            self.shutdown.cancelled().await;
            return false;
        };
        let mut kv = client.kv_client();
        let key = self.cfg.checkpoint_key();
        loop {
            self.take_reload();
            if let Ok(Observed::Present { record, .. }) =
                read_checkpoint(&mut kv, &key, self.cfg.sync.request_timeout.get()).await
            {
                if record.role == Role::Mirror && self.cfg.epoch as u64 > record.epoch {
                    info!(
                        ours = self.cfg.epoch,
                        stored = record.epoch,
                        "epoch raised above the fence; taking over"
                    );
                    return true;
                }
                let now = (record.epoch, record.agent_id.clone());
                if last.as_ref() != Some(&now) {
                    info!(epoch = record.epoch, holder = %record.agent_id, "fence held by another writer");
                    self.update(|s| s.watermark = record.watermark);
                    last = Some(now);
                }
            }
            tokio::select! {
                _ = self.shutdown.cancelled() => return false,
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
        }
    }

    /// A TLS failure before the link ever worked is a wrong config: permanent, named. After it
    /// worked, the same failure is more likely a rotation in progress and is retried.
    fn refuse_tls_at_start(&self, e: EtcdError) -> EngineError {
        match e.fault {
            Fault::TlsConfig | Fault::TlsRejected if !self.ever_connected => EngineError::Refused {
                reason: if e.fault == Fault::TlsConfig { "TlsConfig" } else { "TlsRejected" },
                message: format!("{} on {}: {}", e.op, e.side, e.source),
            },
            _ => e.into(),
        }
    }

    async fn connect_and_run(&mut self, pending: Pending) -> Result<(), EngineError> {
        if !self.ever_connected {
            self.set_phase(Phase::Connecting);
        }
        // Taken before the files are read, so a rotation racing the connect is seen next check.
        let tls_files = tls_fingerprint(&self.cfg);
        let sync = &self.cfg.sync;
        let source_probe = probe_members(Side::Source, &self.cfg.source, sync).await;
        self.update(|s| reachability(s, "SourceReachable", &source_probe));
        let source_probe = source_probe.map_err(|e| self.refuse_tls_at_start(e))?;
        let target_probe = probe_members(Side::Target, &self.cfg.target, sync).await;
        self.update(|s| reachability(s, "TargetReachable", &target_probe));
        let target_probe = target_probe.map_err(|e| self.refuse_tls_at_start(e))?;
        self.ever_connected = true;
        let expiry = (tls_expiry(&self.cfg.source), tls_expiry(&self.cfg.target));
        let (source_info, source_cluster) = side_status(Side::Source, &source_probe)?;
        let (target_info, target_cluster) = side_status(Side::Target, &target_probe)?;
        self.update(|s| members_reachable(s, &source_probe, &target_probe));
        let learner = source_info.learner || target_info.learner;
        let trust = match sync.trust_progress_notify {
            TrustProgressNotify::Always => true,
            TrustProgressNotify::Never => false,
            TrustProgressNotify::Auto => progress_notify_trustworthy(&source_info.version),
        };
        self.update(|s| {
            s.source = SideStatus { tls_cert_expiry: expiry.0, ..source_info.clone() };
            s.target = SideStatus { tls_cert_expiry: expiry.1, ..target_info.clone() };
            s.set_condition("LearnerEndpoint", learner, "Probe", "an endpoint is a learner");
        });
        if source_cluster == target_cluster {
            let (src, dst) = (self.rewriter.source_prefix(), self.rewriter.dest_prefix());
            if src.starts_with(dst) || dst.starts_with(src) {
                self.update(|s| s.set_condition("DirectionConflict", true, "SameCluster", ""));
                return Err(EngineError::Refused {
                    reason: "DirectionConflict",
                    message: "source and target are the same cluster and the ranges overlap".into(),
                });
            }
        }

        let sync = &self.cfg.sync;
        let source =
            connect_to(Side::Source, &self.cfg.source, sync, &source_probe.reachable_endpoints()).await?;
        let reverse = mirror_reconcile::find_reverse_link(
            &mut source.kv_client(),
            &self.rewriter,
            source_cluster,
            target_cluster,
            sync.request_timeout.get(),
        )
        .await?;
        if let Some(other) = reverse {
            let message = format!(
                "link {:?} mirrors this link's target cluster into its source range (its checkpoint is at {} in the source); \
                 together they would echo every write forever, so nothing was written",
                other.link_uid,
                self.rewriter.redact(&other.namespace)
            );
            self.update(|s| s.set_condition("DirectionConflict", true, "ReverseLink", message.clone()));
            return Err(EngineError::Refused { reason: "DirectionConflict", message });
        }
        let target =
            connect_to(Side::Target, &self.cfg.target, sync, &target_probe.reachable_endpoints()).await?;
        let mut run = Run {
            engine: self,
            source,
            target_kv: target.kv_client(),
            source_cluster,
            target_cluster,
            trust,
            writer: None,
            watch: None,
            drain_target: None,
            tls_files,
            idle_replies: 0,
            drain_settles: 0,
            member_probe: None,
        };
        run.start(pending).await
    }
}

/// A probe of the source and of the target.
type BothProbes = (Result<Probe, EtcdError>, Result<Probe, EtcdError>);

/// Everything one connected run needs.
struct Run<'e> {
    engine: &'e mut Engine,
    source: Client,
    target_kv: KvClient,
    source_cluster: u64,
    target_cluster: u64,
    trust: bool,
    writer: Option<FencedWriter>,
    /// The tail's source watch; dropped (cancelled) under sustained target backoff so the
    /// source's events wait in the source, not in this process.
    watch: Option<Watch>,
    /// Drain mode: the source revision the watermark must reach before verification.
    drain_target: Option<i64>,
    /// [`tls_fingerprint`] taken before this run connected; a change means rotated files.
    tls_files: Option<Vec<[u8; 32]>>,
    /// Untrusted progress replies in a row with no event between (the source looks idle).
    idle_replies: u32,
    /// Comparisons in a row during a drain that found the target behind.
    drain_settles: u32,
    /// A background probe of every member of both sides (for `MemberUnreachable`).
    member_probe: Option<tokio::task::JoinHandle<BothProbes>>,
}

/// The source watch, split so the request half can ask for progress while the response half is
/// read (or buffered by a forwarder during the scan).
struct Watch {
    sender: WatchRequestSender,
    stream: WatchResponseStream,
}

impl Run<'_> {
    fn cfg(&self) -> &Config {
        &self.engine.cfg
    }

    fn timeout(&self) -> Duration {
        self.engine.cfg.sync.request_timeout.get()
    }

    fn template(&self, watermark: i64) -> Checkpoint {
        Checkpoint {
            link_uid: self.cfg().link_uid.clone(),
            epoch: self.cfg().epoch as u64,
            role: Role::Mirror,
            watermark,
            scanning: false,
            scan_cursor: Vec::new(),
            prune_pending: false,
            source_cluster_id: self.source_cluster,
            target_cluster_id: self.target_cluster,
            agent_id: self.engine.agent_id.clone(),
        }
    }

    /// Packs independent target ops by `max_txn_ops` (one slot left for the checkpoint) and
    /// `txn_flush_bytes`.
    fn chunker(&self) -> OpChunker {
        let sync = &self.cfg().sync;
        OpChunker::new((sync.max_txn_ops as usize).saturating_sub(1), sync.txn_flush_bytes.bytes() as usize)
    }

    /// Page limits and deadline of every reader, as configured.
    fn page_options(&self, op: &'static str) -> mirror_core::PagerOptions {
        let sync = &self.cfg().sync;
        mirror_core::PagerOptions::new(
            op,
            sync.page_key_limit,
            sync.page_bytes.bytes() as usize,
            sync.request_timeout.get(),
        )
    }

    fn writer(&mut self) -> &mut FencedWriter {
        self.writer.as_mut().expect("fence claimed before any write")
    }

    async fn start(&mut self, pending: Pending) -> Result<(), EngineError> {
        let key = self.cfg().checkpoint_key();
        let timeout = self.timeout();
        let observed = read_checkpoint(&mut self.target_kv, &key, timeout).await?;
        mirror_fence::may_claim(&observed, &self.template(0))?;
        let stored = match &observed {
            Observed::Present { record, .. } => Some(record.clone()),
            Observed::Absent => None,
        };
        let clusters_changed = stored.as_ref().is_some_and(|r| {
            r.source_cluster_id != self.source_cluster || r.target_cluster_id != self.target_cluster
        });
        if clusters_changed {
            warn!("stored cluster ids differ from the connected clusters; fresh genesis with require_empty re-armed");
        }
        match stored {
            Some(r) if pending == Pending::Resume && !clusters_changed && !r.scanning => {
                // Tail from the watermark.
                let mut next = r.clone();
                next.epoch = self.cfg().epoch as u64;
                next.agent_id = self.engine.agent_id.clone();
                self.claim(observed, next).await?;
                self.engine.update(|s| {
                    s.watermark = r.watermark;
                    s.initial_sync.completed.get_or_insert_with(now_rfc3339);
                    s.set_condition("InitialSyncComplete", true, "Resumed", "");
                });
                let watch = self.open_watch(r.watermark + 1).await?;
                self.tail(watch, None).await
            }
            Some(r) if pending == Pending::Resume && !clusters_changed => {
                // Resume a scan in progress.
                let mut next = r.clone();
                next.epoch = self.cfg().epoch as u64;
                next.agent_id = self.engine.agent_id.clone();
                self.claim(observed, next).await?;
                self.genesis(r.watermark, r.scan_cursor.clone(), r.prune_pending).await
            }
            stored => {
                let first_ever = stored.is_none() || clusters_changed;
                if first_ever && self.cfg().initial_sync.mode == InitialSyncMode::RequireEmpty {
                    self.require_empty().await?;
                }
                let prune = !first_ever || self.cfg().initial_sync.mode == InitialSyncMode::OverwriteAndPrune;
                let (total, r0) = count(
                    &mut self.source.kv_client(),
                    &self.engine.rewriter.scan_windows(),
                    None,
                    Side::Source,
                    self.timeout(),
                )
                .await?;
                let r0 = match self.cfg().initial_sync.start_revision {
                    0 => r0,
                    start => start.min(r0),
                };
                let mut next = self.template(r0);
                next.scanning = true;
                next.prune_pending = prune;
                self.claim(observed, next).await?;
                self.engine.update(|s| {
                    s.initial_sync.total_keys = total;
                    s.initial_sync.keys = 0;
                    s.initial_sync.started = Some(now_rfc3339());
                    s.initial_sync.completed = None;
                    s.watermark = r0;
                    s.set_condition("InitialSyncComplete", false, "Scanning", "");
                });
                self.genesis(r0, Vec::new(), prune).await
            }
        }
    }

    async fn claim(&mut self, observed: Observed, next: Checkpoint) -> Result<(), EngineError> {
        let writer = FencedWriter::claim(
            self.target_kv.clone(),
            self.cfg().checkpoint_key(),
            observed,
            next,
            self.timeout(),
        )
        .await?
        .with_max_txn_ops(self.cfg().sync.max_txn_ops as usize);
        info!(epoch = writer.record().epoch, watermark = writer.record().watermark, "holding the fence");
        let watermark = writer.record().watermark;
        self.engine.update(|s| {
            s.watermark = watermark;
            s.set_condition("Fenced", false, "HoldingFence", "");
        });
        self.writer = Some(writer);
        Ok(())
    }

    /// The source's current revision, from a count-only Get (no data read).
    async fn source_revision(&mut self) -> Result<i64, EngineError> {
        let range = self.engine.rewriter.source_range();
        let opts = GetOptions::new().with_range(range.end).with_count_only();
        let resp = unary(
            "revision",
            Side::Source,
            self.timeout(),
            self.source.kv_client().get(range.start, Some(opts)),
        )
        .await?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    async fn require_empty(&mut self) -> Result<(), EngineError> {
        let windows = self.engine.rewriter.target_windows();
        let timeout = self.timeout();
        let (n, _) = count(&mut self.target_kv, &windows, None, Side::Target, timeout).await?;
        if n > 0 {
            let message = format!(
                "initial_sync.mode = require_empty but the destination range holds {n} keys; nothing was written"
            );
            self.engine
                .update(|s| s.set_condition("EmptyTargetViolation", true, "TargetNotEmpty", message.clone()));
            return Err(EngineError::Refused { reason: "EmptyTargetViolation", message });
        }
        Ok(())
    }

    async fn open_watch(&mut self, start: i64) -> Result<Watch, EngineError> {
        let stream = open_watch(&mut self.source, &self.engine.rewriter, start).await?;
        let (sender, stream) = stream.split();
        Ok(Watch { sender, stream })
    }

    /// Steps 4-7 of SPEC §5 from a claimed `{scanning: true, watermark: r0}`.
    async fn genesis(&mut self, r0: i64, cursor: Vec<u8>, prune: bool) -> Result<(), EngineError> {
        self.engine.set_phase(Phase::InitialSync);
        if prune {
            // Before the first data write, not only before the sweep.
            self.refuse_foreign_links().await?;
        }
        let mut watch = match self.open_watch(r0 + 1).await {
            Ok(w) => w,
            Err(EngineError::Etcd(e)) if e.class() == ErrorClass::Resync => {
                return Err(EngineError::Resync("CompactedDuringScan"))
            }
            Err(e) => return Err(e),
        };
        // Buffer the watch while scanning.
        let buffer =
            Arc::new(Mutex::new(ReplayBuffer::new(self.cfg().sync.watch_buffer_bytes.bytes() as usize)));
        let stop = CancellationToken::new();
        let forwarder = tokio::spawn(forward(
            watch.stream,
            buffer.clone(),
            stop.clone(),
            self.engine.rewriter.clone(),
            r0,
        ));

        let scan = self.scan(r0, cursor, prune, &forwarder).await;
        stop.cancel();
        let (stream, forwarded) =
            forwarder.await.map_err(|_| EngineError::RestartGenesis("ForwarderPanicked"))?;
        scan?;
        forwarded?;
        watch.stream = stream;

        // Prune owed: sweep target keys whose source no longer has them.
        if prune {
            self.sweep(r0).await?;
        }
        let scan_end = self.source_revision().await?;
        let replay = buffer.lock().await.drain();
        info!(r0, scan_end, buffered = replay.len(), "scan done; replaying to scan_end");
        self.tail(watch, Some((scan_end, replay))).await
    }

    /// Step 5: the scan, pipelined (SPEC §9's hint).
    ///
    /// A reader task fetches the next page while the current one is written. Pages are cut into
    /// Txn-sized chunks and written in *cycles*: every chunk of a cycle but the last goes out as a
    /// data-only Txn carrying just the fence compare, up to [`SCAN_TXNS_IN_FLIGHT`] at once. They
    /// all compare the same mod revision, so they never conflict with each other, and scan keys
    /// are disjoint and idempotent, so their order does not matter. Only when all of them have
    /// landed does the last chunk go out together with the checkpoint put that advances
    /// `scan_cursor`. The fence holds: a takeover moves the mod revision and every stale Txn
    /// fails; a chunk that failed is redone through the fenced, judged commit path.
    async fn scan(
        &mut self,
        r0: i64,
        cursor: Vec<u8>,
        prune: bool,
        forwarder: &tokio::task::JoinHandle<(WatchResponseStream, Result<(), EngineError>)>,
    ) -> Result<(), EngineError> {
        let cfg = self.engine.cfg.sync.clone();
        let mut scanner = Scanner::new(
            self.source.kv_client(),
            &self.engine.rewriter,
            cfg.page_key_limit,
            cfg.page_bytes.bytes() as usize,
            cfg.request_timeout.get(),
        )
        .resume_after(&cursor);
        // A few pages ahead, so the next cycle's pages are read while this one is written;
        // bounded, so memory stays O(page bytes).
        let (tx, mut pages) = tokio::sync::mpsc::channel(SCAN_READ_AHEAD_PAGES);
        let reader = tokio::spawn(async move {
            loop {
                let page = scanner.next_page().await;
                let done = !matches!(page, Ok(Some(_)));
                if tx.send(page).await.is_err() || done {
                    return;
                }
            }
        });
        let result = async {
            let max_ops = (cfg.max_txn_ops as usize).saturating_sub(1).max(1);
            let max_bytes = cfg.txn_flush_bytes.bytes() as usize;
            let mut cycle: Vec<Vec<Op>> = Vec::new();
            let mut cursor = cursor;
            let mut leased = 0u64;
            while let Some(page) = pages.recv().await {
                let Some(page) = page? else { break };
                if forwarder.is_finished() {
                    // The forwarder stops early only on overflow or a compacted watch.
                    return Ok(());
                }
                let mut chunker = OpChunker::new(max_ops, max_bytes);
                for kv in &page.kvs {
                    let Some(key) = self.engine.rewriter.to_target(kv.key()) else { continue };
                    leased += u64::from(kv.lease() != 0);
                    cycle.extend(chunker.push(Op::Put { key, value: kv.value().to_vec() }));
                }
                cycle.extend(chunker.take());
                cursor = page.last_key().map(<[u8]>::to_vec).unwrap_or(cursor);
                if cycle.len() >= SCAN_CYCLE_TXNS {
                    self.flush_scan_cycle(
                        std::mem::take(&mut cycle),
                        r0,
                        prune,
                        &cursor,
                        std::mem::take(&mut leased),
                    )
                    .await?;
                }
            }
            if !cycle.is_empty() {
                self.flush_scan_cycle(cycle, r0, prune, &cursor, leased).await?;
            }
            Ok(())
        }
        .await;
        reader.abort();
        result
    }

    /// Writes one scan cycle: concurrent data-only Txns, then the last chunk with the cursor.
    async fn flush_scan_cycle(
        &mut self,
        mut cycle: Vec<Vec<Op>>,
        r0: i64,
        prune: bool,
        cursor: &[u8],
        leased: u64,
    ) -> Result<(), EngineError> {
        let Some(last) = cycle.pop() else { return Ok(()) };
        let keys = cycle.iter().map(Vec::len).sum::<usize>() + last.len();
        let timeout = self.timeout();
        let in_flight = cycle.into_iter().map(|chunk| {
            let txn = self.writer().data_txn(chunk.iter().map(Op::to_txn_op).collect());
            let mut kv = self.target_kv.clone();
            async move {
                let landed = match txn {
                    Ok(txn) => unary("scan txn", Side::Target, timeout, kv.txn(txn))
                        .await
                        .is_ok_and(|r| r.succeeded()),
                    Err(_) => false,
                };
                (chunk, landed)
            }
        });
        let results: Vec<(Vec<Op>, bool)> =
            futures::stream::iter(in_flight).buffer_unordered(SCAN_TXNS_IN_FLIGHT).collect().await;
        self.pace(keys - last.len()).await;
        for (chunk, landed) in results {
            if !landed {
                // Redo through the judged path: a moved fence surfaces as a FenceError there.
                let same = self.writer().record().clone();
                self.commit_with_retry(&chunk, same).await?;
            }
        }
        let mut next = self.writer().record().clone();
        next.watermark = r0;
        next.scanning = true;
        next.prune_pending = prune;
        next.scan_cursor = cursor.to_vec();
        self.commit_with_retry(&last, next).await?;
        self.engine.update(|s| {
            s.initial_sync.keys += keys as u64;
            s.keys_applied_total += keys as u64;
            s.lease_backed_keys += leased;
        });
        Ok(())
    }

    /// Mark-and-sweep: delete target keys (outside the reserved namespace) whose source key does
    /// not exist now. Changes after R0 are replayed afterwards, so deleting by the source's
    /// current state is safe. A keys-only merge-join of both sides ([`mirror_reconcile::Differ`]),
    /// so at most two pages are in memory; another link's keys are never candidates, and another
    /// link found inside the destination range stops the sweep before anything is deleted.
    async fn sweep(&mut self, r0: i64) -> Result<(), EngineError> {
        self.refuse_foreign_links().await?;
        let mut chunker = self.chunker();
        let page = self.page_options("sweep page").keys_only();
        let mut differ = mirror_reconcile::Differ::new(
            self.engine.rewriter.clone(),
            self.source.kv_client(),
            self.target_kv.clone(),
            page,
        );
        let mut deleted = 0u64;
        info!("prune sweep started");
        loop {
            let diff = differ.next_difference().await?;
            let done = diff.is_none();
            let full = match diff {
                Some(mirror_reconcile::Difference::Orphan { key, .. }) => chunker.push(Op::Delete { key }),
                _ if done => chunker.take(),
                _ => None,
            };
            if let Some(batch) = full {
                let mut next = self.writer().record().clone();
                next.watermark = r0;
                next.scanning = true;
                next.prune_pending = true;
                deleted += batch.len() as u64;
                self.commit_with_retry(&batch, next).await?;
            }
            if done && chunker.is_empty() {
                break;
            }
        }
        info!(deleted, "prune sweep done");
        Ok(())
    }

    /// Refuses to prune or delete orphans while another link's reserved namespace lies inside
    /// the destination range (a nested `dest_prefix`): its keys are not ours to judge.
    async fn refuse_foreign_links(&mut self) -> Result<(), EngineError> {
        let page = self.page_options("foreign link check").keys_only();
        let found =
            mirror_reconcile::find_foreign_link(self.target_kv.clone(), &self.engine.rewriter, page).await?;
        let Some(other) = found else { return Ok(()) };
        let message = format!(
            "link {:?} keeps its checkpoint inside this link's destination range (at {}); a prune or \
             delete_orphans would delete its data, so nothing was deleted",
            other.link_uid,
            self.engine.rewriter.redact(&other.namespace)
        );
        Err(EngineError::Refused { reason: "PrefixConflict", message })
    }

    /// A comparison of the source pinned at the watermark with the target as it is: while the
    /// tail is not writing, that is the state G3 says must be equal.
    fn differ_at_watermark(&mut self) -> mirror_reconcile::Differ {
        let watermark = self.writer.as_ref().expect("fence claimed").record().watermark;
        let page = self.page_options("reconcile page").at_revision(watermark);
        mirror_reconcile::Differ::new(
            self.engine.rewriter.clone(),
            self.source.kv_client(),
            self.target_kv.clone(),
            page,
        )
    }

    /// Counts and compares both sides with the source pinned at the watermark; no writes.
    async fn compare_at_watermark(&mut self) -> Result<mirror_reconcile::Counts, EngineError> {
        let mut differ = self.differ_at_watermark();
        while differ.next_difference().await?.is_some() {}
        Ok(differ.counts)
    }

    /// Drain, step 2 (SPEC §5): the watermark reached the drain target. Count both sides, repair
    /// once if they differ, refuse if they still differ, else promote the target: the fence's
    /// role becomes `primary`, so every later writer with the old view fails its compare.
    async fn verify_and_promote(&mut self, drain_target: i64) -> Result<(), EngineError> {
        let mut counts = self.compare_at_watermark().await?;
        if !counts.equal() {
            warn!(
                missing = counts.missing,
                divergent = counts.divergent,
                orphan = counts.orphan,
                "drain: sides differ; one repair pass"
            );
            self.reconcile_pass(true).await?;
            counts = self.compare_at_watermark().await?;
        }
        if !counts.equal() {
            let message = format!(
                "after one repair pass the sides still differ at watermark {}: missing {}, divergent {}, orphan {}",
                self.writer().record().watermark,
                counts.missing,
                counts.divergent,
                counts.orphan
            );
            self.engine
                .update(|s| s.set_condition("DrainVerificationFailed", true, "SidesDiffer", message.clone()));
            return Err(EngineError::Refused { reason: "DrainVerificationFailed", message });
        }
        let mut next = self.writer().record().clone();
        next.role = Role::Primary;
        let drained = next.watermark;
        self.commit_with_retry(&[], next).await?;
        info!(
            drained_revision = drained,
            source_keys = counts.source_keys,
            "cut over: the target is primary; no further writes"
        );
        self.watch = None;
        self.engine.update(|s| {
            s.role = "primary".into();
            s.source_keys = Some(counts.source_keys);
            s.target_keys = Some(counts.target_keys);
            s.cutover = Some(mirror_core::CutoverStatus {
                drain_target_revision: drain_target,
                drained_revision: drained,
                verified_time: Some(now_rfc3339()),
                source_keys: counts.source_keys,
                target_keys: counts.target_keys,
                leased_keys: counts.leased_keys,
            });
            s.set_condition(
                "CutoverReady",
                true,
                "Verified",
                format!("verified at source revision {drained}"),
            );
            s.set_condition("InvariantsHeld", true, "CountsEqual", "");
        });
        self.engine.set_phase(Phase::Drained);
        Ok(())
    }

    /// One diff-and-repair pass (SPEC §5): the source pinned at the watermark against the target,
    /// merged page by page. Missing and divergent keys are repaired, orphans deleted when
    /// `delete_orphans`; every repair is a fenced Txn that also re-writes the checkpoint (same
    /// watermark), paced by `max_ops_per_second`. Counts, pass time and drift are published in
    /// one status update. A fence bump surfaces as a `FenceError` from the first repair after it
    /// and aborts the pass with nothing more written.
    async fn reconcile_pass(&mut self, delete_orphans: bool) -> Result<(), EngineError> {
        let started = Instant::now();
        if delete_orphans {
            self.refuse_foreign_links().await?;
        }
        let watermark = self.writer().record().watermark;
        let sync = self.cfg().sync.clone();
        let mut differ = self.differ_at_watermark();
        let mut chunker = self.chunker();
        let rate = sync.max_ops_per_second.max(0) as f64;
        let mut repaired = 0u64;
        loop {
            let diff = match differ.next_difference().await {
                Ok(d) => d,
                Err(e) if e.class() == ErrorClass::Resync => {
                    // The watermark was compacted in the source: nothing to compare against
                    // until the watermark moves; the data is not in doubt.
                    warn!("reconcile pass skipped: the source compacted past the watermark");
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            };
            let done = diff.is_none();
            let full = match diff {
                Some(
                    mirror_reconcile::Difference::Missing(e) | mirror_reconcile::Difference::Divergent(e),
                ) => chunker.push(Op::Put { key: e.key, value: e.value }),
                Some(mirror_reconcile::Difference::Orphan { key, .. }) if delete_orphans => {
                    chunker.push(Op::Delete { key })
                }
                _ if done => chunker.take(),
                _ => None,
            };
            if let Some(batch) = full {
                let n = batch.len() as u64;
                let same = self.writer().record().clone();
                self.commit_with_retry(&batch, same).await?;
                repaired += n;
                // commit_with_retry paced the repair; a long paced pass must not let the
                // source's events pile up in this process.
                if rate > 0.0 && repaired as f64 > 3.0 * rate && self.watch.take().is_some() {
                    info!("long paced repair: source watch cancelled; will re-watch from the watermark");
                }
            }
            if done && chunker.is_empty() {
                break;
            }
        }
        let c = &differ.counts;
        let drift = !c.equal();
        let held = !drift && c.source_keys == c.target_keys;
        if drift {
            warn!(
                missing = c.missing,
                divergent = c.divergent,
                orphan = c.orphan,
                repaired,
                "reconcile pass found drift"
            );
        }
        self.engine.update(|s| {
            s.source_keys = Some(c.source_keys);
            s.target_keys = Some(c.target_keys);
            s.last_reconcile = Some(mirror_core::LastReconcile {
                time: Some(now_rfc3339()),
                missing: c.missing,
                divergent: c.divergent,
                orphan: c.orphan,
                repaired,
                keys_compared: c.source_keys,
                duration_seconds: started.elapsed().as_secs_f64(),
            });
            s.set_condition(
                "DriftDetected",
                drift,
                if drift { "Drift" } else { "NoDrift" },
                format!(
                    "missing {}, divergent {}, orphan {}, repaired {repaired}",
                    c.missing, c.divergent, c.orphan
                ),
            );
            s.set_condition(
                "InvariantsHeld",
                held,
                if held { "CountsEqual" } else { "CountsDiffer" },
                format!(
                    "source {} keys, target {} keys at watermark {watermark}",
                    c.source_keys, c.target_keys
                ),
            );
        });
        Ok(())
    }

    /// The tail. With `genesis = Some((scan_end, replay))`, first applies the replay and keeps
    /// `scanning: true` until the watermark reaches `scan_end`.
    async fn tail(&mut self, watch: Watch, genesis: Option<(i64, Vec<Revision>)>) -> Result<(), EngineError> {
        self.watch = Some(watch);
        let mut scan_end = genesis.as_ref().map(|(e, _)| *e);
        if let Some((_, replay)) = genesis {
            self.apply_revisions(replay, &mut scan_end).await?;
        }
        if scan_end.is_none() {
            self.engine.set_phase(Phase::Syncing);
        }
        let steady = self.cfg().sync.progress_interval.get();
        let interval = self.cfg().reconcile.interval.get();
        let mut next_reconcile = (!interval.is_zero()).then(|| Instant::now() + interval);
        let mut fence_check = tokio::time::interval(FENCE_CHECK_INTERVAL);
        let mut tls_check = tokio::time::interval(TLS_CHECK_INTERVAL);
        let mut member_check = tokio::time::interval(MEMBER_CHECK_INTERVAL);
        // While the initial sync waits for scan_end, ask for progress often.
        let mut progress =
            tokio::time::interval(if scan_end.is_some() { Duration::from_millis(500) } else { steady });
        loop {
            if self.watch.is_none() {
                // Cancelled under sustained target backoff; the target takes writes again.
                let from = self.writer().record().watermark + 1;
                info!(from, "re-watching the source from the watermark");
                self.watch = Some(self.open_watch(from).await?);
            }
            let watch = self.watch.as_mut().expect("opened above");
            let reconcile_at = next_reconcile.filter(|_| scan_end.is_none());
            let resp = tokio::select! {
                _ = self.engine.shutdown.cancelled() => return Ok(()),
                _ = reload_changed(&mut self.engine.reload) => {
                    if self.engine.adopt_reload() {
                        return Err(EngineError::Reconnect("ConnectionSettingsReloaded"));
                    }
                    let interval = self.cfg().reconcile.interval.get();
                    next_reconcile = (!interval.is_zero()).then(|| Instant::now() + interval);
                    continue;
                }
                _ = tls_check.tick(), if self.tls_files.is_some() && scan_end.is_none() => {
                    if tls_fingerprint(self.cfg()) != self.tls_files {
                        return Err(EngineError::Reconnect("TlsFilesChanged"));
                    }
                    continue;
                }
                _ = member_check.tick(), if self.member_probe.is_none() => {
                    let cfg = self.engine.cfg.clone();
                    self.member_probe = Some(tokio::spawn(async move {
                        let source = probe_members(Side::Source, &cfg.source, &cfg.sync).await;
                        let target = probe_members(Side::Target, &cfg.target, &cfg.sync).await;
                        (source, target)
                    }));
                    continue;
                }
                probed = join_some(&mut self.member_probe) => {
                    self.member_probe = None;
                    if let Ok((Ok(source), Ok(target))) = probed {
                        self.engine.update(|s| members_reachable(s, &source, &target));
                    }
                    continue;
                }
                _ = fence_check.tick() => {
                    // An idle tail learns of a takeover or a cutover now, not at its next write.
                    self.writer().verify_held().await?;
                    continue;
                }
                _ = sleep_until_some(reconcile_at) => {
                    // Inline on the tail's own task: it cannot overlap genesis, a sweep, a
                    // drain or itself, and no tail write races its reads.
                    self.reconcile_pass(self.cfg().reconcile.delete_orphans).await?;
                    next_reconcile = Some(Instant::now() + interval);
                    continue;
                }
                _ = progress.tick() => {
                    let _ = watch.sender.request_progress().await;
                    continue;
                }
                msg = watch.stream.message() => msg,
            };
            let resp = match resp {
                Ok(Some(r)) => r,
                Ok(None) => {
                    return Err(EngineError::Etcd(EtcdError::new(
                        "watch",
                        Side::Source,
                        etcd_client::Error::WatchError("watch stream ended".into()),
                    )))
                }
                Err(e) => return Err(EtcdError::new("watch", Side::Source, e).into()),
            };
            self.on_response(resp, &mut scan_end).await?;
            if scan_end.is_none() && self.cfg().mode == Mode::Drain {
                let watermark = self.writer().record().watermark;
                match self.drain_target {
                    None => {
                        let target = self.source_revision().await?;
                        info!(
                            drain_target_revision = target,
                            "draining: waiting for the watermark to reach the drain target"
                        );
                        self.drain_target = Some(target);
                        self.engine.update(|s| {
                            s.cutover = Some(mirror_core::CutoverStatus {
                                drain_target_revision: target,
                                ..Default::default()
                            })
                        });
                        progress = tokio::time::interval(Duration::from_millis(500));
                        continue;
                    }
                    Some(target) if watermark >= target => {
                        return self.verify_and_promote(target).await;
                    }
                    Some(_) => continue,
                }
            }
            if scan_end.is_none() && progress.period() != steady {
                progress = tokio::time::interval(steady);
                progress.tick().await;
            }
        }
    }

    async fn on_response(
        &mut self,
        resp: WatchResponse,
        scan_end: &mut Option<i64>,
    ) -> Result<(), EngineError> {
        if resp.canceled() || resp.compact_revision() > 0 {
            let fault = Fault::of_watch_cancel(resp.compact_revision(), resp.cancel_reason());
            return Err(match fault.class() {
                ErrorClass::Resync => EngineError::Resync("WatchCompacted"),
                _ => EngineError::Etcd(EtcdError::new(
                    "watch",
                    Side::Source,
                    etcd_client::Error::WatchError(format!("watch cancelled: {}", resp.cancel_reason())),
                )),
            });
        }
        let header_rev = resp.header().map_or(0, |h| h.revision());
        self.engine.update(|s| s.source_revision = s.source_revision.max(header_rev));
        if resp.created() && resp.events().is_empty() {
            return Ok(());
        }
        let watermark = self.writer().record().watermark;
        if resp.events().is_empty() {
            // A progress notification. Only a trusted one proves that nothing at or below
            // header_rev is still to come (see the module doc).
            let idle = std::mem::replace(&mut self.idle_replies, 0) + 1;
            if self.trust {
                if header_rev > watermark {
                    let batch = Batch { revisions: vec![Revision { revision: header_rev, ops: Vec::new() }] };
                    self.apply(batch, scan_end).await?;
                } else {
                    self.finish_genesis_if_due(scan_end, watermark).await?;
                    self.engine.update(|s| s.last_progress_time = Some(now_rfc3339()));
                }
                return Ok(());
            }
            let must_reach = scan_end.or(self.drain_target).filter(|end| header_rev >= *end);
            match must_reach {
                Some(end) if end > watermark && idle >= 2 => self.settle_at(end, scan_end).await?,
                Some(end) if end > watermark => self.idle_replies = idle,
                Some(_) => self.finish_genesis_if_due(scan_end, watermark).await?,
                None => {}
            }
            return Ok(());
        }
        self.idle_replies = 0;
        let converted = convert_events(resp.events(), &self.engine.rewriter, watermark);
        self.engine.update(|s| s.lease_backed_keys += converted.leased);
        self.apply_revisions(converted.revisions, scan_end).await
    }

    /// Brings the target to the source's state at `end` by comparison, then moves the watermark
    /// to `end` (module doc: "Why genesis and drain completion do not rest on an untrusted
    /// progress reply"). Genesis repairs what differs; a drain only compares, and repairs after
    /// [`DRAIN_SETTLE_ATTEMPTS`] comparisons in a row found the target behind (something other
    /// than undelivered events keeps it different; the verification after the drain repairs
    /// such keys anyway).
    async fn settle_at(&mut self, end: i64, scan_end: &mut Option<i64>) -> Result<(), EngineError> {
        let genesis = scan_end.is_some();
        let prune = self.writer().record().prune_pending;
        let ours_after = self.writer().create_revision();
        let repair = genesis || self.drain_settles + 1 >= DRAIN_SETTLE_ATTEMPTS;
        info!(end, genesis, repair, "source idle: settling the target against the source pinned at {end}");
        let page = self.page_options("settle page").at_revision(end);
        let mut differ = mirror_reconcile::Differ::new(
            self.engine.rewriter.clone(),
            self.source.kv_client(),
            self.target_kv.clone(),
            page,
        );
        let mut chunker = self.chunker();
        let mut differences = 0u64;
        loop {
            let diff = match differ.next_difference().await {
                Ok(d) => d,
                Err(e) if e.class() == ErrorClass::Resync => {
                    // `end` was compacted away while comparing: settle at the current revision
                    // next time; the watch still delivers everything in between.
                    let now = self.source_revision().await?;
                    warn!(end, now, "source compacted past the settle revision; settling at {now} next");
                    if let Some(e) = scan_end.as_mut() {
                        *e = now;
                    } else {
                        self.drain_target = Some(now);
                    }
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            };
            let Some(diff) = diff else { break };
            let op = match diff {
                mirror_reconcile::Difference::Missing(e) | mirror_reconcile::Difference::Divergent(e) => {
                    Op::Put { key: e.key, value: e.value }
                }
                mirror_reconcile::Difference::Orphan { key, mod_revision }
                    if prune || mod_revision > ours_after =>
                {
                    Op::Delete { key }
                }
                mirror_reconcile::Difference::Orphan { .. } => continue,
            };
            differences += 1;
            if !repair {
                continue;
            }
            if let Some(batch) = chunker.push(op) {
                let same = self.writer().record().clone();
                self.commit_with_retry(&batch, same).await?;
            }
        }
        if let Some(batch) = chunker.take() {
            let same = self.writer().record().clone();
            self.commit_with_retry(&batch, same).await?;
        }
        if differences > 0 && !repair {
            self.drain_settles += 1;
            info!(end, differences, "target still behind the source at {end}; waiting for the watch");
            return Ok(());
        }
        self.drain_settles = 0;
        info!(end, repaired = differences, "target settled at the source's state at {end}");
        let batch = Batch { revisions: vec![Revision { revision: end, ops: Vec::new() }] };
        self.apply(batch, scan_end).await
    }

    async fn finish_genesis_if_due(
        &mut self,
        scan_end: &mut Option<i64>,
        watermark: i64,
    ) -> Result<(), EngineError> {
        if let Some(end) = *scan_end {
            if watermark >= end && self.writer().record().scanning {
                let mut next = self.writer().record().clone();
                next.scanning = false;
                next.scan_cursor.clear();
                next.prune_pending = false;
                self.commit_with_retry(&[], next).await?;
            }
            if watermark >= end {
                *scan_end = None;
                info!(watermark, "initial sync complete");
                self.engine.update(|s| {
                    s.initial_sync.completed = Some(now_rfc3339());
                    s.set_condition("InitialSyncComplete", true, "Complete", "");
                });
                self.engine.set_phase(Phase::Syncing);
            }
        }
        Ok(())
    }

    /// Packs whole revisions into batches (flushing at the end: the end of a watch response or
    /// of the replay) and commits each.
    async fn apply_revisions(
        &mut self,
        revisions: Vec<Revision>,
        scan_end: &mut Option<i64>,
    ) -> Result<(), EngineError> {
        let sync = &self.cfg().sync;
        let mut batcher =
            RevisionBatcher::new(sync.max_txn_ops as usize, sync.txn_flush_bytes.bytes() as usize);
        for rev in revisions {
            if let Some(b) = batcher.push(rev) {
                self.apply(b, scan_end).await?;
            }
        }
        if let Some(b) = batcher.take() {
            self.apply(b, scan_end).await?;
        }
        Ok(())
    }

    /// Commits one batch with its checkpoint; splits it when the target finds it too big.
    async fn apply(&mut self, batch: Batch, scan_end: &mut Option<i64>) -> Result<(), EngineError> {
        let last = batch.last_revision();
        let ops: Vec<Op> = batch.ops().cloned().collect();
        let mut next = self.writer().record().clone();
        next.watermark = last;
        let done = scan_end.is_some_and(|end| last >= end);
        if scan_end.is_some() {
            next.scanning = !done;
            if done {
                next.scan_cursor.clear();
                next.prune_pending = false;
            }
        }
        match self.commit_with_retry(&ops, next).await {
            Ok(()) => {}
            Err(EngineError::Etcd(e)) if e.fault.is_txn_too_big() => {
                if batch.revisions.len() > 1 {
                    warn!(
                        revisions = batch.revisions.len(),
                        ops = ops.len(),
                        "target refused a merged Txn as too big; retrying one revision at a time"
                    );
                    for one in batch.split() {
                        Box::pin(self.apply(one, scan_end)).await?;
                    }
                    return Ok(());
                }
                let per_level = self.writer().max_txn_ops();
                if e.fault == Fault::TooManyOps && per_level > 2 {
                    // The target allows fewer ops per level than configured: lay the Txn out
                    // deeper rather than give up a revision that fits its byte limit.
                    warn!(
                        configured = per_level,
                        now = per_level / 2,
                        "target refused a Txn for too many ops per level; sync.max_txn_ops is above the target's --max-txn-ops"
                    );
                    let writer = self.writer.take().expect("fence claimed").with_max_txn_ops(per_level / 2);
                    self.writer = Some(writer);
                    return Box::pin(self.apply(batch, scan_end)).await;
                }
                if e.fault == Fault::RequestTooLarge {
                    if let Some(coalesced) = self.coalesce_deletes(&ops).await? {
                        info!(
                            revision = last,
                            ops = ops.len(),
                            now = coalesced.len(),
                            "revision over the target's request limit: runs of deletes coalesced into range deletes"
                        );
                        let batch = Batch { revisions: vec![Revision { revision: last, ops: coalesced }] };
                        return Box::pin(self.apply(batch, scan_end)).await;
                    }
                }
                let key = ops.first().map(|op| self.engine.rewriter.redact(op.key())).unwrap_or_default();
                let bytes: usize = ops.iter().map(Op::size).sum();
                return Err(EngineError::Refused {
                    reason: "RevisionTooLarge",
                    message: format!(
                        "source revision {last} ({} ops, {bytes} bytes, first key {key}) is too large for the target ({:?}); nothing of it was applied. Raise the target's --max-request-bytes above {bytes}",
                        ops.len(),
                        e.fault
                    ),
                });
            }
            Err(e) => return Err(e),
        }
        let n = ops.len() as u64;
        if scan_end.is_none() {
            self.engine.resyncs_in_a_row = 0;
        }
        self.engine.update(|s| {
            s.watermark = last;
            s.keys_applied_total += n;
            s.last_progress_time = Some(now_rfc3339());
            if n > 0 && s.condition("ResyncLoopDetected") {
                s.set_condition("ResyncLoopDetected", false, "LiveApply", "");
            }
        });
        if done {
            self.finish_genesis_if_due(scan_end, last).await?;
        }
        Ok(())
    }

    /// A revision's ops with runs of deleted keys replaced by range deletes, or `None` when no
    /// run of two or more could be formed. A run is a sequence of keys that are next to each
    /// other *in the target*: the target is read (keys only) over the deletes' span, and any key
    /// there that this revision does not delete (an excluded, reserved, foreign or untouched
    /// key), and any key it puts, ends the run. So a range delete removes exactly the keys the
    /// source revision deleted.
    async fn coalesce_deletes(&mut self, ops: &[Op]) -> Result<Option<Vec<Op>>, EngineError> {
        let mut deletes: Vec<&[u8]> =
            ops.iter().filter(|op| matches!(op, Op::Delete { .. })).map(Op::key).collect();
        if deletes.len() < 2 {
            return Ok(None);
        }
        deletes.sort_unstable();
        let puts: std::collections::BTreeSet<&[u8]> =
            ops.iter().filter(|op| matches!(op, Op::Put { .. })).map(Op::key).collect();
        let span = mirror_core::KeyRange {
            start: deletes[0].to_vec(),
            end: [deletes[deletes.len() - 1], &[0u8]].concat(),
        };
        let page = self.page_options("coalesce page").keys_only();
        let mut target =
            mirror_reconcile::RangeReader::new(self.target_kv.clone(), Side::Target, vec![span], page);
        let mut out: Vec<Op> = ops.iter().filter(|op| matches!(op, Op::Put { .. })).cloned().collect();
        let mut run: Vec<Vec<u8>> = Vec::new();
        let mut next_delete = deletes.iter().peekable();
        let close = |run: &mut Vec<Vec<u8>>, out: &mut Vec<Op>| match run.len() {
            0 => {}
            1 => out.push(Op::Delete { key: run.pop().expect("one") }),
            _ => {
                let key = run.first().expect("two").clone();
                let end = [run.last().expect("two").as_slice(), &[0u8]].concat();
                out.push(Op::DeleteRange { key, end });
                run.clear();
            }
        };
        while let Some(kv) = target.next().await? {
            let key = kv.key();
            // Deletes of keys the target does not hold (none, if G3 holds) stay single.
            while next_delete.peek().is_some_and(|d| **d < key) {
                close(&mut run, &mut out);
                out.push(Op::Delete { key: next_delete.next().expect("peeked").to_vec() });
            }
            let deleted_here = next_delete.peek().is_some_and(|d| **d == key);
            let put_between = run.last().is_some_and(|last| {
                puts.range::<[u8], _>((
                    std::ops::Bound::Excluded(last.as_slice()),
                    std::ops::Bound::Excluded(key),
                ))
                .next()
                .is_some()
            });
            if put_between {
                close(&mut run, &mut out);
            }
            if deleted_here {
                run.push(next_delete.next().expect("peeked").to_vec());
            } else {
                close(&mut run, &mut out);
            }
        }
        close(&mut run, &mut out);
        out.extend(next_delete.map(|d| Op::Delete { key: d.to_vec() }));
        Ok((out.len() < ops.len()).then_some(out))
    }

    /// Holds target writes to `sync.max_ops_per_second` (read on every call, so a reload applies
    /// at once): after `ops` ops, wait `ops / rate` seconds.
    async fn pace(&self, ops: usize) {
        let rate = self.cfg().sync.max_ops_per_second;
        if rate > 0 && ops > 0 {
            tokio::time::sleep(Duration::from_secs_f64(ops as f64 / rate as f64)).await;
        }
    }

    /// One fenced Txn, retried through transient errors, throttling and a full target.
    async fn commit_with_retry(&mut self, ops: &[Op], next: Checkpoint) -> Result<(), EngineError> {
        let cfg = self.engine.cfg.sync.clone();
        let mut delay = cfg.backoff.initial.get();
        let mut rounds = 0u32;
        loop {
            let txn_ops = ops.iter().map(Op::to_txn_op).collect();
            let started = Instant::now();
            let result = self.writer().commit(txn_ops, Some(next.clone())).await;
            let err = match result {
                Ok(_) => {
                    if let Some(m) = &self.engine.metrics {
                        m.apply_latency.observe(started.elapsed().as_secs_f64());
                        m.batch_size.observe(ops.len() as f64);
                    }
                    self.pace(ops.len()).await;
                    // Status follows the fence: what the target holds is what status shows.
                    self.engine.update(|s| s.watermark = next.watermark);
                    if rounds > 0 {
                        info!("target accepts writes again");
                        self.engine.update(|s| {
                            s.set_condition("TargetThrottled", false, "Recovered", "");
                            s.set_condition("TargetQuotaExhausted", false, "Recovered", "");
                            s.set_condition("TargetReachable", true, "Recovered", "");
                        });
                        let phase = if next.scanning { Phase::InitialSync } else { Phase::Syncing };
                        self.engine.set_phase(phase);
                    }
                    return Ok(());
                }
                Err(FenceError::Etcd(e)) => e,
                Err(f) => return Err(f.into()),
            };
            rounds += 1;
            if rounds == 3 && self.watch.take().is_some() {
                warn!("sustained target backoff: source watch cancelled; will re-watch from the watermark");
            }
            match err.class() {
                ErrorClass::Quota => {
                    if rounds == 1 {
                        error!("target out of space; holding writes and probing");
                        self.engine.set_phase(Phase::Degraded);
                        self.engine.update(|s| {
                            s.set_condition("TargetQuotaExhausted", true, "NoSpace", err.to_string())
                        });
                    }
                    delay = cfg.backoff.max.get().min(Duration::from_secs(60));
                }
                ErrorClass::Throttle => {
                    self.engine.update(|s| {
                        s.set_condition("TargetThrottled", true, "TooManyRequests", err.to_string())
                    });
                    delay = (delay * 2).min(cfg.backoff.max.get());
                }
                ErrorClass::Transient => {
                    // Retrying on this client cannot pick up new TLS files: only a reconnect
                    // reads them. The batch is not lost: nothing past the watermark landed.
                    if err.fault == Fault::TlsRejected || tls_fingerprint(self.cfg()) != self.tls_files {
                        return Err(EngineError::Reconnect("TlsRejectedOrFilesChanged"));
                    }
                    if rounds == 3 {
                        warn!("target unavailable for 3 rounds: {err}");
                        self.engine.set_phase(Phase::Degraded);
                        self.engine.update(|s| {
                            s.set_condition(
                                "TargetReachable",
                                false,
                                &format!("{:?}", err.fault),
                                err.to_string(),
                            )
                        });
                    }
                    delay = (delay * 2).min(cfg.backoff.max.get());
                }
                _ => return Err(err.into()),
            }
            tokio::select! {
                _ = self.engine.shutdown.cancelled() => {
                    return Err(EngineError::Etcd(err));
                }
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }
}

/// Resolves when a reloaded config is waiting (without consuming it), never without a channel.
async fn reload_changed(reload: &mut Option<tokio::sync::watch::Receiver<Config>>) {
    match reload {
        Some(rx) => {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// The result of a spawned task, or never when there is none.
async fn join_some<T>(task: &mut Option<tokio::task::JoinHandle<T>>) -> Result<T, tokio::task::JoinError> {
    match task {
        Some(handle) => handle.await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`, or forever when there is no deadline.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Reads the watch into the replay buffer during the scan. Ends on `stop` (returning the stream
/// for the tail), on overflow, or on a compacted or broken watch.
async fn forward(
    mut stream: WatchResponseStream,
    buffer: Arc<Mutex<ReplayBuffer>>,
    stop: CancellationToken,
    rewriter: KeyRewriter,
    r0: i64,
) -> (WatchResponseStream, Result<(), EngineError>) {
    let mut floor = r0;
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => return (stream, Ok(())),
            msg = stream.message() => msg,
        };
        let resp = match msg {
            Ok(Some(r)) => r,
            Ok(None) => return (stream, Err(EngineError::RestartGenesis("WatchEndedDuringScan"))),
            Err(e) => return (stream, Err(EtcdError::new("watch", Side::Source, e).into())),
        };
        if resp.canceled() || resp.compact_revision() > 0 {
            return (stream, Err(EngineError::RestartGenesis("CompactedDuringScan")));
        }
        let converted = convert_events(resp.events(), &rewriter, floor);
        if let Some(last) = converted.revisions.last() {
            floor = last.revision;
        }
        if let Err(overflow) = buffer.lock().await.push(converted.revisions) {
            return (stream, Err(overflow.into()));
        }
    }
}

/// Digests of both sides' TLS files; `None` without TLS.
fn tls_fingerprint(cfg: &Config) -> Option<Vec<[u8; 32]>> {
    let sides: Vec<[u8; 32]> = [&cfg.source, &cfg.target]
        .iter()
        .filter_map(|s| s.tls.as_ref())
        .map(mirror_core::tls::fingerprint)
        .collect();
    (!sides.is_empty()).then_some(sides)
}

/// The expiry of the side's CA bundle and client certificate, as loaded by this connect.
fn tls_expiry(side: &mirror_core::SideConfig) -> Vec<mirror_core::tls::CertExpiry> {
    side.tls.as_ref().map(mirror_core::tls::expiry).unwrap_or_default()
}

/// Lists the endpoints that did not answer and sets `MemberUnreachable` accordingly.
fn members_reachable(s: &mut Status, source: &Probe, target: &Probe) {
    let down: Vec<String> = [(Side::Source, source), (Side::Target, target)]
        .iter()
        .flat_map(|(side, probe)| {
            probe.unreachable.iter().map(move |(url, why)| format!("{side} {url}: {why}"))
        })
        .collect();
    s.source.unreachable_endpoints = source.unreachable.iter().map(|(url, _)| url.clone()).collect();
    s.target.unreachable_endpoints = target.unreachable.iter().map(|(url, _)| url.clone()).collect();
    if down.is_empty() {
        s.set_condition("MemberUnreachable", false, "AllMembersAnswer", "");
    } else {
        s.set_condition("MemberUnreachable", true, "ProbeFailed", down.join("; "));
    }
}

fn side_status(side: Side, probe: &Probe) -> Result<(SideStatus, u64), EngineError> {
    let members = &probe.members;
    let mut lowest: Option<(u32, u32, u32)> = None;
    let mut version = String::new();
    for m in members {
        let v = parse_version(&m.version).unwrap_or((0, 0, 0));
        if v < (3, 4, 0) {
            return Err(EngineError::Refused {
                reason: "VersionUnsupported",
                message: format!(
                    "{side} endpoint {} runs etcd {:?}; 3.4.0 or newer is required",
                    m.endpoint, m.version
                ),
            });
        }
        if lowest.is_none_or(|l| v < l) {
            lowest = Some(v);
            version = m.version.clone();
        }
    }
    let cluster = members.first().map_or(0, |m| m.cluster_id);
    if let Some(other) = members.iter().find(|m| m.cluster_id != cluster) {
        return Err(EngineError::Refused {
            reason: "MixedClusters",
            message: format!("{side} endpoint {} belongs to another cluster", other.endpoint),
        });
    }
    Ok((
        SideStatus {
            version,
            cluster_id: cluster.to_string(),
            learner: members.iter().any(|m| m.learner),
            unreachable_endpoints: probe.unreachable.iter().map(|(url, _)| url.clone()).collect(),
            tls_cert_expiry: Vec::new(),
        },
        cluster,
    ))
}

/// Sets `SourceReachable`/`TargetReachable` from a probe, naming why it failed (wrong
/// credentials read `AuthFailed`, so the side at fault is obvious).
fn reachability<T>(s: &mut Status, condition: &str, probe: &Result<T, EtcdError>) {
    match probe {
        Ok(_) => s.set_condition(condition, true, "Probe", ""),
        Err(e) => s.set_condition(condition, false, &format!("{:?}", e.fault), e.to_string()),
    }
}

fn phase_reason(phase: Phase) -> &'static str {
    match phase {
        Phase::Connecting => "Connecting",
        Phase::InitialSync => "InitialSync",
        Phase::Syncing => "Syncing",
        Phase::Degraded => "Degraded",
        Phase::Standby => "Standby",
        Phase::Drained => "Drained",
        Phase::Failed => "Failed",
    }
}

fn is_condition(reason: &str) -> bool {
    matches!(reason, "EmptyTargetViolation" | "DirectionConflict" | "PrefixConflict")
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown-host".into())
}
