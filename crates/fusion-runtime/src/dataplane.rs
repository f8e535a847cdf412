//! A node's side of the tensor data plane: it accepts sessions from the peers that send to it
//! (checking the join token, the assignment generation, that the peer is one of its senders and
//! that the peer's certificate names it), validates every tensor against the stage's graph and
//! drops it into the mailbox; and it keeps one outgoing session per peer it sends to, paced to
//! the emulated link when the testbed says so.

use crate::error::{Result, RuntimeError};
use crate::fetch::Wanted;
use crate::hostile::BadResult;
use crate::mailbox::{Key, Mailbox, Payload};
use crate::outgoing::{send_loop, Outgoing, SendSession, Target, TLS_TIMEOUT};
use crate::path::{ReceiveRoute, SendRoute};
use crate::probe::{self, pace_writer, LinkEstimate};
use crate::progress::{Handle, Tracker};
use crate::rendezvous::{Kind, Preamble, Relay, ReverseSlots, MAGIC};
use crate::shards::{ShardFile, ShardStore};
use fusion_compress::{compressor, Codec, Compressor, ErrorFeedback, NodeCompression};
use fusion_proto::{
    frame::Body, DType, Direction, Frame, Goodbye, Hello, Phase, TensorHeader, PROTOCOL_VERSION,
};
use fusion_transport::{
    accept_session, certificate_admitted, server_config, ConnectionGate, ConnectionLimits,
    ExpectedTensor, FrameReader, FrameWriter, GatedStream, NodeIdentity, PacedLink, TensorReceiver,
    DEFAULT_MAX_FRAME,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;

/// Tensors queued per peer before the compute thread waits for the session to catch up
/// (backpressure: a slow or stuck peer bounds this node's memory, not the other way round).
pub const OUTBOX_DEPTH: usize = 32;

/// What the current assignment lets this node receive.
pub struct Inbound {
    pub generation: u64,
    pub mailbox: Arc<Mailbox>,
    /// Node id of every peer that sends to this node, with its stage.
    pub senders: HashMap<String, usize>,
    /// SHA-256 of the certificate each sender joined the broker with (see `with_pins`).
    pins: HashMap<String, Vec<u8>>,
    /// Shape of every tensor this node receives, by (direction, id).
    pub expected: HashMap<(i32, u64), Vec<usize>>,
    /// Bytes the mailbox may hold from one sending stage before its sessions stop being read
    /// (backpressure: a peer sending ahead is slowed, not buffered without bound).
    budget: usize,
    /// Per sending peer: sessions opened in this generation and the next tensor number due.
    streams: Mutex<HashMap<String, PeerStream>>,
    /// Counts the tensors taken in from each peer (for the heartbeats).
    progress: Option<Handle>,
    /// Test hook: stop reading every session once a tensor of this step arrives, as a peer whose
    /// reader is stuck (heartbeats go on).
    stop_reading_at: Option<u64>,
    /// The (sender, receiver) pairs whose sessions this node relays in this generation.
    relays: std::collections::HashSet<(String, String)>,
}

impl Inbound {
    pub fn new(
        generation: u64,
        mailbox: Arc<Mailbox>,
        senders: HashMap<String, usize>,
        expected: HashMap<(i32, u64), Vec<usize>>,
    ) -> Self {
        // Two micro-batches of everything this node receives, at 8 bytes a value, and 64 MiB.
        let values: usize = expected.values().map(|s| s.iter().product::<usize>()).sum();
        let budget = (64 << 20) + 16 * values;
        Inbound {
            generation,
            mailbox,
            senders,
            pins: HashMap::new(),
            expected,
            budget,
            streams: Mutex::new(HashMap::new()),
            progress: None,
            stop_reading_at: None,
            relays: Default::default(),
        }
    }

    /// The (sender, receiver) pairs the broker chose this node to relay for.
    pub fn with_relays(mut self, pairs: impl IntoIterator<Item = (String, String)>) -> Self {
        self.relays = pairs.into_iter().collect();
        self
    }

    /// Counts what arrives from each peer in `progress`.
    pub fn with_progress(mut self, progress: Handle) -> Self {
        self.progress = Some(progress);
        self
    }

    /// Admits a sender's sessions only with the certificate whose SHA-256 `pins` gives for it
    /// (none: every session is refused).
    pub fn with_pins(mut self, pins: HashMap<String, Vec<u8>>) -> Self {
        self.pins = pins;
        self
    }

    /// Sets the bytes held from one sending stage before its sessions stop being read.
    #[cfg(test)]
    pub fn with_budget(mut self, bytes: usize) -> Self {
        self.budget = bytes;
        self
    }

    /// Test hook: stop reading at `step` (see the field).
    pub fn with_stop_reading_at(mut self, step: Option<u64>) -> Self {
        self.stop_reading_at = step;
        self
    }
}

/// How long a session from a peer waits for this node's own assignment of the peer's
/// generation before it is refused.
const ASSIGNMENT_WAIT: Duration = Duration::from_secs(120);

/// Sessions a peer may open in one generation (the first, then re-opens after breaks).
const MAX_SESSIONS_PER_PEER: u32 = 16;

/// One sending peer's stream into this node.
#[derive(Default)]
struct PeerStream {
    sessions: u32,
    next_seq: u64,
}

impl Inbound {
    /// Admits one more session from `peer` (None), or says why not.
    fn admit(&self, peer: &str) -> Option<String> {
        let Ok(mut streams) = self.streams.lock() else {
            return Some("internal lock poisoned".into());
        };
        let st = streams.entry(peer.to_string()).or_default();
        if st.sessions >= MAX_SESSIONS_PER_PEER {
            return Some(format!(
                "'{peer}' opened {MAX_SESSIONS_PER_PEER} sessions in this generation already"
            ));
        }
        st.sessions += 1;
        None
    }

    /// Decodes a tensor from `peer` and puts it in the mailbox: in stream order, once (a re-sent
    /// tensor already delivered is dropped). Bad data poisons the mailbox blaming the peer with
    /// proof; a gap, as a suspicion.
    fn deliver(
        &self,
        peer: &str,
        from_stage: usize,
        t: fusion_transport::ReceivedTensor,
    ) -> Result<()> {
        let fail = |msg: String| {
            self.mailbox.poison_blaming(msg.clone(), peer, true);
            RuntimeError::Protocol(msg)
        };
        let data = match t.header.dtype() {
            DType::F64 => Payload::F64(t.to_f64()?),
            DType::Compressed => {
                let n = t.header.shape.iter().product::<u64>() as usize;
                let v = fusion_compress::decode(&t.data, n).map_err(|e| {
                    fail(format!(
                        "bad data from {peer} (stage {from_stage}), edge {}: {e}",
                        t.header.edge
                    ))
                })?;
                // The decoder refuses what could decode to a non-finite value; checked again
                // here so that no codec can carry one into the stage.
                if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                    return Err(fail(format!(
                        "bad data from {peer} (stage {from_stage}), edge {}: value {i} decodes \
                         to {}",
                        t.header.edge, v[i]
                    )));
                }
                Payload::F32(v)
            }
            _ => Payload::F32(t.to_f32()?),
        };
        let key = Key {
            step: t.header.step,
            micro_batch: t.header.micro_batch,
            direction: t.header.direction,
            id: t.header.edge,
            from_stage: from_stage as u32,
        };
        let mut streams = self
            .streams
            .lock()
            .map_err(|_| RuntimeError::Protocol("the stream table's lock is poisoned".into()))?;
        // Every session was admitted (and its peer's stream entered) before it delivers.
        let Some(st) = streams.get_mut(peer) else {
            return Err(RuntimeError::Protocol(format!("{peer} was never admitted")));
        };
        let seq = t.header.seq;
        if seq < st.next_seq {
            return Ok(());
        }
        if seq > st.next_seq {
            // A gap: tensors were lost. A suspicion, not proof (either side may be at fault).
            let msg = format!("{peer} sent tensor #{seq} where #{} was due", st.next_seq);
            self.mailbox.poison_blaming(msg.clone(), peer, false);
            return Err(RuntimeError::Protocol(msg));
        }
        self.mailbox
            .put(key, data)
            .map_err(|e| fail(format!("from {peer}: {e}")))?;
        st.next_seq += 1;
        if let Some(p) = &self.progress {
            p.received(peer);
        }
        Ok(())
    }
}

