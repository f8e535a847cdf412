use thiserror::Error;

#[derive(Debug, Error)]
pub enum BackendError {
    #[error("shape error: {0}")]
    Shape(String),
    #[error("index {index} out of range for size {size}")]
    Index { index: usize, size: usize },
    #[error("device: {0}")]
    Device(String),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, BackendError>;
