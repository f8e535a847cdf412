use thiserror::Error;

/// What is wrong with a Hugging Face model directory, or with writing one.
#[derive(Debug, Error)]
pub enum HfError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// The directory lacks what a model directory holds.
    #[error("{path} is not a Hugging Face model directory fusionllm reads: {reason}")]
    NotAModel { path: String, reason: String },
    /// `config.json` is malformed, or one field has a value fusionllm cannot honour.
    #[error("{path}: field '{field}': {message}")]
    Config {
        path: String,
        field: String,
        message: String,
    },
    #[error("{path}: model_type '{model_type}' is not supported (fusionllm reads gpt2 and llama)")]
    Unsupported { path: String, model_type: String },
    /// A safetensors file (or a shard index) that cannot be read as one: truncated, a bad header.
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("tensor '{name}' in {path} is {dtype}; fusionllm reads F32, F16, BF16 and F64")]
    Dtype {
        name: String,
        path: String,
        dtype: String,
    },
    #[error("tensor '{name}' has shape {found:?}; the model needs {expected:?}")]
    Shape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    /// Tensors the model needs that the files lack, and tensors in the files the model has no
    /// place for (a checkpoint of another architecture or size).
    #[error("the weights do not fit the model: {}", missing_and_unexpected(.missing, .unexpected))]
    Tensors {
        missing: Vec<String>,
        unexpected: Vec<String>,
    },
    #[error("tensor '{name}' in {path} holds a non-finite value ({value}) at index {index}")]
    NotFinite {
        name: String,
        path: String,
        index: usize,
        value: f32,
    },
    /// The model cannot be written as a Hugging Face directory.
    #[error("cannot export model '{model}': {reason}")]
    Export { model: String, reason: String },
    #[error(transparent)]
    Train(#[from] fusion_train::TrainError),
    #[error(transparent)]
    Model(#[from] fusion_models::ModelError),
}

/// At most this many names of each kind in a message.
const NAMES_SHOWN: usize = 8;

fn missing_and_unexpected(missing: &[String], unexpected: &[String]) -> String {
    let list = |names: &[String]| {
        let mut s = names
            .iter()
            .take(NAMES_SHOWN)
            .map(|n| format!("'{n}'"))
            .collect::<Vec<_>>()
            .join(", ");
        if names.len() > NAMES_SHOWN {
            s.push_str(&format!(" and {} more", names.len() - NAMES_SHOWN));
        }
        s
    };
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("{} missing ({})", missing.len(), list(missing)));
    }
    if !unexpected.is_empty() {
        parts.push(format!(
            "{} unexpected ({})",
            unexpected.len(),
            list(unexpected)
        ));
    }
    parts.join("; ")
}

pub type Result<T> = std::result::Result<T, HfError>;

pub(crate) fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io {
        path: path.display().to_string(),
        source,
    }
}
