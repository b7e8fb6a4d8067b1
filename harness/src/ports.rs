//! Free loopback ports for members and agents.

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::{OnceLock, RwLock};

/// Ports this process has handed out already. A stopped member keeps its port in the plan and
/// binds it again when started, so no later caller in the same process (say an agent's HTTP
/// port) may be given it meanwhile.
fn handed_out() -> &'static RwLock<HashSet<u16>> {
    static PORTS: OnceLock<RwLock<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(|| RwLock::new(HashSet::new()))
}

/// `n` distinct ports that were free a moment ago and were never handed out before in this
/// process. All probes are held open together so the kernel never gives the same one twice; a
/// race with another process is still possible and callers retry a failed start on fresh ports.
pub fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let mut held = Vec::new();
    let mut out = Vec::with_capacity(n);
    let mut given = handed_out().write().expect("ports lock");
    while out.len() < n {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        held.push(listener);
        if given.insert(port) {
            out.push(port);
        }
    }
    Ok(out)
}
