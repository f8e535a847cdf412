//! The tensor data plane. Nodes send activations downstream and gradients upstream as
//! length-prefixed protobuf frames over mutually authenticated TLS streams (a framed stream, not
//! gRPC: HTTP/2 flow-control windows throttle long fat links).
//!
//! Everything a peer sends is validated before it is used or memory is reserved for it: frame
//! lengths against a limit, tensor headers against the expected edge (dtype, shape, byte count),
//! chunk offsets and sizes against the announced total. A bad peer produces an error naming the
//! problem, never a panic or an unbounded allocation.

mod ca;
mod error;
mod frame;
mod gate;
mod pace;
mod session;
mod tensor;
mod tls;

pub use ca::{
    Certificates, Issued, BROKER_NAME, CA_VALIDITY_DAYS, CRL_VALIDITY_DAYS, DEFAULT_VALIDITY_DAYS,
};
pub use error::{Result, TransportError};
pub use frame::{FrameReader, FrameWriter, DEFAULT_MAX_FRAME};
pub use gate::{ConnectionGate, ConnectionLimits, GatedStream, Permit, Refusal};
pub use pace::{paced, PacedLink};
pub use session::{accept_session, open_session, token_matches, SessionInfo, HANDSHAKE_TIMEOUT};
pub use tensor::{
    dtype_size, f32_le_bytes, f64_le_bytes, le_bytes_to_f32, le_bytes_to_f64, send_tensor,
    send_tensor_within, ExpectedTensor, ReceivedTensor, TensorReceiver, CHUNK_BYTES,
};
pub use time;
pub use tls::{
    certificate_admitted, certificate_fingerprint, certificate_names, client_config, server_config,
    CertificateRefusal, NodeIdentity, RevocationCheck,
};
