//! Tensors as a header plus in-order chunks, and a receiver that validates each step.

use crate::error::{Result, TransportError};
use crate::frame::{FrameReader, FrameWriter};
use fusion_proto::{frame::Body, DType, Direction, Frame, TensorHeader};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// Bytes per chunk: large enough to amortise framing, small enough to interleave streams.
pub const CHUNK_BYTES: usize = 4 << 20;

pub fn dtype_size(d: DType) -> Option<usize> {
    match d {
        DType::F64 => Some(8),
        DType::F32 | DType::I32 => Some(4),
        DType::F16 | DType::Bf16 => Some(2),
        DType::DtypeUnspecified | DType::Compressed => None,
    }
}

/// Sends `data` (little-endian elements) as one tensor.
pub async fn send_tensor<W: AsyncWrite + Unpin>(
    w: &mut FrameWriter<W>,
    header: TensorHeader,
    data: &[u8],
) -> Result<()> {
    send_tensor_within(w, header, data, None, || {}).await
}

/// Sends like [`send_tensor`], failing with [`TransportError::Stalled`] when writing one frame
/// (at most a chunk) takes longer than `stall`: the peer stopped reading, or the way to it is cut.
/// `on_chunk` is called after every chunk written (progress).
pub async fn send_tensor_within<W: AsyncWrite + Unpin>(
    w: &mut FrameWriter<W>,
    mut header: TensorHeader,
    data: &[u8],
    stall: Option<Duration>,
    mut on_chunk: impl FnMut(),
) -> Result<()> {
    header.total_bytes = data.len() as u64;
    let frame = Frame {
        body: Some(Body::Header(header)),
    };
    within(stall, w.write(&frame)).await?;
    let mut offset = 0usize;
    for piece in data.chunks(CHUNK_BYTES) {
        within(stall, w.write_chunk(offset as u64, piece)).await?;
        offset += piece.len();
        on_chunk();
    }
    within(stall, w.flush()).await
}

async fn within<T>(
    stall: Option<Duration>,
    f: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    match stall {
        None => f.await,
        Some(d) => tokio::time::timeout(d, f)
            .await
            .map_err(|_| TransportError::Stalled(d.as_secs_f64()))?,
    }
}

/// What the receiver expects on an edge (from its subgraph): anything else is refused.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpectedTensor {
    /// Element types the receiver accepts (a float tensor may come as F32 or F64).
    pub dtypes: Vec<DType>,
    pub shape: Vec<usize>,
    pub direction: Direction,
}

/// A fully received and validated tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct ReceivedTensor {
    pub header: TensorHeader,
    pub data: Vec<u8>,
}

impl ReceivedTensor {
    /// The elements as `f32` (for F32 tensors).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        if self.header.dtype() != DType::F32 {
            return Err(TransportError::BadTensor(format!(
                "edge {} is {:?}, not F32",
                self.header.edge,
                self.header.dtype()
            )));
        }
        Ok(le_bytes_to_f32(&self.data))
    }
}

/// Little-endian bytes of `v`: one copy of the slice (and a byte swap per value on a big-endian
/// machine), not a loop that appends each element.
fn to_le<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    let mut bytes = bytemuck::cast_slice::<T, u8>(v).to_vec();
    if cfg!(target_endian = "big") {
        bytes
            .chunks_exact_mut(std::mem::size_of::<T>())
            .for_each(|c| c.reverse());
    }
    bytes
}

/// The values of little-endian bytes (a trailing partial value is ignored), copied into an
/// aligned buffer.
fn from_le<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    let n = b.len() / size;
    let mut out = vec![T::zeroed(); n];
    let bytes = bytemuck::cast_slice_mut::<T, u8>(&mut out);
    bytes.copy_from_slice(&b[..n * size]);
    if cfg!(target_endian = "big") {
        bytes.chunks_exact_mut(size).for_each(|c| c.reverse());
    }
    out
}

/// Little-endian bytes of `f32` values (see [`to_le`]).
pub fn f32_le_bytes(v: &[f32]) -> Vec<u8> {
    to_le(v)
}

/// Little-endian bytes of `f64` values.
pub fn f64_le_bytes(v: &[f64]) -> Vec<u8> {
    to_le(v)
}

/// The `f32` values of little-endian bytes (see [`from_le`]).
pub fn le_bytes_to_f32(b: &[u8]) -> Vec<f32> {
    from_le(b)
}

/// The `f64` values of little-endian bytes.
pub fn le_bytes_to_f64(b: &[u8]) -> Vec<f64> {
    from_le(b)
}

impl ReceivedTensor {
    /// The elements as `f64` (for F32 and F64 tensors).
    pub fn to_f64(&self) -> Result<Vec<f64>> {
        match self.header.dtype() {
            DType::F64 => Ok(le_bytes_to_f64(&self.data)),
            _ => Ok(self.to_f32()?.into_iter().map(f64::from).collect()),
        }
    }
}

/// Reads tensors from a peer, checking each against `expect(edge, direction)` (an activation and a
/// gradient, or a tensor and a parameter, may share an id).
pub struct TensorReceiver<R, F> {
    reader: FrameReader<R>,
    expect: F,
    /// Reject non-finite f32 values (NaN or infinity) when set.
    pub require_finite: bool,
}

