//! Compaction follows the source (SPEC §10): the source's compacted revision is learned
//! without admin rights on a task of its own, and the target is compacted there once the
//! replica holds that revision.

use std::time::Duration;

use etcd_client::{Client, CompactionOptions, KvClient, WatchOptions};
use mirror_core::{unary, Config, ErrorClass, Fault, LastError, Reason, Side};
use tokio_util::task::AbortOnDropHandle;
use tracing::{info, warn};

use super::Stop;
use crate::reporter::Reporter;

/// How often the source's compaction is probed.
pub(super) const COMPACTION_CHECK: Duration = Duration::from_secs(10);

/// The target's compaction as the link moved it.
#[derive(Debug)]
pub(super) struct Following {
    /// The revision the target was last compacted at by the link (0: not yet).
    done: i64,
    /// The target refused the last compaction to the link's user (etcd 3.5 lets only the root
    /// role compact): said once in the log, and in `last_error` until one is allowed.
    refused: bool,
    /// The shell command that lets the link's target user compact, for `last_error`.
    fix: String,
}

impl Following {
    /// Nothing compacted yet, for the link of `cfg`.
    pub(super) fn new(cfg: &Config) -> Following {
        let user = cfg.target.auth.as_ref().map_or("USER", |a| a.username.as_str());
        let fix = format!(
            "etcdctl --endpoints={} --user root user grant-role {user} root",
            cfg.target.endpoints.join(",")
        );
        Following { done: 0, refused: false, fix }
    }

    /// Compacts the target at `at`, where the source compacted, once the replica holds that
    /// revision (`watermark`) and unless it already did; the revision compacted goes to
    /// status. Compaction adds no revision; "compacted" means someone got there first.
    ///
    /// A compaction refused to the link's user does not stop the replica: what it holds is
    /// still exact, only its history is kept longer than the source's (a client may watch
    /// from a revision the source compacted) and the target's database grows until its quota.
    /// `last_error` says so with the fix, and each later check asks again.
    pub(super) async fn follow(
        &mut self,
        at: i64,
        watermark: i64,
        mut kv: KvClient,
        timeout: Duration,
        reporter: &Reporter,
    ) -> Result<(), Stop> {
        if at <= self.done || at > watermark {
            return Ok(());
        }
        let compact = kv.compact(at, Some(CompactionOptions::new()));
        match unary("compact target", Side::Target, timeout, compact).await {
            Ok(_) => info!(revision = at, "target compacted where the source compacted"),
            Err(e) if e.fault == Fault::Compacted => {}
            Err(e) if e.fault == Fault::PermissionDenied => {
                if !std::mem::replace(&mut self.refused, true) {
                    warn!(revision = at, fix = %self.fix, "the target refused to compact where the source compacted: {e}");
                }
                let message = format!(
                    "compacting the target at {at}, where the source compacted, was refused to the link's user \
                     ({e}); the replica goes on, but the target keeps the history the source dropped and its \
                     database grows until etcd's quota: give the user the root role (etcd 3.5 lets only root \
                     compact): {}",
                    self.fix
                );
                let fix = Some(self.fix.clone());
                let class = ErrorClass::Permanent;
                reporter.update(|s| {
                    s.last_error = Some(LastError { class, reason: Reason::PermissionDenied, message, fix })
                });
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
        self.done = at;
        if std::mem::replace(&mut self.refused, false) {
            info!(revision = at, "the target compacts where the source compacted again");
        }
        reporter.update(|s| {
            if s.last_error.as_ref().is_some_and(|e| e.reason == Reason::PermissionDenied) {
                s.last_error = None;
            }
            s.exact.get_or_insert_with(Default::default).compacted_revision = at;
        });
        Ok(())
    }
}

/// Starts learning the source's compacted revision every [`COMPACTION_CHECK`], publishing it
/// to `learned`, on a task that ends when the handle is dropped: each probe waits up to a
/// second for etcd's answer, which the tail must not.
pub(super) fn learn_compaction(
    mut source: Client,
    cfg: Config,
    learned: tokio::sync::watch::Sender<i64>,
) -> AbortOnDropHandle<()> {
    AbortOnDropHandle::new(tokio::spawn(async move {
        loop {
            if let Ok(Some(at)) = compacted_revision(&mut source, &cfg).await {
                learned.send_if_modified(|known| std::mem::replace(known, at) != at);
            }
            tokio::time::sleep(COMPACTION_CHECK).await;
        }
    }))
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