/// The node's listening side; lives as long as the node.
/// A peer the broker named in a probe round or an assignment: where it listens, the emulated
/// link to pace what goes to it (if any), and the SHA-256 of the certificate it joined with.
#[derive(Clone, Debug)]
pub struct PeerAddr {
    pub id: String,
    pub address: String,
    pub stage: usize,
    pub link: Option<PacedLink>,
    pub pin: Vec<u8>,
    /// How this node opens its sessions to the peer, and gets the peer's sessions to it.
    pub send: SendRoute,
    pub receive: ReceiveRoute,
    /// The node relaying sessions between the two (when neither accepts connections).
    pub relay_node: String,
}

/// Peers the broker said may probe this node (or fetch shards from it), by node id.
type Probers = Arc<Mutex<HashMap<String, PeerAddr>>>;

pub struct DataPlane {
    pub address: SocketAddr,
    /// The node's progress, with the tensors sent to and received from each peer.
    pub progress: Arc<Tracker>,
    current: Arc<Mutex<Option<Arc<Inbound>>>>,
    probers: Probers,
    fetchers: Probers,
    store: Arc<ShardStore>,
    identity: NodeIdentity,
    node_id: String,
    token: String,
    accept_task: tokio::task::JoinHandle<()>,
    /// What the sessions this node opens itself need of its accepting side.
    ctx: Arc<AcceptContext>,
}

/// The data plane's side of shard copies, owned, for a task of its own.
#[derive(Clone)]
pub struct Fetcher {
    identity: NodeIdentity,
    node_id: String,
    token: String,
    store: Arc<ShardStore>,
}

impl Fetcher {
    /// Copies a shard from `peer` into this node's store (see [`crate::fetch::fetch`]).
    pub async fn fetch(&self, peer: &PeerAddr, want: &Wanted<'_>) -> Result<ShardFile> {
        let me = Hello {
            fetch: true,
            ..hello(&self.node_id, &self.token, 0)
        };
        crate::fetch::fetch(
            &self.identity,
            me,
            &peer.id,
            &peer.address,
            &peer.pin,
            &self.store,
            want,
        )
        .await
    }

    /// The node's shard files.
    pub fn store(&self) -> &ShardStore {
        &self.store
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.accept_task.abort();
        // Ends the sessions this node keeps open itself (they run while its generation does).
        if let Ok(mut cur) = self.current.lock() {
            *cur = None;
        }
    }
}

impl DataPlane {
    /// Listens on `listen` for peers' sessions, keeping at most `limits` connections open;
    /// serves the shard files of `store` to the peers the broker allows.
    /// `accepts: false` emulates a node behind a NAT or a firewall on a local cluster: the port
    /// is bound but never listened on, so every connection to it is refused.
    pub async fn start(
        listen: SocketAddr,
        identity: NodeIdentity,
        node_id: String,
        token: String,
        limits: ConnectionLimits,
        store: Arc<ShardStore>,
        accepts: bool,
    ) -> Result<Self> {
        let bind_err = crate::error::io_err(format!("binding the data plane to {listen}"));
        let socket = match listen {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }
        .map_err(crate::error::io_err("data plane socket"))?;
        socket.set_reuseaddr(true).ok();
        socket.bind(listen).map_err(bind_err)?;
        let address = socket
            .local_addr()
            .map_err(crate::error::io_err("data plane address"))?;
        let acceptor = TlsAcceptor::from(server_config(&identity)?);
        let current: Arc<Mutex<Option<Arc<Inbound>>>> = Arc::new(Mutex::new(None));
        let probers: Probers = Arc::default();
        let fetchers: Probers = Arc::default();
        let ctx = AcceptContext {
            acceptor,
            current: current.clone(),
            probers: probers.clone(),
            fetchers: fetchers.clone(),
            store: store.clone(),
            me: hello(&node_id, "", 0),
            token: token.clone(),
            gate: ConnectionGate::new(limits),
            relay: Arc::default(),
            slots: Arc::default(),
            probe_round: Mutex::default(),
        };
        let ctx = Arc::new(ctx);
        let accept_task = if accepts {
            let listener = socket
                .listen(1024)
                .map_err(crate::error::io_err(format!("listening on {address}")))?;
            tokio::spawn(accept_loop(listener, ctx.clone()))
        } else {
            tracing::warn!("{node_id}: emulating a node that accepts no connections at {address}");
            tokio::spawn(async move {
                let _bound = socket;
                std::future::pending::<()>().await
            })
        };
        Ok(DataPlane {
            address,
            progress: Arc::new(Tracker::new()),
            current,
            probers,
            fetchers,
            store,
            identity,
            node_id,
            token,
            accept_task,
            ctx,
        })
    }

    /// Test hook: the relay this node runs alters byte `at` of every session it relays.
    pub fn tamper_relayed(&self, at: Option<u64>) {
        self.ctx.relay.set_tamper(at);
    }

    /// Starts accepting sessions of a new assignment (and refusing the old one's).
    pub fn set_inbound(&self, inbound: Option<Arc<Inbound>>) {
        if let Ok(mut cur) = self.current.lock() {
            if let Some(old) = cur.take() {
                old.mailbox.poison("the assignment changed".into());
            }
            if let Some(ib) = &inbound {
                self.ctx.slots.retain_from(ib.generation);
            }
            *cur = inbound;
        }
    }

    /// Opens the sessions of `senders` to this node that this node must open itself (it accepts
    /// no connections: reversed or relayed), keeping each open for `generation` (see `pull`).
    pub fn dial_senders(&self, generation: u64, senders: Vec<PeerAddr>) {
        for peer in senders {
            if peer.receive != ReceiveRoute::Accept {
                tokio::spawn(crate::pull::keep_open(
                    self.ctx.clone(),
                    generation,
                    self.node_id.clone(),
                    peer,
                ));
            }
        }
    }

    /// Lets `peers` open probe sessions to this node (replacing the previous set); replies to
    /// each are paced to its link when links are emulated.
    pub fn allow_probers(&self, peers: HashMap<String, PeerAddr>) {
        if let Ok(mut p) = self.probers.lock() {
            *p = peers;
        }
    }

    /// Starts probe round `round` on this node: it relays the probes `relays` (sender,
    /// receiver) of it, and takes reversed probe connections only of it.
    pub fn start_probe_round(
        &self,
        round: u64,
        relays: impl IntoIterator<Item = (String, String)>,
    ) {
        if let Ok(mut r) = self.ctx.probe_round.lock() {
            *r = Some(ProbeRound {
                round,
                relays: relays.into_iter().collect(),
                started: std::time::Instant::now(),
            });
        }
    }

