//! One outgoing data-plane session: a node's stream of tensors to one peer in one generation.
//! It writes the tensors its outbox queue hands it, in order, numbering each (`seq`); when the
//! connection breaks (a TCP reset, NAT rebinding, a flaky home link) it opens a new session and
//! sends again the tensors of the current step, which the receiver de-duplicates by number, so a
//! connection that is reset (a restarted router, a NAT that dropped its state and answers with a
//! reset, a flaky home link) costs a re-send, not a rollback. A peer that stops reading (a write
//! that does not complete in time, which is also how a silent NAT rebinding shows), refuses the
//! new session, or cannot be reached again fails the step, suspecting the peer.

use crate::error::{Result, RuntimeError};
use crate::mailbox::Mailbox;
use crate::path::SendRoute;
use crate::progress::Handle;
use crate::rendezvous::{
    join_relay, keep_alive, punch, punch_ports, session_key, BoxIo, Kind, ReverseSlots, PAIR_WAIT,
};
use fusion_proto::{frame::Body, Frame, Goodbye, Hello, TensorHeader};
use fusion_transport::{
    certificate_admitted, client_config, open_session, paced, send_tensor_within, FrameReader,
    FrameWriter, NodeIdentity, PacedLink, TransportError, DEFAULT_MAX_FRAME,
};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncWrite, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

/// How long a TLS handshake with a peer may take.
pub const TLS_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a sender keeps trying to re-open a broken session before failing the step.
pub const HEAL_WINDOW: Duration = Duration::from_secs(20);

/// Re-opened sessions one sender may need in one generation before it gives up (a link that
/// keeps breaking is a link to plan around, not to retry forever).
pub const MAX_HEALS: u32 = 8;

/// How long closing a session may take (a goodbye to a peer that stopped reading).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// A TLS session to a peer: its reading and writing halves.
pub type Session = (
    FrameReader<ReadHalf<TlsStream<BoxIo>>>,
    FrameWriter<WriteHalf<TlsStream<BoxIo>>>,
);

/// A tensor queued for a peer.
pub struct Outgoing {
    pub header: TensorHeader,
    pub data: Vec<u8>,
}

/// Opens a TCP connection to `address` (where `peer` listens, or its relay); a connection that
/// cannot be made at all says the peer is unreachable there.
pub async fn connect_tcp(peer: &str, address: &str) -> Result<TcpStream> {
    let unreachable = |reason: String| RuntimeError::Unreachable {
        peer: peer.to_string(),
        address: address.to_string(),
        reason,
    };
    let tcp = tokio::time::timeout(TLS_TIMEOUT, TcpStream::connect(address))
        .await
        .map_err(|_| unreachable(format!("no answer in {} s", TLS_TIMEOUT.as_secs())))?
        .map_err(|e| unreachable(e.to_string()))?;
    tcp.set_nodelay(true).ok();
    Ok(tcp)
}

/// Opens a TLS session to `peer` at `address` announcing `me`; the peer must present the
/// certificate whose SHA-256 is `pin` (the one it joined the broker with).
pub async fn dial(
    identity: &NodeIdentity,
    peer: &str,
    address: &str,
    pin: &[u8],
    me: Hello,
) -> Result<Session> {
    let tcp = connect_tcp(peer, address).await?;
    tls_client(identity, peer, address, Box::new(tcp), pin, me).await
}

/// Runs the client side of a session over `io`, however it was opened (dialled, relayed, or
/// dialled by the peer); `address` names the way for messages.
pub async fn tls_client(
    identity: &NodeIdentity,
    peer: &str,
    address: &str,
    io: BoxIo,
    pin: &[u8],
    me: Hello,
) -> Result<Session> {
    let connector = TlsConnector::from(client_config(identity)?);
    let name = ServerName::try_from(peer.to_string())
        .map_err(|e| RuntimeError::Config(format!("node id '{peer}' is not a valid name: {e}")))?;
    let tls = tokio::time::timeout(TLS_TIMEOUT, connector.connect(name, io))
        .await
        .map_err(|_| RuntimeError::Timeout(format!("TLS handshake with {peer}")))?
        .map_err(crate::error::io_err(format!("TLS handshake with {peer}")))?;
    let cert = tls.get_ref().1.peer_certificates().and_then(|c| c.first());
    // Whoever answers at the peer's address without its admitted certificate is not the peer:
    // a suspicion against it, which the broker weighs against everyone's progress.
    certificate_admitted(cert, peer, Some(pin)).map_err(|refusal| RuntimeError::Peer {
        peer: peer.to_string(),
        reason: format!("{peer} at {address}: {refusal}"),
        proven: false,
    })?;
    let (r, w, _info) = open_session(tls, me, DEFAULT_MAX_FRAME)
        .await
        .map_err(|e| RuntimeError::Protocol(format!("opening a session to {peer}: {e}")))?;
    Ok((r, w))
}

