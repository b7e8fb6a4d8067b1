//! The checkpoint record of SPEC §6: what the fence key holds, as JSON with `"v": 1`.
//!
//! Decoding fails closed: a record this agent does not fully understand must stop all writes
//! (G7), so every field is typed strictly and range-checked, and unknown fields are refused (a
//! newer writer would bump `v`). The error names the field. Every field is required except the
//! two added later within v1, `commit` and `range`, which records written before them lack
//! (and the optional ones after them, written only when set, `source_seen` the last):
//! such records still decode (with both empty), so an upgraded agent resumes an older link.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The only record version this code reads and writes.
pub const VERSION: u64 = 1;

/// Who the target belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A mirror of the source, written by the agent.
    Mirror,
    /// Cut over: the target is the primary now; no agent may write.
    Primary,
}

/// One checkpoint: the fence and the resume point of a link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    /// The link this record belongs to.
    pub link_uid: String,
    /// The epoch of the agent that wrote it (>= 1).
    pub epoch: u64,
    /// Mirror or cut-over primary.
    pub role: Role,
    /// Source revision the target range reflects (G3).
    pub watermark: i64,
    /// True while the initial scan is under way; the target is not yet a consistent prefix.
    pub scanning: bool,
    /// Last source key written by the scan; a restart resumes after it. Empty when not scanning.
    pub scan_cursor: Vec<u8>,
    /// A mark-and-sweep prune is owed (forced resync or `overwrite_and_prune`).
    pub prune_pending: bool,
    /// Cluster id of the source at the time of writing.
    pub source_cluster_id: u64,
    /// Cluster id of the target at the time of writing.
    pub target_cluster_id: u64,
    /// Free-form id of the writing agent (host/pid), for operators.
    pub agent_id: String,
    /// Unique per commit attempt (a per-process random nonce and a counter), so the ambiguous-
    /// commit rule ("the stored bytes are exactly what this attempt wrote") can never match
    /// another process's write, even one with the same host and pid (two pods of a StatefulSet).
    /// Empty in records written before it existed.
    pub commit: String,
    /// Fingerprint of the mirrored range (source prefix, destination prefix, excludes); a
    /// restart under another range forces a resync with prune. Empty when unknown (records
    /// written before it existed).
    pub range: String,
    /// When the source was last confirmed at or below `watermark` (RFC 3339, UTC): a trusted
    /// progress reply, the idle proof, or an apply that caught up with the source's header
    /// revision. What a failover would lose is at most what the source took since. Empty when
    /// never confirmed (records written before it existed, or a sync that has not caught up).
    pub confirmed_time: String,
    /// Forced resyncs of the link so far, kept so a restarted agent's status does not forget
    /// them. 0 in records written before it existed.
    pub forced_resyncs: u64,
    /// Genesis restarts (watch buffer overflow, compaction mid-scan) of the link so far. 0 in
    /// records written before it existed.
    pub scan_restarts: u64,
    /// When the last initial sync completed (RFC 3339, UTC). Empty while the first one runs,
    /// and in records written before it existed.
    pub initial_sync_completed: String,
    /// Destination prefixes this link never writes (its `exclude_prefixes`, mapped to the
    /// target), so a link nested under one of them can tell it does not overlap. Empty in
    /// records written before it existed and for links without excludes.
    pub excludes: Vec<Vec<u8>>,
    /// Exact mode (SPEC §10): the highest source revision the link had seen when it wrote the
    /// record (the watch's header revision), which clients of the source may have seen too;
    /// `failover` compacts the target past it. 0 in compact mode and in records before it.
    pub source_seen: i64,
}

/// Why a stored record was refused. Each variant names the field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not a JSON object.
    #[error("checkpoint is not a JSON object: {0}")]
    NotAnObject(String),
    /// A required field is absent.
    #[error("checkpoint field `{0}` is missing")]
    Missing(&'static str),
    /// A field has the wrong type or an out-of-range value.
    #[error("checkpoint field `{field}` is invalid: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A field this version does not know.
    #[error("checkpoint field `{0}` is unknown to record version 1")]
    Unknown(String),
}

const FIELDS: &[&str] = &[
    "v",
    "link_uid",
    "epoch",
    "role",
    "watermark",
    "scanning",
    "scan_cursor",
    "prune_pending",
    "source_cluster_id",
    "target_cluster_id",
    "agent_id",
    "commit",
    "range",
    "confirmed_time",
    "forced_resyncs",
    "scan_restarts",
    "initial_sync_completed",
    "excludes",
    "source_seen",
];

