//! Forward execution with a tape, and reverse-mode differentiation over it.

use crate::error::{ExecError, Result};
use crate::recompute::{segments, Segment};
use fusion_backend::{Backend, BinaryOp};
use fusion_graph::{Graph, NodeId, ParamId, TensorId};
use fusion_ops::{Mode, Value};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// What one node recorded in forward for its backward.
struct NodeTape<B: Backend> {
    inputs: Vec<Value<B>>,
    saved: Vec<B::Tensor>,
}

/// The result of a forward pass: the graph outputs, new buffer values, and (when recorded) the
/// tape that [`Executor::backward`] consumes. With recomputation the tape is empty until
/// backward rebuilds it, one segment at a time, from the values kept at segment boundaries.
pub struct ForwardPass<B: Backend> {
    pub outputs: HashMap<TensorId, Value<B>>,
    pub buffer_updates: Vec<(ParamId, B::Tensor)>,
    tape: Vec<Option<NodeTape<B>>>,
    /// Per segment (recomputation on): the values its nodes read from outside it.
    kept: Vec<HashMap<TensorId, Value<B>>>,
    mode: Mode,
}

impl<B: Backend> ForwardPass<B> {
    pub fn output(&self, t: TensorId) -> Option<&Value<B>> {
        self.outputs.get(&t)
    }
}

/// Gradients of a backward pass: per parameter (None for buffers and parameters no gradient
/// reached) and per float graph input.
pub struct Gradients<B: Backend> {
    pub params: Vec<Option<B::Tensor>>,
    pub inputs: HashMap<TensorId, B::Tensor>,
}

/// Runs one validated graph on one backend.
pub struct Executor<B: Backend> {
    backend: B,
    graph: Arc<Graph>,
    order: Vec<NodeId>,
    /// For each tensor, the position in `order` of its last consumer (to free values early when no
    /// tape is kept).
    last_use: Vec<usize>,
    /// Recomputation segments (empty: every recorded pass keeps its whole tape).
    segments: Vec<Segment>,
}

fn kind<B: Backend>(v: &Value<B>) -> &'static str {
    match v {
        Value::Float(_) => "f32",
        Value::Ids(_) => "i32",
    }
}

impl<B: Backend> Executor<B> {
    pub fn new(backend: B, graph: Arc<Graph>) -> Result<Self> {
        graph.validate()?;
        let order = graph.topo_order()?;
        let mut last_use = vec![0; graph.tensors.len()];
        for (pos, n) in order.iter().enumerate() {
            for t in &graph.node(*n).inputs {
                last_use[t.0] = pos;
            }
        }
        for t in &graph.outputs {
            last_use[t.0] = usize::MAX;
        }
        Ok(Executor {
            backend,
            graph,
            order,
            last_use,
            segments: Vec::new(),
        })
    }

    /// Activation recomputation: a recorded forward pass keeps only the values that cross into
    /// each of `segments` runs of nodes (in topological order), and backward recomputes one
    /// segment's forward at a time before differentiating it. Gradients are bit-identical to a
    /// stored tape's (the same operators run on the same values). 0 or 1 segment keeps only
    /// the graph's inputs and recomputes the whole forward; `None` turns recomputation off.
    pub fn with_recompute(mut self, segments_wanted: Option<usize>) -> Self {
        self.segments = match segments_wanted {
            Some(k) => segments(&self.graph, &self.order, k.max(1)),
            None => Vec::new(),
        };
        self
    }

