//! The rules of SPEC §4 a config must satisfy, one `check` per section; every violation names
//! its field, and all are reported at once ([`super::Config::validate`]).

use std::collections::BTreeSet;
use std::net::SocketAddr;

use super::*;

/// The violations found so far.
#[derive(Default)]
pub(super) struct Rules(pub(super) Vec<Violation>);

impl Rules {
    fn add(&mut self, field: impl Into<String>, rule: impl Into<String>) {
        self.0.push(Violation { field: field.into(), rule: rule.into() });
    }
}

impl Config {
    /// Every rule of the file, section by section, then those that span sections.
    pub(super) fn check(&self, v: &mut Rules) {
        let uid_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if self.link_uid.is_empty() {
            v.add("link_uid", "is required");
        } else if self.link_uid.len() > 128 || !self.link_uid.chars().all(uid_ok) {
            v.add("link_uid", "must be 1-128 characters of A-Z a-z 0-9 . _ -");
        }
        if self.epoch < 1 {
            v.add("epoch", "must be >= 1");
        }
        self.source.check("source", v);
        self.target.check("target", v);
        self.initial_sync.check(v);
        self.sync.check(v);
        self.reconcile.check(v);
        self.ha.check(v);
        self.http.check(v);
        self.check_checkpoint_key(v);
        self.check_direction(v);
        self.check_exact(v);
    }

    /// Exact mode (SPEC §10) mirrors a restore of the whole keyspace that only the link writes:
    /// every field that would narrow the range, seed it another way or have the link write
    /// outside its one Txn per revision is named.
    fn check_exact(&self, v: &mut Rules) {
        if !(1..=4).contains(&self.sync.txns_in_flight) {
            v.add("sync.txns_in_flight", "must be 1-4");
        }
        if !self.exact() {
            if !self.sync.exact_seed.is_empty() {
                v.add("sync.exact_seed", "applies only with sync.revisions = \"exact\"");
            }
            return;
        }
        if self.sync.txns_in_flight != 1 {
            v.add(
                "sync.txns_in_flight",
                "applies only with sync.revisions = \"compact\" (exact mode: sync.exact_txns_in_flight)",
            );
        }
        const WHY: &str = "with sync.revisions = \"exact\"";
        for (field, prefix) in [
            ("source.prefix", &self.source.prefix),
            ("target.prefix", &self.target.prefix),
            ("sync.dest_prefix", &self.sync.dest_prefix),
        ] {
            if !prefix.is_empty() {
                v.add(field, format!("must be \"\" {WHY}: a restored target holds the whole keyspace"));
            }
        }
        if !self.sync.exclude_prefixes.is_empty() {
            v.add("sync.exclude_prefixes", format!("must be empty {WHY}: a restored target holds every key"));
        }
        if self.sync.leases != LeaseMode::Preserve {
            v.add("sync.leases", format!("must be \"preserve\" {WHY}: every key keeps its lease ID"));
        }
        if self.initial_sync != InitialSync::default() {
            v.add(
                "initial_sync",
                format!("must be left out {WHY}: the target is seeded from a snapshot (mirror-agent snapshot save)"),
            );
        }
        if !self.checkpoint.key.is_empty() {
            v.add(
                "checkpoint.key",
                format!(
                    "must be left out {WHY}: the record lives at \\u0000etcd-mirror/<link_uid>/checkpoint"
                ),
            );
        }
        if self.reconcile.delete_orphans {
            v.add("reconcile.delete_orphans", format!("must be false {WHY}: reconcile only reads"));
        }
        if self.mode == Mode::Drain {
            v.add(
                "mode",
                format!("must be left out {WHY}: `mirror-agent cutover` drains, compares and promotes an exact link"),
            );
        }
        if self.sync.max_ops_per_second != 0 {
            v.add(
                "sync.max_ops_per_second",
                format!("must be 0 {WHY}: every source revision lands as one Txn, as fast as the source took them"),
            );
        }
        if !(1..=16).contains(&self.sync.exact_txns_in_flight) {
            v.add("sync.exact_txns_in_flight", "must be 1-16");
        }
        if self.sync.exact_txn_spacing.get() > crate::spacing::MAX_GAP {
            v.add("sync.exact_txn_spacing", "must be at most 10ms (a Txn takes about a millisecond)");
        }
        if self.sync.exact_lease_hold.get().as_secs() < 60 {
            v.add("sync.exact_lease_hold", "must be >= 60s (it is how long every agent may be down)");
        } else if self.sync.exact_lease_hold.get().subsec_nanos() != 0 {
            v.add("sync.exact_lease_hold", "must be whole seconds (etcd leases count seconds)");
        }
    }

