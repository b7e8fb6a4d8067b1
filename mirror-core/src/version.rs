//! Version gates: what a server's version says about the behaviour the engine relies on.

/// Parses `major.minor.patch` (ignoring any suffix) for version gates.
pub fn parse_version(v: &str) -> Option<(u32, u32, u32)> {
    let mut it = v.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty());
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// Whether etcd's progress notifications are trustworthy in this version (fixed in 3.4.25 and
/// 3.5.8; older servers could send a notification ahead of events still to be delivered).
pub fn progress_notify_trustworthy(version: &str) -> bool {
    match parse_version(version) {
        Some((3, 4, p)) => p >= 25,
        Some((3, 5, p)) => p >= 8,
        Some((major, minor, _)) => (major, minor) > (3, 5),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The progress-notify gate follows the fixed releases of 3.4 and 3.5.
    #[test]
    fn progress_notify_gate() {
        assert!(!progress_notify_trustworthy("3.4.23"));
        assert!(progress_notify_trustworthy("3.4.25"));
        assert!(!progress_notify_trustworthy("3.5.1"));
        assert!(progress_notify_trustworthy("3.5.8"));
        assert!(progress_notify_trustworthy("3.6.0"));
        assert!(!progress_notify_trustworthy("garbage"));
        assert_eq!(parse_version("3.5.1-rc.0"), Some((3, 5, 1)));
    }
}
