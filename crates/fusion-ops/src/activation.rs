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
    let dx = b.binary(BinaryOp::Mul, dy, &b.unary(UnaryOp::GeluGrad, x)?)?;
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
    Ok(plain(b.binary(BinaryOp::Add, x, y)?))
}