/// Punches from `local_port` to `peer` at `ip`:`port` (see `rendezvous::punch`); a punch that
/// does not go through is a path failure the broker routes around.
/// `listen`: this end is the session's receiver (see `rendezvous::punch`).
pub async fn punch_to(
    peer: &str,
    ip: &str,
    local_port: u16,
    port: u16,
    listen: bool,
) -> Result<TcpStream> {
    let failed = |reason: String| RuntimeError::PathFailed {
        peer: peer.to_string(),
        reason,
    };
    let addr: std::net::IpAddr = ip
        .parse()
        .map_err(|_| failed(format!("'{ip}' is not an IP address to punch to")))?;
    punch(local_port, (addr, port).into(), PUNCH_WAIT, listen)
        .await
        .map_err(|e| {
            failed(format!(
                "punching through to {ip}:{port} from port {local_port}: {e}"
            ))
        })
}

/// How long both ends of a punched session keep trying to meet (the receiver may get its
/// assignment well after the sender, as for a relay).
pub const PUNCH_WAIT: Duration = PAIR_WAIT;

/// What an outgoing session needs to open (and re-open) itself.
#[derive(Clone)]
pub struct Target {
    pub identity: NodeIdentity,
    pub hello: Hello,
    pub peer: String,
    pub address: String,
    pub link: Option<PacedLink>,
    /// SHA-256 of the certificate the peer joined with.
    pub pin: Vec<u8>,
    /// How the connection is opened (see `path`).
    pub route: SendRoute,
    /// Where the receiver's dials land when the route is reversed.
    pub slots: Arc<ReverseSlots>,
    /// The connection's name at a relay or in the reverse slots; None: the generation's
    /// session (a probe over a path has a name of its round).
    pub key: Option<String>,
}

/// An open connection: the (paced) writer, the pacing pump, and a signal that fires when the
/// peer's side of the connection ends (the receiver writes nothing after its hello, so that is a
/// break, or, with the peer's goodbye, a refusal).
pub struct Conn {
    w: FrameWriter<Box<dyn AsyncWrite + Unpin + Send>>,
    pump: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// Fires once: Some(reason) when the peer refused the session, None when it broke.
    broken: oneshot::Receiver<Option<String>>,
    /// Holds the read half; aborted with the connection so that the socket closes.
    watcher: tokio::task::JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

impl Target {
    /// Dials the peer (or its relay, or waits for its dial) and sets up pacing and the break
    /// signal.
    pub async fn open(&self) -> Result<Conn> {
        let (mut r, w) = self.session().await?;
        let (tx, broken) = oneshot::channel();
        let watcher = tokio::spawn(async move {
            let refusal = match r.read().await {
                Ok(Frame {
                    body: Some(Body::Goodbye(g)),
                }) => Some(g.reason),
                _ => None,
            };
            let _ = tx.send(refusal);
        });
        let inner = w.into_inner();
        let (w, pump): (Box<dyn AsyncWrite + Unpin + Send>, _) = match self.link {
            Some(link) => {
                let (app, pump) = paced(inner, link);
                (Box::new(app), Some(pump))
            }
            None => (Box::new(inner), None),
        };
        Ok(Conn {
            w: FrameWriter::new(w),
            pump,
            broken,
            watcher,
        })
    }
}

impl Target {
    /// The session's name at a relay or in the sender's reverse slots.
    fn key(&self) -> String {
        self.key
            .clone()
            .unwrap_or_else(|| session_key(self.hello.generation, &self.hello.node_id, &self.peer))
    }

