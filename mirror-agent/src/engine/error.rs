//! How an engine run ends, as the outer loop sees it: [`EngineError`], its error class, the
//! typed reason `/statusz` shows, and the fix command of a refusal.

use mirror_core::{ErrorClass, EtcdError, Reason};
use mirror_fence::FenceError;

use super::{ReconnectCause, Refusal, Restart, ResyncCause};

/// How an engine run ended, as the outer loop sees it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// An etcd call failed.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    /// The fence said no.
    #[error(transparent)]
    Fence(#[from] FenceError),
    /// A rule of the product was broken (empty target, direction, version, oversized revision).
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// Genesis must start over (buffer overflow, compacted watch mid-scan).
    #[error("genesis restart: {0}")]
    RestartGenesis(Restart),
    /// History is gone: forced resync with prune.
    #[error("forced resync: {0}")]
    Resync(ResyncCause),
    /// The connection settings or TLS files changed: reconnect now, no backoff, no error.
    #[error("reconnect: {0}")]
    Reconnect(ReconnectCause),
    /// A reload set `paused = true`: drop the watch, stop writing, wait for the unpause.
    #[error("paused by config")]
    Paused,
    /// SIGTERM/SIGINT arrived inside a long phase (scan, sweep, reconcile pass, retry wait):
    /// stop now; a restart resumes from the checkpoint.
    #[error("shutting down")]
    Shutdown,
}

impl EngineError {
    pub(super) fn class(&self) -> ErrorClass {
        match self {
            EngineError::Etcd(e) => e.class(),
            EngineError::Fence(f) => f.class(),
            EngineError::Refused(_) => ErrorClass::Permanent,
            EngineError::RestartGenesis(_) | EngineError::Resync(_) => ErrorClass::Resync,
            EngineError::Reconnect(_) | EngineError::Paused | EngineError::Shutdown => ErrorClass::Transient,
        }
    }

    /// The command that clears the way, for the refusals that have one.
    pub(super) fn fix(&self) -> Option<String> {
        match self {
            EngineError::Refused(r) => r.fix(),
            _ => None,
        }
    }

    pub(super) fn reason(&self) -> Reason {
        match self {
            EngineError::Etcd(e) | EngineError::Fence(FenceError::Etcd(e)) => e.fault.into(),
            EngineError::Fence(f) => f.reason(),
            EngineError::Refused(r) => r.reason(),
            EngineError::RestartGenesis(r) => r.reason(),
            EngineError::Resync(r) => r.reason(),
            EngineError::Reconnect(r) => r.reason(),
            EngineError::Paused => Reason::Paused,
            EngineError::Shutdown => Reason::Shutdown,
        }
    }
}

impl From<mirror_watch::Overflow> for EngineError {
    fn from(_: mirror_watch::Overflow) -> Self {
        EngineError::RestartGenesis(Restart::WatchBufferOverflow)
    }
}