    /// Opens this node's side of `peer`'s probe `key` (of round `round`) to it when the path has
    /// this node open it (it accepts no connections: it dials the prober, the relay or a
    /// punch), and serves the probe. The prober probes its peers one after another, so this
    /// side dials again after each failed try (a dial that no probe took) until a probe was
    /// served, the round is over, or `within` has passed.
    pub fn open_probe_half(
        &self,
        round: u64,
        key: String,
        peer: PeerAddr,
        within: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let ctx = self.ctx.clone();
        tokio::spawn(async move {
            let until = tokio::time::Instant::now() + within;
            let mut last = None;
            for _ in 0..MAX_PROBE_HALF_TRIES {
                if !ctx.in_probe_round(round) {
                    break;
                }
                let served = crate::pull::open_once(&ctx, &key, &peer);
                match tokio::time::timeout_at(until, served).await {
                    Ok(Ok(())) => return,
                    Ok(Err(e)) => last = Some(e),
                    Err(_) => break,
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            if let Some(e) = last {
                tracing::debug!("the probe {key} from {}: {e}", peer.id);
            }
        })
    }

    /// Measures the link to `peer` over the path the broker routed it (`peer.send`), as
    /// `probe` does for a direct one; `key` names the probe at a relay or in reverse slots, and
    /// the connection must open within `open_within`.
    pub async fn probe_over(
        &self,
        peer: &PeerAddr,
        key: String,
        max_bytes: u64,
        open_within: Duration,
    ) -> Result<LinkEstimate> {
        let target = Target {
            identity: self.identity.clone(),
            hello: Hello {
                probe: true,
                ..hello(&self.node_id, &self.token, 0)
            },
            peer: peer.id.clone(),
            address: peer.address.clone(),
            link: peer.link,
            pin: peer.pin.clone(),
            route: peer.send.clone(),
            slots: self.ctx.slots.clone(),
            key: Some(key),
        };
        let session = tokio::time::timeout(open_within, target.session())
            .await
            .map_err(|_| RuntimeError::PathFailed {
                peer: peer.id.clone(),
                reason: format!(
                    "its probe's connection did not open within {} s",
                    open_within.as_secs()
                ),
            })??;
        measure_paced(session, peer, max_bytes).await
    }

    /// Lets `peers` open fetch sessions to this node (replacing the previous set).
    pub fn allow_fetchers(&self, peers: HashMap<String, PeerAddr>) {
        if let Ok(mut p) = self.fetchers.lock() {
            *p = peers;
        }
    }

    /// The node's shard files, for a blocking thread.
    pub fn store_handle(&self) -> Arc<ShardStore> {
        self.store.clone()
    }

    /// What a shard copy running beside the node's other work needs of the data plane.
    pub fn fetcher(&self) -> Fetcher {
        Fetcher {
            identity: self.identity.clone(),
            node_id: self.node_id.clone(),
            token: self.token.clone(),
            store: self.store.clone(),
        }
    }

    /// Measures the link to `peer` (bandwidth and latency) with a bounded probe of at most
    /// `max_bytes` per transfer, pacing this side to its link when links are emulated.
    /// Returns it with the address the probe left from.
    pub async fn probe(&self, peer: &PeerAddr, max_bytes: u64) -> Result<(LinkEstimate, String)> {
        let me = Hello {
            probe: true,
            ..hello(&self.node_id, &self.token, 0)
        };
        let tcp = crate::outgoing::connect_tcp(&peer.id, &peer.address).await?;
        let local = tcp.local_addr().map(|a| a.to_string()).unwrap_or_default();
        let session = crate::outgoing::tls_client(
            &self.identity,
            &peer.id,
            &peer.address,
            Box::new(tcp),
            &peer.pin,
            me,
        )
        .await?;
        measure_paced(session, peer, max_bytes)
            .await
            .map(|e| (e, local))
    }

    /// Opens sessions to `peers` for `generation`; tensors handed
    /// to the returned outbox are sent in order per peer (see `outgoing`: a broken session is
    /// re-opened; one whose frame write takes longer than `stall` fails). A send failure poisons
    /// `mailbox`, suspecting the peer; every tensor written is counted in `progress`.
    pub async fn connect(
        &self,
        generation: u64,
        peers: Vec<PeerAddr>,
        mailbox: Arc<Mailbox>,
        progress: Handle,
        stall: Duration,
    ) -> Result<Outbox> {
        // Opened at once: a reversed or punched session may wait for its peer's assignment,
        // and must not hold up the others.
        let opening: Vec<_> = peers
            .into_iter()
            .map(|p| {
                let target = Target {
                    identity: self.identity.clone(),
                    hello: hello(&self.node_id, &self.token, generation),
                    peer: p.id.clone(),
                    address: p.address,
                    link: p.link,
                    pin: p.pin,
                    route: p.send,
                    slots: self.ctx.slots.clone(),
                    key: None,
                };
                let open = target.clone();
                (
                    p.stage,
                    target,
                    tokio::spawn(async move { open.open().await }),
                )
            })
            .collect();
        let mut senders = HashMap::new();
        for (stage, target, opened) in opening {
            let conn = opened
                .await
                .map_err(|e| RuntimeError::Protocol(format!("opening a session: {e}")))??;
            let peer = target.peer.clone();
            let (tx, rx) = mpsc::channel(OUTBOX_DEPTH);
            let session = SendSession {
                target,
                mailbox: mailbox.clone(),
                progress: progress.clone(),
                stall,
            };
            tokio::spawn(send_loop(conn, rx, session));
            senders.insert(
                stage,
                PeerSender {
                    peer,
                    tx,
                    bytes: Arc::new(AtomicU64::new(0)),
                    tensors: Arc::new(AtomicU64::new(0)),
                },
            );
        }
        Ok(Outbox {
            senders,
            compression: Mutex::default(),
            progress,
            mailbox,
            lie: None,
        })
    }
}

fn hello(node_id: &str, token: &str, generation: u64) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        node_id: node_id.into(),
        token: token.into(),
        backend: String::new(),
        software_version: env!("CARGO_PKG_VERSION").into(),
        generation,
        probe: false,
        fetch: false,
    }
}

struct PeerSender {
    peer: String,
    tx: mpsc::Sender<Outgoing>,
    bytes: Arc<AtomicU64>,
    tensors: Arc<AtomicU64>,
}

/// Hands tensors to the per-peer senders; usable from the compute thread.
pub struct Outbox {
    senders: HashMap<usize, PeerSender>,
    compression: Mutex<OutboxCompression>,
    /// Where a send blocked on a full queue is reported.
    progress: Handle,
    /// A test hook: the step at which this node lies on the data plane, and how.
    lie: Option<(u64, BadResult)>,
    /// Poisoned when the step is abandoned: a blocked send gives up then.
    mailbox: Arc<Mailbox>,
}

/// The codecs in force per (peer stage, direction) and the error-feedback residuals.
#[derive(Default)]
struct OutboxCompression {
    settings: NodeCompression,
    compressors: HashMap<(usize, i32), (Codec, Box<dyn Compressor>)>,
    feedback: ErrorFeedback,
}

impl OutboxCompression {
    /// The compressor for `to` in `direction`, when that direction of that link compresses.
    fn codec(&self, to: usize, direction: Direction) -> Codec {
        self.settings.peers.iter().find(|p| p.stage == to).map_or(
            Codec::None,
            |p| match direction {
                Direction::Activation => p.forward,
                Direction::Gradient => p.backward,
                _ => Codec::None,
            },
        )
    }

    /// Whether a tensor with `header` sent to `to` is compressed.
    fn active(&self, to: usize, header: &TensorHeader) -> bool {
        Direction::try_from(header.direction).is_ok_and(|d| {
            self.codec(to, d) != Codec::None && header.step >= self.settings.warmup_steps
        })
    }

    /// The message for `values` sent to `to`, or None to send them dense.
    fn compress(&mut self, to: usize, header: &TensorHeader, values: &[f32]) -> Option<Vec<u8>> {
        let direction = Direction::try_from(header.direction).ok()?;
        let codec = self.codec(to, direction);
        if codec == Codec::None || header.step < self.settings.warmup_steps {
            return None;
        }
        let key = (to, direction as i32);
        let stale = self.compressors.get(&key).is_none_or(|(c, _)| *c != codec);
        if stale {
            let c = compressor(
                codec,
                self.settings.values,
                self.settings.selection,
                header.edge ^ ((to as u64) << 32),
            );
            self.compressors.insert(key, (codec, c));
        }
        let (_, c) = self.compressors.get_mut(&key)?;
        Some(
            if direction == Direction::Gradient && self.settings.error_feedback {
                // One residual per tensor stream: (receiving stage, tensor).
                self.feedback
                    .compress(c.as_mut(), header.edge ^ ((to as u64) << 48), values)
            } else {
                c.compress(values)
            },
        )
    }
}

impl Outbox {
    /// Sets the codecs this node applies per link from now on (residuals carry over).
    pub fn set_compression(&self, settings: NodeCompression) {
        if let Ok(mut c) = self.compression.lock() {
            c.settings = settings;
        }
    }

    /// Queues `data` for stage `to`, compressed when that link and direction compress.
    pub fn send(&self, to: usize, header: TensorHeader, data: &Payload) -> Result<()> {
        self.send_reporting(to, header, data, true)
    }