    /// Recomputation segments in use (0 when off).
    pub fn recompute_segments(&self) -> usize {
        self.segments.len()
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn graph(&self) -> &Arc<Graph> {
        &self.graph
    }

    /// Uploads host parameter values (in graph parameter order), checking their sizes.
    pub fn upload_params(&self, values: &[Vec<f32>]) -> Result<Vec<B::Tensor>> {
        if values.len() != self.graph.params.len() {
            return Err(ExecError::ParamCount {
                expected: self.graph.params.len(),
                found: values.len(),
            });
        }
        self.graph
            .params
            .iter()
            .zip(values)
            .map(|(spec, v)| {
                if v.len() != spec.numel() {
                    return Err(ExecError::ParamShape {
                        name: spec.name.clone(),
                        found: vec![v.len()],
                        expected: spec.shape.clone(),
                    });
                }
                Ok(self.backend.upload(v.clone(), &spec.shape)?)
            })
            .collect()
    }

    fn check_feed(&self, t: TensorId, v: &Value<B>) -> Result<()> {
        let info = self.graph.tensor(t);
        let shape = v.shape(&self.backend);
        let expected_kind = if info.dtype.is_float() { "f32" } else { "i32" };
        if shape != info.shape || kind(v) != expected_kind {
            return Err(ExecError::FeedMismatch {
                name: info.name.clone(),
                found: shape,
                found_kind: kind(v),
                expected: info.shape.clone(),
                expected_kind,
            });
        }
        Ok(())
    }

    /// Runs every node forward. `feeds` must hold a value for every graph input; with
    /// `record = true` the pass keeps what backward needs.
    pub fn forward(
        &self,
        params: &[B::Tensor],
        feeds: HashMap<TensorId, Value<B>>,
        mode: Mode,
        record: bool,
    ) -> Result<ForwardPass<B>> {
        if params.len() != self.graph.params.len() {
            return Err(ExecError::ParamCount {
                expected: self.graph.params.len(),
                found: params.len(),
            });
        }
        for t in feeds.keys() {
            if !self.graph.inputs.contains(t) {
                let name = self
                    .graph
                    .tensors
                    .get(t.0)
                    .map(|i| i.name.clone())
                    .unwrap_or_else(|| format!("#{}", t.0));
                return Err(ExecError::NotAnInput(name));
            }
        }
        for t in &self.graph.inputs {
            let v = feeds
                .get(t)
                .ok_or_else(|| ExecError::MissingInput(self.graph.tensor(*t).name.clone()))?;
            self.check_feed(*t, v)?;
        }
        let mut values = feeds;
        let keep_tape = record && self.segments.is_empty();
        let mut kept = Vec::new();
        let mut tape: Vec<Option<NodeTape<B>>> =
            (0..self.graph.nodes.len()).map(|_| None).collect();
        let mut buffer_updates = Vec::new();
        let mut next_segment = 0;
        for (pos, nid) in self.order.iter().enumerate() {
            if record {
                if let Some(seg) = self.segments.get(next_segment).filter(|g| g.start == pos) {
                    kept.push(self.keep(seg, &values));
                    next_segment += 1;
                }
            }
            let (inputs, out) = self.run_node(*nid, params, &values, mode)?;
            let node = self.graph.node(*nid);
            for (slot, t) in out.buffer_updates {
                buffer_updates.push((node.params[slot], t));
            }
            values.insert(node.outputs[0], Value::Float(out.output));
            if keep_tape {
                tape[nid.0] = Some(NodeTape {
                    inputs,
                    saved: out.saved,
                });
            }
            for t in &node.inputs {
                if self.last_use[t.0] == pos && !self.graph.outputs.contains(t) {
                    values.remove(t);
                }
            }
        }
        let outputs = self
            .graph
            .outputs
            .iter()
            .filter_map(|t| values.remove(t).map(|v| (*t, v)))
            .collect();
        Ok(ForwardPass {
            outputs,
            buffer_updates,
            tape,
            kept,
            mode,
        })
    }

    /// One node's VJP from its tape and its output's gradient.
    fn node_backward(
        &self,
        node: &fusion_graph::Node,
        tape: &NodeTape<B>,
        params: &[B::Tensor],
        dy: &B::Tensor,
        mode: Mode,
    ) -> Result<fusion_ops::Backward<B>> {
        let in_refs: Vec<&Value<B>> = tape.inputs.iter().collect();
        let p_refs: Vec<&B::Tensor> = node.params.iter().map(|p| &params[p.0]).collect();
        fusion_ops::backward(
            &self.backend,
            &node.op,
            &in_refs,
            &p_refs,
            &tape.saved,
            dy,
            mode,
        )
        .map_err(|source| ExecError::Op {
            node: node.name.clone(),
            source,
        })
    }

    /// Runs one node forward on the values at hand: its inputs and its output.
    fn run_node(
        &self,
        nid: NodeId,
        params: &[B::Tensor],
        values: &HashMap<TensorId, Value<B>>,
        mode: Mode,
    ) -> Result<(Vec<Value<B>>, fusion_ops::Forward<B>)> {
        let node = self.graph.node(nid);
        let found: Vec<&Value<B>> = node
            .inputs
            .iter()
            .map(|t| {
                values
                    .get(t)
                    .ok_or_else(|| ExecError::MissingInput(self.graph.tensor(*t).name.clone()))
            })
            .collect::<Result<_>>()?;
        let failed = |source| ExecError::Op {
            node: node.name.clone(),
            source,
        };
        // The tape keeps the inputs as the operator computes on them: a 16-bit run's wide
        // residual stream is kept narrowed for the operators that read it narrowed.
        let inputs = fusion_ops::admit(&self.backend, &node.op, &found).map_err(failed)?;
        let in_refs: Vec<&Value<B>> = inputs.iter().collect();
        let p_refs: Vec<&B::Tensor> = node.params.iter().map(|p| &params[p.0]).collect();
        let out = fusion_ops::forward(&self.backend, &node.op, &in_refs, &p_refs, mode)
            .map_err(failed)?;
        Ok((inputs, out))
    }

    /// The values a segment reads from outside itself, taken from those live at its start.
    fn keep(
        &self,
        seg: &Segment,
        values: &HashMap<TensorId, Value<B>>,
    ) -> HashMap<TensorId, Value<B>> {
        seg.reads
            .iter()
            .filter_map(|t| values.get(t).map(|v| (*t, v.clone())))
            .collect()
    }

    /// Recomputes segment `s`'s forward from its kept values, filling the tape of its nodes.
    /// Buffer updates are dropped: the first forward pass already reported them.
    fn recompute(&self, s: usize, pass: &mut ForwardPass<B>, params: &[B::Tensor]) -> Result<()> {
        let (Some(seg), Some(kept)) = (self.segments.get(s), pass.kept.get_mut(s)) else {
            return Err(ExecError::Recompute(format!(
                "segment {s} of {} has no kept values: the pass was not recorded by this executor",
                self.segments.len()
            )));
        };
        let mut values = std::mem::take(kept);
        for nid in &self.order[seg.start..seg.end] {
            let (inputs, out) = self.run_node(*nid, params, &values, pass.mode)?;
            let node = self.graph.node(*nid);
            values.insert(node.outputs[0], Value::Float(out.output));
            pass.tape[nid.0] = Some(NodeTape {
                inputs,
                saved: out.saved,
            });
        }
        Ok(())
    }

    /// Reverse-mode differentiation over a recorded pass. `seeds` gives the gradient of the
    /// objective with respect to output tensors (for a loss: a one-element tensor holding the
    /// loss scale). Gradients of shared parameters and of tensors with several consumers are summed.
    pub fn backward(
        &self,
        mut pass: ForwardPass<B>,
        params: &[B::Tensor],
        seeds: HashMap<TensorId, B::Tensor>,
    ) -> Result<Gradients<B>> {
        let b = &self.backend;
        for (t, g) in &seeds {
            let info = self
                .graph
                .tensors
                .get(t.0)
                .ok_or_else(|| ExecError::NotAnInput(format!("#{}", t.0)))?;
            if b.shape(g) != info.shape {
                return Err(ExecError::SeedShape {
                    name: info.name.clone(),
                    found: b.shape(g),
                    expected: info.shape.clone(),
                });
            }
        }
        let mut grads: HashMap<TensorId, B::Tensor> = seeds;
        let mut pgrads: Vec<Option<B::Tensor>> =
            (0..self.graph.params.len()).map(|_| None).collect();
        let accumulate = |slot: &mut Option<B::Tensor>, g: B::Tensor| -> Result<()> {
            *slot = Some(match slot.take() {
                Some(prev) => b.binary(BinaryOp::Add, &prev, &g)?,
                None => g,
            });
            Ok(())
        };
        let spans: Vec<(Option<usize>, Range<usize>)> = if self.segments.is_empty() {
            vec![(None, 0..self.order.len())]
        } else {
            let seg = self.segments.iter().enumerate();
            seg.rev().map(|(i, g)| (Some(i), g.start..g.end)).collect()
        };
        for (segment, span) in spans {
            if let Some(s) = segment {
                self.recompute(s, &mut pass, params)?;
            }
            for nid in self.order[span].iter().rev() {
                let node = self.graph.node(*nid);
                let Some(tape) = pass.tape[nid.0].take() else {
                    continue;
                };
                let Some(dy) = grads.remove(&node.outputs[0]) else {
                    continue;
                };
                let g = self.node_backward(node, &tape, params, &dy, pass.mode)?;
                for (t, gi) in node.inputs.iter().zip(g.inputs) {
                    if let Some(gi) = gi {
                        let mut slot = grads.remove(t);
                        accumulate(&mut slot, gi)?;
                        if let Some(s) = slot {
                            grads.insert(*t, s);
                        }
                    }
                }
                // Parameter gradients sum at f32 or better (a tied weight's uses, and later the
                // micro-batches), whatever the compute precision.
                for (p, gp) in node.params.iter().zip(g.params) {
                    if let Some(gp) = gp {
                        let slot = &mut pgrads[p.0];
                        *slot = Some(b.accumulate(slot.take(), gp)?);
                    }
                }
            }
        }
        let inputs = grads
            .into_iter()
            .filter(|(t, _)| self.graph.inputs.contains(t))
            .collect();
        Ok(Gradients {
            params: pgrads,
            inputs,
        })
    }
}
