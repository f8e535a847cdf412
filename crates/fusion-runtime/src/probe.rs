//! Link probing over the data plane: how fast and how far away is a peer? The scheduler plans
//! with these figures instead of what a testbed file claims, and AdaTopK sizes its compression
//! from them.
//!
//! A probe session is a data-plane session whose Hello says `probe`. The prober measures the
//! round trip with a few empty probes (latency = half the smallest round trip), then sends a
//! payload that grows fourfold until one transfer lasts long enough to time reliably, or reaches
//! the byte cap; bandwidth = payload / (time to its reply − round trip). Everything is bounded:
//! the bytes, the number of frames, and the time waited for any reply. When links are emulated,
//! both directions are paced like tensor traffic, so the probe sees the emulated link.

use crate::error::{Result, RuntimeError};
use fusion_proto::{frame::Body, Frame, Goodbye, Probe, ProbeReply};
use fusion_transport::{paced, FrameReader, FrameWriter, PacedLink, CHUNK_BYTES};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};

/// Empty probes sent to measure the round trip; the smallest counts.
const PINGS: u64 = 3;
/// The first bulk payload; it grows fourfold from here.
const FIRST_PAYLOAD: usize = 64 * 1024;
/// A bulk transfer shorter than this is too quick to time: send four times more.
const MIN_TRANSFER: Duration = Duration::from_millis(60);
/// How long the prober waits for any reply, and the answering side for any probe frame.
pub const PROBE_REPLY_TIMEOUT: Duration = Duration::from_secs(20);
/// Probe frames an answering side accepts in one session (the prober needs far fewer).
pub const MAX_PROBE_FRAMES: u64 = 1024;
/// Default cap on one probe's payload.
pub const DEFAULT_PROBE_BYTES: u64 = 8 << 20;

/// What one probe measured.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkEstimate {
    pub bytes_per_s: f64,
    /// One-way latency (half the smallest round trip).
    pub latency_s: f64,
    /// Payload of the transfer the bandwidth comes from.
    pub probe_bytes: u64,
    /// Where the peer saw the probe come from (empty when it did not say).
    pub observed: String,
}

type Writer = FrameWriter<Box<dyn AsyncWrite + Unpin + Send>>;

/// Wraps a session's writer in the emulated link, when there is one.
pub(crate) fn pace_writer<W: AsyncWrite + Unpin + Send + 'static>(
    inner: W,
    link: Option<PacedLink>,
) -> (Writer, Option<tokio::task::JoinHandle<std::io::Result<()>>>) {
    match link {
        Some(link) => {
            let (app, pump) = paced(inner, link);
            (FrameWriter::new(Box::new(app)), Some(pump))
        }
        None => (FrameWriter::new(Box::new(inner)), None),
    }
}

fn protocol(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Protocol(e.to_string())
}

/// Reads the reply to probe `seq` (replies come in order).
async fn reply<R: AsyncRead + Unpin>(
    r: &mut FrameReader<R>,
    peer: &str,
    seq: u64,
) -> Result<ProbeReply> {
    let frame = tokio::time::timeout(PROBE_REPLY_TIMEOUT, r.read())
        .await
        .map_err(|_| {
            RuntimeError::Timeout(format!(
                "no probe reply from {peer} within {} s",
                PROBE_REPLY_TIMEOUT.as_secs()
            ))
        })?
        .map_err(|e| protocol(format!("probing {peer}: {e}")))?;
    match frame.body {
        Some(Body::ProbeReply(p)) if p.seq == seq => Ok(p),
        Some(Body::Goodbye(g)) => Err(RuntimeError::Rejected(format!(
            "{peer} refused the probe: {}",
            g.reason
        ))),
        _ => Err(protocol(format!(
            "{peer} answered probe {seq} with something else"
        ))),
    }
}

