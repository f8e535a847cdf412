use thiserror::Error;

#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error("{0}")]
    Config(String),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("rejected by the broker: {0}")]
    Rejected(String),
    #[error("node '{node}' lost: {reason}")]
    NodeLost { node: String, reason: String },
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("the job was reset: {0}")]
    Reset(String),
    /// A fault attributed to a peer: it sent garbage, never sent an awaited tensor, stopped
    /// reading, or its session broke. The node reports it blaming `peer`.
    /// `proven`: the node holds proof (a malformed or non-finite tensor); otherwise it is a
    /// suspicion (a timed-out wait, a broken session) the broker checks against progress.
    #[error("{reason}")]
    Peer {
        peer: String,
        reason: String,
        proven: bool,
    },
    /// The broker blamed this node for a stall or a fault and goes on without it.
    #[error("evicted by the broker: {0}")]
    Evicted(String),
    /// The run trained to its last step but the broker could not write its final state (a
    /// full disk) within the patience it was given.
    #[error("the final state could not be saved within {seconds} s: {why}")]
    FinalStateUnsaved { seconds: u64, why: String },
    /// Another broker process holds the state directory (two brokers on one directory would
    /// remove each other's snapshots).
    #[error(
        "the state directory {path} is in use by another broker ({holder}); stop it, or give \
         this one another directory"
    )]
    StateDirInUse { path: String, holder: String },
    /// A placement that must shard the optimizer state (memory binds) cannot restore a sharded
    /// snapshot, whose shards hold whole moments: the broker rolls back to its own snapshot.
    #[error("the sharded snapshot cannot be restored into this placement: {0}")]
    ShardingNeeded(String),
    /// A shard of a sharded snapshot that cannot be written, copied or read.
    #[error("shard '{shard}': {reason}")]
    Shard { shard: String, reason: String },
    /// No TCP connection could be made to a peer's address (refused, no route, no answer):
    /// behind a NAT or firewall, or gone. Probe rounds report it as the peer's reachability.
    #[error("cannot connect to {peer} at {address}: {reason}")]
    Unreachable {
        peer: String,
        address: String,
        reason: String,
    },
    /// No path to a peer could be opened the way the broker said (a hole punch through both
    /// sides' NATs that did not go through): the broker routes the pair another way.
    #[error("no path to {peer}: {reason}")]
    PathFailed { peer: String, reason: String },
    /// The control stream to the broker ended: the broker (or the way to it) is gone.
    #[error("lost the broker: {0}")]
    BrokerGone(String),
    #[error("transport: {0}")]
    Transport(#[from] fusion_transport::TransportError),
    #[error("execution: {0}")]
    Exec(#[from] fusion_exec::ExecError),
    #[error("training: {0}")]
    Train(#[from] fusion_train::TrainError),
    #[error("graph: {0}")]
    Graph(#[from] fusion_graph::GraphError),
    #[error("model: {0}")]
    Model(#[from] fusion_models::ModelError),
    #[error("data: {0}")]
    Data(#[from] fusion_data::DataError),
    #[error("backend: {0}")]
    Backend(#[from] fusion_backend::BackendError),
    #[error("gRPC: {0}")]
    Grpc(#[from] tonic::Status),
    #[error("gRPC transport: {0}")]
    GrpcTransport(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, RuntimeError>;

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RuntimeError {
    let context = context.into();
    move |source| RuntimeError::Io { context, source }
}

impl From<tonic::transport::Error> for RuntimeError {
    fn from(e: tonic::transport::Error) -> Self {
        RuntimeError::GrpcTransport(error_chain(&e))
    }
}

/// An error with its causes ("transport error: tls handshake: invalid peer certificate ...").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let part = c.to_string();
        if !s.contains(&part) {
            s.push_str(": ");
            s.push_str(&part);
        }
        cur = c.source();
    }
    s
}
