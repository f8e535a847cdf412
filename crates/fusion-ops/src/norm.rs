//! Layer normalisation (over the last dim) and batch normalisation (over N, H, W).
//!
//! On a half-precision backend the statistics and the gradients are computed in `f32`
//! ([`Backend::widen`]): `dx` is a difference of nearly equal terms, which 16-bit roundings of
//! each would swamp. The output, the parameters' gradients and the saved normalised input are
//! narrowed back to the compute precision; the per-row reciprocal deviations are kept wide, and
//! so is the input's gradient until [`crate::backward`] gives it its input's format (a residual
//! stream read wide gets a wide gradient).

use crate::error::{param, saved, OpError, Result};
use crate::linear::as_rows;
use crate::{Backward, Forward, Mode};
use fusion_backend::{Backend, BinaryOp, UnaryOp};

/// Normalises `x` over `dims` (kept as size 1): returns `(xhat, mean, var, rstd)`.
fn normalise<B: Backend>(
    b: &B,
    x: &B::Tensor,
    dims: &[usize],
    count: usize,
    eps: f32,
) -> Result<[B::Tensor; 4]> {
    let inv = 1.0 / count as f64;
    let mean = b.affine(&b.sum_keepdim(x, dims)?, inv, 0.0)?;
    let xc = b.binary(BinaryOp::Sub, x, &mean)?;
    let var = b.affine(
        &b.sum_keepdim(&b.unary(UnaryOp::Square, &xc)?, dims)?,
        inv,
        0.0,
    )?;
    let rstd = b.unary(
        UnaryOp::Recip,
        &b.unary(UnaryOp::Sqrt, &b.affine(&var, 1.0, eps as f64)?)?,
    )?;
    let xhat = b.binary(BinaryOp::Mul, &xc, &rstd)?;
    Ok([xhat, mean, var, rstd])
}

/// `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))` with `g = dy * gamma`, the gradient of a
/// normalisation whose statistics depend on its input.
fn normalise_backward<B: Backend>(
    b: &B,
    g: &B::Tensor,
    xhat: &B::Tensor,
    rstd: &B::Tensor,
    dims: &[usize],
    count: usize,
) -> Result<B::Tensor> {
    let inv = 1.0 / count as f64;
    let mean_g = b.affine(&b.sum_keepdim(g, dims)?, inv, 0.0)?;
    let mean_gx = b.affine(
        &b.sum_keepdim(&b.binary(BinaryOp::Mul, g, xhat)?, dims)?,
        inv,
        0.0,
    )?;
    let t = b.binary(
        BinaryOp::Sub,
        &b.binary(BinaryOp::Sub, g, &mean_g)?,
        &b.binary(BinaryOp::Mul, xhat, &mean_gx)?,
    )?;
    Ok(b.binary(BinaryOp::Mul, &t, rstd)?)
}

/// The gain's VJP for rows `dy2 [N, D]` of a normalisation `y = xhat * gamma (+ beta)`:
/// `dgamma = sum_rows(dy * xhat)`, and `g = dy * gamma`, the gradient reaching `xhat`.
fn gain_backward<B: Backend>(
    b: &B,
    dy2: &B::Tensor,
    xhat: &B::Tensor,
    gamma: &B::Tensor,
) -> Result<(B::Tensor, B::Tensor)> {
    let d = b.shape(dy2)[1];
    let dgamma = b.reshape(
        &b.sum_keepdim(&b.binary(BinaryOp::Mul, dy2, xhat)?, &[0])?,
        &[d],
    )?;
    let g = b.binary(BinaryOp::Mul, dy2, &b.reshape(gamma, &[1, d])?)?;
    Ok((dgamma, g))
}

fn layer_norm_forward_wide<B: Backend>(
    b: &B,
    x: &B::Tensor,
    params: &[&B::Tensor],
    eps: f32,
) -> Result<Forward<B>> {
    let gamma = param(params, 0, "layer_norm", "gamma")?;
    let beta = param(params, 1, "layer_norm", "beta")?;
    let x2 = as_rows(b, x)?;
    let d = b.shape(&x2)[1];
    let [y, xhat, rstd] = match b.layer_norm_rows(&x2, gamma, beta, eps as f64)? {
        Some(fused) => fused,
        None => {
            let [xhat, _, _, rstd] = normalise(b, &x2, &[1], d, eps)?;
            let y = b.binary(BinaryOp::Mul, &xhat, &b.reshape(gamma, &[1, d])?)?;
            let y = b.binary(BinaryOp::Add, &y, &b.reshape(beta, &[1, d])?)?;
            [y, xhat, rstd]
        }
    };
    Ok(Forward {
        output: b.reshape(&y, &b.shape(x))?,
        saved: vec![xhat, rstd],
        buffer_updates: vec![],
    })
}