    /// [`Outbox::send`]; `report`: whether a wait for a full queue shows in the node's progress
    /// (not from a thread beside the compute thread, such as an overlapped outer exchange's).
    pub fn send_reporting(
        &self,
        to: usize,
        header: TensorHeader,
        data: &Payload,
        report: bool,
    ) -> Result<()> {
        let s = self.senders.get(&to).ok_or_else(|| {
            RuntimeError::Protocol(format!("no data-plane session to stage {to}"))
        })?;
        let compressed = self.compression.lock().ok().and_then(|mut c| match data {
            Payload::F32(v) => c.compress(to, &header, v),
            // Compression is lossy anyway: f64 nodes' tensors are compressed from f32.
            Payload::F64(v) if c.active(to, &header) => {
                let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
                c.compress(to, &header, &v)
            }
            Payload::F64(_) => None,
        });
        let (dtype, bytes) = match (compressed, data) {
            (Some(m), _) => (DType::Compressed, m),
            (None, Payload::F32(v)) => (DType::F32, fusion_transport::f32_le_bytes(v)),
            (None, Payload::F64(v)) => (DType::F64, fusion_transport::f64_le_bytes(v)),
        };
        let out = Outgoing {
            header: TensorHeader {
                dtype: dtype as i32,
                ..header
            },
            data: bytes,
        };
        match self.lie {
            // A test hook: this node lies at this step, as a hostile node would.
            Some((at, bad)) if at == out.header.step => {
                tracing::warn!("test hook: lying on the data plane at step {at} ({bad:?})");
                crate::hostile::lie(bad, out)
                    .into_iter()
                    .try_for_each(|o| self.queue(s, o, report))
            }
            _ => self.queue(s, out, report),
        }
    }

    /// Sends a message the caller encoded itself (`fusion_compress`'s self-describing format) as
    /// a compressed tensor of `header`'s shape; `report` as in [`Outbox::send_reporting`] (every
    /// such message comes from a ring, which knows whether it reports).
    pub fn send_encoded_reporting(
        &self,
        to: usize,
        header: TensorHeader,
        message: Vec<u8>,
        report: bool,
    ) -> Result<()> {
        let s = self.senders.get(&to).ok_or_else(|| {
            RuntimeError::Protocol(format!("no data-plane session to stage {to}"))
        })?;
        let out = Outgoing {
            header: TensorHeader {
                dtype: DType::Compressed as i32,
                ..header
            },
            data: message,
        };
        self.queue(s, out, report)
    }

    /// Counts and queues `out` for its peer, waiting while the peer's queue is full, until the
    /// step is abandoned; with `report`, the wait shows in the node's progress.
    fn queue(&self, s: &PeerSender, mut out: Outgoing, report: bool) -> Result<()> {
        s.bytes.fetch_add(out.data.len() as u64, Ordering::Relaxed);
        s.tensors.fetch_add(1, Ordering::Relaxed);
        let (step, mb) = (out.header.step, out.header.micro_batch as usize);
        let mut blocked = false;
        let result = loop {
            match s.tx.try_send(out) {
                Ok(()) => break Ok(()),
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    // The sender task ended: its failure (in the mailbox) says why.
                    self.mailbox.check()?;
                    break Err(RuntimeError::Peer {
                        peer: s.peer.clone(),
                        reason: format!("the session to {} is closed", s.peer),
                        proven: false,
                    });
                }
                Err(mpsc::error::TrySendError::Full(back)) => {
                    if !blocked && report {
                        self.progress.enter(Phase::Sending, step, mb, &s.peer);
                    }
                    blocked = true;
                    if let Err(e) = self.mailbox.check() {
                        break Err(e);
                    }
                    std::thread::sleep(Duration::from_millis(2));
                    out = back;
                }
            }
        };
        if blocked && report {
            self.progress.resume();
        }
        result
    }

    /// Makes this node lie on the data plane at one step, as a hostile node would (a test hook).
    pub fn with_lie(mut self, lie: Option<(u64, BadResult)>) -> Self {
        self.lie = lie.filter(|(_, b)| b.on_data_plane());
        self
    }

    /// Bytes and tensors queued per peer since the last call (and resets the counters).
    pub fn take_sent(&self) -> Vec<(String, u64, u64)> {
        let mut v: Vec<(String, u64, u64)> = self
            .senders
            .values()
            .map(|s| {
                (
                    s.peer.clone(),
                    s.bytes.swap(0, Ordering::Relaxed),
                    s.tensors.swap(0, Ordering::Relaxed),
                )
            })
            .collect();
        v.sort();
        v
    }
}

pub(crate) struct AcceptContext {
    acceptor: TlsAcceptor,
    current: Arc<Mutex<Option<Arc<Inbound>>>>,
    probers: Probers,
    fetchers: Probers,
    store: Arc<ShardStore>,
    me: Hello,
    token: String,
    /// Caps the connections open at once (in all and per address) before any TLS work.
    gate: ConnectionGate,
    /// Pairs the halves of sessions between nodes that accept no connections.
    relay: Arc<Relay>,
    /// Connections receivers dialled for this node's sessions to them.
    slots: Arc<ReverseSlots>,
    /// The current probe round over the links' paths, if any.
    probe_round: Mutex<Option<ProbeRound>>,
}

/// A probe round over the links' paths, as this node takes part in it.
struct ProbeRound {
    round: u64,
    /// The probes ("sender", "receiver") this node relays in it.
    relays: std::collections::HashSet<(String, String)>,
    started: std::time::Instant,
}

/// Tries at most to open this node's side of one probe to it (each waits for the prober, a
/// relay's pairing or a punch, so the window bounds them too).
const MAX_PROBE_HALF_TRIES: u32 = 30;

/// How long a probe round's relays and reversed probe connections are accepted after it
/// started (unless a newer round replaces it first).
pub const PROBE_ROUND_LIFETIME: Duration = Duration::from_secs(600);

impl AcceptContext {
    /// Whether probe round `round` is this node's current one, not too old, and `also` holds
    /// of it.
    fn probe_round_is(&self, round: u64, also: impl Fn(&ProbeRound) -> bool) -> bool {
        self.probe_round.lock().is_ok_and(|r| {
            r.as_ref().is_some_and(|r| {
                r.round == round && r.started.elapsed() < PROBE_ROUND_LIFETIME && also(r)
            })
        })
    }

    /// Whether probe round `round` is this node's current one and not too old.
    fn in_probe_round(&self, round: u64) -> bool {
        self.probe_round_is(round, |_| true)
    }

    /// Whether this node relays the probe from `sender` to `receiver` of round `round`.
    fn relays_probe(&self, round: u64, pair: &(String, String)) -> bool {
        self.probe_round_is(round, |r| r.relays.contains(pair))
    }
}

impl AcceptContext {
    /// The generation of the current assignment, if any.
    pub(crate) fn generation(&self) -> Option<u64> {
        self.current
            .lock()
            .ok()
            .and_then(|c| c.as_ref().map(|ib| ib.generation))
    }
}

/// How long the rest of a frame may take once its length has arrived (a 4 MiB frame takes 4 s
/// at 8 Mbit/s): a peer trickling bytes cannot hold a session's reader.
const FRAME_BODY_TIMEOUT: Duration = Duration::from_secs(120);

async fn accept_loop(listener: TcpListener, ctx: Arc<AcceptContext>) {
    loop {
        let (tcp, addr) = ctx.gate.accept(&listener).await;
        let ctx = ctx.clone();
        tokio::spawn(async move {
            if let Err(e) = route_connection(tcp, &ctx).await {
                tracing::warn!("data-plane session from {addr}: {e}");
            }
        });
    }
}

