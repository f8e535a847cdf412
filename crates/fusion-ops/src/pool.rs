//! Pooling and flattening.

use crate::error::{OpError, Result};
use crate::{Backward, Forward};
use fusion_backend::{Backend, BinaryOp, Window};

fn plain<B: Backend>(output: B::Tensor) -> Forward<B> {
    Forward {
        output,
        saved: vec![],
        buffer_updates: vec![],
    }
}

fn only_input<B: Backend>(dx: B::Tensor) -> Backward<B> {
    Backward {
        inputs: vec![Some(dx)],
        params: vec![],
    }
}

pub fn max_forward<B: Backend>(b: &B, x: &B::Tensor, win: Window) -> Result<Forward<B>> {
    Ok(plain(b.max_pool2d(x, win)?))
}

pub fn max_backward<B: Backend>(
    b: &B,
    x: &B::Tensor,
    dy: &B::Tensor,
    win: Window,
) -> Result<Backward<B>> {
    Ok(only_input(b.max_pool2d_backward(x, dy, win)?))
}

pub fn avg_forward<B: Backend>(b: &B, x: &B::Tensor, win: Window) -> Result<Forward<B>> {
    Ok(plain(b.avg_pool2d(x, win)?))
}

pub fn avg_backward<B: Backend>(
    b: &B,
    x: &B::Tensor,
    dy: &B::Tensor,
    win: Window,
) -> Result<Backward<B>> {
    Ok(only_input(b.avg_pool2d_backward(dy, &b.shape(x), win)?))
}

fn nchw<B: Backend>(b: &B, x: &B::Tensor) -> Result<[usize; 4]> {
    match b.shape(x)[..] {
        [n, c, h, w] => Ok([n, c, h, w]),
        ref s => Err(OpError::Shape(format!(
            "global average pool needs [N, C, H, W], got {s:?}"
        ))),
    }
}

pub fn global_avg_forward<B: Backend>(b: &B, x: &B::Tensor) -> Result<Forward<B>> {
    let [n, c, h, w] = nchw(b, x)?;
    let s = b.affine(&b.sum_keepdim(x, &[2, 3])?, 1.0 / (h * w) as f64, 0.0)?;
    Ok(plain(b.reshape(&s, &[n, c])?))
}

pub fn global_avg_backward<B: Backend>(
    b: &B,
    x: &B::Tensor,
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    let [n, c, h, w] = nchw(b, x)?;
    let spread = b.binary(
        BinaryOp::Add,
        &b.zeros(&[n, c, h, w])?,
        &b.reshape(dy, &[n, c, 1, 1])?,
    )?;
    Ok(only_input(b.affine(&spread, 1.0 / (h * w) as f64, 0.0)?))
}

pub fn flatten_forward<B: Backend>(b: &B, x: &B::Tensor) -> Result<Forward<B>> {
    let s = b.shape(x);
    let n = s.first().copied().unwrap_or(1);
    Ok(plain(b.reshape(x, &[n, s.iter().skip(1).product()])?))
}

pub fn flatten_backward<B: Backend>(b: &B, x: &B::Tensor, dy: &B::Tensor) -> Result<Backward<B>> {
    Ok(only_input(b.reshape(dy, &b.shape(x))?))
}
