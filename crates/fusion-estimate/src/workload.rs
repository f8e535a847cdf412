//! Work, memory and traffic of a graph's operators for one micro-batch, indexed by the operator's
//! position in topological order (the order in which fences cut the graph).

use crate::error::EstimateError;
use fusion_graph::{Graph, GraphCost, Op};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Adam keeps two f32 moments per parameter.
pub const ADAM_STATE_BYTES_PER_PARAM: f64 = 8.0;

/// Whether an operator's time is set by arithmetic (matrix products) or by memory traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    Dense,
    Memory,
}

/// One operator's cost for one micro-batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpWorkload {
    pub name: String,
    pub op: String,
    pub kind: OpKind,
    pub fwd_flops: f64,
    pub bwd_flops: f64,
    /// Bytes read and written by the forward pass (inputs, parameters, output).
    pub fwd_bytes: f64,
    /// Bytes read and written by the backward pass (about twice the forward's: it reads the
    /// output gradient and saved inputs and writes input and parameter gradients).
    pub bwd_bytes: f64,
    /// Trainable parameters first used by this operator (a shared one counts once).
    pub params: usize,
    pub param_bytes: f64,
    pub grad_bytes: f64,
    pub optimizer_bytes: f64,
    /// Bytes kept from forward until backward per micro-batch in flight (output and saved state).
    pub activation_bytes: f64,
}

/// A tensor produced by one operator and read by later ones: what crosses a fence between them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorFlow {
    pub name: String,
    pub bytes: f64,
    /// Position of the producing operator.
    pub producer: usize,
    /// Positions of the consuming operators, ascending.
    pub consumers: Vec<usize>,
}

/// A parameter read by several operators (GPT-2's token embedding, tied to the output head):
/// stages that hold it exchange their gradient parts every step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedParam {
    pub name: String,
    pub bytes: f64,
    /// Positions of the operators reading it, ascending.
    pub users: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    pub model: String,
    pub ops: Vec<OpWorkload>,
    pub flows: Vec<TensorFlow>,
    /// `cut_bytes[p]`: bytes of every tensor crossing a fence placed before operator `p`
    /// (produced before it, read at or after it); `cut_bytes[0] = 0`.
    pub cut_bytes: Vec<f64>,
    /// Global node index of the operator at each position.
    pub node_of_position: Vec<usize>,
    #[serde(default)]
    pub shared: Vec<SharedParam>,
}

fn op_kind(op: &Op) -> OpKind {
    match op {
        Op::Linear { .. }
        | Op::Conv2d { .. }
        | Op::CausalSelfAttention { .. }
        | Op::GroupedQueryAttention { .. } => OpKind::Dense,
        _ => OpKind::Memory,
    }
}

