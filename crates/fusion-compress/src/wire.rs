//! The compressed-tensor message: self-describing bytes that travel as a tensor's payload.
//!
//! ```text
//! 0      magic 0xC5
//! 1      format version (1)
//! 2      kind: 0 dense, 1 sparse, 2 int8 blocks
//! 3      value type: 0 f32, 1 f16, 2 bf16, 3 i8
//! 4..12  n, elements of the dense tensor (u64 LE)
//! dense:  n values
//! sparse: k (u64 LE), index encoding (u8: 0 absolute u32, 1 delta varint, 2 bitmap),
//!         index bytes (u64 LE) and the indices, then k values
//! int8:   block (u32 LE), ceil(n / block) f32 scales, then n i8 values (value = q * scale)
//! ```
//!
//! Values of type i8 in a dense or sparse message are written as ceil(count / 256) f32 scales
//! followed by count i8 values, one scale per run of 256 values.
//!
//! The encoder picks the cheapest index encoding per message. The decoder trusts nothing: it
//! checks every length against the bytes present and the element count the receiver expects,
//! that k ≤ n, that indices are strictly increasing (so in range and without duplicates) and as
//! many as announced, that no bytes trail, and that every value and scale is finite.

use crate::error::{malformed, CompressError, Result};
use crate::values::{push_int8, push_values, read_int8, read_values};
use serde::{Deserialize, Serialize};

pub const MAGIC: u8 = 0xC5;
pub const FORMAT_VERSION: u8 = 1;
const HEADER: usize = 12;

/// Precision of the values a message carries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ValueType {
    #[default]
    F32,
    F16,
    Bf16,
    /// Int8 with an f32 scale per [`I8_RUN`] values (about 1.02 bytes a value).
    I8,
}

/// Values of type i8 share one scale per this many.
pub const I8_RUN: usize = 256;

impl ValueType {
    /// Bytes of `count` values of this type.
    pub fn bytes(self, count: usize) -> usize {
        match self {
            ValueType::F32 => 4 * count,
            ValueType::F16 | ValueType::Bf16 => 2 * count,
            ValueType::I8 => 4 * count.div_ceil(I8_RUN) + count,
        }
    }

    fn tag(self) -> u8 {
        match self {
            ValueType::F32 => 0,
            ValueType::F16 => 1,
            ValueType::Bf16 => 2,
            ValueType::I8 => I8_TAG,
        }
    }

    fn from_tag(t: u8) -> Result<Self> {
        match t {
            0 => Ok(ValueType::F32),
            1 => Ok(ValueType::F16),
            2 => Ok(ValueType::Bf16),
            I8_TAG => Ok(ValueType::I8),
            _ => malformed(format!("unknown value type {t}")),
        }
    }

    /// Parses `f32`, `f16`, `bf16` or `i8`.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(ValueType::F32),
            "f16" => Ok(ValueType::F16),
            "bf16" => Ok(ValueType::Bf16),
            "i8" | "int8" => Ok(ValueType::I8),
            _ => Err(format!("unknown value type '{s}' (f32, f16, bf16, i8)")),
        }
    }
}

/// How the indices of a sparse message are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexEncoding {
    /// 4 bytes per index.
    Absolute,
    /// LEB128 varint of each gap minus one (the first index as is).
    DeltaVarint,
    /// One bit per element.
    Bitmap,
}

const I8_TAG: u8 = 3;
const KIND_DENSE: u8 = 0;
const KIND_SPARSE: u8 = 1;
const KIND_INT8: u8 = 2;

fn header(out: &mut Vec<u8>, kind: u8, values: u8, n: usize) {
    out.extend_from_slice(&[MAGIC, FORMAT_VERSION, kind, values]);
    out.extend_from_slice(&(n as u64).to_le_bytes());
}

/// A dense message of `x` at precision `t`.
pub fn encode_dense(x: &[f32], t: ValueType) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + t.bytes(x.len()));
    header(&mut out, KIND_DENSE, t.tag(), x.len());
    push_values(&mut out, x, t);
    out
}

