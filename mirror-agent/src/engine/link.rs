//! [`Link`]: the link while it is connected (both clients, the lease keeper, the fenced applier
//! once the fence is claimed, the watch and its replay buffer), the helpers every phase shares
//! (the record template, Txn chunking, page options, the applier's entry points, the source's
//! revision, opening the watch), and [`Link::drive`], the loop over the phases of one run:
//! [`Start`] -> [`Genesis`] -> [`Tail`], each a type holding only its own state, each handing
//! back the [`Step`] to take next.

use std::time::Duration;

use etcd_client::{Client, KvClient};
use mirror_core::{read_head, Config, Side};
use mirror_fence::{Applier, Checkpoint, FencedWriter, Role};
use mirror_scan::count;
use mirror_watch::{open_watch, Op, OpChunker, Watch};
use tracing::warn;

use super::genesis::Genesis;
use super::start::Start;
use super::tail::Tail;
use super::{buffering, commit, leases, Engine, EngineError, Pending};

/// The link while connected: what every phase of one run uses.
pub(super) struct Link<'e> {
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
    /// [`super::tls_fingerprint`] taken before this run connected; a change means rotated files.
    pub(super) tls_files: Option<Vec<[u8; 32]>>,
    /// The watch read into a replay buffer while a long pass runs (`buffering`).
    pub(super) buffering: buffering::Buffering,
}

/// What a phase hands back: the phase to run next, or the end of the run.
pub(super) enum Step {
    Genesis(Genesis),
    /// The tail, with the watch it reads and what genesis buffered and did not apply yet.
    Tail(Tail, Box<Watch>, mirror_watch::Buffered),
    /// The run ended by itself (shutdown, or a drain that promoted the target).
    Done,
}

impl Link<'_> {
    /// One run of the link: the phases in turn, from the start plan to the end of the tail.
    /// An error ends the run; the run loop decides by its class what happens next.
    pub(super) async fn drive(&mut self, pending: Pending) -> Result<(), EngineError> {
        let mut step = Start::new(pending).run(self).await?;
        loop {
            step = match step {
                Step::Genesis(genesis) => genesis.run(self).await?,
                Step::Tail(tail, watch, replay) => tail.run(self, watch, replay).await?,
                Step::Done => return Ok(()),
            };
        }
    }

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
    /// from the stored record at the start of every run: [`Start`]).
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
        let Link { engine, applier, leases, watch, tls_files, .. } = self;
        let hooks = commit::Hooks { engine, leases, watch, tls_files };
        (applier.as_mut().expect("fence claimed before any write"), hooks)
    }

    /// Waits for the tail's Txns in flight to land ([`Applier::drain`]): before anything reads
    /// the record the fence holds or writes otherwise.
    pub(super) async fn drain(&mut self) -> Result<(), EngineError> {
        if self.applier.is_none() {
            return Ok(());
        }
        let (applier, mut hooks) = self.applier();
        applier.drain(&mut hooks).await
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

    /// The source's current revision: the header of a count-only Get of one key. (A count of
    /// the whole range would make etcd walk every key of it in its index, under the lock every
    /// write needs: a second or more at millions of keys.)
    pub(super) async fn source_revision(&mut self) -> Result<i64, EngineError> {
        let range = self.engine.rewriter.source_range();
        let (mut kv, t) = (self.source.kv_client(), self.timeout());
        Ok(read_head(&mut kv, range.start, "revision", Side::Source, t).await?.revision)
    }

    /// Counts what the target still holds under each excluded prefix and lists it in status
    /// (`excluded_keys_in_target`), with one warning when there is any: those keys are outside
    /// the mirrored range, so no prune or reconcile pass ever touches them (an exclude added to a
    /// running link leaves its keys behind). One count-only read per exclude.
    pub(super) async fn note_excluded_in_target(&mut self) -> Result<(), EngineError> {
        // The configured ones only: the rewriter's list also holds the reserved namespace.
        let excludes = self.cfg().sync.exclude_prefixes.clone();
        let dest_prefix = self.engine.rewriter.dest_prefix().to_vec();
        let mut found = Vec::new();
        for exclude in &excludes {
            let relative = exclude.as_bytes();
            let start = [&dest_prefix[..], relative].concat();
            let window = [mirror_core::KeyRange { end: mirror_core::prefix_end(&start), start }];
            let timeout = self.timeout();
            let (keys, _) = count(&mut self.target_kv, &window, None, Side::Target, timeout).await?;
            if keys > 0 {
                let prefix = String::from_utf8_lossy(relative).into_owned();
                warn!(
                    exclude = %prefix,
                    keys,
                    "the target holds keys under an excluded prefix; the agent never touches them (delete them by hand if they are stale)"
                );
                found.push(mirror_core::ExcludedKeys { prefix, keys });
            }
        }
        self.engine.update(|s| s.excluded_keys_in_target = found);
        Ok(())
    }

    pub(super) async fn open_watch(&mut self, start: i64) -> Result<Watch, EngineError> {
        let fragment = self.engine.fragment_watch;
        let stream = open_watch(&mut self.source, &self.engine.rewriter, start, fragment).await?;
        let first = !std::mem::replace(&mut self.engine.watch_opened, true);
        if !first {
            self.engine.update(|s| s.watch_restarts += 1);
        }
        let (sender, stream) = stream.split();
        Ok(Watch::new(sender, stream, self.held_revision_bytes()))
    }
}
