//! Operator kinds, their shape rules and the parameters each one owns.

use crate::shape::DType;
use serde::{Deserialize, Serialize};

/// An operator at layer granularity. The semantics (forward and backward) are defined by the
/// `fusion-ops` crate against a backend-neutral trait, so any backend that implements the
/// primitives computes the same function.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Op {
    /// Token ids `[..]` (i32) -> rows of the table `[V, D]`: `[.., D]`.
    Embedding,
    /// Adds learned positions: `x [B, T, D]` + `pos[0..T]` where `pos` is `[T_max, D]`.
    PositionalEmbedding,
    /// `x [.., in]` -> `x W^T + b`, with `W [out, in]` and optional `b [out]`.
    Linear {
        bias: bool,
    },
    /// Normalises the last dimension, then scales by `gamma` and shifts by `beta`.
    LayerNorm {
        eps: f32,
    },
    /// Causal multi-head self-attention core: `qkv [B, T, 3C]` -> `[B, T, C]`
    /// (the projections around it are ordinary `Linear` nodes).
    CausalSelfAttention {
        n_head: usize,
    },
    /// GELU with the tanh approximation used by GPT-2.
    Gelu,
    Relu,
    /// Element-wise sum of two tensors of the same shape (residual connections).
    Add,
    /// `x [N, C, H, W]`, `w [O, C, k, k]` -> `[N, O, H', W']`.
    Conv2d {
        kernel: usize,
        stride: usize,
        padding: usize,
        bias: bool,
    },
    /// Batch normalisation over `N, H, W` per channel; running statistics are non-trainable
    /// buffers updated during training and used in evaluation.
    BatchNorm2d {
        eps: f32,
        momentum: f32,
    },
    MaxPool2d {
        kernel: usize,
        stride: usize,
        padding: usize,
    },
    /// Average pooling without padding.
    AvgPool2d {
        kernel: usize,
        stride: usize,
    },
    /// `[N, C, H, W]` -> `[N, C]`.
    GlobalAvgPool,
    /// `[N, ...]` -> `[N, prod(...)]`.
    Flatten,
    /// Mean softmax cross-entropy of `logits [.., V]` against `targets [..]` (i32): a `[1]` loss.
    SoftmaxCrossEntropy,
    /// RMS normalisation over the last dim with a gain (Llama).
    RmsNorm {
        eps: f32,
    },
    /// `x * sigmoid(x)`.
    Silu,
    /// The element-wise product of two tensors of one shape.
    Mul,
    /// Causal attention of `q [B, T, H*D]` over `k, v [B, T, Hkv*D]`, each key/value head
    /// serving `H / Hkv` query heads, queries and keys rotated by their position (RoPE with base
    /// `rope_theta`, the "rotate half" convention).
    GroupedQueryAttention {
        n_head: usize,
        n_kv_head: usize,
        rope_theta: f32,
    },
}

/// How a parameter is initialised before training.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Init {
    Zeros,
    Ones,
    Normal {
        std: f32,
    },
    /// Kaiming-normal for ReLU networks: std = sqrt(2 / fan_in).
    KaimingNormal {
        fan_in: usize,
    },
}

/// A parameter an operator needs, derived from its input shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSlot {
    pub role: &'static str,
    pub shape: Vec<usize>,
    pub trainable: bool,
    pub init: Init,
}

fn slot(role: &'static str, shape: Vec<usize>, init: Init) -> ParamSlot {
    ParamSlot {
        role,
        shape,
        trainable: true,
        init,
    }
}

fn buffer(role: &'static str, shape: Vec<usize>, init: Init) -> ParamSlot {
    ParamSlot {
        role,
        shape,
        trainable: false,
        init,
    }
}

