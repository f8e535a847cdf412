//! Which values a 16-bit run keeps wide.
//!
//! In a bf16 or f16 run the residual stream stays in `f32`, as mixed precision does elsewhere
//! (PyTorch's autocast promotes `bf16 + f32` to `f32`): the embeddings and every residual sum are
//! wide, and only the normalisations, which widen their input anyway, read them as they are.
//! Every other operator computes in the compute precision and is handed narrowed inputs
//! ([`admit`]). A block's small update added to a 16-bit stream would round away at 8 bits of
//! mantissa (bf16); kept wide, it accumulates over the layers.
//!
//! Gradients take the format of their value ([`cast_grads_like`]): the stream's gradient sums
//! the blocks' contributions in `f32` too. In an `f32` or `f64` run nothing here changes a value.

use crate::error::Result;
use crate::{Backward, Value};
use fusion_backend::Backend;
use fusion_graph::Op;

/// Whether `op` reads wide inputs as they are (the residual sums and normalisations), instead
/// of their compute-precision copies.
pub fn reads_wide(op: &Op) -> bool {
    matches!(
        op,
        Op::Add | Op::PositionalEmbedding | Op::LayerNorm { .. } | Op::RmsNorm { .. }
    )
}

/// `op`'s inputs as it computes on them: in a 16-bit run, wide float inputs of an operator
/// that does not [`reads_wide`] are narrowed to the compute precision; otherwise each is
/// returned as it is (a cheap clone).
pub fn admit<B: Backend>(b: &B, op: &Op, inputs: &[&Value<B>]) -> Result<Vec<Value<B>>> {
    let narrow = b.precision().is_half() && !reads_wide(op);
    inputs
        .iter()
        .map(|v| match v {
            Value::Float(t) if narrow => Ok(Value::Float(b.to_compute(t)?)),
            _ => Ok((*v).clone()),
        })
        .collect()
}

/// `g` with each input's gradient in the format of that input (as [`admit`] handed it over).
pub(crate) fn cast_grads_like<B: Backend>(
    b: &B,
    inputs: &[Value<B>],
    g: Backward<B>,
) -> Result<Backward<B>> {
    if !b.precision().is_half() {
        return Ok(g);
    }
    let inputs_grads = g
        .inputs
        .into_iter()
        .zip(inputs)
        .map(|(gi, v)| match (gi, v) {
            (Some(gi), Value::Float(x)) => Ok(Some(b.cast_like(&gi, x)?)),
            (gi, _) => Ok(gi),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Backward {
        inputs: inputs_grads,
        params: g.params,
    })
}
