//! Causal multi-head self-attention core: `qkv [B, T, 3C]` -> `[B, T, C]`.

use crate::error::{OpError, Result};
use crate::{Backward, Forward};
use fusion_backend::{Backend, BinaryOp, UnaryOp};

struct Dims {
    b: usize,
    t: usize,
    h: usize,
    d: usize,
}

fn dims<B: Backend>(be: &B, qkv: &B::Tensor, n_head: usize) -> Result<Dims> {
    match be.shape(qkv)[..] {
        [b, t, c3] if c3 % 3 == 0 && n_head > 0 && (c3 / 3) % n_head == 0 => Ok(Dims {
            b,
            t,
            h: n_head,
            d: c3 / 3 / n_head,
        }),
        ref s => Err(OpError::Shape(format!(
            "attention with {n_head} heads cannot take qkv {s:?}"
        ))),
    }
}

/// Row-wise softmax over the last dim (of scores at `f32` or better under a 16-bit precision:
/// rounded to bf16, a score of 10 would be off by 0.03 and its weight by 3%).
fn softmax<B: Backend>(be: &B, x: &B::Tensor) -> Result<B::Tensor> {
    let last = be.shape(x).len() - 1;
    let z = be.binary(BinaryOp::Sub, x, &be.max_keepdim(x, last)?)?;
    let e = be.unary(UnaryOp::Exp, &z)?;
    Ok(be.binary(BinaryOp::Div, &e, &be.sum_keepdim(&e, &[last])?)?)
}

/// `qkv [B, T, 3C]` as one `[B*H, T, D]` matrix stack each for q, k and v (by way of
/// `[B, T, 3, H, D] -> [3, B, H, T, D]`).
fn heads<B: Backend>(be: &B, qkv: &B::Tensor, n_head: usize) -> Result<[B::Tensor; 3]> {
    let Dims { b, t, h, d } = dims(be, qkv, n_head)?;
    let split = be.permute(&be.reshape(qkv, &[b, t, 3, h, d])?, &[2, 0, 3, 1, 4])?;
    let part = |i: usize| -> Result<B::Tensor> {
        Ok(be.reshape(&be.narrow(&split, 0, i, 1)?, &[b * h, t, d])?)
    };
    Ok([part(0)?, part(1)?, part(2)?])
}

pub fn forward<B: Backend>(be: &B, qkv: &B::Tensor, n_head: usize) -> Result<Forward<B>> {
    let Dims { b, t, h, d } = dims(be, qkv, n_head)?;
    let [q, k, v] = heads(be, qkv, n_head)?;
    let (y, extras) = core_forward(be, &q, &k, &v)?;
    let y = be.reshape(
        &be.permute(&be.reshape(&y, &[b, h, t, d])?, &[0, 2, 1, 3])?,
        &[b, t, h * d],
    )?;
    // Only what the core saved (the fused kernel's output and row log-sum-exps, or the
    // weights): backward splits q, k and v from `qkv` again, which the tape holds as this
    // node's input anyway, instead of a second copy held from forward to backward (113 MB at
    // gpt2-small's batch 4 x 256, at the step's memory peak).
    Ok(Forward {
        output: y,
        saved: extras,
        buffer_updates: vec![],
    })
}

/// Causal scaled dot-product attention over stacks of heads `q, k, v [N, T, D]`: the output
/// `[N, T, D]` and what backward needs besides `q, k, v` — the output and each row's
/// log-sum-exp when the backend has a fused kernel, else the attention weights `p [N, T, T]`.
pub(crate) fn core_forward<B: Backend>(
    be: &B,
    q: &B::Tensor,
    k: &B::Tensor,
    v: &B::Tensor,
) -> Result<(B::Tensor, Vec<B::Tensor>)> {
    let d = be.shape(q).last().copied().unwrap_or(1);
    let scale = 1.0 / (d as f64).sqrt();
    if let Some((y, lse)) = be.causal_attention(q, k, v, scale)? {
        return Ok((y.clone(), vec![y, lse]));
    }
    // Scores and their softmax at f32 or better, as a fused kernel computes them; the weights
    // are kept (and saved) in the compute precision, half the memory of f32 ones.
    let scores = be.matmul(&be.widen(q)?, &be.widen(k)?, false, true)?;
    let scores = be.affine(&scores, scale, 0.0)?;
    let p = softmax(be, &be.causal_fill(&scores, f64::NEG_INFINITY)?)?;
    let p = be.to_compute(&p)?;
    let y = be.matmul(&p, v, false, false)?;
    Ok((y, vec![p]))
}

