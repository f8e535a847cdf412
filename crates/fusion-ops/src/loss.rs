//! Mean softmax cross-entropy against integer class targets.

use crate::error::{saved, OpError, Result};
use crate::linear::as_rows;
use crate::value::IdTensor;
use crate::{Backward, Forward};
use fusion_backend::{Backend, BinaryOp, UnaryOp};

pub fn forward<B: Backend>(b: &B, logits: &B::Tensor, targets: &IdTensor) -> Result<Forward<B>> {
    let x = as_rows(b, logits)?;
    let n = b.shape(&x)[0];
    if n != targets.data.len() {
        return Err(OpError::Shape(format!(
            "{n} rows of logits but {} targets",
            targets.data.len()
        )));
    }
    if let Some(rows) = b.cross_entropy_rows(&x, &targets.data)? {
        // Fused: nothing is saved; backward recomputes the softmax from the logits.
        return Ok(Forward {
            output: mean_of(b, &rows, n)?,
            saved: vec![],
            buffer_updates: vec![],
        });
    }
    // Softmax with the row maximum subtracted for stability. One exponential pass serves both the
    // loss (log-sum-exp) and the saved probabilities; log-probabilities are needed only at the
    // targets. At f32 or better under a 16-bit precision, as the fused kernel computes it: a
    // bf16 logit of 10 less the row maximum is off by up to 0.03, and its probability by 3%.
    let wide = b.widen(&x)?;
    let z = b.binary(BinaryOp::Sub, &wide, &b.max_keepdim(&wide, 1)?)?;
    drop(wide);
    let e = b.unary(UnaryOp::Exp, &z)?;
    let sum = b.sum_keepdim(&e, &[1])?;
    let probs = b.to_compute(&b.binary(BinaryOp::Div, &e, &sum)?)?;
    drop(e);
    let picked = b.binary(
        BinaryOp::Sub,
        &b.pick_last(&z, &targets.data)?,
        &b.unary(UnaryOp::Log, &sum)?,
    )?;
    let loss = b.affine(&mean_of(b, &picked, n)?, -1.0, 0.0)?;
    Ok(Forward {
        output: loss,
        saved: vec![probs],
        buffer_updates: vec![],
    })
}

/// The mean of `n` per-row values as a one-element tensor.
fn mean_of<B: Backend>(b: &B, rows: &B::Tensor, n: usize) -> Result<B::Tensor> {
    Ok(b.affine(
        &b.reshape(&b.sum_keepdim(rows, &[0])?, &[1])?,
        1.0 / n as f64,
        0.0,
    )?)
}

pub fn backward<B: Backend>(
    b: &B,
    logits: &B::Tensor,
    targets: &IdTensor,
    saved_t: &[B::Tensor],
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    if saved_t.is_empty() {
        // The fused forward: the gradient comes from the logits in one pass.
        let x = as_rows(b, logits)?;
        let n = b.shape(&x)[0];
        let scale = b.to_f64(dy)?.first().copied().unwrap_or(0.0) / n as f64;
        let g = b
            .cross_entropy_rows_backward(&x, &targets.data, scale)?
            .ok_or_else(|| {
                OpError::Shape(
                    "cross-entropy saved a fused forward the backend cannot reverse".into(),
                )
            })?;
        return Ok(Backward {
            inputs: vec![Some(b.reshape(&g, &b.shape(logits))?), None],
            params: vec![],
        });
    }
    let probs = saved(saved_t, 0, "softmax_cross_entropy")?;
    let n = b.shape(probs)[0];
    // d/dlogits mean(-log p[target]) = (p - onehot) / N, scaled by the incoming gradient.
    let g = b.add_at_last(probs, &targets.data, -1.0)?;
    let g = b.binary(BinaryOp::Mul, &g, &b.reshape(dy, &[1, 1])?)?;
    let g = b.reshape(&b.affine(&g, 1.0 / n as f64, 0.0)?, &b.shape(logits))?;
    Ok(Backward {
        inputs: vec![Some(g), None],
        params: vec![],
    })
}
