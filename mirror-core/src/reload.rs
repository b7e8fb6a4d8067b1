//! What SIGHUP does with each config field: the "SIGHUP" column of docs/configuration.md, as
//! code. The agent sorts a reload's changed fields with [`Applies::of`], refuses the reload
//! when one [`Applies::Refused`] field changed, and names the fields that wait for a later
//! point in its log; a test holds the reference to this table.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::Config;

/// When a changed field takes effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Applies {
    /// Read each time it is used.
    Live,
    /// The agent reconnects both sides with the new value at once.
    Reconnect,
    /// Read when a run starts: the next reconnect, forced resync or restart.
    NextRun,
    /// Read only when an initial sync is planned.
    NextGenesis,
    /// Defines the link: a reload that changes it is refused whole.
    Refused,
    /// Kept until the process restarts; the rest of the reload applies.
    Restart,
}

impl Applies {
    /// The word the reference uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Applies::Live => "live",
            Applies::Reconnect => "reconnect",
            Applies::NextRun => "next run",
            Applies::NextGenesis => "next genesis",
            Applies::Refused => "refused",
            Applies::Restart => "restart",
        }
    }

    /// The column of `field` (dotted, as in the reference: `sync.max_txn_ops`). Fields of
    /// `[source]` and `[target]` share their rules; `None` for a name that is not a field.
    pub fn of(field: &str) -> Option<Applies> {
        let side_field = field.strip_prefix("source.").or_else(|| field.strip_prefix("target."));
        if let Some(rest) = side_field {
            return match rest {
                "prefix" | "auth.password" => Some(Applies::Refused),
                "endpoints" => Some(Applies::Reconnect),
                _ if rest.starts_with("tls.") || rest.starts_with("auth.") => Some(Applies::Reconnect),
                _ => None,
            };
        }
        Some(match field {
            "epoch" | "paused" | "mode" => Applies::Live,
            "link_uid" | "checkpoint.key" | "ha.enabled" => Applies::Refused,
            // Keys outside the range would appear or vanish mid-stream; target leases are
            // granted (or not) for the whole run.
            "sync.dest_prefix" | "sync.exclude_prefixes" | "sync.leases" | "sync.revisions" => {
                Applies::Refused
            }
            "initial_sync.mode" | "initial_sync.start_revision" => Applies::NextGenesis,
            "sync.max_txn_ops"
            | "sync.dial_timeout"
            | "sync.trust_progress_notify"
            | "ha.lease_ttl"
            | "sync.exact_lease_hold"
            | "sync.exact_seed"
            | "sync.exact_txns_in_flight"
            | "sync.exact_txn_spacing"
            | "sync.txns_in_flight" => Applies::NextRun,
            "sync.txn_flush_bytes"
            | "sync.page_key_limit"
            | "sync.page_bytes"
            | "sync.watch_buffer_bytes"
            | "sync.max_ops_per_second"
            | "sync.request_timeout"
            | "sync.backoff.initial"
            | "sync.backoff.max"
            | "sync.progress_interval"
            | "sync.max_lag"
            | "reconcile.interval"
            | "reconcile.delete_orphans" => Applies::Live,
            "http.listen" => Applies::Restart,
            _ => return None,
        })
    }
}

/// The dotted names of the fields whose values differ between two configs (a table present
/// in one only counts as all its fields changed).
pub fn changed_fields(before: &Config, after: &Config) -> Vec<String> {
    let (a, b) = (leaves(before), leaves(after));
    let names: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    names.into_iter().filter(|n| a.get(*n) != b.get(*n)).cloned().collect()
}

/// A reload's changed fields, sorted by when they apply.
pub fn sort_changes(before: &Config, after: &Config) -> BTreeMap<Applies, Vec<String>> {
    let mut out: BTreeMap<Applies, Vec<String>> = BTreeMap::new();
    for field in changed_fields(before, after) {
        // A field this table does not know is refused: better a refused reload than one that
        // silently does nothing.
        let when = Applies::of(&field).unwrap_or(Applies::Refused);
        out.entry(when).or_default().push(field);
    }
    out
}