    /// Opens the TLS session over the route the broker's reachability findings call for.
    pub(crate) async fn session(&self) -> Result<Session> {
        let (id, pin, me) = (&self.identity, &self.pin, self.hello.clone());
        match &self.route {
            SendRoute::Dial => dial(id, &self.peer, &self.address, pin, me).await,
            SendRoute::Relay(relay) => {
                let mut tcp = connect_tcp(&format!("the relay for {}", self.peer), relay).await?;
                keep_alive(&tcp);
                join_relay(&mut tcp, Kind::RelaySender, &self.key())
                    .await
                    .map_err(crate::error::io_err(format!(
                        "relaying to {} through {relay}",
                        self.peer
                    )))?;
                let via = format!("relay {relay}");
                tls_client(id, &self.peer, &via, Box::new(tcp), pin, me).await
            }
            SendRoute::AwaitDial => self.await_dial().await,
            SendRoute::Punch(ip) => {
                let (mine, theirs) = punch_ports(&self.key());
                let tcp = punch_to(&self.peer, ip, mine, theirs, false).await?;
                keep_alive(&tcp);
                let via = format!("{ip}:{theirs} (punched)");
                tls_client(id, &self.peer, &via, Box::new(tcp), pin, me).await
            }
        }
    }

    /// Reversed: takes the connections the receiver dials for this session until one carries a
    /// TLS session (one left over from an earlier try may be dead), within [`PAIR_WAIT`].
    async fn await_dial(&self) -> Result<Session> {
        let until = Instant::now() + PAIR_WAIT;
        let key = self.key();
        let mut last = None;
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            let Some(io) = self.slots.take(&key, left).await else {
                break;
            };
            let via = format!("{} (it dialled this node)", self.address);
            match tls_client(
                &self.identity,
                &self.peer,
                &via,
                io,
                &self.pin,
                self.hello.clone(),
            )
            .await
            {
                Ok(session) => return Ok(session),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| RuntimeError::PathFailed {
            peer: self.peer.clone(),
            reason: format!(
                "it accepts no connections and did not dial this node for its session within {} s",
                PAIR_WAIT.as_secs()
            ),
        }))
    }
}

/// The sender task's context.
pub struct SendSession {
    pub target: Target,
    pub mailbox: Arc<Mailbox>,
    pub progress: Handle,
    /// Longest one frame's write may take.
    pub stall: Duration,
}

/// Tensors of the current step, numbered, kept until the next step starts (by then every
/// receiver has taken in all of them: a step ends only when every node has finished it).
#[derive(Default)]
struct Replay {
    sent: VecDeque<Outgoing>,
    next_seq: u64,
    /// Tensors below this number are counted as sent.
    counted: u64,
}

impl Replay {
    /// Numbers `out` and keeps it, forgetting the previous step's tensors.
    fn push(&mut self, mut out: Outgoing) -> &Outgoing {
        if self
            .sent
            .front()
            .is_some_and(|o| o.header.step != out.header.step)
        {
            self.sent.clear();
        }
        out.header.seq = self.next_seq;
        self.next_seq += 1;
        self.sent.push_back(out);
        &self.sent[self.sent.len() - 1]
    }
}

enum Next {
    Tensor(Outgoing),
    Closed,
    /// The connection broke, or (Some) the peer refused the session with this reason.
    Broken(Option<String>),
}

/// Writes the queue's tensors to the peer until the queue closes, healing broken connections.
pub async fn send_loop(mut conn: Conn, mut rx: mpsc::Receiver<Outgoing>, s: SendSession) {
    let mut replay = Replay::default();
    let mut heals = 0u32;
    loop {
        // Both branches are cancel-safe; `broken` completes at most once per connection (a
        // completed one is replaced by heal, or the loop ends).
        let next = tokio::select! {
            m = rx.recv() => m.map_or(Next::Closed, Next::Tensor),
            r = &mut conn.broken => Next::Broken(r.ok().flatten()),
        };
        let written = match next {
            Next::Closed => break,
            Next::Tensor(out) => {
                s.progress.started(&s.target.peer);
                let out = replay.push(out);
                write(&mut conn, out, &s).await
            }
            Next::Broken(Some(reason)) => Err(TransportError::Refused(reason)),
            Next::Broken(None) => Err(TransportError::Closed),
        };
        let result = match written {
            Ok(()) => Ok(()),
            Err(e @ (TransportError::Io(_) | TransportError::Closed)) if heals < MAX_HEALS => {
                heals += 1;
                heal(&mut conn, &replay, &s, e).await
            }
            Err(e) => Err(e.to_string()),
        };
        if let Err(why) = result {
            let peer = &s.target.peer;
            s.mailbox
                .poison_blaming(format!("sending to {peer} failed: {why}"), peer, false);
            return;
        }
        count_sent(&mut replay, &s);
    }
    if tokio::time::timeout(CLOSE_TIMEOUT, close(conn))
        .await
        .is_err()
    {
        tracing::debug!("closing the session to {} timed out", s.target.peer);
    }
}

