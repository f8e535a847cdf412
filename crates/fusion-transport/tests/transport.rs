//! The data plane over loopback TLS and in-memory pipes: tensors arrive intact, and every kind of
//! bad input is refused with an error naming the problem. Every test is bounded by a timeout.

use fusion_proto::{
    frame::Body, DType, Direction, Frame, Hello, TensorChunk, TensorHeader, PROTOCOL_VERSION,
};
use fusion_transport::*;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::{TlsAcceptor, TlsConnector};

const LIMIT: Duration = Duration::from_secs(20);

fn hello(name: &str, token: &str) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        node_id: name.into(),
        token: token.into(),
        backend: "test".into(),
        software_version: "0".into(),
        generation: 0,
        probe: false,
        fetch: false,
    }
}

fn header(edge: u64, shape: &[u64]) -> TensorHeader {
    TensorHeader {
        step: 1,
        micro_batch: 0,
        edge,
        direction: Direction::Activation as i32,
        dtype: DType::F32 as i32,
        shape: shape.to_vec(),
        total_bytes: 0,
        seq: 0,
    }
}

fn expect_edge_7(edge: u64, _dir: Direction) -> Option<ExpectedTensor> {
    (edge == 7).then(|| ExpectedTensor {
        dtypes: vec![DType::F32],
        shape: vec![1024, 5120],
        direction: Direction::Activation,
    })
}

/// Runs a TLS server accepting one session with `server_id`, and a client connecting with
/// `client_id`; returns (server result, client result).
async fn tls_pair(
    server_id: NodeIdentity,
    client_id: NodeIdentity,
    token: &'static str,
    client_hello: Hello,
    payload: Vec<u8>,
) -> (Result<Vec<u8>>, Result<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = TlsAcceptor::from(server_config(&server_id).unwrap());
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await?;
        let tls = acceptor.accept(tcp).await?;
        let (r, _w, info) =
            accept_session(tls, hello("server", ""), token, DEFAULT_MAX_FRAME).await?;
        assert_eq!(info.peer.node_id, "client");
        let mut rx = TensorReceiver::new(r, expect_edge_7);
        Ok::<_, TransportError>(rx.recv().await?.data)
    });
    let connector = TlsConnector::from(client_config(&client_id).unwrap());
    let client = async move {
        let tcp = TcpStream::connect(addr).await?;
        let tls = connector
            .connect(ServerName::try_from("server").unwrap(), tcp)
            .await?;
        let (_r, mut w, info) = open_session(tls, client_hello, DEFAULT_MAX_FRAME).await?;
        assert_eq!(info.peer.node_id, "server");
        send_tensor(&mut w, header(7, &[1024, 5120]), &payload).await?;
        Ok::<_, TransportError>(())
    };
    let (s, c) = tokio::time::timeout(LIMIT, async { tokio::join!(server, client) })
        .await
        .expect("test timed out");
    (s.expect("server task"), c)
}

fn payload() -> Vec<u8> {
    (0..1024 * 5120)
        .flat_map(|i| ((i % 997) as f32 * 0.5).to_le_bytes())
        .collect()
}

#[tokio::test]
async fn twenty_megabyte_tensor_crosses_mutual_tls_intact() {
    let ca = Certificates::new_ca("test CA").unwrap();
    let data = payload();
    let (got, sent) = tls_pair(
        ca.issue("server", &[]).unwrap(),
        ca.issue("client", &[]).unwrap(),
        "secret",
        hello("client", "secret"),
        data.clone(),
    )
    .await;
    sent.unwrap();
    assert_eq!(got.unwrap(), data);
}

#[tokio::test]
async fn wrong_token_is_refused_with_a_reason() {
    let ca = Certificates::new_ca("test CA").unwrap();
    let (server, client) = tls_pair(
        ca.issue("server", &[]).unwrap(),
        ca.issue("client", &[]).unwrap(),
        "secret",
        hello("client", "guess"),
        vec![],
    )
    .await;
    let err = client.unwrap_err().to_string();
    assert!(err.contains("invalid join token"), "{err}");
    assert!(server
        .unwrap_err()
        .to_string()
        .contains("invalid join token"));
}

#[tokio::test]
async fn wrong_protocol_version_is_refused() {
    let ca = Certificates::new_ca("test CA").unwrap();
    let mut h = hello("client", "secret");
    h.protocol_version = 99;
    let (_, client) = tls_pair(
        ca.issue("server", &[]).unwrap(),
        ca.issue("client", &[]).unwrap(),
        "secret",
        h,
        vec![],
    )
    .await;
    let err = client.unwrap_err().to_string();
    assert!(err.contains("protocol version 99"), "{err}");
}

#[tokio::test]
async fn certificate_from_another_ca_is_rejected() {
    let ca = Certificates::new_ca("test CA").unwrap();
    let rogue = Certificates::new_ca("rogue CA").unwrap();
    let mut intruder = rogue.issue("client", &[]).unwrap();
    // The intruder trusts the real CA (so it accepts the server) but its own certificate is rogue.
    intruder.ca_pem = ca.ca_pem.clone();
    let (server, client) = tls_pair(
        ca.issue("server", &[]).unwrap(),
        intruder,
        "secret",
        hello("client", "secret"),
        vec![],
    )
    .await;
    assert!(
        server.is_err(),
        "the server must not accept a rogue client certificate"
    );
    assert!(client.is_err());
}

