//! Tail lag, open loop: puts sent at their due time whatever the system does, each timed from
//! its acknowledgement to its first sight on the other side ([`tail_lag`]), beside the source's
//! own watch and the agent's Txns over the same window ([`Commits`]); the highest rate a side
//! keeps up with ([`highest_kept_up`]).

use std::time::Duration;

use etcd_client::{Client, WatchOptions};
use tokio::time::Instant;

use super::*;

/// Writes to `src` at `rate`/s for `seconds`, open loop, and measures put acknowledged →
/// visible in `dst`. Lags sorted ascending; a write never seen counts as the whole wait.
pub(super) async fn tail_lag(
    src: &Client,
    dst: &Client,
    prefix: &str,
    rate: u32,
    seconds: u64,
) -> anyhow::Result<Lags> {
    let total = (rate as u64 * seconds) as usize;
    let wait = Duration::from_secs(seconds + 30);
    // Keys to wait for: every put sent, then, once the writer is done, those acknowledged (a
    // refused put never appears, and waiting for it cost every refused round the whole wait).
    let (expect, expected) = tokio::sync::watch::channel(total);
    let opts = || Some(WatchOptions::new().with_prefix());
    let seen = tokio::spawn(first_seen(dst.clone().watch(prefix, opts()).await?, expected.clone(), wait));
    // The baseline: when a watch on the source itself sees each put. What the agent adds is the
    // difference; what the source's own delivery takes is no part of it.
    let at_source = tokio::spawn(first_seen(src.clone().watch(prefix, opts()).await?, expected, wait));
    let Sent { acked, refused: rejected } =
        open_loop(src.clone(), prefix.to_owned(), rate, total, tokio_util::sync::CancellationToken::new())
            .await?;
    let _ = expect.send(acked.len());
    let lags_of = |seen: HashMap<Vec<u8>, Instant>| {
        let mut lags: Vec<Duration> = acked
            .iter()
            .map(|(k, at)| seen.get(k).map_or(wait, |s| s.saturating_duration_since(*at)))
            .collect();
        lags.sort();
        lags
    };
    let lags = lags_of(seen.await?);
    let source = lags_of(at_source.await?);
    Ok(Lags { lags, source, rejected, commits: None })
}

/// [`tail_lag`] through `agent`, with what its Txns took meanwhile ([`Commits`]).
pub(super) async fn agent_tail_lag(
    agent: &AgentProcess,
    src: &Client,
    dst: &Client,
    prefix: &str,
    rate: u32,
    seconds: u64,
) -> anyhow::Result<Lags> {
    let before = agent.metrics().await?;
    let mut lags = tail_lag(src, dst, prefix, rate, seconds).await?;
    lags.commits = Some(Commits::between(&before, &agent.metrics().await?));
    Ok(lags)
}

/// When each key first appears on `stream`, until `expected` keys have or `wait` passed.
pub(super) async fn first_seen(
    mut stream: etcd_client::WatchStream,
    expected: tokio::sync::watch::Receiver<usize>,
    wait: Duration,
) -> HashMap<Vec<u8>, Instant> {
    let mut seen: HashMap<Vec<u8>, Instant> = HashMap::new();
    let deadline = Instant::now() + wait;
    while seen.len() < *expected.borrow() && Instant::now() < deadline {
        let Ok(Ok(Some(resp))) = tokio::time::timeout(Duration::from_secs(1), stream.message()).await else {
            continue;
        };
        let now = Instant::now();
        for ev in resp.events() {
            if let Some(kv) = ev.kv() {
                seen.entry(kv.key().to_vec()).or_insert(now);
            }
        }
    }
    seen
}

/// Rounds of [`highest_kept_up`]: 10 % steps down from the rate the source did not keep up
/// with, so the rate found is within a tenth of the highest it keeps up with, down to 43 % of
/// the rate first offered.
pub(super) const ACCEPT_ROUNDS: u32 = 8;

/// The p99 within which a watch on the source must see the puts for the source to count as
/// keeping up with a rate: the agent reads that same watch, so it cannot be faster than it, and
/// this is the tail's own bound (issue #24: p99 <= 100 ms).
pub(super) const SOURCE_WATCH_P99: Duration = Duration::from_millis(100);

/// After the source did not keep up with `offered` (it refused puts, or took them all but
/// delivered them to its own watch later than [`SOURCE_WATCH_P99`]): offers 90 %, 81 %, ...
/// of it, each for `seconds` like the round it follows, until the source keeps up, and prints
/// and returns the agent's lags at that rate: the tail at the highest rate the source kept up
/// with (to within 10 %), rather than a rate the source lowered reported as met. None when it
/// kept up with none.
pub(super) async fn highest_kept_up(
    agent: &AgentProcess,
    src: &Client,
    dst: &Client,
    round: usize,
    offered: u32,
    seconds: u64,
) -> anyhow::Result<Option<TailFigures>> {
    let mut rate = offered;
    for _ in 0..ACCEPT_ROUNDS {
        rate = rate * 9 / 10;
        let prefix = format!("/bench/lag{round}-{rate}/");
        let lags = agent_tail_lag(agent, src, dst, &prefix, rate, seconds).await?;
        let Some(why) = lags.overloaded() else {
            println!("  highest rate the source kept up with: {rate:>5} writes/s: agent {}", lags.summary());
            lags.print_commits();
            return Ok(Some(TailFigures { rate, agent: lags.lags, make_mirror: None }));
        };
        println!("  at {rate:>5} writes/s the source still did not keep up: {why}");
    }
    println!("  the source did not keep up with any rate down to {rate} writes/s");
    Ok(None)
}

