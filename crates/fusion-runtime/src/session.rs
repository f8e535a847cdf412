//! A node's session with the broker: joining (with retries over the brokers), the control
//! stream both ways, heartbeats, work running beside the commands, and a clean close.

use crate::error::{Result, RuntimeError};
use crate::identity::client_tls;
use crate::node::{NodeConfig, MAX_CONTROL_MESSAGE};
use crate::progress::Tracker;
use fusion_proto::{
    broker_client::BrokerClient, node_message, BrokerMessage, Capabilities, Heartbeat, Join,
    NodeMessage, PROTOCOL_VERSION,
};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::transport::Channel;

/// How long a stopped node waits for the broker to end the control stream.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Connection attempts to the broker before a node gives up (about 30 s in all).
const CONNECT_ATTEMPTS: u32 = 4;

/// How a session with the broker ended.
pub(crate) enum SessionEnd {
    /// The broker stopped the job or released this node.
    Stopped,
    /// The control stream broke: the broker (or the way to it) is gone.
    BrokerLost(String),
}

/// One connection to the broker: the inbound stream, the sender of node messages, and what
/// arrived while a step was computing.
pub(crate) struct Session {
    inbound: tonic::Streaming<BrokerMessage>,
    tx: mpsc::Sender<NodeMessage>,
    /// Resolves once the gRPC client has dropped the node's half of the stream.
    taken: oneshot::Receiver<()>,
    pub(crate) queued: VecDeque<BrokerMessage>,
    pub(crate) leave_sent: bool,
    /// Whether the broker sent anything on this session (a join refused as a duplicate name
    /// ends the session before).
    pub(crate) heard: bool,
    /// Shard writes and copies running beside the commands (aborted by a reset).
    background: Vec<AbortOnDrop>,
    /// Set for the tasks of `background` when a reset gives them up (a write already on its
    /// blocking thread then neither writes nor prunes).
    pub(crate) cancel: Arc<AtomicBool>,
    /// Shard writes holding a copy of the stage's state.
    pub(crate) writing: Arc<AtomicUsize>,
    _heartbeat: AbortOnDrop,
}

impl Session {
    pub(crate) async fn send(&self, body: node_message::Body) -> Result<()> {
        self.tx
            .send(NodeMessage { body: Some(body) })
            .await
            .map_err(|_| {
                RuntimeError::BrokerGone("the control stream to the broker is closed".into())
            })
    }

    /// Runs `work` beside the commands; what it answers goes to the broker when it is done.
    pub(crate) fn spawn_beside(
        &mut self,
        work: impl std::future::Future<Output = node_message::Body> + Send + 'static,
    ) {
        self.background.retain(|t| !t.0.is_finished());
        let tx = self.tx.clone();
        self.background.push(AbortOnDrop(tokio::spawn(async move {
            let body = work.await;
            let _ = tx.send(NodeMessage { body: Some(body) }).await;
        })));
    }

    /// Gives up the shard writes and copies under way (a reset).
    pub(crate) fn cancel_background(&mut self) {
        self.background.clear();
        self.cancel.store(true, Ordering::SeqCst);
        self.cancel = Arc::new(AtomicBool::new(false));
    }

    /// The next command: queued ones first, else from the stream. Err: the stream ended.
    pub(crate) async fn next(&mut self) -> std::result::Result<BrokerMessage, SessionEnd> {
        match self.queued.pop_front() {
            Some(m) => Ok(m),
            None => self.receive().await,
        }
    }

    /// The next message on the stream, past the queue. Err: the stream ended.
    pub(crate) async fn receive(&mut self) -> std::result::Result<BrokerMessage, SessionEnd> {
        match self.inbound.message().await {
            Ok(Some(m)) => {
                self.heard = true;
                Ok(m)
            }
            Ok(None) => Err(SessionEnd::BrokerLost(
                "the broker closed the control stream".into(),
            )),
            Err(status) => Err(SessionEnd::BrokerLost(format!(
                "the control stream broke: {}",
                status.message()
            ))),
        }
    }

    /// Ends the session cleanly: stops the heartbeats and the work beside, closes the node's
    /// half of the stream and waits (at most [`CLOSE_WAIT`]) for the broker to end its half, so
    /// that a last answer (a failure, a leave) still reaches the broker when the node exits
    /// right after. Dropping the session instead resets the stream, and what the connection
    /// had not yet sent is lost.
    pub(crate) async fn close(self) {
        let Session {
            mut inbound,
            tx,
            taken,
            background,
            _heartbeat,
            ..
        } = self;
        drop((tx, background, _heartbeat));
        let flushed = async {
            let _ = taken.await;
            while let Ok(Some(_)) = inbound.message().await {}
        };
        if tokio::time::timeout(CLOSE_WAIT, flushed).await.is_err() {
            tracing::debug!("the broker did not end the control stream within {CLOSE_WAIT:?}");
        }
    }
}

/// The node's half of the control stream as the gRPC client reads it; dropping it (the client
/// read it to the end, or gave it up) tells [`Session::close`].
struct Outgoing {
    messages: ReceiverStream<NodeMessage>,
    _taken: oneshot::Sender<()>,
}

impl Stream for Outgoing {
    type Item = NodeMessage;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<NodeMessage>> {
        Pin::new(&mut self.messages).poll_next(cx)
    }
}

