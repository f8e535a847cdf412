//! Fused causal attention on the CPU: for every head, rows in blocks of [`BLOCK`], the scores of
//! a block against the keys it may see (never the masked upper triangle), an exact softmax in
//! place, and the block's output, all in a scratch buffer the size of one block of scores. Each
//! row's log-sum-exp is returned beside the output, and backward recomputes the block's
//! probabilities from it instead of reading a stored `T x T` tensor per head. Heads run in parallel; every product is one
//! `gemm` call on slices, so the kernel is generic over `f32` (training) and `f64` (gradient
//! checks of the same code).

use crate::error::{BackendError, Result};
use crate::simd::{dispatch, lanes_max, lanes_sum};
use gemm::Parallelism;
use num_traits::Float;
use rayon::prelude::*;

/// Rows per block: the scores of one block are `BLOCK x T`.
const BLOCK: usize = 64;

/// An element the kernel computes in: the `gemm` element types with an `exp` for the softmax.
pub trait Elem: Float + Send + Sync + 'static {
    fn exp_fast(self) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn exp_fast(self) -> Self {
        crate::candle_fast::fast_exp(self)
    }
}

impl Elem for f64 {
    #[inline(always)]
    fn exp_fast(self) -> Self {
        self.exp()
    }
}

/// A row-major matrix in a slice: `rows x cols` with `stride` elements between rows, read
/// transposed when `t`.
#[derive(Clone, Copy)]
struct View<'a, T> {
    data: &'a [T],
    rows: usize,
    cols: usize,
    stride: usize,
    t: bool,
}

impl<'a, T> View<'a, T> {
    fn new(data: &'a [T], rows: usize, cols: usize, stride: usize) -> Self {
        View {
            data,
            rows,
            cols,
            stride,
            t: false,
        }
    }

    fn t(self) -> Self {
        View { t: !self.t, ..self }
    }

