//! Loading a node's or the broker's TLS identity from the files `fusionllm cert` writes, and the
//! matching tonic (control plane) TLS configurations. Both planes use the same CA and
//! certificates: the broker accepts only nodes with a certificate from the job's CA, and nodes
//! accept only a broker and peers that have one.

use crate::error::{Result, RuntimeError};
use fusion_transport::NodeIdentity;
use std::path::Path;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// Reads `ca.pem`, `<name>.pem` and `<name>.key` from `dir`; a key that others than its owner
/// may read is refused (as ssh does), with the command that fixes it.
pub fn load_identity(dir: &Path, name: &str) -> Result<NodeIdentity> {
    check_private(&dir.join(format!("{name}.key")))?;
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

/// Refuses a key file whose group or others have any access to it.
fn check_private(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(path) {
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(RuntimeError::Config(format!(
                    "{} is accessible to other users (mode {mode:o}); a private key must be \
                     readable by its owner alone: chmod 600 {}",
                    path.display(),
                    path.display()
                )));
            }
        }
    }
    let _ = path;
    Ok(())
}

/// Writes `<name>.pem` and `<name>.key` (owner-only) of `id` into `dir`, replacing them.
pub fn save_identity(dir: &Path, name: &str, id: &NodeIdentity) -> Result<()> {
    let io = |p: &Path| crate::error::io_err(format!("writing {}", p.display()));
    let cert = dir.join(format!("{name}.pem"));
    std::fs::write(&cert, &id.cert_pem).map_err(io(&cert))?;
    let key = dir.join(format!("{name}.key"));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(&key).map_err(io(&key))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io(&key))?;
    }
    std::io::Write::write_all(&mut f, id.key_pem.as_bytes()).map_err(io(&key))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_others_can_read_is_refused_and_a_saved_one_loads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = fusion_transport::Certificates::new_ca("test").expect("ca");
        std::fs::write(dir.path().join("ca.pem"), &ca.ca_pem).expect("write");
        save_identity(dir.path(), "node0", &ca.issue("node0", &[]).expect("cert")).expect("save");
        assert!(load_identity(dir.path(), "node0").is_ok());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let key = dir.path().join("node0.key");
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).expect("chmod");
            let err = load_identity(dir.path(), "node0").expect_err("world-readable key");
            assert!(err.to_string().contains("chmod 600"), "{err}");
        }
    }
}
