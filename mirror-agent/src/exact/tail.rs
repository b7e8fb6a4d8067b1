//! The exact tail: one fenced Txn per source revision, in order, each judged by the fence
//! ([`mirror_fence::Landing`]); between revisions the target leases are kept alive and the
//! target's compaction follows the source's.

use std::time::Duration;

use etcd_client::{Client, CompactionOptions, WatchOptions};
use mirror_core::{
    now_rfc3339, unary, Config, ErrorClass, ExactRevision, ExponentialBackoff, Fault, Phase, Reason, Side,
};
use mirror_fence::{Answer, Checkpoint, Landing, Role};
use mirror_watch::{ExactDelivery, ExactError, ExactWatch, SpoolReader};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::leases::TargetLeases;
use super::replica::{Replicas, Turn};
use super::seed::Placed;
use super::{timeout, Stop};
use crate::reporter::Reporter;

/// How often the tail looks at the leases due a keep-alive.
const KEEP_CHECK: Duration = Duration::from_secs(1);
/// How often it asks the source how far it compacted.
const COMPACTION_CHECK: Duration = Duration::from_secs(10);
/// How often an idle tail re-reads the checkpoint (a foreign write shows without a Txn).
const FENCE_CHECK: Duration = Duration::from_secs(2);

/// The tail's state: the clients, the fence, and how far the target holds the source.
pub(super) struct Tail<'c> {
    cfg: &'c Config,
    source: Client,
    target: Client,
    placed: Placed,
    /// The target's compaction as the link moved it (0: not yet).
    compacted: i64,
    /// This agent's ID, written into every record it lands.
    me: String,
    /// The highest source revision the watch has shown (its responses' header revision).
    seen: i64,
}

