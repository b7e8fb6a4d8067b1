//! Both sides of an exact replica at one revision, key by key: every key outside the reserved
//! namespace must agree in value, create and mod revision, version and lease. The seed's proof
//! stops at the first difference; `verify` and the tail's periodic pass count them all and
//! show the first few.

use etcd_client::{Client, KeyValue};
use mirror_core::{redact_key, Config, EtcdError, KeyRange, PagerOptions, Side, RESERVED_MARKER};
use mirror_reconcile::RangeReader;

/// What a comparison found.
#[derive(Debug, Default)]
pub(crate) struct Comparison {
    /// Keys that agree.
    pub equal: u64,
    /// Keys only the source has.
    pub missing: u64,
    /// Keys on both sides that differ.
    pub divergent: u64,
    /// Keys only the target has.
    pub orphan: u64,
    /// Source keys that carry a lease.
    pub leased: u64,
    /// The first differences, in words, keys redacted.
    pub shown: Vec<String>,
}

impl Comparison {
    /// Keys that differ, or are on one side only.
    pub fn differences(&self) -> u64 {
        self.missing + self.divergent + self.orphan
    }

    /// Keys the source holds (outside the reserved namespace).
    pub fn source_keys(&self) -> u64 {
        self.equal + self.divergent + self.missing
    }

    /// Keys the target holds (outside the reserved namespace).
    pub fn target_keys(&self) -> u64 {
        self.equal + self.divergent + self.orphan
    }
}

/// Compares both sides at `revision`; stops after `stop_after` differences (0: never).
pub(crate) async fn compare_at(
    cfg: &Config,
    source: &Client,
    target: &Client,
    revision: i64,
    show: usize,
    stop_after: u64,
) -> Result<Comparison, EtcdError> {
    let page = |op| {
        PagerOptions::new(
            op,
            cfg.sync.page_key_limit,
            cfg.sync.page_bytes.bytes() as usize,
            cfg.sync.request_timeout.get(),
        )
        .at_revision(revision)
    };
    let all = || vec![KeyRange { start: vec![0], end: vec![0] }];
    let mut theirs = RangeReader::new(source.kv_client(), Side::Source, all(), page("compare source"));
    let mut ours = RangeReader::new(target.kv_client(), Side::Target, all(), page("compare target"));
    let mut found = Comparison::default();
    let (mut a, mut b) = (next_unreserved(&mut theirs).await?, next_unreserved(&mut ours).await?);
    loop {
        let (what, advance_a, advance_b) = match (&a, &b) {
            (None, None) => break,
            (Some(x), Some(y)) if x.key() == y.key() => {
                (differs(x, y).map(|w| (w, &mut found.divergent)), true, true)
            }
            (Some(x), Some(y)) if x.key() < y.key() => {
                (Some((only(x, "source"), &mut found.missing)), true, false)
            }
            (Some(x), None) => (Some((only(x, "source"), &mut found.missing)), true, false),
            (_, Some(y)) => (Some((only(y, "target"), &mut found.orphan)), false, true),
        };
        match what {
            None => found.equal += 1,
            Some((what, kind)) => {
                *kind += 1;
                if found.shown.len() < show {
                    found.shown.push(what);
                }
                if stop_after > 0 && found.differences() >= stop_after {
                    break;
                }
            }
        }
        if advance_a {
            found.leased += u64::from(a.as_ref().is_some_and(|kv| kv.lease() != 0));
            a = next_unreserved(&mut theirs).await?;
        }
        if advance_b {
            b = next_unreserved(&mut ours).await?;
        }
    }
    Ok(found)
}

/// The reader's next key outside the reserved namespace.
async fn next_unreserved(reader: &mut RangeReader) -> Result<Option<KeyValue>, EtcdError> {
    loop {
        match reader.next().await? {
            Some(kv) if kv.key().starts_with(RESERVED_MARKER.as_bytes()) => continue,
            other => return Ok(other),
        }
    }
}

fn only(kv: &KeyValue, side: &str) -> String {
    format!("key {} is only in the {side}", redact_key(b"", kv.key()))
}

/// What differs between the source's and the target's copy of one key.
fn differs(a: &KeyValue, b: &KeyValue) -> Option<String> {
    let field = if a.value() != b.value() {
        "value"
    } else if a.create_revision() != b.create_revision() {
        "create_revision"
    } else if a.mod_revision() != b.mod_revision() {
        "mod_revision"
    } else if a.version() != b.version() {
        "version"
    } else if a.lease() != b.lease() {
        "lease"
    } else {
        return None;
    };
    Some(format!("key {} differs in {field}", redact_key(b"", a.key())))
}
