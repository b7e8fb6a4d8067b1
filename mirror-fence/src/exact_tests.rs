use mirror_core::{Change, ExactRevision};
use rstest::rstest;

use super::*;

const KEY: &[u8] = b"\0etcd-mirror/k8s-dr/checkpoint";

fn fence() -> ExactFence {
    ExactFence::new(KEY.to_vec(), 100)
}

fn put(key: &str, version: i64, create_revision: i64) -> Change {
    Change::Put { key: key.into(), value: b"v".to_vec(), lease: 0, version, create_revision, prev_lease: 0 }
}

fn del(key: &str, prev: Option<i64>) -> Change {
    Change::Delete { key: key.into(), prev_mod_revision: prev, prev_lease: 0 }
}

fn rev(revision: i64, changes: Vec<Change>) -> ExactRevision {
    ExactRevision { revision, changes }
}

/// The first Txn after the seed finds the checkpoint absent; every later one finds it put by
/// its predecessor (mod revision R-1, version R-1-R0), both known before R-1 lands.
#[test]
fn the_fence_compares_what_the_predecessor_leaves() {
    let first = fence().txn(&rev(101, vec![]), b"r".to_vec(), Vec::new(), 128).unwrap();
    assert_eq!(first.guards, [Guard::Version(KEY.to_vec(), 0)]);
    let later = fence().txn(&rev(105, vec![]), b"r".to_vec(), Vec::new(), 128).unwrap();
    assert_eq!(later.guards, [Guard::ModRevision(KEY.to_vec(), 104), Guard::Version(KEY.to_vec(), 4)]);
    assert_eq!(ExactFence::from_stamp(KEY.to_vec(), fence().stamp_after(104)), fence());
}

/// Each key is compared with the source's view before R: a created key is absent, an updated
/// one has the version before and the same create revision, a deleted one its prev_kv's mod
/// revision.
#[test]
fn every_key_is_compared_with_the_source_before_the_revision() {
    let t = fence()
        .txn(
            &rev(101, vec![put("/a", 1, 101), put("/b", 3, 90), del("/c", Some(95))]),
            b"r".to_vec(),
            Vec::new(),
            128,
        )
        .unwrap();
    assert_eq!(
        t.guards[1..],
        [
            Guard::Version(b"/a".to_vec(), 0),
            Guard::Version(b"/b".to_vec(), 2),
            Guard::CreateRevision(b"/b".to_vec(), 90),
            Guard::ModRevision(b"/c".to_vec(), 95),
        ]
    );
}

/// Where the compares do not fit one level, or a delete's prior state is unknown, one range
/// compare over the whole keyspace stands for them; the ops nest, the checkpoint put last.
#[rstest]
#[case::too_many_compares(vec![put("/a", 2, 1), put("/b", 2, 1), put("/c", 2, 1)], 6)]
#[case::delete_without_prev_kv(vec![del("/a", None)], 128)]
fn a_revision_without_room_for_its_compares_is_guarded_by_the_keyspace(
    #[case] changes: Vec<Change>,
    #[case] per_level: usize,
) {
    let t = fence().txn(&rev(110, changes), b"r".to_vec(), Vec::new(), per_level).unwrap();
    assert_eq!(t.guards.last(), Some(&Guard::NothingSince(110)));
    assert_eq!(t.guards.len(), 3, "the fence's two and the keyspace's one: {:?}", t.guards);
}

#[rstest]
#[case::landed(Answer::Succeeded { revision: 110 }, Landing::Landed)]
#[case::already(Answer::Failed { checkpoint: Stamp { mod_revision: 110, version: 10 } }, Landing::AlreadyLanded)]
#[case::overtaken(Answer::Failed { checkpoint: Stamp { mod_revision: 108, version: 8 } }, Landing::Overtaken)]
#[case::behind(Answer::Failed { checkpoint: Stamp { mod_revision: 115, version: 15 } }, Landing::Behind { at: 115 })]
fn the_judge_tells_a_landing_a_reorder_and_another_replica(#[case] answer: Answer, #[case] landing: Landing) {
    assert_eq!(fence().judge(110, &answer), landing);
}

/// Everything else is another writer: a Txn landing at another revision, a checkpoint no Txn
/// of this seed gives (deleted and put again), a key guard failing with the fence in place.
#[rstest]
#[case::landed_elsewhere(Answer::Succeeded { revision: 111 }, "landed as target revision 111")]
#[case::checkpoint_rewritten(Answer::Failed { checkpoint: Stamp { mod_revision: 109, version: 1 } }, "another writer put it")]
#[case::key_changed(Answer::Failed { checkpoint: Stamp { mod_revision: 109, version: 9 } }, "another writer changed it")]
#[case::first_key_changed(Answer::Failed { checkpoint: Stamp { mod_revision: 0, version: 0 } }, "another writer changed it")]
fn anything_else_is_a_foreign_write(#[case] answer: Answer, #[case] says: &str) {
    let revision = if answer == (Answer::Failed { checkpoint: Stamp { mod_revision: 0, version: 0 } }) {
        101
    } else {
        110
    };
    match fence().judge(revision, &answer) {
        Landing::Foreign(why) => assert!(why.contains(says), "{why}"),
        other => panic!("{answer:?} judged {other:?}"),
    }
}

/// Before its first Txn an absent checkpoint is no foreign write: later Txns sent early wait.
#[test]
fn an_absent_checkpoint_means_the_first_txn_is_still_to_land() {
    let absent = Answer::Failed { checkpoint: Stamp { mod_revision: 0, version: 0 } };
    assert_eq!(fence().judge(103, &absent), Landing::Overtaken);
}