/// Counts the tensors written since the last count (once each, re-sends aside).
fn count_sent(replay: &mut Replay, s: &SendSession) {
    while replay.counted < replay.next_seq {
        s.progress.sent(&s.target.peer);
        replay.counted += 1;
    }
}

async fn write(
    conn: &mut Conn,
    out: &Outgoing,
    s: &SendSession,
) -> std::result::Result<(), TransportError> {
    let chunk = || s.progress.chunk();
    send_tensor_within(
        &mut conn.w,
        out.header.clone(),
        &out.data,
        Some(s.stall),
        chunk,
    )
    .await
}

/// Re-opens the session after `cause` and sends the current step's tensors again, for up to
/// [`HEAL_WINDOW`]; the error says why it could not.
async fn heal(
    conn: &mut Conn,
    replay: &Replay,
    s: &SendSession,
    cause: TransportError,
) -> std::result::Result<(), String> {
    let peer = &s.target.peer;
    let until = Instant::now() + HEAL_WINDOW;
    let mut last = cause.to_string();
    let mut pause = Duration::from_millis(100);
    tracing::warn!("the session to {peer} broke ({last}); re-opening it");
    while Instant::now() < until {
        // A reset or a new assignment abandons the step: nothing left to heal.
        s.mailbox.check().map_err(|e| e.to_string())?;
        s.progress.chunk();
        let left = until.saturating_duration_since(Instant::now());
        let opened = tokio::time::timeout(left, s.target.open())
            .await
            .unwrap_or_else(|_| Err(RuntimeError::Timeout("re-opening the session".into())));
        match opened {
            Ok(mut fresh) => {
                let mut resent = Ok(());
                for out in &replay.sent {
                    resent = write(&mut fresh, out, s).await;
                    if resent.is_err() {
                        break;
                    }
                }
                match resent {
                    Ok(()) => {
                        tracing::info!(
                            "re-opened the session to {peer}; sent {} tensors again",
                            replay.sent.len()
                        );
                        let old = std::mem::replace(conn, fresh);
                        if let Some(p) = &old.pump {
                            p.abort();
                        }
                        return Ok(());
                    }
                    Err(e @ TransportError::Stalled(_)) => return Err(e.to_string()),
                    Err(e) => last = e.to_string(),
                }
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
    Err(format!(
        "the session broke and could not be re-opened within {} s: {last}",
        HEAL_WINDOW.as_secs()
    ))
}

/// Says goodbye so the peer's reader ends cleanly, then lets the pacing pump drain.
async fn close(mut conn: Conn) {
    let _ = conn
        .w
        .write(&Frame {
            body: Some(Body::Goodbye(Goodbye {
                reason: "assignment finished".into(),
            })),
        })
        .await;
    let _ = conn.w.flush().await;
    let pump = conn.pump.take();
    drop(conn);
    if let Some(p) = pump {
        let _ = p.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(step: u64) -> Outgoing {
        Outgoing {
            header: TensorHeader {
                step,
                ..Default::default()
            },
            data: vec![0; 4],
        }
    }

    #[test]
    fn tensors_are_numbered_in_order_and_kept_until_the_next_step() {
        let mut r = Replay::default();
        assert_eq!(r.push(tensor(3)).header.seq, 0);
        assert_eq!(r.push(tensor(3)).header.seq, 1);
        assert_eq!(r.sent.len(), 2);
        assert_eq!(r.push(tensor(4)).header.seq, 2);
        let kept: Vec<u64> = r.sent.iter().map(|o| o.header.seq).collect();
        assert_eq!(
            kept,
            vec![2],
            "step 3's tensors are forgotten once step 4 starts"
        );
    }
}
