//! Reading a TLS refusal out of an error: whether a connect or request failed because a
//! certificate was refused (by us or by the server), and what the operator should check. Pure
//! inspection of rustls errors; it reads no config and no file, so error classification
//! (`error.rs`) depends on it without depending on the TLS settings (`tls.rs`).

use crate::side::Side;

/// Whether a connect error (or anything in its source chain) is a TLS rejection: a certificate
/// the client refused, or an alert the server sent about ours.
pub fn is_tls_rejection(err: &(dyn std::error::Error + 'static)) -> bool {
    rejection(err).is_some() || late_alert(err).is_some()
}

/// A fatal alert the server sent after the handshake, as its text (`"received fatal alert:
/// UnknownCA"`). A TLS 1.3 server checks the client certificate after the client has finished
/// its side of the handshake (etcd 3.5.30, built with Go 1.26, does), so the refusal arrives with
/// the first request, and rustls hands it over as an I/O error carrying only that text, not as
/// a [`rustls::Error`].
pub fn late_alert(err: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            let text = io.get_ref().map(|inner| inner.to_string()).unwrap_or_default();
            if io.kind() == std::io::ErrorKind::InvalidData && text.starts_with("received fatal alert") {
                return Some(text);
            }
        }
        next = e.source();
    }
    None
}

/// The rustls error in `err`'s source chain, looking inside I/O errors too (their `source()`
/// skips the error they wrap).
pub fn rejection<'e>(err: &'e (dyn std::error::Error + 'static)) -> Option<&'e rustls::Error> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(tls) = e
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
            .and_then(|i| i.downcast_ref())
        {
            return Some(tls);
        }
        next = e.source();
    }
    None
}

/// What to check when the server refused the client certificate.
pub fn client_cert_hint(side: Side) -> String {
    format!("the server refused our client certificate; check {side}.tls.cert_file against the server's --trusted-ca-file")
}

/// What an operator should check for a TLS rejection, naming the config field.
pub fn hint(side: Side, err: &rustls::Error) -> String {
    use rustls::{AlertDescription as A, CertificateError as C};
    match err {
        rustls::Error::InvalidCertificate(C::UnknownIssuer | C::BadSignature) => {
            format!("the server's certificate is not signed by a CA in {side}.tls.ca_file (without one: the system's CA roots)")
        }
        rustls::Error::InvalidCertificate(C::NotValidForName | C::NotValidForNameContext { .. }) => format!(
            "the server's certificate is not valid for the name checked: {side}.tls.server_name, or the endpoint's host when that is empty"
        ),
        rustls::Error::InvalidCertificate(C::Expired | C::ExpiredContext { .. }) => {
            "the server's certificate has expired".to_owned()
        }
        rustls::Error::AlertReceived(
            A::BadCertificate
            | A::UnknownCA
            | A::CertificateRequired
            | A::CertificateExpired
            | A::CertificateRevoked
            | A::CertificateUnknown
            | A::UnsupportedCertificate
            | A::AccessDenied,
        ) => client_cert_hint(side),
        _ => format!("check the files of [{side}.tls]"),
    }
}
