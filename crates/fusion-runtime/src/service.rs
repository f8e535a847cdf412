//! The broker's gRPC endpoint. It admits a node only after its first message, a Join with the
//! job's token and this protocol version (refusing with a status that says why), then forwards
//! everything the node sends, and the end of its stream, to the coordinator as events.

use fusion_proto::{
    broker_server::Broker, node_message, BrokerMessage, Join, NodeMessage, Progress,
    PROTOCOL_VERSION,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// How long a new connection may take to send its Join.
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The request metadata key that carries the job's token on a node's `Attach` call; the broker
/// checks it before decoding any message of the call.
pub const TOKEN_METADATA: &str = "x-fusionllm-token";

/// Longest node id: a DNS label, since the id is also the name in the node's certificate.
const MAX_NODE_ID: usize = 63;

/// Longest text a node may put in a failure report or its capabilities (the rest is cut).
const MAX_REPORTED_TEXT: usize = 1024;

/// Why `id` cannot name a node, if it cannot: ids are lowercase DNS labels (`[a-z0-9-]`, at most
/// 63 characters, not starting or ending with `-`), so that ids compare exactly as certificate
/// names do (DNS names match case-insensitively), and not a name every certificate may carry.
pub fn canonical_node_id(id: &str) -> std::result::Result<(), String> {
    let valid = !id.is_empty()
        && id.len() <= MAX_NODE_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-');
    if !valid {
        return Err(format!(
            "node id '{}' is not a lowercase name of 1 to {MAX_NODE_ID} letters, digits and inner hyphens",
            printable(id, 80)
        ));
    }
    if matches!(id, "broker" | "localhost" | "ca") {
        return Err(format!("node id '{id}' is reserved"));
    }
    Ok(())
}

/// `text` cut to `max` characters with control characters replaced, fit for a log line or a
/// message to other nodes.
pub fn printable(text: &str, max: usize) -> String {
    let mut out: String = text
        .chars()
        .take(max)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}

/// Cuts the free text of what a node sends to printable, bounded strings.
fn tame(m: &mut NodeMessage) {
    if let Some(node_message::Body::Failure(f)) = &mut m.body {
        f.message = printable(&f.message, MAX_REPORTED_TEXT);
        f.blame = printable(&f.blame, MAX_NODE_ID + 1);
    }
}

/// Messages queued to one node's control stream. Parameters travel in 1 MiB pieces, so this
/// bounds what the broker buffers per node while shipping state (32 MiB).
const CONTROL_QUEUE: usize = 32;

/// Messages from all nodes queued to the coordinator (heartbeats are not queued): at most
/// 128 MiB of state pieces while a snapshot is gathered.
pub const EVENT_QUEUE: usize = 128;

pub type ToNode = mpsc::Sender<Result<BrokerMessage, Status>>;

/// When a member was last heard from, and the progress its heartbeats report. Its stream task
/// records every message as it arrives, so a coordinator that is busy (writing a checkpoint,
/// shipping parameters, re-planning) never mistakes heartbeats waiting in its queue for silence.
pub struct Liveness {
    base: Instant,
    last_ms: AtomicU64,
    /// The latest progress report and when its counter last moved.
    progress: Mutex<Option<(Progress, Instant)>>,
}

impl Liveness {
    pub fn new() -> Self {
        Liveness {
            base: Instant::now(),
            last_ms: AtomicU64::new(0),
            progress: Mutex::new(None),
        }
    }

    /// Records a heartbeat's progress report.
    pub fn note_progress(&self, p: Option<Progress>) {
        let (Some(p), Ok(mut cur)) = (p, self.progress.lock()) else {
            return;
        };
        let moved = cur
            .as_ref()
            .is_none_or(|(old, _)| old.generation != p.generation || old.counter != p.counter);
        let since = match cur.take() {
            Some((_, t)) if !moved => t,
            _ => Instant::now(),
        };
        *cur = Some((p, since));
    }

    /// The latest progress report and how long its counter has not moved.
    pub fn progress(&self) -> Option<(Progress, Duration)> {
        let cur = self.progress.lock().ok()?;
        cur.as_ref().map(|(p, t)| (p.clone(), t.elapsed()))
    }

    /// Records that the member was heard from now.
    pub fn touch(&self) {
        let ms = self.base.elapsed().as_millis() as u64;
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// How long the member has been silent.
    pub fn silent_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.base.elapsed().saturating_sub(last)
    }
}

impl Default for Liveness {
    fn default() -> Self {
        Self::new()
    }
}

/// What the coordinator hears, tagged with the connection's serial number. Heartbeats are not
/// forwarded: they only refresh the connection's [`Liveness`].
pub enum Event {
    Joined(Box<Join>, [u8; 32], ToNode, Arc<Liveness>),
    Message(NodeMessage),
    Closed(String),
}

pub struct BrokerService {
    pub token: String,
    /// The CA's revocation list, when the broker was given one.
    pub revocation: Option<Arc<fusion_transport::RevocationCheck>>,
    /// What the job computes in: a node of another precision is refused for good.
    pub precision: fusion_backend::Precision,
    pub events: mpsc::Sender<(u64, Event)>,
    pub serial: AtomicU64,
}

#[tonic::async_trait]
impl Broker for BrokerService {
    type AttachStream = ReceiverStream<Result<BrokerMessage, Status>>;

    async fn attach(
        &self,
        request: Request<Streaming<NodeMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        // The certificate the node presented (the TLS layer already checked it is the job CA's
        // and within its validity period).
        let chain = request.peer_certs();
        let cert = chain.as_ref().and_then(|certs| certs.first().cloned());
        let mut stream = request.into_inner();
        let first = tokio::time::timeout(JOIN_TIMEOUT, stream.message())
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!(
                    "no join message within {} s",
                    JOIN_TIMEOUT.as_secs()
                ))
            })??;
        let mut join = match first.and_then(|m| m.body) {
            Some(node_message::Body::Join(j)) => j,
            _ => return Err(Status::invalid_argument("the first message must be a join")),
        };
        if join.protocol_version != PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "protocol version {} is not supported (the broker speaks {PROTOCOL_VERSION})",
                join.protocol_version
            )));
        }
        if !fusion_transport::token_matches(&join.token, &self.token) {
            tracing::warn!(
                "refused '{}': invalid join token",
                printable(&join.node_id, 80)
            );
            return Err(Status::permission_denied("invalid join token"));
        }
        join.token.clear();
        canonical_node_id(&join.node_id).map_err(Status::invalid_argument)?;
        if let Some(c) = join.capabilities.as_mut() {
            c.backend = printable(&c.backend, 64);
            c.device = printable(&c.device, 128);
            c.software_version = printable(&c.software_version, 64);
        }
        let backend = join
            .capabilities
            .as_ref()
            .map_or("", |c| c.backend.as_str());
        if let Err(why) = crate::broker::claims::precision_matches(backend, self.precision) {
            tracing::warn!("refused '{}': {why}", join.node_id);
            return Err(Status::failed_precondition(format!(
                "{}: {why}",
                join.node_id
            )));
        }
        if !cert
            .as_ref()
            .is_some_and(|c| fusion_transport::certificate_names(c, &join.node_id))
        {
            tracing::warn!(
                "refused '{}': its certificate is for another name",
                join.node_id
            );
            return Err(Status::permission_denied(format!(
                "the client certificate is not issued for '{}'",
                join.node_id
            )));
        }
        if let (Some(check), Some(chain)) = (&self.revocation, &chain) {
            if let Err(e) = check.check(chain) {
                tracing::warn!("refused '{}': {e}", join.node_id);
                return Err(Status::permission_denied(format!(
                    "the certificate of '{}' is refused: {e}",
                    join.node_id
                )));
            }
        }
        // Checked above: the node presented a certificate issued for its name.
        let pin = cert
            .as_ref()
            .map(fusion_transport::certificate_fingerprint)
            .unwrap_or_default();
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(CONTROL_QUEUE);
        let events = self.events.clone();
        let live = Arc::new(Liveness::new());
        events
            .send((serial, Event::Joined(Box::new(join), pin, tx, live.clone())))
            .await
            .map_err(|_| Status::unavailable("the job is over"))?;
        tokio::spawn(async move {
            loop {
                let ev = match stream.message().await {
                    Ok(Some(mut m)) => {
                        live.touch();
                        tame(&mut m);
                        if let Some(node_message::Body::Heartbeat(h)) = m.body {
                            live.note_progress(h.progress);
                            continue;
                        }
                        Event::Message(m)
                    }
                    Ok(None) => Event::Closed("closed its control stream".into()),
                    Err(s) => Event::Closed(format!("its connection broke ({})", s.message())),
                };
                let end = matches!(ev, Event::Closed(_));
                // Bounded: a coordinator that falls behind slows the node down instead of
                // buffering its state here.
                if events.send((serial, ev)).await.is_err() || end {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