/// The VJP of [`core_forward`]: `(dq, dk, dv)` from the output's gradient `dy [N, T, D]` and
/// the extras it saved.
pub(crate) fn core_backward<B: Backend>(
    be: &B,
    q: &B::Tensor,
    k: &B::Tensor,
    v: &B::Tensor,
    extras: &[B::Tensor],
    dy: &B::Tensor,
) -> Result<[B::Tensor; 3]> {
    let d = be.shape(q).last().copied().unwrap_or(1);
    let scale = 1.0 / (d as f64).sqrt();
    match extras {
        [y, lse] => be
            .causal_attention_backward(q, k, v, y, lse, dy, scale)?
            .ok_or_else(|| {
                OpError::Shape("attention saved a fused forward the backend cannot reverse".into())
            }),
        [p] => composed_backward(be, q, k, v, p, dy),
        _ => Err(OpError::Shape(format!(
            "attention saved {} tensors besides q, k, v",
            extras.len()
        ))),
    }
}

/// The VJP of the composed forward, from the attention weights `p`.
fn composed_backward<B: Backend>(
    be: &B,
    q: &B::Tensor,
    k: &B::Tensor,
    v: &B::Tensor,
    p: &B::Tensor,
    dy: &B::Tensor,
) -> Result<[B::Tensor; 3]> {
    let d = be.shape(q).last().copied().unwrap_or(1);
    let dv = be.matmul(p, dy, true, false)?;
    // Softmax VJP: ds = p * (dp - sum(dp * p)); masked entries have p = 0 and get no gradient.
    // `dp - sum(dp * p)` nearly cancels where attention is peaked, so dp, the row sums and the
    // difference are kept at f32 or better (as a fused kernel keeps them): a bf16 dp's rounding
    // would come out of the cancellation as large relative errors in ds.
    let (dp, p) = (
        be.matmul(&be.widen(dy)?, &be.widen(v)?, false, true)?,
        be.widen(p)?,
    );
    let row = be.sum_keepdim(&be.binary(BinaryOp::Mul, &dp, &p)?, &[2])?;
    let ds = be.binary(BinaryOp::Mul, &p, &be.binary(BinaryOp::Sub, &dp, &row)?)?;
    drop((dp, p));
    let ds = be.to_compute(&be.affine(&ds, 1.0 / (d as f64).sqrt(), 0.0)?)?;
    let dq = be.matmul(&ds, k, false, false)?;
    let dk = be.matmul(&ds, q, true, false)?;
    Ok([dq, dk, dv])
}

pub fn backward<B: Backend>(
    be: &B,
    qkv: &B::Tensor,
    n_head: usize,
    saved_t: &[B::Tensor],
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    let Dims { b, t, h, d } = dims(be, qkv, n_head)?;
    let [q, k, v] = heads(be, qkv, n_head)?;
    let dy = be.reshape(
        &be.permute(&be.reshape(dy, &[b, t, h, d])?, &[0, 2, 1, 3])?,
        &[b * h, t, d],
    )?;
    let [dq, dk, dv] = core_backward(be, &q, &k, &v, saved_t, &dy)?;
    let shape = [1, b, h, t, d];
    let stacked = be.cat(
        &[
            &be.reshape(&dq, &shape)?,
            &be.reshape(&dk, &shape)?,
            &be.reshape(&dv, &shape)?,
        ],
        0,
    )?;
    let dqkv = be.reshape(&be.permute(&stacked, &[1, 3, 0, 2, 4])?, &[b, t, 3 * h * d])?;
    Ok(Backward {
        inputs: vec![Some(dqkv)],
        params: vec![],
    })
}
