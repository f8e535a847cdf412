//! 2-D convolution with an optional per-channel bias.

use crate::error::{param, Result};
use crate::{Backward, Forward};
use fusion_backend::{Backend, BinaryOp, Window};

pub(crate) fn window(kernel: usize, stride: usize, padding: usize) -> Window {
    Window {
        kernel,
        stride,
        padding,
    }
}

pub fn forward<B: Backend>(
    b: &B,
    x: &B::Tensor,
    params: &[&B::Tensor],
    win: Window,
) -> Result<Forward<B>> {
    let w = param(params, 0, "conv2d", "weight")?;
    let mut y = b.conv2d(x, w, win)?;
    if let Some(bias) = params.get(1) {
        let c = b.shape(bias)[0];
        y = b.binary(BinaryOp::Add, &y, &b.reshape(bias, &[1, c, 1, 1])?)?;
    }
    Ok(Forward {
        output: y,
        saved: vec![],
        buffer_updates: vec![],
    })
}

pub fn backward<B: Backend>(
    b: &B,
    x: &B::Tensor,
    params: &[&B::Tensor],
    dy: &B::Tensor,
    win: Window,
) -> Result<Backward<B>> {
    let w = param(params, 0, "conv2d", "weight")?;
    let dx = b.conv2d_backward_input(dy, w, &b.shape(x), win)?;
    let dw = b.conv2d_backward_weight(x, dy, win)?;
    let mut grads = vec![Some(dw)];
    if params.len() > 1 {
        let c = b.shape(dy)[1];
        grads.push(Some(b.reshape(&b.sum_keepdim(dy, &[0, 2, 3])?, &[c])?));
    }
    Ok(Backward {
        inputs: vec![Some(dx)],
        params: grads,
    })
}
