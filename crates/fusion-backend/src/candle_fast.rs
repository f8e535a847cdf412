//! Multi-threaded element-wise kernels for large contiguous `f32` tensors on the CPU.
//!
//! candle runs unary maps, affine maps and scatters on one thread and allocates through several
//! intermediate copies; on a softmax over a 50257-token vocabulary those passes cost more than the
//! matrix products. These kernels read the tensor's storage in place and write one new buffer in
//! parallel. Anything else (other dtypes, strided layouts, CUDA, small tensors) returns `None`
//! and takes candle's path.

use crate::scalar::{GELU_A, GELU_C};
use crate::simd::dispatch;
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

/// Applies `f` to every element in parallel; generic so each op's loop is inlined, and written
/// over plain slice pairs so the compiler vectorises it.
fn map(a: &Tensor, f: impl Fn(f32) -> f32 + Sync + Send) -> Option<Tensor> {
    let out = with_slice(a, |s| {
        let mut out = vec![0f32; s.len()];
        out.par_chunks_mut(GRAIN)
            .zip(s.par_chunks(GRAIN))
            .for_each(|(o, x)| {
                dispatch(
                    #[inline(always)]
                    || {
                        for (o, &x) in o.iter_mut().zip(x) {
                            *o = f(x);
                        }
                    },
                )
            });
        out
    })?;
    finish(out, a)
}

pub(crate) fn unary(op: UnaryOp, a: &Tensor) -> Option<Tensor> {
    match op {
        UnaryOp::Exp => map(a, fast_exp),
        UnaryOp::Neg => map(a, |x| -x),
        UnaryOp::Square => map(a, |x| x * x),
        UnaryOp::Recip => map(a, |x| 1.0 / x),
        UnaryOp::Relu => map(a, |x| x.max(0.0)),
        UnaryOp::ReluMask => map(a, |x| if x > 0.0 { 1.0 } else { 0.0 }),
        UnaryOp::Gelu => map(a, |x| 0.5 * x * (1.0 + fast_tanh(gelu_inner(x)))),
        UnaryOp::GeluGrad => map(a, gelu_grad),
        other => map(a, move |x| crate::scalar::unary(other, x)),
    }
}

/// The derivative of the tanh-approximated GELU at `x`.
#[inline(always)]
fn gelu_grad(x: f32) -> f32 {
    let t = fast_tanh(gelu_inner(x));
    let du = GELU_C as f32 * (1.0 + 3.0 * GELU_A as f32 * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
}

/// `dy * gelu'(x)` in one pass (the same bits as the derivative's map followed by the product,
/// without the derivative's tensor), for same-shaped contiguous tensors.
pub(crate) fn gelu_backward(x: &Tensor, dy: &Tensor) -> Option<Tensor> {
    if x.dims() != dy.dims() {
        return None;
    }
    let out = with_slice(x, |xs| {
        with_slice(dy, |gs| {
            let mut out = vec![0f32; xs.len()];
            out.par_chunks_mut(GRAIN)
                .zip(xs.par_chunks(GRAIN).zip(gs.par_chunks(GRAIN)))
                .for_each(|(o, (x, g))| {
                    dispatch(
                        #[inline(always)]
                        || {
                            for ((o, &x), &g) in o.iter_mut().zip(x).zip(g) {
                                *o = g * gelu_grad(x);
                            }
                        },
                    )
                });
            out
        })
    })??;
    finish(out, x)
}

#[inline(always)]
fn gelu_inner(x: f32) -> f32 {
    GELU_C as f32 * (x + GELU_A as f32 * x * x * x)
}

/// `tanh(u) = 1 - 2 / (e^(2u) + 1)`, vectorisable (glibc's `tanhf` is a scalar call); absolute
/// error below 1e-6.
#[inline(always)]
fn fast_tanh(u: f32) -> f32 {
    1.0 - 2.0 / (fast_exp(2.0 * u) + 1.0)
}

/// `e^x` to within about 2e-7 relative error, in a form the compiler vectorises (glibc's `expf`
/// is a scalar call and was a sixth of a small model's training step): `e^x = 2^n * e^g` with
/// `n = round(x / ln 2)` and a degree-7 polynomial for `e^g`, `|g| <= ln(2) / 2`.
#[inline(always)]
pub(crate) fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n * LN2_HI is exact (Cody-Waite reduction): LN2_HI is 0.693145751953125
    // and LN2_LO the remainder.
    const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
    const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer without a rounding
    // instruction.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let g = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + g * (1.0
            + g * (0.5
                + g * (1.0 / 6.0
                    + g * (1.0 / 24.0
                        + g * (1.0 / 120.0 + g * (1.0 / 720.0 + g * (1.0 / 5040.0)))))));
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    // Selects, not branches, so the loop stays vectorised.
    let y = if x < -87.0 { 0.0 } else { p * scale };
    let y = if x > 88.0 { f32::INFINITY } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