fn layer_norm_backward_wide<B: Backend>(
    b: &B,
    params: &[&B::Tensor],
    saved_t: &[B::Tensor],
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    let gamma = param(params, 0, "layer_norm", "gamma")?;
    let xhat = saved(saved_t, 0, "layer_norm")?;
    let rstd = saved(saved_t, 1, "layer_norm")?;
    let (dy2, d) = (as_rows(b, dy)?, b.shape(xhat)[1]);
    let [dx, dgamma, dbeta] = match b.layer_norm_rows_backward(&dy2, xhat, rstd, gamma)? {
        Some(fused) => fused,
        None => {
            let (dgamma, g) = gain_backward(b, &dy2, xhat, gamma)?;
            let dbeta = b.reshape(&b.sum_keepdim(&dy2, &[0])?, &[d])?;
            let dx = normalise_backward(b, &g, xhat, rstd, &[1], d)?;
            [dx, dgamma, dbeta]
        }
    };
    Ok(Backward {
        inputs: vec![Some(b.reshape(&dx, &b.shape(dy))?)],
        params: vec![Some(dgamma), Some(dbeta)],
    })
}

fn rms_norm_forward_wide<B: Backend>(
    b: &B,
    x: &B::Tensor,
    params: &[&B::Tensor],
    eps: f32,
) -> Result<Forward<B>> {
    let gamma = param(params, 0, "rms_norm", "gamma")?;
    let x2 = as_rows(b, x)?;
    let d = b.shape(&x2)[1];
    let ms = b.affine(
        &b.sum_keepdim(&b.unary(UnaryOp::Square, &x2)?, &[1])?,
        1.0 / d as f64,
        eps as f64,
    )?;
    let rstd = b.unary(UnaryOp::Recip, &b.unary(UnaryOp::Sqrt, &ms)?)?;
    let xhat = b.binary(BinaryOp::Mul, &x2, &rstd)?;
    let y = b.binary(BinaryOp::Mul, &xhat, &b.reshape(gamma, &[1, d])?)?;
    Ok(Forward {
        output: b.reshape(&y, &b.shape(x))?,
        saved: vec![xhat, rstd],
        buffer_updates: vec![],
    })
}

/// `dx = rstd * (g - xhat * mean(g * xhat))` with `g = dy * gamma`; `dgamma = sum(dy * xhat)`.
fn rms_norm_backward_wide<B: Backend>(
    b: &B,
    params: &[&B::Tensor],
    saved_t: &[B::Tensor],
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    let gamma = param(params, 0, "rms_norm", "gamma")?;
    let xhat = saved(saved_t, 0, "rms_norm")?;
    let rstd = saved(saved_t, 1, "rms_norm")?;
    let d = b.shape(xhat)[1];
    let (dgamma, g) = gain_backward(b, &as_rows(b, dy)?, xhat, gamma)?;
    let mean_gx = b.affine(
        &b.sum_keepdim(&b.binary(BinaryOp::Mul, &g, xhat)?, &[1])?,
        1.0 / d as f64,
        0.0,
    )?;
    let t = b.binary(BinaryOp::Sub, &g, &b.binary(BinaryOp::Mul, xhat, &mean_gx)?)?;
    let dx = b.binary(BinaryOp::Mul, &t, rstd)?;
    Ok(Backward {
        inputs: vec![Some(b.reshape(&dx, &b.shape(dy))?)],
        params: vec![Some(dgamma)],
    })
}

fn channels<B: Backend>(b: &B, x: &B::Tensor) -> Result<(usize, usize)> {
    match b.shape(x)[..] {
        [n, c, h, w] => Ok((c, n * h * w)),
        ref s => Err(OpError::Shape(format!(
            "batch norm needs [N, C, H, W], got {s:?}"
        ))),
    }
}

