//! Models built as graphs with the [`fusion_graph::GraphBuilder`]: no kernels, only operators.
//!
//! Every model graph has the same contract: two inputs, integer token ids `[B, T]` or float
//! images `[B, C, H, W]`, then integer targets (`[B, T]` or `[B]`); and two outputs, the loss (a
//! `[1]` mean cross-entropy), then the logits. A graph read from a file (`file.rs`) is checked
//! against it.

mod file;
mod gpt2;
mod llama;
mod resnet;
mod spec;

pub use file::{is_model_file, GraphModel, MAX_DIMENSION, MAX_LAYERS, MAX_MODEL_FILE};
pub use gpt2::Gpt2Config;
pub use llama::LlamaConfig;
pub use resnet::{Block, ResNetConfig, Stem};
pub use spec::{ModelError, ModelKind, ModelSpec, PRESETS};