/// Sends `bytes` of probe payload as frames of at most a chunk each; returns the last seq.
async fn send_payload(w: &mut Writer, seq: &mut u64, bytes: usize) -> Result<u64> {
    let mut left = bytes;
    loop {
        let n = left.min(CHUNK_BYTES);
        *seq += 1;
        w.write(&Frame {
            body: Some(Body::Probe(Probe {
                seq: *seq,
                payload: vec![0u8; n].into(),
            })),
        })
        .await
        .map_err(protocol)?;
        left -= n;
        if left == 0 {
            break;
        }
    }
    w.flush().await.map_err(protocol)?;
    Ok(*seq)
}

/// Measures the link to `peer` over an open probe session (`r`, `w` after the hellos), sending
/// at most `max_bytes` in one transfer; says goodbye at the end.
pub(crate) async fn measure<R: AsyncRead + Unpin>(
    mut r: FrameReader<R>,
    mut w: Writer,
    peer: &str,
    max_bytes: u64,
) -> Result<LinkEstimate> {
    let mut seq = 0u64;
    let mut rtt = f64::INFINITY;
    let mut observed = String::new();
    for _ in 0..PINGS {
        let t0 = Instant::now();
        let last = send_payload(&mut w, &mut seq, 0).await?;
        observed = reply(&mut r, peer, last).await?.observed_address;
        rtt = rtt.min(t0.elapsed().as_secs_f64());
    }
    let cap = (max_bytes as usize).max(1);
    let mut payload = FIRST_PAYLOAD.min(cap);
    let estimate = loop {
        let t0 = Instant::now();
        let first = seq + 1;
        let last = send_payload(&mut w, &mut seq, payload).await?;
        let mut got = 0u64;
        for s in first..=last {
            got += reply(&mut r, peer, s).await?.received;
        }
        if got != payload as u64 {
            return Err(protocol(format!(
                "{peer} acknowledged {got} of {payload} probe bytes"
            )));
        }
        let elapsed = t0.elapsed().as_secs_f64();
        let transfer = (elapsed - rtt).max(1e-6);
        if transfer >= MIN_TRANSFER.as_secs_f64() || payload >= cap {
            break LinkEstimate {
                bytes_per_s: payload as f64 / transfer,
                latency_s: rtt / 2.0,
                probe_bytes: payload as u64,
                observed,
            };
        }
        payload = (payload * 4).min(cap);
    };
    let _ = w
        .write(&Frame {
            body: Some(Body::Goodbye(Goodbye {
                reason: "probe done".into(),
            })),
        })
        .await;
    let _ = w.flush().await;
    Ok(estimate)
}

/// The answering side of a probe session: replies to every probe frame until the prober says
/// goodbye or closes, within [`MAX_PROBE_FRAMES`] frames and [`PROBE_REPLY_TIMEOUT`] per frame.
/// Each reply says where the session came from (`observed`).
pub(crate) async fn answer<R: AsyncRead + Unpin>(
    mut r: FrameReader<R>,
    mut w: Writer,
    peer: &str,
    observed: &str,
) -> Result<()> {
    for _ in 0..MAX_PROBE_FRAMES {
        let frame = match tokio::time::timeout(PROBE_REPLY_TIMEOUT, r.read()).await {
            Err(_) => {
                return Err(RuntimeError::Timeout(format!(
                    "probe session from {peer} went silent"
                )))
            }
            Ok(Err(e)) => return Err(protocol(format!("probe session from {peer}: {e}"))),
            Ok(Ok(f)) => f,
        };
        match frame.body {
            Some(Body::Probe(p)) => {
                w.write(&Frame {
                    body: Some(Body::ProbeReply(ProbeReply {
                        seq: p.seq,
                        received: p.payload.len() as u64,
                        observed_address: observed.to_string(),
                    })),
                })
                .await
                .map_err(protocol)?;
                w.flush().await.map_err(protocol)?;
            }
            Some(Body::Goodbye(_)) => return Ok(()),
            _ => {
                return Err(protocol(format!(
                    "{peer} sent something other than a probe in a probe session"
                )))
            }
        }
    }
    Err(protocol(format!(
        "{peer} sent more than {MAX_PROBE_FRAMES} probe frames"
    )))
}
