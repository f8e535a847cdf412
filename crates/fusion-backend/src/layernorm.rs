//! Fused layer normalisation over the last dim on the CPU. Forward makes, per row, the mean, the
//! centred row, its variance and reciprocal deviation, the normalised row `xhat` and the output
//! `xhat * gamma + beta` in one buffer per output, where the composed operator runs a dozen
//! whole-tensor passes and temporaries. Backward makes each row's input gradient
//! `rstd * (g - mean(g) - xhat * mean(g * xhat))` with `g = dy * gamma`, and the gain's and
//! bias's gradients as column sums that add the rows in order. Sums are taken in the fixed lane
//! order of [`crate::simd`], so every instruction set gives the same bits. Generic over `f32`
//! and `f64` like the attention kernel, so the f64 gradient checks run the code that trains.

use crate::attention::Elem;
use crate::error::{BackendError, Result};
use crate::simd::{dispatch, lanes_dot, lanes_sum};
use rayon::prelude::*;

/// Rows per parallel task (a few hundred kilobytes of a gpt2-small activation).
const ROWS_PER_TASK: usize = 16;

fn check<T>(what: &str, x: &[T], rows: usize, d: usize) -> Result<()> {
    if d == 0 || x.len() != rows * d {
        return Err(BackendError::Shape(format!(
            "fused layer norm: {what} has {} elements, expected {rows} x {d}",
            x.len()
        )));
    }
    Ok(())
}

/// One row's forward: `xhat`, `y` and the returned reciprocal deviation.
#[inline(always)]
fn row_forward<T: Elem>(
    x: &[T],
    (gamma, beta): (&[T], &[T]),
    eps: T,
    xhat: &mut [T],
    y: &mut [T],
) -> T {
    let inv = T::one() / T::from(x.len()).unwrap_or_else(T::one);
    let mean = lanes_sum(x) * inv;
    xhat.iter_mut().zip(x).for_each(|(c, &v)| *c = v - mean);
    let var = lanes_dot(xhat, xhat) * inv;
    let rstd = (var + eps).sqrt().recip();
    xhat.iter_mut().for_each(|c| *c = *c * rstd);
    for (((o, &h), &g), &b) in y.iter_mut().zip(xhat.iter()).zip(gamma).zip(beta) {
        *o = h * g + b;
    }
    rstd
}

/// Forward of `x [rows, d]`: `(y, xhat, rstd [rows])`.
pub fn forward<T: Elem>(
    x: &[T],
    d: usize,
    gamma: &[T],
    beta: &[T],
    eps: T,
) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
    let rows = x.len().checked_div(d).unwrap_or(0);
    check("x", x, rows, d)?;
    check("gamma", gamma, 1, d)?;
    check("beta", beta, 1, d)?;
    let (mut y, mut xhat, mut rstd) = (
        vec![T::zero(); x.len()],
        vec![T::zero(); x.len()],
        vec![T::zero(); rows],
    );
    let span = ROWS_PER_TASK * d.max(1);
    y.par_chunks_mut(span)
        .zip(xhat.par_chunks_mut(span))
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .zip(x.par_chunks(span))
        .for_each(|(((y, xhat), rstd), x)| {
            dispatch(
                #[inline(always)]
                || {
                    let rows = y.chunks_mut(d).zip(xhat.chunks_mut(d)).zip(x.chunks(d));
                    for (((y, h), x), r) in rows.zip(rstd.iter_mut()) {
                        *r = row_forward(x, (gamma, beta), eps, h, y);
                    }
                },
            )
        });
    Ok((y, xhat, rstd))
}

/// One row's input gradient into `dx`, with `g` as scratch.
#[inline(always)]
fn row_backward<T: Elem>(dy: &[T], xhat: &[T], rstd: T, gamma: &[T], g: &mut [T], dx: &mut [T]) {
    let inv = T::one() / T::from(dy.len()).unwrap_or_else(T::one);
    g.iter_mut()
        .zip(dy)
        .zip(gamma)
        .for_each(|((g, &a), &b)| *g = a * b);
    let mean_g = lanes_sum(g) * inv;
    let mean_gx = lanes_dot(g, xhat) * inv;
    for ((o, &gv), &h) in dx.iter_mut().zip(g.iter()).zip(xhat) {
        *o = (gv - mean_g - h * mean_gx) * rstd;
    }
}

