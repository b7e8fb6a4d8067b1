//! A TCP fault proxy: the agent talks to a side through it, and a test cuts and heals the
//! network in between.
//!
//! A cut is a *blackhole*, like a real partition: bytes stop flowing both ways on existing
//! connections and new connections are accepted but never answered. Nothing is reset, so the
//! client has to notice by itself (gRPC keepalive), exactly as it would in production. On heal
//! the blackholed connections are closed (their streams lost bytes and cannot continue) and new
//! connections are relayed again. A delay holds every chunk for that long before passing it on,
//! both ways (a slow or distant link). A rewriting proxy ([`FaultProxy::start_rewriting`])
//! also swaps one byte string for another of the same length in what the server sends, which
//! lets a current etcd pose as another version (gRPC and the HTTP gateway are plaintext).

use std::net::SocketAddr;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// One proxied upstream address.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    delay_ms: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

/// A byte string and what replaces it, of the same length.
type Rewrite = Arc<(Vec<u8>, Vec<u8>)>;

impl FaultProxy {
    /// Listens on a free loopback port and relays every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        FaultProxy::listen(upstream, None).await
    }

    /// As [`FaultProxy::start`], and every `from` in the server's bytes reaches the client as
    /// `to` (same length, so HTTP/2 framing stays intact; a match split across two reads is
    /// missed, which a short answer such as a version never is).
    pub async fn start_rewriting(
        upstream: SocketAddr,
        from: &[u8],
        to: &[u8],
    ) -> std::io::Result<FaultProxy> {
        assert_eq!(from.len(), to.len(), "a rewrite keeps the length");
        assert!(!from.is_empty());
        FaultProxy::listen(upstream, Some(Arc::new((from.to_vec(), to.to_vec())))).await
    }

    async fn listen(upstream: SocketAddr, rewrite: Option<Rewrite>) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (cut, _) = watch::channel(false);
        let state = cut.clone();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let delay = delay_ms.clone();
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let _ = inbound.set_nodelay(true);
                tokio::spawn(relay(inbound, upstream, state.subscribe(), delay.clone(), rewrite.clone()));
            }
        });
        Ok(FaultProxy { addr, cut, delay_ms, accept })
    }

    /// The address clients should dial.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`, for an etcd endpoint list.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Blackholes all traffic until [`FaultProxy::heal`].
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Closes blackholed connections, ends any delay and relays again.
    pub fn heal(&self) {
        self.delay_ms.store(0, Ordering::Relaxed);
        self.cut.send_replace(false);
    }

    /// Holds every chunk, both ways, for `delay` before passing it on (zero: none).
    pub fn delay(&self, delay: Duration) {
        self.delay_ms.store(delay.as_millis() as u64, Ordering::Relaxed);
    }

    /// Whether the proxy is cut now.
    pub fn is_cut(&self) -> bool {
        *self.cut.borrow()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Wake every relay so it ends: a cut that is healed closes its sockets.
        self.cut.send_replace(false);
    }
}

async fn relay(
    mut inbound: TcpStream,
    upstream: SocketAddr,
    mut cut: watch::Receiver<bool>,
    delay: Arc<AtomicU64>,
    rewrite: Option<Rewrite>,
) {
    if *cut.borrow_and_update() {
        // Accepted during a cut: hold the socket silently until heal, then drop it.
        let _ = cut.wait_for(|c| !*c).await;
        return;
    }
    let Ok(mut outbound) = TcpStream::connect(upstream).await else { return };
    let _ = outbound.set_nodelay(true);
    let (mut in_read, mut in_write) = inbound.split();
    let (mut out_read, mut out_write) = outbound.split();
    let blackholed = tokio::select! {
        _ = pump(&mut in_read, &mut out_write, &delay, None) => false,
        _ = pump(&mut out_read, &mut in_write, &delay, rewrite.as_deref()) => false,
        _ = cut.wait_for(|c| *c) => true,
    };
    if blackholed {
        // Keep both sockets open and move no bytes until heal.
        let _ = cut.wait_for(|c| !*c).await;
    }
}

/// Copies `from` to `to` until either ends, as a delay line: each chunk is released the
/// current delay after it was *read*, so the delay adds latency without capping throughput, and
/// chunks that arrive apart (a request, then its cancellation) stay apart.
async fn pump<R, W>(from: &mut R, to: &mut W, delay: &AtomicU64, rewrite: Option<&(Vec<u8>, Vec<u8>)>)
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let due =
                        tokio::time::Instant::now() + Duration::from_millis(delay.load(Ordering::Relaxed));
                    let mut chunk = buf[..n].to_vec();
                    if let Some((from, to)) = rewrite {
                        replace_all(&mut chunk, from, to);
                    }
                    if tx.send((due, chunk)).is_err() {
                        return;
                    }
                }
            }
        }
    };
    let write = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    };
    // Reading ends first on EOF; what was read is still written, in order.
    let (_, ()) = tokio::join!(read, write);
}

/// Replaces every `from` in `bytes` by `to`, of the same length, in place.
fn replace_all(bytes: &mut [u8], from: &[u8], to: &[u8]) {
    let mut i = 0;
    while i + from.len() <= bytes.len() {
        if &bytes[i..i + from.len()] == from {
            bytes[i..i + from.len()].copy_from_slice(to);
            i += from.len();
        } else {
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_match_is_replaced_in_place() {
        let mut bytes = b"v3.5.30 and 3.5.30, 3.5.3".to_vec();
        super::replace_all(&mut bytes, b"3.5.30", b"3.3.30");
        assert_eq!(bytes, b"v3.3.30 and 3.3.30, 3.5.3");
    }
}
