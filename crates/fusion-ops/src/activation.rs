//! Element-wise activations and the residual sum.

use crate::error::Result;
use crate::{Backward, Forward};
use fusion_backend::{Backend, BinaryOp, UnaryOp};

fn plain<B: Backend>(output: B::Tensor) -> Forward<B> {
    Forward {
        output,
        saved: vec![],
        buffer_updates: vec![],
    }
}

pub fn gelu_forward<B: Backend>(b: &B, x: &B::Tensor) -> Result<Forward<B>> {
    Ok(plain(b.unary(UnaryOp::Gelu, x)?))
}

pub fn gelu_backward<B: Backend>(b: &B, x: &B::Tensor, dy: &B::Tensor) -> Result<Backward<B>> {
    let dx = match b.gelu_backward(x, dy)? {
        Some(dx) => dx,
        None => b.binary(BinaryOp::Mul, dy, &b.unary(UnaryOp::GeluGrad, x)?)?,
    };
    Ok(Backward {
        inputs: vec![Some(dx)],
        params: vec![],
    })
}

pub fn relu_forward<B: Backend>(b: &B, x: &B::Tensor) -> Result<Forward<B>> {
    Ok(plain(b.unary(UnaryOp::Relu, x)?))
}

pub fn relu_backward<B: Backend>(b: &B, x: &B::Tensor, dy: &B::Tensor) -> Result<Backward<B>> {
    let dx = b.binary(BinaryOp::Mul, dy, &b.unary(UnaryOp::ReluMask, x)?)?;
    Ok(Backward {
        inputs: vec![Some(dx)],
        params: vec![],
    })
}

pub fn add_forward<B: Backend>(b: &B, x: &B::Tensor, y: &B::Tensor) -> Result<Forward<B>> {
    if b.shape(x) != b.shape(y) {
        return Err(crate::OpError::Shape(format!(
            "add: {:?} vs {:?}",
            b.shape(x),
            b.shape(y)
        )));
    }
    // A residual sum is kept wide in a 16-bit run (see `precision`): after a pipeline boundary,
    // where the stream arrives in the compute precision, the first sum widens it again.
    Ok(plain(b.binary(
        BinaryOp::Add,
        &b.widen(x)?,
        &b.widen(y)?,
    )?))
}

/// `sigmoid(x)`, from the backend's primitives: `1 / (1 + exp(-x))`.
fn sigmoid<B: Backend>(b: &B, x: &B::Tensor) -> Result<B::Tensor> {
    let e = b.unary(UnaryOp::Exp, &b.unary(UnaryOp::Neg, x)?)?;
    Ok(b.unary(UnaryOp::Recip, &b.affine(&e, 1.0, 1.0)?)?)
}

/// SiLU (swish): `x * sigmoid(x)`.
pub fn silu_forward<B: Backend>(b: &B, x: &B::Tensor) -> Result<Forward<B>> {
    Ok(plain(b.binary(BinaryOp::Mul, x, &sigmoid(b, x)?)?))
}

/// `dx = dy * s * (1 + x * (1 - s))` with `s = sigmoid(x)`.
pub fn silu_backward<B: Backend>(b: &B, x: &B::Tensor, dy: &B::Tensor) -> Result<Backward<B>> {
    let s = sigmoid(b, x)?;
    let one_minus = b.affine(&s, -1.0, 1.0)?;
    let inner = b.affine(&b.binary(BinaryOp::Mul, x, &one_minus)?, 1.0, 1.0)?;
    let dx = b.binary(BinaryOp::Mul, dy, &b.binary(BinaryOp::Mul, &s, &inner)?)?;
    Ok(Backward {
        inputs: vec![Some(dx)],
        params: vec![],
    })
}

/// The element-wise product of two tensors of one shape (SwiGLU's gate times its input).
pub fn mul_forward<B: Backend>(b: &B, x: &B::Tensor, y: &B::Tensor) -> Result<Forward<B>> {
    if b.shape(x) != b.shape(y) {
        return Err(crate::OpError::Shape(format!(
            "mul: {:?} vs {:?}",
            b.shape(x),
            b.shape(y)
        )));
    }
    Ok(plain(b.binary(BinaryOp::Mul, x, y)?))
}

pub fn mul_backward<B: Backend>(
    b: &B,
    x: &B::Tensor,
    y: &B::Tensor,
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    Ok(Backward {
        inputs: vec![
            Some(b.binary(BinaryOp::Mul, dy, y)?),
            Some(b.binary(BinaryOp::Mul, dy, x)?),
        ],
        params: vec![],
    })
}
