//! Free loopback ports for members and agents.

use std::net::TcpListener;

/// `n` distinct ports that were free a moment ago. All are held open together while probing so
/// the kernel never hands out the same one twice; a race with another process is still possible
/// and callers retry a failed start on fresh ports.
pub fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let listeners = (0..n).map(|_| TcpListener::bind("127.0.0.1:0")).collect::<std::io::Result<Vec<_>>>()?;
    listeners.iter().map(|l| l.local_addr().map(|a| a.port())).collect()
}
