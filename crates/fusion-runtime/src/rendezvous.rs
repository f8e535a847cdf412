//! Sessions for nodes that accept no connections (see `path`): the preamble a connection opens
//! with when it is not a plain TLS session, a relay that pairs two connections and copies bytes
//! between them, and the slots where a sender waits for its receiver to dial it (reversed).
//!
//! The preamble comes before TLS and is not authenticated: it only names the session
//! (`generation/sender/receiver`) so that a relay can pair the two halves and a sender can tell
//! whose dial it got. Whoever forges one gains nothing: the TLS session that follows is between
//! the two pinned certificates, end to end. A plain TLS session starts with 0x16 (a handshake
//! record), which no preamble does, so both kinds share the data-plane port.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::Notify;

/// The first bytes of a preamble (a TLS session starts with 0x16).
pub const MAGIC: &[u8; 4] = b"FLRZ";
const VERSION: u8 = 1;
/// Longest session name a preamble may carry.
pub const MAX_KEY: usize = 512;
/// How long a relay keeps one half waiting for the other, and how long a node waits for its
/// relay to pair it (the receiver may get its assignment well after the sender: the broker ships
/// the stages' state one node after another).
pub const PAIR_WAIT: Duration = Duration::from_secs(120);
/// How long the preamble itself may take to arrive.
pub const PREAMBLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections a relay keeps waiting for their partner at once.
pub const MAX_WAITING: usize = 256;
/// The byte a relay writes to both halves once it has paired them.
const PAIRED: u8 = 0x01;

/// Any byte stream a session can run over (a TCP connection, or one behind a connection gate).
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
pub type BoxIo = Box<dyn Io>;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RendezvousError {
    #[error("not a rendezvous preamble (starts with {0:02x?})")]
    BadMagic(Vec<u8>),
    #[error("rendezvous preamble version {0} (this node speaks {VERSION})")]
    Version(u8),
    #[error("unknown rendezvous kind {0}")]
    Kind(u8),
    #[error("rendezvous session name of {0} bytes (at most {MAX_KEY})")]
    KeyLength(usize),
    #[error("rendezvous session name is not UTF-8 text")]
    KeyText,
    #[error("truncated rendezvous preamble ({0} bytes)")]
    Truncated(usize),
}

/// What a connection that opens with a preamble asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// To a relay: pair me with the receiver of this session (I am its TLS client).
    RelaySender = 1,
    /// To a relay: pair me with the sender of this session (I am its TLS server).
    RelayReceiver = 2,
    /// To a sender: this connection is for your session to me (I am its TLS server).
    Reverse = 3,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preamble {
    pub kind: Kind,
    /// `generation/sender/receiver`.
    pub key: String,
}

/// The name both ends and the relay give one session.
pub fn session_key(generation: u64, sender: &str, receiver: &str) -> String {
    format!("{generation}/{sender}/{receiver}")
}

/// The name both ends and the relay give one probe of a probe round over the links' paths.
pub fn probe_key(round: u64, sender: &str, receiver: &str) -> String {
    format!("{PROBE_PREFIX}{round}/{sender}/{receiver}")
}

const PROBE_PREFIX: &str = "probe";

/// The round, sender and receiver of a probe's key (None: not a probe's key).
pub fn probe_parts(key: &str) -> Option<(u64, &str, &str)> {
    let mut parts = key.strip_prefix(PROBE_PREFIX)?.splitn(3, '/');
    let round = parts.next()?.parse::<u64>().ok()?;
    Some((round, parts.next()?, parts.next()?))
}

