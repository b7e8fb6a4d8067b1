//! `confirmed_time` of an exact link: when the source was last seen at or below the
//! watermark. The watch's responses say it (their header revision is the source's revision
//! when sent), and on an idle source a read does (etcd sends a watch ahead of the source's
//! revision no progress notification), started by the engine's
//! [`crate::engine::confirm::Confirmer`].
//!
//! One Txn lands per source revision, a few in flight, so the watch has usually shown the
//! revisions after the one landing: what the source said when it was at that revision is kept
//! until the revision lands ([`Heard`]). Never the time a Txn is built: behind a backlog the
//! source is past the revision then, and a failover would report a smaller loss window than
//! it is.

use std::collections::VecDeque;

use mirror_core::now_rfc3339;

use crate::reporter::Reporter;

use super::super::timeout;
use super::Tail;

/// The source's revisions as its answers gave them, each with the time it came (RFC 3339),
/// from the last at or below the watermark on.
#[derive(Debug, Default)]
pub(super) struct Heard {
    log: VecDeque<(i64, String)>,
}

impl Heard {
    /// The source was at `header` at `time`. The same revision again moves its time (the
    /// source was still there); a lower one changes nothing.
    fn at(&mut self, header: i64, time: String) {
        match self.log.back_mut() {
            Some((last, at)) if *last == header => *at = time,
            Some((last, _)) if *last > header => {}
            _ => self.log.push_back((header, time)),
        }
    }

    /// The last time the source was heard at or below `revision`.
    fn at_or_below(&self, revision: i64) -> Option<&String> {
        self.log.iter().rev().find(|(header, _)| *header <= revision).map(|(_, time)| time)
    }

    /// Forgets what the landed `watermark` makes old: every entry before the last at or
    /// below it.
    fn landed(&mut self, watermark: i64) {
        while self.log.get(1).is_some_and(|(header, _)| *header <= watermark) {
            self.log.pop_front();
        }
    }

    /// The newest revision heard.
    fn newest(&self) -> Option<i64> {
        self.log.back().map(|(header, _)| *header)
    }
}

impl Tail<'_> {
    /// The source answered the watch with `header` now.
    pub(super) fn heard(&mut self, header: i64) {
        self.seen = self.seen.max(header);
        self.heard.at(header, now_rfc3339());
    }

    /// When the source was last known at or below `revision`: heard so, or else the last time
    /// confirmed for the watermark, which is below `revision`.
    pub(super) fn confirmed_at(&self, revision: i64) -> String {
        self.heard.at_or_below(revision).unwrap_or(&self.confirmed).clone()
    }

    /// The watermark moved or the source answered: the watermark's `confirmed_time` for
    /// status, unless none is known yet.
    pub(super) fn confirm(&mut self) -> Option<String> {
        self.confirmed = self.confirmed_at(self.placed.watermark);
        self.heard.landed(self.placed.watermark);
        Some(self.confirmed.clone()).filter(|at| !at.is_empty())
    }

    /// Starts the idle source's confirm read, one at a time, and none while the watch has
    /// shown revisions above the watermark (they will land and confirm).
    pub(super) fn start_confirm_read(&mut self) {
        if self.heard.newest().is_some_and(|newest| newest > self.placed.watermark) {
            return;
        }
        let t = timeout(self.cfg).min(self.cfg.sync.progress_interval.get());
        self.confirmer.start_read(self.placed.watermark, false, self.source.kv_client(), vec![0], t);
    }

    /// The confirm read's answer: the source's revision for status and, at or below the
    /// watermark, a `confirmed_time` for status. No record is written for it (a Txn would add
    /// a target revision the source never had); the next revision landed carries it.
    pub(super) fn on_confirm_read(&mut self, answer: Option<(i64, String)>, reporter: &Reporter) {
        let Some((header, time)) = answer else { return };
        self.seen = self.seen.max(header);
        let confirmed = (header <= self.placed.watermark).then(|| {
            self.heard.at(header, time);
            self.confirm()
        });
        reporter.update(|s| {
            s.source_revision = s.source_revision.max(header);
            s.confirmed_time = confirmed.flatten().or(s.confirmed_time.take());
        });
    }
}

#[cfg(test)]
mod tests {
    use super::Heard;

    fn heard(entries: &[(i64, &str)]) -> Heard {
        let mut heard = Heard::default();
        for (header, time) in entries {
            heard.at(*header, (*time).to_owned());
        }
        heard
    }

    /// With revisions in flight the watch is ahead of the one landing: its time is the one
    /// the source was heard at it, not the newest.
    #[test]
    fn a_revision_behind_the_newest_keeps_the_time_the_source_was_at_it() {
        let heard = heard(&[(10, "t10"), (11, "t11"), (13, "t13")]);
        assert_eq!(heard.at_or_below(11).map(String::as_str), Some("t11"));
        assert_eq!(heard.at_or_below(12).map(String::as_str), Some("t11"));
        assert_eq!(heard.at_or_below(13).map(String::as_str), Some("t13"));
        assert_eq!(heard.at_or_below(9), None, "below everything heard: the caller's last");
    }

    /// The same revision heard again (an idle source's read) moves its time; a lower one
    /// (an answer that came late) changes nothing.
    #[test]
    fn the_same_revision_again_moves_the_time_and_a_lower_one_is_ignored() {
        let heard = heard(&[(10, "a"), (10, "b"), (9, "c")]);
        assert_eq!(heard.at_or_below(10).map(String::as_str), Some("b"));
        assert_eq!(heard.newest(), Some(10));
    }

    /// Landing forgets every entry but the last at or below the watermark and those above.
    #[test]
    fn landing_keeps_the_last_entry_at_or_below_the_watermark() {
        let mut heard = heard(&[(10, "t10"), (11, "t11"), (13, "t13")]);
        heard.landed(12);
        assert_eq!(heard.log.iter().map(|(h, _)| *h).collect::<Vec<_>>(), [11, 13]);
        assert_eq!(heard.at_or_below(12).map(String::as_str), Some("t11"));
        heard.landed(13);
        assert_eq!(heard.log.iter().map(|(h, _)| *h).collect::<Vec<_>>(), [13]);
    }
}