impl Checkpoint {
    /// The rules of a record beyond its JSON shape, which [`Checkpoint::decode`] refuses a
    /// stored record for breaking, so [`Checkpoint::encode`] never writes one that breaks them
    /// (every agent of the link, this one included, would then fail closed on it).
    pub fn check(&self) -> Result<(), DecodeError> {
        if self.link_uid.is_empty() {
            return Err(invalid("link_uid", "is empty"));
        }
        if self.epoch == 0 {
            return Err(invalid("epoch", "must be >= 1"));
        }
        if self.watermark < 0 {
            return Err(invalid("watermark", "must be a non-negative integer"));
        }
        if !self.scanning && !self.scan_cursor.is_empty() {
            return Err(invalid("scan_cursor", "is set although scanning is false"));
        }
        for (field, time) in [
            ("confirmed_time", &self.confirmed_time),
            ("initial_sync_completed", &self.initial_sync_completed),
        ] {
            check_time(field, time)?;
        }
        Ok(())
    }

    /// Encodes as compact JSON v1; refuses a record that breaks [`Checkpoint::check`].
    pub fn encode(&self) -> Result<Vec<u8>, DecodeError> {
        self.check()?;
        let mut value = serde_json::json!({
            "v": VERSION,
            "link_uid": self.link_uid,
            "epoch": self.epoch,
            "role": self.role,
            "watermark": self.watermark,
            "scanning": self.scanning,
            "scan_cursor": B64.encode(&self.scan_cursor),
            "prune_pending": self.prune_pending,
            "source_cluster_id": self.source_cluster_id.to_string(),
            "target_cluster_id": self.target_cluster_id.to_string(),
            "agent_id": self.agent_id,
            "commit": self.commit,
            "range": self.range,
        });
        // Fields added within v1 are written only when set, so a record that never needed
        // them reads the same to an agent that predates them.
        if !self.confirmed_time.is_empty() {
            value["confirmed_time"] = self.confirmed_time.clone().into();
        }
        if self.forced_resyncs > 0 {
            value["forced_resyncs"] = self.forced_resyncs.into();
        }
        if self.scan_restarts > 0 {
            value["scan_restarts"] = self.scan_restarts.into();
        }
        if !self.initial_sync_completed.is_empty() {
            value["initial_sync_completed"] = self.initial_sync_completed.clone().into();
        }
        if !self.excludes.is_empty() {
            value["excludes"] = self.excludes.iter().map(|p| Value::from(B64.encode(p))).collect();
        }
        if self.source_seen > 0 {
            value["source_seen"] = self.source_seen.into();
        }
        Ok(serde_json::to_vec(&value).expect("a JSON value always serialises"))
    }

    /// Decodes a stored record, refusing anything not exactly v1.
    pub fn decode(bytes: &[u8]) -> Result<Checkpoint, DecodeError> {
        let value: Value =
            serde_json::from_slice(bytes).map_err(|e| DecodeError::NotAnObject(e.to_string()))?;
        let Value::Object(map) = value else {
            return Err(DecodeError::NotAnObject("top level is not an object".into()));
        };
        if let Some(unknown) = map.keys().find(|k| !FIELDS.contains(&k.as_str())) {
            return Err(DecodeError::Unknown(unknown.clone()));
        }
        let r = Reader(&map);
        let v = r.u64("v")?;
        if v != VERSION {
            return Err(invalid("v", format!("version {v} is not supported (this agent reads {VERSION})")));
        }
        let link_uid = r.str("link_uid")?;
        let epoch = r.u64("epoch")?;
        let role = match r.str("role")?.as_str() {
            "mirror" => Role::Mirror,
            "primary" => Role::Primary,
            other => return Err(invalid("role", format!("{other:?} is neither \"mirror\" nor \"primary\""))),
        };
        let watermark = i64::try_from(r.u64("watermark")?)
            .map_err(|_| invalid("watermark", "exceeds the revision range"))?;
        let scanning = r.bool("scanning")?;
        let scan_cursor = B64
            .decode(r.str("scan_cursor")?)
            .map_err(|e| invalid("scan_cursor", format!("not base64: {e}")))?;
        let record = Checkpoint {
            link_uid,
            epoch,
            role,
            watermark,
            scanning,
            scan_cursor,
            prune_pending: r.bool("prune_pending")?,
            source_cluster_id: r.decimal("source_cluster_id")?,
            target_cluster_id: r.decimal("target_cluster_id")?,
            agent_id: r.str("agent_id")?,
            commit: r.optional_str("commit")?,
            range: r.optional_str("range")?,
            confirmed_time: r.optional_str("confirmed_time")?,
            forced_resyncs: r.optional_u64("forced_resyncs")?,
            scan_restarts: r.optional_u64("scan_restarts")?,
            initial_sync_completed: r.optional_str("initial_sync_completed")?,
            excludes: r.optional_prefixes("excludes")?,
            source_seen: i64::try_from(r.optional_u64("source_seen")?)
                .map_err(|_| invalid("source_seen", "exceeds the revision range"))?,
        };
        record.check()?;
        Ok(record)
    }
}

