//! The credentials of a side (`[source.auth]`, `[target.auth]`) and the one place a password
//! is read. The config schema names where a password lives; it never holds one: a `password`
//! field is parsed only to be refused by validation.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `[source.auth]` / `[target.auth]`: a user whose password comes from a file or the environment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Auth {
    /// The etcd user.
    #[serde(default)]
    pub username: String,
    /// File holding the password (trailing newline ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
    /// Environment variable holding the password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_env: Option<String>,
    /// Accepted by the parser only to be refused by `validate` with a clear message:
    /// passwords never live in the config file.
    #[serde(default, skip_serializing_if = "Option::is_none", serialize_with = "redact")]
    pub password: Option<String>,
}

fn redact<S: serde::Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(_) => s.serialize_str("<redacted>"),
        None => s.serialize_none(),
    }
}

/// The password of `auth`, from its file (one trailing newline dropped) or environment variable.
/// An empty one is an error: it is a Secret that was never filled in, not a password.
pub fn read_password(auth: &Auth) -> Result<String, String> {
    if let Some(path) = &auth.password_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read password_file {}: {e}", path.display()))?;
        let password =
            text.strip_suffix('\n').map(|t| t.strip_suffix('\r').unwrap_or(t)).unwrap_or(&text).to_owned();
        if password.is_empty() {
            return Err(format!("password_file {} is empty", path.display()));
        }
        return Ok(password);
    }
    if let Some(var) = &auth.password_env {
        let password = std::env::var(var).map_err(|_| format!("password_env {var} is not set"))?;
        if password.is_empty() {
            return Err(format!("password_env {var} is empty"));
        }
        return Ok(password);
    }
    Err("needs password_file or password_env".into())
}
