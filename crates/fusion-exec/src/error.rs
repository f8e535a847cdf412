use thiserror::Error;

#[derive(Debug, Error)]
pub enum ExecError {
    #[error("invalid graph: {0}")]
    Graph(#[from] fusion_graph::GraphError),
    #[error("node '{node}': {source}")]
    Op {
        node: String,
        source: fusion_ops::OpError,
    },
    #[error("input '{0}' was not fed")]
    MissingInput(String),
    #[error("tensor '{name}' was fed with shape {found:?} ({found_kind}), the graph declares {expected:?} ({expected_kind})")]
    FeedMismatch {
        name: String,
        found: Vec<usize>,
        found_kind: &'static str,
        expected: Vec<usize>,
        expected_kind: &'static str,
    },
    #[error("'{0}' is not an input of this graph")]
    NotAnInput(String),
    #[error("expected {expected} parameter tensors, got {found}")]
    ParamCount { expected: usize, found: usize },
    #[error("parameter '{name}' has shape {found:?}, the graph declares {expected:?}")]
    ParamShape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("gradient seed for '{name}' has shape {found:?}, expected {expected:?}")]
    SeedShape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("recomputation: {0}")]
    Recompute(String),
    #[error("backend: {0}")]
    Backend(#[from] fusion_backend::BackendError),
}

pub type Result<T> = std::result::Result<T, ExecError>;
