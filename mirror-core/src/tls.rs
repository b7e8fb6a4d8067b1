//! TLS material of one side: read from disk on every connect, checked before use, and the
//! expiry of what was loaded.
//!
//! Nothing is cached between connects, so certificates and CA bundles replaced on disk are used
//! from the next connect on. The agent connects afresh after every lost connection and when
//! [`fingerprint`] shows the files changed (it checks every few seconds while tailing), so a
//! rotation takes effect within seconds and needs no restart. A TLS session that is already up
//! keeps the material it was established with; TLS never re-checks a live session.

use std::path::Path;
use std::sync::Arc;

use etcd_client::{Certificate, Identity, TlsOptions};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use x509_cert::der::Decode;

use crate::config::Tls;
use crate::side::Side;

/// What a connect needs: the tonic TLS settings and, only with an acknowledged
/// `insecure_skip_verify`, a verifier that accepts any server certificate.
#[derive(Clone, Debug)]
pub struct TlsMaterial {
    /// CA roots, client identity and server name.
    pub options: TlsOptions,
    /// Set only for `insecure_skip_verify`.
    pub verifier: Option<Arc<dyn ServerCertVerifier>>,
}

/// A file that could not be used, named by its config field.
#[derive(Debug, thiserror::Error)]
#[error("{field}: {message}")]
pub struct TlsFileError {
    /// E.g. `target.tls.ca_file`.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

/// The expiry of one loaded certificate, for `etcd_mirror_tls_cert_expiry_timestamp_seconds`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CertExpiry {
    /// `ca` or `client`.
    pub kind: String,
    /// The earliest `notAfter` among the certificates of the file, Unix seconds.
    pub not_after: i64,
}

/// Reads and checks the files of `tls`. Errors name the field and the path, never key material.
pub fn load(side: Side, tls: &Tls) -> Result<TlsMaterial, TlsFileError> {
    let mut options = TlsOptions::new();
    if !tls.server_name.is_empty() {
        options = options.domain_name(tls.server_name.clone());
    }
    match &tls.ca_file {
        // Skip-verify replaces the verifier; tonic refuses roots next to it.
        _ if tls.insecure_skip_verify => {}
        Some(path) => {
            let pem = read_certificates(side, "ca_file", path)?;
            options = options.ca_certificate(Certificate::from_pem(pem));
        }
        None => options = options.with_native_roots(),
    }
    if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
        let cert_pem = read_certificates(side, "cert_file", cert)?;
        let key_pem = read(side, "key_file", key)?;
        if PrivateKeyDer::from_pem_slice(&key_pem).is_err() {
            return Err(field_error(side, "key_file", format!("{} holds no PEM private key", key.display())));
        }
        options = options.identity(Identity::from_pem(cert_pem, key_pem));
    }
    let verifier: Option<Arc<dyn ServerCertVerifier>> = if tls.insecure_skip_verify {
        let provider = rustls::crypto::ring::default_provider();
        Some(Arc::new(AcceptAnyServerCert { algorithms: provider.signature_verification_algorithms }))
    } else {
        None
    };
    Ok(TlsMaterial { options, verifier })
}

/// A rustls client configuration from the same files as [`load`], for plain HTTPS requests to
/// the side's members (the client URL's `/version`, read when Maintenance Status is refused):
/// the CA bundle (or the system's roots), the client certificate, `server_name` checked in place
/// of the URL's host, or any certificate with an acknowledged `insecure_skip_verify`.
pub fn https_config(side: Side, tls: &Tls) -> Result<rustls::ClientConfig, TlsFileError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier: Arc<dyn ServerCertVerifier> = if tls.insecure_skip_verify {
        Arc::new(AcceptAnyServerCert { algorithms: provider.signature_verification_algorithms })
    } else {
        let mut roots = rustls::RootCertStore::empty();
        match &tls.ca_file {
            Some(path) => {
                let pem = read_certificates(side, "ca_file", path)?;
                for der in CertificateDer::pem_slice_iter(&pem).flatten() {
                    roots
                        .add(der)
                        .map_err(|e| field_error(side, "ca_file", format!("{}: {e}", path.display())))?;
                }
            }
            None => {
                for der in rustls_native_certs::load_native_certs().certs {
                    let _ = roots.add(der);
                }
            }
        }
        let webpki =
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| field_error(side, "ca_file", format!("no usable CA: {e}")))?;
        if tls.server_name.is_empty() {
            webpki
        } else {
            let name = ServerName::try_from(tls.server_name.clone())
                .map_err(|e| field_error(side, "server_name", format!("{:?}: {e}", tls.server_name)))?;
            Arc::new(NamedServerCert { inner: webpki, name })
        }
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| field_error(side, "tls", format!("no TLS version in common: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => {
            let cert_pem = read_certificates(side, "cert_file", cert)?;
            let chain: Vec<CertificateDer<'static>> =
                CertificateDer::pem_slice_iter(&cert_pem).flatten().collect();
            let key_pem = read(side, "key_file", key)?;
            let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| {
                field_error(side, "key_file", format!("{} holds no PEM private key", key.display()))
            })?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| field_error(side, "key_file", format!("{}: {e}", key.display())))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// A server certificate checked against `server_name` (`[*.tls] server_name`) rather than the
