//! Link emulation without root: the sending side of a connection is paced to a link's bandwidth
//! and every byte is held back for the link's one-way latency, so a loopback connection behaves
//! like the wide-area link a testbed describes (throughput = bandwidth, first byte after latency).
//!
//! The application writes into an in-memory pipe; a pump task reads from it, stamps each piece
//! with the time the emulated link would deliver it (serialisation at the link rate, then the
//! latency) and writes it to the real connection at that time. The pipe's small buffer and a cap
//! on bytes in flight push back on the writer as a full link would.

use std::collections::VecDeque;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Bandwidth and one-way latency to emulate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PacedLink {
    pub bytes_per_sec: f64,
    pub latency: Duration,
}

/// Smallest piece the pump moves at once; fast links use pieces of about a millisecond of data.
const PIECE: usize = 16 * 1024;
/// The timer's granularity: pieces due within it are delivered together.
const TICK: Duration = Duration::from_millis(1);

/// Wraps the sending side of `inner` in an emulated link. Write to the returned stream; the task
/// finishes (and shuts `inner` down) after the returned stream is dropped or shut down and every
/// byte has been delivered.
pub fn paced<W: AsyncWrite + Unpin + Send + 'static>(
    inner: W,
    link: PacedLink,
) -> (DuplexStream, JoinHandle<std::io::Result<()>>) {
    let (app, pump_side) = tokio::io::duplex(PIECE * 4);
    let task = tokio::spawn(pump(pump_side, inner, link));
    (app, task)
}

async fn pump<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut from: R,
    mut to: W,
    link: PacedLink,
) -> std::io::Result<()> {
    let rate = link.bytes_per_sec.max(1.0);
    let piece = ((rate * TICK.as_secs_f64()) as usize).clamp(PIECE, 16 * PIECE);
    // Bytes may be in flight for up to the latency plus a little serialisation slack.
    let max_in_flight = (rate * link.latency.as_secs_f64()) as usize + 4 * piece;
    let mut line: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut in_flight = 0usize;
    let mut next_free = Instant::now();
    let mut eof = false;
    let mut buf = vec![0u8; piece];
    loop {
        if eof && line.is_empty() {
            break;
        }
        let due = line.front().map(|(t, _)| *t);
        let can_read = !eof && in_flight < max_in_flight;
        tokio::select! {
            biased;
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                // Deliver everything due within the timer's granularity in one go.
                let horizon = Instant::now() + TICK;
                while line.front().is_some_and(|(t, _)| *t <= horizon) {
                    if let Some((_, bytes)) = line.pop_front() {
                        in_flight -= bytes.len();
                        to.write_all(&bytes).await?;
                    }
                }
                to.flush().await?;
            }
            n = from.read(&mut buf), if can_read => {
                let n = n?;
                if n == 0 {
                    eof = true;
                    continue;
                }
                // Serialisation: the link is busy until `next_free`; this piece leaves after it.
                let now = Instant::now();
                let start = next_free.max(now);
                next_free = start + Duration::from_secs_f64(n as f64 / rate);
                line.push_back((next_free + link.latency, buf[..n].to_vec()));
                in_flight += n;
            }
        }
    }
    to.flush().await?;
    to.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn paced_bytes_arrive_intact_and_in_order() {
        let (near, mut far) = tokio::io::duplex(1 << 16);
        let link = PacedLink {
            bytes_per_sec: 50e6,
            latency: Duration::from_millis(2),
        };
        let (mut w, task) = paced(near, link);
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            w.write_all(&sent).await?;
            w.shutdown().await
        });
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(20), far.read_to_end(&mut got))
            .await
            .expect("timed out")
            .unwrap();
        writer.await.unwrap().unwrap();
        task.await.unwrap().unwrap();
        assert_eq!(got, data);
    }
}