pub(crate) fn affine(a: &Tensor, mul: f64, add: f64) -> Option<Tensor> {
    let (m, c) = (mul as f32, add as f32);
    map(a, move |x| x * m + c)
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
/// per row), or is 1s followed by `a`'s trailing dims (a row repeated), or a single value.
pub(crate) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Option<Tensor> {
    match op {
        BinaryOp::Add => binary_with(a, b, |x, y| x + y),
        BinaryOp::Sub => binary_with(a, b, |x, y| x - y),
        BinaryOp::Mul => binary_with(a, b, |x, y| x * y),
        BinaryOp::Div => binary_with(a, b, |x, y| x / y),
    }
}

fn binary_with(
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(f32, f32) -> f32 + Sync + Send,
) -> Option<Tensor> {
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
    let b = b.contiguous().ok()?;
    let kernel = |s: &[f32], bv: &[f32]| -> Vec<f32> {
        let mut out = vec![0f32; s.len()];
        // Whole rows per task, and one dispatch per task.
        let rows_per_task = GRAIN / row.max(1) + 1;
        let span = rows_per_task * row;
        out.par_chunks_mut(span)
            .zip(s.par_chunks(span))
            .enumerate()
            .for_each(|(k, (o, x))| {
                dispatch(
                    #[inline(always)]
                    || {
                        let rows = o.chunks_mut(row).zip(x.chunks(row));
                        for (j, (o, x)) in rows.enumerate() {
                            let r = k * rows_per_task + j;
                            binary_row(pattern, r, o, x, bv, &f);
                        }
                    },
                )
            });
        out
    };
    // A large `b` (same-shape operands) is read in place; a small one is copied out.
    let out = if b.elem_count() >= PARALLEL_MIN {
        with_slice(a, |s| with_slice(&b, |bv| kernel(s, bv)))??
    } else {
        let bv: Vec<f32> = b.flatten_all().ok()?.to_vec1().ok()?;
        with_slice(a, |s| kernel(s, &bv))?
    };
    finish(out, a)
}

/// Row `r` of `a op b` (`o` from `x`) for the broadcast `pattern` of `b`'s values `bv`.
#[inline(always)]
fn binary_row(
    pattern: Pattern,
    r: usize,
    o: &mut [f32],
    x: &[f32],
    bv: &[f32],
    f: &impl Fn(f32, f32) -> f32,
) {
    match pattern {
        Pattern::Scalar => o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x, bv[0])),
        Pattern::PerRow => o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x, bv[r])),
        Pattern::Repeated => {
            let n = o.len();
            let offset = (r * n) % bv.len();
            o.iter_mut()
                .zip(x)
                .zip(&bv[offset..offset + n])
                .for_each(|((o, &x), &y)| *o = f(x, y));
        }
    }
}

/// Sums `a` over its leading dims `0..lead` (a bias or a norm's gradient: `[rows, d]` to `[d]`)
/// as column sums of the contiguous `[outer, inner]` view, instead of candle's route through a
/// transposed copy. Each column adds its rows in order, however the columns are split between
/// threads, so the bits do not depend on the thread count or the instruction set.
pub(crate) fn leading_sum(a: &Tensor, dims: &[usize]) -> Option<Tensor> {
    let lead = dims.len();
    let rank = a.rank();
    if lead == 0 || lead >= rank || (0..lead).any(|d| !dims.contains(&d)) {
        return None;
    }
    let inner: usize = a.dims()[lead..].iter().product();
    let out = with_slice(a, |s| {
        let mut out = vec![0f32; inner];
        // Column blocks of whole cache lines, a few per thread.
        let width = (inner / (4 * rayon::current_num_threads().max(1))).clamp(16, 1024) / 16 * 16;
        out.par_chunks_mut(width).enumerate().for_each(|(k, acc)| {
            let c0 = k * width;
            dispatch(
                #[inline(always)]
                || {
                    for row in s.chunks_exact(inner) {
                        let cols = &row[c0..c0 + acc.len()];
                        acc.iter_mut().zip(cols).for_each(|(a, &x)| *a += x);
                    }
                },
            )
        });
        out
    })?;
    let mut shape = a.dims().to_vec();
    shape[..lead].iter_mut().for_each(|d| *d = 1);
    Tensor::from_vec(out, shape, &Device::Cpu).ok()
}

/// Copies `x [.., t, t]` with the entries above each row's diagonal set to `fill`.
pub(crate) fn causal_fill(x: &Tensor, fill: f64) -> Option<Tensor> {
    let t = *x.dims().last()?;
    let fill = fill as f32;
    let out = with_slice(x, |s| {
        let mut out = vec![0f32; s.len()];
        out.par_chunks_mut(t)
            .zip(s.par_chunks(t))
            .enumerate()
            .with_min_len(GRAIN / t.max(1) + 1)
            .for_each(|(r, (o, src))| {
                let i = r % t;
                o[..=i].copy_from_slice(&src[..=i]);
                o[i + 1..].iter_mut().for_each(|v| *v = fill);
            });
        out
    })?;
    finish(out, x)
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

#[cfg(test)]
mod tests {
    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0.0f64;
        for i in -20_000..=20_000 {
            let x = i as f32 * 0.004;
            let want = (x as f64).exp();
            worst = worst.max(((super::fast_exp(x) as f64) - want).abs() / want);
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(super::fast_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(super::fast_exp(-100.0), 0.0);
        assert_eq!(super::fast_exp(100.0), f32::INFINITY);
        assert!(super::fast_exp(f32::NAN).is_nan());
    }

    #[test]
    fn fast_tanh_is_accurate() {
        for i in -10_000..=10_000 {
            let u = i as f32 * 0.002;
            assert!((super::fast_tanh(u) - u.tanh()).abs() < 1e-6, "tanh({u})");
        }
        assert_eq!(super::fast_tanh(100.0), 1.0);
        assert_eq!(super::fast_tanh(-100.0), -1.0);
    }
}
