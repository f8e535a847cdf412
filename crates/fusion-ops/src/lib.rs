//! Operator semantics: forward and hand-written backward (vector-Jacobian product) for every
//! [`Op`], composed from [`Backend`] primitives. The DAG executor calls [`forward`] and
//! [`backward`] node by node; nothing here knows whether the neighbours of a node run on the
//! same machine.

mod activation;
mod attention;
mod conv;
mod embedding;
mod error;
mod linear;
mod loss;
mod norm;
mod pool;
mod precision;
mod rotary;
mod value;

pub use error::{OpError, Result};
pub use precision::{admit, reads_wide};
pub use value::{IdTensor, Value};

use fusion_backend::Backend;
use fusion_graph::Op;

/// Whether the pass is part of training (batch norm uses batch statistics and updates its
/// running statistics) or evaluation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Train,
    Eval,
}

/// Result of a node's forward pass.
pub struct Forward<B: Backend> {
    pub output: B::Tensor,
    /// Intermediate tensors the backward pass needs besides the node's inputs and parameters.
    pub saved: Vec<B::Tensor>,
    /// New values for non-trainable buffers, by parameter slot (batch-norm running statistics).
    pub buffer_updates: Vec<(usize, B::Tensor)>,
}

/// Result of a node's backward pass: one gradient per input (None for integer inputs) and one
/// per parameter slot (None for buffers).
pub struct Backward<B: Backend> {
    pub inputs: Vec<Option<B::Tensor>>,
    pub params: Vec<Option<B::Tensor>>,
}

fn check_arity<B: Backend>(op: &Op, inputs: &[&Value<B>]) -> Result<()> {
    if inputs.len() != op.num_inputs() {
        return Err(OpError::Arity {
            op: op.name(),
            expected: op.num_inputs(),
            found: inputs.len(),
        });
    }
    Ok(())
}

/// The three float inputs of an attention operator.
fn floats3<'a, B: Backend>(inputs: &[&'a Value<B>]) -> Result<[&'a B::Tensor; 3]> {
    Ok([inputs[0].float()?, inputs[1].float()?, inputs[2].float()?])
}

/// Runs one operator forward.
pub fn forward<B: Backend>(
    b: &B,
    op: &Op,
    inputs: &[&Value<B>],
    params: &[&B::Tensor],
    mode: Mode,
) -> Result<Forward<B>> {
    check_arity(op, inputs)?;
    let admitted = admit(b, op, inputs)?;
    let inputs: Vec<&Value<B>> = admitted.iter().collect();
    match op {
        Op::Embedding => embedding::token_forward(b, inputs[0].ids()?, params),
        Op::PositionalEmbedding => embedding::position_forward(b, inputs[0].float()?, params),
        Op::Linear { .. } => linear::forward(b, inputs[0].float()?, params),
        Op::LayerNorm { eps } => norm::layer_norm_forward(b, inputs[0].float()?, params, *eps),
        Op::CausalSelfAttention { n_head } => attention::forward(b, inputs[0].float()?, *n_head),
        Op::Gelu => activation::gelu_forward(b, inputs[0].float()?),
        Op::Relu => activation::relu_forward(b, inputs[0].float()?),
        Op::Add => activation::add_forward(b, inputs[0].float()?, inputs[1].float()?),
        Op::Conv2d {
            kernel,
            stride,
            padding,
            ..
        } => conv::forward(
            b,
            inputs[0].float()?,
            params,
            conv::window(*kernel, *stride, *padding),
        ),
        Op::BatchNorm2d { eps, momentum } => {
            norm::batch_norm_forward(b, inputs[0].float()?, params, *eps, *momentum, mode)
        }
        Op::MaxPool2d {
            kernel,
            stride,
            padding,
        } => pool::max_forward(
            b,
            inputs[0].float()?,
            conv::window(*kernel, *stride, *padding),
        ),
        Op::AvgPool2d { kernel, stride } => {
            pool::avg_forward(b, inputs[0].float()?, conv::window(*kernel, *stride, 0))
        }
        Op::GlobalAvgPool => pool::global_avg_forward(b, inputs[0].float()?),
        Op::Flatten => pool::flatten_forward(b, inputs[0].float()?),
        Op::SoftmaxCrossEntropy => loss::forward(b, inputs[0].float()?, inputs[1].ids()?),
        Op::RmsNorm { eps } => norm::rms_norm_forward(b, inputs[0].float()?, params, *eps),
        Op::Silu => activation::silu_forward(b, inputs[0].float()?),
        Op::Mul => activation::mul_forward(b, inputs[0].float()?, inputs[1].float()?),
        Op::GroupedQueryAttention {
            n_head,
            n_kv_head,
            rope_theta,
        } => rotary::forward(b, floats3(&inputs)?, *n_head, *n_kv_head, *rope_theta),
    }
}

