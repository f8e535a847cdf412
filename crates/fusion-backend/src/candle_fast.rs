//! Multi-threaded element-wise kernels for large contiguous `f32` tensors on the CPU.
//!
//! candle runs unary maps, affine maps and scatters on one thread and allocates through several
//! intermediate copies; on a softmax over a 50257-token vocabulary those passes cost more than the
//! matrix products. These kernels read the tensor's storage in place and write one new buffer in
//! parallel. Anything else (other dtypes, strided layouts, CUDA, small tensors) returns `None`
//! and takes candle's path.

use crate::{BinaryOp, UnaryOp};
use candle_core::{CpuStorage, Device, Storage, Tensor};
use rayon::prelude::*;

/// Below this many elements threading does not pay.
const PARALLEL_MIN: usize = 1 << 16;
const GRAIN: usize = 1 << 12;

/// Runs `f` on the contiguous host `f32` elements of `t`, if it has them and is large enough.
fn with_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
    if t.elem_count() < PARALLEL_MIN || !t.is_contiguous() {
        return None;
    }
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => {
            let start = layout.start_offset();
            v.get(start..start + t.elem_count()).map(f)
        }
        _ => None,
    }
}

fn finish(out: Vec<f32>, like: &Tensor) -> Option<Tensor> {
    Tensor::from_vec(out, like.dims(), &Device::Cpu).ok()
}

const GELU_C: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044715;

fn unary_f(op: UnaryOp, x: f32) -> f32 {
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Recip => 1.0 / x,
        UnaryOp::Square => x * x,
        UnaryOp::Relu => x.max(0.0),
        UnaryOp::ReluMask => f32::from(u8::from(x > 0.0)),
        UnaryOp::Gelu => 0.5 * x * (1.0 + (GELU_C * (x + GELU_A * x * x * x)).tanh()),
        UnaryOp::GeluGrad => {
            let t = (GELU_C * (x + GELU_A * x * x * x)).tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * x * x)
        }
    }
}

fn binary_f(op: BinaryOp) -> fn(f32, f32) -> f32 {
    match op {
        BinaryOp::Add => |x, y| x + y,
        BinaryOp::Sub => |x, y| x - y,
        BinaryOp::Mul => |x, y| x * y,
        BinaryOp::Div => |x, y| x / y,
    }
}

pub(crate) fn unary(op: UnaryOp, a: &Tensor) -> Option<Tensor> {
    let out = with_slice(a, |s| {
        s.par_iter()
            .with_min_len(GRAIN)
            .map(|&x| unary_f(op, x))
            .collect()
    })?;
    finish(out, a)
}

pub(crate) fn affine(a: &Tensor, mul: f64, add: f64) -> Option<Tensor> {
    let (m, c) = (mul as f32, add as f32);
    let out = with_slice(a, |s| {
        s.par_iter()
            .with_min_len(GRAIN)
            .map(|&x| x * m + c)
            .collect()
    })?;
    finish(out, a)
}

#[derive(Clone, Copy)]
enum Pattern {
    /// `b` is a single value.
    Scalar,
    /// `b` holds one value per row of `a`'s last dimension.
    PerRow,
    /// `b` is `a`'s trailing block (a row or more), repeated.
    Repeated,
}

/// `a op b` where `b` equals `a`'s shape, or is `a`'s leading dims with a trailing 1 (one value
/// per row), or is 1s followed by `a`'s trailing dims (a row repeated).
pub(crate) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Option<Tensor> {
    let f = binary_f(op);
    let (ad, bd) = (a.dims(), b.dims());
    let rank = ad.len();
    let row = *ad.last()?;
    let lead = bd.iter().take_while(|&&d| d == 1).count();
    let pattern = if bd.iter().all(|&d| d == 1) {
        Pattern::Scalar
    } else if row > 1 && bd[rank - 1] == 1 && bd[..rank - 1] == ad[..rank - 1] {
        Pattern::PerRow
    } else if lead < rank && bd[lead..] == ad[lead..] {
        Pattern::Repeated
    } else {
        return None;
    };
    let bv: Vec<f32> = b.contiguous().ok()?.flatten_all().ok()?.to_vec1().ok()?;
    let out = with_slice(a, |s| {
        let mut out = vec![0f32; s.len()];
        let rows_per_task = GRAIN / row.max(1) + 1;
        out.par_chunks_mut(row)
            .zip(s.par_chunks(row))
            .enumerate()
            .with_min_len(rows_per_task)
            .for_each(|(r, (o, x))| match pattern {
                Pattern::Scalar => o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x, bv[0])),
                Pattern::PerRow => o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x, bv[r])),
                Pattern::Repeated => {
                    let offset = (r * row) % bv.len();
                    o.iter_mut()
                        .zip(x)
                        .zip(&bv[offset..offset + row])
                        .for_each(|((o, &x), &y)| *o = f(x, y));
                }
            });
        out
    })?;
    finish(out, a)
}

/// `x` with `value` added at `x[n, ids[n]]` (ids already validated).
pub(crate) fn add_at_last(x: &Tensor, ids: &[u32], value: f64) -> Option<Tensor> {
    let v = *x.dims().last()?;
    let mut out = with_slice(x, |s| {
        s.par_iter()
            .with_min_len(GRAIN)
            .copied()
            .collect::<Vec<f32>>()
    })?;
    for (r, &i) in ids.iter().enumerate() {
        if let Some(e) = out.get_mut(r * v + i as usize) {
            *e += value as f32;
        }
    }
    finish(out, x)
}