    /// A configured checkpoint key lies in this link's reserved namespace.
    fn check_checkpoint_key(&self, v: &mut Rules) {
        if !self.checkpoint.key.is_empty() {
            let dest = self.destination_prefix();
            let reserved = String::from_utf8_lossy(&self.rewriter().reserved_prefix()).into_owned();
            if !self.checkpoint.key.starts_with(&dest) {
                v.add(
                    "checkpoint.key",
                    format!(
                        "must start with the destination prefix {dest:?} (target.prefix + sync.dest_prefix)"
                    ),
                );
            } else if !self.checkpoint.key.starts_with(&reserved) {
                v.add(
                    "checkpoint.key",
                    format!("must lie in the reserved namespace {reserved:?}, or mirrored keys could overwrite it"),
                );
            }
        }
    }

    /// The same cluster on both sides with overlapping ranges mirrors into itself.
    fn check_direction(&self, v: &mut Rules) {
        // The same cluster on both sides with overlapping ranges mirrors into itself. The
        // cluster-id check at connect catches different spellings of one cluster; this catches
        // the obvious case before anything connects.
        let norm = |s: &Side| {
            s.endpoints.iter().map(|e| e.trim_end_matches('/').to_owned()).collect::<BTreeSet<_>>()
        };
        let dest = self.destination_prefix();
        let src = &self.source.prefix;
        if !self.source.endpoints.is_empty()
            && norm(&self.source) == norm(&self.target)
            && (dest.starts_with(src.as_str()) || src.starts_with(dest.as_str()))
        {
            v.add(
                "target.endpoints",
                "are the source's endpoints and the destination range overlaps the source range (a direction conflict)",
            );
        }
    }
}

impl InitialSync {
    fn check(&self, v: &mut Rules) {
        if self.start_revision < 0 {
            v.add("initial_sync.start_revision", "must be >= 0");
        } else if self.start_revision > 0 && self.mode == InitialSyncMode::RequireEmpty {
            v.add(
                "initial_sync.start_revision",
                "must be 0 with initial_sync.mode = \"require_empty\" (a partial history cannot start from an empty target)",
            );
        }
    }
}

impl SyncSection {
    fn check(&self, v: &mut Rules) {
        let s = self;
        if s.dest_prefix.contains(RESERVED_MARKER) {
            v.add("sync.dest_prefix", "must not contain the reserved marker \\u0000etcd-mirror/");
        }
        for (i, p) in s.exclude_prefixes.iter().enumerate() {
            if p.is_empty() {
                v.add(
                    format!("sync.exclude_prefixes[{i}]"),
                    "must not be empty (it would exclude the whole range)",
                );
            }
        }
        if s.max_txn_ops < 2 {
            v.add("sync.max_txn_ops", "must be >= 2 (one slot is reserved for the checkpoint)");
        }
        if s.txn_flush_bytes.bytes() == 0 {
            v.add("sync.txn_flush_bytes", "must be > 0");
        }
        if s.page_key_limit < 1 {
            v.add("sync.page_key_limit", "must be >= 1");
        }
        if s.page_bytes.bytes() == 0 {
            v.add("sync.page_bytes", "must be > 0");
        }
        if s.watch_buffer_bytes.bytes() == 0 {
            v.add("sync.watch_buffer_bytes", "must be > 0");
        }
        if s.max_ops_per_second < 0 {
            v.add("sync.max_ops_per_second", "must be >= 0 (0 = unlimited)");
        }
        for (field, d) in [
            ("sync.request_timeout", s.request_timeout),
            ("sync.dial_timeout", s.dial_timeout),
            ("sync.progress_interval", s.progress_interval),
            ("sync.backoff.initial", s.backoff.initial),
            ("sync.max_lag", s.max_lag),
        ] {
            if d.get().is_zero() {
                v.add(field, "must be > 0s");
            }
        }
        if s.backoff.max < s.backoff.initial {
            v.add("sync.backoff.max", "must be >= sync.backoff.initial");
        }
    }
}

