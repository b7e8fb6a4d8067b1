//! [`Run`]: everything one connected run needs (both clients, the lease keeper, the fenced
//! applier once the fence is claimed, the watch and the tail's small components), and the
//! helpers every phase shares: the record template, Txn chunking, page options and the
//! applier's entry points.

use std::time::Duration;

use etcd_client::{Client, KvClient};
use mirror_core::{Config, EtcdError, Probe};
use mirror_fence::{Applier, Checkpoint, FencedWriter, Role};
use mirror_watch::{Op, OpChunker, Watch};
use tokio::time::Instant;

use super::{buffering, commit, confirm, genesis, leases, Engine, EngineError};

/// A probe of the source and of the target.
pub(super) type BothProbes = (Result<Probe, EtcdError>, Result<Probe, EtcdError>);

/// Everything one connected run needs.
pub(super) struct Run<'e> {
    pub(super) engine: &'e mut Engine,
    pub(super) source: Client,
    pub(super) target_kv: KvClient,
    /// The target leases of `sync.leases = "preserve"` (`leases`).
    pub(super) leases: leases::LeaseKeeper,
    pub(super) source_cluster: u64,
    pub(super) target_cluster: u64,
    pub(super) trust: bool,
    /// The fenced applier, once the fence is claimed: the writer and how writes land.
    pub(super) applier: Option<Applier>,
    /// The tail's source watch; dropped (cancelled) under sustained target backoff so the
    /// source's events wait in the source, not in this process.
    pub(super) watch: Option<Watch>,
    /// Drain mode: the source revision the watermark must reach before verification.
    pub(super) drain_target: Option<i64>,
    /// [`tls_fingerprint`] taken before this run connected; a change means rotated files.
    pub(super) tls_files: Option<Vec<[u8; 32]>>,
    /// Comparisons in a row during a drain that found the target behind.
    pub(super) drain_settles: u32,
    /// Not before this may the tail run another idle proof ([`mirror_watch::prove_unchanged`]):
    /// proofs read the range keys-only, so they are spaced to at most a fifth of the time, but
    /// never farther apart than `progress_interval`.
    pub(super) next_idle_proof: Option<Instant>,
    /// A background probe of every member of both sides (for `MemberUnreachable`).
    pub(super) member_probe: Option<tokio::task::JoinHandle<BothProbes>>,
    /// The watch read into a replay buffer while a long pass runs (`buffering`).
    pub(super) buffering: buffering::Buffering,
    /// The count of the range at R0 for `initial_sync.total_keys`, beside the scan (`genesis`).
    pub(super) counting: Option<genesis::Counting>,
    /// What the source last said about its revision, and the confirm read in flight
    /// (`confirmed_time`).
    pub(super) confirmer: confirm::Confirmer,
}

impl Run<'_> {
    pub(super) fn cfg(&self) -> &Config {
        &self.engine.cfg
    }

    pub(super) fn timeout(&self) -> Duration {
        self.engine.cfg.sync.request_timeout.get()
    }

    /// Ops of one revision held key by key before its deletes fold into runs.
    pub(super) fn held_revision_bytes(&self) -> usize {
        mirror_watch::held_revision_bytes(self.engine.cfg.sync.watch_buffer_bytes.bytes())
    }

    /// A fresh record at `watermark`, carrying the link's counts as status holds them (seeded
    /// from the stored record at the start of every run: [`Run::remember_counts`]).
    pub(super) fn template(&self, watermark: i64) -> Checkpoint {
        let (forced_resyncs, scan_restarts, initial_sync_completed) = self.engine.counts();
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
            commit: String::new(),
            range: self.engine.rewriter.range_fingerprint(),
            confirmed_time: String::new(),
            forced_resyncs,
            scan_restarts,
            initial_sync_completed,
            excludes: self.engine.rewriter.dest_excludes(),
            source_seen: 0,
        }
    }

    /// Packs independent target ops (scan puts, repairs, prune deletes) by what one Txn of
    /// nested Txns holds beside the checkpoint put ([`mirror_fence::nested_txn_capacity`]), by
    /// `txn_flush_bytes`, and, under `max_ops_per_second`, by about a second of ops (never below
    /// a flat Txn), so a paced target gets steady Txns rather than bursts and long pauses.
    pub(super) fn chunker(&self) -> OpChunker {
        let sync = &self.cfg().sync;
        let per_level = self.txn_ops_per_level();
        let mut ops = mirror_fence::nested_txn_capacity(per_level as i64);
        if sync.max_ops_per_second > 0 {
            let flat = per_level.max(2) - 1;
            ops = ops.min((sync.max_ops_per_second as usize).max(flat));
        }
        OpChunker::new(ops, sync.txn_flush_bytes.bytes() as usize)
    }

    /// Page limits and deadline of every reader, as configured.
    pub(super) fn page_options(&self, op: &'static str) -> mirror_core::PagerOptions {
        let sync = &self.cfg().sync;
        mirror_core::PagerOptions::new(
            op,
            sync.page_key_limit,
            sync.page_bytes.bytes() as usize,
            sync.request_timeout.get(),
        )
    }

    /// The per-level op limit of this run: `sync.max_txn_ops` as the writer was built with it
    /// (a reload applies at the next run), halved where the target refused it.
    pub(super) fn txn_ops_per_level(&self) -> usize {
        self.applier
            .as_ref()
            .map_or(mirror_fence::ops_per_level(self.cfg().sync.max_txn_ops), Applier::max_txn_ops)
    }

    pub(super) fn writer(&mut self) -> &mut FencedWriter {
        self.applier.as_mut().expect("fence claimed before any write").writer_mut()
    }

    /// Hands a reloaded config's live fields to the components that use them (the lease
    /// keeper's TTLs, the applier's pace and backoff).
    pub(super) fn reconfigure(&mut self) {
        let sync = &self.engine.cfg.sync;
        self.leases.configure(sync);
        if let Some(applier) = self.applier.as_mut() {
            applier.reload(sync);
        }
    }

    /// The fenced applier and what it reaches of this run ([`commit::Hooks`]).
    pub(super) fn applier(&mut self) -> (&mut Applier, commit::Hooks<'_>) {
        let Run { engine, applier, leases, watch, tls_files, .. } = self;
        let hooks = commit::Hooks { engine, leases, watch, tls_files };
        (applier.as_mut().expect("fence claimed before any write"), hooks)
    }

    /// One fenced Txn of `ops` moving the record to `next` ([`Applier::commit`]).
    pub(super) async fn commit_with_retry(
        &mut self,
        ops: &[Op],
        next: Checkpoint,
    ) -> Result<(), EngineError> {
        let (applier, mut hooks) = self.applier();
        applier.commit(ops, next, &mut hooks).await
    }

    /// Independent ops under the checkpoint as it stands ([`Applier::commit_keep`]).
    pub(super) async fn commit_keep(&mut self, ops: &[Op]) -> Result<(), EngineError> {
        let (applier, mut hooks) = self.applier();
        applier.commit_keep(ops, &mut hooks).await
    }

    /// Independent ops with the checkpoint `next`, split as the target's limits require
    /// ([`Applier::commit_independent`]).
    pub(super) async fn commit_independent(
        &mut self,
        ops: &[Op],
        next: Checkpoint,
    ) -> Result<(), EngineError> {
        let (applier, mut hooks) = self.applier();
        applier.commit_independent(ops, next, &mut hooks).await
    }
}
