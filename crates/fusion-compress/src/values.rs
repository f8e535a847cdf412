//! The value arrays of a message: f32, f16, bf16 or i8 (an f32 scale per run) in little-endian
//! bytes, and back.
//!
//! These loops touch every byte of a dense message, so they are written to vectorise: casts go
//! through `half`'s slice conversions (F16C where the processor has it), chunk by chunk so the
//! staging buffers stay in L1, and the int8 loops are compiled for AVX2 as well as the baseline,
//! picked at run time.

use crate::error::{malformed, Result};
use crate::wire::{ValueType, I8_RUN};
use half::{bf16, f16, slice::HalfFloatSliceExt};

/// Values converted at a time through the staging buffers.
const CHUNK: usize = 1024;

/// Appends `vals` at precision `t`.
pub(crate) fn push_values(out: &mut Vec<u8>, vals: &[f32], t: ValueType) {
    match t {
        ValueType::F32 => {
            let start = out.len();
            out.resize(start + 4 * vals.len(), 0);
            for (d, v) in out[start..].chunks_exact_mut(4).zip(vals) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
        // Saturate: a value beyond the type's range must not arrive as infinity.
        ValueType::F16 => push_half(out, vals, f16::MAX.to_f32(), f16::ZERO, f16::to_le_bytes),
        ValueType::Bf16 => push_half(out, vals, bf16::MAX.to_f32(), bf16::ZERO, bf16::to_le_bytes),
        ValueType::I8 => push_int8(out, vals, I8_RUN),
    }
}

/// Appends `vals` clamped to ±`max` as 16-bit floats of type `H`.
fn push_half<H>(out: &mut Vec<u8>, vals: &[f32], max: f32, zero: H, le: fn(H) -> [u8; 2])
where
    H: Copy,
    [H]: HalfFloatSliceExt,
{
    let start = out.len();
    out.resize(start + 2 * vals.len(), 0);
    let mut clamped = [0f32; CHUNK];
    let mut half = [zero; CHUNK];
    for (src, dst) in vals.chunks(CHUNK).zip(out[start..].chunks_mut(2 * CHUNK)) {
        let n = src.len();
        for (c, &v) in clamped.iter_mut().zip(src) {
            *c = v.clamp(-max, max);
        }
        half[..n].convert_from_f32_slice(&clamped[..n]);
        for (d, &h) in dst.chunks_exact_mut(2).zip(&half[..n]) {
            d.copy_from_slice(&le(h));
        }
    }
}

/// Appends one f32 scale (max |v| / 127) per run of `run` values, then the values as i8.
///
/// A NaN makes its run's scale NaN, so the receiver refuses the message instead of taking a
/// silently zeroed run.
pub(crate) fn push_int8(out: &mut Vec<u8>, x: &[f32], run: usize) {
    let run = run.max(1);
    let scales: Vec<f32> = x.chunks(run).map(|c| max_magnitude(c) / 127.0).collect();
    let start = out.len();
    out.resize(start + 4 * scales.len() + x.len(), 0);
    let (scale_bytes, q) = out[start..].split_at_mut(4 * scales.len());
    for (d, s) in scale_bytes.chunks_exact_mut(4).zip(&scales) {
        d.copy_from_slice(&s.to_le_bytes());
    }
    for ((c, d), &s) in x.chunks(run).zip(q.chunks_mut(run)).zip(&scales) {
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        quantise(c, inv, d);
    }
}

/// The largest |v| of `x` (NaN above infinity), compared as integers so that it vectorises.
#[multiversion::multiversion(targets("x86_64+avx2", "aarch64+neon"))]
fn max_magnitude(x: &[f32]) -> f32 {
    f32::from_bits(x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff)))
}

/// `round(v · inv)` as i8 bytes. Adding 1.5 · 2^23 leaves the rounded integer in the low bits
/// of the float (the spacing of floats there is exactly 1), whose low byte is the two's-complement
/// i8: unlike `as i32`, whose NaN and saturation rules keep it scalar, this vectorises.
#[multiversion::multiversion(targets("x86_64+avx2", "aarch64+neon"))]
fn quantise(x: &[f32], inv: f32, out: &mut [u8]) {
    const ROUND: f32 = 12_582_912.0;
    for (d, &v) in out.iter_mut().zip(x) {
        *d = ((v * inv).clamp(-127.0, 127.0) + ROUND).to_bits() as u8;
    }
}

/// `q · scale` for i8 bytes `q`.
#[multiversion::multiversion(targets("x86_64+avx2", "aarch64+neon"))]
fn dequantise(q: &[u8], scale: f32, out: &mut [f32]) {
    for (d, &b) in out.iter_mut().zip(q) {
        *d = b as i8 as f32 * scale;
    }
}

