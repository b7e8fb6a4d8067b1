//! The exact replica's periodic pass (`reconcile.interval`): both sides read at the last
//! revision landed and compared key by key, nothing written. The fence catches every write to
//! the target; the pass catches a replica at the source's revision number without its content.

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use harness::exact::{exact_config, seed};
use harness::scenario::{current_revision, SYNC_TIMEOUT};
use harness::{load_keys, AgentProcess, Churn, EtcdVersion};
use mirror_core::{ConditionType, Phase, Reason, Status};

use super::{assert_exact, cluster};

fn held(s: &Status, condition: ConditionType) -> Option<bool> {
    s.conditions.iter().find(|c| c.type_ == condition).map(|c| c.status)
}

fn synced(s: &Status) -> Option<(bool, Reason)> {
    let c = s.conditions.iter().find(|c| c.type_ == ConditionType::InitialSyncComplete)?;
    Some((c.status, c.reason))
}

/// A clean replica passes (every key equal, `InvariantsHeld` True, the drift gauge 0); one
/// whose target took another write under a checkpoint forged to match (the target at the
/// source's revision number, its content not the source's: what no fence can see) is found by
/// the next pass, each kind counted, and the link goes on writing nothing it should not.
/// `InitialSyncComplete` is True from the proven seed (`Complete`) and from a resumed
/// checkpoint (`Resumed`), as the runbook's "wait for it before failing over" needs.
#[tokio::test]
async fn the_periodic_pass_finds_a_replica_that_differs_at_the_same_revision() {
    let source = cluster(EtcdVersion::V3_5_30).await;
    let mut target = cluster(EtcdVersion::V3_5_30).await;
    let mut src = source.client().await.unwrap();
    load_keys(&mut src, "/registry/pods/", 50, 16).await.unwrap();
    seed(&source, &mut target, "seed").await.unwrap();
    let cfg = exact_config(&source, &target, "k8s-dr").overlay("[reconcile]\ninterval = \"2s\"");
    let mut agent = AgentProcess::start(&cfg).await.unwrap();
    let mut dst = target.client().await.unwrap();
    Churn::new("/registry/configmaps/", 300, 300, 30).spawn(src.clone()).await.unwrap().unwrap();
    assert_exact(&agent, &mut src, &mut dst, "after the churn").await;
    let keys = src.get("/registry/", Some(etcd_client::GetOptions::new().with_prefix().with_count_only()));
    let keys = keys.await.unwrap().count() as u64;
    let clean = agent
        .wait_for("a clean pass over every key", SYNC_TIMEOUT, |s| {
            s.last_reconcile.as_ref().is_some_and(|r| r.keys_compared == keys)
                && held(s, ConditionType::InvariantsHeld) == Some(true)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    let last = clean.last_reconcile.clone().expect("checked");
    assert_eq!((last.missing, last.divergent, last.orphan, last.repaired), (0, 0, 0, 0));
    assert_eq!(held(&clean, ConditionType::DriftDetected), Some(false));
    assert_eq!((clean.source_keys, clean.target_keys), (Some(keys), Some(keys)));
    assert_eq!(synced(&clean), Some((true, Reason::Complete)));
    assert!(clean.initial_sync.completed.is_some());
    let metrics = agent.metrics().await.unwrap();
    assert_eq!(metrics.sample("etcd_mirror_initial_sync_complete"), Some(1.0), "{}", metrics.text());
    assert_eq!(metrics.sample("etcd_mirror_drift_keys{kind=\"divergent\"}"), Some(0.0), "{}", metrics.text());
    assert!(metrics.sample("etcd_mirror_last_reconcile_timestamp_seconds").is_some_and(|t| t > 0.0));

    // Agent down; the target takes a value the source never had together with a checkpoint
    // record claiming the next source revision, which the source then takes elsewhere: both
    // sides at the same revision, the record at its own, and the key-by-key content apart.
    agent.terminate().await.unwrap();
    let key = cfg.parsed().unwrap().checkpoint_key();
    let got = dst.get(key.clone(), None).await.unwrap();
    let kv = got.kvs().first().expect("the link's checkpoint").clone();
    let mut record = mirror_fence::Checkpoint::decode(kv.value()).unwrap();
    let first = src.get("/registry/pods/", Some(etcd_client::GetOptions::new().with_prefix().with_limit(1)));
    let pod = first.await.unwrap().kvs()[0].key().to_vec();
    record.watermark += 1;
    let forged = Txn::new()
        .when([Compare::mod_revision(key.clone(), CompareOp::Equal, kv.mod_revision())])
        .and_then([
            TxnOp::put(pod.clone(), "not the source's", None),
            TxnOp::put(key.clone(), record.encode().unwrap(), None),
        ]);
    assert!(dst.txn(forged).await.unwrap().succeeded());
    src.put("/registry/pods/only-in-the-source", "1", None).await.unwrap();
    assert_eq!(current_revision(&mut src).await.unwrap(), current_revision(&mut dst).await.unwrap());

    agent.restart().await.unwrap();
    let drifted = agent
        .wait_for("the pass to find the drift", SYNC_TIMEOUT, |s| {
            held(s, ConditionType::DriftDetected) == Some(true)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    let last = drifted.last_reconcile.clone().expect("a pass");
    assert_eq!((last.missing, last.divergent, last.orphan, last.repaired), (1, 1, 0, 0), "{last:?}");
    assert_eq!(held(&drifted, ConditionType::InvariantsHeld), Some(false));
    assert_eq!(synced(&drifted), Some((true, Reason::Resumed)));
    let said = &drifted.conditions.iter().find(|c| c.type_ == ConditionType::DriftDetected).unwrap().message;
    assert!(said.contains("differs in value") && said.contains("only in the source"), "{said}");
    assert!(agent.log().contains("differs from its source at the same revision"), "{}", agent.log());
    let metrics = agent.metrics().await.unwrap();
    assert_eq!(metrics.sample("etcd_mirror_drift_keys{kind=\"divergent\"}"), Some(1.0), "{}", metrics.text());
    // Only read: the value the source never had is still there, and the link goes on.
    let kept = dst.get(pod, None).await.unwrap();
    assert_eq!(kept.kvs()[0].value(), b"not the source's");
    src.put("/registry/pods/after", "1", None).await.unwrap();
    let head = current_revision(&mut src).await.unwrap();
    agent.wait_for("the next revision landed", SYNC_TIMEOUT, |s| s.watermark == head).await.unwrap();
    assert_eq!(agent.status().await.unwrap().phase, Phase::Syncing);
}
