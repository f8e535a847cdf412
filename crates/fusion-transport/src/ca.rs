//! A deployment's certificate authority, kept apart from what is copied to nodes: it issues the
//! broker's and every node's certificate (its own name only, a validity period, and the usage
//! its role needs) and signs the list of certificates it has revoked.

use crate::error::{Result, TransportError};
use crate::tls::{tls_err, NodeIdentity};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose, RevocationReason,
    RevokedCertParams, SerialNumber,
};
use sha2::{Digest, Sha256};
use time::{Duration, OffsetDateTime};

/// The name only the broker's certificate carries: nodes accept no other server on the control
/// plane, and no node may take it.
pub const BROKER_NAME: &str = "broker";

/// Days a certificate is valid unless said otherwise.
pub const DEFAULT_VALIDITY_DAYS: u32 = 30;

/// Days the CA's own certificate is valid.
pub const CA_VALIDITY_DAYS: u32 = 365;

/// Days a revocation list is valid before the CA should sign a new one.
pub const CRL_VALIDITY_DAYS: u32 = 30;

/// A deployment's certificate authority (kept by whoever runs `fusionllm cert`).
pub struct Certificates {
    params: CertificateParams,
    key: KeyPair,
    /// The CA certificate every peer trusts.
    pub ca_pem: String,
}

/// What the CA keeps of a certificate it issued, to revoke it later.
#[derive(Clone, Debug, PartialEq)]
pub struct Issued {
    pub name: String,
    /// The certificate's serial number (big-endian, positive).
    pub serial: Vec<u8>,
    pub not_after: OffsetDateTime,
}

/// The CA's parameters: the same for a new CA and one loaded from its files, so that what a
/// loaded CA signs chains to the certificate made when it was new.
fn ca_params(name: &str, days: u32) -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::minutes(5);
    params.not_after = now + Duration::days(days.into());
    params.key_identifier_method = KeyIdMethod::Sha256;
    Ok(params)
}

impl Certificates {
    /// A new CA named `name`, valid for [`CA_VALIDITY_DAYS`].
    pub fn new_ca(name: &str) -> Result<Self> {
        let params = ca_params(name, CA_VALIDITY_DAYS)?;
        let key = KeyPair::generate().map_err(tls_err)?;
        let ca_pem = params.self_signed(&key).map_err(tls_err)?.pem();
        Ok(Certificates {
            params,
            key,
            ca_pem,
        })
    }

    /// The CA made earlier as `name`, from its certificate and private key; refused when what
    /// it signs would not chain to that certificate (another key, another name).
    pub fn load(name: &str, ca_pem: &str, ca_key_pem: &str) -> Result<Self> {
        let key = KeyPair::from_pem(ca_key_pem).map_err(tls_err)?;
        let ca = Certificates {
            params: ca_params(name, CA_VALIDITY_DAYS)?,
            key,
            ca_pem: ca_pem.to_string(),
        };
        let probe = ca.issue("probe", &[])?;
        crate::tls::verify_client(&probe, ca_pem).map_err(|e| {
            TransportError::Tls(format!(
                "the CA key does not belong to the CA certificate named '{name}': {e}"
            ))
        })?;
        Ok(ca)
    }

    /// The CA's private key in PEM (to issue more certificates later).
    pub fn ca_key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// A certificate for `name` valid from now for [`DEFAULT_VALIDITY_DAYS`] (see
    /// [`Certificates::issue_for`]).
    pub fn issue(&self, name: &str, addresses: &[String]) -> Result<NodeIdentity> {
        let now = OffsetDateTime::now_utc();
        let until = now + Duration::days(DEFAULT_VALIDITY_DAYS.into());
        Ok(self.issue_for(name, addresses, now, until)?.0)
    }

    /// A certificate for `name`, valid for that name and the given addresses only (a node's
    /// certificate carries its own name alone, so it speaks for no one else: no name shared by
    /// every certificate, like `localhost`, that anyone could claim), from `from` (less five
    /// minutes of clock skew) to `until`. The broker's ([`BROKER_NAME`]) may only serve; a node's
    /// may serve (its data plane) and connect as a client.
    pub fn issue_for(
        &self,
        name: &str,
        addresses: &[String],
        from: OffsetDateTime,
        until: OffsetDateTime,
    ) -> Result<(NodeIdentity, Issued)> {
        let mut sans = vec![name.to_string()];
        for a in addresses {
            if !sans.contains(a) {
                sans.push(a.clone());
            }
        }
        let mut params = CertificateParams::new(sans).map_err(tls_err)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.not_before = from - Duration::minutes(5);
        params.not_after = until;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = if name == BROKER_NAME {
            vec![ExtendedKeyUsagePurpose::ServerAuth]
        } else {
            vec![
                ExtendedKeyUsagePurpose::ClientAuth,
                ExtendedKeyUsagePurpose::ServerAuth,
            ]
        };
        let key = KeyPair::generate().map_err(tls_err)?;
        let serial = serial_for(&key, name, from);
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer).map_err(tls_err)?;
        let id = NodeIdentity {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            ca_pem: self.ca_pem.clone(),
        };
        let issued = Issued {
            name: name.to_string(),
            serial,
            not_after: until,
        };
        Ok((id, issued))
    }

    /// The revocation list (PEM) naming the certificates with these `serials`, numbered
    /// `number` (each new list a higher number), valid for [`CRL_VALIDITY_DAYS`].
    pub fn revocation_list(&self, serials: &[Vec<u8>], number: u64) -> Result<String> {
        let now = OffsetDateTime::now_utc();
        let params = CertificateRevocationListParams {
            this_update: now - Duration::minutes(5),
            next_update: now + Duration::days(CRL_VALIDITY_DAYS.into()),
            crl_number: SerialNumber::from(number),
            issuing_distribution_point: None,
            revoked_certs: serials
                .iter()
                .map(|s| RevokedCertParams {
                    serial_number: SerialNumber::from_slice(s),
                    revocation_time: now,
                    reason_code: Some(RevocationReason::Unspecified),
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: KeyIdMethod::Sha256,
        };
        let issuer = Issuer::from_params(&self.params, &self.key);
        params
            .signed_by(&issuer)
            .map_err(tls_err)?
            .pem()
            .map_err(tls_err)
    }
}

/// A serial number unique to the key, name and time: 16 bytes, positive, with no leading zero.
fn serial_for(key: &KeyPair, name: &str, from: OffsetDateTime) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(key.public_key_raw());
    h.update(name.as_bytes());
    h.update(from.unix_timestamp_nanos().to_le_bytes());
    let mut serial = h.finalize()[..16].to_vec();
    serial[0] = (serial[0] & 0x7f) | 0x40;
    serial
}
