//! Connecting both sides: probe every member, check versions, clusters and direction, and hand
//! a connected [`Link`] to the start planner.

use mirror_core::{
    connect_to, parse_version, probe_members, ConditionType, Config, EtcdError, Fault, Phase, Probe, Reason,
    Side, SideStatus, Status,
};

use tokio::time::Instant;
use tracing::info;

use mirror_fence::Applier;

use super::link::Link;
use super::{Engine, EngineError, Pending, Refusal};

impl Engine {
    /// A TLS failure before the link ever worked is a wrong config: permanent, named. After it
    /// worked, the same failure is more likely a rotation in progress and is retried.
    pub(super) fn refuse_tls_at_start(&self, e: EtcdError) -> EngineError {
        match e.fault {
            Fault::TlsConfig | Fault::TlsRejected if !self.ever_connected => Refusal::Tls {
                reason: e.fault.into(),
                detail: format!("{} on {}: {}", e.op, e.side, e.source),
            }
            .into(),
            _ => e.into(),
        }
    }

    /// Probes both sides and connects to the members that serve, reusing `last`'s clients
    /// when the same members serve: what an HA standby keeps fresh while it waits.
    pub(super) async fn warm_up(&self, last: Option<&Warm>) -> Result<Warm, EtcdError> {
        let (cfg, sync) = (&self.cfg, &self.cfg.sync);
        let tls_files = tls_fingerprint(cfg);
        let (source_probe, target_probe) = futures::try_join!(
            probe_members(Side::Source, &cfg.source, sync),
            probe_members(Side::Target, &cfg.target, sync)
        )?;
        let same = last.filter(|w| {
            w.tls_files == tls_files
                && w.source_probe.serving_endpoints() == source_probe.serving_endpoints()
                && w.target_probe.serving_endpoints() == target_probe.serving_endpoints()
        });
        let (source, target) = match same {
            Some(w) => (w.source.clone(), w.target.clone()),
            None => {
                let serving = (source_probe.serving_endpoints(), target_probe.serving_endpoints());
                futures::try_join!(
                    connect_to(Side::Source, &cfg.source, sync, &serving.0),
                    connect_to(Side::Target, &cfg.target, sync, &serving.1),
                )?
            }
        };
        Ok(Warm { at: Instant::now(), tls_files, source_probe, target_probe, source, target })
    }

