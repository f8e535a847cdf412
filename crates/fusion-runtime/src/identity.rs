//! Loading a node's or the broker's TLS identity from the files `fusionllm cert` writes, and the
//! matching tonic (control plane) TLS configurations. Both planes use the same CA and
//! certificates: the broker accepts only nodes with a certificate from the job's CA, and nodes
//! accept only a broker and peers that have one.

use crate::error::{Result, RuntimeError};
use fusion_transport::NodeIdentity;
use std::path::Path;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// Reads `ca.pem`, `<name>.pem` and `<name>.key` from `dir`.
pub fn load_identity(dir: &Path, name: &str) -> Result<NodeIdentity> {
    let read = |file: String| {
        let path = dir.join(&file);
        std::fs::read_to_string(&path).map_err(|e| {
            RuntimeError::Config(format!(
                "cannot read {} ({e}); make certificates with `fusionllm cert --out {} --names {name},...`",
                path.display(),
                dir.display()
            ))
        })
    };
    Ok(NodeIdentity {
        ca_pem: read("ca.pem".into())?,
        cert_pem: read(format!("{name}.pem"))?,
        key_pem: read(format!("{name}.key"))?,
    })
}

/// The broker's gRPC TLS: its certificate, and client certificates required from the CA; a
/// handshake not done within [`crate::outgoing::TLS_TIMEOUT`] is dropped.
pub fn server_tls(id: &NodeIdentity) -> ServerTlsConfig {
    ServerTlsConfig::new()
        .identity(Identity::from_pem(&id.cert_pem, &id.key_pem))
        .client_ca_root(Certificate::from_pem(&id.ca_pem))
        .timeout(crate::outgoing::TLS_TIMEOUT)
}

/// A node's gRPC TLS toward a broker whose certificate names `broker_name`.
pub fn client_tls(id: &NodeIdentity, broker_name: &str) -> ClientTlsConfig {
    ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&id.ca_pem))
        .identity(Identity::from_pem(&id.cert_pem, &id.key_pem))
        .domain_name(broker_name)
}
