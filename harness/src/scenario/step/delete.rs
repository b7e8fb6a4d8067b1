//! The `del` step: one key, the checkpoint, or a whole prefix in one revision (a delete whose
//! answer timed out is waited for, not blindly sent again).

use anyhow::bail;
use etcd_client::{Client, DeleteOptions, GetOptions};
use serde::{Deserialize, Serialize};

use mirror_watch::Written;

use super::data::{key_of, write};
use super::{is_false, is_source, source_side, SideName, Sides, Step};
use crate::scenario::world::World;

/// Delete one key or a prefix.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Del {
    /// Which side (default source).
    #[serde(default = "source_side", skip_serializing_if = "is_source")]
    pub side: SideName,
    /// The checkpoint key.
    #[serde(default, skip_serializing_if = "is_false")]
    pub checkpoint: bool,
    /// One key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Every key under this prefix (one revision).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// Extension: the agent (`a`) applies this source revision as exactly this many target
    /// revisions (1: atomically); the step waits for it to catch up before and after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_revisions: Option<i64>,
}

#[async_trait::async_trait]
#[typetag::serde(name = "del")]
impl Step for Del {
    fn check(&self) -> anyhow::Result<()> {
        let given = usize::from(self.key.is_some())
            + usize::from(self.prefix.is_some())
            + usize::from(self.checkpoint);
        anyhow::ensure!(given == 1, "del: give exactly one of key, prefix and checkpoint = true");
        if self.side == SideName::Target && self.target_revisions.is_some() {
            bail!("del: target_revisions is for a source write");
        }
        Ok(())
    }

    fn detachable(&self) -> bool {
        self.target_revisions.is_none()
    }

    async fn run(&self, world: &mut World, seed: u64) -> anyhow::Result<String> {
        write(self, world, seed, self.target_revisions).await
    }

    async fn run_detached(&self, mut sides: Sides, _seed: u64) -> anyhow::Result<String> {
        let key = key_of(&self.key, &sides, self.side);
        let (client, prefix) = sides.of(self.side);
        let under = self.prefix.as_ref().map(|p| format!("{prefix}{p}"));
        let (count, revision, deleted) = match &under {
            Some(p) => {
                let (count, revision) = delete_prefix(client, p).await?;
                (count, revision, None)
            }
            None => {
                let resp = client.delete(key, Some(DeleteOptions::new().with_prev_key())).await?;
                let keys = resp.prev_kvs().iter().map(|kv| kv.key().to_vec()).collect::<Vec<_>>();
                (resp.deleted(), resp.header().map_or(0, |h| h.revision()), Some(keys))
            }
        };
        if self.side == SideName::Source {
            let deleted = match (deleted, &under) {
                (Some(keys), _) => keys,
                // The keys the prefix held just before, paged: a prefix delete may remove
                // 300 000 keys, and their previous values in one answer pass the client's
                // decode limit.
                (None, Some(p)) if count > 0 => keys_at(client, p, revision - 1).await?,
                (None, _) => Vec::new(),
            };
            sides.journal.record(deleted.into_iter().map(|key| Written::Delete { key, revision }));
        }
        Ok(format!("{count} keys deleted"))
    }
}

/// How long a prefix delete whose answer timed out is given to apply before it is sent again.
const DELETE_APPLY_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Deletes every key under `prefix` in one revision: how many it deleted and at which
/// revision. A delete of 300 000 keys can outlast etcd's own request timeout on a loaded
/// machine (3.5.1 answered "etcdserver: request timed out" in CI): the proposal is then in
/// raft and usually applies moments later, so the answer is ambiguous. The harness waits for
/// the prefix to empty and finds the revision that emptied it; only a delete that never
/// applied within `DELETE_APPLY_WAIT` is sent again (still one revision).
async fn delete_prefix(client: &mut Client, prefix: &str) -> anyhow::Result<(i64, i64)> {
    for attempt in 1..=3 {
        let before = client.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await?;
        let before_rev = before.header().map_or(0, |h| h.revision());
        match client.delete(prefix, Some(DeleteOptions::new().with_prefix())).await {
            Ok(resp) => return Ok((resp.deleted(), resp.header().map_or(0, |h| h.revision()))),
            Err(e) if timed_out(&e) => {
                tracing::warn!(prefix, attempt, error = %e, "prefix delete timed out; waiting for it to apply");
                let deadline = tokio::time::Instant::now() + DELETE_APPLY_WAIT;
                while tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                    let Ok(now) =
                        client.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await
                    else {
                        continue;
                    };
                    if now.count() == 0 {
                        let now_rev = now.header().map_or(0, |h| h.revision());
                        let revision = emptied_at(client, prefix, before_rev + 1, now_rev).await?;
                        return Ok((before.count(), revision));
                    }
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    bail!("delete of prefix {prefix:?} timed out three times and never applied")
}

/// The first revision in `from..=to` at which nothing is left under `prefix`.
async fn emptied_at(client: &mut Client, prefix: &str, from: i64, to: i64) -> anyhow::Result<i64> {
    for revision in from..=to {
        let opts = GetOptions::new().with_prefix().with_count_only().with_revision(revision);
        if client.get(prefix, Some(opts)).await?.count() == 0 {
            return Ok(revision);
        }
    }
    bail!("prefix {prefix:?} is empty at {to} but at no revision from {from}")
}

/// Whether etcd gave up waiting for a proposal it may still apply.
fn timed_out(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => s.message().contains("request timed out"),
        _ => false,
    }
}

/// The keys under `prefix` at `revision`, read keys-only in pages.
async fn keys_at(client: &Client, prefix: &str, revision: i64) -> anyhow::Result<Vec<Vec<u8>>> {
    let opts =
        mirror_core::PagerOptions::new("journal page", 1000, 1 << 20, std::time::Duration::from_secs(30))
            .at_revision(revision)
            .keys_only();
    let range = mirror_core::KeyRange::prefix(prefix.as_bytes());
    let mut pager = mirror_core::Pager::new(client.kv_client(), mirror_core::Side::Source, vec![range], opts);
    let mut keys = Vec::new();
    while let Some(page) = pager.next_page().await? {
        keys.extend(page.iter().map(|kv| kv.key().to_vec()));
    }
    Ok(keys)
}