/// Feeds raw bytes to a receiver through an in-memory pipe and returns its verdict.
async fn receive_raw(bytes: Vec<u8>, require_finite: bool) -> Result<ReceivedTensor> {
    let (mut a, b) = tokio::io::duplex(1 << 16);
    let writer = tokio::spawn(async move {
        let _ = a.write_all(&bytes).await;
        let _ = a.shutdown().await;
    });
    let expect = |edge: u64, _dir: Direction| {
        (edge == 3).then(|| ExpectedTensor {
            dtypes: vec![DType::F32],
            shape: vec![2, 3],
            direction: Direction::Activation,
        })
    };
    let mut rx = TensorReceiver::new(FrameReader::new(b, 1024), expect);
    rx.require_finite = require_finite;
    let out = tokio::time::timeout(LIMIT, rx.recv())
        .await
        .expect("receiver timed out");
    let _ = writer.await;
    out
}

fn encode(frames: &[Frame]) -> Vec<u8> {
    use prost::Message;
    let mut out = Vec::new();
    for f in frames {
        out.extend_from_slice(&(f.encoded_len() as u32).to_be_bytes());
        f.encode(&mut out).unwrap();
    }
    out
}

fn hdr(edge: u64, shape: &[u64], total: u64) -> Frame {
    let mut h = header(edge, shape);
    h.total_bytes = total;
    Frame {
        body: Some(Body::Header(h)),
    }
}

fn chunk(offset: u64, data: Vec<u8>) -> Frame {
    Frame {
        body: Some(Body::Chunk(TensorChunk {
            offset,
            data: data.into(),
        })),
    }
}

fn floats(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[tokio::test]
async fn a_valid_tensor_in_two_chunks_is_accepted() {
    let d = floats(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let t = receive_raw(
        encode(&[
            hdr(3, &[2, 3], 24),
            chunk(0, d[..8].to_vec()),
            chunk(8, d[8..].to_vec()),
        ]),
        true,
    )
    .await
    .unwrap();
    assert_eq!(t.to_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
}

#[tokio::test]
async fn malformed_input_is_rejected_with_clear_errors() {
    let d = floats(&[1.0; 6]);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        // A length prefix far above the limit: refused before allocating.
        (
            [u32::MAX.to_be_bytes().to_vec(), vec![0; 8]].concat(),
            "above the limit",
        ),
        // Bytes that are not a protobuf frame.
        (
            [8u32.to_be_bytes().to_vec(), vec![0xff; 8]].concat(),
            "undecodable",
        ),
        (
            encode(&[hdr(9, &[2, 3], 24)]),
            "not an edge this node receives",
        ),
        (encode(&[hdr(3, &[3, 3], 36)]), "does not match the graph"),
        (
            encode(&[hdr(3, &[2, 3], 1 << 40)]),
            "declares 1099511627776 bytes",
        ),
        (
            encode(&[hdr(3, &[2, 3], 24), chunk(4, d.clone())]),
            "offset 4, expected 0",
        ),
        (
            encode(&[
                hdr(3, &[2, 3], 24),
                chunk(0, [d.clone(), d.clone()].concat()),
            ]),
            "48 bytes with 24 bytes left",
        ),
        (
            encode(&[hdr(3, &[2, 3], 24), hdr(3, &[2, 3], 24)]),
            "expected a chunk",
        ),
        (encode(&[chunk(0, d.clone())]), "expected a tensor header"),
        // The stream ends halfway through the tensor.
        (
            encode(&[hdr(3, &[2, 3], 24), chunk(0, d[..8].to_vec())]),
            "closed",
        ),
    ];
    for (bytes, want) in cases {
        let err = receive_raw(bytes, false).await.unwrap_err().to_string();
        assert!(err.contains(want), "expected '{want}' in: {err}");
    }
    let nan = floats(&[1.0, f32::NAN, 0.0, 0.0, 0.0, 0.0]);
    let err = receive_raw(encode(&[hdr(3, &[2, 3], 24), chunk(0, nan)]), true)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("non-finite"), "{err}");
}

#[test]
fn identities_need_certificates_and_keys() {
    let ca = Certificates::new_ca("test CA").unwrap();
    let mut id = ca.issue("n", &[]).unwrap();
    id.key_pem = "not a key".into();
    assert!(server_config(&id).is_err());
}

#[tokio::test(start_paused = true)]
async fn a_silent_peer_times_out_instead_of_hanging() {
    // The client connects and says nothing; with paused time the timeout elapses at once.
    let (_client, server) = tokio::io::duplex(1024);
    let err = accept_session(server, hello("server", ""), "secret", DEFAULT_MAX_FRAME)
        .await
        .err()
        .expect("must fail");
    assert!(err.to_string().contains("no hello"), "{err}");
}