impl Preamble {
    /// Bytes on the wire: magic, version, kind, key length (u16, big-endian), key.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.push(VERSION);
        out.push(self.kind as u8);
        out.extend((self.key.len() as u16).to_be_bytes());
        out.extend(self.key.as_bytes());
        out
    }

    /// Decodes a whole preamble; returns it and how many bytes it took.
    pub fn decode(bytes: &[u8]) -> Result<(Preamble, usize), RendezvousError> {
        let (kind, len) = Self::decode_head(bytes)?;
        let end = 8 + len;
        let key = bytes
            .get(8..end)
            .ok_or(RendezvousError::Truncated(bytes.len()))?;
        let key = std::str::from_utf8(key).map_err(|_| RendezvousError::KeyText)?;
        Ok((
            Preamble {
                kind,
                key: key.into(),
            },
            end,
        ))
    }

    /// The kind and key length from the first 8 bytes.
    fn decode_head(bytes: &[u8]) -> Result<(Kind, usize), RendezvousError> {
        let head = bytes
            .get(..8)
            .ok_or(RendezvousError::Truncated(bytes.len()))?;
        if &head[..4] != MAGIC {
            return Err(RendezvousError::BadMagic(head[..4].to_vec()));
        }
        if head[4] != VERSION {
            return Err(RendezvousError::Version(head[4]));
        }
        let kind = match head[5] {
            1 => Kind::RelaySender,
            2 => Kind::RelayReceiver,
            3 => Kind::Reverse,
            k => return Err(RendezvousError::Kind(k)),
        };
        let len = u16::from_be_bytes([head[6], head[7]]) as usize;
        if len == 0 || len > MAX_KEY {
            return Err(RendezvousError::KeyLength(len));
        }
        Ok((kind, len))
    }

    /// Reads a preamble from `io` (within [`PREAMBLE_TIMEOUT`]).
    pub async fn read<S: AsyncRead + Unpin>(io: &mut S) -> std::io::Result<Preamble> {
        let read = async {
            let mut head = [0u8; 8];
            io.read_exact(&mut head).await?;
            let (_, len) = Self::decode_head(&head).map_err(invalid)?;
            let mut all = head.to_vec();
            all.resize(8 + len, 0);
            io.read_exact(&mut all[8..]).await?;
            Self::decode(&all).map(|(p, _)| p).map_err(invalid)
        };
        tokio::time::timeout(PREAMBLE_TIMEOUT, read)
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no preamble"))?
    }
}

fn invalid(e: RendezvousError) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e)
}

/// Opens `io` as one half of a relayed session and waits (up to [`PAIR_WAIT`]) for the relay to
/// pair it with the other half.
pub async fn join_relay<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut S,
    kind: Kind,
    key: &str,
) -> std::io::Result<()> {
    let preamble = Preamble {
        kind,
        key: key.into(),
    };
    io.write_all(&preamble.encode()).await?;
    io.flush().await?;
    let mut ack = [0u8; 1];
    match tokio::time::timeout(PAIR_WAIT, io.read_exact(&mut ack)).await {
        Ok(Ok(_)) if ack[0] == PAIRED => Ok(()),
        Ok(Ok(_)) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("the relay answered {:#04x}, not the pairing byte", ack[0]),
        )),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "the relay paired nothing with '{key}' in {} s",
                PAIR_WAIT.as_secs()
            ),
        )),
    }
}

struct Waiting {
    kind: Kind,
    io: BoxIo,
    id: u64,
}

/// A node's relay: connections waiting for their partner, by session name.
#[derive(Default)]
pub struct Relay {
    waiting: Mutex<HashMap<String, Waiting>>,
    next_id: AtomicU64,
    /// Test hook: a relay that alters this byte of every sender-to-receiver stream (0: none;
    /// byte n is stored as n + 1).
    tamper_at: AtomicU64,
}

impl Relay {
    /// Test hook: alter byte `at` of every sender-to-receiver stream relayed from now on.
    pub fn set_tamper(&self, at: Option<u64>) {
        self.tamper_at
            .store(at.map_or(0, |a| a.saturating_add(1)), Ordering::Relaxed);
    }

