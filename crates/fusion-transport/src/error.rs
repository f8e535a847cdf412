use thiserror::Error;

#[derive(Debug, Error)]
pub enum TransportError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("peer sent a frame of {len} bytes, above the limit of {limit}")]
    FrameTooLarge { len: usize, limit: usize },
    #[error("peer sent an undecodable frame: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("peer closed the connection")]
    Closed,
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("bad tensor from peer: {0}")]
    BadTensor(String),
    #[error("peer refused the session: {0}")]
    Refused(String),
    #[error("writing a frame (at most one chunk) to the peer took over {0:.1} s")]
    Stalled(f64),
    #[error("TLS configuration: {0}")]
    Tls(String),
    #[error("certificate refused: {0}")]
    CertificateRefused(String),
}

pub type Result<T> = std::result::Result<T, TransportError>;