/// The control-plane endpoint of each broker URL.
fn endpoints(cfg: &NodeConfig) -> Result<Vec<tonic::transport::Endpoint>> {
    if cfg.brokers.is_empty() {
        return Err(RuntimeError::Config("no broker URL".into()));
    }
    let tls = client_tls(&cfg.identity, &cfg.broker_name);
    cfg.brokers
        .iter()
        .map(|url| {
            Ok(Channel::from_shared(url.clone())
                .map_err(|e| RuntimeError::Config(format!("broker URL '{url}': {e}")))?
                .tls_config(tls.clone())?
                .connect_timeout(Duration::from_secs(5))
                .http2_keep_alive_interval(Duration::from_secs(2))
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(true))
        })
        .collect()
}

/// Connects to the broker and joins, retrying with backoff: a few times at first start, for up
/// to `budget` after losing the broker. With several brokers (a leader and standbys) each is
/// tried in turn, and the backoff comes after a whole round. A refused certificate or token is
/// final.
pub(crate) async fn join(
    cfg: &NodeConfig,
    caps: &Capabilities,
    data_address: &str,
    budget: Duration,
    progress: &Arc<Tracker>,
) -> Result<Session> {
    let endpoints = endpoints(cfg)?;
    let until = std::time::Instant::now() + budget;
    let mut attempt = 0u32;
    loop {
        let which = attempt as usize % endpoints.len();
        attempt += 1;
        let url = &cfg.brokers[which];
        let err = match attach(
            cfg,
            caps,
            data_address,
            &endpoints[which],
            url,
            progress.clone(),
        )
        .await
        {
            Ok(s) => return Ok(s),
            Err(e) => e,
        };
        let msg = err.to_string();
        let final_error = matches!(err, RuntimeError::Rejected(_) | RuntimeError::Config(_))
            || msg.contains("certificate");
        let rounds = attempt.div_ceil(endpoints.len() as u32);
        let out_of_time = if budget.is_zero() {
            attempt >= CONNECT_ATTEMPTS * endpoints.len() as u32
        } else {
            std::time::Instant::now() >= until
        };
        if final_error || out_of_time {
            return Err(RuntimeError::GrpcTransport(format!(
                "connecting to the broker at {} ({attempt} attempts): {msg}",
                cfg.brokers.join(", ")
            )));
        }
        tracing::warn!(
            "{}: joining the broker at {url}: {msg}; retrying",
            cfg.node_id
        );
        if (attempt as usize).is_multiple_of(endpoints.len()) {
            let backoff = Duration::from_secs(1 << rounds.min(3)).min(Duration::from_secs(5));
            tokio::time::sleep(backoff).await;
        }
    }
}

/// One attempt: connect, send the Join, open the stream, start heartbeats.
async fn attach(
    cfg: &NodeConfig,
    caps: &Capabilities,
    data_address: &str,
    endpoint: &tonic::transport::Endpoint,
    url: &str,
    progress: Arc<Tracker>,
) -> Result<Session> {
    let channel = endpoint.connect().await?;
    let mut client = BrokerClient::new(channel)
        .max_decoding_message_size(MAX_CONTROL_MESSAGE)
        .max_encoding_message_size(MAX_CONTROL_MESSAGE);
    let (tx, rx) = mpsc::channel::<NodeMessage>(64);
    let join = node_message::Body::Join(Join {
        protocol_version: PROTOCOL_VERSION,
        node_id: cfg.node_id.clone(),
        token: cfg.token.clone(),
        capabilities: Some(caps.clone()),
        data_address: data_address.to_string(),
    });
    tx.send(NodeMessage { body: Some(join) })
        .await
        .map_err(|_| RuntimeError::Protocol("the control stream closed before the join".into()))?;
    // The token also travels as metadata, which the broker checks before it decodes a message.
    let (read, taken) = oneshot::channel();
    let mut request = tonic::Request::new(Outgoing {
        messages: ReceiverStream::new(rx),
        _taken: read,
    });
    let token = tonic::metadata::MetadataValue::try_from(cfg.token.as_str())
        .map_err(|_| RuntimeError::Config("the join token must be printable ASCII".into()))?;
    request
        .metadata_mut()
        .insert(crate::service::TOKEN_METADATA, token);
    let inbound = match client.attach(request).await {
        Ok(r) => r.into_inner(),
        Err(s) if refusal(&s) => return Err(RuntimeError::Rejected(s.message().to_string())),
        Err(s) => return Err(s.into()),
    };
    let heartbeat = tokio::spawn(heartbeats(tx.clone(), cfg.heartbeat, progress));
    tracing::info!("{} joined {url}", cfg.node_id);
    Ok(Session {
        inbound,
        tx,
        taken,
        queued: VecDeque::new(),
        leave_sent: false,
        heard: false,
        background: Vec::new(),
        cancel: Arc::new(AtomicBool::new(false)),
        writing: Arc::new(AtomicUsize::new(0)),
        _heartbeat: AbortOnDrop(heartbeat),
    })
}

/// Whether the broker refused this node for good (token, version, name), not for now.
fn refusal(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::PermissionDenied
            | tonic::Code::FailedPrecondition
            | tonic::Code::InvalidArgument
    )
}

/// Sends a heartbeat with the stage's progress every `interval`.
async fn heartbeats(tx: mpsc::Sender<NodeMessage>, interval: Duration, progress: Arc<Tracker>) {
    loop {
        tokio::time::sleep(interval).await;
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let msg = NodeMessage {
            body: Some(node_message::Body::Heartbeat(Heartbeat {
                sent_unix_ms: ms,
                progress: progress.report(),
            })),
        };
        if tx.send(msg).await.is_err() {
            return;
        }
    }
}

pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
