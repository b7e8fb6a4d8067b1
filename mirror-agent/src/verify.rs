//! `mirror-agent verify`: an independent, read-only comparison of source and target.
//!
//! The source is read pinned at a revision (default: the target checkpoint's watermark, where
//! G3 promises equality), the target pinned at one snapshot, and the two are merge-joined by
//! `mirror-reconcile`. Counts and SHA-256 fingerprints of the ordered (target key, value) pairs
//! of both sides are printed, then up to `--max-diffs` differing keys, redacted. It never writes.
//!
//! An exact link (`sync.revisions = "exact"`) is compared as SPEC §10 says: the target's
//! revision must be the revision its checkpoint names (nothing else wrote it), and at that
//! revision (or `--revision`) every key agrees in value, create and mod revision, version and
//! lease, reserved keys left out.

use crate::exit::Exit;
use std::process::ExitCode;

use mirror_core::{connect_reachable, unary, Config, Side};
use mirror_fence::Checkpoint;
use mirror_reconcile::{Differ, Difference};

/// Runs the comparison and prints the report.
pub async fn verify(config: Config, revision: Option<i64>, max_diffs: usize) -> ExitCode {
    match run(config, revision, max_diffs).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(Exit::No),
        Err(e) => {
            eprintln!("mirror-agent verify: {e:#}");
            ExitCode::from(Exit::CannotStart)
        }
    }
}

async fn run(config: Config, revision: Option<i64>, max_diffs: usize) -> anyhow::Result<bool> {
    if config.exact() {
        return exact(config, revision, max_diffs).await;
    }
    let rewriter = config.rewriter();
    let timeout = config.sync.request_timeout.get();
    let source = connect_reachable(Side::Source, &config.source, &config.sync).await?;
    let target = connect_reachable(Side::Target, &config.target, &config.sync).await?;
    let target_kv = target.kv_client();
    // One target snapshot: the checkpoint read's revision pins every target page, and the
    // watermark is decoded from that same read. (Reading the checkpoint a second time let a
    // commit land between the two reads: a healthy link under load was reported DIFFERENT.)
    let cp =
        unary("read checkpoint", Side::Target, timeout, target_kv.clone().get(config.checkpoint_key(), None))
            .await?;
    let target_revision = cp.header().map_or(0, |h| h.revision());
    let revision = match revision {
        Some(r) => r,
        None => match cp.kvs().first().map(|kv| Checkpoint::decode(kv.value())).transpose()? {
            Some(record) if !record.scanning => record.watermark,
            Some(_) => anyhow::bail!("the initial sync is still running; pass --revision"),
            None => anyhow::bail!("no checkpoint in the target; pass --revision"),
        },
    };
    let (total, _) = mirror_scan::count(
        &mut source.kv_client(),
        &rewriter.scan_windows(),
        Some(revision),
        Side::Source,
        timeout,
    )
    .await?;
    let page = mirror_core::PagerOptions::new(
        "verify page",
        config.sync.page_key_limit,
        config.sync.page_bytes.bytes() as usize,
        timeout,
    );
    let mut differ = Differ::new(
        rewriter.clone(),
        source.kv_client(),
        target_kv.clone(),
        page.clone().at_revision(revision),
    )
    .target_at(target_kv, target_revision, page);
    let compared = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    differ = differ.progress(compared.clone());
    let progress = crate::progress::Progress::new("verify", total)
        .follow(compared, move |n| format!("{n}/{total} source keys compared"));
    let mut shown = Vec::new();
    while let Some(diff) = differ.next_difference().await? {
        if shown.len() < max_diffs {
            let kind = match &diff {
                Difference::Missing(_) => "missing in target",
                Difference::Divergent(_) => "different value",
                Difference::Orphan { .. } => "only in target",
            };
            shown.push(format!("  {kind}: {}", rewriter.redact(diff.key())));
        }
    }
    progress.finish().await;
    let c = &differ.counts;
    println!("source revision:  {revision}");
    println!("target revision:  {target_revision}");
    println!("source keys:      {}", c.source_keys);
    println!("target keys:      {}", c.target_keys);
    println!("source sha256:    {}", c.source_digest());
    println!("target sha256:    {}", c.target_digest());
    println!("missing:          {}", c.missing);
    println!("divergent:        {}", c.divergent);
    println!("orphan:           {}", c.orphan);
    if c.foreign_keys > 0 {
        println!("foreign (under excluded prefixes, ignored): {}", c.foreign_keys);
    }
    if c.equal() {
        println!("EQUAL");
        Ok(true)
    } else {
        println!("DIFFERENT; first {} differing keys:", shown.len());
        for line in shown {
            println!("{line}");
        }
        Ok(false)
    }
}

/// `verify` of an exact link: both revisions, then every key with its metadata.
async fn exact(config: Config, revision: Option<i64>, max_diffs: usize) -> anyhow::Result<bool> {
    let timeout = config.sync.request_timeout.get();
    let source = connect_reachable(Side::Source, &config.source, &config.sync).await?;
    let target = connect_reachable(Side::Target, &config.target, &config.sync).await?;
    let cp = unary(
        "read checkpoint",
        Side::Target,
        timeout,
        target.kv_client().get(config.checkpoint_key(), None),
    )
    .await?;
    let target_revision = cp.header().map_or(0, |h| h.revision());
    let Some(kv) = cp.kvs().first() else { anyhow::bail!("no checkpoint of this link in the target") };
    let landed = Checkpoint::decode(kv.value())?.watermark;
    let revision = revision.unwrap_or(landed);
    anyhow::ensure!(
        revision <= landed,
        "--revision {revision} is past the last source revision landed, {landed}"
    );
    let found = crate::exact::compare::compare_at(&config, &source, &target, revision, max_diffs, 0).await?;
    println!("source revision landed:  {landed}");
    println!("target revision:         {target_revision}");
    println!("compared at revision:    {revision}");
    println!("keys equal:              {}", found.equal);
    println!("keys differing:          {}", found.differences());
    let same_revision = target_revision == kv.mod_revision() && kv.mod_revision() == landed;
    if !same_revision {
        println!(
            "the target's revision is {target_revision} and its checkpoint was put at {} for source revision {landed}: \
             something other than the link wrote the target",
            kv.mod_revision()
        );
    }
    if same_revision && found.differences() == 0 {
        println!("EQUAL");
        return Ok(true);
    }
    println!("DIFFERENT; first {} differing keys:", found.shown.len());
    for line in found.shown {
        println!("  {line}");
    }
    Ok(false)
}
