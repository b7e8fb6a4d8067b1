//! One answer of the target to an exact Txn, judged: landed (here or by another replica),
//! to send again, or a stop (a foreign write, a promoted target, a revision too large).

use mirror_core::{ErrorClass, EtcdError, ExactRevision, Reason};
use mirror_fence::{Answer, Landing};

use super::super::flight::Verdict;
use super::super::Stop;
use super::Tail;

/// One answer, judged.
#[derive(Debug)]
pub(super) struct Judged {
    pub verdict: Verdict,
    /// Landed by this agent's Txn.
    pub here: bool,
    /// The answer was lost (`Again`): the error, transient or "too many requests", that a wait
    /// goes before the Txn is sent again.
    pub lost: Option<EtcdError>,
}

impl Judged {
    fn answered(verdict: Verdict, here: bool) -> Result<Judged, Stop> {
        Ok(Judged { verdict, here, lost: None })
    }
}

impl Tail<'_> {
    /// One answer as a verdict. A foreign write or a promoted target stops the link.
    pub(super) fn verdict(
        &self,
        rev: &ExactRevision,
        answer: Result<etcd_client::TxnResponse, EtcdError>,
    ) -> Result<Judged, Stop> {
        let revision = rev.revision;
        let resp = match answer {
            Ok(resp) => resp,
            // The member that took it is unreachable (down, or the connection broke): sent again
            // on this client, a share of the Txns would go to it again. The run ends; the next
            // connects to the members that serve and goes on from the checkpoint (the fence
            // tells whether this Txn landed). A member that answers (a timeout) is resent to.
            Err(e) if e.is_unreachable() => return Err(e.into()),
            // A revision lands whole or not at all: one the target cannot take as one Txn never
            // will, whatever is retried.
            Err(e) if e.fault.is_txn_too_big() => return Err(too_big(rev, &e)),
            Err(e) if matches!(e.class(), ErrorClass::Transient | ErrorClass::Throttle) => {
                return Ok(Judged { verdict: Verdict::Again, here: false, lost: Some(e) });
            }
            Err(e) => return Err(e.into()),
        };
        match self.placed.fence.judge(revision, &Answer::of(&resp)) {
            Landing::Landed => Judged::answered(Verdict::Landed, true),
            // Landed before (a lost answer), or another replica landed it and maybe more.
            Landing::AlreadyLanded | Landing::Behind { .. } => Judged::answered(Verdict::Landed, false),
            Landing::Overtaken => Judged::answered(Verdict::Again, false),
            Landing::Foreign(why) => Err(Stop::lost(Reason::ForeignWrite, why)),
            Landing::Promoted => Err(Stop::lost(
                Reason::TargetPromoted,
                "the target was promoted (failover or cutover): this link writes it no more",
            )),
        }
    }
}

/// Txn `rev` refused by the target as too large (`--max-request-bytes`) or of too many ops
/// (`--max-txn-ops`). A revision etcd made itself (a lease running out, a range delete: one
/// small request, or none) can be larger than any request the source took, so the message
/// names the revision's size rather than pointing at the source's limits alone.
fn too_big(rev: &ExactRevision, e: &EtcdError) -> Stop {
    let bytes: usize = rev.changes.iter().map(mirror_core::Change::size).sum();
    Stop::lost(
        Reason::RevisionTooLarge,
        format!(
            "source revision {} ({} changes, about {} KiB of keys, values and ops) cannot land as one target Txn, \
             which exact mode needs: the target refused it ({}). A revision etcd makes itself (a lease running out, \
             a range delete) can be larger than any request the source took. Start the target with \
             --max-request-bytes above that size (32 MiB covers a lease of about 300 000 short keys running \
             out) and --max-txn-ops at least sync.max_txn_ops (or lower sync.max_txn_ops to it), and restart the \
             agent: it goes on from its checkpoint",
            rev.revision,
            rev.changes.len(),
            bytes.div_ceil(1024),
            e.said()
        ),
    )
}