    pub(super) async fn connect_and_run(&mut self, pending: Pending) -> Result<(), EngineError> {
        if !self.ever_connected {
            self.set_phase(Phase::Connecting);
        }
        // Taken before the files are read, so a rotation racing the connect is seen next check.
        let tls_files = tls_fingerprint(&self.cfg);
        // An HA standby's connection, if fresh and made with today's files: no dial, no probe.
        let warm = self.warm.take().filter(|w| w.at.elapsed() < WARM_FOR && w.tls_files == tls_files);
        if warm.is_none() && self.elected_at.is_some() {
            // The claim then waits for probes and dials: said, so a slow takeover is explained.
            info!("elected without a fresh standby connection; probing and dialing both sides");
        }
        let sync = &self.cfg.sync;
        let source_probe = match &warm {
            Some(w) => Ok(w.source_probe.clone()),
            None => probe_members(Side::Source, &self.cfg.source, sync).await,
        };
        self.update(|s| reachability(s, ConditionType::SourceReachable, &source_probe));
        let source_probe = source_probe.map_err(|e| self.refuse_tls_at_start(e))?;
        let target_probe = match &warm {
            Some(w) => Ok(w.target_probe.clone()),
            None => probe_members(Side::Target, &self.cfg.target, sync).await,
        };
        self.update(|s| reachability(s, ConditionType::TargetReachable, &target_probe));
        let target_probe = target_probe.map_err(|e| self.refuse_tls_at_start(e))?;
        self.ever_connected = true;
        let expiry = (tls_expiry(&self.cfg.source), tls_expiry(&self.cfg.target));
        let (source_info, source_cluster) = side_status(Side::Source, &source_probe)?;
        let (target_info, target_cluster) = side_status(Side::Target, &target_probe)?;
        self.update(|s| crate::members::members_reachable(s, &source_probe, &target_probe));
        let learner = source_info.learner || target_info.learner;
        let trust = sync.trust_progress_notify.trusts(&source_info.version);
        self.update(|s| {
            s.source = SideStatus { tls_cert_expiry: expiry.0, ..source_info.clone() };
            s.target = SideStatus { tls_cert_expiry: expiry.1, ..target_info.clone() };
            s.set_condition(
                ConditionType::LearnerEndpoint,
                learner,
                Reason::Probe,
                "an endpoint is a learner",
            );
        });
        if source_cluster == target_cluster {
            let (src, dst) = (self.rewriter.source_prefix(), self.rewriter.dest_prefix());
            if src.starts_with(dst) || dst.starts_with(src) {
                return Err(Refusal::SameClusterOverlap.into());
            }
        }

        let sync = &self.cfg.sync;
        let source = match &warm {
            Some(w) => w.source.clone(),
            None => {
                connect_to(Side::Source, &self.cfg.source, sync, &source_probe.serving_endpoints()).await?
            }
        };
        let reverse = mirror_reconcile::find_reverse_link(
            &mut source.kv_client(),
            &self.rewriter,
            source_cluster,
            target_cluster,
            sync.request_timeout.get(),
        )
        .await?;
        if let Some(other) = reverse {
            let at = self.rewriter.redact(&other.namespace);
            return Err(Refusal::ReverseLink { other: other.link_uid, at }.into());
        }
        let target = match warm {
            Some(w) => w.target,
            None => {
                connect_to(Side::Target, &self.cfg.target, sync, &target_probe.serving_endpoints()).await?
            }
        };
        let target_kv = target.kv_client();
        let leases = super::leases::LeaseKeeper::new(sync, source.clone(), target, self.reporter.handle());
        let buffering = super::buffering::Buffering::new(self.rewriter.clone());
        let mut link = Link {
            engine: self,
            source,
            target_kv,
            leases,
            source_cluster,
            target_cluster,
            trust,
            applier: None,
            watch: None,
            tls_files,
            buffering,
        };
        let result = link.drive(pending).await;
        let committed = link.applier.as_ref().map_or(0, |a| a.writer().mod_revision());
        // The throttle curve goes on from this run's last write into the next run's.
        if let Some(throttle) = link.applier.as_ref().map(Applier::throttle) {
            self.throttle = throttle;
        }
        self.target_committed = self.target_committed.max(committed);
        result
    }
}

/// How long a standby's [`Warm`] connection stands in for a probe: a little over two of its
/// refreshes (`ha.rs`), so a member lost since shows in the next member check instead.
pub(super) const WARM_FOR: std::time::Duration = std::time::Duration::from_secs(5);

/// Both sides probed and connected, ahead of the claim (an HA standby's, [`Engine::warm_up`]).
pub(super) struct Warm {
    /// When the probes answered.
    pub at: tokio::time::Instant,
    /// The TLS files' digests the connections were made with.
    pub tls_files: Option<Vec<[u8; 32]>>,
    pub source_probe: Probe,
    pub target_probe: Probe,
    pub source: etcd_client::Client,
    pub target: etcd_client::Client,
}

/// Digests of both sides' TLS files; `None` without TLS.
pub(crate) fn tls_fingerprint(cfg: &Config) -> Option<Vec<[u8; 32]>> {
    let sides: Vec<[u8; 32]> = [&cfg.source, &cfg.target]
        .iter()
        .filter_map(|s| s.tls.as_ref())
        .map(mirror_core::tls::fingerprint)
        .collect();
    (!sides.is_empty()).then_some(sides)
}

/// The expiry of the side's CA bundle and client certificate, as loaded by this connect.
pub(crate) fn tls_expiry(side: &mirror_core::SideConfig) -> Vec<mirror_core::tls::CertExpiry> {
    side.tls.as_ref().map(mirror_core::tls::expiry).unwrap_or_default()
}

