//! A TCP fault proxy: the agent talks to a side through it, and a test cuts and heals the
//! network in between.
//!
//! A cut is a *blackhole*, like a real partition: bytes stop flowing both ways on existing
//! connections and new connections are accepted but never answered. Nothing is reset, so the
//! client has to notice by itself (gRPC keepalive), exactly as it would in production. On heal
//! the blackholed connections are closed (their streams lost bytes and cannot continue) and new
//! connections are relayed again.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// One proxied upstream address.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and relays every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (cut, _) = watch::channel(false);
        let state = cut.clone();
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let _ = inbound.set_nodelay(true);
                tokio::spawn(relay(inbound, upstream, state.subscribe()));
            }
        });
        Ok(FaultProxy { addr, cut, accept })
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

    /// Closes blackholed connections and relays again.
    pub fn heal(&self) {
        self.cut.send_replace(false);
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

async fn relay(mut inbound: TcpStream, upstream: SocketAddr, mut cut: watch::Receiver<bool>) {
    if *cut.borrow_and_update() {
        // Accepted during a cut: hold the socket silently until heal, then drop it.
        let _ = cut.wait_for(|c| !*c).await;
        return;
    }
    let Ok(mut outbound) = TcpStream::connect(upstream).await else { return };
    let _ = outbound.set_nodelay(true);
    let blackholed = tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => false,
        _ = cut.wait_for(|c| *c) => true,
    };
    if blackholed {
        // Keep both sockets open and move no bytes until heal.
        let _ = cut.wait_for(|c| !*c).await;
    }
}
