use thiserror::Error;

#[derive(Debug, Error)]
pub enum BackendError {
    #[error("shape error: {0}")]
    Shape(String),
    #[error("index {index} out of range for size {size}")]
    Index { index: usize, size: usize },
    #[error("device: {0}")]
    Device(String),
    /// Two operands in formats with no common wider one (not a 16-bit and an `f32` tensor).
    #[error("{op} of {a} and {b} values: no common format")]
    MixedFormats { op: String, a: String, b: String },
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, BackendError>;
