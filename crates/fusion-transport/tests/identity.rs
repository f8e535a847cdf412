//! Certificates as the CA issues them: a loaded CA's certificates chain to the one made when it
//! was new; expired certificates, the broker's certificate used as a client, and a node's used as
//! the broker are refused at the handshake; the revocation list refuses exactly what it names.

use fusion_transport::time::{Duration as Days, OffsetDateTime};
use fusion_transport::*;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::{TlsAcceptor, TlsConnector};

const LIMIT: Duration = Duration::from_secs(20);

/// A TLS handshake to a server presenting `server` (dialled as `name`) from a client presenting
/// `client`, then one byte each way; (server's result, client's result).
async fn handshake(
    server: &NodeIdentity,
    name: &str,
    client: &NodeIdentity,
) -> (std::io::Result<()>, std::io::Result<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let acceptor = TlsAcceptor::from(server_config(server).expect("server config"));
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await?;
        let mut tls = acceptor.accept(tcp).await?;
        let mut b = [0u8; 1];
        tls.read_exact(&mut b).await?;
        tls.write_all(&b).await?;
        tls.flush().await
    });
    let connector = TlsConnector::from(client_config(client).expect("client config"));
    let name = ServerName::try_from(name.to_string()).expect("name");
    let client = async move {
        let tcp = TcpStream::connect(addr).await?;
        let mut tls = connector.connect(name, tcp).await?;
        tls.write_all(&[7]).await?;
        tls.flush().await?;
        let mut b = [0u8; 1];
        tls.read_exact(&mut b).await?;
        Ok(())
    };
    let (s, c) = tokio::time::timeout(LIMIT, async { tokio::join!(server, client) })
        .await
        .expect("the handshake test timed out");
    (s.expect("server task"), c)
}

fn der(id: &NodeIdentity) -> Vec<CertificateDer<'static>> {
    rustls_pemfile::certs(&mut id.cert_pem.as_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()
        .expect("certificate PEM")
}

#[tokio::test]
async fn a_loaded_ca_issues_certificates_that_chain_to_the_original() {
    let ca = Certificates::new_ca("test CA").expect("ca");
    let again = Certificates::load("test CA", &ca.ca_pem, &ca.ca_key_pem()).expect("load");
    let (s, c) = handshake(
        &ca.issue("node0", &[]).expect("cert"),
        "node0",
        &again.issue("node1", &[]).expect("cert"),
    )
    .await;
    assert!(s.is_ok() && c.is_ok(), "{s:?} {c:?}");
    // Another CA's key with this certificate, or this key under another name, is refused.
    let other = Certificates::new_ca("test CA").expect("ca");
    assert!(Certificates::load("test CA", &ca.ca_pem, &other.ca_key_pem()).is_err());
    assert!(Certificates::load("renamed CA", &ca.ca_pem, &ca.ca_key_pem()).is_err());
}

#[tokio::test]
async fn an_expired_certificate_is_refused_at_the_handshake() {
    let ca = Certificates::new_ca("test CA").expect("ca");
    let now = OffsetDateTime::now_utc();
    let (expired, issued) = ca
        .issue_for("node1", &[], now - Days::days(40), now - Days::days(10))
        .expect("cert");
    assert_eq!(issued.not_after, now - Days::days(10));
    let (s, _) = handshake(&ca.issue("node0", &[]).expect("cert"), "node0", &expired).await;
    let err = s.expect_err("an expired client certificate is refused");
    assert!(err.to_string().to_lowercase().contains("expired"), "{err}");
    // And as a server.
    let (_, c) = handshake(&expired, "node1", &ca.issue("node0", &[]).expect("cert")).await;
    let err = c.expect_err("an expired server certificate is refused");
    assert!(err.to_string().to_lowercase().contains("expired"), "{err}");
}

#[tokio::test]
async fn the_broker_certificate_cannot_be_a_client_nor_a_node_certificate_the_broker() {
    let ca = Certificates::new_ca("test CA").expect("ca");
    let broker = ca.issue(BROKER_NAME, &["10.0.0.1".into()]).expect("cert");
    let node = ca.issue("node0", &[]).expect("cert");
    // The broker's certificate serves only: it cannot join a node's data plane as a client.
    let (s, _) = handshake(&node, "node0", &broker).await;
    let err = s.expect_err("the broker's certificate is not a client certificate");
    assert!(
        err.to_string().contains("Usage") || err.to_string().contains("usage"),
        "{err}"
    );
    // A node's certificate is not the broker's: a node dialling "broker" refuses it.
    let (_, c) = handshake(&node, BROKER_NAME, &ca.issue("node1", &[]).expect("cert")).await;
    let err = c.expect_err("a node's certificate cannot serve as the broker");
    assert!(err.to_string().contains("not valid for name"), "{err}");
    // The real broker serves.
    let (s, c) = handshake(&broker, BROKER_NAME, &node).await;
    assert!(s.is_ok() && c.is_ok(), "{s:?} {c:?}");
}

#[test]
fn the_revocation_list_refuses_exactly_the_certificates_it_names() {
    let ca = Certificates::new_ca("test CA").expect("ca");
    let now = OffsetDateTime::now_utc();
    let until = now + Days::days(30);
    let (node1, issued1) = ca.issue_for("node1", &[], now, until).expect("cert");
    let (node2, issued2) = ca.issue_for("node2", &[], now, until).expect("cert");
    assert_ne!(issued1.serial, issued2.serial);
    let crl = ca.revocation_list(&[issued1.serial], 1).expect("crl");
    let check = RevocationCheck::new(&ca.ca_pem, &crl).expect("check");
    let err = check.check(&der(&node1)).expect_err("node1 is revoked");
    assert!(err.to_string().contains("Revoked"), "{err}");
    assert!(check.check(&der(&node2)).is_ok());
    // An empty list revokes nothing; a list signed by another CA is refused.
    let none =
        RevocationCheck::new(&ca.ca_pem, &ca.revocation_list(&[], 2).expect("crl")).expect("check");
    assert!(none.check(&der(&node1)).is_ok());
    let rogue = Certificates::new_ca("rogue CA").expect("ca");
    let forged = rogue.revocation_list(&[issued2.serial], 1).expect("crl");
    let check = RevocationCheck::new(&ca.ca_pem, &forged).expect("parses");
    assert!(
        check.check(&der(&node2)).is_err(),
        "a forged list is not trusted"
    );
    assert!(RevocationCheck::new(&ca.ca_pem, "not a list").is_err());
}
