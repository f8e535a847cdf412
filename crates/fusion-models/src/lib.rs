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

/// The graphs a device is profiled on (see `fusion_estimate::profile_backend`): a small one,
/// where per-operator overhead dominates, then larger ones of the same family, largest first,
/// where the matrix products do (the profile times the largest a device runs quickly).
/// Language models time two-layer GPT-2 graphs: 64 wide with a 512-token vocabulary at 1 × 16
/// tokens; then 512, 256 and 128 wide at 2 × 64 tokens with 8192, 4096 and 2048-token
/// vocabularies (about 8, 2.5 and 0.7 GFLOP: the first takes about 0.14 s on one core of a
/// 2026 CPU). Image models time the small ResNet at 2, then at 32 and 8 images.
pub fn calibration_graphs(language: bool) -> Result<Vec<fusion_graph::Graph>, ModelError> {
    let gpt2 = |vocab, n_embd, n_head| Gpt2Config {
        vocab,
        n_ctx: 128,
        n_embd,
        n_layer: 2,
        n_head,
    };
    Ok(if language {
        vec![
            gpt2(512, 64, 2).graph("calibration-small", 1, 16)?,
            gpt2(8192, 512, 8).graph("calibration-large", 2, 64)?,
            gpt2(4096, 256, 4).graph("calibration-medium", 2, 64)?,
            gpt2(2048, 128, 2).graph("calibration-modest", 2, 64)?,
        ]
    } else {
        let tiny = ModelSpec::preset("resnet-tiny")?;
        vec![tiny.graph(2, 0)?, tiny.graph(32, 0)?, tiny.graph(8, 0)?]
    })
}
