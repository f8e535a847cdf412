//! Models built as graphs with the [`fusion_graph::GraphBuilder`]: no kernels, only operators.
//!
//! Every model graph has the same contract: float or integer inputs named `tokens`/`images`,
//! integer `targets`/`labels`, and two outputs, `loss` (a `[1]` mean cross-entropy) and `logits`.

mod gpt2;
mod resnet;
mod spec;

pub use gpt2::Gpt2Config;
pub use resnet::{Block, ResNetConfig, Stem};
pub use spec::{ModelError, ModelKind, ModelSpec, PRESETS};