/// Reads `count` values of type `t` from exactly their bytes, refusing any that is not finite.
pub(crate) fn read_values(bytes: &[u8], t: ValueType, count: usize) -> Result<Vec<f32>> {
    let vals: Vec<f32> = match t {
        ValueType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        ValueType::F16 => read_half(bytes, f16::ZERO, f16::from_le_bytes),
        ValueType::Bf16 => read_half(bytes, bf16::ZERO, bf16::from_le_bytes),
        ValueType::I8 => read_int8(bytes, count, I8_RUN)?,
    };
    if !all_finite(&vals) {
        let i = vals.iter().position(|v| !v.is_finite()).unwrap_or(0);
        return malformed(format!("value {i} is not finite"));
    }
    Ok(vals)
}

/// Whether no value is NaN or infinite: one pass without an early exit, so that it vectorises.
#[multiversion::multiversion(targets("x86_64+avx2", "aarch64+neon"))]
fn all_finite(x: &[f32]) -> bool {
    x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff)) < f32::INFINITY.to_bits()
}

/// 16-bit floats of type `H` from little-endian bytes.
fn read_half<H>(bytes: &[u8], zero: H, from_le: fn([u8; 2]) -> H) -> Vec<f32>
where
    H: Copy,
    [H]: HalfFloatSliceExt,
{
    let mut out = vec![0f32; bytes.len() / 2];
    let mut half = [zero; CHUNK];
    for (src, dst) in bytes.chunks(2 * CHUNK).zip(out.chunks_mut(CHUNK)) {
        let n = dst.len();
        for (h, b) in half.iter_mut().zip(src.chunks_exact(2)) {
            *h = from_le([b[0], b[1]]);
        }
        half[..n].convert_to_f32_slice(dst);
    }
    out
}

/// Reads what [`push_int8`] wrote for `count` values.
pub(crate) fn read_int8(bytes: &[u8], count: usize, run: usize) -> Result<Vec<f32>> {
    let runs = count.div_ceil(run);
    if bytes.len() != 4 * runs + count {
        return malformed(format!(
            "int8: {runs} scales and {count} values need {} bytes, have {}",
            4 * runs + count,
            bytes.len()
        ));
    }
    let (scale_bytes, q) = bytes.split_at(4 * runs);
    let scales = read_values(scale_bytes, ValueType::F32, runs)?;
    if let Some(b) = scales.iter().position(|s| *s < 0.0) {
        return malformed(format!("int8 scale {b} is negative"));
    }
    // Larger scales overflow to infinity for some quantised value (|q| is at most 128).
    if let Some(b) = scales
        .iter()
        .position(|s| !s.is_finite() || s.abs() > f32::MAX / 128.0)
    {
        return malformed(format!(
            "int8 scale {b} ({}) overflows when dequantised",
            scales[b]
        ));
    }
    let mut out = vec![0f32; count];
    for ((c, d), &s) in q.chunks(run).zip(out.chunks_mut(run)).zip(&scales) {
        dequantise(c, s, d);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Longer than a chunk, not a multiple of one, with values beyond f16's range.
    fn x() -> Vec<f32> {
        (0..2 * CHUNK + 77)
            .map(|i| ((i as f32) * 0.731).sin() * 10f32.powi(i as i32 % 8 - 2))
            .collect()
    }

    #[test]
    fn casts_match_the_scalar_conversion_across_chunks() {
        let x = x();
        for t in [ValueType::F32, ValueType::F16, ValueType::Bf16] {
            let mut out = vec![0xAB]; // something before the values must stay
            push_values(&mut out, &x, t);
            assert_eq!(out[0], 0xAB);
            assert_eq!(out.len(), 1 + t.bytes(x.len()));
            let back = read_values(&out[1..], t, x.len()).expect("finite");
            for (a, b) in x.iter().zip(&back) {
                let want = match t {
                    ValueType::F32 => *a,
                    ValueType::F16 => f16::from_f32(a.clamp(-65504.0, 65504.0)).to_f32(),
                    _ => bf16::from_f32(*a).to_f32(),
                };
                assert_eq!(*b, want, "{t:?} {a}");
            }
        }
    }

    #[test]
    fn int8_rounds_to_the_nearest_step_and_a_nan_poisons_its_run() {
        let x: Vec<f32> = (0..600).map(|i| (i as f32 - 300.0) * 0.01).collect();
        let mut out = Vec::new();
        push_int8(&mut out, &x, 256);
        let back = read_int8(&out, x.len(), 256).expect("valid");
        for (run, b) in x.chunks(256).zip(back.chunks(256)) {
            let step = run.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (v, w) in run.iter().zip(b) {
                assert!((v - w).abs() <= 0.5 * step * (1.0 + 1e-5), "{v} {w}");
            }
        }
        let mut y = x.clone();
        y[300] = f32::NAN;
        let mut out = Vec::new();
        push_int8(&mut out, &y, 256);
        let err = read_int8(&out, y.len(), 256).expect_err("NaN scale");
        assert!(err.to_string().contains("not finite"), "{err}");
    }

    #[test]
    fn a_value_that_is_not_finite_is_named() {
        let mut out = Vec::new();
        push_values(&mut out, &[1.0, 2.0, f32::INFINITY, 3.0], ValueType::F32);
        let err = read_values(&out, ValueType::F32, 4).expect_err("infinite");
        assert!(err.to_string().contains("value 2 is not finite"), "{err}");
    }
}