    /// Rows and columns as read.
    fn shape(&self) -> (usize, usize) {
        if self.t {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }

    /// Whether the slice holds every element the view names.
    fn in_bounds(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.stride + self.cols <= self.data.len()
    }

    /// (column stride, row stride) as read.
    fn strides(&self) -> (isize, isize) {
        let (c, r) = (1, self.stride as isize);
        if self.t {
            (r, c)
        } else {
            (c, r)
        }
    }
}

/// `dst[m x n] (row stride dst_stride) = keep * dst + scale * a[m x k] . b[k x n]`, where
/// `keep` is 0 (overwrite) or 1 (accumulate). Checks every extent before the unsafe call.
fn mm<T: Elem>(
    dst: &mut [T],
    dst_stride: usize,
    a: View<T>,
    b: View<T>,
    accumulate: bool,
    scale: T,
) -> Result<()> {
    let ((m, k), (k2, n)) = (a.shape(), b.shape());
    let fits = dst_stride >= n && (m == 0 || (m - 1) * dst_stride + n <= dst.len());
    if k != k2 || !fits || !a.in_bounds() || !b.in_bounds() {
        return Err(BackendError::Shape(format!(
            "fused attention product {m}x{k} . {k2}x{n} out of bounds"
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let ((a_cs, a_rs), (b_cs, b_rs)) = (a.strides(), b.strides());
    // SAFETY: every view and the destination were checked above to hold all the elements the
    // strides address; `dst` is a unique borrow and does not alias the shared `a` and `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_stride as isize,
            accumulate,
            a.data.as_ptr(),
            a_cs,
            a_rs,
            b.data.as_ptr(),
            b_cs,
            b_rs,
            T::one(),
            scale,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
    Ok(())
}

/// The shape of a stack of heads: `n` heads of `t` rows of width `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub n: usize,
    pub t: usize,
    pub d: usize,
}

impl Heads {
    fn check(&self, what: &str, len: usize, width: usize) -> Result<()> {
        if len != self.n * self.t * width {
            return Err(BackendError::Shape(format!(
                "fused attention: {what} has {len} elements, expected {} x {} x {width}",
                self.n, self.t
            )));
        }
        Ok(())
    }
}

/// Softmax of block rows `r0..r1` of the causal scores in `s` (row stride `t`, already scaled),
/// in place; writes each row's log-sum-exp to `lse`.
#[inline(always)]
fn softmax_block<T: Elem>(s: &mut [T], t: usize, r0: usize, r1: usize, lse: &mut [T]) {
    for (i, row) in (r0..r1).enumerate() {
        let line = &mut s[i * t..i * t + row + 1];
        let max = lanes_max(line);
        line.iter_mut().for_each(|x| *x = (*x - max).exp_fast());
        let sum = lanes_sum(line);
        let inv = sum.recip();
        line.iter_mut().for_each(|x| *x = *x * inv);
        lse[i] = max + sum.ln();
    }
}

/// Recomputes the probabilities of block rows `r0..r1` from their scores and log-sum-exp.
#[inline(always)]
fn probabilities<T: Elem>(s: &mut [T], t: usize, r0: usize, r1: usize, lse: &[T]) {
    for (i, row) in (r0..r1).enumerate() {
        let line = &mut s[i * t..(i + 1) * t];
        let (seen, masked) = line.split_at_mut(row + 1);
        seen.iter_mut().for_each(|x| *x = (*x - lse[i]).exp_fast());
        masked.iter_mut().for_each(|x| *x = T::zero());
    }
}

/// One head's forward: `y [t x d]` and `lse [t]` from `q, k, v [t x d]`.
#[inline(always)]
fn head_forward<T: Elem>(
    h: Heads,
    scale: T,
    (q, k, v): (&[T], &[T], &[T]),
    y: &mut [T],
    lse: &mut [T],
) -> Result<()> {
    let (t, d) = (h.t, h.d);
    let mut s = vec![T::zero(); BLOCK.min(t) * t];
    for r0 in (0..t).step_by(BLOCK) {
        let r1 = (r0 + BLOCK).min(t);
        let (rows, seen) = (r1 - r0, r1);
        let qi = View::new(&q[r0 * d..], rows, d, d);
        let kj = View::new(k, seen, d, d);
        mm(&mut s, t, qi, kj.t(), false, scale)?;
        softmax_block(&mut s, t, r0, r1, &mut lse[r0..r1]);
        // Entries past each row's diagonal are stale scores: zero them before the product.
        for (i, row) in (r0..r1).enumerate() {
            s[i * t + row + 1..i * t + seen]
                .iter_mut()
                .for_each(|x| *x = T::zero());
        }
        let p = View::new(&s, rows, seen, t);
        mm(
            &mut y[r0 * d..],
            d,
            p,
            View::new(v, seen, d, d),
            false,
            T::one(),
        )?;
    }
    Ok(())
}

/// Fused causal attention forward over `h.n` heads: `(y [n, t, d], lse [n, t])`.
pub fn forward<T: Elem>(h: Heads, scale: T, q: &[T], k: &[T], v: &[T]) -> Result<(Vec<T>, Vec<T>)> {
    for (what, x) in [("q", q), ("k", k), ("v", v)] {
        h.check(what, x.len(), h.d)?;
    }
    let (td, t) = (h.t * h.d, h.t);
    let mut y = vec![T::zero(); h.n * td];
    let mut lse = vec![T::zero(); h.n * t];
    y.par_chunks_mut(td.max(1))
        .zip(lse.par_chunks_mut(t.max(1)))
        .enumerate()
        .try_for_each(|(i, (y, lse))| {
            let at = i * td..(i + 1) * td;
            let qkv = (&q[at.clone()], &k[at.clone()], &v[at]);
            dispatch(
                #[inline(always)]
                || head_forward(h, scale, qkv, y, lse),
            )
        })?;
    Ok((y, lse))
}

/// One head's inputs and what backward reads besides them: `q, k, v, y, dy [t x d]` and the
/// row log-sum-exp `lse [t]`.
struct HeadSaved<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    y: &'a [T],
    lse: &'a [T],
    dy: &'a [T],
}

/// One head's gradients `(dq, dk, dv)`, each `[t x d]`.
struct HeadGrads<'a, T> {
    dq: &'a mut [T],
    dk: &'a mut [T],
    dv: &'a mut [T],
}

/// One head's backward from its inputs, output, log-sum-exp and output gradient.
#[inline(always)]
fn head_backward<T: Elem>(h: Heads, scale: T, s: HeadSaved<T>, g: HeadGrads<T>) -> Result<()> {
    let HeadSaved {
        q,
        k,
        v,
        y,
        lse,
        dy,
    } = s;
    let HeadGrads { dq, dk, dv } = g;
    let (t, d) = (h.t, h.d);
    let n = BLOCK.min(t) * t;
    let (mut p, mut dp) = (vec![T::zero(); n], vec![T::zero(); n]);
    for r0 in (0..t).step_by(BLOCK) {
        let r1 = (r0 + BLOCK).min(t);
        let (rows, seen) = (r1 - r0, r1);
        let (qi, dyi) = (
            View::new(&q[r0 * d..], rows, d, d),
            View::new(&dy[r0 * d..], rows, d, d),
        );
        let (kj, vj) = (View::new(k, seen, d, d), View::new(v, seen, d, d));
        mm(&mut p, t, qi, kj.t(), false, scale)?;
        probabilities(&mut p, t, r0, r1, &lse[r0..r1]);
        mm(&mut dp, t, dyi, vj.t(), false, T::one())?;
        // ds = p * (dp - rowsum(dy * y)), in place of dp.
        for (i, row) in (r0..r1).enumerate() {
            let (dyr, yr) = (&dy[row * d..(row + 1) * d], &y[row * d..(row + 1) * d]);
            let delta = dyr.iter().zip(yr).fold(T::zero(), |a, (&x, &z)| a + x * z);
            let (pr, dsr) = (&p[i * t..i * t + seen], &mut dp[i * t..i * t + seen]);
            dsr.iter_mut()
                .zip(pr)
                .for_each(|(x, &pv)| *x = pv * (*x - delta));
        }
        let (pb, ds) = (View::new(&p, rows, seen, t), View::new(&dp, rows, seen, t));
        mm(&mut dv[..], d, pb.t(), dyi, true, T::one())?;
        mm(&mut dq[r0 * d..], d, ds, kj, false, scale)?;
        mm(&mut dk[..], d, ds.t(), qi, true, scale)?;
    }
    Ok(())
}

/// Fused causal attention backward: `(dq, dk, dv)`, each `[n, t, d]`.
pub fn backward<T: Elem>(
    h: Heads,
    scale: T,
    (q, k, v): (&[T], &[T], &[T]),
    (y, lse): (&[T], &[T]),
    dy: &[T],
) -> Result<[Vec<T>; 3]> {
    for (what, x) in [("q", q), ("k", k), ("v", v), ("y", y), ("dy", dy)] {
        h.check(what, x.len(), h.d)?;
    }
    h.check("lse", lse.len(), 1)?;
    let (td, t) = (h.t * h.d, h.t);
    let zeros = || vec![T::zero(); h.n * td];
    let (mut dq, mut dk, mut dv) = (zeros(), zeros(), zeros());
    dq.par_chunks_mut(td.max(1))
        .zip(dk.par_chunks_mut(td.max(1)))
        .zip(dv.par_chunks_mut(td.max(1)))
        .enumerate()
        .try_for_each(|(i, ((dq, dk), dv))| {
            let at = i * td..(i + 1) * td;
            let saved = HeadSaved {
                q: &q[at.clone()],
                k: &k[at.clone()],
                v: &v[at.clone()],
                y: &y[at.clone()],
                lse: &lse[i * t..(i + 1) * t],
                dy: &dy[at],
            };
            dispatch(
                #[inline(always)]
                || head_backward(h, scale, saved, HeadGrads { dq, dk, dv }),
            )
        })?;
    Ok([dq, dk, dv])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain causal attention in f64: the oracle.
    fn naive(h: Heads, q: &[f64], k: &[f64], v: &[f64]) -> Vec<f64> {
        let (t, d) = (h.t, h.d);
        let scale = 1.0 / (d as f64).sqrt();
        let mut y = vec![0.0; h.n * t * d];
        for n in 0..h.n {
            let o = n * t * d;
            for i in 0..t {
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d)
                            .map(|c| q[o + i * d + c] * k[o + j * d + c])
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for c in 0..d {
                        y[o + i * d + c] += ej / z * v[o + j * d + c];
                    }
                }
            }
        }
        y
    }

