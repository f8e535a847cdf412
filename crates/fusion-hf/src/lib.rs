//! Hugging Face interoperability. A model directory as `transformers` saves it — `config.json`
//! and `model.safetensors` (or shards named by `model.safetensors.index.json`) — opens as a
//! model specification and a [`fusion_train::WeightSource`] to start training from, for GPT-2
//! and Llama-family models; a trained model is written back as such a directory.
//!
//! Names and layouts are mapped in `names.rs` (pure functions); every tensor's shape is checked
//! before training starts, and missing or unexpected tensors are reported by name.

mod config;
mod error;
mod export;
mod import;
mod names;
mod reader;

pub use config::{config_json, read_config};
pub use error::{HfError, Result};
pub use export::export_hf;
pub use import::{family, is_hf_dir, HfModel};
pub use names::{hf_place, hf_shape, ignorable, Family, HfPlace, Layout};
pub use reader::{Entry, SafetensorsDir, INDEX, SINGLE};
