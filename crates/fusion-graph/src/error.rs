use thiserror::Error;

/// Everything that can be wrong with a graph. Messages name the node or tensor involved so a user
/// can find the mistake in their builder code or in a received graph file.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum GraphError {
    #[error("unsupported graph format {found:?} version {version} (this build reads {expected:?} version {supported})")]
    Version {
        found: String,
        expected: String,
        version: u32,
        supported: u32,
    },
    #[error("node '{node}' refers to tensor #{tensor}, which does not exist (dangling edge)")]
    DanglingTensor { node: String, tensor: usize },
    #[error("node '{node}' refers to parameter #{param}, which does not exist")]
    DanglingParam { node: String, param: usize },
    #[error("tensor '{tensor}' is produced by both '{first}' and '{second}'")]
    MultipleProducers {
        tensor: String,
        first: String,
        second: String,
    },
    #[error("tensor '{tensor}' is a graph input but is also produced by node '{node}'")]
    InputProduced { tensor: String, node: String },
    #[error("node '{node}' reads tensor '{tensor}', which no node produces and which is not a graph input")]
    Unproduced { node: String, tensor: String },
    #[error("graph output #{0} does not exist")]
    BadOutput(usize),
    #[error("the graph has a cycle through node '{0}'")]
    Cycle(String),
    #[error("node '{node}' ({op}): {message}")]
    Shape {
        node: String,
        op: String,
        message: String,
    },
    #[error("node '{node}': parameter '{param}' has shape {found:?}, expected {expected:?}")]
    ParamShape {
        node: String,
        param: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("node '{node}' ({op}) expects {expected} {what}, got {found}")]
    Arity {
        node: String,
        op: String,
        what: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("duplicate name '{0}'")]
    DuplicateName(String),
    #[error("{what} '{name}' has shape {shape:?}, more than 2^40 elements")]
    TooLarge {
        what: &'static str,
        name: String,
        shape: Vec<usize>,
    },
    #[error("invalid partition: {0}")]
    Partition(String),
    #[error("could not parse graph: {0}")]
    Parse(String),
}
