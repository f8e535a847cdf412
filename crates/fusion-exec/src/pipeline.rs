//! Runs a graph split into stages inside one process, moving boundary activations forward and
//! their gradients backward exactly as the distributed runtime does between machines. It is the
//! reference the distributed runtime is compared with, and shows that remote autodiff over an
//! arbitrary cut (residual edges included) reproduces whole-graph gradients.

use crate::error::{ExecError, Result};
use crate::executor::{Executor, ForwardPass};
use fusion_backend::{Backend, BinaryOp};
use fusion_graph::{Graph, Stage, TensorId};
use fusion_ops::{Mode, Value};
use std::collections::HashMap;
use std::sync::Arc;

pub struct LocalPipeline<B: Backend> {
    stages: Vec<(Stage, Executor<B>)>,
    num_params: usize,
    graph_outputs: Vec<TensorId>,
}

/// The result of one forward and backward pass through every stage.
pub struct PipelineStep<B: Backend> {
    /// Every global graph output (the loss, the logits).
    pub outputs: HashMap<TensorId, Value<B>>,
    /// Gradients by global parameter id, summed over the stages that share a parameter.
    pub param_grads: Vec<Option<B::Tensor>>,
    /// New values of non-trainable buffers (batch-norm statistics), by global parameter id.
    pub buffer_updates: Vec<(fusion_graph::ParamId, B::Tensor)>,
    /// Bytes of activations (forward) and gradients (backward) that crossed stage boundaries.
    pub boundary_bytes: usize,
}

fn add_into<B: Backend>(b: &B, slot: &mut Option<B::Tensor>, g: B::Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        Some(prev) => b.binary(BinaryOp::Add, &prev, &g)?,
        None => g,
    });
    Ok(())
}

impl<B: Backend> LocalPipeline<B> {
    pub fn new(backend: B, graph: &Graph, assignment: &[usize]) -> Result<Self> {
        let stages = graph
            .split(assignment)?
            .into_iter()
            .map(|s| {
                let exec = Executor::new(backend.clone(), Arc::new(s.graph.clone()))?;
                Ok((s, exec))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(LocalPipeline {
            stages,
            num_params: graph.params.len(),
            graph_outputs: graph.outputs.clone(),
        })
    }

    /// Recomputes every stage's activations in backward (each in its default segment count).
    pub fn with_recompute(mut self, on: bool) -> Self {
        if on {
            self.stages = self
                .stages
                .into_iter()
                .map(|(s, e)| {
                    let k = crate::default_segments(s.graph.nodes.len());
                    (s, e.with_recompute(Some(k)))
                })
                .collect();
        }
        self
    }

    pub fn stages(&self) -> impl Iterator<Item = &Stage> {
        self.stages.iter().map(|(s, _)| s)
    }

    /// Forward through every stage, then backward from `seeds` (gradients of global outputs).
    /// `params` holds every global parameter's tensor; each stage uses its own subset.
    pub fn step(
        &self,
        params: &[B::Tensor],
        feeds: HashMap<TensorId, Value<B>>,
        seeds: HashMap<TensorId, B::Tensor>,
        mode: Mode,
    ) -> Result<PipelineStep<B>> {
        if params.len() != self.num_params {
            return Err(ExecError::ParamCount {
                expected: self.num_params,
                found: params.len(),
            });
        }
        let b = self
            .stages
            .first()
            .map(|(_, e)| e.backend().clone())
            .ok_or(ExecError::ParamCount {
                expected: 1,
                found: 0,
            })?;
        let mut values: HashMap<TensorId, Value<B>> = feeds;
        let mut passes: Vec<ForwardPass<B>> = Vec::new();
        let mut boundary_bytes = 0;
        let mut buffer_updates = Vec::new();
        let stage_params = |s: &Stage| -> Vec<B::Tensor> {
            s.params.iter().map(|p| params[p.0].clone()).collect()
        };
        for (stage, exec) in &self.stages {
            let mut local = HashMap::new();
            for (l, g) in stage.graph.inputs.iter().zip(stage.global_inputs()) {
                let v = values
                    .get(&g)
                    .cloned()
                    .ok_or_else(|| ExecError::MissingInput(stage.graph.tensor(*l).name.clone()))?;
                local.insert(*l, v);
            }
            let pass = exec.forward(&stage_params(stage), local, mode, true)?;
            buffer_updates.extend(
                pass.buffer_updates
                    .iter()
                    .map(|(p, t)| (stage.params[p.0], t.clone())),
            );
            for (l, g) in stage.graph.outputs.iter().zip(stage.global_outputs()) {
                if let Some(v) = pass.output(*l) {
                    boundary_bytes += stage.graph.tensor(*l).bytes();
                    values.insert(g, v.clone());
                }
            }
            passes.push(pass);
        }
        let mut grads: HashMap<TensorId, B::Tensor> = seeds;
        let mut param_grads: Vec<Option<B::Tensor>> = (0..self.num_params).map(|_| None).collect();
        for ((stage, exec), pass) in self.stages.iter().zip(passes).rev() {
            let mut local_seeds = HashMap::new();
            for (l, g) in stage.graph.outputs.iter().zip(stage.global_outputs()) {
                if let Some(t) = grads.remove(&g) {
                    boundary_bytes += stage.graph.tensor(*l).bytes();
                    local_seeds.insert(*l, t);
                }
            }
            let g = exec.backward(pass, &stage_params(stage), local_seeds)?;
            for (l, t) in g.inputs {
                let mut slot = grads.remove(&stage.tensors[l.0]);
                add_into(&b, &mut slot, t)?;
                if let Some(t) = slot {
                    grads.insert(stage.tensors[l.0], t);
                }
            }
            for (lp, gp) in g.params.into_iter().enumerate() {
                if let Some(gp) = gp {
                    add_into(&b, &mut param_grads[stage.params[lp].0], gp)?;
                }
            }
        }
        let outputs = values
            .into_iter()
            .filter(|(t, _)| self.graph_outputs.contains(t))
            .collect();
        Ok(PipelineStep {
            outputs,
            param_grads,
            buffer_updates,
            boundary_bytes,
        })
    }
}
