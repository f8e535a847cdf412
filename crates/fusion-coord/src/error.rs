//! What can go wrong talking to the coordination service.

/// Errors of the etcd client and of broker leadership.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    #[error("etcd endpoint '{endpoint}': {why}")]
    Endpoint { endpoint: String, why: String },
    #[error("etcd at {endpoint} cannot be reached: {why}")]
    Unreachable { endpoint: String, why: String },
    #[error("etcd refused {call} (HTTP {status}, gRPC code {code}): {message}")]
    Refused {
        call: String,
        status: u16,
        code: i64,
        message: String,
    },
    #[error("etcd sent a malformed reply: {0}")]
    Malformed(String),
    #[error("the run record at etcd key '{key}' is not one a fusionllm broker wrote: {why}")]
    BadRecord { key: String, why: String },
    #[error("this broker no longer leads election '{0}': the record was not written")]
    NotLeader(String),
    #[error("election '{0}': a name of 1 to 200 printable characters without spaces is needed")]
    BadElection(String),
}

pub type Result<T> = std::result::Result<T, CoordError>;