    fn data(len: usize, seed: usize) -> Vec<f64> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f64 / 500.0 - 1.0) * 1.5)
            .collect()
    }

    #[test]
    fn forward_matches_plain_attention_across_block_edges() {
        // 150 rows: blocks of 64, 64 and 22; width 5.
        let h = Heads { n: 3, t: 150, d: 5 };
        let len = h.n * h.t * h.d;
        let (q, k, v) = (data(len, 1), data(len, 2), data(len, 3));
        let (y, lse) = forward(h, 1.0 / 5f64.sqrt(), &q, &k, &v).expect("forward");
        let want = naive(h, &q, &k, &v);
        let worst = y
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-12, "{worst}");
        assert!(lse.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn backward_matches_finite_differences() {
        let h = Heads { n: 2, t: 70, d: 3 };
        let len = h.n * h.t * h.d;
        let (q, k, v) = (data(len, 4), data(len, 5), data(len, 6));
        let w = data(len, 7);
        let scale = 1.0 / 3f64.sqrt();
        let objective = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            let (y, _) = forward(h, scale, q, k, v).expect("forward");
            y.iter().zip(&w).map(|(a, b)| a * b).sum()
        };
        let (y, lse) = forward(h, scale, &q, &k, &v).expect("forward");
        let [dq, dk, dv] = backward(h, scale, (&q, &k, &v), (&y, &lse), &w).expect("backward");
        let eps = 1e-6;
        for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
            for i in (0..len).step_by(37) {
                let mut ins = [q.clone(), k.clone(), v.clone()];
                ins[which][i] += eps;
                let up = objective(&ins[0], &ins[1], &ins[2]);
                ins[which][i] -= 2.0 * eps;
                let down = objective(&ins[0], &ins[1], &ins[2]);
                let fd = (up - down) / (2.0 * eps);
                assert!(
                    (fd - grad[i]).abs() < 1e-6 * (1.0 + fd.abs()),
                    "input {which}[{i}]: {fd} vs {}",
                    grad[i]
                );
            }
        }
    }

    #[test]
    fn mismatched_lengths_are_an_error() {
        let h = Heads { n: 2, t: 4, d: 3 };
        let ok = vec![0.0f32; 24];
        assert!(forward(h, 1.0, &ok, &ok, &ok[..23]).is_err());
        assert!(backward(h, 1.0, (&ok, &ok, &ok), (&ok, &ok[..7]), &ok).is_err());
    }
}
