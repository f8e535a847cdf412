//! Token and learned positional embeddings.

use crate::error::{param, OpError, Result};
use crate::value::IdTensor;
use crate::{Backward, Forward};
use fusion_backend::{Backend, BinaryOp};

pub fn token_forward<B: Backend>(
    b: &B,
    ids: &IdTensor,
    params: &[&B::Tensor],
) -> Result<Forward<B>> {
    let table = param(params, 0, "embedding", "table")?;
    let rows = b.gather_rows(table, &ids.data)?;
    let mut shape = ids.shape.clone();
    shape.push(b.shape(table)[1]);
    // The residual stream starts here; a 16-bit run keeps it wide (see `precision`).
    Ok(Forward {
        output: b.widen(&b.reshape(&rows, &shape)?)?,
        saved: vec![],
        buffer_updates: vec![],
    })
}

pub fn token_backward<B: Backend>(
    b: &B,
    ids: &IdTensor,
    params: &[&B::Tensor],
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    let table = param(params, 0, "embedding", "table")?;
    let ts = b.shape(table);
    let dy2 = b.reshape(dy, &[ids.data.len(), ts[1]])?;
    let dt = b.scatter_add_rows(&dy2, &ids.data, ts[0])?;
    Ok(Backward {
        inputs: vec![None],
        params: vec![Some(dt)],
    })
}

fn dims<B: Backend>(b: &B, x: &B::Tensor) -> Result<(usize, usize, usize)> {
    match b.shape(x)[..] {
        [bs, t, d] => Ok((bs, t, d)),
        ref s => Err(OpError::Shape(format!(
            "positional embedding needs [B, T, D], got {s:?}"
        ))),
    }
}

pub fn position_forward<B: Backend>(
    b: &B,
    x: &B::Tensor,
    params: &[&B::Tensor],
) -> Result<Forward<B>> {
    let table = param(params, 0, "positional_embedding", "table")?;
    let (_, t, d) = dims(b, x)?;
    let pos = b.reshape(&b.narrow(table, 0, 0, t)?, &[1, t, d])?;
    Ok(Forward {
        output: b.binary(BinaryOp::Add, &b.widen(x)?, &b.widen(&pos)?)?,
        saved: vec![],
        buffer_updates: vec![],
    })
}

pub fn position_backward<B: Backend>(
    b: &B,
    params: &[&B::Tensor],
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    let table = param(params, 0, "positional_embedding", "table")?;
    let (_, t, d) = dims(b, dy)?;
    let t_max = b.shape(table)[0];
    let mut dt = b.reshape(&b.sum_keepdim(dy, &[0])?, &[t, d])?;
    if t < t_max {
        dt = b.cat(&[&dt, &b.zeros(&[t_max - t, d])?], 0)?;
    }
    Ok(Backward {
        inputs: vec![Some(dy.clone())],
        params: vec![Some(dt)],
    })
}