fn batch_norm_forward_wide<B: Backend>(
    b: &B,
    x: &B::Tensor,
    params: &[&B::Tensor],
    eps: f32,
    momentum: f32,
    mode: Mode,
) -> Result<Forward<B>> {
    let gamma = param(params, 0, "batch_norm2d", "gamma")?;
    let beta = param(params, 1, "batch_norm2d", "beta")?;
    let running_mean = param(params, 2, "batch_norm2d", "running_mean")?;
    let running_var = param(params, 3, "batch_norm2d", "running_var")?;
    let (c, count) = channels(b, x)?;
    let per_channel = |t: &B::Tensor| b.reshape(t, &[1, c, 1, 1]);
    let (xhat, rstd, updates) = match mode {
        Mode::Train => {
            let [xhat, mean, var, rstd] = normalise(b, x, &[0, 2, 3], count, eps)?;
            let m = momentum as f64;
            let unbiased = count as f64 / (count.max(2) - 1) as f64;
            let new_mean = b.binary(
                BinaryOp::Add,
                &b.affine(running_mean, 1.0 - m, 0.0)?,
                &b.affine(&b.reshape(&mean, &[c])?, m, 0.0)?,
            )?;
            let new_var = b.binary(
                BinaryOp::Add,
                &b.affine(running_var, 1.0 - m, 0.0)?,
                &b.affine(&b.reshape(&var, &[c])?, m * unbiased, 0.0)?,
            )?;
            (xhat, rstd, vec![(2, new_mean), (3, new_var)])
        }
        Mode::Eval => {
            let rstd = per_channel(&b.unary(
                UnaryOp::Recip,
                &b.unary(UnaryOp::Sqrt, &b.affine(running_var, 1.0, eps as f64)?)?,
            )?)?;
            let xhat = b.binary(
                BinaryOp::Mul,
                &b.binary(BinaryOp::Sub, x, &per_channel(running_mean)?)?,
                &rstd,
            )?;
            (xhat, rstd, vec![])
        }
    };
    let y = b.binary(
        BinaryOp::Add,
        &b.binary(BinaryOp::Mul, &xhat, &per_channel(gamma)?)?,
        &per_channel(beta)?,
    )?;
    Ok(Forward {
        output: y,
        saved: vec![xhat, rstd],
        buffer_updates: updates,
    })
}

fn batch_norm_backward_wide<B: Backend>(
    b: &B,
    params: &[&B::Tensor],
    saved_t: &[B::Tensor],
    dy: &B::Tensor,
    mode: Mode,
) -> Result<Backward<B>> {
    let gamma = param(params, 0, "batch_norm2d", "gamma")?;
    let xhat = saved(saved_t, 0, "batch_norm2d")?;
    let rstd = saved(saved_t, 1, "batch_norm2d")?;
    let (c, count) = channels(b, dy)?;
    let dgamma = b.reshape(
        &b.sum_keepdim(&b.binary(BinaryOp::Mul, dy, xhat)?, &[0, 2, 3])?,
        &[c],
    )?;
    let dbeta = b.reshape(&b.sum_keepdim(dy, &[0, 2, 3])?, &[c])?;
    let g = b.binary(BinaryOp::Mul, dy, &b.reshape(gamma, &[1, c, 1, 1])?)?;
    let dx = match mode {
        Mode::Train => normalise_backward(b, &g, xhat, rstd, &[0, 2, 3], count)?,
        // Running statistics are constants in evaluation.
        Mode::Eval => b.binary(BinaryOp::Mul, &g, rstd)?,
    };
    Ok(Backward {
        inputs: vec![Some(dx)],
        params: vec![Some(dgamma), Some(dbeta), None, None],
    })
}

/// Widened copies of `ts` ([`Backend::widen`]).
fn widened<B: Backend>(b: &B, ts: &[&B::Tensor]) -> Result<Vec<B::Tensor>> {
    Ok(ts
        .iter()
        .map(|t| b.widen(t))
        .collect::<fusion_backend::Result<_>>()?)
}

