//! Length-prefixed protobuf frames.

use crate::error::{Result, TransportError};
use fusion_proto::Frame;
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Default largest frame a reader accepts: one tensor chunk plus header room.
pub const DEFAULT_MAX_FRAME: usize = crate::tensor::CHUNK_BYTES + 64 * 1024;

pub struct FrameReader<R> {
    inner: R,
    max_frame: usize,
    buf: Vec<u8>,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R, max_frame: usize) -> Self {
        FrameReader {
            inner,
            max_frame,
            buf: Vec::new(),
        }
    }

    /// The next frame. The length prefix is checked against the limit before any allocation.
    pub async fn read(&mut self) -> Result<Frame> {
        let mut len = [0u8; 4];
        match self.inner.read_exact(&mut len).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(TransportError::Closed)
            }
            Err(e) => return Err(e.into()),
        }
        let len = u32::from_be_bytes(len) as usize;
        if len > self.max_frame {
            return Err(TransportError::FrameTooLarge {
                len,
                limit: self.max_frame,
            });
        }
        self.buf.resize(len, 0);
        self.inner.read_exact(&mut self.buf).await?;
        Ok(Frame::decode(&self.buf[..])?)
    }

    pub fn into_inner(self) -> R {
        self.inner
    }
}

pub struct FrameWriter<W> {
    inner: W,
    buf: Vec<u8>,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    pub fn new(inner: W) -> Self {
        FrameWriter {
            inner,
            buf: Vec::new(),
        }
    }

    /// Queues one frame (buffered by the stream; call [`FrameWriter::flush`] to push it out).
    pub async fn write(&mut self, frame: &Frame) -> Result<()> {
        let len = frame.encoded_len();
        let prefix = u32::try_from(len).map_err(|_| {
            TransportError::Protocol(format!("frame of {len} bytes cannot be sent"))
        })?;
        self.buf.clear();
        self.buf.extend_from_slice(&prefix.to_be_bytes());
        frame
            .encode(&mut self.buf)
            .map_err(|e| TransportError::Protocol(e.to_string()))?;
        self.inner.write_all(&self.buf).await?;
        Ok(())
    }

    pub async fn flush(&mut self) -> Result<()> {
        self.inner.flush().await?;
        Ok(())
    }

    pub fn into_inner(self) -> W {
        self.inner
    }
}
