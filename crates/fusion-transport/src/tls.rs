//! Mutually authenticated TLS configurations: every node and the broker present a certificate
//! signed by the deployment's CA (see `ca`), and accept only peers that do the same; the broker
//! also checks a node's certificate against the CA's revocation list.

use crate::error::{Result, TransportError};
use std::sync::Arc;
use tokio_rustls::rustls::{self, pki_types::PrivateKeyDer, RootCertStore};

pub(crate) fn tls_err(e: impl std::fmt::Display) -> TransportError {
    TransportError::Tls(e.to_string())
}

/// One node's identity: its certificate and key, and the CA it trusts.
#[derive(Clone)]
pub struct NodeIdentity {
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
}

impl NodeIdentity {
    /// The SHA-256 of this identity's own (first) certificate, as peers pin it.
    pub fn certificate_sha256(&self) -> Result<[u8; 32]> {
        let cert = rustls_pemfile::certs(&mut self.cert_pem.as_bytes())
            .next()
            .ok_or_else(|| {
                TransportError::Tls("no certificate in the node's certificate PEM".into())
            })?
            .map_err(tls_err)?;
        Ok(certificate_fingerprint(&cert))
    }
}

/// Never prints the private key.
impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeIdentity")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<private>")
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn parse(
    id: &NodeIdentity,
) -> Result<(
    Vec<rustls::pki_types::CertificateDer<'static>>,
    PrivateKeyDer<'static>,
    RootCertStore,
)> {
    let certs = rustls_pemfile::certs(&mut id.cert_pem.as_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(tls_err)?;
    if certs.is_empty() {
        return Err(TransportError::Tls(
            "no certificate in the node's certificate PEM".into(),
        ));
    }
    let key = rustls_pemfile::private_key(&mut id.key_pem.as_bytes())
        .map_err(tls_err)?
        .ok_or_else(|| TransportError::Tls("no private key in the node's key PEM".into()))?;
    let mut roots = RootCertStore::empty();
    for ca in rustls_pemfile::certs(&mut id.ca_pem.as_bytes()) {
        roots.add(ca.map_err(tls_err)?).map_err(tls_err)?;
    }
    if roots.is_empty() {
        return Err(TransportError::Tls(
            "no CA certificate in the CA PEM".into(),
        ));
    }
    Ok((certs, key, roots))
}

/// Server side: present `id`, require a client certificate signed by the CA.
pub fn server_config(id: &NodeIdentity) -> Result<Arc<rustls::ServerConfig>> {
    let (certs, key, roots) = parse(id)?;
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(tls_err)?;
    let cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .map_err(tls_err)?;
    Ok(Arc::new(cfg))
}

/// Client side: present `id`, trust only servers with a certificate signed by the CA.
pub fn client_config(id: &NodeIdentity) -> Result<Arc<rustls::ClientConfig>> {
    let (certs, key, roots) = parse(id)?;
    let cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?
        .with_root_certificates(roots)
        .with_client_auth_cert(certs, key)
        .map_err(tls_err)?;
    Ok(Arc::new(cfg))
}

/// The CA's revocation list, as the broker applies it to a node's certificate when the node
/// joins (the TLS handshake already checked the chain and validity period; this adds the list,
/// whose signature is checked against the CA).
pub struct RevocationCheck {
    verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
}

impl RevocationCheck {
    /// The check of `crl_pem` (one or more PEM revocation lists) against the CA in `ca_pem`.
    pub fn new(ca_pem: &str, crl_pem: &str) -> Result<Self> {
        let mut roots = RootCertStore::empty();
        for ca in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
            roots.add(ca.map_err(tls_err)?).map_err(tls_err)?;
        }
        let crls = rustls_pemfile::crls(&mut crl_pem.as_bytes())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| TransportError::Tls(format!("the revocation list: {e}")))?;
        if crls.is_empty() {
            return Err(TransportError::Tls(
                "no revocation list in the revocation list PEM".into(),
            ));
        }
        for c in &crls {
            webpki::OwnedCertRevocationList::from_der(c)
                .map_err(|e| TransportError::Tls(format!("the revocation list: {e:?}")))?;
        }
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider(),
        )
        .with_crls(crls)
        .only_check_end_entity_revocation()
        .build()
        .map_err(tls_err)?;
        Ok(RevocationCheck { verifier })
    }

    /// Whether `chain` (end entity first) is a valid client chain the list does not revoke.
    pub fn check(&self, chain: &[rustls::pki_types::CertificateDer<'_>]) -> Result<()> {
        let Some((end, rest)) = chain.split_first() else {
            return Err(TransportError::CertificateRefused("no certificate".into()));
        };
        self.verifier
            .verify_client_cert(end, rest, rustls::pki_types::UnixTime::now())
            .map(|_| ())
            .map_err(|e| TransportError::CertificateRefused(e.to_string()))
    }
}