impl Workload {
    /// The workload of `graph` for one micro-batch (the graph's static batch), with optimizer
    /// state of `optimizer_bytes_per_param` per trainable parameter.
    pub fn of(graph: &Graph, optimizer_bytes_per_param: f64) -> Result<Self, EstimateError> {
        let cost = GraphCost::of(graph);
        let order = graph.topo_order()?;
        let mut position = vec![0usize; graph.nodes.len()];
        for (p, n) in order.iter().enumerate() {
            position[n.0] = p;
        }
        let ops: Vec<OpWorkload> = order
            .iter()
            .map(|nid| {
                let node = graph.node(*nid);
                let c = &cost.nodes[nid.0];
                let inputs: usize = node.inputs.iter().map(|t| graph.tensor(*t).bytes()).sum();
                let weights: usize = node
                    .params
                    .iter()
                    .map(|p| graph.param(*p).numel() * 4)
                    .sum();
                let fwd_bytes = (inputs + weights + c.activation_bytes) as f64;
                let params = c.params as f64;
                OpWorkload {
                    name: c.name.clone(),
                    op: c.op.to_string(),
                    kind: op_kind(&node.op),
                    fwd_flops: c.fwd_flops,
                    bwd_flops: c.bwd_flops,
                    fwd_bytes,
                    bwd_bytes: 2.0 * fwd_bytes,
                    params: c.params,
                    param_bytes: 4.0 * params,
                    grad_bytes: 4.0 * params,
                    optimizer_bytes: optimizer_bytes_per_param * params,
                    activation_bytes: (c.activation_bytes + c.saved_bytes) as f64,
                }
            })
            .collect();
        let producers = graph.producers();
        let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); graph.tensors.len()];
        for (i, n) in graph.nodes.iter().enumerate() {
            for t in &n.inputs {
                consumers[t.0].push(position[i]);
            }
        }
        let mut flows = Vec::new();
        for (t, info) in graph.tensors.iter().enumerate() {
            let Some(p) = producers[t] else { continue };
            let mut cs: Vec<usize> = consumers[t].clone();
            cs.sort_unstable();
            cs.dedup();
            if cs.is_empty() {
                continue;
            }
            flows.push(TensorFlow {
                name: info.name.clone(),
                bytes: info.bytes() as f64,
                producer: position[p.0],
                consumers: cs,
            });
        }
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); graph.params.len()];
        for (i, n) in graph.nodes.iter().enumerate() {
            for p in &n.params {
                users[p.0].push(position[i]);
            }
        }
        let shared = users
            .into_iter()
            .enumerate()
            .filter_map(|(p, mut us)| {
                us.sort_unstable();
                us.dedup();
                (us.len() > 1 && graph.params[p].trainable).then(|| SharedParam {
                    name: graph.params[p].name.clone(),
                    bytes: 4.0 * graph.params[p].numel() as f64,
                    users: us,
                })
            })
            .collect();
        let mut w = Workload::from_parts(&graph.name, ops, flows);
        w.node_of_position = order.iter().map(|n| n.0).collect();
        w.shared = shared;
        Ok(w)
    }

    /// A workload from its operators (in topological order) and the tensors between them; the
    /// cut sizes follow. Operators map to graph nodes of the same index.
    pub fn from_parts(model: &str, ops: Vec<OpWorkload>, flows: Vec<TensorFlow>) -> Self {
        let n = ops.len();
        // A flow crosses every fence in (producer, last consumer].
        let mut delta = vec![0.0f64; n + 1];
        for f in &flows {
            let last = *f.consumers.last().unwrap_or(&f.producer);
            if last > f.producer && last < n {
                delta[f.producer + 1] += f.bytes;
                delta[last + 1] -= f.bytes;
            }
        }
        let mut cut_bytes = vec![0.0; n];
        let mut running = 0.0;
        for (p, c) in cut_bytes.iter_mut().enumerate() {
            running += delta[p];
            *c = running.max(0.0);
        }
        Workload {
            model: model.to_string(),
            ops,
            flows,
            cut_bytes,
            node_of_position: (0..n).collect(),
            shared: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub fn flops(&self, range: Range<usize>) -> f64 {
        self.ops[range]
            .iter()
            .map(|o| o.fwd_flops + o.bwd_flops)
            .sum()
    }

    /// Bytes of parameters, gradients and optimizer state, and of activations per micro-batch
    /// in flight, of the operators in `range`.
    pub fn memory(&self, range: Range<usize>) -> (f64, f64) {
        self.ops[range].iter().fold((0.0, 0.0), |(s, a), o| {
            (
                s + o.param_bytes + o.grad_bytes + o.optimizer_bytes,
                a + o.activation_bytes,
            )
        })
    }

    /// Activation bytes of `range` with recomputation in `k` segments (as the executor cuts
    /// them): what each micro-batch in flight keeps (the tensors crossing into every segment),
    /// and the largest segment's own activations, rebuilt for one micro-batch at a time.
    pub fn recompute_memory(&self, range: Range<usize>, k: usize) -> (f64, f64) {
        let bounds: Vec<(usize, usize)> = fusion_exec::segment_bounds(range.len(), k)
            .into_iter()
            .map(|(a, b)| (range.start + a, range.start + b))
            .collect();
        let segment_start = |c: usize| bounds[bounds.partition_point(|&(_, e)| e <= c)].0;
        // A tensor is kept once if any segment reads it from before that segment's start.
        let kept = self
            .flows
            .iter()
            .filter(|f| {
                f.consumers
                    .iter()
                    .any(|&c| range.contains(&c) && f.producer < segment_start(c))
            })
            .map(|f| f.bytes)
            .sum();
        let largest = bounds
            .iter()
            .map(|&(a, b)| self.ops[a..b].iter().map(|o| o.activation_bytes).sum())
            .fold(0.0, f64::max);
        (kept, largest)
    }

    /// Gradient bytes of the parameters in `range` (what data-parallel replicas all-reduce).
    pub fn grad_bytes(&self, range: Range<usize>) -> f64 {
        self.ops[range].iter().map(|o| o.grad_bytes).sum()
    }

    /// Bytes every pair of stages exchanges per micro-batch (activations forward; the same
    /// amount of gradients comes back), for stages given as contiguous position ranges that
    /// cover the graph in order. A tensor read by several operators of one later stage is sent
    /// to that stage once. Returns `(from, to, bytes)` with `from < to`, sorted.
    pub fn traffic(&self, bounds: &[usize]) -> Vec<(usize, usize, f64)> {
        let stage_of = |p: usize| bounds.partition_point(|&b| b <= p);
        let mut pairs: std::collections::BTreeMap<(usize, usize), f64> = Default::default();
        for f in &self.flows {
            let from = stage_of(f.producer);
            let mut last = from;
            for &c in &f.consumers {
                let to = stage_of(c);
                if to > last {
                    *pairs.entry((from, to)).or_insert(0.0) += f.bytes;
                    last = to;
                }
            }
        }
        pairs.into_iter().map(|((a, b), v)| (a, b, v)).collect()
    }

    /// Gradient bytes every pair of stages exchanges once per step for the parameters they
    /// share (each sends its part to the other), for stages given as in [`Workload::traffic`].
    /// Returns `(a, b, bytes)` with `a < b`, sorted.
    pub fn exchanges(&self, bounds: &[usize]) -> Vec<(usize, usize, f64)> {
        let stage_of = |p: usize| bounds.partition_point(|&b| b <= p);
        let mut pairs: std::collections::BTreeMap<(usize, usize), f64> = Default::default();
        for sp in &self.shared {
            let mut holders: Vec<usize> = sp.users.iter().map(|&u| stage_of(u)).collect();
            holders.dedup();
            for (i, &a) in holders.iter().enumerate() {
                for &b in &holders[i + 1..] {
                    *pairs.entry((a, b)).or_insert(0.0) += sp.bytes;
                }
            }
        }
        pairs.into_iter().map(|((a, b), v)| (a, b, v)).collect()
    }

    /// Parameters a stage of the operators in `range` holds and updates: a shared parameter is
    /// counted on its first reader only, so a later stage that also reads it adds it here.
    pub fn params_in(&self, range: Range<usize>) -> f64 {
        let own: f64 = self.ops[range.clone()]
            .iter()
            .map(|o| o.params as f64)
            .sum();
        let copies: f64 = self
            .shared
            .iter()
            .filter(|sp| {
                !sp.users.first().is_some_and(|u| range.contains(u))
                    && sp.users.iter().any(|u| range.contains(u))
            })
            .map(|sp| sp.bytes / 4.0)
            .sum();
        own + copies
    }

    /// The assignment (stage of every graph node, by node index) for stages that start at
    /// positions `0 = starts[0] < starts[1] < ...`.
    pub fn assignment(&self, starts: &[usize]) -> Vec<usize> {
        let mut a = vec![0; self.ops.len()];
        for (p, &node) in self.node_of_position.iter().enumerate() {
            a[node] = starts.partition_point(|&b| b <= p).saturating_sub(1);
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusion_models::ModelSpec;

    #[test]
    fn gpt2_cuts_carry_the_residual_stream_between_blocks_and_more_inside() {
        let g = ModelSpec::preset("gpt2-tiny")
            .expect("preset")
            .graph(2, 16)
            .expect("graph");
        let w = Workload::of(&g, ADAM_STATE_BYTES_PER_PARAM).expect("workload");
        assert_eq!(w.len(), g.nodes.len());
        let c = match &ModelSpec::preset("gpt2-tiny").expect("preset").kind {
            fusion_models::ModelKind::Gpt2(c) => c.n_embd,
            _ => unreachable!(),
        };
        let stream = (2 * 16 * c * 4) as f64;
        let min_inner = w.cut_bytes[2..w.len() - 2]
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min);
        assert_eq!(min_inner, stream, "the thinnest cut is the residual stream");
        // Inside a block the residual travels beside the branch, so the cut is wider.
        let widest = w.cut_bytes.iter().copied().fold(0.0, f64::max);
        assert!(widest >= 2.0 * stream, "{widest} vs {stream}");
        // Totals agree with the graph cost model.
        let total: f64 = w.ops.iter().map(|o| o.fwd_flops).sum();
        assert!((total - GraphCost::of(&g).fwd_flops).abs() < 1.0);
        let params: usize = w.ops.iter().map(|o| o.params).sum();
        assert_eq!(params, g.num_trainable());
    }

    #[test]
    fn recomputation_keeps_the_tensors_crossing_into_segments() {
        // A small vocabulary, so that the blocks' activations dominate the logits'.
        let g = ModelSpec::preset("gpt2-tiny")
            .expect("preset")
            .with_vocab(97)
            .graph(2, 16)
            .expect("graph");
        let w = Workload::of(&g, ADAM_STATE_BYTES_PER_PARAM).expect("workload");
        let n = w.len();
        let (_, stored) = w.memory(0..n);
        // One segment keeps nothing but the graph inputs and rebuilds every activation.
        assert_eq!(w.recompute_memory(0..n, 1), (0.0, stored));
        // A segment per operator keeps every tensor that is read at all.
        let read: f64 = w.flows.iter().map(|f| f.bytes).sum();
        let one_op = w.ops.iter().map(|o| o.activation_bytes).fold(0.0, f64::max);
        assert_eq!(w.recompute_memory(0..n, n), (read, one_op));
        // The default keeps far less than storing, per micro-batch in flight.
        let (kept, largest) = w.recompute_memory(0..n, fusion_exec::default_segments(n));
        assert!(
            kept < stored / 3.0 && largest < stored / 3.0,
            "{kept} {largest} {stored}"
        );
        // A later stage keeps what it receives.
        let (a, b) = (n / 2, n);
        assert!(w.recompute_memory(a..b, 1).0 >= w.cut_bytes[a]);
    }

    #[test]
    fn the_tied_embedding_is_exchanged_between_the_stages_that_hold_it() {
        let g = ModelSpec::preset("gpt2-tiny")
            .expect("preset")
            .with_vocab(97)
            .graph(1, 8)
            .expect("graph");
        let w = Workload::of(&g, 0.0).expect("workload");
        assert_eq!(w.shared.len(), 1, "{:?}", w.shared);
        let embd = w.shared[0].bytes;
        assert_eq!(embd, (97 * 64 * 4) as f64);
        let starts = [0, w.len() / 3, 2 * w.len() / 3];
        // The embedding is read first and last: the outer stages exchange it, nobody else.
        assert_eq!(w.exchanges(&starts[1..]), vec![(0, 2, embd)]);
        assert!(w.exchanges(&[]).is_empty(), "one stage holds it whole");
        // Every stage updates what its graph holds, the shared copy included.
        let stages = g.split(&w.assignment(&starts)).expect("split");
        for (s, st) in stages.iter().enumerate() {
            let end = starts.get(s + 1).copied().unwrap_or(w.len());
            assert_eq!(
                w.params_in(starts[s]..end),
                st.graph.num_trainable() as f64,
                "stage {s}"
            );
        }
    }

    #[test]
    fn traffic_counts_a_tensor_once_per_consuming_stage_and_matches_the_split() {
        let g = ModelSpec::preset("gpt2-tiny")
            .expect("preset")
            .graph(1, 8)
            .expect("graph");
        let w = Workload::of(&g, 0.0).expect("workload");
        let starts = [0, w.len() / 3, 2 * w.len() / 3];
        let traffic = w.traffic(&starts[1..]);
        let stages = g.split(&w.assignment(&starts)).expect("split");
        // Every pair's bytes equal the inputs the receiving stage graph gets from that stage.
        for (from, to, bytes) in &traffic {
            assert!(from < to);
            let producers = g.producers();
            let a = w.assignment(&starts);
            let expect: usize = stages[*to]
                .global_inputs()
                .into_iter()
                .filter(|t| producers[t.0].is_some_and(|n| a[n.0] == *from))
                .map(|t| g.tensor(t).bytes())
                .sum();
            assert_eq!(*bytes, expect as f64, "{from}->{to}");
        }
        // The cut before a stage's first operator is everything its predecessors send past it.
        let fence = starts[1];
        let crossing: f64 = traffic
            .iter()
            .filter(|(f, _, _)| *f == 0)
            .map(|(_, _, b)| b)
            .sum();
        assert!(crossing >= w.cut_bytes[fence] - 1e-9);
    }
}
