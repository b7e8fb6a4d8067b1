//! Words every part of a scenario shares: which side, which member, which signal, and the
//! clients of both sides a step that only writes is given.

use std::sync::{Arc, RwLock};

use anyhow::bail;
use etcd_client::Client;
use mirror_watch::Written;
use serde::{Deserialize, Serialize};

/// Both sides of the link, for a step that only talks to the clusters.
pub struct Sides {
    /// A client of the source.
    pub source: Client,
    /// A client of the target.
    pub target: Client,
    /// `source.prefix`.
    pub source_prefix: String,
    /// `target.prefix`.
    pub target_prefix: String,
    /// The link's checkpoint key in the target.
    pub checkpoint: Vec<u8>,
    /// What the steps wrote to the source.
    pub journal: Journal,
}

/// What the scenario's own `put`, `del` and `txn` steps wrote to the source, each key with the
/// revision etcd gave it (a `del` of a prefix: every key it deleted). `load`, `churn`,
/// `revoke` and lease expiry are not recorded: a check against the journal (the failback plan)
/// is exact only over a window in which the source took no other writes.
#[derive(Clone, Debug, Default)]
pub struct Journal(Arc<RwLock<Vec<Written>>>);

impl Journal {
    /// Records writes of the source.
    pub fn record(&self, writes: impl IntoIterator<Item = Written>) {
        self.0.write().expect("journal lock").extend(writes);
    }

    /// Every recorded write with a revision in `(after, upto]`, in revision order (and key
    /// order within a revision).
    pub fn between(&self, after: i64, upto: i64) -> Vec<Written> {
        let mut writes: Vec<Written> = self
            .0
            .read()
            .expect("journal lock")
            .iter()
            .filter(|w| w.revision() > after && w.revision() <= upto)
            .cloned()
            .collect();
        writes.sort_by(|a, b| (a.revision(), key(a)).cmp(&(b.revision(), key(b))));
        writes
    }
}

/// The key a write wrote.
pub fn key(w: &Written) -> &[u8] {
    match w {
        Written::Put { key, .. } | Written::Delete { key, .. } => key,
    }
}

impl Sides {
    /// The client of `side` and its prefix.
    pub fn of(&mut self, side: SideName) -> (&mut Client, &str) {
        match side {
            SideName::Source => (&mut self.source, &self.source_prefix),
            SideName::Target => (&mut self.target, &self.target_prefix),
        }
    }
}

/// Which side of the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SideName {
    /// The source cluster.
    Source,
    /// The target cluster.
    Target,
}

/// A member: its index, or `"leader"`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum MemberRef {
    /// By index, from 0.
    Index(usize),
    /// `"leader"`: whichever member leads when the step runs.
    Named(String),
}

impl MemberRef {
    /// The leader, whichever member it is when the step runs.
    pub fn leader() -> MemberRef {
        MemberRef::Named("leader".into())
    }

    pub(in crate::scenario) fn check(&self) -> anyhow::Result<()> {
        match self {
            MemberRef::Named(n) if n != "leader" => bail!("member: {n:?} (an index or \"leader\")"),
            _ => Ok(()),
        }
    }
}

/// A signal for `stop_agent`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum Signal {
    /// SIGTERM, then wait for the exit code.
    #[default]
    #[serde(rename = "TERM")]
    Term,
    /// SIGKILL.
    #[serde(rename = "KILL")]
    Kill,
    /// SIGSTOP: frozen, not stopped.
    #[serde(rename = "STOP")]
    Stop,
    /// SIGCONT.
    #[serde(rename = "CONT")]
    Cont,
}

/// `compact`'s revision: `"current"` or a number.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum RevisionRef {
    /// A revision number.
    At(i64),
    /// `"current"`.
    Named(String),
}