/// host of the URL asked, as the gRPC connects do.
#[derive(Debug)]
struct NamedServerCert {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    name: ServerName<'static>,
}

impl ServerCertVerifier for NamedServerCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner.verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The expiry of the CA bundle and the client certificate configured in `tls`, as on disk now.
/// A file that cannot be read or holds no usable certificate has no series (the connect refuses
/// it, naming its field); it is logged here too, so a gauge gone missing is never silent.
pub fn expiry(tls: &Tls) -> Vec<CertExpiry> {
    let mut out = Vec::new();
    for (kind, path) in [("ca", &tls.ca_file), ("client", &tls.cert_file)] {
        let Some(path) = path else { continue };
        let read = std::fs::read(path).map_err(|e| e.to_string());
        match read.and_then(|pem| earliest_not_after(&pem).map_err(|e| e.to_string())) {
            Ok(not_after) => out.push(CertExpiry { kind: kind.to_owned(), not_after }),
            Err(e) => tracing::warn!(kind, path = %path.display(), "no certificate expiry to report: {e}"),
        }
    }
    out
}

/// Why a file gives no `notAfter`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoExpiry {
    /// A PEM block is malformed.
    #[error("bad PEM: {0}")]
    BadPem(String),
    /// A certificate block does not parse as X.509: which one (from 1), and why.
    #[error("certificate {0} is not valid X.509: {1}")]
    BadCertificate(usize, String),
    /// Not one certificate in the file (not PEM at all, or only other blocks such as a key).
    #[error("holds no PEM certificate")]
    NoCertificate,
}

/// A digest of the paths and contents of the files `tls` names, to notice a rotation on disk
/// without keeping any material in memory. A missing file digests differently from any content.
pub fn fingerprint(tls: &Tls) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for path in [&tls.ca_file, &tls.cert_file, &tls.key_file] {
        match path {
            Some(path) => {
                h.update(path.as_os_str().as_encoded_bytes());
                match std::fs::read(path) {
                    Ok(bytes) => {
                        h.update([1]);
                        h.update((bytes.len() as u64).to_le_bytes());
                        h.update(bytes);
                    }
                    Err(_) => h.update([2]),
                }
            }
            None => h.update([0]),
        }
    }
    h.finalize().into()
}

/// The earliest `notAfter` of the PEM certificates in `pem`, Unix seconds. A file that is not
/// PEM, holds no certificate, or holds one that is malformed is an error, not a file without
/// expiry.
pub fn earliest_not_after(pem: &[u8]) -> Result<i64, NoExpiry> {
    let mut earliest: Option<i64> = None;
    for (n, der) in CertificateDer::pem_slice_iter(pem).enumerate() {
        let der = der.map_err(|e| NoExpiry::BadPem(e.to_string()))?;
        let cert = x509_cert::Certificate::from_der(der.as_ref())
            .map_err(|e| NoExpiry::BadCertificate(n + 1, e.to_string()))?;
        let not_after = cert.tbs_certificate.validity.not_after.to_unix_duration().as_secs() as i64;
        earliest = Some(earliest.map_or(not_after, |e| e.min(not_after)));
    }
    earliest.ok_or(NoExpiry::NoCertificate)
}

fn field_error(side: Side, field: &str, message: String) -> TlsFileError {
    TlsFileError { field: format!("{side}.tls.{field}"), message }
}

fn read(side: Side, field: &str, path: &Path) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(path).map_err(|e| field_error(side, field, format!("cannot read {}: {e}", path.display())))
}

/// Reads a PEM file that must hold at least one well-formed certificate.
fn read_certificates(side: Side, field: &str, path: &Path) -> Result<Vec<u8>, TlsFileError> {
    let pem = read(side, field, path)?;
    earliest_not_after(&pem).map_err(|e| field_error(side, field, format!("{}: {e}", path.display())))?;
    Ok(pem)
}

