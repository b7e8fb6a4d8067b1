//! `/metrics`: the metric families of SPEC §7, prefix `etcd_mirror_`.
//!
//! Everything that status already knows is encoded from one status snapshot per scrape (so
//! metrics and `/statusz` never disagree); only what status cannot hold, the distributions of
//! apply latency and batch size, is observed live by the engine into histograms.

use std::sync::Arc;

use mirror_core::{ConditionType, ErrorClass, Phase, Status};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use mirror_core::StatusHandle;

/// Live-observed metrics the engine feeds.
#[derive(Debug)]
pub struct Metrics {
    /// Seconds per successful fenced Txn.
    pub apply_latency: Histogram,
    /// Data ops per successful fenced Txn.
    pub batch_size: Histogram,
    /// Whole source revisions per tail Txn (group commit: above 1 under load).
    pub batch_revisions: Histogram,
}

/// The registry served at `/metrics` and the handle the engine observes into.
pub fn registry(status: StatusHandle) -> (Registry, Arc<Metrics>) {
    let mut root = Registry::default();
    // The Prometheus convention's name, unprefixed, so standard dashboards and rules find it.
    root.register_collector(Box::new(ProcessCollector));
    let registry = root.sub_registry_with_prefix("etcd_mirror");
    let metrics = Arc::new(Metrics {
        apply_latency: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
        batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
        batch_revisions: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
    });
    registry.register(
        "apply_latency_seconds",
        "Latency of fenced target Txns that landed",
        metrics.apply_latency.clone(),
    );
    registry.register("batch_size_ops", "Data ops per fenced target Txn", metrics.batch_size.clone());
    registry.register(
        "batch_revisions",
        "Whole source revisions per tail Txn (group commit)",
        metrics.batch_revisions.clone(),
    );
    registry.register_collector(Box::new(StatusCollector { status }));
    (root, metrics)
}

/// `process_resident_memory_bytes`, read from /proc at each scrape.
#[derive(Debug)]
struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some((rss, _)) = mirror_core::process_memory() {
            gauge(&mut e, "process_resident_memory_bytes", "Resident memory size in bytes", rss as i64)?;
        }
        Ok(())
    }
}

/// Encodes the registry in the OpenMetrics text format.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, registry).is_err() {
        out = "# encoding failed\n".into();
    }
    out
}

#[derive(Debug)]
struct StatusCollector {
    status: StatusHandle,
}

fn gauge<N: prometheus_client::encoding::EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: N,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(value);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(value);
    c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)
}

