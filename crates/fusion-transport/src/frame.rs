//! Length-prefixed protobuf frames.

use crate::error::{Result, TransportError};
use fusion_proto::Frame;
use prost::bytes::BytesMut;
use prost::encoding::{encode_varint, encoded_len_varint};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Default largest frame a reader accepts: one tensor chunk plus header room.
pub const DEFAULT_MAX_FRAME: usize = crate::tensor::CHUNK_BYTES + 64 * 1024;

pub struct FrameReader<R> {
    inner: R,
    max_frame: usize,
    buf: BytesMut,
    /// How long the rest of a frame may take once its length has arrived (None: no limit).
    body_timeout: Option<std::time::Duration>,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R, max_frame: usize) -> Self {
        FrameReader {
            inner,
            max_frame,
            buf: BytesMut::new(),
            body_timeout: None,
        }
    }

    /// Bounds how long the rest of a frame may take once its length prefix has arrived, so a
    /// peer that trickles a frame byte by byte cannot hold the reader (waiting between frames
    /// stays unbounded: an idle session is legitimate).
    pub fn set_body_timeout(&mut self, limit: std::time::Duration) {
        self.body_timeout = Some(limit);
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
        let body = self.inner.read_exact(&mut self.buf[..]);
        match self.body_timeout {
            Some(limit) => {
                // A stall, not proof of a bad peer: reported like a broken connection.
                tokio::time::timeout(limit, body).await.map_err(|_| {
                    TransportError::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "a frame of {len} bytes did not arrive within {} s",
                            limit.as_secs_f64()
                        ),
                    ))
                })??;
            }
            None => {
                body.await?;
            }
        }
        // Decoding from `Bytes` lets chunk payloads point into this buffer instead of copying.
        Ok(Frame::decode(self.buf.split().freeze())?)
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

    /// Writes a `Frame { chunk: TensorChunk { offset, data } }` without copying `data` into an
    /// encode buffer: the protobuf framing is written by hand (byte-identical to prost's encoding)
    /// and the payload goes straight to the stream. Like prost, zero and empty fields are omitted.
    pub async fn write_chunk(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        const FRAME_CHUNK_KEY: u8 = (3 << 3) | 2; // Frame.chunk, length-delimited
        const OFFSET_KEY: u8 = 1 << 3; // TensorChunk.offset, varint
        const DATA_KEY: u8 = (2 << 3) | 2; // TensorChunk.data, length-delimited
        let offset_len = if offset == 0 {
            0
        } else {
            1 + encoded_len_varint(offset)
        };
        let data_len = if data.is_empty() {
            0
        } else {
            1 + encoded_len_varint(data.len() as u64) + data.len()
        };
        let inner = offset_len + data_len;
        let frame = 1 + encoded_len_varint(inner as u64) + inner;
        let prefix = u32::try_from(frame).map_err(|_| {
            TransportError::Protocol(format!("chunk of {} bytes cannot be sent", data.len()))
        })?;
        self.buf.clear();
        self.buf.extend_from_slice(&prefix.to_be_bytes());
        self.buf.push(FRAME_CHUNK_KEY);
        encode_varint(inner as u64, &mut self.buf);
        if offset != 0 {
            self.buf.push(OFFSET_KEY);
            encode_varint(offset, &mut self.buf);
        }
        if !data.is_empty() {
            self.buf.push(DATA_KEY);
            encode_varint(data.len() as u64, &mut self.buf);
        }
        self.inner.write_all(&self.buf).await?;
        self.inner.write_all(data).await?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use fusion_proto::{frame::Body, TensorChunk};

    /// The hand-written chunk encoding is byte-identical to prost's.
    #[tokio::test]
    async fn chunk_encoding_matches_prost() {
        for (offset, len) in [
            (0u64, 0usize),
            (0, 5),
            (1, 1),
            (300, 200),
            (4 << 20, 4 << 20),
            (u64::MAX >> 1, 127),
        ] {
            let data: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut w = FrameWriter::new(Vec::new());
            w.write_chunk(offset, &data).await.unwrap();
            let mut want = FrameWriter::new(Vec::new());
            want.write(&Frame {
                body: Some(Body::Chunk(TensorChunk {
                    offset,
                    data: data.clone().into(),
                })),
            })
            .await
            .unwrap();
            assert_eq!(
                w.into_inner(),
                want.into_inner(),
                "offset {offset}, {len} bytes"
            );
        }
    }
}
