//! Admission of TCP connections before any TLS work is done for them: a cap on the connections
//! open at once, in all and per remote address, and an accept loop that backs off when the
//! process runs out of file descriptors instead of spinning. A flood of idle connections from one
//! address cannot then starve the others, and one from many addresses is bounded in memory and
//! descriptors (each admitted connection still has to finish its handshake in bounded time).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// How many connections a listener keeps open at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// In all.
    pub total: usize,
    /// From one remote IP address.
    pub per_address: usize,
}

impl Default for ConnectionLimits {
    /// 1024 in all, 64 from one address (a local cluster's nodes all share 127.0.0.1).
    fn default() -> Self {
        ConnectionLimits {
            total: 1024,
            per_address: 64,
        }
    }
}

/// Why a connection was closed right after it was accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    TooManyConnections,
    TooManyFromAddress,
}

#[derive(Default)]
struct Counts {
    total: usize,
    by_address: HashMap<IpAddr, usize>,
    refused: u64,
}

/// Counts the open connections of one listener.
#[derive(Clone)]
pub struct ConnectionGate {
    limits: ConnectionLimits,
    counts: Arc<Mutex<Counts>>,
}

/// One admitted connection's place in its gate, given back when dropped.
pub struct Permit {
    address: IpAddr,
    counts: Arc<Mutex<Counts>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Ok(mut c) = self.counts.lock() {
            c.total = c.total.saturating_sub(1);
            if let Some(n) = c.by_address.get_mut(&self.address) {
                *n -= 1;
                if *n == 0 {
                    c.by_address.remove(&self.address);
                }
            }
        }
    }
}

impl ConnectionGate {
    pub fn new(limits: ConnectionLimits) -> Self {
        ConnectionGate {
            limits,
            counts: Arc::default(),
        }
    }

    /// A place for one more connection from `address`, or why not.
    pub fn admit(&self, address: IpAddr) -> Result<Permit, Refusal> {
        let mut c = self
            .counts
            .lock()
            .map_err(|_| Refusal::TooManyConnections)?;
        let from = c.by_address.get(&address).copied().unwrap_or(0);
        let refusal = if c.total >= self.limits.total {
            Some(Refusal::TooManyConnections)
        } else if from >= self.limits.per_address {
            Some(Refusal::TooManyFromAddress)
        } else {
            None
        };
        if let Some(r) = refusal {
            c.refused += 1;
            return Err(r);
        }
        c.total += 1;
        c.by_address.insert(address, from + 1);
        Ok(Permit {
            address,
            counts: self.counts.clone(),
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.counts.lock().map_or(0, |c| c.total)
    }

    /// Connections closed on arrival so far because a limit was reached.
    pub fn refused(&self) -> u64 {
        self.counts.lock().map_or(0, |c| c.refused)
    }

    /// The next connection the gate admits. Connections over a limit are closed at once (and
    /// counted); accept errors (out of file descriptors, a connection reset before it was
    /// accepted) are retried after a pause that doubles up to a second.
    pub async fn accept(&self, listener: &TcpListener) -> (GatedStream, SocketAddr) {
        let mut pause = Duration::from_millis(5);
        loop {
            match listener.accept().await {
                Ok((tcp, addr)) => {
                    pause = Duration::from_millis(5);
                    match self.admit(addr.ip()) {
                        Ok(permit) => {
                            tcp.set_nodelay(true).ok();
                            return (GatedStream { tcp, permit }, addr);
                        }
                        Err(r) => tracing::debug!("closed a connection from {addr}: {r:?}"),
                    }
                }
                Err(e) => {
                    tracing::warn!(
                        "accepting a connection failed ({e}); retrying in {} ms",
                        pause.as_millis()
                    );
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

/// An admitted TCP connection; its place in the gate is given back when it is dropped.
pub struct GatedStream {
    tcp: TcpStream,
    permit: Permit,
}

impl GatedStream {
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// The remote address the gate counted it under.
    pub fn address(&self) -> IpAddr {
        self.permit.address
    }
}

impl AsyncRead for GatedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for GatedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_in_all_and_per_address_and_permits_are_given_back() {
        let gate = ConnectionGate::new(ConnectionLimits {
            total: 3,
            per_address: 2,
        });
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        let a1 = gate.admit(a).expect("first");
        let _a2 = gate.admit(a).expect("second");
        assert_eq!(gate.admit(a).err(), Some(Refusal::TooManyFromAddress));
        let _b1 = gate.admit(b).expect("another address");
        assert_eq!(gate.admit(b).err(), Some(Refusal::TooManyConnections));
        assert_eq!((gate.open(), gate.refused()), (3, 2));
        drop(a1);
        assert_eq!(gate.open(), 2);
        let _a3 = gate.admit(a).expect("a place was given back");
    }

    #[tokio::test]
    async fn connections_over_the_limit_are_closed_on_arrival() {
        use tokio::io::AsyncReadExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let gate = ConnectionGate::new(ConnectionLimits {
            total: 8,
            per_address: 1,
        });
        let g = gate.clone();
        let server = tokio::spawn(async move {
            let (held, _) = g.accept(&listener).await;
            // Keep accepting (and closing) while the first is held.
            let _ = tokio::time::timeout(Duration::from_secs(2), g.accept(&listener)).await;
            drop(held);
        });
        let _first = TcpStream::connect(addr).await.expect("first");
        let mut second = TcpStream::connect(addr).await.expect("second");
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(10), second.read(&mut byte))
            .await
            .expect("closed in time")
            .unwrap_or(0);
        assert_eq!(n, 0, "the second connection is closed by the server");
        server.await.expect("server");
        assert!(gate.refused() >= 1);
    }
}
