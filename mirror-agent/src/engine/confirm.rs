//! `confirmed_time`: when the source was last seen at or below the watermark (SPEC §5,
//! Failover). What a failover would lose is at most what the source took since.

use etcd_client::GetOptions;
use mirror_core::{now_rfc3339, unary, Side};

use super::{EngineError, Run};

impl Run<'_> {
    /// When `revision` reaches the newest header revision the watch answered with, the time
    /// that answer arrived: the source held nothing newer then, so a failover at that moment
    /// would have lost nothing (`confirmed_time`). None during an initial sync that has not
    /// reached `scan_end` (the target is not yet the source's state).
    pub(super) fn confirmed_by(&self, revision: i64, scan_end: Option<i64>) -> Option<String> {
        if scan_end.is_some_and(|end| revision < end) {
            return None;
        }
        let (header, time) = self.newest_header.as_ref()?;
        (revision >= *header).then(|| time.clone())
    }

    /// A reply at or below the watermark confirmed it current: stores when, with a
    /// checkpoint-only Txn at most once per `progress_interval`, so `confirmed_time` stays
    /// fresh on an idle source (a failover's data-loss window is measured from it).
    pub(super) async fn confirm_current(&mut self, scan_end: &Option<i64>) -> Result<(), EngineError> {
        let Some((_, time)) = self.newest_header.clone() else { return Ok(()) };
        if scan_end.is_some() {
            return Ok(());
        }
        let interval = self.cfg().sync.progress_interval.get();
        let stored = &self.writer().record().confirmed_time;
        let age = humantime::parse_rfc3339_weak(stored)
            .ok()
            .and_then(|at| std::time::SystemTime::now().duration_since(at).ok());
        if age.is_some_and(|age| age < interval) {
            return Ok(());
        }
        let next = self.writer().record().confirmed_at(time);
        self.commit_with_retry(&[], next).await
    }

    /// On a source whose whole cluster has not moved past the watermark, etcd 3.5.30 answers no
    /// progress request (the watch starts at watermark + 1, a revision the server has not
    /// reached), so nothing would ever confirm the watermark and a failover would report an
    /// unbounded loss window. A linearizable read says it directly: its header revision is the
    /// source's revision when it was served. The read runs on a task of its own (one at a time)
    /// so a source that does not answer never holds up the tail: its watch error, a fence check
    /// or a stop is handled meanwhile. Above the watermark, the watch's own replies and events
    /// confirm (the server has reached its start revision).
    pub(super) fn start_confirm_read(&mut self, scan_end: &Option<i64>) {
        let watermark = self.writer().record().watermark;
        if self.confirm_read.is_some()
            || scan_end.is_some()
            || self.newest_header.as_ref().is_some_and(|(header, _)| *header > watermark)
        {
            return;
        }
        let sync = &self.cfg().sync;
        let timeout = sync.request_timeout.get().min(sync.progress_interval.get());
        let key = self.engine.rewriter.source_prefix().to_vec();
        let mut kv = self.source.kv_client();
        self.confirm_read = Some(tokio::spawn(async move {
            let opts = GetOptions::new().with_count_only().with_limit(1);
            let resp = unary("confirm read", Side::Source, timeout, kv.get(key, Some(opts))).await.ok()?;
            Some((resp.header().map_or(0, |h| h.revision()), now_rfc3339()))
        }));
    }

    /// The confirm read's answer (the source's revision and when it was served): at or below
    /// the watermark, the source held nothing newer then; stored as `confirm_current` does. A
    /// failed read confirms nothing and is left to the watch to notice.
    pub(super) async fn on_confirm_read(
        &mut self,
        answer: Option<(i64, String)>,
        scan_end: &Option<i64>,
    ) -> Result<(), EngineError> {
        self.confirm_read = None;
        let Some((header, time)) = answer else { return Ok(()) };
        self.engine.update(|s| s.source_revision = s.source_revision.max(header));
        if header > self.writer().record().watermark {
            return Ok(());
        }
        if self.newest_header.as_ref().is_none_or(|(newest, _)| header >= *newest) {
            self.newest_header = Some((header, time));
        }
        self.confirm_current(scan_end).await
    }
}
