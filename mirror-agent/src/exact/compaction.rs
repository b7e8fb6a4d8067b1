//! Compaction follows the source (SPEC §10): the source's compacted revision is learned
//! without admin rights on a task of its own, and the target is compacted there once the
//! replica holds that revision.

use std::time::Duration;

use etcd_client::{Client, CompactionOptions, KvClient, WatchOptions};
use mirror_core::{unary, Config, Fault, Side};
use tracing::info;

use super::Stop;

/// How often the source's compaction is probed.
pub(super) const COMPACTION_CHECK: Duration = Duration::from_secs(10);

/// The target's compaction as the link moved it.
#[derive(Debug, Default)]
pub(super) struct Following {
    /// The revision the target was last compacted at by the link (0: not yet).
    done: i64,
}

impl Following {
    /// Compacts the target at `at`, where the source compacted, once the replica holds that
    /// revision (`watermark`) and unless it already did; the revision compacted, if any.
    /// Compaction adds no revision; "compacted" means someone got there first.
    pub(super) async fn follow(
        &mut self,
        at: i64,
        watermark: i64,
        mut kv: KvClient,
        timeout: Duration,
    ) -> Result<Option<i64>, Stop> {
        if at <= self.done || at > watermark {
            return Ok(None);
        }
        let compact = kv.compact(at, Some(CompactionOptions::new()));
        match unary("compact target", Side::Target, timeout, compact).await {
            Ok(_) => info!(revision = at, "target compacted where the source compacted"),
            Err(e) if e.fault == Fault::Compacted => {}
            Err(e) => return Err(e.into()),
        }
        self.done = at;
        Ok(Some(at))
    }
}

/// A task aborted when dropped (the run that started it ended).
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts learning the source's compacted revision every [`COMPACTION_CHECK`], publishing it
/// to `learned`, on a task that ends when the handle is dropped: each probe waits up to a
/// second for etcd's answer, which the tail must not.
pub(super) fn learn_compaction(
    mut source: Client,
    cfg: Config,
    learned: tokio::sync::watch::Sender<i64>,
) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(async move {
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
