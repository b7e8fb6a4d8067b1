//! `confirmed_time`: when the source was last seen at or below the watermark (SPEC §5,
//! Failover). What a failover would lose is at most what the source took since.
//!
//! [`Confirmer`] is a component of its own: it owns what the source last said
//! about its revision and the confirm read in flight, and says when a checkpoint-only Txn is
//! owed; the tail commits it.

use std::time::{Duration, SystemTime};

use etcd_client::{GetOptions, KvClient};
use mirror_core::{now_rfc3339, unary, Side};
use tokio::task::JoinHandle;

/// A revision the source answered with and when (RFC 3339).
type Heard = (i64, String);

/// The newest source revision seen, when, and the confirm read in flight.
#[derive(Debug, Default)]
pub(crate) struct Confirmer {
    /// The newest header revision the tail's watch (or a confirm read at or below the
    /// watermark) answered with, and when it arrived: a watermark at or above it was current
    /// then.
    newest: Option<Heard>,
    /// The idle source's confirm read in flight: its revision and when it answered.
    read: Option<JoinHandle<Option<Heard>>>,
}

impl Confirmer {
    /// The source answered with `header` now (a watch response or reply). The same revision
    /// seen again later moves the time: the source was still there then (an idle source's
    /// replies keep `confirmed_time` fresh). A lower one changes nothing.
    pub(super) fn heard(&mut self, header: i64) {
        self.heard_at(header, now_rfc3339());
    }

    fn heard_at(&mut self, header: i64, time: String) {
        if self.newest.as_ref().is_none_or(|(newest, _)| header >= *newest) {
            self.newest = Some((header, time));
        }
    }

    /// When `revision` reaches the newest header revision heard, the time it arrived: the
    /// source held nothing newer then, so a failover at that moment would have lost nothing
    /// (`confirmed_time`). None during an initial sync that has not reached `scan_end` (the
    /// target is not yet the source's state).
    pub(super) fn confirmed_by(&self, revision: i64, scan_end: Option<i64>) -> Option<String> {
        if scan_end.is_some_and(|end| revision < end) {
            return None;
        }
        let (header, time) = self.newest.as_ref()?;
        (revision >= *header).then(|| time.clone())
    }

    /// A reply at or below the watermark confirmed it current: the time to store with a
    /// checkpoint-only Txn, at most once per `interval` after the record's `stored` time, so
    /// `confirmed_time` stays fresh on an idle source. None in an initial sync, or when nothing
    /// was heard.
    pub(super) fn owed(&self, stored: &str, interval: Duration, scan_end: Option<i64>) -> Option<String> {
        let (_, time) = self.newest.as_ref()?;
        if scan_end.is_some() {
            return None;
        }
        let age = humantime::parse_rfc3339_weak(stored)
            .ok()
            .and_then(|at| SystemTime::now().duration_since(at).ok());
        age.is_none_or(|age| age >= interval).then(|| time.clone())
    }

    /// On a source whose whole cluster has not moved past the watermark, etcd 3.5.30 answers
    /// no progress request (the watch starts at watermark + 1, a revision the server has not
    /// reached), so nothing would ever confirm the watermark and a failover would report an
    /// unbounded loss window. A linearizable read of `key` says it directly: its header
    /// revision is the source's revision when it was served. The read runs on a task of its own
    /// (one at a time) so a source that does not answer never holds up the tail. Above the
    /// watermark, or in an initial sync, the watch's own replies and events confirm.
    pub(crate) fn start_read(
        &mut self,
        watermark: i64,
        in_genesis: bool,
        mut kv: KvClient,
        key: Vec<u8>,
        timeout: Duration,
    ) {
        if self.read.is_some()
            || in_genesis
            || self.newest.as_ref().is_some_and(|(header, _)| *header > watermark)
        {
            return;
        }
        self.read = Some(tokio::spawn(async move {
            let opts = GetOptions::new().with_count_only().with_limit(1);
            let resp = unary("confirm read", Side::Source, timeout, kv.get(key, Some(opts))).await.ok()?;
            Some((resp.header().map_or(0, |h| h.revision()), now_rfc3339()))
        }));
    }

    /// The confirm read's answer, once it is in (never while none runs).
    pub(crate) async fn answer(&mut self) -> Option<Heard> {
        let answer = super::waits::join_some(&mut self.read).await;
        self.read = None;
        answer.ok().flatten()
    }

    /// Takes the read's `answer`; the source revision it saw, and whether the watermark is
    /// confirmed current by it (at or below `watermark`: the source held nothing newer then,
    /// and the tail stores it as for a reply). A failed read confirms nothing and is left to
    /// the watch to notice.
    pub(super) fn on_answer(&mut self, answer: Option<Heard>, watermark: i64) -> (Option<i64>, bool) {
        let Some((header, time)) = answer else { return (None, false) };
        if header > watermark {
            return (Some(header), false);
        }
        self.heard_at(header, time);
        (Some(header), true)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Confirmer;

    const T1: &str = "2026-12-05T10:00:00Z";
    const T2: &str = "2026-12-05T10:00:05Z";

    /// The newest revision heard, and its time, is what a watermark at or above it confirms;
    /// a lower revision heard later changes nothing, the same one heard again moves the time.
    #[test]
    fn a_watermark_at_the_newest_header_is_confirmed_at_its_time() {
        let mut c = Confirmer::default();
        assert_eq!(c.confirmed_by(10, None), None, "nothing heard");
        c.heard_at(10, T1.into());
        assert_eq!(c.confirmed_by(9, None), None, "behind the source");
        assert_eq!(c.confirmed_by(10, None).as_deref(), Some(T1));
        c.heard_at(8, T2.into());
        assert_eq!(c.confirmed_by(10, None).as_deref(), Some(T1), "an older header is no news");
        c.heard_at(10, T2.into());
        assert_eq!(c.confirmed_by(10, None).as_deref(), Some(T2), "the source was still at 10 later");
        assert_eq!(c.confirmed_by(10, Some(11)), None, "an initial sync short of scan_end confirms nothing");
        assert_eq!(c.confirmed_by(11, Some(11)).as_deref(), Some(T2));
    }

    /// A stored time younger than the interval owes no Txn; an older, unreadable or missing
    /// one does, and so does nothing during an initial sync.
    #[test]
    fn a_confirmation_is_owed_once_per_interval() {
        let mut c = Confirmer::default();
        let minute = Duration::from_secs(60);
        assert_eq!(c.owed("", minute, None), None, "nothing heard");
        c.heard_at(10, T2.into());
        assert_eq!(c.owed("", minute, None).as_deref(), Some(T2), "never stored");
        assert_eq!(c.owed(T1, minute, None).as_deref(), Some(T2), "stored long ago");
        assert_eq!(c.owed(&mirror_core::now_rfc3339(), minute, None), None, "stored just now");
        assert_eq!(c.owed(T1, minute, Some(12)), None, "in an initial sync");
    }

    /// A confirm read above the watermark only reports the source's revision; at or below it,
    /// it confirms the watermark at the read's time.
    #[test]
    fn a_read_at_or_below_the_watermark_confirms_it() {
        let mut c = Confirmer::default();
        assert_eq!(c.on_answer(None, 10), (None, false), "a failed read confirms nothing");
        assert_eq!(c.on_answer(Some((12, T1.into())), 10), (Some(12), false));
        assert_eq!(c.confirmed_by(10, None), None);
        assert_eq!(c.on_answer(Some((10, T2.into())), 10), (Some(10), true));
        assert_eq!(c.confirmed_by(10, None).as_deref(), Some(T2));
    }
}
