//! What the run loop does once a run of the link ended in an error: a pure function of the
//! error, so every case is a row of a table test; the loop only carries the decision out
//! (waits, status, phase). How long to wait before the next run is the retry policy's
//! ([`mirror_core::RetryPolicy`]), which has its own tests.

use mirror_core::{ConditionType, ErrorClass};
use mirror_fence::FenceError;

use super::{EngineError, ReconnectCause};

/// The next step after a failed run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Decision {
    /// Connect both sides again at once (no error to record); `fragments`: watch in fragments
    /// from now on (a response was over the decode limit).
    Reconnect { fragments: bool },
    /// Another writer legitimately holds the fence: cold standby (under HA, the term ends),
    /// with the `Fenced` condition's reason.
    StandBy(&'static str),
    /// A fresh genesis after the policy's wait: a restart of it (`forced` false: nothing lost)
    /// or a forced resync with prune (history is gone).
    FreshGenesis { reason: &'static str, forced: bool },
    /// No further writes: phase `failed`, raising `condition` (type, reason) when the error has
    /// one.
    Fail { condition: Option<(ConditionType, &'static str)> },
    /// Back off by the policy and resume from the checkpoint.
    Retry,
}

/// The decision for `err`.
pub(super) fn on_run_error(err: &EngineError) -> Decision {
    match err {
        EngineError::Reconnect(why) => {
            Decision::Reconnect { fragments: *why == ReconnectCause::WatchResponseTooLarge }
        }
        EngineError::Fence(f) if f.standby_reason().is_some() => {
            Decision::StandBy(f.standby_reason().unwrap_or("Fenced"))
        }
        EngineError::RestartGenesis(r) => Decision::FreshGenesis { reason: r.as_str(), forced: false },
        EngineError::Resync(r) => Decision::FreshGenesis { reason: r.as_str(), forced: true },
        EngineError::Etcd(e) if e.class() == ErrorClass::Resync => {
            Decision::FreshGenesis { reason: "SourceCompacted", forced: true }
        }
        err if err.class() == ErrorClass::Permanent => {
            let condition = match err {
                EngineError::Refused(refusal) => refusal.condition(),
                EngineError::Fence(FenceError::PrefixConflict { .. }) => {
                    Some((ConditionType::PrefixConflict, "PrefixConflict"))
                }
                _ => None,
            };
            Decision::Fail { condition }
        }
        _ => Decision::Retry,
    }
}

#[cfg(test)]
mod tests {
    use mirror_core::{ConditionType, EtcdError, Side};
    use mirror_fence::FenceError;

    use super::super::{EngineError, ReconnectCause, Refusal, Restart, ResyncCause};
    use super::{on_run_error, Decision};

    fn etcd(code: tonic::Code, message: &str) -> EngineError {
        let status = tonic::Status::new(code, message);
        EngineError::Etcd(EtcdError::new("test", Side::Target, etcd_client::Error::GRpcStatus(status)))
    }

    /// Every kind of error the engine ends a run with, and what follows it.
    #[test]
    fn every_error_has_its_decision() {
        use tonic::Code;
        let cases: Vec<(EngineError, Decision)> = vec![
            (
                EngineError::Reconnect(ReconnectCause::WatchResponseTooLarge),
                Decision::Reconnect { fragments: true },
            ),
            (
                EngineError::Reconnect(ReconnectCause::TlsFilesChanged),
                Decision::Reconnect { fragments: false },
            ),
            (
                EngineError::Fence(FenceError::FencedByNewerEpoch { stored: 3, ours: 2 }),
                Decision::StandBy("FencedByNewerEpoch"),
            ),
            (
                EngineError::Fence(FenceError::EpochRegressed { stored: 2, ours: 2, agent: "b".into() }),
                Decision::StandBy("EpochRegressed"),
            ),
            (EngineError::Fence(FenceError::CutOver), Decision::StandBy("TargetPromoted")),
            (
                EngineError::RestartGenesis(Restart::WatchBufferOverflow),
                Decision::FreshGenesis { reason: "WatchBufferOverflow", forced: false },
            ),
            (
                EngineError::Resync(ResyncCause::WatchCompacted),
                Decision::FreshGenesis { reason: "WatchCompacted", forced: true },
            ),
            (
                etcd(Code::OutOfRange, "etcdserver: mvcc: required revision has been compacted"),
                Decision::FreshGenesis { reason: "SourceCompacted", forced: true },
            ),
            (etcd(Code::Unavailable, "etcdserver: no leader"), Decision::Retry),
            (etcd(Code::ResourceExhausted, "etcdserver: too many requests"), Decision::Retry),
            (etcd(Code::ResourceExhausted, "etcdserver: mvcc: database space exceeded"), Decision::Retry),
            (EngineError::Fence(FenceError::Raced), Decision::Retry),
            (
                etcd(Code::PermissionDenied, "etcdserver: permission denied"),
                Decision::Fail { condition: None },
            ),
            (
                EngineError::Refused(Refusal::SourceWentBack { watermark: 9, source_revision: 5 }),
                Decision::Fail { condition: Some((ConditionType::SourceWentBack, "BelowWatermark")) },
            ),
            (
                EngineError::Fence(FenceError::PrefixConflict { stored: "x".into(), ours: "y".into() }),
                Decision::Fail { condition: Some((ConditionType::PrefixConflict, "PrefixConflict")) },
            ),
            (EngineError::Fence(FenceError::FenceLost), Decision::Fail { condition: None }),
        ];
        for (err, want) in cases {
            assert_eq!(on_run_error(&err), want, "{err}");
        }
    }
}
