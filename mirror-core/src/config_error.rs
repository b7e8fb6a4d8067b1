//! Why a config could not be used ([`ConfigError`]), and each broken rule ([`Violation`]) named
//! by its field.

use std::fmt;
use std::path::PathBuf;

/// One broken rule: the field (dotted path, as in the file) and what it must be.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Violation {
    /// Dotted path of the field, e.g. `sync.max_txn_ops` or `source.endpoints[1]`.
    pub field: String,
    /// The rule, phrased so that `field rule` reads as a sentence.
    pub rule: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.rule)
    }
}

/// Why a config could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O failure.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("cannot parse config: {0}")]
    Parse(String),
    /// The file parsed but breaks rules.
    #[error("invalid config:\n{}", .0.iter().map(|v| format!("  - {v}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Violation>),
}
