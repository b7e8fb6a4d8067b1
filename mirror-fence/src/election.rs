//! HA leader election on the target (SPEC §6, HA): several agents of one link campaign for a
//! lease-backed key under `R + "election/"` with etcd's election service.
//!
//! ## What the election decides, and what it does not
//! The election only decides *who tries* to write. The checkpoint fence still decides who
//! *does*: the leader's epoch is max(configured epoch, the create revision of its election key),
//! and every election key is created after the keys of all earlier leaders, so each new leader
//! claims the fence with a higher epoch than the last. A paused old leader whose lease expired
//! can therefore never land a write after the new leader's first commit: its Txns compare the
//! checkpoint's mod revision, which the new leader's claim moved.
//!
//! ## A cutover in progress
//! `cutover --wait` claims the fence with the stored epoch + 1 but does not campaign. The HA
//! leader it fences resigns and campaigns again, and its next election key is newer than the
//! cutover's epoch, so without more it would claim the fence back while the cutover drains
//! (seen on 3.5.30: the cutover ended `not cut over (phase standby)`). So a cutover of an HA
//! link first holds [`cutover_key`] under a lease of its own ([`hold_cutover`]), kept alive while
//! it drains, verifies and promotes; an elected agent that finds the key held
//! ([`cutover_holder`]) resigns and waits until it is gone, and only then campaigns again (by
//! then the target is promoted, and the claim stands it by with `TargetPromoted`). A cutover that
//! dies lets its lease expire, and the replicas carry on.
//!
//! ## Losing the lease
//! [`Leadership::lost`] resolves as soon as a keep-alive answer says the lease is gone, or no
//! keep-alive has been answered for a whole TTL (the lease may have expired unseen), so the
//! agent stops writing at once instead of at its next compare failure.

use std::time::Duration;

use etcd_client::Client;
use mirror_core::{unary, EtcdError, Side};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// This agent leads the election.
pub struct Leadership {
    /// The lease that keeps the election key alive.
    pub lease_id: i64,
    /// The create revision of our election key: the floor of this term's epoch.
    pub revision: i64,
    lost: watch::Receiver<bool>,
    keeper: JoinHandle<()>,
    client: Client,
}

impl Leadership {
    /// Resolves once the lease is gone or cannot be confirmed for a whole TTL.
    pub async fn lost(&mut self) {
        let _ = self.lost.wait_for(|lost| *lost).await;
    }