    /// Pairs `io` with the waiting other half of `key`, or leaves it waiting (a newer half of
    /// the same side replaces an older one: its sender re-opened the session). Once paired, the
    /// relay copies bytes both ways until either side closes.
    pub fn offer(self: &Arc<Self>, kind: Kind, key: String, io: BoxIo) {
        let partner = {
            let Ok(mut w) = self.waiting.lock() else {
                return;
            };
            match w.remove(&key) {
                Some(other) if other.kind != kind => Some(other),
                Some(_) | None if w.len() >= MAX_WAITING => {
                    tracing::warn!("relay: {MAX_WAITING} halves wait already; dropping '{key}'");
                    None
                }
                _ => {
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    w.insert(key.clone(), Waiting { kind, io, id });
                    let me = self.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(PAIR_WAIT).await;
                        me.expire(&key, id);
                    });
                    return;
                }
            }
        };
        let Some(other) = partner else { return };
        let (to_receiver, to_sender) = match kind {
            Kind::RelaySender => (other.io, io),
            _ => (io, other.io),
        };
        let tamper = self.tamper_at.load(Ordering::Relaxed).checked_sub(1);
        tokio::spawn(splice(to_sender, to_receiver, tamper, key));
    }

    fn expire(&self, key: &str, id: u64) {
        if let Ok(mut w) = self.waiting.lock() {
            if w.get(key).is_some_and(|h| h.id == id) {
                w.remove(key);
                tracing::debug!("relay: nobody paired with '{key}'");
            }
        }
    }
}

/// Tells both halves they are paired, then copies bytes between them until both directions end.
async fn splice(mut sender: BoxIo, mut receiver: BoxIo, tamper_at: Option<u64>, key: String) {
    if sender.write_all(&[PAIRED]).await.is_err() || receiver.write_all(&[PAIRED]).await.is_err() {
        return;
    }
    let (sr, sw) = tokio::io::split(sender);
    let (rr, rw) = tokio::io::split(receiver);
    let forward = pump(sr, rw, tamper_at);
    let backward = pump(rr, sw, None);
    let (f, b) = tokio::join!(forward, backward);
    tracing::debug!("relay: '{key}' ended after {f} + {b} bytes");
}

/// Copies until `from` ends or either side fails; returns the bytes copied.
async fn pump<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut from: R,
    mut to: W,
    tamper_at: Option<u64>,
) -> u64 {
    let mut buf = vec![0u8; 64 << 10];
    let mut total = 0u64;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(at) = tamper_at.filter(|&at| at >= total && at < total + n as u64) {
            buf[(at - total) as usize] ^= 0x5a;
            tracing::warn!("test hook: the relay altered byte {at} of a session");
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
        total += n as u64;
    }
    let _ = to.shutdown().await;
    total
}

/// Turns on TCP keepalive for a connection that may outlive its path silently: one a relay
/// splices, one a node opened itself to receive on (relayed, reversed, punched). Its reader
/// otherwise waits for the next tensor forever when a NAT or the relay drops the path without a
/// reset; with keepalive the kernel notices within about 25 s and the read fails, so the
/// session is opened again.
pub fn keep_alive<S: std::os::fd::AsFd>(socket: &S) {
    let probes = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    if let Err(e) = socket2::SockRef::from(socket).set_tcp_keepalive(&probes) {
        tracing::debug!("TCP keepalive: {e}");
    }
}

/// The ports a punched session's two ends use (sender, receiver): both derive them from the
/// session's name (FNV-1a), in 10000-29999, below Linux's ephemeral ports.
pub fn punch_ports(key: &str) -> (u16, u16) {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let sender = 10_000 + (h % 20_000) as u16;
    let mut receiver = 10_000 + ((h >> 32) % 20_000) as u16;
    if receiver == sender {
        receiver = 10_000 + (receiver - 10_000 + 1) % 20_000;
    }
    (sender, receiver)
}

