//! Certificates for a private deployment and mutually authenticated TLS configurations: every
//! node and the broker present a certificate signed by the deployment's CA, and accept only
//! peers that do the same.

use crate::error::{Result, TransportError};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use std::sync::Arc;
use tokio_rustls::rustls::{self, pki_types::PrivateKeyDer, RootCertStore};

fn tls_err(e: impl std::fmt::Display) -> TransportError {
    TransportError::Tls(e.to_string())
}

/// A deployment's certificate authority (kept by whoever runs `fusionllm cert`).
pub struct Certificates {
    params: CertificateParams,
    key: KeyPair,
    /// The CA certificate every peer trusts.
    pub ca_pem: String,
}

/// One node's identity: its certificate and key, and the CA it trusts.
#[derive(Clone)]
pub struct NodeIdentity {
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
}

impl Certificates {
    /// A new CA named `name`.
    pub fn new_ca(name: &str) -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().map_err(tls_err)?;
        let ca_pem = params.self_signed(&key).map_err(tls_err)?.pem();
        Ok(Certificates {
            params,
            key,
            ca_pem,
        })
    }

    /// The CA's private key in PEM (to issue more certificates later).
    pub fn ca_key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// A certificate for `name`, valid for that name and the given addresses only (a node's
    /// certificate carries its own name alone, so it speaks for no one else: no name shared by
    /// every certificate, like `localhost`, that anyone could claim).
    pub fn issue(&self, name: &str, addresses: &[String]) -> Result<NodeIdentity> {
        let mut sans = vec![name.to_string()];
        for a in addresses {
            if !sans.contains(a) {
                sans.push(a.clone());
            }
        }
        let mut params = CertificateParams::new(sans).map_err(tls_err)?;
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().map_err(tls_err)?;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer).map_err(tls_err)?;
        Ok(NodeIdentity {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            ca_pem: self.ca_pem.clone(),
        })
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