/// `insecure_skip_verify`: any server certificate is accepted, for any name. The handshake
/// signatures are still checked, so the peer at least holds the key of the certificate it shows.
#[derive(Debug)]
struct AcceptAnyServerCert {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for AcceptAnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file without a certificate is refused, naming the field and the path.
    #[test]
    fn unusable_files_name_their_field() {
        let dir = std::env::temp_dir().join(format!("mirror-core-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate\n").unwrap();
        let tls = Tls { ca_file: Some(junk.clone()), ..Tls::default() };
        let err = load(Side::Target, &tls).unwrap_err();
        assert_eq!(err.field, "target.tls.ca_file");
        assert!(err.message.contains("holds no PEM certificate"), "{err}");

        let missing = Tls { ca_file: Some(dir.join("missing.pem")), ..Tls::default() };
        let err = load(Side::Source, &missing).unwrap_err();
        assert_eq!(err.field, "source.tls.ca_file");
        assert!(err.message.contains("cannot read"), "{err}");
        assert!(expiry(&missing).is_empty());
        std::fs::remove_dir_all(&dir).ok();
    }

    fn self_signed_until(year: i32) -> String {
        let mut params = rcgen::CertificateParams::new(vec![format!("until-{year}")]).unwrap();
        params.not_after = rcgen::date_time_ymd(year, 1, 1);
        params.self_signed(&rcgen::KeyPair::generate().unwrap()).unwrap().pem()
    }

    /// The gauge's inputs: only the files configured, a bundle by its earliest `notAfter`
    /// (whatever its order), and a file gone from disk drops its series.
    #[test]
    fn expiry_reports_configured_files_and_a_bundles_earliest() {
        let dir = std::env::temp_dir().join(format!("mirror-core-expiry-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let at = |year: i32| rcgen::date_time_ymd(year, 1, 1).unix_timestamp();
        let bundle = dir.join("bundle.pem");
        std::fs::write(
            &bundle,
            format!("{}{}{}", self_signed_until(2040), self_signed_until(2031), self_signed_until(2035)),
        )
        .unwrap();
        let client = dir.join("client.pem");
        std::fs::write(&client, self_signed_until(2033)).unwrap();

        assert!(expiry(&Tls::default()).is_empty(), "no TLS files, no series");
        let ca_only = Tls { ca_file: Some(bundle.clone()), ..Tls::default() };
        assert_eq!(expiry(&ca_only), [CertExpiry { kind: "ca".into(), not_after: at(2031) }]);
        let both = Tls { ca_file: Some(bundle.clone()), cert_file: Some(client.clone()), ..Tls::default() };
        assert_eq!(
            expiry(&both),
            [
                CertExpiry { kind: "ca".into(), not_after: at(2031) },
                CertExpiry { kind: "client".into(), not_after: at(2033) }
            ]
        );
        // The key file is configured but is not a certificate: never a series of its own.
        let with_key = Tls { key_file: Some(client.clone()), ..ca_only.clone() };
        assert_eq!(expiry(&with_key).len(), 1);

        std::fs::remove_file(&bundle).unwrap();
        assert_eq!(expiry(&both), [CertExpiry { kind: "client".into(), not_after: at(2033) }]);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Upstream's TestEarliestNotAfterNoCertificate: a file that is not PEM, or PEM without a
    /// certificate, or with a block that is not X.509, is an error (never "no expiry"); the
    /// earliest of several certificates wins.
    #[test]
    fn earliest_not_after_refuses_a_file_without_a_certificate() {
        use super::NoExpiry;
        assert_eq!(earliest_not_after(b"not a certificate at all\n"), Err(NoExpiry::NoCertificate));
        assert_eq!(earliest_not_after(b""), Err(NoExpiry::NoCertificate));
        let key = rcgen::KeyPair::generate().unwrap().serialize_pem();
        assert_eq!(
            earliest_not_after(key.as_bytes()),
            Err(NoExpiry::NoCertificate),
            "a key is no certificate"
        );
        let garbage = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert!(matches!(earliest_not_after(garbage.as_bytes()), Err(NoExpiry::BadCertificate(1, _))));
        let two = format!("{}{}", self_signed_until(2036), self_signed_until(2032));
        let at = rcgen::date_time_ymd(2032, 1, 1).unix_timestamp();
        assert_eq!(earliest_not_after(two.as_bytes()), Ok(at));
    }
}
