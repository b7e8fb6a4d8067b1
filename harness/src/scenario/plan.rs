//! A failback plan file (`mirror-agent failback-plan`) read back and held against the journal
//! of what the scenario wrote.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context as _};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use mirror_core::KeyRewriter;
use mirror_watch::Written;
use serde::Deserialize;

use super::sides::{key, Journal};

/// The plan's header line (the fields checked here).
#[derive(Debug, Deserialize)]
struct Header {
    failback_plan: u32,
    promoted_watermark: i64,
    to_revision: i64,
    listed_from: String,
    deletes_listed: bool,
    puts: u64,
    deletes: u64,
}

/// One line after the header.
#[derive(Debug, Deserialize)]
struct Line {
    op: String,
    key: String,
    #[serde(default)]
    value: Option<String>,
    mod_revision: i64,
}

/// A plan file, decoded.
pub(in crate::scenario) struct Plan {
    pub listed_from: String,
    watermark: i64,
    to_revision: i64,
    deletes_listed: bool,
    writes: Vec<Written>,
}

impl Plan {
    /// Reads and checks the file: a header, then lines whose counts agree with it.
    pub fn read(path: &Path) -> anyhow::Result<Plan> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut lines = text.lines();
        let header: Header =
            serde_json::from_str(lines.next().unwrap_or_default()).context("the plan's header")?;
        anyhow::ensure!(header.failback_plan == 1, "plan version {}", header.failback_plan);
        let mut writes = Vec::new();
        for (i, line) in lines.enumerate() {
            let l: Line = serde_json::from_str(line).with_context(|| format!("plan line {}", i + 2))?;
            let key = B64.decode(&l.key).with_context(|| format!("plan line {}: key", i + 2))?;
            writes.push(match (l.op.as_str(), l.value) {
                ("put", Some(v)) => Written::Put {
                    key,
                    value: B64.decode(v).with_context(|| format!("plan line {}: value", i + 2))?,
                    revision: l.mod_revision,
                    lease: 0,
                },
                ("delete", None) => Written::Delete { key, revision: l.mod_revision },
                (op, _) => bail!("plan line {}: op {op:?} with or without a value", i + 2),
            });
        }
        let puts = writes.iter().filter(|w| matches!(w, Written::Put { .. })).count() as u64;
        anyhow::ensure!(
            (puts, writes.len() as u64 - puts) == (header.puts, header.deletes),
            "the header counts {} puts and {} deletes, the lines {puts} and {}",
            header.puts,
            header.deletes,
            writes.len() as u64 - puts
        );
        Ok(Plan {
            listed_from: header.listed_from,
            watermark: header.promoted_watermark,
            to_revision: header.to_revision,
            deletes_listed: header.deletes_listed,
            writes,
        })
    }

    pub fn puts(&self) -> usize {
        self.writes.iter().filter(|w| matches!(w, Written::Put { .. })).count()
    }

    pub fn deletes(&self) -> usize {
        self.writes.len() - self.puts()
    }

    /// The plan lists exactly the journal's writes in `(watermark, to_revision]` of the keys
    /// the reverse link owns (`rewriter`: not excluded, not reserved): all of them in revision
    /// order from the history; from the keys, the puts still standing.
    pub fn matches(
        &self,
        journal: &Journal,
        rewriter: &KeyRewriter,
        watermark: i64,
        listed_from: &str,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(self.watermark == watermark, "the plan is at watermark {}", self.watermark);
        anyhow::ensure!(
            self.listed_from == listed_from,
            "the plan listed from {:?}, expected {listed_from:?}",
            self.listed_from
        );
        anyhow::ensure!(
            self.deletes_listed == (listed_from == "history"),
            "deletes_listed is {} for a plan from {listed_from}",
            self.deletes_listed
        );
        let mut wrote = journal.between(watermark, self.to_revision);
        wrote.retain(|w| rewriter.to_source(key(w)).is_some());
        let want: Vec<Written> = if listed_from == "history" {
            wrote
        } else {
            // The last write of each key, if it is a put.
            let mut last: BTreeMap<Vec<u8>, Written> = BTreeMap::new();
            for w in wrote {
                last.insert(key(&w).to_vec(), w);
            }
            last.into_values().filter(|w| matches!(w, Written::Put { .. })).collect()
        };
        let mut got = self.writes.clone();
        if listed_from == "history" {
            got.sort_by(|a, b| (a.revision(), key(a)).cmp(&(b.revision(), key(b))));
        } else {
            got.sort_by(|a, b| key(a).cmp(key(b)));
        }
        if got != want {
            let show = |ws: &[Written]| {
                ws.iter()
                    .take(20)
                    .map(|w| match w {
                        Written::Put { key, revision, .. } => {
                            format!("put {} @{revision}", String::from_utf8_lossy(key))
                        }
                        Written::Delete { key, revision } => {
                            format!("delete {} @{revision}", String::from_utf8_lossy(key))
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            bail!(
                "the plan lists {} writes, the journal holds {} in ({watermark}, {}]:\n  plan:    {}\n  journal: {}",
                got.len(),
                want.len(),
                self.to_revision,
                show(&got),
                show(&want)
            );
        }
        anyhow::ensure!(
            !want.is_empty(),
            "the journal holds no write after the watermark: the check proves nothing"
        );
        Ok(())
    }
}
