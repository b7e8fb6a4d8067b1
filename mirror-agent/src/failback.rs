//! `mirror-agent failback-plan --config REVERSE.toml --promoted-watermark W --out FILE`: what
//! the old source took after the failover's watermark and the new primary never got (SPEC §5,
//! Failback). Read-only.
//!
//! `REVERSE.toml` is the reverse link's config: its source is the new primary, its target the
//! old source. The plan reads the old source's range of that link (its destination range,
//! without reserved keys or excludes) and lists, as JSON lines after one header line, every
//! write in `(W, R]`, where R is the old source's revision when the plan starts:
//! - from the old source's history when it still holds revision W + 1: puts and deletes, in
//!   revision order ([`mirror_watch::read_history`], which says what proved it read all);
//! - otherwise (compacted past W) every key whose `mod_revision > W` at R: puts only, and the
//!   header says deletes could not be listed.
//!
//! Take the plan before starting the reverse link: once it runs it writes the old source too.
//! If its checkpoint is already there, the plan stops just before the revision that created
//! it, and says so.
//!
//! The file is written whole or not at all (a temporary file renamed into place).

use crate::exit::Exit;
use std::fs::File;
use std::io::{BufWriter, Seek, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use etcd_client::Client;
use mirror_core::{
    connect_to, parse_version, probe_members, read_head, unary, Config, Pager, PagerOptions, Side,
};
use mirror_watch::{read_history, History, HistoryError, Written};
use serde_json::json;

/// How often the history read asks for progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Runs the plan.
pub async fn failback_plan(config: Config, watermark: i64, out: PathBuf) -> ExitCode {
    match plan(&config, watermark, &out).await {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::from(Exit::Done)
        }
        Err(Failure::Refused(why)) => {
            eprintln!("mirror-agent failback-plan: refused, nothing written: {why}");
            ExitCode::from(Exit::No)
        }
        Err(Failure::Error(why)) => {
            eprintln!("mirror-agent failback-plan: {why:#}");
            ExitCode::from(Exit::CannotStart)
        }
    }
}

enum Failure {
    Refused(String),
    Error(anyhow::Error),
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Failure {
        Failure::Error(e.into())
    }
}

/// What was read, for the header and the summary.
struct Listed {
    from: &'static str,
    puts: u64,
    deletes: u64,
    end: String,
}

async fn plan(config: &Config, watermark: i64, out: &Path) -> Result<String, Failure> {
    if watermark <= 0 {
        return Err(Failure::Refused(format!("--promoted-watermark {watermark}: a revision is > 0")));
    }
    let sync = &config.sync;
    let timeout = sync.request_timeout.get();
    // The old source is the reverse link's target.
    let probe = probe_members(Side::Target, &config.target, sync).await.map_err(|e| {
        anyhow::anyhow!("cannot reach the old source (the target of {:?}): {e}", config.link_uid)
    })?;
    let lowest = probe
        .members
        .iter()
        .filter_map(|m| Some((parse_version(&m.version)?, m.version.as_str())))
        .min()
        .map_or(mirror_core::UNKNOWN_VERSION, |(_, v)| v);
    let trusted = sync.trust_progress_notify.trusts(lowest);
    let client = connect_to(Side::Target, &config.target, sync, &probe.serving_endpoints()).await?;
    let rewriter = config.rewriter();
    let range = rewriter.target_range();
    let now = read_head(
        &mut client.kv_client(),
        range.start.clone(),
        "failback plan revision",
        Side::Target,
        timeout,
    )
    .await?
    .revision;
    if now < watermark {
        return Err(Failure::Refused(format!(
            "the old source is at revision {now}, below the promoted watermark {watermark}: it went back \
             (restored from an older snapshot), or this is not the cluster the link mirrored; its history \
             cannot say what it took after the watermark"
        )));
    }
    let (upto, reverse_note) = match reverse_link_started(&client, config, timeout).await? {
        Some(created) if created <= now => (
            (created - 1).max(watermark),
            format!(
                "the reverse link's checkpoint was created at revision {created}: the plan stops before it \
                 (what the link wrote is not the old source's own)"
            ),
        ),
        _ => (now, String::new()),
    };

    let tmp = out.with_extension("partial");
    let mut entries = tempfile_in(out)?;
    let history = History {
        range: range.clone(),
        after: watermark,
        upto,
        trusted,
        progress_every: PROGRESS_EVERY,
        pager: pager(config, timeout),
    };
    let mut listed = Listed { from: "history", puts: 0, deletes: 0, end: String::new() };
    let read = {
        let mut writer = BufWriter::new(&mut entries);
        let read = read_history(&client, &history, |w| {
            let Some(line) = entry(&rewriter, &w) else { return Ok(()) };
            match w {
                Written::Put { .. } => listed.puts += 1,
                Written::Delete { .. } => listed.deletes += 1,
            }
            writeln!(writer, "{line}")
        })
        .await;
        writer.flush()?;
        read
    };
    match read {
        Ok(end) => listed.end = end.describe().to_owned(),
        Err(HistoryError::Compacted { compact_revision }) => {
            entries.set_len(0)?;
            entries.rewind()?;
            listed = Listed { from: "keys", puts: 0, deletes: 0, end: String::new() };
            listed.end = format!(
                "the old source is compacted (at revision {compact_revision}) past the watermark: \
                 keys with mod_revision > {watermark} at revision {upto}; deletes after the watermark \
                 could not be listed"
            );
            let mut writer = BufWriter::new(&mut entries);
            let mut pages = Pager::new(
                client.kv_client(),
                Side::Target,
                rewriter.target_windows(),
                pager(config, timeout).at_revision(upto),
            );
            while let Some(page) = pages.next_page().await? {
                for kv in page.iter().filter(|kv| kv.mod_revision() > watermark) {
                    let put = Written::Put {
                        key: kv.key().to_vec(),
                        value: kv.value().to_vec(),
                        revision: kv.mod_revision(),
                        lease: kv.lease(),
                    };
                    if let Some(line) = entry(&rewriter, &put) {
                        listed.puts += 1;
                        writeln!(writer, "{line}")?;
                    }
                }
            }
            writer.flush()?;
        }
        Err(e) => return Err(anyhow::Error::from(e).context("reading the old source's history").into()),
    }

    let header = json!({
        "failback_plan": 1,
        "link_uid": config.link_uid,
        "old_source_range": String::from_utf8_lossy(rewriter.dest_prefix()),
        "promoted_watermark": watermark,
        "to_revision": upto,
        "listed_from": listed.from,
        "deletes_listed": listed.from == "history",
        "puts": listed.puts,
        "deletes": listed.deletes,
        "end": listed.end,
        "note": reverse_note,
    });
    {
        let mut file = BufWriter::new(File::create(&tmp)?);
        writeln!(file, "{header}")?;
        entries.rewind()?;
        std::io::copy(&mut entries, &mut file)?;
        file.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    }
    std::fs::rename(&tmp, out)?;

    let mut summary = format!(
        "failback plan of link {:?}: the old source's writes after the promoted watermark {watermark}, up to its revision {upto}\n",
        config.link_uid
    );
    match listed.from {
        "history" => {
            summary += &format!(
                "  {} puts and {} deletes, from its history (the end proven by {})\n",
                listed.puts, listed.deletes, listed.end
            )
        }
        _ => summary += &format!("  {} puts; DELETES NOT LISTED: {}\n", listed.puts, listed.end),
    }
    if !reverse_note.is_empty() {
        summary += &format!("  note: {reverse_note}\n");
    }
    summary += &format!("  written to {}", out.display());
    Ok(summary)
}