/// Runs one operator backward: given the gradient of the loss with respect to the output, returns
/// the gradients with respect to its inputs (each in its input's format, see [`admit`]) and
/// parameters.
pub fn backward<B: Backend>(
    b: &B,
    op: &Op,
    inputs: &[&Value<B>],
    params: &[&B::Tensor],
    saved: &[B::Tensor],
    dy: &B::Tensor,
    mode: Mode,
) -> Result<Backward<B>> {
    check_arity(op, inputs)?;
    let admitted = admit(b, op, inputs)?;
    let refs: Vec<&Value<B>> = admitted.iter().collect();
    let g = vjp(b, op, &refs, params, saved, dy, mode)?;
    precision::cast_grads_like(b, &admitted, g)
}

fn vjp<B: Backend>(
    b: &B,
    op: &Op,
    inputs: &[&Value<B>],
    params: &[&B::Tensor],
    saved: &[B::Tensor],
    dy: &B::Tensor,
    mode: Mode,
) -> Result<Backward<B>> {
    match op {
        Op::Embedding => embedding::token_backward(b, inputs[0].ids()?, params, dy),
        Op::PositionalEmbedding => embedding::position_backward(b, params, dy),
        Op::Linear { .. } => linear::backward(b, inputs[0].float()?, params, dy),
        Op::LayerNorm { .. } => norm::layer_norm_backward(b, params, saved, dy),
        Op::CausalSelfAttention { n_head } => {
            attention::backward(b, inputs[0].float()?, *n_head, saved, dy)
        }
        Op::Gelu => activation::gelu_backward(b, inputs[0].float()?, dy),
        Op::Relu => activation::relu_backward(b, inputs[0].float()?, dy),
        Op::Add => Ok(Backward {
            inputs: vec![Some(dy.clone()), Some(dy.clone())],
            params: vec![],
        }),
        Op::Conv2d {
            kernel,
            stride,
            padding,
            ..
        } => conv::backward(
            b,
            inputs[0].float()?,
            params,
            dy,
            conv::window(*kernel, *stride, *padding),
        ),
        Op::BatchNorm2d { .. } => norm::batch_norm_backward(b, params, saved, dy, mode),
        Op::MaxPool2d {
            kernel,
            stride,
            padding,
        } => pool::max_backward(
            b,
            inputs[0].float()?,
            dy,
            conv::window(*kernel, *stride, *padding),
        ),
        Op::AvgPool2d { kernel, stride } => {
            pool::avg_backward(b, inputs[0].float()?, dy, conv::window(*kernel, *stride, 0))
        }
        Op::GlobalAvgPool => pool::global_avg_backward(b, inputs[0].float()?, dy),
        Op::Flatten => pool::flatten_backward(b, inputs[0].float()?, dy),
        Op::SoftmaxCrossEntropy => {
            loss::backward(b, inputs[0].float()?, inputs[1].ids()?, saved, dy)
        }
        Op::RmsNorm { .. } => norm::rms_norm_backward(b, params, saved, dy),
        Op::Silu => activation::silu_backward(b, inputs[0].float()?, dy),
        Op::Mul => activation::mul_backward(b, inputs[0].float()?, inputs[1].float()?, dy),
        Op::GroupedQueryAttention {
            n_head,
            n_kv_head,
            rope_theta,
        } => rotary::backward(
            b,
            floats3(inputs)?,
            *n_head,
            *n_kv_head,
            *rope_theta,
            saved,
            dy,
        ),
    }
}