/// Output shape of a convolution or pooling window along one axis.
pub fn window_out(size: usize, kernel: usize, stride: usize, padding: usize) -> Option<usize> {
    let padded = size + 2 * padding;
    if stride == 0 || kernel == 0 || padded < kernel {
        return None;
    }
    Some((padded - kernel) / stride + 1)
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Embedding => "embedding",
            Op::PositionalEmbedding => "positional_embedding",
            Op::Linear { .. } => "linear",
            Op::LayerNorm { .. } => "layer_norm",
            Op::CausalSelfAttention { .. } => "causal_self_attention",
            Op::Gelu => "gelu",
            Op::Relu => "relu",
            Op::Add => "add",
            Op::Conv2d { .. } => "conv2d",
            Op::BatchNorm2d { .. } => "batch_norm2d",
            Op::MaxPool2d { .. } => "max_pool2d",
            Op::AvgPool2d { .. } => "avg_pool2d",
            Op::GlobalAvgPool => "global_avg_pool",
            Op::Flatten => "flatten",
            Op::SoftmaxCrossEntropy => "softmax_cross_entropy",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Silu => "silu",
            Op::Mul => "mul",
            Op::GroupedQueryAttention { .. } => "grouped_query_attention",
        }
    }

    /// Number of tensor inputs the operator takes.
    pub fn num_inputs(&self) -> usize {
        match self {
            Op::Add | Op::Mul | Op::SoftmaxCrossEntropy => 2,
            Op::GroupedQueryAttention { .. } => 3,
            _ => 1,
        }
    }

    /// Parameters the operator needs for the given input shapes. `out_features` is the only
    /// hyper-parameter that cannot be derived from inputs, so `Linear` and `Conv2d` read it from
    /// the declared output shape instead.
    pub fn param_slots(&self, inputs: &[Vec<usize>], output: &[usize]) -> Vec<ParamSlot> {
        let last = |s: &[usize]| s.last().copied().unwrap_or(0);
        match self {
            Op::Embedding | Op::PositionalEmbedding => Vec::new(), // table shape given by builder
            Op::Linear { bias } => {
                let fan_in = last(&inputs[0]);
                let fan_out = last(output);
                let mut v = vec![slot(
                    "weight",
                    vec![fan_out, fan_in],
                    Init::Normal { std: 0.02 },
                )];
                if *bias {
                    v.push(slot("bias", vec![fan_out], Init::Zeros));
                }
                v
            }
            Op::LayerNorm { .. } => {
                let d = last(&inputs[0]);
                vec![
                    slot("gamma", vec![d], Init::Ones),
                    slot("beta", vec![d], Init::Zeros),
                ]
            }
            Op::RmsNorm { .. } => vec![slot("gamma", vec![last(&inputs[0])], Init::Ones)],
            Op::Conv2d { kernel, bias, .. } => {
                let c_in = inputs[0].get(1).copied().unwrap_or(0);
                let c_out = output.get(1).copied().unwrap_or(0);
                let fan_in = c_in * kernel * kernel;
                let mut v = vec![slot(
                    "weight",
                    vec![c_out, c_in, *kernel, *kernel],
                    Init::KaimingNormal { fan_in },
                )];
                if *bias {
                    v.push(slot("bias", vec![c_out], Init::Zeros));
                }
                v
            }
            Op::BatchNorm2d { .. } => {
                let c = inputs[0].get(1).copied().unwrap_or(0);
                vec![
                    slot("gamma", vec![c], Init::Ones),
                    slot("beta", vec![c], Init::Zeros),
                    buffer("running_mean", vec![c], Init::Zeros),
                    buffer("running_var", vec![c], Init::Ones),
                ]
            }
            _ => Vec::new(),
        }
    }

    /// Infers output shapes and dtypes from input shapes, dtypes and parameter shapes.
    /// `out_hint` is the declared output shape, needed only where the op cannot derive it
    /// (the feature count of `Linear` and `Conv2d`).
    pub fn infer(
        &self,
        inputs: &[(Vec<usize>, DType)],
        params: &[Vec<usize>],
        out_hint: Option<&[usize]>,
    ) -> Result<Vec<(Vec<usize>, DType)>, String> {
        if inputs.len() != self.num_inputs() {
            return Err(format!(
                "expects {} inputs, got {}",
                self.num_inputs(),
                inputs.len()
            ));
        }
        let (x, xd) = (&inputs[0].0, inputs[0].1);
        let need_float = |d: DType| {
            if d.is_float() {
                Ok(())
            } else {
                Err("expects a floating-point input".to_string())
            }
        };
        let f = |s: Vec<usize>| Ok(vec![(s, DType::F32)]);
        match self {
            Op::Embedding => {
                if xd != DType::I32 {
                    return Err("expects i32 token ids".into());
                }
                let table = params.first().ok_or("needs a table parameter")?;
                if table.len() != 2 {
                    return Err(format!("table must be [V, D], got {table:?}"));
                }
                let mut s = x.clone();
                s.push(table[1]);
                f(s)
            }
            Op::PositionalEmbedding => {
                need_float(xd)?;
                let table = params.first().ok_or("needs a position table parameter")?;
                if x.len() != 3 || table.len() != 2 || table[1] != x[2] || x[1] > table[0] {
                    return Err(format!("input {x:?} does not fit position table {table:?}"));
                }
                f(x.clone())
            }
            Op::Linear { .. } => {
                need_float(xd)?;
                let w = params.first().ok_or("needs a weight")?;
                if x.is_empty() || w.len() != 2 || w[1] != x[x.len() - 1] {
                    return Err(format!("input {x:?} does not fit weight {w:?} ([out, in])"));
                }
                let mut s = x.clone();
                let n = s.len();
                s[n - 1] = w[0];
                f(s)
            }
            Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::Gelu | Op::Relu | Op::Silu => {
                need_float(xd)?;
                if x.is_empty() {
                    return Err("expects at least one dimension".into());
                }
                f(x.clone())
            }
            Op::CausalSelfAttention { n_head } => {
                need_float(xd)?;
                if x.len() != 3 || x[2] % 3 != 0 {
                    return Err(format!("expects qkv [B, T, 3C], got {x:?}"));
                }
                let c = x[2] / 3;
                if *n_head == 0 || c % n_head != 0 {
                    return Err(format!(
                        "model width {c} is not divisible by {n_head} heads"
                    ));
                }
                f(vec![x[0], x[1], c])
            }
            Op::GroupedQueryAttention {
                n_head, n_kv_head, ..
            } => {
                for (s, d) in inputs {
                    need_float(*d)?;
                    if s.len() != 3 || x.len() != 3 || s[..2] != x[..2] {
                        return Err(format!("expects q, k, v [B, T, heads*D], got {s:?}"));
                    }
                }
                let (h, kv) = (*n_head, *n_kv_head);
                let fits = h > 0 && kv > 0 && h % kv == 0 && x[2] % h == 0;
                let d = if fits { x[2] / h } else { 0 };
                if !fits || d % 2 != 0 || inputs[1].0[2] != kv * d || inputs[2].0 != inputs[1].0 {
                    return Err(format!(
                        "{h} query and {kv} key/value heads of an even width cannot take q {x:?}, \
                         k {:?}, v {:?}",
                        inputs[1].0, inputs[2].0
                    ));
                }
                f(x.clone())
            }
            Op::Add | Op::Mul => {
                need_float(xd)?;
                if inputs[1].0 != *x {
                    return Err(format!("shapes differ: {x:?} vs {:?}", inputs[1].0));
                }
                f(x.clone())
            }
            Op::Conv2d {
                kernel,
                stride,
                padding,
                ..
            } => {
                need_float(xd)?;
                if x.len() != 4 {
                    return Err(format!("expects [N, C, H, W], got {x:?}"));
                }
                let c_out = match (params.first(), out_hint) {
                    (Some(w), _) if w.len() == 4 => w[0],
                    (_, Some(o)) if o.len() == 4 => o[1],
                    _ => return Err("cannot determine output channels".into()),
                };
                let h = window_out(x[2], *kernel, *stride, *padding);
                let w = window_out(x[3], *kernel, *stride, *padding);
                match (h, w) {
                    (Some(h), Some(w)) => f(vec![x[0], c_out, h, w]),
                    _ => Err(format!("kernel {kernel} does not fit input {x:?}")),
                }
            }
            Op::BatchNorm2d { .. } => {
                need_float(xd)?;
                if x.len() != 4 {
                    return Err(format!("expects [N, C, H, W], got {x:?}"));
                }
                f(x.clone())
            }
            Op::MaxPool2d {
                kernel,
                stride,
                padding,
            } => {
                need_float(xd)?;
                if x.len() != 4 || *padding * 2 > *kernel {
                    return Err(format!(
                        "expects [N, C, H, W] and padding <= kernel/2, got {x:?}"
                    ));
                }
                match (
                    window_out(x[2], *kernel, *stride, *padding),
                    window_out(x[3], *kernel, *stride, *padding),
                ) {
                    (Some(h), Some(w)) => f(vec![x[0], x[1], h, w]),
                    _ => Err(format!("window {kernel} does not fit input {x:?}")),
                }
            }
            Op::AvgPool2d { kernel, stride } => {
                need_float(xd)?;
                if x.len() != 4 {
                    return Err(format!("expects [N, C, H, W], got {x:?}"));
                }
                match (
                    window_out(x[2], *kernel, *stride, 0),
                    window_out(x[3], *kernel, *stride, 0),
                ) {
                    (Some(h), Some(w)) => f(vec![x[0], x[1], h, w]),
                    _ => Err(format!("window {kernel} does not fit input {x:?}")),
                }
            }
            Op::GlobalAvgPool => {
                need_float(xd)?;
                if x.len() != 4 {
                    return Err(format!("expects [N, C, H, W], got {x:?}"));
                }
                f(vec![x[0], x[1]])
            }
            Op::Flatten => {
                need_float(xd)?;
                if x.is_empty() {
                    return Err("expects at least one dimension".into());
                }
                f(vec![x[0], x[1..].iter().product()])
            }
            Op::SoftmaxCrossEntropy => {
                need_float(xd)?;
                let (t, td) = (&inputs[1].0, inputs[1].1);
                if td != DType::I32 {
                    return Err("targets must be i32 class ids".into());
                }
                if x.len() != t.len() + 1 || x[..t.len()] != t[..] {
                    return Err(format!("logits {x:?} do not match targets {t:?}"));
                }
                f(vec![1])
            }
        }
    }
}
