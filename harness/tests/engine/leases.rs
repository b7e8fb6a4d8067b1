//! Preserved leases: what the lease keeper does on its own task while the engine runs.

use harness::load_leased_keys;

use super::*;

/// An agent synced over 20 source keys under lease 0x77 under `prefix`, with leases preserved,
/// a keep-alive every second (`progress_interval`), `request_timeout` as given and the target
/// keep-alives `unanswered` names left without an answer (failpoint `UNANSWERED_KEEP_ALIVES`).
async fn leased_link(pair: &Pair, prefix: &str, request_timeout: &str, unanswered: &str) -> AgentProcess {
    let (mut src, _) = pair.clients().await;
    load_leased_keys(&mut src, prefix, 20, 16, Some((0x77, 1))).await.unwrap();
    let cfg = fast_progress(pair.config("keep-alive", prefix))
        .overlay(&format!("[sync]\nleases = \"preserve\"\nrequest_timeout = {request_timeout:?}"))
        .env("MIRROR_FAILPOINT_UNANSWERED_KEEP_ALIVES", unanswered);
    let agent = AgentProcess::start(&cfg).await.unwrap();
    synced(&agent).await;
    agent
}

/// A target keep-alive that gets no answer in time (as over a connection a network cut left
/// stale, the official CI's `leases-lapsed-on-target` failure) is the lease keeper's to retry:
/// the run goes on, the lease is kept alive by the retry, and nothing restarts. Before, the
/// first one ended the run; its restart re-read both ranges while leases with a TTL of a few
/// seconds ran out on the target and took their keys with them.
#[tokio::test]
async fn an_unanswered_keep_alive_is_retried_and_the_run_goes_on() {
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
    let agent = leased_link(&pair, "/kl/", "1s", "2").await;

    // Logged either way: as the keeper's retry, or as the error that ended the run.
    let unanswered = "lease keep-alive on target";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while agent.log().matches(unanswered).count() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "no keep-alive went unanswered:\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A few rounds after the failpoint is spent.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let status = agent.status().await.unwrap();
    assert_eq!(status.watch_restarts, 0, "the run restarted:\n{}", agent.log());
    assert!(status.last_error.is_none(), "the run ended: {:?}", status.last_error);
    assert_eq!(status.leases.preserved, 1);
    assert!(agent.log().contains("a lease round failed: retrying"));
    assert!(
        status.leases.keepalive_lag_seconds < 2.5,
        "the lease was not kept alive since: {} s",
        status.leases.keepalive_lag_seconds
    );
}

/// The keeper's round takes its lock only between its calls: a keep-alive waiting for its
/// answer (here the first, unanswered until `request_timeout`, 10 s) holds up no write. A put
/// made while it waits lands at once, before the round gives up on it. Before, every Txn took
/// the lock the round held through its calls, so the tail stood still for the whole timeout.
#[tokio::test]
async fn a_keep_alive_waiting_for_its_answer_holds_up_no_write() {
    let pair = Pair::start(EtcdVersion::V3_5_30, EtcdVersion::V3_5_30).await;
    let agent = leased_link(&pair, "/kw/", "10s", "1").await;
    let (mut src, mut dst) = pair.clients().await;
    // The first keep-alive (one or two seconds after the scan granted the lease: a round every
    // second, the lease due a second after its grant) is waiting now, until about 12 s.
    tokio::time::sleep(Duration::from_secs(4)).await;
    src.put("/kw/during", "1", None).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while dst.get("/kw/during", None).await.unwrap().count() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the put never landed:\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !agent.log().contains("lease keep-alive on target"),
        "the put landed only after the keep-alive gave up:\n{}",
        agent.log()
    );
}