/// Opens a TCP connection from `local_port` to `remote` while the other end does the same the
/// other way (simultaneous open through both NATs), retrying until `wait` has passed: a SYN
/// that reaches the other NAT before the other side's own SYN opened it is dropped. With
/// `listen` (the session's receiver) the port also accepts the other end's SYN when it arrives
/// between this end's tries (or where nothing drops it: a host that refuses at once); there is
/// one TCP connection either way, the one of the two ports.
pub async fn punch(
    local_port: u16,
    remote: SocketAddr,
    wait: Duration,
    listen: bool,
) -> std::io::Result<TcpStream> {
    let until = tokio::time::Instant::now() + wait;
    let listener = match listen {
        true => Some(port_socket(local_port, remote)?.listen(4)?),
        false => None,
    };
    let mut last = None;
    while tokio::time::Instant::now() < until {
        let attempt = async {
            let socket = port_socket(local_port, remote)?;
            tokio::time::timeout(Duration::from_secs(2), socket.connect(remote))
                .await
                .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
        };
        let accepted = async {
            match &listener {
                Some(l) => l.accept().await,
                None => std::future::pending().await,
            }
        };
        let result = tokio::select! {
            r = attempt => r,
            a = accepted => match a {
                Ok((tcp, from)) if from.ip() == remote.ip() => Ok(tcp),
                Ok((_, from)) => Err(std::io::Error::other(format!("a stranger at {from}"))),
                Err(e) => Err(e),
            },
        };
        match result {
            Ok(tcp) => {
                tcp.set_nodelay(true).ok();
                return Ok(tcp);
            }
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer from {remote} in {} s", wait.as_secs()),
        )
    }))
}