/// Serves a plain TLS session, or hands a connection that opens with a rendezvous preamble to
/// the relay or to the sender waiting for it.
async fn route_connection(mut tcp: GatedStream, ctx: &AcceptContext) -> Result<()> {
    let mut first = [0u8; 1];
    let peeked = tokio::time::timeout(TLS_TIMEOUT, tcp.tcp().peek(&mut first))
        .await
        .map_err(|_| RuntimeError::Timeout("the first byte of a session".into()))?
        .map_err(crate::error::io_err("reading a session's first byte"))?;
    if peeked == 0 || first[0] != MAGIC[0] {
        let observed = tcp.tcp().peer_addr().ok();
        return serve_peer(tcp, ctx, None, observed).await;
    }
    let p = Preamble::read(&mut tcp)
        .await
        .map_err(crate::error::io_err("reading a rendezvous preamble"))?;
    crate::rendezvous::keep_alive(tcp.tcp());
    if let Some((round, sender, receiver)) = crate::rendezvous::probe_parts(&p.key) {
        let pair = (sender.to_string(), receiver.to_string());
        let key = p.key.clone();
        return route_probe(tcp, ctx, p, round, pair)
            .await
            .map_err(|why| RuntimeError::Rejected(format!("rendezvous '{key}': {why}")));
    }
    let refuse = |why: String| RuntimeError::Rejected(format!("rendezvous '{}': {why}", p.key));
    let Some((generation, sender, receiver)) = parse_key(&p.key) else {
        return Err(refuse("not generation/sender/receiver".into()));
    };
    let ib = rendezvous_inbound(ctx, generation).await.map_err(refuse)?;
    match p.kind {
        Kind::Reverse if sender == ctx.me.node_id => ctx.slots.put(p.key, Box::new(tcp)),
        Kind::Reverse => return Err(refuse("this node is not its sender".into())),
        kind if ib
            .relays
            .contains(&(sender.to_string(), receiver.to_string())) =>
        {
            ctx.relay.offer(kind, p.key, Box::new(tcp))
        }
        _ => {
            return Err(refuse(
                "the broker did not ask this node to relay it".into(),
            ))
        }
    }
    Ok(())
}

/// Runs a probe over an open session, pacing this side to `peer`'s emulated link.
async fn measure_paced(
    (r, w): crate::outgoing::Session,
    peer: &PeerAddr,
    max_bytes: u64,
) -> Result<LinkEstimate> {
    let (w, pump) = pace_writer(w.into_inner(), peer.link);
    let result = probe::measure(r, w, &peer.id, max_bytes).await;
    if let Some(p) = pump {
        p.abort();
    }
    result
}