pub(super) fn side_status(side: Side, probe: &Probe) -> Result<(SideStatus, u64), EngineError> {
    let members = &probe.members;
    let mut lowest: Option<(u32, u32, u32)> = None;
    let mut version = String::new();
    for m in members.iter().filter(|m| m.version != mirror_core::UNKNOWN_VERSION) {
        let v = parse_version(&m.version).unwrap_or((0, 0, 0));
        if v < (3, 4, 0) {
            return Err(Refusal::VersionUnsupported {
                side,
                endpoint: m.endpoint.clone(),
                version: m.version.clone(),
            }
            .into());
        }
        if lowest.is_none_or(|l| v < l) {
            lowest = Some(v);
            version = m.version.clone();
        }
    }
    if version.is_empty() {
        // No member told its version (a user Maintenance Status refuses, over https): said so
        // in status, never refused, progress notifications untrusted unless configured.
        version = mirror_core::UNKNOWN_VERSION.to_owned();
    }
    let cluster = members.first().map_or(0, |m| m.cluster_id);
    if let Some(other) = members.iter().find(|m| m.cluster_id != cluster) {
        return Err(Refusal::MixedClusters { side, endpoint: other.endpoint.clone() }.into());
    }
    Ok((
        SideStatus {
            version,
            cluster_id: cluster.to_string(),
            learner: members.iter().any(|m| m.learner),
            unreachable_endpoints: probe.unreachable.iter().map(|(url, _)| url.clone()).collect(),
            tls_cert_expiry: Vec::new(),
        },
        cluster,
    ))
}

/// Sets `SourceReachable`/`TargetReachable` from a probe, naming why it failed (wrong
/// credentials read `AuthFailed`, so the side at fault is obvious).
pub(crate) fn reachability<T>(s: &mut Status, condition: ConditionType, probe: &Result<T, EtcdError>) {
    match probe {
        Ok(_) => s.set_condition(condition, true, Reason::Probe, ""),
        Err(e) => s.set_condition(condition, false, e.fault.into(), e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use mirror_core::MemberInfo;

    use super::*;

    fn member(endpoint: &str, version: &str, cluster_id: u64, learner: bool) -> MemberInfo {
        MemberInfo { endpoint: endpoint.into(), version: version.into(), cluster_id, learner }
    }

    fn probe(members: Vec<MemberInfo>) -> Probe {
        Probe { members, unreachable: vec![("http://c:2379".into(), "refused".into())] }
    }

    fn refusal(r: Result<(SideStatus, u64), EngineError>) -> Refusal {
        match r {
            Err(EngineError::Refused(refusal)) => refusal,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn the_lowest_version_a_learner_and_the_unreachable_are_reported() {
        let p = probe(vec![
            member("http://a:2379", "3.5.30", 7, false),
            member("http://b:2379", "3.4.23", 7, true),
        ]);
        let (side, cluster) = side_status(Side::Source, &p).unwrap();
        assert_eq!((side.version.as_str(), side.cluster_id.as_str(), cluster), ("3.4.23", "7", 7));
        assert!(side.learner, "LearnerEndpoint comes from this");
        assert_eq!(side.unreachable_endpoints, ["http://c:2379"]);
    }

    #[test]
    fn a_member_below_3_4_is_refused_naming_it() {
        let p = probe(vec![
            member("http://a:2379", "3.5.30", 7, false),
            member("http://old:2379", "3.3.27", 7, false),
        ]);
        let r = refusal(side_status(Side::Target, &p));
        assert_eq!(r.reason(), Reason::VersionUnsupported);
        let text = r.to_string();
        assert!(text.contains("http://old:2379") && text.contains("3.3.27"), "{text}");
    }

    #[test]
    fn endpoints_of_two_clusters_are_refused_naming_the_odd_one() {
        let p = probe(vec![
            member("http://a:2379", "3.5.30", 7, false),
            member("http://x:2379", "3.5.30", 8, false),
        ]);
        let r = refusal(side_status(Side::Source, &p));
        assert_eq!(r.reason(), Reason::MixedClusters);
        assert!(r.to_string().contains("http://x:2379"), "{r}");
    }

    #[test]
    fn members_that_hide_their_version_are_not_refused() {
        let p = probe(vec![member("http://a:2379", mirror_core::UNKNOWN_VERSION, 7, false)]);
        let (side, _) = side_status(Side::Source, &p).unwrap();
        assert_eq!(side.version, mirror_core::UNKNOWN_VERSION);
    }
}