/// Bytes of `v` as a LEB128 varint (7 bits a byte), without a branch.
fn varint_len(v: u32) -> usize {
    let bits = 32 - (v | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

/// `v` as a LEB128 varint in the low [`varint_len`] bytes of a little-endian u64: each 7-bit
/// group in its own byte, the continuation bit set on all but the last.
fn varint_bytes(v: u32) -> u64 {
    let v = v as u64;
    let spread = (v & 0x7f)
        | ((v >> 7) & 0x7f) << 8
        | ((v >> 14) & 0x7f) << 16
        | ((v >> 21) & 0x7f) << 24
        | (v >> 28) << 32;
    let continued = (1u64 << (8 * (varint_len(v as u32) - 1))) - 1;
    spread | (0x80_8080_8080 & continued)
}

fn gaps(indices: &[u32]) -> impl Iterator<Item = u32> + '_ {
    indices
        .iter()
        .enumerate()
        .map(move |(j, &i)| if j == 0 { i } else { i - indices[j - 1] - 1 })
}

/// Bytes each index encoding needs for ascending `indices` of `n` elements.
pub fn index_sizes(indices: &[u32], n: usize) -> [(IndexEncoding, usize); 3] {
    [
        (IndexEncoding::Absolute, 4 * indices.len()),
        (
            IndexEncoding::DeltaVarint,
            gaps(indices).map(varint_len).sum(),
        ),
        (IndexEncoding::Bitmap, n.div_ceil(8)),
    ]
}

/// A sparse message of `x` keeping `indices` (ascending, distinct, below `x.len()`), values at
/// precision `t`, indices in the cheapest encoding.
pub fn encode_sparse(x: &[f32], indices: &[u32], t: ValueType) -> Vec<u8> {
    let values: Vec<f32> = indices.iter().map(|&i| x[i as usize]).collect();
    encode_sparse_values(x.len(), indices, &values, t)
}

/// A sparse message of a tensor of `n` values that keeps `values` at `indices` (ascending,
/// distinct, below `n`, as many as the values).
pub fn encode_sparse_values(n: usize, indices: &[u32], values: &[f32], t: ValueType) -> Vec<u8> {
    // A mismatch is a bug in the caller; failing here beats a message every receiver refuses.
    assert_eq!(indices.len(), values.len(), "one value per index");
    let (enc, len) = index_sizes(indices, n)
        .into_iter()
        .min_by_key(|&(_, l)| l)
        .unwrap_or((IndexEncoding::Absolute, 0));
    let mut out = Vec::with_capacity(HEADER + 17 + len + t.bytes(indices.len()));
    header(&mut out, KIND_SPARSE, t.tag(), n);
    out.extend_from_slice(&(indices.len() as u64).to_le_bytes());
    out.push(match enc {
        IndexEncoding::Absolute => 0,
        IndexEncoding::DeltaVarint => 1,
        IndexEncoding::Bitmap => 2,
    });
    out.extend_from_slice(&(len as u64).to_le_bytes());
    match enc {
        IndexEncoding::Absolute => indices
            .iter()
            .for_each(|i| out.extend_from_slice(&i.to_le_bytes())),
        IndexEncoding::DeltaVarint => {
            // Eight bytes written per gap, the cursor moved by its length: no branch per byte.
            let start = out.len();
            out.resize(start + len + 8, 0);
            let buf = &mut out[start..];
            let mut at = 0;
            for g in gaps(indices) {
                buf[at..at + 8].copy_from_slice(&varint_bytes(g).to_le_bytes());
                at += varint_len(g);
            }
            out.truncate(start + len);
        }
        IndexEncoding::Bitmap => {
            let start = out.len();
            out.resize(start + len, 0);
            for &i in indices {
                out[start + i as usize / 8] |= 1 << (i % 8);
            }
        }
    }
    push_values(&mut out, values, t);
    out
}

/// Int8 quantisation with one f32 scale per block of `block` values (scale = max |x| / 127).
pub fn encode_int8(x: &[f32], block: usize) -> Vec<u8> {
    let block = block.max(1);
    let blocks = x.len().div_ceil(block);
    let mut out = Vec::with_capacity(HEADER + 4 + 4 * blocks + x.len());
    header(&mut out, KIND_INT8, I8_TAG, x.len());
    out.extend_from_slice(&(block as u32).to_le_bytes());
    push_int8(&mut out, x, block);
    out
}

/// Reads a little-endian field, refusing to run past the message.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(len).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return malformed(format!(
                "{what} needs {len} bytes at offset {}, the message has {}",
                self.at,
                self.bytes.len()
            ));
        };
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().map_err(|_| {
            CompressError::Malformed(format!("{what}: short field"))
        })?))
    }

    fn rest(&self) -> usize {
        self.bytes.len() - self.at
    }
}

