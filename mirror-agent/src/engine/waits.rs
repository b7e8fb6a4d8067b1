//! What the engine's `select!` loops wait on beside their work: a reloaded config, a spawned
//! task's result, a deadline that may not be set.

use mirror_core::Config;
use tokio::time::Instant;

/// Resolves when a reloaded config is waiting (without consuming it), never without a channel.
pub(super) async fn reload_changed(reload: &mut Option<tokio::sync::watch::Receiver<Config>>) {
    match reload {
        Some(rx) => {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// The result of a spawned task, or never when there is none.
pub(super) async fn join_some<F: std::future::Future + Unpin>(task: &mut Option<F>) -> F::Output {
    match task {
        Some(handle) => handle.await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`, or forever when there is no deadline.
pub(super) async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
