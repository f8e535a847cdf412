//! Training data. Every dataset is a deterministic function from (split, batch index) to a batch,
//! so a run's data position is one integer: resuming at index k replays exactly what an
//! uninterrupted run would have seen, on any machine.

mod idx;
mod markov;
mod seed;
mod synthetic_images;
mod text;

pub use idx::IdxImages;
pub use markov::MarkovCorpus;
pub use synthetic_images::SyntheticImages;
pub use text::{unigram_entropy, TextCorpus, Tokenizer};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Format { path: String, message: String },
    #[error("{0}")]
    Invalid(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

pub type Result<T> = std::result::Result<T, DataError>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    Eval,
}

/// One micro-batch.
#[derive(Clone, Debug, PartialEq)]
pub enum Batch {
    /// `inputs[b * seq + t]` predicts `targets[b * seq + t]` (the next token).
    Tokens {
        inputs: Vec<u32>,
        targets: Vec<u32>,
        batch: usize,
        seq: usize,
    },
    /// Pixels `[batch, channels, size, size]`, normalised.
    Images {
        pixels: Vec<f32>,
        labels: Vec<u32>,
        batch: usize,
        channels: usize,
        size: usize,
    },
}

/// One input of a batch as plain host data, ready to upload or to send to another machine.
#[derive(Clone, Debug, PartialEq)]
pub enum HostTensor {
    Float { data: Vec<f32>, shape: Vec<usize> },
    Ids { data: Vec<u32>, shape: Vec<usize> },
}

impl Batch {
    /// The two graph inputs of the batch: (tokens, targets) or (images, labels).
    pub fn into_inputs(self) -> [HostTensor; 2] {
        match self {
            Batch::Tokens {
                inputs,
                targets,
                batch,
                seq,
            } => [
                HostTensor::Ids {
                    data: inputs,
                    shape: vec![batch, seq],
                },
                HostTensor::Ids {
                    data: targets,
                    shape: vec![batch, seq],
                },
            ],
            Batch::Images {
                pixels,
                labels,
                batch,
                channels,
                size,
            } => [
                HostTensor::Float {
                    data: pixels,
                    shape: vec![batch, channels, size, size],
                },
                HostTensor::Ids {
                    data: labels,
                    shape: vec![batch],
                },
            ],
        }
    }

    /// What the model should predict: next tokens or class labels.
    pub fn targets(&self) -> &[u32] {
        match self {
            Batch::Tokens { targets, .. } => targets,
            Batch::Images { labels, .. } => labels,
        }
    }
}

/// What kind of model the data feeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataKind {
    Text {
        vocab: usize,
    },
    Images {
        channels: usize,
        size: usize,
        classes: usize,
    },
}

pub trait Dataset: Send + Sync {
    fn describe(&self) -> String;
    fn kind(&self) -> DataKind;
    /// The batch at `index` of `split`. Deterministic in (seed, split, index).
    fn batch(&self, split: Split, index: u64, batch: usize, seq: usize) -> Result<Batch>;
    /// How many evaluation batches make one full evaluation (a full pass for finite test sets).
    fn eval_batches(&self, batch: usize) -> usize;
    /// The lowest achievable loss per prediction in nats, when the source is known.
    fn entropy_floor(&self) -> Option<f64> {
        None
    }
    /// A reference loss for comparison (the unigram entropy of a text corpus).
    fn unigram_entropy(&self) -> Option<f64> {
        None
    }
}
