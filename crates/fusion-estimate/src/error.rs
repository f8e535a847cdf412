use thiserror::Error;

#[derive(Debug, Error)]
pub enum EstimateError {
    #[error("graph: {0}")]
    Graph(#[from] fusion_graph::GraphError),
    #[error("profiling on the backend failed: {0}")]
    Profile(String),
    #[error("device profile {path}: {message}")]
    ProfileFile { path: String, message: String },
    #[error("device profile '{name}': {message}")]
    InvalidProfile { name: String, message: String },
}
