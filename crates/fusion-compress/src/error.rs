use thiserror::Error;

/// Why a compressed message was refused or a codec could not be built.
#[derive(Debug, Error, PartialEq)]
pub enum CompressError {
    /// The message is malformed: it names the field and what is wrong with it.
    #[error("malformed compressed tensor: {0}")]
    Malformed(String),
    #[error("invalid compression setting: {0}")]
    Config(String),
}

pub type Result<T> = std::result::Result<T, CompressError>;

pub(crate) fn malformed<T>(msg: impl Into<String>) -> Result<T> {
    Err(CompressError::Malformed(msg.into()))
}