fn labelled_gauges(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &'static str,
    values: &[(String, i64)],
) -> Result<(), std::fmt::Error> {
    let mut family =
        encoder.encode_descriptor(name, help, None, prometheus_client::metrics::MetricType::Gauge)?;
    for (value, n) in values {
        let labels = [(label, value.as_str())];
        ConstGauge::new(*n).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for StatusCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut s: Status = self.status.read().expect("status lock").clone();
        s.read_memory();
        gauge(
            &mut e,
            "resident_memory_peak_bytes",
            "The most resident memory the agent has held (VmHWM)",
            s.peak_rss_bytes as i64,
        )?;
        let flag = |c: ConditionType| i64::from(s.condition(c));
        gauge(&mut e, "watermark", "Source revision the target reflects", s.watermark)?;
        gauge(&mut e, "source_revision", "Latest source revision seen", s.source_revision)?;
        gauge(&mut e, "lag_revisions", "source_revision - watermark", s.lag_revisions)?;
        gauge(&mut e, "lag_seconds", "Seconds the watermark has trailed the source", s.lag_seconds)?;
        counter(
            &mut e,
            "keys_applied",
            "Target keys written by scan, tail and repairs",
            s.keys_applied_total,
        )?;
        gauge(
            &mut e,
            "lease_backed_keys",
            "Source keys seen with a lease (stripped, or attached where sync.leases = preserve)",
            s.lease_backed_keys as i64,
        )?;
        gauge(&mut e, "leases_preserved", "Target leases kept alive now", s.leases.preserved as i64)?;
        counter(&mut e, "leases_granted", "Target leases granted", s.leases.granted_total)?;
        counter(
            &mut e,
            "leases_revoked",
            "Target leases revoked (the source lease was gone)",
            s.leases.revoked_total,
        )?;
        gauge(
            &mut e,
            "leases_keepalive_lag_seconds",
            "The longest time since a kept target lease was last kept alive",
            s.leases.keepalive_lag_seconds,
        )?;
        counter(
            &mut e,
            "scan_restarts",
            "Genesis restarts (overflow, compaction mid-scan)",
            s.scan_restarts,
        )?;
        counter(
            &mut e,
            "watch_restarts",
            "Source watches opened after the first (reconnects, re-watches, genesis restarts)",
            s.watch_restarts,
        )?;
        {
            let mut family = e.encode_descriptor(
                "forced_resyncs",
                "Forced resyncs by reason",
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (reason, n) in &s.forced_resyncs.by_reason {
                let labels = [("reason", reason.as_str())];
                ConstCounter::new(*n).encode(family.encode_family(&labels)?)?;
            }
        }
        gauge(
            &mut e,
            "target_throttled",
            "1 while the target throttles writes",
            flag(ConditionType::TargetThrottled),
        )?;
        gauge(
            &mut e,
            "target_quota_exhausted",
            "1 while the target is out of space",
            flag(ConditionType::TargetQuotaExhausted),
        )?;
        gauge(&mut e, "fenced", "1 while another writer holds the fence", flag(ConditionType::Fenced))?;
        // Absent with ha off, as its help says: EtcdMirrorNoHALeader must not fire there. The
        // link's uid is a label, so the alert groups the replicas of one link even where one
        // Prometheus job scrapes the agents of several links.
        if let Some(ha) = &s.ha {
            labelled_gauges(
                &mut e,
                "ha_leader",
                "1 while this agent leads the HA election of its link_uid (0 on a standby; absent with ha off)",
                "link_uid",
                &[(s.link_uid.clone(), i64::from(ha.leader))],
            )?;
        }
        gauge(
            &mut e,
            "cutover_ready",
            "1 once drained, verified and promoted",
            flag(ConditionType::CutoverReady),
        )?;
        gauge(&mut e, "initial_sync_complete", "1 once G3 holds", flag(ConditionType::InitialSyncComplete))?;
        gauge(
            &mut e,
            "confirmed_age_seconds",
            "Seconds since the source was last confirmed at or below the watermark: what a failover now would lose at most",
            s.confirmed_age_seconds,
        )?;
        gauge(
            &mut e,
            "seconds_since_progress",
            "Seconds since the watermark last moved or was confirmed current",
            s.seconds_since_progress,
        )?;
        gauge(
            &mut e,
            "replication_lag_exceeded",
            "1 while the lag or the time without progress is over sync.max_lag",
            flag(ConditionType::ReplicationLagExceeded),
        )?;
        gauge(
            &mut e,
            "resync_loop_detected",
            "1 while forced resyncs or genesis restarts repeat with no live apply",
            flag(ConditionType::ResyncLoopDetected),
        )?;
        let current = s.last_error.as_ref().map(|e| e.class);
        let classes: Vec<(String, i64)> =
            ErrorClass::ALL.iter().map(|c| (c.to_string(), i64::from(current == Some(*c)))).collect();
        labelled_gauges(
            &mut e,
            "last_error",
            "1 for the class of the last error, while it stands",
            "class",
            &classes,
        )?;
        let reconciled_at = s
            .last_reconcile
            .as_ref()
            .and_then(|r| r.time.as_deref())
            .and_then(|t| humantime::parse_rfc3339(t).ok())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs() as i64);
        gauge(
            &mut e,
            "last_reconcile_timestamp_seconds",
            "Unix time of the last reconcile pass (0 before the first)",
            reconciled_at,
        )?;
        let drift = s.last_reconcile.clone().unwrap_or_default();
        labelled_gauges(
            &mut e,
            "drift_keys",
            "Differences found by the last reconcile pass",
            "kind",
            &[
                ("missing".into(), drift.missing as i64),
                ("divergent".into(), drift.divergent as i64),
                ("orphan".into(), drift.orphan as i64),
            ],
        )?;
        labelled_gauges(
            &mut e,
            "keys",
            "Keys in scope at the last count (-1 before the first count)",
            "side",
            &[
                ("source".into(), s.source_keys.map_or(-1, |n| n as i64)),
                ("target".into(), s.target_keys.map_or(-1, |n| n as i64)),
            ],
        )?;
        {
            let mut family = e.encode_descriptor(
                "tls_cert_expiry_timestamp_seconds",
                "notAfter of the TLS CA bundle and client certificate loaded at the last connect",
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?;
            for (side, info) in [("source", &s.source), ("target", &s.target)] {
                for cert in &info.tls_cert_expiry {
                    let labels = [("side", side), ("kind", cert.kind.as_str())];
                    ConstGauge::new(cert.not_after).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        let phases: Vec<(String, i64)> =
            Phase::ALL.iter().map(|p| (p.as_str().to_owned(), i64::from(*p == s.phase))).collect();
        labelled_gauges(&mut e, "phase", "1 for the current phase", "phase", &phases)?;
        Ok(())
    }
}
