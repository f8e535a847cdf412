//! Deterministic feeds and small models shared by the executor tests.

use fusion_backend::Backend;
use fusion_exec::{IdTensor, Value};
use fusion_graph::{Graph, TensorId};
use fusion_models::{Block, Gpt2Config, ResNetConfig, Stem};
use std::collections::HashMap;

/// A 3-layer GPT-2 of width 8 over 13 tokens, batch 2 x 6.
#[allow(dead_code)]
pub fn small_gpt() -> Graph {
    Gpt2Config {
        vocab: 13,
        n_ctx: 8,
        n_embd: 8,
        n_layer: 3,
        n_head: 2,
    }
    .graph("gpt", 2, 6)
    .unwrap()
}

/// A bottleneck ResNet with batch norm over 16 x 16 single-channel images, 3 classes.
#[allow(dead_code)]
pub fn small_resnet() -> Graph {
    ResNetConfig {
        block: Block::Bottleneck,
        layers: vec![1, 2],
        widths: vec![2, 4],
        stem: Stem::ImageNet,
        in_channels: 1,
        image_size: 16,
        classes: 3,
    }
    .graph("resnet", 3)
    .unwrap()
}

/// A value for every graph input: floats in [-1, 1), integer ids below `classes`.
pub fn feeds<B: Backend>(b: &B, g: &Graph, classes: u32) -> HashMap<TensorId, Value<B>> {
    g.inputs
        .iter()
        .enumerate()
        .map(|(k, t)| {
            let info = g.tensor(*t);
            let n = info.numel();
            let v = if info.dtype.is_float() {
                Value::Float(
                    b.upload_f64(
                        (0..n)
                            .map(|i| ((i * 37 + k) % 17) as f64 / 8.5 - 1.0)
                            .collect(),
                        &info.shape,
                    )
                    .unwrap(),
                )
            } else {
                Value::Ids(
                    IdTensor::new(
                        (0..n).map(|i| ((i * 7 + 3 * k) as u32) % classes).collect(),
                        info.shape.clone(),
                    )
                    .unwrap(),
                )
            };
            (*t, v)
        })
        .collect()
}