/// `count` values of type `t` (the caller has checked `bytes` holds exactly that many).
fn read_indices(enc: u8, bytes: &[u8], k: usize, n: usize) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(k);
    match enc {
        0 => {
            if bytes.len() != 4 * k {
                return malformed(format!(
                    "{} bytes of absolute indices for k = {k}",
                    bytes.len()
                ));
            }
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        1 => {
            let mut prev: Option<u64> = None;
            let mut at = 0;
            while at < bytes.len() {
                let (mut g, mut shift) = (0u64, 0u32);
                loop {
                    let Some(&b) = bytes.get(at) else {
                        return malformed("a delta-varint index runs past its bytes");
                    };
                    at += 1;
                    if shift >= 35 {
                        return malformed("a delta-varint index is longer than 5 bytes");
                    }
                    g |= u64::from(b & 0x7f) << shift;
                    shift += 7;
                    if b & 0x80 == 0 {
                        break;
                    }
                }
                let i = match prev {
                    None => g,
                    Some(p) => p + g + 1,
                };
                if i >= n as u64 {
                    return malformed(format!("index {i} is out of range for {n} elements"));
                }
                if out.len() == k {
                    return malformed(format!("more than k = {k} delta-varint indices"));
                }
                out.push(i as u32);
                prev = Some(i);
            }
        }
        2 => {
            if bytes.len() != n.div_ceil(8) {
                return malformed(format!(
                    "a bitmap of {} bytes for {n} elements",
                    bytes.len()
                ));
            }
            for (byte, &b) in bytes.iter().enumerate() {
                let mut b = b;
                while b != 0 {
                    let i = byte * 8 + b.trailing_zeros() as usize;
                    if i >= n {
                        return malformed(format!("bitmap bit {i} is beyond {n} elements"));
                    }
                    if out.len() == k {
                        return malformed(format!("the bitmap has more than k = {k} bits set"));
                    }
                    out.push(i as u32);
                    b &= b - 1;
                }
            }
        }
        e => return malformed(format!("unknown index encoding {e}")),
    }
    if out.len() != k {
        return malformed(format!("{} indices for k = {k}", out.len()));
    }
    if let Some(w) = out.windows(2).find(|w| w[0] >= w[1]) {
        return malformed(format!(
            "indices must strictly increase (duplicate or out of order: {} then {})",
            w[0], w[1]
        ));
    }
    if let Some(&last) = out.last() {
        if last as usize >= n {
            return malformed(format!("index {last} is out of range for {n} elements"));
        }
    }
    Ok(out)
}

/// What a message holds, for reporting (bytes on the wire vs dense f32).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MessageInfo {
    pub n: usize,
    /// Elements with a value on the wire (k for sparse, n otherwise).
    pub kept: usize,
}

/// Decodes a message into the dense tensor of `expected` elements (absent elements are zero).
pub fn decode(bytes: &[u8], expected: usize) -> Result<Vec<f32>> {
    decode_with_info(bytes, expected).map(|(v, _)| v)
}

