//! The routing plan every node of a job shares: which stage each operator runs in, which node
//! runs each stage, and for every stage where its inputs come from and where its outputs go.
//! The broker computes it once per assignment; a node derives all its sends and receives from it,
//! so activations reach every consuming stage (also non-adjacent ones across residual edges) and
//! gradients return to the producing stage.

use crate::error::{Result, RuntimeError};
use fusion_graph::{Graph, Stage};
use serde::{Deserialize, Serialize};

/// Where a stage input comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// A graph input (tokens, targets, images, labels): the broker feeds it.
    Data,
    /// An activation produced by this earlier stage.
    Stage(usize),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InputRoute {
    /// Global tensor id.
    pub tensor: usize,
    pub source: Source,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutputRoute {
    /// Global tensor id.
    pub tensor: usize,
    /// Later stages that read it (ascending).
    pub consumers: Vec<usize>,
    /// Index among the graph's outputs (0 = loss, 1 = logits) when it is one.
    pub graph_output: Option<usize>,
}

/// A parameter several stages use (a tied embedding): their gradients are summed across them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedParam {
    /// Global parameter id.
    pub param: usize,
    /// Every stage that uses it, ascending; the first one counts it in the gradient norm.
    pub stages: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageRoutes {
    pub inputs: Vec<InputRoute>,
    pub outputs: Vec<OutputRoute>,
    pub shared: Vec<SharedParam>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Stage of every operator of the graph.
    pub assignment: Vec<usize>,
    /// Node id running each stage.
    pub stage_nodes: Vec<String>,
    /// Global parameter ids of each stage's parameters, in its graph's order.
    pub stage_params: Vec<Vec<usize>>,
    pub stages: Vec<StageRoutes>,
    /// Recomputation segments of each stage (0: it stores its activations); empty: none
    /// recomputes.
    #[serde(default)]
    pub recompute: Vec<usize>,
}

impl Plan {
    /// Builds the routes of `graph` cut by `assignment`, with stage `s` placed on `stage_nodes[s]`.
    pub fn new(
        graph: &Graph,
        assignment: Vec<usize>,
        stage_nodes: Vec<String>,
    ) -> Result<(Self, Vec<Stage>)> {
        let stages = graph.split(&assignment)?;
        if stages.len() != stage_nodes.len() {
            return Err(RuntimeError::Config(format!(
                "the plan has {} stages but {} nodes to run them",
                stages.len(),
                stage_nodes.len()
            )));
        }
        let producers = graph.producers();
        let stage_of_tensor = |t: usize| producers[t].map(|n| assignment[n.0]);
        let mut routes = Vec::with_capacity(stages.len());
        for (s, stage) in stages.iter().enumerate() {
            let inputs = stage
                .global_inputs()
                .into_iter()
                .map(|t| InputRoute {
                    tensor: t.0,
                    source: match stage_of_tensor(t.0) {
                        Some(p) => Source::Stage(p),
                        None => Source::Data,
                    },
                })
                .collect();
            let outputs = stage
                .global_outputs()
                .into_iter()
                .map(|t| {
                    let consumers: Vec<usize> = stages
                        .iter()
                        .enumerate()
                        .filter(|(c, st)| *c != s && st.global_inputs().contains(&t))
                        .map(|(c, _)| c)
                        .collect();
                    OutputRoute {
                        tensor: t.0,
                        consumers,
                        graph_output: graph.outputs.iter().position(|o| *o == t),
                    }
                })
                .collect();
            let shared = stage
                .params
                .iter()
                .filter_map(|p| {
                    let users: Vec<usize> = stages
                        .iter()
                        .enumerate()
                        .filter(|(_, st)| st.params.contains(p))
                        .map(|(i, _)| i)
                        .collect();
                    (users.len() > 1).then_some(SharedParam {
                        param: p.0,
                        stages: users,
                    })
                })
                .collect();
            routes.push(StageRoutes {
                inputs,
                outputs,
                shared,
            });
        }
        Ok((
            Plan {
                assignment,
                stage_nodes,
                stage_params: stages
                    .iter()
                    .map(|s| s.params.iter().map(|p| p.0).collect())
                    .collect(),
                stages: routes,
                recompute: Vec::new(),
            },
            stages,
        ))
    }

    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    /// Checks a plan that came over the wire before anything indexes it: one node and one
    /// parameter list per stage, `stage` among them, and every stage number a route or operator
    /// names in range.
    pub fn check(&self, stage: usize) -> Result<()> {
        let n = self.stages.len();
        let bad = |what: String| Err(RuntimeError::Protocol(format!("the plan {what}")));
        if self.stage_nodes.len() != n || self.stage_params.len() != n {
            return bad(format!(
                "has {n} stages, {} nodes and {} parameter lists",
                self.stage_nodes.len(),
                self.stage_params.len()
            ));
        }
        if stage >= n {
            return bad(format!("has {n} stages; this node was given stage {stage}"));
        }
        if !self.recompute.is_empty() && self.recompute.len() != n {
            return bad(format!(
                "has {n} stages but recomputation settings for {}",
                self.recompute.len()
            ));
        }
        let named = self.stages.iter().flat_map(|r| {
            let sources = r.inputs.iter().filter_map(|i| match i.source {
                Source::Stage(p) => Some(p),
                Source::Data => None,
            });
            let consumers = r.outputs.iter().flat_map(|o| o.consumers.iter().copied());
            let shared = r.shared.iter().flat_map(|sp| sp.stages.iter().copied());
            sources.chain(consumers).chain(shared)
        });
        if let Some(s) = named
            .chain(self.assignment.iter().copied())
            .find(|&s| s >= n)
        {
            return bad(format!("names stage {s} of {n}"));
        }
        Ok(())
    }

    /// The recomputation segments stage `stage` runs with, if it recomputes.
    pub fn recompute_segments(&self, stage: usize) -> Option<usize> {
        self.recompute.get(stage).copied().filter(|&k| k > 0)
    }

    /// Stages this stage sends tensors to (activations downstream, gradients upstream, shared
    /// parameter gradients to co-owners), ascending.
    pub fn peers_of(&self, stage: usize) -> Vec<usize> {
        let r = &self.stages[stage];
        let mut peers: Vec<usize> = r
            .outputs
            .iter()
            .flat_map(|o| o.consumers.iter().copied())
            .chain(r.inputs.iter().filter_map(|i| match i.source {
                Source::Stage(p) => Some(p),
                Source::Data => None,
            }))
            .chain(r.shared.iter().flat_map(|sp| sp.stages.iter().copied()))
            .filter(|&p| p != stage)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    /// Stages this stage receives tensors from (the same relation seen from the other side).
    pub fn senders_to(&self, stage: usize) -> Vec<usize> {
        (0..self.num_stages())
            .filter(|&s| s != stage && self.peers_of(s).contains(&stage))
            .collect()
    }
}

/// An even split by operator count, as the graph's own `even_assignment`, or the user's list of
/// the first operator of every stage after the first (`cuts`), checked for order and range.
pub fn assignment_from_cuts(graph: &Graph, cuts: &[usize]) -> Result<Vec<usize>> {
    let n = graph.nodes.len();
    if cuts.windows(2).any(|w| w[0] >= w[1])
        || cuts.first() == Some(&0)
        || cuts.last().is_some_and(|&c| c >= n)
    {
        return Err(RuntimeError::Config(format!(
            "plan cuts {cuts:?} must be increasing operator indices in 1..{n}"
        )));
    }
    let order = graph.topo_order()?;
    let mut assignment = vec![0; n];
    for (pos, node) in order.iter().enumerate() {
        assignment[node.0] = cuts.iter().filter(|&&c| c <= pos).count();
    }
    Ok(assignment)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusion_models::ModelSpec;

    #[test]
    fn gpt2_plan_routes_tied_embedding_and_residuals() {
        let spec = ModelSpec::preset("gpt2-tiny")
            .expect("preset")
            .with_vocab(64);
        let g = spec.graph(2, 8).expect("graph");
        let a = g.even_assignment(4).expect("split");
        let nodes = (0..4).map(|i| format!("n{i}")).collect();
        let (plan, stages) = Plan::new(&g, a, nodes).expect("plan");
        assert_eq!(stages.len(), 4);
        // The token embedding is used by the first stage and the language-model head.
        let shared: Vec<_> = plan.stages[0]
            .shared
            .iter()
            .map(|s| s.stages.clone())
            .collect();
        assert_eq!(shared, vec![vec![0, 3]]);
        // Data inputs come from the broker; every other input from an earlier stage.
        for (s, r) in plan.stages.iter().enumerate() {
            for i in &r.inputs {
                if let Source::Stage(p) = i.source {
                    assert!(p < s);
                }
            }
        }
        assert!(plan.peers_of(0).contains(&3));
        assert_eq!(plan.senders_to(1), vec![0, 2]);
    }

    #[test]
    fn cuts_are_checked() {
        let spec = ModelSpec::preset("gpt2-tiny")
            .expect("preset")
            .with_vocab(64);
        let g = spec.graph(2, 8).expect("graph");
        assert!(assignment_from_cuts(&g, &[5, 3]).is_err());
        assert!(assignment_from_cuts(&g, &[0]).is_err());
        assert!(assignment_from_cuts(&g, &[g.nodes.len()]).is_err());
        let a = assignment_from_cuts(&g, &[4]).expect("cut");
        assert_eq!(a.iter().filter(|&&s| s == 0).count(), 4);
    }
}
