//! Steps on the fault proxies between the agents and a side: `partition`, `heal`, `delay`.
//! Container agents bypass the proxies, so a file with container agents refuses them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{SideName, Step};
use crate::scenario::world::World;

/// Blackholes the network between the agents and a side.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Partition {
    /// Which side.
    pub side: SideName,
}

#[async_trait::async_trait]
#[typetag::serde(name = "partition")]
impl Step for Partition {
    fn acts_on_proxies(&self) -> bool {
        true
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        world.proxies(self.side).cut();
        Ok(String::new())
    }
}

/// Ends a partition and a delay.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Heal {
    /// Which side.
    pub side: SideName,
}

#[async_trait::async_trait]
#[typetag::serde(name = "heal")]
impl Step for Heal {
    fn acts_on_proxies(&self) -> bool {
        true
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        world.proxies(self.side).heal();
        Ok(String::new())
    }
}

/// Delays every chunk between the agents and a side by `ms`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Delay {
    /// Which side.
    pub side: SideName,
    /// Milliseconds.
    pub ms: u64,
}

#[async_trait::async_trait]
#[typetag::serde(name = "delay")]
impl Step for Delay {
    fn acts_on_proxies(&self) -> bool {
        true
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        world.proxies(self.side).delay(Duration::from_millis(self.ms));
        Ok(String::new())
    }
}
