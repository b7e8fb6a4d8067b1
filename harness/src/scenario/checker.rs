//! The continuous G3 checker: while a scenario runs, G3 is checked every 300 ms (lease IDs
//! included where the agent preserves leases); a violation fails the run at the next step.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::Client;
use tokio::sync::RwLock;

use crate::{check_g3_leases, G3Violation, G3};

/// What the continuous G3 checker saw.
#[derive(Default)]
pub(in crate::scenario) struct CheckerState {
    pub enabled: AtomicBool,
    pub holds: AtomicU64,
    pub unreadable: AtomicU64,
    pub violations: RwLock<Vec<String>>,
}

/// Checks G3 every 300 ms while enabled, counting holds, unreadable sides and violations.
pub(in crate::scenario) async fn check_continuously(
    mut src: Client,
    mut dst: Client,
    rewriter: mirror_core::KeyRewriter,
    checkpoint_key: Vec<u8>,
    leases: bool,
    state: Arc<CheckerState>,
) {
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        if !state.enabled.load(Ordering::Relaxed) {
            continue;
        }
        let check = tokio::time::timeout(
            Duration::from_secs(20),
            check_g3_leases(&mut src, &mut dst, &rewriter, &checkpoint_key, leases),
        )
        .await;
        match check {
            Ok(Ok(G3::Holds { .. })) => drop(state.holds.fetch_add(1, Ordering::Relaxed)),
            Ok(Ok(G3::NotYet)) => {}
            Ok(Err(e)) if e.downcast_ref::<G3Violation>().is_some() => {
                state.violations.write().await.push(format!("{e:#}"))
            }
            Ok(Err(_)) | Err(_) => drop(state.unreadable.fetch_add(1, Ordering::Relaxed)),
        }
    }
}
