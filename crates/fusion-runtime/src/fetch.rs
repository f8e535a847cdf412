//! Fetch sessions of the data plane: a node copies a shard file from the peer that holds it
//! (a buddy keeping a copy of a stage's snapshot, or a node restoring a stage it did not hold).
//! The holder admits only the peers the broker named (with the certificates they joined with);
//! the fetcher checks the file's size and SHA-256 against what the broker recorded, so a holder
//! cannot hand out anything else.

use crate::error::{io_err, Result, RuntimeError};
use crate::outgoing::dial;
use crate::shards::{ShardFile, ShardStore};
use fusion_proto::{frame::Body, Frame, Goodbye, Hello, ShardFile as ShardAnnounce, ShardRequest};
use fusion_transport::{FrameReader, FrameWriter, NodeIdentity};
use sha2::{Digest, Sha256};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bytes per chunk of a shard file on the wire.
const CHUNK: usize = 1 << 20;

/// How long a fetch session may wait for the next frame (a chunk of 1 MiB takes 1 s at
/// 8 Mbit/s).
const FRAME_WAIT: Duration = Duration::from_secs(120);

fn shard_err(shard: &str, reason: String) -> RuntimeError {
    RuntimeError::Shard {
        shard: shard.to_string(),
        reason,
    }
}

/// What a fetcher asks for and expects.
pub struct Wanted<'a> {
    pub run_id: &'a str,
    pub step: u64,
    pub shard: &'a str,
    pub bytes: u64,
    pub sha256: &'a str,
}

/// Copies shard `want` from `peer` (listening at `address`, presenting the certificate `pin`)
/// into `store`, checking its size and checksum; `me` is this node's hello (with `fetch` set).
pub async fn fetch(
    identity: &NodeIdentity,
    me: Hello,
    peer: &str,
    address: &str,
    pin: &[u8],
    store: &ShardStore,
    want: &Wanted<'_>,
) -> Result<ShardFile> {
    let (mut r, mut w) = dial(identity, peer, address, pin, me).await?;
    r.set_body_timeout(FRAME_WAIT);
    w.write(&Frame {
        body: Some(Body::ShardRequest(ShardRequest {
            run_id: want.run_id.into(),
            step: want.step,
            shard: want.shard.into(),
        })),
    })
    .await?;
    w.flush().await?;
    let announced = match next_frame(&mut r).await? {
        Body::ShardFile(f) => f,
        Body::Goodbye(g) => {
            return Err(shard_err(
                want.shard,
                format!("{peer} refused to send it: {}", g.reason),
            ))
        }
        _ => {
            return Err(shard_err(
                want.shard,
                format!("{peer} answered out of turn"),
            ))
        }
    };
    if announced.total_bytes != want.bytes || announced.sha256 != want.sha256 {
        return Err(shard_err(
            want.shard,
            format!(
                "{peer} offers {} bytes with checksum {}, the snapshot recorded {} bytes with {}",
                announced.total_bytes, announced.sha256, want.bytes, want.sha256
            ),
        ));
    }
    let path = store.prepare(want.run_id, want.step, want.shard)?;
    let partial = path.with_extension("partial");
    let limit = fetch_deadline(want.bytes);
    let result = match tokio::time::timeout(limit, receive(&mut r, &partial, want, peer)).await {
        Ok(r) => r,
        Err(_) => Err(shard_err(
            want.shard,
            format!(
                "{peer} did not send its {} bytes within {} s",
                want.bytes,
                limit.as_secs()
            ),
        )),
    };
    if let Err(e) = result {
        let _ = tokio::fs::remove_file(&partial).await;
        return Err(e);
    }
    tokio::fs::rename(&partial, &path)
        .await
        .map_err(io_err(format!("renaming {}", partial.display())))?;
    store.commit(&path, want.sha256)
}

/// The longest a whole fetch of `bytes` may take: a minute plus 1 s per MB (8 Mbit/s, the
/// slowest link a run is meant for), so a holder that trickles cannot hold the fetcher forever.
pub fn fetch_deadline(bytes: u64) -> Duration {
    Duration::from_secs(60 + bytes / 1_000_000)
}