/// Every leaf of the config as TOML writes it, by dotted path (arrays are leaves).
pub(crate) fn leaves(config: &Config) -> BTreeMap<String, String> {
    fn walk(prefix: &str, value: &toml::Value, out: &mut BTreeMap<String, String>) {
        match value {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    walk(&path, v, out);
                }
            }
            leaf => drop(out.insert(prefix.to_owned(), leaf.to_string())),
        }
    }
    let mut out = BTreeMap::new();
    // A Config always serializes: every field is a plain value, string, array or table.
    if let Ok(value) = toml::Value::try_from(config) {
        walk("", &value, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::MINIMAL_CONFIG;

    fn config(extra: &str) -> Config {
        Config::from_toml_str(&format!("{MINIMAL_CONFIG}{extra}")).unwrap()
    }

    #[test]
    fn changes_are_sorted_by_when_they_apply() {
        let before = config("");
        let after = config(
            "[source.tls]\nca_file = \"/ca.pem\"\n[sync]\nmax_txn_ops = 64\nmax_ops_per_second = 10\n\
             [initial_sync]\nmode = \"overwrite\"\n[http]\nlisten = \"0.0.0.0:9\"\n",
        );
        let sorted = sort_changes(&before, &after);
        let get = |a: Applies| sorted.get(&a).cloned().unwrap_or_default();
        assert_eq!(get(Applies::Live), ["sync.max_ops_per_second"]);
        assert_eq!(get(Applies::NextRun), ["sync.max_txn_ops"]);
        assert_eq!(get(Applies::NextGenesis), ["initial_sync.mode"]);
        // A new table: each of its fields (those with defaults too) counts as changed.
        let reconnect = get(Applies::Reconnect);
        assert!(reconnect.contains(&"source.tls.ca_file".to_owned()), "{reconnect:?}");
        assert!(reconnect.iter().all(|f| f.starts_with("source.tls.")), "{reconnect:?}");
        assert_eq!(get(Applies::Restart), ["http.listen"]);
        assert!(get(Applies::Refused).is_empty());
        assert!(sort_changes(&before, &before.clone()).is_empty(), "nothing changed");
    }

    /// The reference's immutability rule (prefixes, destination prefix, excludes and the
    /// checkpoint key fixed; endpoints mutable), as a reload sorts real config changes.
    #[test]
    fn what_defines_the_link_is_refused_and_endpoints_reconnect() {
        let before = config("");
        let cases = [
            ("[sync]\ndest_prefix = \"sub/\"\n", "sync.dest_prefix"),
            ("[sync]\nexclude_prefixes = [\"/registry/skip/\"]\n", "sync.exclude_prefixes"),
            ("[checkpoint]\nkey = \"/mirror/cp\"\n", "checkpoint.key"),
        ];
        for (extra, field) in cases {
            let sorted = sort_changes(&before, &config(extra));
            assert_eq!(
                sorted.get(&Applies::Refused).map(Vec::as_slice),
                Some(&[field.to_owned()][..]),
                "{field}"
            );
            assert_eq!(sorted.len(), 1, "{field}: {sorted:?}");
        }
        let mut target_moved = MINIMAL_CONFIG.to_owned();
        let last = target_moved.rfind("/registry/").expect("the minimal config names a target prefix");
        target_moved.replace_range(last..last + "/registry/".len(), "/registry/b/");
        let prefixes = [
            (MINIMAL_CONFIG.replacen("/registry/", "/registry/a/", 1), "source.prefix"),
            (target_moved, "target.prefix"),
        ];
        for (text, field) in prefixes {
            let sorted = sort_changes(&before, &Config::from_toml_str(&text).unwrap());
            assert_eq!(
                sorted.get(&Applies::Refused).map(Vec::as_slice),
                Some(&[field.to_owned()][..]),
                "{field}"
            );
        }
        let moved = MINIMAL_CONFIG.replacen("127.0.0.1:2379", "127.0.0.1:12379", 1);
        assert_ne!(moved, MINIMAL_CONFIG, "the minimal config names a source endpoint");
        let sorted = sort_changes(&before, &Config::from_toml_str(&moved).unwrap());
        assert_eq!(sorted.get(&Applies::Reconnect).map(Vec::len), Some(1), "{sorted:?}");
        assert_eq!(sorted.len(), 1, "{sorted:?}");
    }

    #[test]
    fn a_field_the_table_does_not_know_is_refused() {
        assert_eq!(Applies::of("sync.no_such_field"), None);
        assert_eq!(Applies::of("source.no_such_field"), None);
        assert_eq!(Applies::of("source.prefix"), Some(Applies::Refused));
        assert_eq!(Applies::of("target.auth.password_file"), Some(Applies::Reconnect));
    }
}
