//! Initial weights from outside the run (a published checkpoint, another framework's export):
//! a source gives each parameter's values by the graph's parameter specification, so a trainer or
//! a broker reads one tensor at a time and never holds a second copy of the whole model.

use crate::error::Result;
use fusion_graph::{Graph, ParamSpec};

/// Parameter values loaded from elsewhere instead of drawn from the seed.
pub trait WeightSource: Send + Sync {
    /// Where the weights come from, for logs and errors.
    fn describe(&self) -> String;

    /// Checks that the source holds a value of the right shape for every parameter of `graph`
    /// (and nothing it would silently ignore), before any is read.
    fn check(&self, graph: &Graph) -> Result<()>;

    /// The values of `param` in row-major order, `param.numel()` of them.
    fn load(&self, param: &ParamSpec) -> Result<Vec<f32>>;
}

/// Parameter `param` read from `source`, refused unless it has exactly `param.numel()` values.
pub fn load_checked(source: &dyn WeightSource, param: &ParamSpec) -> Result<Vec<f32>> {
    let v = source.load(param)?;
    if v.len() == param.numel() {
        return Ok(v);
    }
    Err(crate::TrainError::Weights {
        origin: source.describe(),
        message: format!(
            "gave {} values for '{}' of shape {:?}",
            v.len(),
            param.name,
            param.shape
        ),
    })
}

/// Every parameter of `graph` read from `source`, after checking that it holds them all.
pub fn load_all(source: &dyn WeightSource, graph: &Graph) -> Result<Vec<Vec<f32>>> {
    source.check(graph)?;
    graph
        .params
        .iter()
        .map(|p| load_checked(source, p))
        .collect()
}
