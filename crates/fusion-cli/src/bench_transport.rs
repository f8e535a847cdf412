//! `fusionllm bench --transport`: loopback throughput of the tensor data plane against a plain
//! TCP stream, and per-message overhead.

use anyhow::{Context, Result};
use fusion_proto::{DType, Direction, Hello, TensorHeader, PROTOCOL_VERSION};
use fusion_transport::{
    accept_session, client_config, open_session, send_tensor, server_config, Certificates,
    ExpectedTensor, TensorReceiver, DEFAULT_MAX_FRAME,
};
use serde::Serialize;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::{TlsAcceptor, TlsConnector};

#[derive(Serialize)]
pub struct TransportResult {
    pub tensor_bytes: usize,
    pub tensors: usize,
    pub plain_tcp_mb_s: f64,
    pub framed_tcp_mb_s: f64,
    pub framed_tls_mb_s: f64,
    pub tls_vs_plain: f64,
    pub small_messages: usize,
    pub small_message_bytes: usize,
    pub small_messages_per_s: f64,
    pub us_per_small_message: f64,
    pub pacing: Vec<PacingResult>,
}

/// How close a paced loopback connection comes to the link it emulates.
#[derive(Serialize)]
pub struct PacingResult {
    pub configured_mbps: f64,
    pub configured_latency_ms: f64,
    pub bytes: usize,
    pub achieved_mbps: f64,
    pub rate_ratio: f64,
    pub first_byte_ms: f64,
}

async fn pacing(mbps: f64, latency_ms: f64, seconds: f64) -> Result<PacingResult> {
    use fusion_transport::{paced, PacedLink};
    let link = PacedLink {
        bytes_per_sec: mbps * 1e6 / 8.0,
        latency: std::time::Duration::from_secs_f64(latency_ms / 1e3),
    };
    let bytes = (link.bytes_per_sec * seconds) as usize;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        let mut first = [0u8; 1];
        s.read_exact(&mut first).await?;
        let first_at = Instant::now();
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0usize;
        while total < bytes {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            total += n;
        }
        Ok::<_, std::io::Error>((first_at, Instant::now(), total))
    });
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let (mut w, task) = paced(tcp, link);
    let t0 = Instant::now();
    w.write_all(&[1]).await?;
    w.write_all(&vec![0u8; bytes]).await?;
    w.shutdown().await?;
    let (first_at, end, total) = server.await??;
    task.await??;
    anyhow::ensure!(
        total == bytes,
        "paced link delivered {total} of {bytes} bytes"
    );
    let transfer = end.duration_since(first_at).as_secs_f64();
    let achieved = bytes as f64 * 8.0 / transfer / 1e6;
    Ok(PacingResult {
        configured_mbps: mbps,
        configured_latency_ms: latency_ms,
        bytes,
        achieved_mbps: achieved,
        rate_ratio: achieved / mbps,
        first_byte_ms: first_at.duration_since(t0).as_secs_f64() * 1e3,
    })
}

fn hello(name: &str) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        node_id: name.into(),
        token: "bench".into(),
        backend: String::new(),
        software_version: env!("CARGO_PKG_VERSION").into(),
        generation: 0,
        probe: false,
        fetch: false,
    }
}

async fn plain_tcp(bytes: usize, count: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0usize;
        while total < bytes * count {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            total += n;
        }
        Ok::<_, std::io::Error>(total)
    });
    let data = vec![7u8; bytes];
    let start = Instant::now();
    let mut c = TcpStream::connect(addr).await?;
    for _ in 0..count {
        c.write_all(&data).await?;
    }
    c.flush().await?;
    let got = server.await??;
    anyhow::ensure!(got == bytes * count, "plain TCP delivered {got} bytes");
    Ok((bytes * count) as f64 / start.elapsed().as_secs_f64() / 1e6)
}

/// Sends `count` tensors of `elems` f32 values through a session, over TLS or not.
async fn framed(elems: usize, count: usize, tls: bool) -> Result<f64> {
    let ca = Certificates::new_ca("bench CA")?;
    let (sid, cid) = (ca.issue("server", &[])?, ca.issue("client", &[])?);
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let expect = move |_edge: u64, _dir: Direction| {
        Some(ExpectedTensor {
            dtypes: vec![DType::F32],
            shape: vec![elems],
            direction: Direction::Activation,
        })
    };
    let acceptor = TlsAcceptor::from(server_config(&sid)?);
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await?;
        tcp.set_nodelay(true)?;
        let mut received = 0usize;
        if tls {
            let (r, _w, _) = accept_session(
                acceptor.accept(tcp).await?,
                hello("server"),
                "bench",
                DEFAULT_MAX_FRAME,
            )
            .await?;
            let mut rx = TensorReceiver::new(r, expect);
            for _ in 0..count {
                received += rx.recv().await?.data.len();
            }
        } else {
            let (r, _w, _) =
                accept_session(tcp, hello("server"), "bench", DEFAULT_MAX_FRAME).await?;
            let mut rx = TensorReceiver::new(r, expect);
            for _ in 0..count {
                received += rx.recv().await?.data.len();
            }
        }
        Ok::<_, anyhow::Error>(received)
    });
    let data: Vec<u8> = (0..elems).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let header = TensorHeader {
        step: 0,
        micro_batch: 0,
        edge: 1,
        direction: Direction::Activation as i32,
        dtype: DType::F32 as i32,
        shape: vec![elems as u64],
        total_bytes: 0,
        seq: 0,
    };
    let start = Instant::now();
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    if tls {
        let stream = TlsConnector::from(client_config(&cid)?)
            .connect(ServerName::try_from("server")?, tcp)
            .await?;
        let (_r, mut w, _) = open_session(stream, hello("client"), DEFAULT_MAX_FRAME).await?;
        for _ in 0..count {
            send_tensor(&mut w, header.clone(), &data).await?;
        }
    } else {
        let (_r, mut w, _) = open_session(tcp, hello("client"), DEFAULT_MAX_FRAME).await?;
        for _ in 0..count {
            send_tensor(&mut w, header.clone(), &data).await?;
        }
    }
    let got = server.await??;
    anyhow::ensure!(
        got == data.len() * count,
        "framed transport delivered {got} bytes"
    );
    Ok((data.len() * count) as f64 / start.elapsed().as_secs_f64() / 1e6)
}

pub fn run() -> Result<TransportResult> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting tokio")?;
    rt.block_on(async {
        let (bytes, count) = (16usize << 20, 40usize);
        // Warm up each path once, then measure.
        plain_tcp(bytes, 2).await?;
        let plain = plain_tcp(bytes, count).await?;
        let framed_tcp = framed(bytes / 4, count, false).await?;
        let framed_tls = framed(bytes / 4, count, true).await?;
        let (small, small_elems) = (20_000usize, 256usize);
        let t = Instant::now();
        framed(small_elems, small, true).await?;
        let secs = t.elapsed().as_secs_f64();
        let mut paced = Vec::new();
        for (mbps, lat) in [(8.0, 20.0), (50.0, 40.0), (200.0, 10.0), (1000.0, 0.2)] {
            paced.push(pacing(mbps, lat, 2.0).await?);
        }
        Ok(TransportResult {
            tensor_bytes: bytes,
            tensors: count,
            plain_tcp_mb_s: plain,
            framed_tcp_mb_s: framed_tcp,
            framed_tls_mb_s: framed_tls,
            tls_vs_plain: framed_tls / plain,
            small_messages: small,
            small_message_bytes: small_elems * 4,
            small_messages_per_s: small as f64 / secs,
            us_per_small_message: secs * 1e6 / small as f64,
            pacing: paced,
        })
    })
}
