//! Steps on members and whole sides: `kill_member`, `stop_member`, `start_member`,
//! `pause_member`, `resume_member`, `compact`, `snapshot`, `restore`, `defrag`,
//! `alarm_disarm`.

use etcd_client::{AlarmAction, AlarmOptions, AlarmType, Client};
use serde::{Deserialize, Serialize};

use super::{MemberRef, RevisionRef, SideName, Sides, Step};
use crate::scenario::world::World;

/// SIGKILL a member.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KillMember {
    /// Which side.
    pub side: SideName,
    /// Which member.
    pub member: MemberRef,
}

#[async_trait::async_trait]
#[typetag::serde(name = "kill_member")]
impl Step for KillMember {
    fn check(&self) -> anyhow::Result<()> {
        self.member.check()
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let i = world.member(self.side, &self.member).await?;
        world.cluster(self.side).node(i).kill().await?;
        world.member_stopped(self.side, i).await?;
        Ok(format!("member {i}"))
    }
}

/// Stops a member cleanly.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StopMember {
    /// Which side.
    pub side: SideName,
    /// Which member.
    pub member: MemberRef,
}

#[async_trait::async_trait]
#[typetag::serde(name = "stop_member")]
impl Step for StopMember {
    fn check(&self) -> anyhow::Result<()> {
        self.member.check()
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let i = world.member(self.side, &self.member).await?;
        world.cluster(self.side).node(i).stop().await?;
        world.member_stopped(self.side, i).await?;
        Ok(format!("member {i}"))
    }
}

/// Starts a member, or every stopped member of the side.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StartMember {
    /// Which side.
    pub side: SideName,
    /// Which member (default: every stopped one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub member: Option<MemberRef>,
}

#[async_trait::async_trait]
#[typetag::serde(name = "start_member")]
impl Step for StartMember {
    fn check(&self) -> anyhow::Result<()> {
        self.member.as_ref().map_or(Ok(()), MemberRef::check)
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let which: Vec<usize> = match &self.member {
            Some(m) => vec![world.member(self.side, m).await?],
            None => world.stopped_members(self.side),
        };
        for &i in &which {
            world.cluster(self.side).node(i).start().await?;
            world.members.started(self.side, i);
        }
        world.members_changed(self.side).await?;
        Ok(format!("members {which:?}"))
    }
}

/// Freezes a member (docker pause or SIGSTOP).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PauseMember {
    /// Which side.
    pub side: SideName,
    /// Which member.
    pub member: MemberRef,
}

#[async_trait::async_trait]
#[typetag::serde(name = "pause_member")]
impl Step for PauseMember {
    fn check(&self) -> anyhow::Result<()> {
        self.member.check()
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let i = world.member(self.side, &self.member).await?;
        world.cluster(self.side).node(i).pause().await?;
        Ok(format!("member {i}"))
    }
}

/// Unfreezes a member.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ResumeMember {
    /// Which side.
    pub side: SideName,
    /// Which member.
    pub member: MemberRef,
}

#[async_trait::async_trait]
#[typetag::serde(name = "resume_member")]
impl Step for ResumeMember {
    fn check(&self) -> anyhow::Result<()> {
        self.member.check()
    }

    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let i = world.member(self.side, &self.member).await?;
        world.cluster(self.side).node(i).unpause().await?;
        Ok(format!("member {i}"))
    }
}

/// Compacts a side.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Compact {
    /// Which side.
    pub side: SideName,
    /// `"current"` (default) or a revision.
    #[serde(default = "current")]
    pub revision: RevisionRef,
    /// Revisions of history kept below `revision` (default 0: compact at it), as operators'
    /// compaction keeps a retention window. Compacting a busy source at its very head cancels
    /// any watcher etcd let fall a moment behind, however fast its client reads.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub keep: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

fn current() -> RevisionRef {
    RevisionRef::Named("current".into())
}

