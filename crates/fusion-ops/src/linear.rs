//! Fully connected layer: `y = x W^T + b` with `W [out, in]`.

use crate::error::{param, Result};
use crate::{Backward, Forward};
use fusion_backend::{Backend, BinaryOp};

/// Views `x [.., d]` as a matrix `[rows, d]`.
pub(crate) fn as_rows<B: Backend>(b: &B, x: &B::Tensor) -> Result<B::Tensor> {
    let s = b.shape(x);
    let d = s.last().copied().unwrap_or(1);
    Ok(b.reshape(x, &[s.iter().product::<usize>() / d.max(1), d])?)
}

pub fn forward<B: Backend>(b: &B, x: &B::Tensor, params: &[&B::Tensor]) -> Result<Forward<B>> {
    let w = param(params, 0, "linear", "weight")?;
    let mut out_shape = b.shape(x);
    let out_features = b.shape(w)[0];
    if let Some(l) = out_shape.last_mut() {
        *l = out_features;
    }
    let x2 = as_rows(b, x)?;
    let fused = match params.get(1) {
        Some(bias) => b.linear_bias(&x2, w, bias)?,
        None => None,
    };
    let y = match (fused, params.get(1)) {
        (Some(y), _) => y,
        (None, Some(bias)) => b.binary(
            BinaryOp::Add,
            &b.matmul(&x2, w, false, true)?,
            &b.reshape(bias, &[1, out_features])?,
        )?,
        (None, None) => b.matmul(&x2, w, false, true)?,
    };
    Ok(Forward {
        output: b.reshape(&y, &out_shape)?,
        saved: vec![],
        buffer_updates: vec![],
    })
}

pub fn backward<B: Backend>(
    b: &B,
    x: &B::Tensor,
    params: &[&B::Tensor],
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    let w = param(params, 0, "linear", "weight")?;
    let x2 = as_rows(b, x)?;
    let dy2 = as_rows(b, dy)?;
    let dx = b.reshape(&b.matmul(&dy2, w, false, false)?, &b.shape(x))?;
    let dw = b.matmul(&dy2, &x2, true, false)?;
    let mut grads = vec![Some(dw)];
    if params.len() > 1 {
        let out_features = b.shape(w)[0];
        grads.push(Some(
            b.reshape(&b.sum_keepdim(&dy2, &[0])?, &[out_features])?,
        ));
    }
    Ok(Backward {
        inputs: vec![Some(dx)],
        params: grads,
    })
}