/// Reads the announced file's chunks into `partial`, in order, hashing as they come.
async fn receive<R: AsyncRead + Unpin>(
    r: &mut FrameReader<R>,
    partial: &std::path::Path,
    want: &Wanted<'_>,
    peer: &str,
) -> Result<()> {
    let mut out = tokio::fs::File::create(partial)
        .await
        .map_err(io_err(format!("creating {}", partial.display())))?;
    let mut hash = Sha256::new();
    let mut got = 0u64;
    while got < want.bytes {
        let chunk = match next_frame(r).await? {
            Body::Chunk(c) => c,
            Body::Goodbye(g) => {
                return Err(shard_err(
                    want.shard,
                    format!("{peer} stopped after {got} bytes: {}", g.reason),
                ))
            }
            _ => return Err(shard_err(want.shard, format!("{peer} sent a stray frame"))),
        };
        let len = chunk.data.len() as u64;
        if chunk.offset != got || len == 0 || got + len > want.bytes {
            return Err(shard_err(
                want.shard,
                format!(
                    "{peer} sent {} bytes at offset {} where offset {got} of {} was due",
                    chunk.data.len(),
                    chunk.offset,
                    want.bytes
                ),
            ));
        }
        hash.update(&chunk.data);
        out.write_all(&chunk.data)
            .await
            .map_err(io_err(format!("writing {}", partial.display())))?;
        got += chunk.data.len() as u64;
    }
    out.sync_all()
        .await
        .map_err(io_err(format!("writing {}", partial.display())))?;
    let sha = hex::encode(hash.finalize());
    if sha != want.sha256 {
        return Err(shard_err(
            want.shard,
            format!(
                "{peer} sent bytes whose checksum is {sha}, not {}",
                want.sha256
            ),
        ));
    }
    Ok(())
}

async fn next_frame<R: AsyncRead + Unpin>(r: &mut FrameReader<R>) -> Result<Body> {
    let frame = tokio::time::timeout(FRAME_WAIT, r.read())
        .await
        .map_err(|_| RuntimeError::Timeout("the next frame of a shard".into()))??;
    frame
        .body
        .ok_or_else(|| RuntimeError::Protocol("an empty frame in a fetch session".into()))
}

/// Answers one admitted fetch session: reads the request and sends the shard file from `store`,
/// or a goodbye saying why not.
pub async fn serve<R, W>(
    mut r: FrameReader<R>,
    mut w: FrameWriter<W>,
    peer: &str,
    store: &ShardStore,
) -> Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let req = match next_frame(&mut r).await? {
        Body::ShardRequest(q) => q,
        _ => {
            return Err(RuntimeError::Protocol(format!(
                "{peer} sent no shard request"
            )))
        }
    };
    let file = match store.find(&req.run_id, req.step, &req.shard) {
        Ok(f) => f,
        Err(e) => {
            let _ = goodbye(&mut w, e.to_string()).await;
            return Err(e);
        }
    };
    // A fetcher that stops reading cannot hold this session (and the file) open for ever.
    let limit = fetch_deadline(file.bytes);
    tokio::time::timeout(limit, send_file(&mut w, &file, &req.shard))
        .await
        .map_err(|_| {
            shard_err(
                &req.shard,
                format!("{peer} did not take the file within {} s", limit.as_secs()),
            )
        })?
}

/// Announces `file` and sends its bytes in chunks.
async fn send_file<W: AsyncWrite + Unpin>(
    w: &mut FrameWriter<W>,
    file: &ShardFile,
    shard: &str,
) -> Result<()> {
    w.write(&Frame {
        body: Some(Body::ShardFile(ShardAnnounce {
            total_bytes: file.bytes,
            sha256: file.sha256.clone(),
        })),
    })
    .await?;
    let mut f = tokio::fs::File::open(&file.path)
        .await
        .map_err(io_err(format!("opening {}", file.path.display())))?;
    let mut buf = vec![0u8; CHUNK];
    let mut sent = 0u64;
    while sent < file.bytes {
        let n = f
            .read(&mut buf)
            .await
            .map_err(io_err(format!("reading {}", file.path.display())))?;
        if n == 0 {
            let _ = goodbye(w, "the file ended early".into()).await;
            return Err(shard_err(shard, "the file ended early".into()));
        }
        w.write_chunk(sent, &buf[..n]).await?;
        sent += n as u64;
    }
    w.flush().await?;
    Ok(())
}

async fn goodbye<W: AsyncWrite + Unpin>(w: &mut FrameWriter<W>, reason: String) -> Result<()> {
    w.write(&Frame {
        body: Some(Body::Goodbye(Goodbye { reason })),
    })
    .await?;
    w.flush().await?;
    Ok(())
}
