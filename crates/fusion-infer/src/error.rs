use thiserror::Error;

#[derive(Debug, Error)]
pub enum InferError {
    #[error("model '{model}' cannot generate: {reason}")]
    Unsupported { model: String, reason: String },
    #[error("the weights have no parameter '{0}'")]
    MissingParam(String),
    #[error("token {token} is outside the model's vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("the context is full: the model reads at most {n_ctx} positions")]
    ContextFull { n_ctx: usize },
    #[error("an empty prompt: give at least one token")]
    EmptyPrompt,
    #[error(transparent)]
    Weights(#[from] fusion_train::TrainError),
    #[error(transparent)]
    Model(#[from] fusion_models::ModelError),
}

pub type Result<T> = std::result::Result<T, InferError>;
