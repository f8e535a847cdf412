//! Named presets and a single description of "the model to train".

use crate::file::GraphModel;
use crate::gpt2::Gpt2Config;
use crate::llama::LlamaConfig;
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
    /// A model file that cannot be read or parsed, or whose architecture does not build.
    #[error("model file {path}: {reason}")]
    File { path: String, reason: String },
    /// A graph that breaks the model contract, or a run it does not fit.
    #[error("{0}")]
    Contract(String),
}

/// Every preset name `ModelSpec::preset` accepts.
pub const PRESETS: &[&str] = &[
    "gpt2-tiny",
    "gpt2-small",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "llama-tiny",
    "smollm-135m",
    "tinyllama-1.1b",
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
    Llama(LlamaConfig),
    ResNet(ResNetConfig),
    /// A fixed OP-DAG from a file.
    Graph(Box<GraphModel>),
}

/// A model: its preset name and architecture.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub name: String,
    pub kind: ModelKind,
    /// The vocabulary belongs to the weights (a published model): data is not allowed to change
    /// it, and a tokenizer with more tokens does not fit.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fixed_vocab: bool,
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
            "llama-tiny" => ModelKind::Llama(LlamaConfig::tiny()),
            "smollm-135m" => ModelKind::Llama(LlamaConfig::smollm_135m()),
            "tinyllama-1.1b" => ModelKind::Llama(LlamaConfig::tinyllama_1b()),
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
            fixed_vocab: false,
        })
    }

    /// Whether the model consumes token sequences (else images).
    pub fn is_language_model(&self) -> bool {
        match &self.kind {
            ModelKind::Gpt2(_) | ModelKind::Llama(_) => true,
            ModelKind::ResNet(_) => false,
            ModelKind::Graph(g) => g.is_language_model(),
        }
    }

    /// The training graph for one micro-batch (`seq` is ignored by image models).
    pub fn graph(&self, batch: usize, seq: usize) -> Result<Graph, ModelError> {
        Ok(match &self.kind {
            ModelKind::Gpt2(c) => c.graph(&self.name, batch, seq)?,
            ModelKind::Llama(c) => c.graph(&self.name, batch, seq)?,
            ModelKind::ResNet(c) => c.graph(&self.name, batch)?,
            ModelKind::Graph(g) => g.graph(batch, seq)?,
        })
    }

    /// Trainable parameter values.
    pub fn parameters(&self) -> usize {
        match &self.kind {
            ModelKind::Graph(g) => g.as_graph().num_trainable(),
            _ => self.graph(1, 1).map(|g| g.num_trainable()).unwrap_or(0),
        }
    }

    /// The micro-batch (sequences or images) and sequence length a fixed graph was built for;
    /// None for an architecture, which builds any.
    pub fn fixed_shape(&self) -> Option<(usize, usize)> {
        match &self.kind {
            ModelKind::Graph(g) => Some((g.batch(), g.seq())),
            _ => None,
        }
    }

    /// The default context length (GPT-2) or 0.
    pub fn context(&self) -> usize {
        match &self.kind {
            ModelKind::Gpt2(c) => c.n_ctx,
            ModelKind::Llama(c) => c.n_ctx,
            ModelKind::ResNet(_) => 0,
            ModelKind::Graph(g) => g.seq(),
        }
    }

    /// Sets the vocabulary of a language model (to match the tokenizer of the data); a fixed
    /// graph keeps its own (see [`ModelSpec::fits_text`]).
    pub fn with_vocab(mut self, vocab: usize) -> Self {
        if self.fixed_vocab {
            return self;
        }
        match &mut self.kind {
            ModelKind::Gpt2(c) => c.vocab = vocab,
            ModelKind::Llama(c) => c.vocab = vocab,
            _ => {}
        }
        self
    }

    /// Sets the number of classes and input geometry of an image model (to match the data); a
    /// fixed graph keeps its own (see [`ModelSpec::fits_images`]).
    pub fn with_images(mut self, channels: usize, size: usize, classes: usize) -> Self {
        if let ModelKind::ResNet(c) = &mut self.kind {
            c.in_channels = channels;
            c.image_size = size;
            c.classes = classes;
        }
        self
    }

    /// The vocabulary of a language model (None for an image model).
    pub fn vocab(&self) -> Option<usize> {
        match &self.kind {
            ModelKind::Gpt2(c) => Some(c.vocab),
            ModelKind::Llama(c) => Some(c.vocab),
            ModelKind::ResNet(_) => None,
            ModelKind::Graph(g) => g.is_language_model().then(|| g.classes()),
        }
    }

    /// Whether text of a `vocab`-token tokenizer fits: presets adapt, a fixed graph or a model
    /// whose vocabulary belongs to its weights must score at least that many tokens.
    pub fn fits_text(&self, vocab: usize) -> Result<(), ModelError> {
        if let (true, Some(own)) = (self.fixed_vocab, self.vocab()) {
            if own < vocab {
                return Err(ModelError::Contract(format!(
                    "model '{}' has a vocabulary of {own} tokens, fixed by its weights; the \
                     data's tokenizer has {vocab} (tokenize with the model's own tokenizer; --tokenizer bytes fits any vocabulary of 256 or more)",
                    self.name
                )));
            }
        }
        match &self.kind {
            ModelKind::Graph(g) if g.classes() < vocab => Err(ModelError::Contract(format!(
                "graph '{}' scores {} tokens; the data's tokenizer has {vocab}",
                self.name,
                g.classes()
            ))),
            _ => Ok(()),
        }
    }

    /// Whether images of `channels` x `size` x `size` in `classes` classes fit: presets adapt, a
    /// fixed graph must have exactly that geometry.
    pub fn fits_images(
        &self,
        channels: usize,
        size: usize,
        classes: usize,
    ) -> Result<(), ModelError> {
        let ModelKind::Graph(g) = &self.kind else {
            return Ok(());
        };
        let shape = g.data_shape();
        if shape[1..] == [channels, size, size] && g.classes() == classes {
            return Ok(());
        }
        Err(ModelError::Contract(format!(
            "graph '{}' reads images of {:?} into {} classes; the data has {:?} and {classes}",
            self.name,
            &shape[1..],
            g.classes(),
            [channels, size, size]
        )))
    }
}