/// `(sum over rows of dy * xhat, sum over rows of dy)`, each column adding its rows in order.
fn gain_and_bias<T: Elem>(dy: &[T], xhat: &[T], d: usize) -> (Vec<T>, Vec<T>) {
    let (mut dgamma, mut dbeta) = (vec![T::zero(); d], vec![T::zero(); d]);
    let width = (d / (4 * rayon::current_num_threads().max(1))).clamp(16, 1024);
    dgamma
        .par_chunks_mut(width)
        .zip(dbeta.par_chunks_mut(width))
        .enumerate()
        .for_each(|(k, (dg, db))| {
            let c0 = k * width;
            dispatch(
                #[inline(always)]
                || {
                    for (r, h) in dy.chunks_exact(d).zip(xhat.chunks_exact(d)) {
                        let (r, h) = (&r[c0..c0 + dg.len()], &h[c0..c0 + dg.len()]);
                        for (((g, b), &a), &x) in dg.iter_mut().zip(db.iter_mut()).zip(r).zip(h) {
                            *g = *g + a * x;
                            *b = *b + a;
                        }
                    }
                },
            )
        });
    (dgamma, dbeta)
}

/// Backward from the output gradient `dy [rows, d]`, the saved `xhat` and `rstd [rows]`:
/// `(dx, dgamma [d], dbeta [d])`.
pub fn backward<T: Elem>(
    dy: &[T],
    xhat: &[T],
    rstd: &[T],
    gamma: &[T],
    d: usize,
) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
    let rows = dy.len().checked_div(d).unwrap_or(0);
    check("dy", dy, rows, d)?;
    check("xhat", xhat, rows, d)?;
    check("rstd", rstd, rows, 1)?;
    check("gamma", gamma, 1, d)?;
    let mut dx = vec![T::zero(); dy.len()];
    let span = ROWS_PER_TASK * d.max(1);
    dx.par_chunks_mut(span)
        .zip(dy.par_chunks(span))
        .zip(xhat.par_chunks(span))
        .zip(rstd.par_chunks(ROWS_PER_TASK))
        .for_each(|(((dx, dy), xhat), rstd)| {
            let mut g = vec![T::zero(); d];
            dispatch(
                #[inline(always)]
                || {
                    let rows = dx.chunks_mut(d).zip(dy.chunks(d)).zip(xhat.chunks(d));
                    for (((dx, dy), h), &r) in rows.zip(rstd) {
                        row_backward(dy, h, r, gamma, &mut g, dx);
                    }
                },
            )
        });
    let (dgamma, dbeta) = gain_and_bias(dy, xhat, d);
    Ok((dx, dgamma, dbeta))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: usize) -> Vec<f64> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f64 / 500.0 - 1.0) * 1.5)
            .collect()
    }

    /// Plain layer norm in f64: the oracle.
    fn naive(x: &[f64], d: usize, gamma: &[f64], beta: &[f64], eps: f64) -> Vec<f64> {
        x.chunks(d)
            .flat_map(|r| {
                let mean = r.iter().sum::<f64>() / d as f64;
                let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
                let s = 1.0 / (var + eps).sqrt();
                r.iter()
                    .zip(gamma.iter().zip(beta))
                    .map(move |(v, (g, b))| (v - mean) * s * g + b)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn forward_matches_plain_layer_norm() {
        // 37 rows (tasks of 16 and a tail) of width 70 (lanes of 16 and a tail).
        let (rows, d) = (37, 70);
        let (x, gamma, beta) = (data(rows * d, 1), data(d, 2), data(d, 3));
        let (y, xhat, rstd) = forward(&x, d, &gamma, &beta, 1e-5).expect("forward");
        let want = naive(&x, d, &gamma, &beta, 1e-5);
        let worst = y
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-12, "{worst}");
        assert_eq!((xhat.len(), rstd.len()), (rows * d, rows));
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (rows, d) = (19, 21);
        let (x, gamma, beta, w) = (data(rows * d, 4), data(d, 5), data(d, 6), data(rows * d, 7));
        let objective = |x: &[f64], gamma: &[f64], beta: &[f64]| -> f64 {
            let (y, _, _) = forward(x, d, gamma, beta, 1e-5).expect("forward");
            y.iter().zip(&w).map(|(a, b)| a * b).sum()
        };
        let (_, xhat, rstd) = forward(&x, d, &gamma, &beta, 1e-5).expect("forward");
        let (dx, dgamma, dbeta) = backward(&w, &xhat, &rstd, &gamma, d).expect("backward");
        let eps = 1e-6;
        for (which, grad) in [(0, &dx), (1, &dgamma), (2, &dbeta)] {
            let len = grad.len();
            for i in (0..len).step_by(7) {
                let mut ins = [x.clone(), gamma.clone(), beta.clone()];
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
        let x = vec![0.0f32; 12];
        assert!(forward(&x, 4, &x[..4], &x[..3], 1e-5).is_err());
        assert!(forward(&x, 5, &x[..5], &x[..5], 1e-5).is_err());
        assert!(forward(&x, 0, &x[..0], &x[..0], 1e-5).is_err());
        assert!(backward(&x, &x, &x[..2], &x[..4], 4).is_err());
    }
}
