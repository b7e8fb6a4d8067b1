//! A throwaway PKI for TLS tests: one CA, a server certificate for `127.0.0.1`/`localhost` and
//! a client certificate, written as PEM files into one directory.
//!
//! A harness cluster started with [`crate::ClusterSpec::tls`] serves the server certificate and
//! requires a client certificate signed by the same CA; the harness's own clients and the agent
//! use the client files.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose,
};

/// File names inside a PKI directory.
pub const CA: &str = "ca.pem";
/// The server certificate.
pub const SERVER_CERT: &str = "server.pem";
/// The server key.
pub const SERVER_KEY: &str = "server-key.pem";
/// The client certificate.
pub const CLIENT_CERT: &str = "client.pem";
/// The client key.
pub const CLIENT_KEY: &str = "client-key.pem";
/// The CA's key, kept so more certificates can be issued later ([`Pki::reissue_client`]).
pub const CA_KEY: &str = "ca-key.pem";

/// A directory holding [`CA`], [`SERVER_CERT`], [`SERVER_KEY`], [`CLIENT_CERT`], [`CLIENT_KEY`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pki {
    /// Where the files are.
    pub dir: PathBuf,
    /// The name the CA was generated with (its subject is derived from it).
    pub name: String,
    /// The `notAfter` of the client certificate, Unix seconds.
    pub client_not_after: i64,
}

/// When the certificates of one PKI expire (distinct per PKI, so a test can tell which is in use).
#[derive(Clone, Copy, Debug)]
pub struct Validity {
    /// The CA's `notAfter` (year, month, day).
    pub ca_until: (i32, u8, u8),
    /// The leaf certificates' `notAfter`.
    pub leaf_until: (i32, u8, u8),
}

impl Default for Validity {
    fn default() -> Self {
        Validity { ca_until: (2040, 1, 1), leaf_until: (2036, 1, 1) }
    }
}

impl Pki {
    /// Generates a CA named `name` and its server and client certificates into `dir`.
    pub fn generate(dir: &Path, name: &str, validity: Validity) -> anyhow::Result<Pki> {
        std::fs::create_dir_all(dir)?;
        let ca_key = KeyPair::generate()?;
        let ca = ca_params(name, validity.ca_until)?;
        let ca_cert = ca.self_signed(&ca_key)?;
        replace(dir, CA, ca_cert.pem().as_bytes())?;
        replace(dir, CA_KEY, ca_key.serialize_pem().as_bytes())?;
        let issuer = Issuer::new(ca, ca_key);
        let (cert, key) = leaf(
            &issuer,
            &format!("{name} etcd server"),
            vec!["127.0.0.1".into(), "localhost".into()],
            // etcd's own gateway dials the member with the server certificate as a client one.
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth],
            validity.leaf_until,
        )?;
        replace(dir, SERVER_CERT, cert.as_bytes())?;
        replace(dir, SERVER_KEY, key.as_bytes())?;
        let pki = Pki { dir: dir.to_owned(), name: name.to_owned(), client_not_after: 0 };
        pki.issue_client(&issuer, validity.leaf_until)
    }

    /// A new client certificate and key from the same CA, valid until `until` (year, month,
    /// day), replacing the client files in place, each by an atomic rename.
    pub fn reissue_client(&self, until: (i32, u8, u8)) -> anyhow::Result<Pki> {
        // An issuer is its subject and key; the validity given here is not used for signing.
        let ca_key = KeyPair::from_pem(&std::fs::read_to_string(self.path(CA_KEY))?)?;
        let issuer = Issuer::new(ca_params(&self.name, until)?, ca_key);
        self.issue_client(&issuer, until)
    }

    fn issue_client(&self, issuer: &Issuer<'_, KeyPair>, until: (i32, u8, u8)) -> anyhow::Result<Pki> {
        let usage = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let (cert, key) = leaf(issuer, &format!("{} mirror client", self.name), Vec::new(), usage, until)?;
        replace(&self.dir, CLIENT_CERT, cert.as_bytes())?;
        replace(&self.dir, CLIENT_KEY, key.as_bytes())?;
        let (y, m, d) = until;
        Ok(Pki { client_not_after: date_time_ymd(y, m, d).unix_timestamp(), ..self.clone() })
    }

    /// Path of one of the files.
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// The client side's `[tls]` block: this CA, the client certificate and key.
    pub fn client_tls(&self) -> mirror_core::Tls {
        client_tls_in(&self.dir)
    }

    /// The `[SIDE.tls]` section of an agent config using this PKI's client files.
    pub fn toml(&self, side: &str) -> String {
        format!(
            "[{side}.tls]\nca_file = {:?}\ncert_file = {:?}\nkey_file = {:?}\n",
            self.path(CA),
            self.path(CLIENT_CERT),
            self.path(CLIENT_KEY)
        )
    }

    /// Copies every file of this PKI over the files of `into`, each by an atomic rename, the
    /// way a secret volume or cert-manager replaces them.
    pub fn install_over(&self, into: &Path) -> anyhow::Result<()> {
        for file in [CA, CA_KEY, SERVER_CERT, SERVER_KEY, CLIENT_CERT, CLIENT_KEY] {
            replace(into, file, &std::fs::read(self.path(file))?)?;
        }
        Ok(())
    }
}

/// The `[tls]` block of a client using the CA and client files of the PKI directory `dir`.
pub fn client_tls_in(dir: &Path) -> mirror_core::Tls {
    mirror_core::Tls {
        ca_file: Some(dir.join(CA)),
        cert_file: Some(dir.join(CLIENT_CERT)),
        key_file: Some(dir.join(CLIENT_KEY)),
        ..mirror_core::Tls::default()
    }
}

/// The CA of PKI `name`: its subject is derived from the name alone.
fn ca_params(name: &str, (y, m, d): (i32, u8, u8)) -> anyhow::Result<CertificateParams> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_after = date_time_ymd(y, m, d);
    Ok(ca)
}

/// A leaf certificate signed by `issuer`, as (certificate PEM, key PEM).
fn leaf(
    issuer: &Issuer<'_, KeyPair>,
    cn: &str,
    sans: Vec<String>,
    usage: Vec<ExtendedKeyUsagePurpose>,
    (y, m, d): (i32, u8, u8),
) -> anyhow::Result<(String, String)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(sans)?;
    params.distinguished_name.push(DnType::CommonName, cn);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages = usage;
    params.not_after = date_time_ymd(y, m, d);
    let cert = params.signed_by(&key, issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Writes `dir/file` through a temporary file renamed over it, so readers never see half a file.
fn replace(dir: &Path, file: &str, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = dir.join(format!(".{file}.new"));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, dir.join(file)).with_context(|| format!("replacing {}", dir.join(file).display()))
}