/// What an [`open_loop`] writer sent.
pub(super) struct Sent {
    /// When each acknowledged put was acknowledged, by key.
    pub(super) acked: HashMap<Vec<u8>, Instant>,
    /// Puts the source refused.
    pub(super) refused: usize,
}

/// Puts `{prefix}{i:08}` for i = 0, 1, ... at `rate`/s until `total` were sent or `stop` is
/// cancelled, then waits for those in flight. Open loop: each put is sent at its due time on a
/// task of its own, whether or not earlier ones returned, so a slow system cannot lower the
/// offered rate.
pub(super) async fn open_loop(
    src: Client,
    prefix: String,
    rate: u32,
    total: usize,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<Sent> {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1) as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut puts = tokio::task::JoinSet::new();
    for i in 0..total {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => break,
        }
        let key = format!("{prefix}{i:08}").into_bytes();
        let mut c = src.clone();
        puts.spawn(async move {
            c.put(key.clone(), "x", None).await?;
            anyhow::Ok((key, Instant::now()))
        });
    }
    let mut sent = Sent { acked: HashMap::new(), refused: 0 };
    while let Some(done) = puts.join_next().await {
        // An overloaded source refuses puts ("too many requests"): count them, lag the rest.
        match done? {
            Ok((key, at)) => drop(sent.acked.insert(key, at)),
            Err(_) => sent.refused += 1,
        }
    }
    Ok(sent)
}

impl Lags {
    /// Why the source did not keep up with the offered rate (it refused puts, or its own
    /// watch saw them later than [`SOURCE_WATCH_P99`]), or None when it did.
    pub(super) fn overloaded(&self) -> Option<String> {
        let p99 = quantile(&self.source, 0.99);
        if self.rejected > 0 {
            Some(format!("it refused {} puts", self.rejected))
        } else if p99 > SOURCE_WATCH_P99 {
            Some(format!("it took every put, but a watch on it saw them with p99 {:.0} ms", ms(p99)))
        } else {
            None
        }
    }

    /// The agent's Txns over the window, on a line of their own (nothing for make-mirror).
    pub(super) fn print_commits(&self) {
        if let Some(commits) = &self.commits {
            println!("  {commits}");
        }
    }

    pub(super) fn summary(&self) -> String {
        let refused = match self.rejected {
            0 => String::new(),
            n => format!(" ({n} puts refused by the source)"),
        };
        format!(
            "p50 {:>8.2} ms p99 {:>8.2} ms (a watch on the source: p50 {:.2} ms p99 {:.2} ms){refused}",
            ms(quantile(&self.lags, 0.5)),
            ms(quantile(&self.lags, 0.99)),
            ms(quantile(&self.source, 0.5)),
            ms(quantile(&self.source, 0.99))
        )
    }
}

/// What [`tail_lag`] measured.
pub(super) struct Lags {
    /// Per acknowledged put, sorted: until the target's watch saw it.
    pub(super) lags: Vec<Duration>,
    /// The same puts until a watch on the source saw them, sorted (the baseline).
    pub(super) source: Vec<Duration>,
    /// Puts the source refused.
    pub(super) rejected: usize,
    /// The agent's Txns meanwhile (None for make-mirror).
    pub(super) commits: Option<Commits>,
}

/// The agent's fenced Txns over a tail window, from two scrapes of its `/metrics`: how long
/// each took from sent to landed (`etcd_mirror_apply_latency_seconds`: the target's commit
/// and the way there and back), and how many source revisions each carried
/// (`etcd_mirror_batch_revisions`, group commit). A put's lag is the source watch's delivery,
/// then the wait for the Txn before it, then its own Txn, then the target watch's delivery:
/// this separates the middle two from the rest.
pub(super) struct Commits {
    pub(super) latency: Observed,
    pub(super) revisions: Observed,
}

impl Commits {
    pub(super) fn between(before: &Scraped, after: &Scraped) -> Commits {
        Commits {
            latency: after.histogram_since(before, "etcd_mirror_apply_latency_seconds"),
            revisions: after.histogram_since(before, "etcd_mirror_batch_revisions"),
        }
    }
}

impl std::fmt::Display for Commits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |s: Option<f64>| match s {
            Some(s) if s.is_finite() => format!("{:.1} ms", s * 1e3),
            Some(_) => "above the last bucket".to_owned(),
            None => "-".to_owned(),
        };
        write!(
            f,
            "its {} Txns meanwhile took p50 <= {}, p99 <= {} (mean {}) from sent to landed; {:.1} revisions per tail Txn",
            self.latency.count,
            ms(self.latency.quantile_at_most(0.5)),
            ms(self.latency.quantile_at_most(0.99)),
            ms(self.latency.mean()),
            self.revisions.mean().unwrap_or(0.0)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The source keeps up with a rate only when it took every put *and* its own watch saw
    /// them within the bound; either failure is said.
    #[test]
    fn a_source_that_took_every_put_late_did_not_keep_up() {
        let ms = |v: &[u64]| v.iter().map(|&m| Duration::from_millis(m)).collect::<Vec<_>>();
        let lags = |source: &[u64], rejected| Lags {
            lags: ms(&[5, 9]),
            source: ms(source),
            rejected,
            commits: None,
        };
        assert_eq!(lags(&[3, 40, 90], 0).overloaded(), None);
        let late = lags(&[3, 40, 2400], 0).overloaded().expect("late");
        assert!(late.contains("took every put") && late.contains("2400 ms"), "{late}");
        let refused = lags(&[3, 4], 12).overloaded().expect("refused");
        assert!(refused.contains("refused 12 puts"), "{refused}");
    }
}