/// Verifies `id`'s certificate as a client certificate of the CA in `ca_pem`.
pub(crate) fn verify_client(id: &NodeIdentity, ca_pem: &str) -> Result<()> {
    let (certs, _, _) = parse(id)?;
    let mut roots = RootCertStore::empty();
    for ca in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
        roots.add(ca.map_err(tls_err)?).map_err(tls_err)?;
    }
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(tls_err)?;
    let (end, rest) = certs
        .split_first()
        .ok_or_else(|| TransportError::Tls("no certificate".into()))?;
    verifier
        .verify_client_cert(end, rest, rustls::pki_types::UnixTime::now())
        .map(|_| ())
        .map_err(tls_err)
}

/// Whether the certificate a TLS peer presented was issued for `name` (its node id). The CA check
/// already happened during the handshake; this binds the identity a peer claims in its hello to
/// its certificate, so one node cannot speak for another.
pub fn certificate_names(cert: &rustls::pki_types::CertificateDer<'_>, name: &str) -> bool {
    let Ok(server_name) = rustls::pki_types::ServerName::try_from(name.to_string()) else {
        return false;
    };
    webpki::EndEntityCert::try_from(cert)
        .and_then(|c| c.verify_is_valid_for_subject_name(&server_name))
        .is_ok()
}

/// The SHA-256 of a certificate's DER bytes: what the broker records for the certificate a node
/// joined with, and what peers compare a data-plane certificate against.
pub fn certificate_fingerprint(cert: &rustls::pki_types::CertificateDer<'_>) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(cert.as_ref()).into()
}

/// Why a data-plane peer's certificate does not speak for the node it names.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CertificateRefusal {
    #[error("no certificate was presented")]
    NoCertificate,
    #[error("the certificate presented is not issued for '{0}'")]
    WrongName(String),
    #[error("the broker admitted no certificate for '{0}'")]
    NotPinned(String),
    #[error("the certificate presented for '{0}' is not the one the broker admitted")]
    PinMismatch(String),
}

/// Whether a data-plane peer that says it is `name` may be believed: its certificate is issued for
/// `name` and is the very one the broker admitted (`pin`, its fingerprint). A certificate for the
/// same name that the broker did not admit (an older one, revoked since, or one issued to
/// somebody else under a reused name) is refused. The CA check already happened in the
/// handshake.
pub fn certificate_admitted(
    cert: Option<&rustls::pki_types::CertificateDer<'_>>,
    name: &str,
    pin: Option<&[u8]>,
) -> std::result::Result<(), CertificateRefusal> {
    let Some(cert) = cert else {
        return Err(CertificateRefusal::NoCertificate);
    };
    if !certificate_names(cert, name) {
        return Err(CertificateRefusal::WrongName(name.into()));
    }
    match pin {
        None | Some([]) => Err(CertificateRefusal::NotPinned(name.into())),
        Some(p) if p == certificate_fingerprint(cert).as_slice() => Ok(()),
        Some(_) => Err(CertificateRefusal::PinMismatch(name.into())),
    }
}
