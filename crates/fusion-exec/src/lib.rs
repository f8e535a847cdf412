//! The DAG executor. It runs a graph (or a subgraph cut out of one) forward, records what each
//! node needs, and runs reverse-mode automatic differentiation by calling each operator's
//! hand-written backward in reverse topological order.
//!
//! Boundaries are explicit so the same executor serves remote autodiff: forward takes values for
//! any input tensors (data, or activations received from another machine) and backward takes
//! gradient seeds for any output tensors (the loss, or gradients received from downstream) and
//! returns the gradients of its float inputs, to be sent upstream.

mod error;
mod executor;
mod init;
mod pipeline;
mod recompute;
mod schedule;

pub use error::{ExecError, Result};
pub use executor::{Executor, ForwardPass, Gradients};
pub use fusion_ops::{IdTensor, Mode, Value};
pub use init::{init_param, init_params};
pub use pipeline::{LocalPipeline, PipelineStep};
pub use recompute::{default_segments, segment_bounds};
pub use schedule::{passes, Pass, Schedule};