    /// Whether the lease is known lost.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Gives the election up (revokes the lease, which deletes the key) so a standby takes over
    /// at once, not after the TTL.
    pub async fn resign(mut self, timeout: Duration) {
        self.keeper.abort();
        let _ =
            unary("resign election", Side::Target, timeout, self.client.lease_revoke(self.lease_id)).await;
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// The election key prefix of a link whose reserved namespace is `reserved`.
pub fn election_name(reserved: &[u8]) -> Vec<u8> {
    [reserved, b"election/"].concat()
}

/// Grants a lease of `ttl`, keeps it alive, and campaigns with `value` (the agent id) until
/// elected. Cancel by dropping the future (the lease then expires by itself).
pub async fn campaign(
    client: &Client,
    name: &[u8],
    value: &str,
    ttl: Duration,
    timeout: Duration,
) -> Result<Leadership, EtcdError> {
    let (lease_id, lost, keeper) = kept_lease(client, "grant election lease", ttl, timeout).await?;
    let mut election = client.election_client();
    let mut watching = lost.clone();
    let elected = tokio::select! {
        r = election.campaign(name.to_vec(), value.as_bytes().to_vec(), lease_id) => r,
        _ = watching.wait_for(|l| *l) => {
            keeper.abort();
            return Err(unavailable("campaign", "the election lease was lost while campaigning"));
        }
    };
    let resp = match elected {
        Ok(r) => r,
        Err(e) => {
            keeper.abort();
            return Err(EtcdError::new("campaign", Side::Target, e));
        }
    };
    let revision = resp.leader().map_or(0, |l| l.rev());
    Ok(Leadership { lease_id, revision, lost, keeper, client: client.clone() })
}

/// The key a running `cutover --wait` of the link holds: `R + "cutover"`.
pub fn cutover_key(reserved: &[u8]) -> Vec<u8> {
    [reserved, b"cutover"].concat()
}

/// [`cutover_key`], held under a kept-alive lease until [`CutoverHold::release`] (or until this
/// process dies and the lease expires).
pub struct CutoverHold {
    lease_id: i64,
    keeper: JoinHandle<()>,
    client: Client,
}

impl CutoverHold {
    /// Deletes the key (revokes its lease) so the HA replicas campaign again.
    pub async fn release(mut self, timeout: Duration) {
        self.keeper.abort();
        let _ = unary("release cutover key", Side::Target, timeout, self.client.lease_revoke(self.lease_id))
            .await;
    }
}

impl Drop for CutoverHold {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// Holds [`cutover_key`] of the link whose reserved namespace is `reserved`, with `value` (the
/// cutover's agent id), under a lease of `ttl` kept alive in the background.
pub async fn hold_cutover(
    client: &Client,
    reserved: &[u8],
    value: &str,
    ttl: Duration,
    timeout: Duration,
) -> Result<CutoverHold, EtcdError> {
    let (lease_id, _, keeper) = kept_lease(client, "grant cutover lease", ttl, timeout).await?;
    let hold = CutoverHold { lease_id, keeper, client: client.clone() };
    let mut c = client.clone();
    let put = c.put(
        cutover_key(reserved),
        value.as_bytes().to_vec(),
        Some(etcd_client::PutOptions::new().with_lease(lease_id)),
    );
    match unary("hold cutover key", Side::Target, timeout, put).await {
        Ok(_) => Ok(hold),
        Err(e) => {
            hold.release(timeout).await;
            Err(e)
        }
    }
}

/// Who holds [`cutover_key`], if anyone: a cutover of the link is draining.
pub async fn cutover_holder(
    client: &Client,
    reserved: &[u8],
    timeout: Duration,
) -> Result<Option<String>, EtcdError> {
    let mut c = client.clone();
    let resp = unary("read cutover key", Side::Target, timeout, c.get(cutover_key(reserved), None)).await?;
    Ok(resp.kvs().first().map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
}

/// The agent id of the current leader, if there is one.
pub async fn leader(client: &Client, name: &[u8], timeout: Duration) -> Result<Option<String>, EtcdError> {
    let mut election = client.election_client();
    match tokio::time::timeout(timeout, election.leader(name.to_vec())).await {
        Ok(Ok(resp)) => Ok(resp.kv().map(|kv| String::from_utf8_lossy(kv.value()).into_owned())),
        // etcd answers "election: no leader" as an error.
        Ok(Err(e)) if mirror_core::Fault::of(&e) == mirror_core::Fault::ElectionNoLeader => Ok(None),
        Ok(Err(e)) => Err(EtcdError::new("election leader", Side::Target, e)),
        Err(_) => Err(unavailable("election leader", "no answer in time")),
    }
}

/// A transient error with `message`.
fn unavailable(op: &'static str, message: &str) -> EtcdError {
    EtcdError::new(op, Side::Target, etcd_client::Error::GRpcStatus(tonic::Status::unavailable(message)))
}

/// Grants a lease of `ttl` (whole seconds, at least 2) and keeps it alive in the background:
/// its id, a flag that turns true once it is lost, and the keep-alive task.
async fn kept_lease(
    client: &Client,
    op: &'static str,
    ttl: Duration,
    timeout: Duration,
) -> Result<(i64, watch::Receiver<bool>, JoinHandle<()>), EtcdError> {
    let ttl_secs = ttl.as_secs().max(2) as i64;
    let lease = unary(op, Side::Target, timeout, client.clone().lease_grant(ttl_secs, None)).await?;
    let (lost_tx, lost) = watch::channel(false);
    let keeper = tokio::spawn(keep_alive(client.clone(), lease.id(), ttl, lost_tx));
    Ok((lease.id(), lost, keeper))
}

/// Keeps the lease alive every TTL/3; marks it lost on a TTL-0 answer or a TTL without a
/// confirmed renewal.
async fn keep_alive(client: Client, lease_id: i64, ttl: Duration, lost: watch::Sender<bool>) {
    let every = ttl / 3;
    let mut confirmed = tokio::time::Instant::now();
    let mut c = client;
    loop {
        let renewed = async {
            let (mut keeper, mut stream) = c.lease_keep_alive(lease_id).await.ok()?;
            loop {
                keeper.keep_alive().await.ok()?;
                let resp = tokio::time::timeout(every, stream.message()).await.ok()?.ok()??;
                if resp.ttl() <= 0 {
                    return Some(false);
                }
                let _ = lost.send_if_modified(|_| false);
                confirmed = tokio::time::Instant::now();
                tokio::time::sleep(every).await;
            }
        };
        let outcome = tokio::time::timeout(ttl, renewed).await;
        if matches!(outcome, Ok(Some(false))) || confirmed.elapsed() >= ttl {
            lost.send_replace(true);
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
