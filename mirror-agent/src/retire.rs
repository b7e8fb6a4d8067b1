//! `mirror-agent retire --config F [--force]`: removes this link's reserved keys from the target
//! (its checkpoint, its HA election keys: the reserved namespace of its destination, and a
//! configured `checkpoint.key` outside it) once the link is cut over, failed over, or being
//! decommissioned. The mirrored data stays.
//!
//! It never deletes another link's checkpoint (a record naming another `link_uid`). It refuses,
//! writing nothing, while an agent of the link may still hold the fence: an HA
//! election lease of the link is alive, or the checkpoint moves within `2 x
//! sync.progress_interval` (a running agent rewrites it at least once per interval while it
//! confirms the source). `--force` skips both checks. The delete itself is one Txn guarded by
//! the checkpoint's mod revision, so a writer that wakes up in between makes it fail instead of
//! losing its fence silently.

use crate::exit::Exit;
use std::process::ExitCode;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, DeleteOptions, GetOptions, Txn, TxnOp};
use mirror_core::{connect_reachable, prefix_end, unary, Config, KeyRange, Side};
use tokio::time::Instant;

/// How often the checkpoint is read while watching for a live writer.
const POLL: Duration = Duration::from_millis(500);

/// Runs the retire.
pub async fn retire(config: Config, force: bool) -> ExitCode {
    match run(&config, force).await {
        Ok(Outcome::Retired { keys }) => {
            println!("retired link {:?}: deleted its {keys} reserved keys from the target", config.link_uid);
            ExitCode::from(Exit::Done)
        }
        Ok(Outcome::Nothing) => {
            println!("link {:?} has no reserved keys in the target: nothing to retire", config.link_uid);
            ExitCode::from(Exit::Done)
        }
        Ok(Outcome::Refused(why)) => {
            eprintln!(
                "mirror-agent retire: refused, nothing deleted: {why}. Stop every agent of the link first; \
                 run again with --force only if none can write any more"
            );
            ExitCode::from(Exit::No)
        }
        Err(e) => {
            eprintln!("mirror-agent retire: {e:#}");
            ExitCode::from(Exit::CannotStart)
        }
    }
}

enum Outcome {
    Retired { keys: i64 },
    Nothing,
    Refused(String),
}

async fn run(config: &Config, force: bool) -> anyhow::Result<Outcome> {
    let timeout = config.sync.request_timeout.get();
    let client = connect_reachable(Side::Target, &config.target, &config.sync)
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the target: {e}"))?;
    let mut kv = client.kv_client();
    let rewriter = config.rewriter();
    let reserved = rewriter.reserved_prefix();
    let checkpoint = config.checkpoint_key();
    let read_checkpoint = |mut kv: etcd_client::KvClient| {
        let key = checkpoint.clone();
        async move {
            let resp = unary("retire read", Side::Target, timeout, kv.get(key, None)).await?;
            Ok::<_, mirror_core::EtcdError>(resp.kvs().first().map_or(0, |kv| kv.mod_revision()))
        }
    };
    let stored = unary("retire read", Side::Target, timeout, kv.get(checkpoint.clone(), None)).await?;
    let held = stored.kvs().first().map_or(0, |kv| kv.mod_revision());
    // Another link's record at this key is never this command's to delete, --force or not.
    if let Some(Ok(record)) = stored.kvs().first().map(|kv| mirror_fence::Checkpoint::decode(kv.value())) {
        if record.link_uid != config.link_uid {
            return Ok(Outcome::Refused(format!(
                "the checkpoint belongs to link {:?}, not {:?}",
                record.link_uid, config.link_uid
            )));
        }
    }
    let namespace = KeyRange::prefix(&reserved);
    let (in_reserved, _) = mirror_scan::count(&mut kv, &[namespace], None, Side::Target, timeout).await?;
    let in_reserved = in_reserved as i64;
    let outside = i64::from(held > 0 && !checkpoint.starts_with(&reserved));
    if in_reserved + outside == 0 {
        return Ok(Outcome::Nothing);
    }
    if !force {
        if let Some(lease) = live_election_lease(&client, &rewriter.election_prefix(), timeout).await? {
            return Ok(Outcome::Refused(format!("HA election lease {lease:x} of the link is alive")));
        }
        let window = config.sync.progress_interval.get() * 2;
        eprintln!(
            "retire: watching the checkpoint for {window:?} (2 x sync.progress_interval) for a live writer"
        );
        let until = Instant::now() + window;
        while Instant::now() < until {
            tokio::time::sleep(POLL.min(until - Instant::now())).await;
            if read_checkpoint(kv.clone()).await? != held {
                return Ok(Outcome::Refused(format!(
                    "the checkpoint moved within {window:?}: an agent writes it"
                )));
            }
        }
    }
    // One Txn: the checkpoint is where it was (or still absent), then every reserved key goes.
    let guard = Compare::mod_revision(checkpoint.clone(), CompareOp::Equal, held);
    let mut deletes =
        vec![TxnOp::delete(reserved.clone(), Some(DeleteOptions::new().with_range(prefix_end(&reserved))))];
    if outside > 0 {
        deletes.push(TxnOp::delete(checkpoint.clone(), None));
    }
    let resp =
        unary("retire", Side::Target, timeout, kv.txn(Txn::new().when([guard]).and_then(deletes))).await?;
    if !resp.succeeded() {
        return Ok(Outcome::Refused(
            "the checkpoint was rewritten while retiring: an agent writes it".into(),
        ));
    }
    Ok(Outcome::Retired { keys: in_reserved + outside })
}

/// The first election key under `prefix` whose lease is still alive.
async fn live_election_lease(
    client: &etcd_client::Client,
    prefix: &[u8],
    timeout: Duration,
) -> anyhow::Result<Option<i64>> {
    let opts = GetOptions::new().with_range(prefix_end(prefix)).with_keys_only();
    let mut kv = client.kv_client();
    let resp =
        unary("retire election read", Side::Target, timeout, kv.get(prefix.to_vec(), Some(opts))).await?;
    let mut lease = client.lease_client();
    for id in resp.kvs().iter().map(|kv| kv.lease()).filter(|&id| id != 0) {
        let ttl =
            unary("retire lease read", Side::Target, timeout, lease.time_to_live(id, None)).await?.ttl();
        if ttl > 0 {
            return Ok(Some(id));
        }
    }
    Ok(None)
}
