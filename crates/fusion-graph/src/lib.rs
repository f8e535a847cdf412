//! The OP-DAG: the framework-neutral intermediate representation of a model.
//!
//! A model is a directed acyclic graph whose nodes are operators at layer granularity and whose
//! edges are tensors with static shapes and dtypes. Parameters are named tensors referenced by
//! nodes (a parameter used by several nodes, such as GPT-2's tied embedding, is shared).
//! The graph is serializable (versioned JSON) so a broker can ship any subgraph to another machine,
//! and [`Graph::validate`] rejects malformed graphs with errors that name the offending node.

mod builder;
mod cost;
mod error;
mod graph;
mod op;
mod partition;
mod shape;

pub use builder::GraphBuilder;
pub use cost::{GraphCost, NodeCost};
pub use error::GraphError;
pub use graph::{
    Graph, Node, NodeId, ParamId, ParamSpec, TensorId, TensorInfo, FORMAT_NAME, FORMAT_VERSION,
};
pub use op::{Init, Op, ParamSlot};
pub use partition::Stage;
pub use shape::DType;