impl<R: AsyncRead + Unpin, F: Fn(u64, Direction) -> Option<ExpectedTensor>> TensorReceiver<R, F> {
    pub fn new(reader: FrameReader<R>, expect: F) -> Self {
        TensorReceiver {
            reader,
            expect,
            require_finite: false,
        }
    }

    fn check_header(&self, h: &TensorHeader) -> Result<usize> {
        let bad = |m: String| Err(TransportError::BadTensor(format!("edge {}: {m}", h.edge)));
        let dtype = DType::try_from(h.dtype).unwrap_or(DType::DtypeUnspecified);
        let direction = Direction::try_from(h.direction).unwrap_or(Direction::Unspecified);
        let Some(exp) = (self.expect)(h.edge, direction) else {
            return bad(format!("not an edge this node receives ({direction:?})"));
        };
        if !exp.dtypes.contains(&dtype) || direction != exp.direction {
            return bad(format!(
                "got {dtype:?} {direction:?}, expected {:?} {:?}",
                exp.dtypes, exp.direction
            ));
        }
        let shape: Vec<usize> = h
            .shape
            .iter()
            .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
            .collect();
        if shape != exp.shape {
            return bad(format!(
                "shape {shape:?} does not match the graph's {:?}",
                exp.shape
            ));
        }
        if dtype == DType::Compressed {
            // A compressed message's size depends on its content; bound it before allocating.
            let limit = shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .and_then(|n| n.checked_mul(4).map(|b| b + n / 8 + 64));
            return match limit {
                Some(l) if h.total_bytes >= 12 && h.total_bytes <= l as u64 => {
                    Ok(h.total_bytes as usize)
                }
                _ => bad(format!(
                    "a compressed message of {} bytes for shape {shape:?} (at most {limit:?})",
                    h.total_bytes
                )),
            };
        }
        let elem = dtype_size(dtype).unwrap_or(0);
        let want = shape.iter().try_fold(elem, |a, &d| a.checked_mul(d));
        match want {
            Some(n) if n as u64 == h.total_bytes => Ok(n),
            _ => bad(format!(
                "declares {} bytes, its shape needs {want:?}",
                h.total_bytes
            )),
        }
    }

    /// The next tensor, fully received and validated.
    pub async fn recv(&mut self) -> Result<ReceivedTensor> {
        let header = match self.reader.read().await?.body {
            Some(Body::Header(h)) => h,
            Some(Body::Goodbye(g)) => return Err(TransportError::Refused(g.reason)),
            other => {
                return Err(TransportError::Protocol(format!(
                    "expected a tensor header, got {}",
                    describe(&other)
                )))
            }
        };
        let total = self.check_header(&header)?;
        let mut data = Vec::with_capacity(total);
        while data.len() < total {
            let chunk = match self.reader.read().await?.body {
                Some(Body::Chunk(c)) => c,
                other => {
                    return Err(TransportError::Protocol(format!(
                        "expected a chunk of edge {}, got {}",
                        header.edge,
                        describe(&other)
                    )))
                }
            };
            if chunk.offset != data.len() as u64 {
                return Err(TransportError::BadTensor(format!(
                    "edge {}: chunk at offset {}, expected {}",
                    header.edge,
                    chunk.offset,
                    data.len()
                )));
            }
            if chunk.data.is_empty() || chunk.data.len() > total - data.len() {
                return Err(TransportError::BadTensor(format!(
                    "edge {}: chunk of {} bytes with {} bytes left",
                    header.edge,
                    chunk.data.len(),
                    total - data.len()
                )));
            }
            data.extend_from_slice(&chunk.data);
        }
        let t = ReceivedTensor { header, data };
        if self.require_finite
            && matches!(t.header.dtype(), DType::F32 | DType::F64)
            && t.to_f64()?.iter().any(|v| !v.is_finite())
        {
            return Err(TransportError::BadTensor(format!(
                "edge {}: non-finite values",
                t.header.edge
            )));
        }
        Ok(t)
    }

    pub fn into_reader(self) -> FrameReader<R> {
        self.reader
    }
}

fn describe(body: &Option<Body>) -> &'static str {
    match body {
        None => "an empty frame",
        Some(Body::Hello(_)) => "a hello",
        Some(Body::Header(_)) => "a tensor header",
        Some(Body::Chunk(_)) => "a chunk",
        Some(Body::Goodbye(_)) => "a goodbye",
        Some(Body::Probe(_)) => "a link probe",
        Some(Body::ProbeReply(_)) => "a link-probe reply",
        Some(Body::ShardRequest(_)) => "a shard request",
        Some(Body::ShardFile(_)) => "a shard announcement",
    }
}

#[cfg(test)]
mod byte_tests {
    use super::*;

    #[test]
    fn values_travel_as_little_endian_bytes_and_back() {
        let v = [1.5f32, -0.0, f32::MAX, 3.25e-7];
        let want: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(f32_le_bytes(&v), want);
        // A trailing partial value is ignored, and an unaligned start is fine.
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&want);
        shifted.push(7);
        assert_eq!(le_bytes_to_f32(&shifted[1..]), v);
        let w = [2.0f64.sqrt(), -1e300];
        assert_eq!(le_bytes_to_f64(&f64_le_bytes(&w)), w);
    }
}