/// Hands a probe's connection (see `route_connection`) to the probe of this node's current
/// round waiting for it (from a peer of that round), or to the relay when this node relays that
/// probe in the round (waiting a little for the round: the prober may have its round first).
async fn route_probe(
    tcp: GatedStream,
    ctx: &AcceptContext,
    p: Preamble,
    round: u64,
    (sender, receiver): (String, String),
) -> std::result::Result<(), String> {
    if p.kind == Kind::Reverse {
        let admitted = ctx.probers.lock().is_ok_and(|m| m.contains_key(&receiver));
        if sender != ctx.me.node_id || !ctx.in_probe_round(round) || !admitted {
            return Err("not a probe of this node's current round".into());
        }
        ctx.slots.put(p.key, Box::new(tcp));
        return Ok(());
    }
    let pair = (sender, receiver);
    for _ in 0..PROBE_ROUND_WAIT.as_millis() / 100 {
        if ctx.relays_probe(round, &pair) {
            ctx.relay.offer(p.kind, p.key, Box::new(tcp));
            return Ok(());
        }
        // Only a round this node has not started yet is worth waiting for.
        let started = ctx
            .probe_round
            .lock()
            .is_ok_and(|r| r.as_ref().is_some_and(|r| r.round >= round));
        if started {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err("the broker did not ask this node to relay this probe in its current round".into())
}

/// How long a relay waits for the probe round that names a probe it is asked to relay.
const PROBE_ROUND_WAIT: Duration = Duration::from_secs(10);

/// `generation/sender/receiver`.
fn parse_key(key: &str) -> Option<(u64, &str, &str)> {
    let mut parts = key.splitn(3, '/');
    let generation = parts.next()?.parse().ok()?;
    Some((generation, parts.next()?, parts.next()?))
}

/// The assignment a rendezvous for `generation` belongs to: the current one, or the next one
/// once it arrives (a peer may have its assignment first; waited for as a session is).
async fn rendezvous_inbound(
    ctx: &AcceptContext,
    generation: u64,
) -> std::result::Result<Arc<Inbound>, String> {
    let current = || ctx.current.lock().ok().and_then(|c| c.clone());
    for _ in 0..ASSIGNMENT_WAIT.as_millis() / 100 {
        match current() {
            Some(ib) if ib.generation == generation => return Ok(ib),
            Some(ib) if ib.generation > generation || generation > ib.generation + 1 => break,
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    Err(format!(
        "generation {generation} is not this node's current one ({:?})",
        current().map(|ib| ib.generation)
    ))
}

/// Runs one inbound session until the peer closes it. Errors before the session is admitted only
/// affect that connection; a tensor that fails validation from an admitted peer poisons the
/// mailbox, so the step fails with the reason.
///
/// `via`: the relay a relayed session passes through. A record that fails TLS's authentication
/// on such a session was altered by the relay, or forged by the sender (which this node cannot
/// tell apart): the mailbox is poisoned blaming the path, and the broker routes the pair through
/// another relay.
/// `observed`: where the connection came from (probe replies tell the prober).
pub(crate) async fn serve_peer<S>(
    tcp: S,
    ctx: &AcceptContext,
    via: Option<&str>,
    observed: Option<SocketAddr>,
) -> Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let tls = tokio::time::timeout(TLS_TIMEOUT, ctx.acceptor.accept(tcp))
        .await
        .map_err(|_| RuntimeError::Timeout("TLS handshake".into()))?
        .map_err(crate::error::io_err("TLS handshake"))?;
    let cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first().cloned());
    let (mut r, mut w, info) =
        accept_session(tls, ctx.me.clone(), &ctx.token, DEFAULT_MAX_FRAME).await?;
    r.set_body_timeout(FRAME_BODY_TIMEOUT);
    let peer = info.peer.node_id.clone();
    if info.peer.probe {
        let observed = observed.map(|a| a.to_string()).unwrap_or_default();
        return serve_probe(r, w, cert, &peer, ctx, &observed).await;
    }
    if info.peer.fetch {
        return serve_fetch(r, w, cert, &peer, ctx).await;
    }
    // Peers connect as soon as they have their own assignment, possibly before this node has
    // received its one (the broker ships the stages' state one node after another: over a
    // gigabyte per stage of gpt2-medium): wait for it rather than refusing.
    let mut inbound = ctx.current.lock().ok().and_then(|c| c.clone());
    let polls = ASSIGNMENT_WAIT.as_millis() / 100;
    for _ in 0..polls {
        if inbound
            .as_ref()
            .is_some_and(|ib| ib.generation >= info.peer.generation)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        inbound = ctx.current.lock().ok().and_then(|c| c.clone());
    }
    let refusal = match &inbound {
        None => Some("this node has no assignment".to_string()),
        Some(ib) if ib.generation != info.peer.generation => Some(format!(
            "assignment generation {} is not the current {}",
            info.peer.generation, ib.generation
        )),
        Some(ib) if !ib.senders.contains_key(&peer) => {
            Some(format!("'{peer}' does not send to this node"))
        }
        Some(ib) => {
            let pin = ib.pins.get(&peer).map(Vec::as_slice);
            match certificate_admitted(cert.as_ref(), &peer, pin) {
                Ok(()) => ib.admit(&peer),
                Err(refusal) => Some(refusal.to_string()),
            }
        }
    };
    if let Some(reason) = refusal {
        let _ = w
            .write(&Frame {
                body: Some(Body::Goodbye(Goodbye {
                    reason: reason.clone(),
                })),
            })
            .await;
        let _ = w.flush().await;
        return Err(RuntimeError::Rejected(format!("refused {peer}: {reason}")));
    }
    let Some(ib) = inbound else {
        return Ok(());
    };
    let from_stage = ib.senders[&peer];
    let expected = ib.expected.clone();
    let mut rx = TensorReceiver::new(r, move |edge: u64, dir: Direction| {
        expected
            .get(&(dir as i32, edge))
            .map(|shape| ExpectedTensor {
                dtypes: vec![DType::F32, DType::F64, DType::Compressed],
                shape: shape.clone(),
                direction: dir,
            })
    });
    rx.require_finite = true;
    loop {
        // Backpressure: while this peer's tensors wait unread in the mailbox past the budget,
        // leave the rest in the socket (a peer cannot fill this node's memory by running ahead).
        while ib.mailbox.held_from(from_stage as u32) > ib.budget {
            if ib.mailbox.is_poisoned() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        match rx.recv().await {
            Ok(t) if ib.stop_reading_at.is_some_and(|s| t.header.step >= s) => {
                tracing::warn!("test hook: no longer reading from {peer}");
                tokio::time::sleep(Duration::from_secs(3600)).await;
                return Ok(());
            }
            Ok(t) => ib.deliver(&peer, from_stage, t)?,
            Err(fusion_transport::TransportError::Refused(reason)) => {
                // The peer closed the session with a goodbye (its assignment ended).
                tracing::debug!("{peer} closed its session: {reason}");
                return Ok(());
            }
            Err(fusion_transport::TransportError::Io(e))
                if via.is_some() && e.kind() == std::io::ErrorKind::InvalidData =>
            {
                let relay = via.unwrap_or_default();
                let msg = format!(
                    "the session from {peer} relayed by {relay} was altered on the way: {e}"
                );
                ib.mailbox.poison_path(msg.clone(), &peer);
                return Err(RuntimeError::Protocol(msg));
            }
            Err(
                e @ (fusion_transport::TransportError::Io(_)
                | fusion_transport::TransportError::Closed),
            ) => {
                // The connection broke (the peer died, or the way to it failed): the sender
                // re-opens the session and sends again; if it cannot, it or the broker says so.
                return Err(RuntimeError::Protocol(format!(
                    "the session from {peer} (stage {from_stage}) broke: {e}"
                )));
            }
            Err(e) => {
                // A malformed stream is proof against the peer.
                let msg = format!("bad data from {peer} (stage {from_stage}): {e}");
                ib.mailbox.poison_blaming(msg.clone(), &peer, true);
                return Err(RuntimeError::Protocol(msg));
            }
        }
    }
}

/// Answers a probe session from `peer` if the broker named it in this node's probe round (it
/// may arrive a little before this node hears of the round) and it presents the certificate the
/// round pins for it (a peer that re-joined with a new certificate may also be a little ahead
/// of the round that carries the new pin: both are waited for, up to 10 s).
async fn serve_probe<R, W>(
    r: FrameReader<R>,
    mut w: FrameWriter<W>,
    cert: Option<tokio_rustls::rustls::pki_types::CertificateDer<'static>>,
    peer: &str,
    ctx: &AcceptContext,
    observed: &str,
) -> Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let lookup = || ctx.probers.lock().ok().and_then(|p| p.get(peer).cloned());
    let check = |link: &Option<PeerAddr>| match link {
        None => Some(format!("'{peer}' is not in this node's probe round")),
        Some(p) => certificate_admitted(cert.as_ref(), peer, Some(&p.pin))
            .err()
            .map(|r| r.to_string()),
    };
    let mut link = lookup();
    let mut refusal = check(&link);
    for _ in 0..100 {
        if refusal.is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        link = lookup();
        refusal = check(&link);
    }
    if let Some(reason) = refusal {
        let _ = w
            .write(&Frame {
                body: Some(Body::Goodbye(Goodbye {
                    reason: reason.clone(),
                })),
            })
            .await;
        let _ = w.flush().await;
        return Err(RuntimeError::Rejected(format!(
            "refused a probe from {peer}: {reason}"
        )));
    }
    let (w, pump) = pace_writer(w.into_inner(), link.and_then(|p| p.link));
    let result = probe::answer(r, w, peer, observed).await;
    if let Some(p) = pump {
        // Let the last replies leave at the link's pace.
        let _ = tokio::time::timeout(Duration::from_secs(5), p).await;
    }
    result
}

/// Answers a fetch session from `peer` if the broker allowed it (waiting up to 10 s for the
/// permission, which may arrive a little after the fetcher's command) with the certificate it
/// joined with.
async fn serve_fetch<R, W>(
    r: FrameReader<R>,
    mut w: FrameWriter<W>,
    cert: Option<tokio_rustls::rustls::pki_types::CertificateDer<'static>>,
    peer: &str,
    ctx: &AcceptContext,
) -> Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let check = || match ctx.fetchers.lock().ok().and_then(|p| p.get(peer).cloned()) {
        None => Some(format!("'{peer}' may not fetch from this node")),
        Some(p) => certificate_admitted(cert.as_ref(), peer, Some(&p.pin))
            .err()
            .map(|r| r.to_string()),
    };
    let mut refusal = check();
    for _ in 0..100 {
        if refusal.is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        refusal = check();
    }
    if let Some(reason) = refusal {
        let _ = w
            .write(&Frame {
                body: Some(Body::Goodbye(Goodbye {
                    reason: reason.clone(),
                })),
            })
            .await;
        let _ = w.flush().await;
        return Err(RuntimeError::Rejected(format!(
            "refused a fetch from {peer}: {reason}"
        )));
    }
    crate::fetch::serve(r, w, peer, &ctx.store).await
}

#[cfg(test)]
mod tests_support {
    use super::*;
    use fusion_transport::{client_config, open_session, Certificates, FrameWriter};
    use tokio::net::TcpStream;
    use tokio_rustls::rustls::pki_types::ServerName;
    use tokio_rustls::TlsConnector;

    pub(super) const TOKEN: &str = "tok";

    pub(super) struct Setup {
        pub ca: Certificates,
        pub plane: DataPlane,
        pub mailbox: Arc<Mailbox>,
        /// The certificate node0 joined the broker with (the one node1 pins).
        pub node0: NodeIdentity,
    }

    /// A node with stage 1's assignment: node0 (stage 0) sends it a [2, 3] activation of tensor 5.
    pub(super) async fn setup(budget: Option<usize>) -> Setup {
        let ca = Certificates::new_ca("ca").expect("ca");
        let id = ca.issue("node1", &[]).expect("cert");
        let plane = DataPlane::start(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            id,
            "node1".into(),
            TOKEN.into(),
            ConnectionLimits::default(),
            Arc::new(ShardStore::open(None).expect("store")),
            true,
        )
        .await
        .expect("start");
        let mailbox = Arc::new(Mailbox::new());
        let node0 = ca.issue("node0", &[]).expect("cert");
        let pin = node0.certificate_sha256().expect("fingerprint").to_vec();
        let mut inbound = Inbound::new(
            1,
            mailbox.clone(),
            HashMap::from([("node0".to_string(), 0)]),
            HashMap::from([((Direction::Activation as i32, 5), vec![2, 3])]),
        )
        .with_pins(HashMap::from([("node0".to_string(), pin)]));
        if let Some(b) = budget {
            inbound = inbound.with_budget(b);
        }
        plane.set_inbound(Some(Arc::new(inbound)));
        Setup {
            ca,
            plane,
            mailbox,
            node0,
        }
    }

    type Writer = FrameWriter<tokio::io::WriteHalf<tokio_rustls::client::TlsStream<TcpStream>>>;

    /// Connects to the plane as `claimed` holding a certificate for `cert_name` (node0's admitted
    /// one for "node0", a new one for any other name); returns the writer, or the refusal.
    pub(super) async fn connect(
        s: &Setup,
        cert_name: &str,
        claimed: &str,
        generation: u64,
    ) -> std::result::Result<Writer, String> {
        let id = match cert_name {
            "node0" => s.node0.clone(),
            _ => s.ca.issue(cert_name, &[]).expect("cert"),
        };
        connect_as(s, &id, claimed, generation).await
    }

    /// Connects to the plane as `claimed` presenting `id`.
    pub(super) async fn connect_as(
        s: &Setup,
        id: &NodeIdentity,
        claimed: &str,
        generation: u64,
    ) -> std::result::Result<Writer, String> {
        let connector = TlsConnector::from(client_config(id).expect("config"));
        let tcp = TcpStream::connect(s.plane.address).await.expect("connect");
        let tls = connector
            .connect(ServerName::try_from("node1").expect("name"), tcp)
            .await
            .expect("tls");
        let (mut r, w, _) = open_session(tls, hello(claimed, TOKEN, generation), DEFAULT_MAX_FRAME)
            .await
            .map_err(|e| e.to_string())?;
        // A refused session gets a goodbye right after the hello.
        match tokio::time::timeout(Duration::from_millis(300), r.read()).await {
            Ok(Ok(Frame {
                body: Some(Body::Goodbye(g)),
            })) => Err(g.reason),
            _ => Ok(w),
        }
    }

    /// The reason the mailbox was poisoned, waiting at most 10 s for it.
    pub(super) fn failure(s: &Setup) -> RuntimeError {
        s.mailbox
            .take(
                Key::new(0, 0, Direction::Activation, 5, 0),
                Duration::from_secs(10),
                String::new,
            )
            .expect_err("poisoned")
    }

    pub(super) fn header(shape: &[u64]) -> TensorHeader {
        TensorHeader {
            step: 0,
            micro_batch: 0,
            edge: 5,
            direction: Direction::Activation as i32,
            dtype: DType::F32 as i32,
            shape: shape.to_vec(),
            total_bytes: 0,
            seq: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::*;
    use super::*;
    use fusion_transport::send_tensor;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_assigned_sender_with_its_own_certificate_is_admitted() {
        let s = setup(None).await;
        let err = connect(&s, "rogue", "rogue", 1)
            .await
            .err()
            .expect("refused");
        assert!(err.contains("'rogue' does not send to this node"), "{err}");
        let err = connect(&s, "rogue", "node0", 1)
            .await
            .err()
            .expect("refused");
        assert!(err.contains("not issued for 'node0'"), "{err}");
        let err = connect(&s, "node0", "node0", 0)
            .await
            .err()
            .expect("refused");
        assert!(err.contains("generation 0 is not the current 1"), "{err}");
        // A certificate for node0 that the broker did not admit (an old or revoked one, or one
        // issued under a reused name) does not speak for node0.
        let other = s.ca.issue("node0", &[]).expect("cert");
        let err = connect_as(&s, &other, "node0", 1)
            .await
            .err()
            .expect("refused");
        assert!(err.contains("not the one the broker admitted"), "{err}");
        assert!(s
            .mailbox
            .take(
                Key::new(0, 0, Direction::Activation, 5, 0),
                Duration::from_millis(1),
                String::new
            )
            .is_err());

        let mut w = connect(&s, "node0", "node0", 1).await.expect("admitted");
        let data: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        send_tensor(&mut w, header(&[2, 3]), &data)
            .await
            .expect("send");
        let got = s
            .mailbox
            .take(
                Key::new(0, 0, Direction::Activation, 5, 0),
                Duration::from_secs(10),
                String::new,
            )
            .expect("delivered");
        assert_eq!(got, Payload::F32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        // A re-opened session from the same peer is admitted: a tensor sent again is dropped,
        // the next one is delivered, a gap in the numbering fails the step with proof.
        let mut w = connect(&s, "node0", "node0", 1).await.expect("re-opened");
        send_tensor(&mut w, header(&[2, 3]), &data)
            .await
            .expect("send again");
        let mut next = header(&[2, 3]);
        (next.seq, next.step) = (1, 1);
        send_tensor(&mut w, next.clone(), &data)
            .await
            .expect("send");
        let take = |step| {
            s.mailbox.take(
                Key::new(step, 0, Direction::Activation, 5, 0),
                Duration::from_secs(10),
                String::new,
            )
        };
        assert!(take(1).is_ok(), "the next tensor is delivered");
        (next.seq, next.step) = (3, 2);
        send_tensor(&mut w, next, &data).await.expect("send");
        let err = take(2).expect_err("a gap");
        assert!(
            err.to_string().contains("sent tensor #3 where #2 was due"),
            "{err}"
        );
        // Re-opening is bounded.
        for _ in 2..MAX_SESSIONS_PER_PEER {
            connect(&s, "node0", "node0", 1).await.expect("admitted");
        }
        let err = connect(&s, "node0", "node0", 1)
            .await
            .err()
            .expect("refused");
        assert!(err.contains("sessions in this generation already"), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_malformed_tensor_from_a_peer_fails_the_step_with_the_reason() {
        let s = setup(None).await;
        let mut w = connect(&s, "node0", "node0", 1).await.expect("admitted");
        let data = vec![0u8; 4 * 8];
        // The receiver hangs up after the header, so the sender may see a broken pipe.
        let _ = send_tensor(&mut w, header(&[2, 4]), &data).await;
        let err = failure(&s);
        let msg = err.to_string();
        assert!(
            msg.contains("bad data from node0")
                && msg.contains("does not match the graph's [2, 3]"),
            "{msg}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_compressed_tensor_is_decoded_and_a_malformed_one_fails_the_step() {
        let s = setup(None).await;
        let mut w = connect(&s, "node0", "node0", 1).await.expect("admitted");
        let values = [1.0f32, 0.0, 0.0, 4.0, 0.0, 6.0];
        let msg = fusion_compress::wire::encode_sparse(&values, &[0, 3, 5], Default::default());
        let mut h = header(&[2, 3]);
        h.dtype = DType::Compressed as i32;
        send_tensor(&mut w, h.clone(), &msg).await.expect("send");
        let got = s
            .mailbox
            .take(
                Key::new(0, 0, Direction::Activation, 5, 0),
                Duration::from_secs(10),
                String::new,
            )
            .expect("delivered");
        assert_eq!(got, Payload::F32(values.to_vec()));
        // The same message with a bit set beyond the tensor in its index bitmap.
        let mut bad = msg.clone();
        assert_eq!(bad[20], 2, "a bitmap is the cheapest index encoding here");
        bad[12 + 8 + 1 + 8] |= 0x80;
        h.step = 1;
        let _ = send_tensor(&mut w, h, &bad).await;
        let err = s
            .mailbox
            .take(
                Key::new(1, 0, Direction::Activation, 5, 0),
                Duration::from_secs(10),
                String::new,
            )
            .expect_err("poisoned");
        let m = err.to_string();
        assert!(
            m.contains("bad data from node0") && m.contains("beyond 6 elements"),
            "{m}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_oversized_frame_is_refused_before_allocation() {
        let s = setup(None).await;
        let w = connect(&s, "node0", "node0", 1).await.expect("admitted");
        let mut raw = w.into_inner();
        use tokio::io::AsyncWriteExt;
        raw.write_all(&u32::MAX.to_be_bytes()).await.expect("write");
        raw.flush().await.expect("flush");
        let err = failure(&s);
        assert!(err.to_string().contains("frame"), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn non_finite_values_are_refused() {
        let s = setup(None).await;
        let mut w = connect(&s, "node0", "node0", 1).await.expect("admitted");
        let data: Vec<u8> = [1.0f32, f32::NAN, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        send_tensor(&mut w, header(&[2, 3]), &data)
            .await
            .expect("send");
        let err = failure(&s);
        assert!(err.to_string().contains("non-finite"), "{err}");
    }
}

#[cfg(test)]
mod window_tests {
    use super::tests_support::*;
    use super::*;
    use fusion_transport::send_tensor;

    fn floats(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tensor_two_steps_ahead_is_proof_against_its_sender() {
        let s = setup(None).await;
        s.mailbox.begin_step(0);
        let mut w = connect(&s, "node0", "node0", 1).await.expect("admitted");
        let mut h = header(&[2, 3]);
        h.step = 2;
        let _ = send_tensor(&mut w, h, &floats(&[1.0; 6])).await;
        match failure(&s) {
            RuntimeError::Peer {
                peer,
                reason,
                proven,
            } => {
                assert!(peer == "node0" && proven, "{peer} {proven}");
                assert!(reason.contains("only this step and the next"), "{reason}");
            }
            other => panic!("expected blame on node0, got {other}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_int8_scale_that_overflows_is_refused_not_decoded_to_infinity() {
        let s = setup(None).await;
        let mut w = connect(&s, "node0", "node0", 1).await.expect("admitted");
        let mut msg = fusion_compress::wire::encode_int8(&[1.0, -2.0, 3.0, 0.0, 5.0, 6.0], 6);
        msg[16..20].copy_from_slice(&(f32::MAX / 2.0).to_le_bytes());
        let mut h = header(&[2, 3]);
        h.dtype = DType::Compressed as i32;
        let _ = send_tensor(&mut w, h, &msg).await;
        let err = failure(&s).to_string();
        assert!(
            err.contains("bad data from node0") && err.contains("overflows"),
            "{err}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_running_ahead_is_read_no_further_than_the_budget() {
        // Room for one [2, 3] f32 tensor (24 bytes): the reader stops after the second.
        let s = setup(Some(30)).await;
        let mut w = connect(&s, "node0", "node0", 1).await.expect("admitted");
        for mb in 0..5u32 {
            let mut h = header(&[2, 3]);
            (h.micro_batch, h.seq) = (mb, mb as u64);
            send_tensor(&mut w, h, &floats(&[mb as f32; 6]))
                .await
                .expect("send");
        }
        let held = || s.mailbox.held_from(0);
        for _ in 0..200 {
            if held() >= 48 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(held(), 48, "two tensors read, the rest left in the socket");
        for mb in 0..5u32 {
            let got = s
                .mailbox
                .take(
                    Key::new(0, mb, Direction::Activation, 5, 0),
                    Duration::from_secs(10),
                    String::new,
                )
                .expect("every tensor arrives as the compute thread takes them");
            assert_eq!(got, Payload::F32(vec![mb as f32; 6]));
        }
    }
}

#[cfg(test)]
mod probe_tests {
    use super::*;
    use fusion_transport::Certificates;

    /// A data plane for `name` and the entry by which its peers reach it.
    async fn plane(ca: &Certificates, name: &str) -> (DataPlane, PeerAddr) {
        let id = ca.issue(name, &[]).expect("cert");
        let pin = id.certificate_sha256().expect("fingerprint").to_vec();
        let plane = DataPlane::start(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            id,
            name.into(),
            "tok".into(),
            ConnectionLimits::default(),
            Arc::new(ShardStore::open(None).expect("store")),
            true,
        )
        .await
        .expect("start");
        let addr = PeerAddr {
            id: name.into(),
            address: plane.address.to_string(),
            stage: 0,
            link: None,
            pin,
            send: SendRoute::Dial,
            receive: ReceiveRoute::Accept,
            relay_node: String::new(),
        };
        (plane, addr)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_measures_the_emulated_link_and_strangers_are_refused() {
        let ca = Certificates::new_ca("ca").expect("ca");
        let ((a, to_a), (b, to_b)) = (plane(&ca, "node0").await, plane(&ca, "node1").await);
        // 20 Mbit/s with 15 ms one way, paced on both sides as the broker's round would ask.
        let link = PacedLink {
            bytes_per_sec: 20e6 / 8.0,
            latency: Duration::from_millis(15),
        };
        let paced = |p: &PeerAddr| PeerAddr {
            link: Some(link),
            ..p.clone()
        };
        b.allow_probers(HashMap::from([("node0".to_string(), paced(&to_a))]));
        let e = a.probe(&paced(&to_b), 4 << 20).await.expect("probe");
        let (e, local) = e;
        // Without a NAT between them, the peer saw the probe come from where it left.
        assert_eq!(e.observed, local);
        let mbps = e.bytes_per_s * 8.0 / 1e6;
        // The probe's arithmetic, not the machine's speed, is under test: the emulated figures
        // must come back within a wide margin (a loaded machine only adds delay).
        assert!((12.0..=24.0).contains(&mbps), "{mbps} Mbit/s");
        assert!((0.010..=0.060).contains(&e.latency_s), "{} s", e.latency_s);
        assert!(e.probe_bytes >= 64 * 1024);
        // node1 was not told that node0 may probe it the other way round.
        let err = b.probe(&to_a, 1 << 20).await.expect_err("refused");
        assert!(
            err.to_string().contains("not in this node's probe round"),
            "{err}"
        );
        // Whoever answers at node1's address must hold the certificate node1 joined with.
        let other = ca.issue("node1", &[]).expect("cert");
        let moved = PeerAddr {
            pin: other.certificate_sha256().expect("fingerprint").to_vec(),
            ..to_b.clone()
        };
        let err = a.probe(&moved, 1 << 20).await.expect_err("refused");
        assert!(
            err.to_string().contains("not the one the broker admitted"),
            "{err}"
        );
        // And the answering side: a prober in the round with another certificate for its name
        // is refused (once the 10 s for a newer round have passed).
        let (impostor, _) = plane(&ca, "node0").await;
        let err = impostor.probe(&to_b, 1 << 20).await.expect_err("refused");
        assert!(
            err.to_string().contains("not the one the broker admitted"),
            "{err}"
        );
    }

    /// Whether the far end closed `tcp` (refusing it) before any byte came.
    async fn refused(mut tcp: tokio::net::TcpStream) -> bool {
        use tokio::io::AsyncReadExt;
        let mut byte = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(60), tcp.read(&mut byte)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    /// Dials `plane` with a rendezvous preamble.
    async fn rendezvous(plane: &DataPlane, kind: Kind, key: &str) -> tokio::net::TcpStream {
        use tokio::io::AsyncWriteExt;
        let mut tcp = tokio::net::TcpStream::connect(plane.address)
            .await
            .expect("connect");
        let preamble = Preamble {
            kind,
            key: key.into(),
        };
        tcp.write_all(&preamble.encode()).await.expect("preamble");
        tcp
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_goes_through_its_relay_which_relays_only_its_rounds_probes() {
        use crate::rendezvous::probe_key;
        let ca = Certificates::new_ca("ca").expect("ca");
        let (a, to_a) = plane(&ca, "node0").await;
        let (b, to_b) = plane(&ca, "node1").await;
        let (relay, to_relay) = plane(&ca, "relay").await;
        relay.start_probe_round(5, [("node0".to_string(), "node1".to_string())]);
        a.start_probe_round(5, []);
        b.start_probe_round(5, []);
        a.allow_probers(HashMap::from([("node1".to_string(), to_b.clone())]));
        b.allow_probers(HashMap::from([("node0".to_string(), to_a.clone())]));
        let key = probe_key(5, "node0", "node1");
        // node1 opens its side through the relay; node0 probes it through the relay.
        let from_a = PeerAddr {
            receive: ReceiveRoute::Relay(to_relay.address.clone()),
            relay_node: "relay".into(),
            ..to_a.clone()
        };
        let half = b.open_probe_half(5, key.clone(), from_a, Duration::from_secs(60));
        let via_relay = PeerAddr {
            send: SendRoute::Relay(to_relay.address.clone()),
            relay_node: "relay".into(),
            ..to_b.clone()
        };
        let e = a
            .probe_over(&via_relay, key, 1 << 20, Duration::from_secs(60))
            .await
            .expect("a probe through the relay");
        assert!(e.bytes_per_s > 0.0 && e.latency_s >= 0.0);
        tokio::time::timeout(Duration::from_secs(60), half)
            .await
            .expect("node1's side ends with the probe")
            .expect("half");
        // A probe of another round, or a pair the round does not name, is not relayed.
        for key in [
            probe_key(4, "node0", "node1"),
            probe_key(5, "node1", "node0"),
        ] {
            let tcp = rendezvous(&relay, Kind::RelaySender, &key).await;
            assert!(refused(tcp).await, "{key} was relayed");
        }
        // Reversed probe connections are taken only for the node's current round, from a peer
        // of that round.
        for key in [
            probe_key(4, "node0", "node1"),
            probe_key(5, "node0", "stranger"),
        ] {
            let tcp = rendezvous(&a, Kind::Reverse, &key).await;
            assert!(refused(tcp).await, "{key} was taken");
        }
    }
}
