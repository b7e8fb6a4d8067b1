//! Progress of long CLI work (`verify`, `cutover --wait`) on stderr: an `indicatif` bar or
//! spinner when stderr is a terminal, else one plain line every few seconds (and on every change
//! of stage), so logs and CI output show it too. Stdout keeps the report.

use std::io::IsTerminal as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tokio::time::Instant;

/// How often a plain line is printed when nothing else changed.
const PLAIN_EVERY: Duration = Duration::from_secs(5);

/// One progress display.
pub struct Progress {
    label: &'static str,
    bar: Option<ProgressBar>,
    last_line: Option<(Instant, String)>,
}

impl Progress {
    /// A bar of `len` units (0: a spinner with a message only).
    pub fn new(label: &'static str, len: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let (bar, template) = if len > 0 {
                (ProgressBar::new(len), "{prefix} {bar:40} {msg} {per_sec} eta {eta}")
            } else {
                (ProgressBar::new_spinner(), "{prefix} {spinner} {msg}")
            };
            bar.set_style(
                ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_prefix(label);
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        });
        Progress { label, bar, last_line: None }
    }

    /// Moves to `pos` with `message`; a plain line when the stage (what the message says before
    /// a `:`, if anything) changed or [`PLAIN_EVERY`] passed.
    pub fn set(&mut self, pos: u64, message: String) {
        if let Some(bar) = &self.bar {
            bar.set_position(pos);
            bar.set_message(message);
            return;
        }
        let stage = |m: &str| m.split_once(':').map(|(stage, _)| stage.to_owned()).unwrap_or_default();
        let due = match &self.last_line {
            None => true,
            Some((at, last)) => stage(last) != stage(&message) || at.elapsed() >= PLAIN_EVERY,
        };
        if due && self.last_line.as_ref().is_none_or(|(_, last)| *last != message) {
            eprintln!("{}: {message}", self.label);
            self.last_line = Some((Instant::now(), message));
        }
    }

    /// Removes the bar (plain lines stay as printed).
    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }

    /// Follows `counter` (e.g. [`mirror_reconcile::Differ::progress`]) on a task of its own until
    /// the returned guard is finished, describing each position with `describe`.
    pub fn follow(
        mut self,
        counter: Arc<AtomicU64>,
        describe: impl Fn(u64) -> String + Send + 'static,
    ) -> Following {
        let stop = tokio_util::sync::CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            loop {
                let n = counter.load(Ordering::Relaxed);
                self.set(n, describe(n));
                tokio::select! {
                    _ = stopped.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
            }
            self.finish();
        });
        Following { stop, task }
    }
}

/// A [`Progress::follow`] in flight.
pub struct Following {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Following {
    /// Stops following and clears the bar.
    pub async fn finish(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}
