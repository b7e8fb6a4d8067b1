//! Steps that wait: `sleep`, and `wait` until a state (`until`, parsed into a typed value when
//! the file is read, so a typo fails the file, not the run).

use mirror_core::HumanDuration;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{agent_a, is_a, sixty, Step, Until};
use crate::scenario::world::World;

/// Sleeps.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Sleep {
    /// How long.
    #[serde(rename = "for")]
    pub for_: HumanDuration,
}

#[async_trait::async_trait]
#[typetag::serde(name = "sleep")]
impl Step for Sleep {
    fn detachable(&self) -> bool {
        true
    }

    async fn run(&self, _world: &mut World, _seed: u64) -> anyhow::Result<String> {
        tokio::time::sleep(self.for_.get()).await;
        Ok(String::new())
    }

    async fn run_detached(&self, _sides: super::Sides, _seed: u64) -> anyhow::Result<String> {
        tokio::time::sleep(self.for_.get()).await;
        Ok(String::new())
    }
}

/// Waits until `"phase:P"`, `"condition:TYPE=True|False"`, `"last_error:REASON"` (or `none`, `any`), `"equal"`,
/// `"caught_up"` or `"background"`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Wait {
    /// The state.
    pub until: Until,
    /// Fails after this.
    #[serde(default = "sixty")]
    pub timeout: HumanDuration,
    /// Agent id.
    #[serde(default = "agent_a", skip_serializing_if = "is_a")]
    pub agent: String,
}

#[async_trait::async_trait]
#[typetag::serde(name = "wait")]
impl Step for Wait {
    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let timeout = self.timeout.get();
        world
            .poll_until(&self.until, &self.agent, Instant::now() + timeout)
            .await
            .map_err(|why| anyhow::anyhow!("not reached within {timeout:?}: {why}"))?;
        // A log line is printed as found: it often carries a figure (e.g. the HA takeover's
        // `fence_after_election_ms`).
        if let Until::Log(text) = &self.until {
            let log = world.agent(&self.agent)?.process.log();
            return Ok(log.lines().find(|l| l.contains(text.as_str())).unwrap_or_default().trim().to_owned());
        }
        Ok(String::new())
    }
}