/// [`decode`], also saying how many elements the message carried.
pub fn decode_with_info(bytes: &[u8], expected: usize) -> Result<(Vec<f32>, MessageInfo)> {
    let mut r = Reader { bytes, at: 0 };
    let h = r.take(4, "the header")?;
    if h[0] != MAGIC {
        return malformed(format!(
            "bad magic byte {:#04x} (expected {MAGIC:#04x})",
            h[0]
        ));
    }
    if h[1] != FORMAT_VERSION {
        return malformed(format!(
            "format version {} is not supported (this node reads {FORMAT_VERSION})",
            h[1]
        ));
    }
    let (kind, vt) = (h[2], h[3]);
    let n = r.u64("the element count")?;
    if n != expected as u64 {
        return malformed(format!(
            "{n} elements announced, the receiver expects {expected}"
        ));
    }
    let n = expected;
    match kind {
        KIND_DENSE => {
            let t = ValueType::from_tag(vt)?;
            if r.rest() != t.bytes(n) {
                return malformed(format!(
                    "a dense message of {n} values needs {} bytes, has {}",
                    t.bytes(n),
                    r.rest()
                ));
            }
            let v = read_values(r.take(t.bytes(n), "values")?, t, n)?;
            Ok((v, MessageInfo { n, kept: n }))
        }
        KIND_SPARSE => {
            let t = ValueType::from_tag(vt)?;
            let k = r.u64("k")?;
            if k > n as u64 {
                return malformed(format!("k = {k} exceeds the {n} elements"));
            }
            let k = k as usize;
            let enc = r.take(1, "the index encoding")?[0];
            let len = r.u64("the index length")?;
            if len > r.rest() as u64 {
                return malformed(format!(
                    "{len} index bytes announced, {} bytes left",
                    r.rest()
                ));
            }
            let idx = read_indices(enc, r.take(len as usize, "indices")?, k, n)?;
            if r.rest() != t.bytes(k) {
                return malformed(format!(
                    "{k} values need {} bytes, the message has {} left",
                    t.bytes(k),
                    r.rest()
                ));
            }
            let vals = read_values(r.take(t.bytes(k), "values")?, t, k)?;
            let mut dense = vec![0.0f32; n];
            for (&i, v) in idx.iter().zip(vals) {
                dense[i as usize] = v;
            }
            Ok((dense, MessageInfo { n, kept: k }))
        }
        KIND_INT8 => {
            if vt != I8_TAG {
                return malformed(format!("an int8 message with value type {vt}"));
            }
            let block = u32::from_le_bytes(
                r.take(4, "the block size")?
                    .try_into()
                    .map_err(|_| CompressError::Malformed("block size".into()))?,
            ) as usize;
            if block == 0 {
                return malformed("int8 block size 0");
            }
            let rest = r.take(r.rest(), "int8 values")?;
            let v = read_int8(rest, n, block)?;
            Ok((v, MessageInfo { n, kept: n }))
        }
        k => malformed(format!("unknown message kind {k}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn x() -> Vec<f32> {
        (0..1000).map(|i| ((i * 37) % 101) as f32 - 50.0).collect()
    }

    #[test]
    fn dense_and_full_sparse_round_trips_are_exact() {
        let x = x();
        assert_eq!(
            decode(&encode_dense(&x, ValueType::F32), 1000),
            Ok(x.clone())
        );
        let all: Vec<u32> = (0..1000).collect();
        let m = encode_sparse(&x, &all, ValueType::F32);
        assert_eq!(decode(&m, 1000), Ok(x.clone()));
        // Integers this small are exact in f16 and bf16 too.
        assert_eq!(
            decode(&encode_dense(&x, ValueType::F16), 1000),
            Ok(x.clone())
        );
        assert_eq!(
            decode(&encode_sparse(&x, &all, ValueType::Bf16), 1000),
            Ok(x)
        );
    }

    #[test]
    fn every_index_encoding_round_trips_and_the_cheapest_is_chosen() {
        let x: Vec<f32> = (0..4096).map(|i| i as f32 + 1.0).collect();
        for idx in [
            vec![0u32, 5, 4095],                        // few, far apart: varint
            (0..4096).step_by(2).collect::<Vec<u32>>(), // dense: bitmap
            vec![0, 1 << 11, 4000],
        ] {
            let m = encode_sparse(&x, &idx, ValueType::F32);
            let d = decode(&m, 4096).expect("valid");
            for (i, v) in d.iter().enumerate() {
                let kept = idx.binary_search(&(i as u32)).is_ok();
                assert_eq!(*v, if kept { x[i] } else { 0.0 });
            }
            let best = index_sizes(&idx, 4096)
                .iter()
                .map(|s| s.1)
                .min()
                .unwrap_or(0);
            assert_eq!(m.len(), 12 + 8 + 1 + 8 + best + 4 * idx.len());
        }
        // Absolute is cheapest for a lone index far out (a 5-byte varint, a 64 MB bitmap).
        let sizes = index_sizes(&[(1 << 29) - 1], 1 << 29);
        let best = sizes.iter().min_by_key(|s| s.1).expect("three");
        assert_eq!(*best, (IndexEncoding::Absolute, 4));
    }

    #[test]
    fn varints_match_the_byte_at_a_time_encoding_at_every_length_boundary() {
        for v in [
            0u32,
            1,
            127,
            128,
            16_383,
            16_384,
            (1 << 21) - 1,
            1 << 21,
            (1 << 28) - 1,
            1 << 28,
            u32::MAX,
        ] {
            let mut want = Vec::new();
            let mut g = v;
            while g >= 0x80 {
                want.push((g as u8 & 0x7f) | 0x80);
                g >>= 7;
            }
            want.push(g as u8);
            let len = varint_len(v);
            assert_eq!(len, want.len(), "{v}");
            assert_eq!(&varint_bytes(v).to_le_bytes()[..len], &want[..], "{v}");
        }
    }

    #[test]
    fn f16_saturates_instead_of_sending_infinity() {
        let m = encode_dense(&[1e6, -1e6, 1.0], ValueType::F16);
        assert_eq!(decode(&m, 3), Ok(vec![65504.0, -65504.0, 1.0]));
    }

    #[test]
    fn int8_error_is_within_half_a_step_per_block() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let d = decode(&encode_int8(&x, 64), 1000).expect("valid");
        for (c, dc) in x.chunks(64).zip(d.chunks(64)) {
            let step = c.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
            for (a, b) in c.iter().zip(dc) {
                assert!((a - b).abs() <= 0.5 * step + 1e-6);
            }
        }
        assert_eq!(decode(&encode_int8(&[0.0; 5], 2), 5), Ok(vec![0.0; 5]));
    }

    #[test]
    fn i8_values_round_trip_within_half_a_step_per_run_of_256() {
        let x: Vec<f32> = (0..3000).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
        let idx: Vec<u32> = (0..3000).step_by(3).collect();
        let m = encode_sparse(&x, &idx, ValueType::I8);
        assert_eq!(m.len(), 12 + 17 + 375 + ValueType::I8.bytes(1000));
        let d = decode(&m, 3000).expect("valid");
        let kept: Vec<f32> = idx.iter().map(|&i| x[i as usize]).collect();
        for (run, start) in kept.chunks(I8_RUN).zip((0..).step_by(I8_RUN)) {
            let step = run.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
            for (j, v) in run.iter().enumerate() {
                let i = idx[start + j] as usize;
                assert!((d[i] - v).abs() <= 0.5 * step + 1e-6);
            }
        }
        assert!(idx.iter().all(|&i| d[i as usize + 1] == 0.0));
        let dense = decode(&encode_dense(&x, ValueType::I8), 3000).expect("valid");
        assert!(dense
            .iter()
            .zip(&x)
            .all(|(a, b)| (a - b).abs() <= 3.0 / 254.0 + 1e-6));
        // A negative scale in the values of a sparse message.
        let mut bad = m.clone();
        bad[12 + 17 + 375..12 + 17 + 379].copy_from_slice(&(-1.0f32).to_le_bytes());
        refused(&bad, 3000, "negative");
    }

    fn refused(m: &[u8], n: usize, why: &str) {
        match decode(m, n) {
            Err(CompressError::Malformed(msg)) => assert!(msg.contains(why), "{msg} lacks {why}"),
            other => panic!("accepted a malformed message ({why}): {other:?}"),
        }
    }

    #[test]
    fn malformed_messages_are_rejected_with_the_reason() {
        let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let idx = [3u32, 9, 40];
        let good = encode_sparse(&x, &idx, ValueType::F32);
        assert!(decode(&good, 64).is_ok());
        refused(&good[..3], 64, "header");
        refused(&good[..5], 64, "element count");
        refused(&good, 65, "expects 65");
        let mut m = good.clone();
        m[0] = 0;
        refused(&m, 64, "magic");
        let mut m = good.clone();
        m[1] = 9;
        refused(&m, 64, "version 9");
        let mut m = good.clone();
        m[2] = 7;
        refused(&m, 64, "kind");
        let mut m = good.clone();
        m[3] = 9;
        refused(&m, 64, "value type 9");
        // Announced as i8 values, sized as f32.
        let mut m = good.clone();
        m[3] = I8_TAG;
        refused(&m, 64, "values need");
        // k above n.
        let mut m = good.clone();
        m[12..20].copy_from_slice(&100u64.to_le_bytes());
        refused(&m, 64, "exceeds");
        // k disagreeing with the indices.
        let mut m = good.clone();
        m[12..20].copy_from_slice(&2u64.to_le_bytes());
        refused(&m, 64, "more than k = 2");
        // Trailing bytes.
        let mut m = good.clone();
        m.push(0);
        refused(&m, 64, "values need");
        // Index length past the end.
        let mut m = good.clone();
        m[21..29].copy_from_slice(&1000u64.to_le_bytes());
        refused(&m, 64, "index bytes announced");
        // Absolute indices: a duplicate, and one out of range.
        let abs = |ix: [u32; 3]| {
            let mut m = Vec::new();
            header(&mut m, KIND_SPARSE, 0, 64);
            m.extend_from_slice(&3u64.to_le_bytes());
            m.push(0);
            m.extend_from_slice(&12u64.to_le_bytes());
            ix.iter()
                .for_each(|i| m.extend_from_slice(&i.to_le_bytes()));
            m.extend_from_slice(&[0u8; 12]);
            m
        };
        assert!(decode(&abs([1, 2, 3]), 64).is_ok());
        refused(&abs([1, 2, 2]), 64, "strictly increase");
        refused(&abs([1, 2, 64]), 64, "out of range");
        // Varint: an index past n, an unterminated varint.
        let var = |bytes: &[u8], k: u64| {
            let mut m = Vec::new();
            header(&mut m, KIND_SPARSE, 0, 64);
            m.extend_from_slice(&k.to_le_bytes());
            m.push(1);
            m.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            m.extend_from_slice(bytes);
            m.extend_from_slice(&vec![0u8; 4 * k as usize]);
            m
        };
        assert!(decode(&var(&[3, 5], 2), 64).is_ok());
        refused(&var(&[3, 70], 2), 64, "out of range");
        refused(&var(&[0x83], 1), 64, "runs past");
        refused(
            &var(&[0xff, 0xff, 0xff, 0xff, 0xff, 0x01], 1),
            64,
            "longer than 5",
        );
        // Bitmap: a bit beyond n, too many bits.
        let bits = |b: &[u8], n: u64, k: u64| {
            let mut m = Vec::new();
            header(&mut m, KIND_SPARSE, 0, n as usize);
            m.extend_from_slice(&k.to_le_bytes());
            m.push(2);
            m.extend_from_slice(&(b.len() as u64).to_le_bytes());
            m.extend_from_slice(b);
            m.extend_from_slice(&vec![0u8; 4 * k as usize]);
            m
        };
        assert!(decode(&bits(&[0b101], 3, 2), 3).is_ok());
        refused(&bits(&[0b1001], 3, 2), 3, "beyond 3");
        refused(&bits(&[0b111], 3, 2), 3, "more than k = 2");
        // Non-finite values and negative scales.
        refused(
            &encode_dense(&[1.0, f32::NAN], ValueType::F32),
            2,
            "not finite",
        );
        let mut q = encode_int8(&[1.0, 2.0], 2);
        q[16..20].copy_from_slice(&(-1.0f32).to_le_bytes());
        refused(&q, 2, "negative");
        // A finite scale so large that 127 · scale is infinite: refused, never ±inf values.
        let mut q = encode_int8(&[1.0, 2.0], 2);
        q[16..20].copy_from_slice(&(f32::MAX / 64.0).to_le_bytes());
        refused(&q, 2, "overflows");
        q[16..20].copy_from_slice(&(f32::MAX / 128.0).to_le_bytes());
        let v = decode(&q, 2).expect("the largest scale that cannot overflow");
        assert!(v.iter().all(|x| x.is_finite()), "{v:?}");
        let mut q = encode_int8(&[1.0, 2.0], 2);
        q[12..16].copy_from_slice(&0u32.to_le_bytes());
        refused(&q, 2, "block size 0");
    }
}
