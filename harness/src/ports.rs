//! Free loopback ports for members and agents.
//!
//! nextest runs every test in a process of its own, and several lanes at once
//! (`.config/nextest.toml`): a port one test process probed, released and later bound (a member
//! restarted after a stop keeps its port) must never be handed to another process meanwhile, or
//! a client of one test talks to another test's etcd (a CI run saw one scenario's churn delete
//! keys in another scenario's source). Ports are therefore claimed machine-wide, by creating a
//! file named after the port in a shared directory; a claim older than [`STALE`] belongs to a
//! finished run and is taken over.

use std::collections::HashSet;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::{OnceLock, RwLock};
use std::time::Duration;

/// A claim this old is a finished run's.
const STALE: Duration = Duration::from_secs(3600);

/// Probes before giving up on the machine-wide registry (every free port claimed recently):
/// the in-process set alone then decides.
const MAX_PROBES: usize = 4096;

/// Ports this process has handed out already. A stopped member keeps its port in the plan and
/// binds it again when started, so no later caller in the same process (say an agent's HTTP
/// port) may be given it meanwhile.
fn handed_out() -> &'static RwLock<HashSet<u16>> {
    static PORTS: OnceLock<RwLock<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(|| RwLock::new(HashSet::new()))
}

fn registry() -> PathBuf {
    std::env::temp_dir().join("etcd-mirror-harness-ports")
}

/// Claims `port` for this process machine-wide; false when another process holds a fresh claim.
fn claim(port: u16) -> bool {
    let dir = registry();
    if std::fs::create_dir_all(&dir).is_err() {
        return true;
    }
    let path = dir.join(port.to_string());
    let create = || std::fs::OpenOptions::new().write(true).create_new(true).open(&path);
    match create() {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let age = std::fs::metadata(&path)
                .and_then(|m| m.modified())
                .map(|t| t.elapsed().unwrap_or_default())
                .unwrap_or_default();
            // Of two processes taking over one stale claim, only one creates the file anew.
            age > STALE && std::fs::remove_file(&path).is_ok() && create().is_ok()
        }
        Err(_) => true,
    }
}

/// `n` distinct ports that were free a moment ago and were never handed out before on this
/// machine within the last hour (by any test process). All probes are held open together so the
/// kernel never gives the same one twice; a race with another program is still possible and
/// callers retry a failed start on fresh ports.
pub fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let mut held = Vec::new();
    let mut out = Vec::with_capacity(n);
    let mut given = handed_out().write().expect("ports lock");
    let mut probes = 0;
    while out.len() < n {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        held.push(listener);
        probes += 1;
        if given.contains(&port) || (probes < MAX_PROBES && !claim(port)) {
            continue;
        }
        given.insert(port);
        out.push(port);
    }
    Ok(out)
}