impl Reconcile {
    fn check(&self, v: &mut Rules) {
        let interval = self.interval.get();
        if !interval.is_zero() && interval.as_secs() < 1 {
            v.add("reconcile.interval", "must be \"0s\" (disabled) or at least 1s");
        }
    }
}

impl Ha {
    fn check(&self, v: &mut Rules) {
        let ttl = self.lease_ttl.get();
        if ttl.as_secs() < 2 {
            v.add("ha.lease_ttl", "must be >= 2s (etcd's smallest useful lease)");
        } else if ttl.as_secs() > 300 {
            v.add("ha.lease_ttl", "must be <= 300s (a standby waits this long after a leader dies)");
        } else if ttl.subsec_nanos() != 0 {
            v.add("ha.lease_ttl", "must be whole seconds (etcd leases count seconds)");
        }
    }
}

impl Http {
    fn check(&self, v: &mut Rules) {
        if self.listen.parse::<SocketAddr>().is_err() {
            v.add("http.listen", "must be an address and port, e.g. \"127.0.0.1:8080\"");
        }
    }
}

impl Side {
    fn check(&self, side: &str, v: &mut Rules) {
        if self.endpoints.is_empty() {
            v.add(format!("{side}.endpoints"), "must list at least one endpoint");
        }
        let mut schemes = BTreeSet::new();
        for (i, e) in self.endpoints.iter().enumerate() {
            match parse_endpoint(e) {
                Ok(scheme) => {
                    schemes.insert(scheme);
                }
                Err(rule) => v.add(format!("{side}.endpoints[{i}]"), rule),
            }
        }
        if schemes.len() > 1 {
            v.add(format!("{side}.endpoints"), "must not mix http:// and https://");
        }
        match (&self.tls, schemes.iter().next().copied()) {
            (None, Some("https")) => v.add(format!("{side}.tls"), "is required for https:// endpoints"),
            (Some(_), Some("http")) if schemes.len() == 1 => v.add(
                format!("{side}.tls"),
                "must be absent for http:// endpoints (use https:// to enable TLS)",
            ),
            _ => {}
        }
        if let Some(tls) = &self.tls {
            if tls.insecure_skip_verify && !tls.insecure_skip_verify_acknowledge_risk {
                v.add(
                    format!("{side}.tls.insecure_skip_verify"),
                    "requires insecure_skip_verify_acknowledge_risk = true",
                );
            }
            if tls.cert_file.is_some() != tls.key_file.is_some() {
                v.add(format!("{side}.tls.cert_file"), "and key_file must be set together");
            }
        }
        if let Some(auth) = &self.auth {
            if auth.username.is_empty() {
                v.add(format!("{side}.auth.username"), "must not be empty");
            }
            if auth.password.is_some() {
                v.add(
                    format!("{side}.auth.password"),
                    "is not accepted in the config file; use password_file or password_env",
                );
            }
            if auth.password_file.is_some() == auth.password_env.is_some() {
                v.add(format!("{side}.auth"), "needs exactly one of password_file or password_env");
            }
        }
        if self.prefix.contains(RESERVED_MARKER) {
            v.add(format!("{side}.prefix"), "must not contain the reserved marker \\u0000etcd-mirror/");
        }
    }
}

/// Checks `scheme://host:port` and returns the scheme.
fn parse_endpoint(e: &str) -> Result<&'static str, String> {
    let (scheme, rest) =
        e.split_once("://").ok_or_else(|| format!("{e:?} must be http://host:port or https://host:port"))?;
    let scheme = match scheme {
        "http" => "http",
        "https" => "https",
        other => return Err(format!("{e:?} has scheme {other:?}; use http or https")),
    };
    let authority = rest.trim_end_matches('/');
    if authority.contains('@') {
        return Err("must not carry credentials; use the auth section".into());
    }
    if authority.contains('/') {
        return Err(format!("{e:?} must not have a path"));
    }
    let (host, port) = authority.rsplit_once(':').ok_or_else(|| format!("{e:?} needs an explicit port"))?;
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(format!("{e:?} must be {scheme}://host:port with a port in 1-65535"));
    }
    Ok(scheme)
}