/// A forward computed wide, with its output and saved normalised input (the first saved
/// tensor) back in the compute precision; buffer updates (running statistics) stay wide.
fn narrow_forward<B: Backend>(b: &B, f: Forward<B>) -> Result<Forward<B>> {
    let mut saved = f.saved;
    if let Some(xhat) = saved.first_mut() {
        *xhat = b.to_compute(xhat)?;
    }
    // Running statistics stay wide: the trainer keeps them in its f32 master state.
    Ok(Forward {
        output: b.to_compute(&f.output)?,
        saved,
        buffer_updates: f.buffer_updates,
    })
}

/// A backward computed wide, with the parameters' gradients back in the compute precision;
/// the input's gradient stays wide for [`crate::backward`] to give it its input's format (wide
/// where the input is the residual stream).
fn narrow_backward<B: Backend>(b: &B, g: Backward<B>) -> Result<Backward<B>> {
    let params = g
        .params
        .into_iter()
        .map(|t| t.map(|t| b.to_compute(&t)).transpose().map_err(Into::into))
        .collect::<Result<Vec<_>>>()?;
    Ok(Backward {
        inputs: g.inputs,
        params,
    })
}

/// A normalisation's forward `f` run on the widened input and parameters, its results narrowed.
fn forward_wide<B: Backend>(
    b: &B,
    x: &B::Tensor,
    params: &[&B::Tensor],
    f: impl FnOnce(&B::Tensor, &[&B::Tensor]) -> Result<Forward<B>>,
) -> Result<Forward<B>> {
    let p = widened(b, params)?;
    let p: Vec<&B::Tensor> = p.iter().collect();
    narrow_forward(b, f(&b.widen(x)?, &p)?)
}

/// A normalisation's VJP `f` run on the widened parameters, saved tensors and output gradient,
/// its gradients narrowed.
fn backward_wide<B: Backend>(
    b: &B,
    params: &[&B::Tensor],
    saved: &[B::Tensor],
    dy: &B::Tensor,
    f: impl FnOnce(&[&B::Tensor], &[B::Tensor], &B::Tensor) -> Result<Backward<B>>,
) -> Result<Backward<B>> {
    let p = widened(b, params)?;
    let p: Vec<&B::Tensor> = p.iter().collect();
    let saved = widened(b, &saved.iter().collect::<Vec<_>>())?;
    narrow_backward(b, f(&p, &saved, &b.widen(dy)?)?)
}

pub fn layer_norm_forward<B: Backend>(
    b: &B,
    x: &B::Tensor,
    params: &[&B::Tensor],
    eps: f32,
) -> Result<Forward<B>> {
    forward_wide(b, x, params, |x, p| layer_norm_forward_wide(b, x, p, eps))
}

pub fn layer_norm_backward<B: Backend>(
    b: &B,
    params: &[&B::Tensor],
    saved_t: &[B::Tensor],
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    backward_wide(b, params, saved_t, dy, |p, s, dy| {
        layer_norm_backward_wide(b, p, s, dy)
    })
}

/// RMS normalisation over the last dim (Llama): `y = x / sqrt(mean(x^2) + eps) * gamma`.
pub fn rms_norm_forward<B: Backend>(
    b: &B,
    x: &B::Tensor,
    params: &[&B::Tensor],
    eps: f32,
) -> Result<Forward<B>> {
    forward_wide(b, x, params, |x, p| rms_norm_forward_wide(b, x, p, eps))
}

pub fn rms_norm_backward<B: Backend>(
    b: &B,
    params: &[&B::Tensor],
    saved_t: &[B::Tensor],
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    backward_wide(b, params, saved_t, dy, |p, s, dy| {
        rms_norm_backward_wide(b, p, s, dy)
    })
}

pub fn batch_norm_forward<B: Backend>(
    b: &B,
    x: &B::Tensor,
    params: &[&B::Tensor],
    eps: f32,
    momentum: f32,
    mode: Mode,
) -> Result<Forward<B>> {
    forward_wide(b, x, params, |x, p| {
        batch_norm_forward_wide(b, x, p, eps, momentum, mode)
    })
}

pub fn batch_norm_backward<B: Backend>(
    b: &B,
    params: &[&B::Tensor],
    saved_t: &[B::Tensor],
    dy: &B::Tensor,
    mode: Mode,
) -> Result<Backward<B>> {
    backward_wide(b, params, saved_t, dy, |p, s, dy| {
        batch_norm_backward_wide(b, p, s, dy, mode)
    })
}
