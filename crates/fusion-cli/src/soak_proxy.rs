//! The soak's partition: a TCP proxy in front of one node's data plane (the node listens on
//! 127.0.0.2, peers reach it through the proxy on 127.0.0.1, the broker directly). Cut, it keeps
//! every connection open and stops moving bytes either way, as a link that lost its route: what
//! was sent waits in the kernels' buffers (then the senders block), as unacknowledged packets
//! wait to be sent again; healed, everything flows on. The sessions node1 dials itself do not
//! pass through it: the cut is of the links into node1.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Default)]
struct Flags {
    cut: AtomicBool,
    stop: AtomicBool,
}

pub struct PartitionProxy {
    /// The port the proxy listens on at 127.0.0.1, and the node at 127.0.0.2.
    pub port: u16,
    flags: Arc<Flags>,
}

impl PartitionProxy {
    pub fn start() -> std::io::Result<PartitionProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let flags = Arc::new(Flags::default());
        let f = flags.clone();
        std::thread::spawn(move || accept(listener, port, &f));
        Ok(PartitionProxy { port, flags })
    }

    /// Cuts (true) or heals (false) every connection through the proxy.
    pub fn set_cut(&self, cut: bool) {
        self.flags.cut.store(cut, Ordering::SeqCst);
    }

    pub fn is_cut(&self) -> bool {
        self.flags.cut.load(Ordering::SeqCst)
    }
}

impl Drop for PartitionProxy {
    fn drop(&mut self) {
        self.flags.stop.store(true, Ordering::SeqCst);
    }
}

fn accept(listener: TcpListener, port: u16, f: &Arc<Flags>) {
    while !f.stop.load(Ordering::Relaxed) {
        let Ok((down, _)) = listener.accept() else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        let _ = down.set_nonblocking(false);
        let Ok(up) = TcpStream::connect(("127.0.0.2", port)) else {
            continue;
        };
        for (from, to) in [(&down, &up), (&up, &down)] {
            if let (Ok(from), Ok(to)) = (from.try_clone(), to.try_clone()) {
                let f = f.clone();
                std::thread::spawn(move || pump(from, to, &f));
            }
        }
    }
}

/// Copies `from` to `to` until either closes or the proxy stops; reads nothing while cut.
fn pump(mut from: TcpStream, mut to: TcpStream, f: &Flags) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = vec![0u8; 64 << 10];
    while !f.stop.load(Ordering::Relaxed) {
        if f.cut.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                // Read just as the cut landed: held until the link heals.
                while f.cut.load(Ordering::SeqCst) && !f.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                }
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proxy_forwards_holds_everything_while_cut_and_delivers_it_when_healed() {
        let node = TcpListener::bind("127.0.0.2:0").expect("node listener");
        // The proxy forwards to the node's port on 127.0.0.2: put the node on the proxy's port.
        let proxy = PartitionProxy::start().expect("proxy");
        drop(node);
        let node = TcpListener::bind(("127.0.0.2", proxy.port)).expect("node on the proxy port");
        let mut client = TcpStream::connect(("127.0.0.1", proxy.port)).expect("connect");
        let (mut server, _) = node.accept().expect("accept");
        server
            .set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        let mut got = [0u8; 5];
        client.write_all(b"hello").expect("write");
        server.read_exact(&mut got).expect("forwarded");
        assert_eq!(&got, b"hello");
        proxy.set_cut(true);
        assert!(proxy.is_cut());
        client
            .write_all(b"held!")
            .expect("the sender's write still succeeds");
        let r = server.read(&mut got);
        assert!(r.is_err(), "nothing crosses a cut link: {r:?}");
        proxy.set_cut(false);
        client.write_all(b"again").expect("write");
        let mut both = [0u8; 10];
        server
            .read_exact(&mut both)
            .expect("delivered after healing");
        assert_eq!(&both, b"held!again");
    }
}
