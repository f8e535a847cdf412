//! Fused softmax cross-entropy over rows of logits on the CPU: each row's loss from one pass for
//! its maximum and one for its log-sum-exp, and the gradient `(softmax - onehot) * scale` from
//! the logits again in backward, so that neither the probabilities nor any other row-sized
//! temporary is kept. Rows run in parallel; generic over `f32` and `f64` like the attention
//! kernel.

use crate::attention::Elem;
use crate::error::{BackendError, Result};
use crate::simd::{add_lanes, dispatch, fold_lanes, lanes_max, LANES};
use rayon::prelude::*;

fn check(x: &[impl Sized], rows: usize, targets: &[u32]) -> Result<usize> {
    let cols = x.len().checked_div(rows).unwrap_or(0);
    if rows != targets.len()
        || cols * rows != x.len()
        || targets.iter().any(|&t| t as usize >= cols)
    {
        return Err(BackendError::Shape(format!(
            "cross-entropy of {} logits in {rows} rows against {} targets below {cols}",
            x.len(),
            targets.len()
        )));
    }
    Ok(cols)
}

/// Maximum and log-sum-exp of one row.
#[inline(always)]
fn row_lse<T: Elem>(row: &[T]) -> (T, T) {
    let max = lanes_max(row);
    let sum = sum_exp(row, max);
    (max, max + sum.ln())
}

/// `sum(exp(x - shift))` over `row`: element `i` goes to partial sum `i % LANES` (the tail to
/// the folded total), the same order on every instruction set. The exponentials are taken a
/// block at a time into a buffer, a loop the compiler vectorises, and summed from there.
#[inline(always)]
fn sum_exp<T: Elem>(row: &[T], shift: T) -> T {
    const BLOCK: usize = 16 * LANES;
    // Whole blocks hold whole lanes, so only the last block can leave a remainder.
    const _: () = assert!(BLOCK.is_multiple_of(LANES));
    let mut acc = [T::zero(); LANES];
    let mut buf = [T::zero(); BLOCK];
    for block in row.chunks(BLOCK) {
        let e = &mut buf[..block.len()];
        for (o, &x) in e.iter_mut().zip(block) {
            *o = (x - shift).exp_fast();
        }
        let rest = add_lanes(&mut acc, e);
        // Only the last block can leave a remainder.
        if !rest.is_empty() {
            return rest.iter().fold(fold_lanes(acc), |s, &x| s + x);
        }
    }
    fold_lanes(acc)
}

/// `-log softmax(x)[target]` of every row of `x [rows, cols]`.
pub fn forward<T: Elem>(x: &[T], rows: usize, targets: &[u32]) -> Result<Vec<T>> {
    let cols = check(x, rows, targets)?;
    Ok(x.par_chunks(cols.max(1))
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            dispatch(
                #[inline(always)]
                || row_lse(row).1,
            ) - row[t as usize]
        })
        .collect())
}

/// `(softmax(x) - onehot(target)) * scale` for every row of `x [rows, cols]`.
pub fn backward<T: Elem>(x: &[T], rows: usize, targets: &[u32], scale: T) -> Result<Vec<T>> {
    let cols = check(x, rows, targets)?;
    let mut g = vec![T::zero(); x.len()];
    g.par_chunks_mut(cols.max(1))
        .zip(x.par_chunks(cols.max(1)))
        .zip(targets.par_iter())
        .for_each(|((g, row), &t)| {
            dispatch(
                #[inline(always)]
                || {
                    let lse = row_lse(row).1;
                    for (o, &v) in g.iter_mut().zip(row) {
                        *o = (v - lse).exp_fast() * scale;
                    }
                },
            );
            g[t as usize] = g[t as usize] - scale;
        });
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_definition_and_its_gradient() {
        let (rows, cols) = (5, 7);
        let x: Vec<f64> = (0..rows * cols)
            .map(|i| ((i * 37) % 11) as f64 * 0.7 - 3.0)
            .collect();
        let targets = [0u32, 6, 3, 3, 1];
        let loss = forward(&x, rows, &targets).expect("forward");
        let g = backward(&x, rows, &targets, 0.5).expect("backward");
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            let z: f64 = row.iter().map(|v| v.exp()).sum();
            let want = -(row[targets[r] as usize].exp() / z).ln();
            assert!((loss[r] - want).abs() < 1e-12);
            for c in 0..cols {
                let p = row[c].exp() / z - f64::from(u8::from(c == targets[r] as usize));
                assert!((g[r * cols + c] - 0.5 * p).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn bad_targets_are_an_error() {
        let x = vec![0f32; 6];
        assert!(forward(&x, 2, &[0, 3]).is_err());
        assert!(forward(&x, 2, &[0]).is_err());
        assert!(backward(&x, 4, &[0, 0, 0, 0], 1.0).is_err());
    }
}
