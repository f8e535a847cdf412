//! Named presets and a single description of "the model to train".

use crate::gpt2::Gpt2Config;
use crate::resnet::ResNetConfig;
use fusion_graph::{Graph, GraphError};
use serde::{Deserialize, Serialize};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("unknown model preset '{0}' (known: {known})", known = PRESETS.join(", "))]
    UnknownPreset(String),
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// Every preset name `ModelSpec::preset` accepts.
pub const PRESETS: &[&str] = &[
    "gpt2-tiny",
    "gpt2-small",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnet18-small",
    "resnet34-small",
    "resnet50-small",
    "resnet-tiny",
];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "family", rename_all = "snake_case")]
pub enum ModelKind {
    Gpt2(Gpt2Config),
    ResNet(ResNetConfig),
}

/// A model: its preset name and architecture.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub name: String,
    pub kind: ModelKind,
}

impl ModelSpec {
    pub fn preset(name: &str) -> Result<Self, ModelError> {
        let kind = match name {
            "gpt2-tiny" => ModelKind::Gpt2(Gpt2Config::tiny()),
            "gpt2-small" | "gpt2" => ModelKind::Gpt2(Gpt2Config::small()),
            "gpt2-medium" => ModelKind::Gpt2(Gpt2Config::medium()),
            "gpt2-large" => ModelKind::Gpt2(Gpt2Config::large()),
            "gpt2-xl" => ModelKind::Gpt2(Gpt2Config::xl()),
            "resnet-tiny" => ModelKind::ResNet(ResNetConfig::tiny()),
            _ => {
                let (depth, small) = match name.strip_prefix("resnet") {
                    Some(rest) => match rest.strip_suffix("-small") {
                        Some(d) => (d.parse::<usize>().ok(), true),
                        None => (rest.parse::<usize>().ok(), false),
                    },
                    None => (None, false),
                };
                let cfg = depth.and_then(|d| {
                    if small {
                        ResNetConfig::small_image(d)
                    } else {
                        ResNetConfig::imagenet(d)
                    }
                });
                ModelKind::ResNet(cfg.ok_or_else(|| ModelError::UnknownPreset(name.to_string()))?)
            }
        };
        Ok(ModelSpec {
            name: name.to_string(),
            kind,
        })
    }

    /// Whether the model consumes token sequences (else images).
    pub fn is_language_model(&self) -> bool {
        matches!(self.kind, ModelKind::Gpt2(_))
    }

    /// The training graph for one micro-batch (`seq` is ignored by image models).
    pub fn graph(&self, batch: usize, seq: usize) -> Result<Graph, ModelError> {
        Ok(match &self.kind {
            ModelKind::Gpt2(c) => c.graph(&self.name, batch, seq)?,
            ModelKind::ResNet(c) => c.graph(&self.name, batch)?,
        })
    }

    /// The default context length (GPT-2) or 0.
    pub fn context(&self) -> usize {
        match &self.kind {
            ModelKind::Gpt2(c) => c.n_ctx,
            ModelKind::ResNet(_) => 0,
        }
    }

    /// Sets the vocabulary of a language model (to match the tokenizer of the data).
    pub fn with_vocab(mut self, vocab: usize) -> Self {
        if let ModelKind::Gpt2(c) = &mut self.kind {
            c.vocab = vocab;
        }
        self
    }

    /// Sets the number of classes and input geometry of an image model (to match the data).
    pub fn with_images(mut self, channels: usize, size: usize, classes: usize) -> Self {
        if let ModelKind::ResNet(c) = &mut self.kind {
            c.in_channels = channels;
            c.image_size = size;
            c.classes = classes;
        }
        self
    }
}
