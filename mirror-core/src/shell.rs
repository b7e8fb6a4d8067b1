//! Fix commands an operator can paste: keys quoted for a POSIX shell, and the commands that
//! delete exactly a set of key ranges. Error messages carry them (the `require_empty` refusal,
//! another link's checkpoint in the way), so clearing the way never means working out a range
//! end by hand.
//!
//! A shell word cannot hold a NUL byte, and the reserved namespace of every link starts with
//! one ([`crate::RESERVED_MARKER`]); a range bound holding NUL is deleted through etcd's JSON
//! gateway (`curl … /v3/kv/deleterange`, keys in base64) instead of `etcdctl`. Only
//! configuration-derived keys (prefixes, range ends, reserved namespaces) go into these
//! commands, never a key read from etcd: they are not redacted.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;

use crate::keys::KeyRange;

/// `bytes` as one shell word: `'…'` when every byte is printable ASCII or a space and none is
/// `'`, otherwise bash's `$'…'` with `\\`, `\'` and `\xNN` escapes (bash, zsh and ksh read it; a
/// non-UTF-8 byte survives the round trip). `None` for bytes holding NUL, which no shell word
/// can carry.
pub fn shell_quote(bytes: &[u8]) -> Option<String> {
    if bytes.contains(&0) {
        return None;
    }
    let plain = |b: u8| (b.is_ascii_graphic() && b != b'\'') || b == b' ';
    if !bytes.is_empty() && bytes.iter().all(|&b| plain(b)) {
        return Some(format!("'{}'", String::from_utf8_lossy(bytes)));
    }
    let mut out = String::from("$'");
    for &b in bytes {
        match b {
            b'\\' => out.push_str("\\\\"),
            b'\'' => out.push_str("\\'"),
            b if plain(b) => out.push(b as char),
            b => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    out.push('\'');
    Some(out)
}

/// Commands, one per range, that delete exactly `ranges` of the cluster at `endpoints`:
/// `etcdctl del` (`--prefix`, `--from-key`, a single key or start and end), or a `curl` to the
/// first endpoint's JSON gateway where a bound holds NUL. TLS and auth flags are the operator's
/// to add.
pub fn delete_commands(endpoints: &[String], ranges: &[KeyRange]) -> Vec<String> {
    let joined = endpoints.join(",");
    let at = format!("etcdctl --endpoints={}", word(joined.as_bytes()));
    ranges
        .iter()
        .map(|r| {
            let single =
                r.end.len() == r.start.len() + 1 && r.end.starts_with(&r.start) && r.end.ends_with(&[0]);
            let command = match shell_quote(&r.start) {
                Some(start) if single => Some(format!("{at} del {start}")),
                Some(start) if r.end == [0] => Some(format!("{at} del --from-key {start}")),
                Some(start) if r.end == crate::keys::prefix_end(&r.start) => {
                    Some(format!("{at} del --prefix {start}"))
                }
                Some(start) => shell_quote(&r.end).map(|end| format!("{at} del {start} {end}")),
                None => None,
            };
            command.unwrap_or_else(|| gateway_delete(endpoints.first().map_or("", String::as_str), r, single))
        })
        .collect()
}

/// Deletes `r` through etcd's gRPC JSON gateway, which takes keys in base64.
fn gateway_delete(endpoint: &str, r: &KeyRange, single: bool) -> String {
    let mut body = format!("{{\"key\":\"{}\"", B64.encode(&r.start));
    if !single {
        body.push_str(&format!(",\"range_end\":\"{}\"", B64.encode(&r.end)));
    }
    body.push('}');
    let url = format!("{}/v3/kv/deleterange", endpoint.trim_end_matches('/'));
    format!("curl -sS --fail -X POST {} -d {}", word(url.as_bytes()), word(body.as_bytes()))
}

/// A word that holds no NUL (URLs, endpoint lists, JSON).
fn word(bytes: &[u8]) -> String {
    shell_quote(bytes).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What bash makes of `words`: the bytes it prints for them, one per line.
    fn bash_prints(words: &str) -> Vec<u8> {
        let out = std::process::Command::new("bash")
            .args(["-c", &format!("printf '%s\\n' {words}")])
            .output()
            .expect("bash runs");
        assert!(out.status.success(), "{words}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    }

    /// Every key comes back from bash byte for byte: spaces, quotes, backslashes, `$`, control
    /// and non-UTF-8 bytes included; a key holding NUL is no shell word at all.
    #[test]
    fn bash_reads_back_exactly_the_key() {
        let keys: [&[u8]; 7] = [
            b"/app/",
            b"/my app/",
            b"/it's/",
            b"/a b'c\xff/",
            b"/back\\slash/$HOME/`x`/\"q\"/",
            b"/tab\t/newline\n/",
            b"",
        ];
        for key in keys {
            let word = shell_quote(key).unwrap();
            assert_eq!(bash_prints(&word), [key, b"\n"].concat(), "{word}");
        }
        assert_eq!(shell_quote(b"/app/").unwrap(), "'/app/'", "plain keys stay readable");
        assert_eq!(shell_quote(b"/a/\x00etcd-mirror/"), None);
    }

    /// A prefix range is `del --prefix`, an open end `--from-key`, a single key itself, anything
    /// else start and end; a bound holding NUL goes to the JSON gateway, base64-encoded.
    #[test]
    fn commands_name_each_range_exactly() {
        let endpoints = vec!["https://a:2379".to_owned(), "https://b:2379".to_owned()];
        let ranges = [
            KeyRange::prefix(b"/a b/"),
            KeyRange { start: b"/x/".to_vec(), end: b"/x/m".to_vec() },
            KeyRange { start: b"/z".to_vec(), end: vec![0] },
            KeyRange { start: b"/k".to_vec(), end: b"/k\0".to_vec() },
            KeyRange { start: b"/c/".to_vec(), end: b"/c/\0etcd-mirror/".to_vec() },
            KeyRange {
                start: b"/c/\0etcd-mirror/checkpoint".to_vec(),
                end: b"/c/\0etcd-mirror/checkpoint\0".to_vec(),
            },
        ];
        let at = "etcdctl --endpoints='https://a:2379,https://b:2379'";
        assert_eq!(
            delete_commands(&endpoints, &ranges),
            [
                format!("{at} del --prefix '/a b/'"),
                format!("{at} del '/x/' '/x/m'"),
                format!("{at} del --from-key '/z'"),
                format!("{at} del '/k'"),
                format!(
                    "curl -sS --fail -X POST 'https://a:2379/v3/kv/deleterange' -d '{{\"key\":\"{}\",\"range_end\":\"{}\"}}'",
                    B64.encode(b"/c/"),
                    B64.encode(b"/c/\0etcd-mirror/")
                ),
                format!(
                    "curl -sS --fail -X POST 'https://a:2379/v3/kv/deleterange' -d '{{\"key\":\"{}\"}}'",
                    B64.encode(b"/c/\0etcd-mirror/checkpoint")
                ),
            ]
        );
    }
}
