//! Cutting a graph into pipeline stages. Each stage becomes a graph of its own whose inputs are
//! the tensors it receives (data, or activations from earlier stages, possibly non-adjacent ones
//! across residual edges) and whose outputs are the tensors later stages or the caller need.
//! A stage therefore runs on the ordinary executor; the runtime only moves boundary tensors
//! forward and their gradients backward.

use crate::error::GraphError;
use crate::graph::{Graph, Node, NodeId, ParamId, TensorId};
use std::collections::HashMap;

/// One stage: its graph (with local ids) and the global ids of its tensors and parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    pub graph: Graph,
    /// Global tensor id of each local tensor.
    pub tensors: Vec<TensorId>,
    /// Global parameter id of each local parameter.
    pub params: Vec<ParamId>,
}

impl Stage {
    /// Global ids of the stage's inputs (data or activations it receives).
    pub fn global_inputs(&self) -> Vec<TensorId> {
        self.graph
            .inputs
            .iter()
            .map(|t| self.tensors[t.0])
            .collect()
    }
    /// Global ids of the stage's outputs (activations it sends, or the graph's own outputs).
    pub fn global_outputs(&self) -> Vec<TensorId> {
        self.graph
            .outputs
            .iter()
            .map(|t| self.tensors[t.0])
            .collect()
    }
}

impl Graph {
    /// Splits the graph by `assignment[node] = stage`. Every edge must go to the same or a later
    /// stage (a pipeline runs forward in stage order), and every stage must own at least one node.
    pub fn split(&self, assignment: &[usize]) -> Result<Vec<Stage>, GraphError> {
        if assignment.len() != self.nodes.len() {
            return Err(GraphError::Partition(format!(
                "{} stage assignments for {} nodes",
                assignment.len(),
                self.nodes.len()
            )));
        }
        let n_stages = assignment.iter().max().map_or(0, |m| m + 1);
        let producers = self.producers();
        let stage_of = |t: TensorId| producers[t.0].map(|n: NodeId| assignment[n.0]);
        let mut consumers_stages: Vec<Vec<usize>> = vec![Vec::new(); self.tensors.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for t in &n.inputs {
                if let Some(s) = stage_of(*t) {
                    if s > assignment[i] {
                        return Err(GraphError::Partition(format!(
                            "node '{}' in stage {} reads '{}' from later stage {s}",
                            n.name,
                            assignment[i],
                            self.tensor(*t).name
                        )));
                    }
                }
                consumers_stages[t.0].push(assignment[i]);
            }
        }
        let order = self.topo_order()?;
        (0..n_stages)
            .map(|s| {
                let nodes: Vec<&Node> = order
                    .iter()
                    .filter(|n| assignment[n.0] == s)
                    .map(|n| self.node(*n))
                    .collect();
                if nodes.is_empty() {
                    return Err(GraphError::Partition(format!("stage {s} has no operators")));
                }
                let mut tensor_map: HashMap<TensorId, TensorId> = HashMap::new();
                let mut param_map: HashMap<ParamId, ParamId> = HashMap::new();
                let mut stage = Stage {
                    graph: Graph {
                        format: self.format.clone(),
                        version: self.version,
                        name: format!("{}/stage{s}", self.name),
                        tensors: Vec::new(),
                        params: Vec::new(),
                        nodes: Vec::new(),
                        inputs: Vec::new(),
                        outputs: Vec::new(),
                    },
                    tensors: Vec::new(),
                    params: Vec::new(),
                };
                let mut local_tensor = |t: TensorId, st: &mut Stage| -> TensorId {
                    *tensor_map.entry(t).or_insert_with(|| {
                        st.graph.tensors.push(self.tensor(t).clone());
                        st.tensors.push(t);
                        TensorId(st.graph.tensors.len() - 1)
                    })
                };
                for n in &nodes {
                    let inputs: Vec<TensorId> = n
                        .inputs
                        .iter()
                        .map(|t| {
                            let local = local_tensor(*t, &mut stage);
                            if stage_of(*t) != Some(s) && !stage.graph.inputs.contains(&local) {
                                stage.graph.inputs.push(local);
                            }
                            local
                        })
                        .collect();
                    let outputs: Vec<TensorId> = n
                        .outputs
                        .iter()
                        .map(|t| local_tensor(*t, &mut stage))
                        .collect();
                    let params = n
                        .params
                        .iter()
                        .map(|p| {
                            *param_map.entry(*p).or_insert_with(|| {
                                stage.graph.params.push(self.param(*p).clone());
                                stage.params.push(*p);
                                ParamId(stage.graph.params.len() - 1)
                            })
                        })
                        .collect();
                    for (g, l) in n.outputs.iter().zip(&outputs) {
                        let later = consumers_stages[g.0].iter().any(|&c| c > s);
                        if later || self.outputs.contains(g) {
                            stage.graph.outputs.push(*l);
                        }
                    }
                    stage.graph.nodes.push(Node {
                        name: n.name.clone(),
                        op: n.op.clone(),
                        inputs,
                        outputs,
                        params,
                    });
                }
                stage.graph.validate()?;
                Ok(stage)
            })
            .collect()
    }

    /// The naive pipeline split: `stages` contiguous runs of nodes in topological order with equal
    /// operator counts (differing by at most one).
    pub fn even_assignment(&self, stages: usize) -> Result<Vec<usize>, GraphError> {
        if stages == 0 || stages > self.nodes.len() {
            return Err(GraphError::Partition(format!(
                "cannot split {} operators into {stages} stages",
                self.nodes.len()
            )));
        }
        let order = self.topo_order()?;
        let mut assignment = vec![0; self.nodes.len()];
        for (pos, n) in order.iter().enumerate() {
            assignment[n.0] = pos * stages / order.len();
        }
        Ok(assignment)
    }
}
