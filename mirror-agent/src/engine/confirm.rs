//! `confirmed_time`: when the source was last seen at or below the watermark (SPEC §5,
//! Failover). What a failover would lose is at most what the source took since.

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
}
