//! Compression of the tensors that cross slow links.
//!
//! Activations flow forward and gradients backward over every cut of the pipeline; on a link of
//! a few Mbit/s they, not the GPUs, set the pace. This crate holds the codecs (dense f32, f16 and
//! bf16 casts, int8 with per-block scales, top-k, random-k and AdaTopK, behind [`Compressor`]),
//! a self-describing message format whose decoder validates everything ([`wire`]), exact and
//! sampled top-k selection ([`select`]), error feedback for what travels backward, and the
//! AdaTopK rule that picks each link's codec from its bandwidth and the stages' compute: the
//! least lossy of dense, fp16, int8 and top-k at the largest density that fits ([`rule`]).

mod codec;
mod config;
mod error;
pub mod rule;
pub mod select;
mod values;
pub mod wire;

pub use codec::{compressor, Codec, Compressor, Dense, ErrorFeedback, Int8, RandomK, TopK};
pub use config::{CompressionConfig, NodeCompression, PeerCodecs};
pub use error::{CompressError, Result};
pub use rule::{codec_bytes, AdaTopKPolicy, CodecChange, CodecController};
pub use select::Selection;
pub use wire::{decode, decode_with_info, ValueType};
