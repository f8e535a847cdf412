use thiserror::Error;

#[derive(Debug, Error)]
pub enum TrainError {
    #[error(transparent)]
    Exec(#[from] fusion_exec::ExecError),
    #[error(transparent)]
    Model(#[from] fusion_models::ModelError),
    #[error(transparent)]
    Graph(#[from] fusion_graph::GraphError),
    #[error(transparent)]
    Data(#[from] fusion_data::DataError),
    #[error(transparent)]
    Backend(#[from] fusion_backend::BackendError),
    #[error("invalid training configuration: {0}")]
    Config(String),
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: String, message: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("the data does not fit the model: {0}")]
    DataMismatch(String),
    /// Initial weights that cannot be used for this model.
    #[error("initial weights from {origin}: {message}")]
    Weights { origin: String, message: String },
    /// A pseudo-gradient of an outer synchronisation that cannot be used.
    #[error("outer synchronisation: {0}")]
    PseudoGradient(String),
    #[error(
        "the optimizer update of step {step} failed part way on the device, so the weights are \
         no step's: resume from the last checkpoint"
    )]
    StateLost { step: u64 },
    #[error("loss became {value} at step {step}: training diverged")]
    Diverged { step: u64, value: f32 },
    #[error(
        "f16 gradients overflowed at step {step} even at loss scale 1: the gradients themselves \
         are not finite (training diverged; resume from a checkpoint with a lower learning rate \
         or in bf16)"
    )]
    GradientsNotFinite { step: u64 },
}

pub type Result<T> = std::result::Result<T, TrainError>;

pub(crate) fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}