/// A socket bound to `port` that other sockets may share (the listener and each try).
fn port_socket(port: u16, remote: SocketAddr) -> std::io::Result<TcpSocket> {
    let (socket, any): (_, SocketAddr) = match remote {
        SocketAddr::V4(_) => (
            TcpSocket::new_v4()?,
            (std::net::Ipv4Addr::UNSPECIFIED, port).into(),
        ),
        SocketAddr::V6(_) => (
            TcpSocket::new_v6()?,
            (std::net::Ipv6Addr::UNSPECIFIED, port).into(),
        ),
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(any)?;
    Ok(socket)
}

/// Connections receivers dialled for a sender's sessions (reversed), by session name.
#[derive(Default)]
pub struct ReverseSlots {
    /// Each connection with when it arrived (kept at most [`PAIR_WAIT`]).
    slots: Mutex<HashMap<String, (std::time::Instant, BoxIo)>>,
    arrived: Notify,
}

impl ReverseSlots {
    /// Keeps `io` for the session `key` (replacing an older connection for it).
    pub fn put(&self, key: String, io: BoxIo) {
        if let Ok(mut s) = self.slots.lock() {
            s.retain(|_, (at, _)| at.elapsed() < PAIR_WAIT);
            if s.len() >= MAX_WAITING && !s.contains_key(&key) {
                tracing::warn!("{MAX_WAITING} reversed connections wait already; dropping '{key}'");
                return;
            }
            s.insert(key, (std::time::Instant::now(), io));
        }
        self.arrived.notify_waiters();
    }

    /// Takes the connection for `key`, waiting up to `wait` for the receiver to dial.
    pub async fn take(&self, key: &str, wait: Duration) -> Option<BoxIo> {
        let until = tokio::time::Instant::now() + wait;
        loop {
            let arrived = self.arrived.notified();
            if let Some((_, io)) = self.slots.lock().ok().and_then(|mut s| s.remove(key)) {
                return Some(io);
            }
            if tokio::time::timeout_at(until, arrived).await.is_err() {
                return None;
            }
        }
    }

    /// Forgets the connections of generations before `generation`.
    pub fn retain_from(&self, generation: u64) {
        if let Ok(mut s) = self.slots.lock() {
            s.retain(|k, _| {
                k.split('/')
                    .next()
                    .and_then(|g| g.parse::<u64>().ok())
                    .is_some_and(|g| g >= generation)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preambles_round_trip_and_bad_ones_are_named() {
        let p = Preamble {
            kind: Kind::Reverse,
            key: session_key(3, "home-a", "lab"),
        };
        let bytes = p.encode();
        assert_eq!(Preamble::decode(&bytes), Ok((p, bytes.len())));
        assert_ne!(bytes[0], 0x16, "a preamble never looks like a TLS record");
        let mut bad = bytes.clone();
        bad[5] = 9;
        assert_eq!(Preamble::decode(&bad), Err(RendezvousError::Kind(9)));
        assert_eq!(
            Preamble::decode(&bytes[..10]),
            Err(RendezvousError::Truncated(10))
        );
        let mut long = bytes[..6].to_vec();
        long.extend(((MAX_KEY + 1) as u16).to_be_bytes());
        assert_eq!(
            Preamble::decode(&long),
            Err(RendezvousError::KeyLength(MAX_KEY + 1))
        );
        assert!(matches!(
            Preamble::decode(&[0x16, 3, 1, 0, 0, 0, 0, 0]),
            Err(RendezvousError::BadMagic(_))
        ));
    }

    /// Two halves offered to a relay are paired and bytes flow both ways; a tampering relay
    /// alters exactly the byte it says.
    #[tokio::test]
    async fn a_relay_pairs_halves_and_copies_both_ways() {
        for tamper in [None, Some(2u64)] {
            let relay = Arc::new(Relay::default());
            relay.set_tamper(tamper);
            let (mut sender, sender_far) = tokio::io::duplex(1 << 16);
            let (mut receiver, receiver_far) = tokio::io::duplex(1 << 16);
            relay.offer(Kind::RelayReceiver, "k".into(), Box::new(receiver_far));
            relay.offer(Kind::RelaySender, "k".into(), Box::new(sender_far));
            let mut ack = [0u8; 1];
            sender.read_exact(&mut ack).await.expect("sender paired");
            receiver
                .read_exact(&mut ack)
                .await
                .expect("receiver paired");
            sender.write_all(b"hello").await.expect("write");
            let mut got = [0u8; 5];
            receiver.read_exact(&mut got).await.expect("read");
            let mut want = *b"hello";
            if let Some(at) = tamper {
                want[at as usize] ^= 0x5a;
            }
            assert_eq!(got, want);
            receiver.write_all(b"back").await.expect("write back");
            let mut back = [0u8; 4];
            sender.read_exact(&mut back).await.expect("read back");
            assert_eq!(&back, b"back");
        }
    }

    #[test]
    fn punch_ports_are_the_same_on_both_ends_and_distinct() {
        let (s, r) = punch_ports("3/home-a/home-b");
        assert_eq!((s, r), punch_ports("3/home-a/home-b"));
        assert_ne!(s, r);
        assert!((10_000..30_000).contains(&s) && (10_000..30_000).contains(&r));
        assert_ne!(punch_ports("3/home-b/home-a"), (s, r));
    }

    /// Two ends punching at each other at once meet (simultaneous open on loopback).
    #[tokio::test]
    async fn two_punches_meet() {
        // Two ports free right now.
        let free = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port")
        };
        let (a, b) = (free(), free());
        let to = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        let wait = Duration::from_secs(10);
        let (x, y) = tokio::join!(punch(a, to(b), wait, false), punch(b, to(a), wait, true));
        let (mut x, mut y) = (x.expect("a's end"), y.expect("b's end"));
        x.write_all(b"ping").await.expect("write");
        let mut got = [0u8; 4];
        y.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"ping");
    }

    #[tokio::test]
    async fn a_sender_takes_the_connection_its_receiver_dialled() {
        let slots = Arc::new(ReverseSlots::default());
        let waiter = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.take("1/a/b", Duration::from_secs(10)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (near, _far) = tokio::io::duplex(64);
        slots.put("1/a/b".into(), Box::new(near));
        assert!(waiter.await.expect("join").is_some());
        assert!(slots
            .take("1/a/b", Duration::from_millis(10))
            .await
            .is_none());
        let (near, _far) = tokio::io::duplex(64);
        slots.put("1/a/c".into(), Box::new(near));
        slots.retain_from(2);
        assert!(slots
            .take("1/a/c", Duration::from_millis(10))
            .await
            .is_none());
    }

    #[test]
    fn a_probe_key_names_its_ends_and_no_session_key_is_one() {
        let k = probe_key(7, "home-a", "home-c");
        assert_eq!(probe_parts(&k), Some((7, "home-a", "home-c")));
        assert_eq!(probe_parts(&session_key(7, "home-a", "home-c")), None);
        assert_eq!(probe_parts("probex/a/b"), None);
        assert_eq!(probe_parts("probe3/a"), None);
    }
}