/// The revision that created the reverse link's checkpoint in the old source, if it exists.
async fn reverse_link_started(
    client: &Client,
    config: &Config,
    timeout: Duration,
) -> Result<Option<i64>, Failure> {
    let key = config.checkpoint_key();
    let resp =
        unary("failback plan checkpoint", Side::Target, timeout, client.kv_client().get(key, None)).await?;
    Ok(resp.kvs().first().map(|kv| kv.create_revision()))
}

fn pager(config: &Config, timeout: Duration) -> PagerOptions {
    PagerOptions::new(
        "failback plan page",
        config.sync.page_key_limit,
        config.sync.page_bytes.bytes() as usize,
        timeout,
    )
}

/// The plan's line for a write, or `None` for a key the reverse link does not own (its
/// reserved keys, another link's, an exclude).
fn entry(rewriter: &mirror_core::KeyRewriter, written: &Written) -> Option<serde_json::Value> {
    let key = match written {
        Written::Put { key, .. } | Written::Delete { key, .. } => key,
    };
    rewriter.to_source(key)?;
    Some(match written {
        Written::Put { key, value, revision, lease } => json!({
            "op": "put",
            "key": B64.encode(key),
            "value": B64.encode(value),
            "mod_revision": revision,
            "lease": lease,
        }),
        Written::Delete { key, revision } => json!({
            "op": "delete",
            "key": B64.encode(key),
            "mod_revision": revision,
        }),
    })
}

/// An anonymous file beside `out` (same filesystem), for the entries until the header is known.
fn tempfile_in(out: &Path) -> std::io::Result<File> {
    let dir = out.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    tempfile::tempfile_in(dir)
}

#[cfg(test)]
mod tests {
    use super::entry;
    use mirror_watch::Written;

    /// Reserved keys of the reverse link (its checkpoint) and excluded keys are not the old
    /// source's writes; the rest are listed with base64 keys and values.
    #[test]
    fn entries_skip_what_the_link_does_not_own() {
        let rewriter = mirror_core::KeyRewriter::new(b"/app/", b"/app/", [&b"skip/"[..]]);
        let put = |k: &[u8]| Written::Put { key: k.to_vec(), value: b"v".to_vec(), revision: 7, lease: 0 };
        let line = entry(&rewriter, &put(b"/app/a")).expect("a data key");
        assert_eq!(line["op"], "put");
        assert_eq!(line["key"], "L2FwcC9h");
        assert_eq!(line["value"], "dg==");
        assert_eq!(line["mod_revision"], 7);
        assert!(entry(&rewriter, &put(b"/app/\0etcd-mirror/checkpoint")).is_none());
        assert!(entry(&rewriter, &put(b"/app/skip/x")).is_none());
        assert!(entry(&rewriter, &put(b"/other")).is_none());
        let del = entry(&rewriter, &Written::Delete { key: b"/app/b".to_vec(), revision: 9 }).unwrap();
        assert_eq!(del["op"], "delete");
        assert!(del.get("value").is_none());
    }
}