impl<'c> Tail<'c> {
    pub(super) fn new(
        cfg: &'c Config,
        source: Client,
        target: Client,
        placed: Placed,
        me: String,
    ) -> Tail<'c> {
        let seen = placed.watermark;
        Tail { cfg, source, target, placed, compacted: 0, me, seen }
    }

    /// Tails until something stops it.
    pub(super) async fn run(mut self, reporter: &Reporter, shutdown: &CancellationToken) -> Stop {
        match self.tail(reporter, shutdown).await {
            Ok(never) => match never {},
            Err(stop) => stop,
        }
    }

    async fn tail(
        &mut self,
        reporter: &Reporter,
        shutdown: &CancellationToken,
    ) -> Result<std::convert::Infallible, Stop> {
        let hold = self.cfg.sync.exact_lease_hold.get();
        let records = lease_records(self.cfg);
        let mut leases =
            TargetLeases::adopt(self.source.clone(), self.target.clone(), hold, timeout(self.cfg), records)
                .await?;
        let mut watch = ExactWatch::open(&mut self.source, self.placed.watermark + 1).await?;
        let mut replicas =
            Replicas::open(self.cfg, &self.target, self.me.clone(), self.placed.watermark).await?;
        reporter.update(|s| s.watermark = self.placed.watermark);
        exact_status(reporter, |e| e.target_revision = self.placed.watermark);
        self.report_leases_and_spool(&leases, reporter);
        reporter.set_phase(Phase::Syncing, Reason::Syncing);
        let mut keep = tokio::time::interval(KEEP_CHECK);
        let mut compaction = tokio::time::interval(COMPACTION_CHECK);
        let mut fence = tokio::time::interval(FENCE_CHECK);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Err(Stop::Shutdown),
                delivered = watch.next() => match delivered {
                    Ok(ExactDelivery::Revisions { revisions, header }) => {
                        self.seen = self.seen.max(header);
                        for rev in revisions {
                            self.apply(&rev, &mut leases, &mut replicas, reporter).await?;
                        }
                    }
                    Ok(ExactDelivery::Reply(header)) => {
                        self.seen = self.seen.max(header);
                        reporter.update(|s| s.source_revision = s.source_revision.max(header));
                    }
                    Ok(ExactDelivery::Compacted(at)) => {
                        // The seed's spool may hold what the source compacted away.
                        let from = self.placed.watermark + 1;
                        if self.replay_spool(&mut leases, &mut replicas, reporter).await? == 0 {
                            return Err(Stop::lost(
                                Reason::ReseedRequired,
                                format!(
                                    "the source compacted to revision {at}, past the replica's next revision {from}, \
                                     and no spool (sync.exact_seed) holds it: the history between is gone; re-seed \
                                     the target"
                                ),
                            ));
                        }
                        watch = ExactWatch::open(&mut self.source, self.placed.watermark + 1).await?;
                    }
                    Err(ExactError::Missing { .. }) => {
                        let err = delivered.err().map(|e| e.to_string()).unwrap_or_default();
                        return Err(Stop::lost(Reason::RevisionMissing, err));
                    }
                    Err(ExactError::Ended(why)) => {
                        return Err(Stop::Etcd(mirror_core::EtcdError::new(
                            "exact watch",
                            Side::Source,
                            etcd_client::Error::WatchError(why),
                        )))
                    }
                },
                _ = keep.tick() => {
                    let gone = leases.keep_due().await?;
                    if !gone.is_empty() {
                        self.check_fence(&format!("; {} ran out or was revoked", gone.join(", "))).await?;
                    }
                    self.report_leases_and_spool(&leases, reporter);
                }
                _ = compaction.tick() => {
                    if let Some(at) = self.follow_compaction().await? {
                        exact_status(reporter, |e| e.compacted_revision = at);
                    }
                }
                _ = fence.tick() => self.check_fence("").await?,
            }
        }
    }

    /// Status of the target leases and the seed's spool.
    fn report_leases_and_spool(&self, leases: &TargetLeases, reporter: &Reporter) {
        let (left, shortest) = leases.snapshot_leases();
        let spool = (!self.cfg.sync.exact_seed.is_empty())
            .then(|| super::digest::spool_path(std::path::Path::new(&self.cfg.sync.exact_seed)))
            .and_then(|p| std::fs::metadata(p).ok())
            .map_or(0, |m| m.len());
        reporter.update(|s| s.leases.preserved = leases.held() as u64);
        exact_status(reporter, |e| {
            e.snapshot_leases = left as u64;
            e.shortest_snapshot_lease_ttl_seconds = shortest;
            e.spool_bytes = spool;
        });
    }

    /// Lands one revision (or finds another replica landed it) with its leases around it, and
    /// says so in status.
    async fn apply(
        &mut self,
        rev: &ExactRevision,
        leases: &mut TargetLeases,
        replicas: &mut Replicas,
        reporter: &Reporter,
    ) -> Result<(), Stop> {
        let here = match replicas.turn(rev.revision).await? {
            Turn::Landed => {
                self.placed.watermark = rev.revision;
                false
            }
            Turn::Send => {
                leases.ensure(rev).await?;
                match self.land(rev, leases.take_riders()).await? {
                    Landing::Landed => {
                        replicas.landed_by_me(rev.revision);
                        true
                    }
                    Landing::Behind { at } => {
                        replicas.landed_elsewhere(at);
                        false
                    }
                    _ => {
                        replicas.landed_elsewhere(rev.revision);
                        false
                    }
                }
            }
        };
        exact_status(reporter, |e| {
            e.target_revision = rev.revision;
            if here {
                e.landed_here += 1;
            } else {
                e.landed_elsewhere += 1;
            }
        });
        leases.release(rev).await?;
        reporter.update(|s| {
            s.watermark = rev.revision;
            s.role = replicas.role();
            s.source_revision = s.source_revision.max(rev.revision);
            s.keys_applied_total += rev.changes.len() as u64;
            s.last_progress_time = Some(now_rfc3339());
            s.confirmed_time = Some(now_rfc3339());
        });
        reporter.revisions_landed(1);
        Ok(())
    }

    /// Applies the seed's spooled revisions from the watermark on, as far as the spool goes
    /// without a gap; how many it applied.
    async fn replay_spool(
        &mut self,
        leases: &mut TargetLeases,
        replicas: &mut Replicas,
        reporter: &Reporter,
    ) -> Result<u64, Stop> {
        if self.cfg.sync.exact_seed.is_empty() {
            return Ok(0);
        }
        let path = super::digest::spool_path(std::path::Path::new(&self.cfg.sync.exact_seed));
        let mut spool = SpoolReader::open(&path)
            .map_err(|e| Stop::lost(Reason::ReseedRequired, format!("{}: {e}", path.display())))?;
        let mut applied = 0;
        loop {
            let next = spool
                .read_next()
                .map_err(|e| Stop::lost(Reason::ReseedRequired, format!("{}: {e}", path.display())))?;
            let Some(rev) = next else { break };
            let want = self.placed.watermark + 1;
            if rev.revision < want {
                continue;
            }
            if rev.revision > want {
                return Err(Stop::lost(
                    Reason::RevisionMissing,
                    format!(
                        "the spool {} starts at revision {}, after the replica's next {want}",
                        path.display(),
                        rev.revision
                    ),
                ));
            }
            self.apply(&rev, leases, replicas, reporter).await?;
            applied += 1;
        }
        if applied > 0 {
            info!(
                applied,
                watermark = self.placed.watermark,
                "applied the seed's spooled revisions the source compacted"
            );
        }
        Ok(applied)
    }

    /// Lands source revision `rev` as target revision `rev.revision`, retrying its Txn through
    /// transient errors (a retry of a Txn that landed is judged `AlreadyLanded`).
    async fn land(&mut self, rev: &ExactRevision, riders: Vec<etcd_client::TxnOp>) -> Result<Landing, Stop> {
        let record = self.record(rev.revision).encode().map_err(|e| {
            Stop::lost(
                Reason::InvalidCheckpointRecord,
                format!("the checkpoint record cannot be written: {e}"),
            )
        })?;
        let per_level = mirror_fence::ops_per_level(self.cfg.sync.max_txn_ops);
        let txn = self.placed.fence.txn(rev, record, riders, per_level).map_err(|e| {
            Stop::lost(Reason::RevisionTooLarge, format!("source revision {}: {e}", rev.revision))
        })?;
        let sync = &self.cfg.sync;
        let mut backoff = ExponentialBackoff::new(sync.backoff.initial.get(), sync.backoff.max.get(), 2);
        loop {
            let mut kv = self.target.kv_client();
            let sent = kv.txn(txn.to_txn(self.placed.fence.key()));
            let resp = match unary("exact txn", Side::Target, timeout(self.cfg), sent).await {
                Ok(resp) => resp,
                Err(e) if matches!(e.class(), ErrorClass::Transient | ErrorClass::Throttle) => {
                    let delay = backoff.next_delay();
                    warn!(revision = rev.revision, "exact Txn failed, retrying in {delay:?}: {e}");
                    tokio::time::sleep(delay).await;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            return match self.placed.fence.judge(rev.revision, &Answer::of(&resp)) {
                landing @ (Landing::Landed | Landing::AlreadyLanded) => {
                    self.placed.watermark = rev.revision;
                    Ok(landing)
                }
                // Another replica of the link landed this revision and more: go on from there
                // (the revisions up to it are skipped as they arrive).
                Landing::Behind { at } => {
                    self.placed.watermark = rev.revision;
                    Ok(Landing::Behind { at })
                }
                Landing::Overtaken => Err(Stop::lost(
                    Reason::ForeignWrite,
                    format!(
                        "Txn {} found its predecessor not landed although it had answered: another writer moved the \
                         checkpoint",
                        rev.revision
                    ),
                )),
                Landing::Foreign(why) => Err(Stop::lost(Reason::ForeignWrite, why)),
                Landing::Promoted => Err(Stop::lost(
                    Reason::TargetPromoted,
                    "the target was promoted (failover or cutover): this link writes it no more",
                )),
            };
        }
    }

    /// The record Txn `revision` puts.
    fn record(&self, revision: i64) -> Checkpoint {
        let cfg = self.cfg;
        Checkpoint {
            link_uid: cfg.link_uid.clone(),
            epoch: cfg.epoch as u64,
            role: Role::Mirror,
            watermark: revision,
            scanning: false,
            scan_cursor: Vec::new(),
            prune_pending: false,
            source_cluster_id: self.placed.source_cluster,
            target_cluster_id: self.placed.target_cluster,
            agent_id: self.me.clone(),
            commit: String::new(),
            range: cfg.rewriter().range_fingerprint(),
            confirmed_time: now_rfc3339(),
            forced_resyncs: 0,
            scan_restarts: 0,
            initial_sync_completed: String::new(),
            excludes: Vec::new(),
            source_seen: self.seen.max(revision),
        }
    }

    /// The check that nothing but the link wrote the target since its last Txn: the target's
    /// revision is still the one its checkpoint was put at (another replica's Txns included),
    /// and that is not behind what this agent landed. `also` names what prompted it.
    async fn check_fence(&mut self, also: &str) -> Result<(), Stop> {
        let key = self.placed.fence.key().to_vec();
        let mut kv = self.target.kv_client();
        let resp = unary("read checkpoint", Side::Target, timeout(self.cfg), kv.get(key, None)).await?;
        let head = resp.header().map_or(0, |h| h.revision());
        let record = resp.kvs().first().and_then(|kv| Checkpoint::decode(kv.value()).ok());
        if record.is_some_and(|r| r.role == Role::Primary) {
            return Err(Stop::lost(
                Reason::TargetPromoted,
                "the target was promoted (failover or cutover): this link writes it no more",
            ));
        }
        let at = resp.kvs().first().map_or(self.placed.fence.seed(), |kv| kv.mod_revision());
        if head != at || at < self.placed.watermark {
            return Err(Stop::lost(
                Reason::ForeignWrite,
                format!(
                    "the target is at revision {head}, its checkpoint at {at}, and this agent landed up to source \
                     revision {}: something other than the link wrote the target{also}",
                    self.placed.watermark
                ),
            ));
        }
        Ok(())
    }

    /// Compacts the target where the source compacted, once the replica holds that revision
    /// (compaction adds no revision; "compacted" means someone got there first).
    async fn follow_compaction(&mut self) -> Result<Option<i64>, Stop> {
        let Some(at) = compacted_revision(&mut self.source, self.cfg).await? else { return Ok(None) };
        if at <= self.compacted || at > self.placed.watermark {
            return Ok(None);
        }
        let mut kv = self.target.kv_client();
        let compact = kv.compact(at, Some(CompactionOptions::new()));
        let reported = at;
        match unary("compact target", Side::Target, timeout(self.cfg), compact).await {
            Ok(_) => info!(revision = at, "target compacted where the source compacted"),
            Err(e) if e.fault == Fault::Compacted => {}
            Err(e) => return Err(e.into()),
        }
        self.compacted = at;
        Ok(Some(reported))
    }
}

/// The source's compacted revision, learned without admin rights: a watch from revision 1 of a
/// key nobody writes is cancelled with it (`None`: not compacted, or not said within a second).
pub(crate) async fn compacted_revision(source: &mut Client, cfg: &Config) -> Result<Option<i64>, Stop> {
    let key = [&cfg.checkpoint_key()[..], b"/compaction-probe"].concat();
    let opts = WatchOptions::new().with_start_revision(1);
    let stream = source.watch_client().watch(key, Some(opts)).await;
    let mut stream = stream.map_err(|e| mirror_core::EtcdError::new("compaction probe", Side::Source, e))?;
    let deadline = tokio::time::sleep(Duration::from_secs(1));
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => return Ok(None),
            message = stream.message() => match message {
                Ok(Some(resp)) if resp.compact_revision() > 0 => return Ok(Some(resp.compact_revision())),
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => return Ok(None),
            }
        }
    }
}

/// Updates the `exact` section of the status.
fn exact_status(reporter: &Reporter, f: impl FnOnce(&mut mirror_core::ExactStatus)) {
    reporter.update(|s| f(s.exact.get_or_insert_with(Default::default)));
}

/// The prefix of the link's lease TTL records: `\0etcd-mirror/<link_uid>/leases/`.
pub(crate) fn lease_records(cfg: &Config) -> Vec<u8> {
    let checkpoint = cfg.checkpoint_key();
    let link = &checkpoint[..checkpoint.len() - b"checkpoint".len()];
    [link, b"leases/"].concat()
}