#[async_trait::async_trait]
#[typetag::serde(name = "compact")]
impl Step for Compact {
    fn check(&self) -> anyhow::Result<()> {
        match &self.revision {
            RevisionRef::Named(n) if n != "current" => {
                anyhow::bail!("revision: {n:?} (a number or \"current\")")
            }
            _ if self.keep < 0 => anyhow::bail!("keep: {} (revisions kept, 0 or more)", self.keep),
            _ => Ok(()),
        }
    }

    fn detachable(&self) -> bool {
        true
    }

    async fn run(&self, world: &mut World, seed: u64) -> anyhow::Result<String> {
        super::data::write(self, world, seed, None).await
    }

    async fn run_detached(&self, mut sides: Sides, _seed: u64) -> anyhow::Result<String> {
        let (client, _) = sides.of(self.side);
        let rev = match self.revision {
            RevisionRef::At(r) => r,
            RevisionRef::Named(_) => crate::scenario::current_revision(client).await?,
        };
        let rev = (rev - self.keep).max(1);
        client.compact(rev, None).await?;
        Ok(format!("at {rev}"))
    }
}

/// Saves a snapshot of a side (etcd's Maintenance Snapshot) under `name`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// Which side.
    pub side: SideName,
    /// Its name, for `restore`.
    pub name: String,
}

#[async_trait::async_trait]
#[typetag::serde(name = "snapshot")]
impl Step for Snapshot {
    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let bytes = world.cluster(self.side).save_snapshot(&self.name).await?;
        Ok(format!("{bytes} bytes"))
    }
}

/// Restores every member of a side from snapshot `name` (`etcdutl snapshot restore` with the
/// same names, token and peer URLs: the same cluster id, back at the snapshot's revision) and
/// starts them again. With `from`, the snapshot is the other side's: the target restored from
/// the source's, as an exact replica is seeded (SPEC §10).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Restore {
    /// Which side.
    pub side: SideName,
    /// A snapshot saved by `snapshot`.
    pub name: String,
    /// Extension: the side that saved it (default: `side` itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<SideName>,
}

#[async_trait::async_trait]
#[typetag::serde(name = "restore")]
impl Step for Restore {
    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        match self.from.filter(|from| *from != self.side) {
            Some(from) => {
                let file = world.cluster(from).snapshot_file(&self.name)?;
                world.cluster(self.side).restore_snapshot_file(&file).await?;
            }
            None => world.cluster(self.side).restore_snapshot(&self.name).await?,
        }
        for i in world.stopped_members(self.side) {
            world.members.started(self.side, i);
        }
        world.members_changed(self.side).await?;
        Ok(String::new())
    }
}

/// Defragments every running member of a side.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Defrag {
    /// Which side.
    pub side: SideName,
}

#[async_trait::async_trait]
#[typetag::serde(name = "defrag")]
impl Step for Defrag {
    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        let stopped = world.stopped_members(self.side);
        let endpoints: Vec<String> = (0..world.cluster(self.side).nodes().len())
            .filter(|i| !stopped.contains(i))
            .map(|i| world.cluster(self.side).node(i).endpoint())
            .collect();
        for endpoint in &endpoints {
            Client::connect([endpoint], None).await?.defragment().await?;
        }
        Ok(format!("{} members", endpoints.len()))
    }
}

/// Disarms a side's NOSPACE alarm.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AlarmDisarm {
    /// Which side.
    pub side: SideName,
}

#[async_trait::async_trait]
#[typetag::serde(name = "alarm_disarm")]
impl Step for AlarmDisarm {
    async fn run(&self, world: &mut World, _seed: u64) -> anyhow::Result<String> {
        // As `etcdctl alarm disarm` does: each raised alarm by its member id.
        let mut client = world.cluster(self.side).client().await?;
        let alarms = client.alarm(AlarmAction::Get, AlarmType::None, None).await?;
        for a in alarms.alarms() {
            let mut opts = AlarmOptions::new();
            opts.with_member(a.member_id());
            client.alarm(AlarmAction::Deactivate, AlarmType::Nospace, Some(opts)).await?;
        }
        Ok(format!("{} alarms", alarms.alarms().len()))
    }
}