/// An optional RFC 3339 time: empty, or it must parse.
fn check_time(field: &'static str, time: &str) -> Result<(), DecodeError> {
    if !time.is_empty() {
        humantime::parse_rfc3339_weak(time)
            .map_err(|e| invalid(field, format!("{time:?} is not an RFC 3339 time: {e}")))?;
    }
    Ok(())
}

/// A valid record of `link` at `epoch` and `role`, for the crate's unit tests.
#[cfg(test)]
pub(crate) fn test_record(link: &str, epoch: u64, role: Role) -> Checkpoint {
    Checkpoint {
        link_uid: link.into(),
        epoch,
        role,
        watermark: 1,
        scanning: false,
        scan_cursor: Vec::new(),
        prune_pending: false,
        source_cluster_id: 1,
        target_cluster_id: 2,
        agent_id: "a".into(),
        commit: String::new(),
        range: String::new(),
        confirmed_time: String::new(),
        forced_resyncs: 0,
        scan_restarts: 0,
        initial_sync_completed: String::new(),
        excludes: Vec::new(),
        source_seen: 0,
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> DecodeError {
    DecodeError::Invalid { field, reason: reason.into() }
}

struct Reader<'a>(&'a Map<String, Value>);

impl Reader<'_> {
    fn get(&self, field: &'static str) -> Result<&Value, DecodeError> {
        self.0.get(field).ok_or(DecodeError::Missing(field))
    }

    fn u64(&self, field: &'static str) -> Result<u64, DecodeError> {
        self.get(field)?.as_u64().ok_or_else(|| invalid(field, "must be a non-negative integer"))
    }

    fn bool(&self, field: &'static str) -> Result<bool, DecodeError> {
        self.get(field)?.as_bool().ok_or_else(|| invalid(field, "must be true or false"))
    }

    fn str(&self, field: &'static str) -> Result<String, DecodeError> {
        self.get(field)?.as_str().map(str::to_owned).ok_or_else(|| invalid(field, "must be a string"))
    }

    /// A string field added within v1: absent reads as empty.
    fn optional_str(&self, field: &'static str) -> Result<String, DecodeError> {
        match self.0.get(field) {
            None => Ok(String::new()),
            Some(_) => self.str(field),
        }
    }

    /// A list of base64 keys added within v1: absent reads as empty.
    fn optional_prefixes(&self, field: &'static str) -> Result<Vec<Vec<u8>>, DecodeError> {
        let Some(value) = self.0.get(field) else { return Ok(Vec::new()) };
        let items = value.as_array().ok_or_else(|| invalid(field, "must be a list of base64 strings"))?;
        items
            .iter()
            .map(|item| {
                let text = item.as_str().ok_or_else(|| invalid(field, "must be a list of base64 strings"))?;
                B64.decode(text).map_err(|e| invalid(field, format!("not base64: {e}")))
            })
            .collect()
    }

    /// A count added within v1: absent reads as 0.
    fn optional_u64(&self, field: &'static str) -> Result<u64, DecodeError> {
        match self.0.get(field) {
            None => Ok(0),
            Some(_) => self.u64(field),
        }
    }

    /// Cluster ids are 64-bit and written as decimal strings, because JSON numbers lose
    /// precision above 2^53 in many readers.
    fn decimal(&self, field: &'static str) -> Result<u64, DecodeError> {
        let s = self.str(field)?;
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid(field, format!("{s:?} is not a decimal string")));
        }
        s.parse().map_err(|_| invalid(field, format!("{s:?} overflows 64 bits")))
    }
}

#[cfg(test)]
#[path = "checkpoint_tests.rs"]
mod tests;
