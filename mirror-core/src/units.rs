//! Human-readable sizes ("1MiB") and durations ("30s") for the config file.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

/// A byte count written as an integer or a string with a binary or decimal unit:
/// `1048576`, `"1MiB"`, `"512KiB"`, `"2MB"`, `"100B"`.
///
/// Units are case-sensitive so that `"1mb"` (millibits?) is an error rather than a guess.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

const UNITS: &[(&str, u64)] = &[
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("B", 1),
];

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = (&s[..split], s[split..].trim());
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("{s:?} is not a size (expected e.g. \"1MiB\", \"512KiB\", \"4096\")"))?;
        let mult = if unit.is_empty() {
            1
        } else {
            UNITS.iter().find(|(u, _)| *u == unit).map(|(_, m)| *m).ok_or_else(|| {
                format!("{s:?} has unknown unit {unit:?} (use B, KiB, MiB, GiB, KB, MB, GB)")
            })?
        };
        n.checked_mul(mult).map(ByteSize).ok_or_else(|| format!("{s:?} overflows 64 bits"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (unit, mult) in [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
            if self.0 >= mult && self.0.is_multiple_of(mult) {
                return write!(f, "{}{unit}", self.0 / mult);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as \"1MiB\" or a number of bytes")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v).map(ByteSize).map_err(|_| E::custom(format!("size {v} is negative")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration written as a humantime string: `"30s"`, `"1h"`, `"250ms"`, `"0s"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// The duration.
    pub fn get(self) -> Duration {
        self.0
    }

    /// A duration of `secs` seconds.
    pub const fn secs(secs: u64) -> Self {
        HumanDuration(Duration::from_secs(secs))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_zero() {
            return f.write_str("0s");
        }
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(s.trim()).map(HumanDuration).map_err(|e| {
            de::Error::custom(format!("{s:?} is not a duration ({e}); write e.g. \"30s\", \"1h\", \"250ms\""))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes accept binary and decimal units and round-trip through Display.
    #[test]
    fn sizes_parse_and_print() {
        assert_eq!("1MiB".parse::<ByteSize>().unwrap(), ByteSize(1 << 20));
        assert_eq!("512KiB".parse::<ByteSize>().unwrap(), ByteSize(512 << 10));
        assert_eq!("2MB".parse::<ByteSize>().unwrap(), ByteSize(2_000_000));
        assert_eq!("4096".parse::<ByteSize>().unwrap(), ByteSize(4096));
        assert_eq!(ByteSize(16 << 20).to_string(), "16MiB");
        assert_eq!(ByteSize(1000).to_string(), "1000B");
        assert!("1mb".parse::<ByteSize>().is_err());
        assert!("MiB".parse::<ByteSize>().is_err());
        assert!("-1MiB".parse::<ByteSize>().is_err());
        assert!("99999999999999GiB".parse::<ByteSize>().is_err());
    }
}
