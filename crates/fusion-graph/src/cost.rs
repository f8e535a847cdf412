//! Analytic cost model: FLOPs and bytes per operator. The workload estimator calibrates these
//! figures with measured device speed; the summary command prints them.

use crate::graph::{Graph, Node};
use crate::op::Op;
use crate::shape::numel;
use serde::Serialize;

/// Cost of one node for one forward and one backward pass over the graph's static shapes.
#[derive(Clone, Debug, Serialize)]
pub struct NodeCost {
    pub name: String,
    pub op: &'static str,
    pub output_shape: Vec<usize>,
    /// Trainable parameter elements owned by this node (a shared parameter counts at its first user).
    pub params: usize,
    pub fwd_flops: f64,
    pub bwd_flops: f64,
    /// Bytes of the node's output activation (what crosses a cut placed after it).
    pub activation_bytes: usize,
    /// Extra bytes kept from forward for backward beyond the inputs (attention probabilities).
    pub saved_bytes: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct GraphCost {
    pub nodes: Vec<NodeCost>,
    pub params: usize,
    pub fwd_flops: f64,
    pub bwd_flops: f64,
    pub activation_bytes: usize,
}

fn node_flops(g: &Graph, n: &Node) -> (f64, f64, usize) {
    let ins: Vec<&[usize]> = n
        .inputs
        .iter()
        .map(|t| g.tensor(*t).shape.as_slice())
        .collect();
    let out = &g.tensor(n.outputs[0]).shape;
    let out_n = numel(out) as f64;
    let in_n = numel(ins[0]) as f64;
    match &n.op {
        Op::Linear { .. } => {
            let k = *ins[0].last().unwrap_or(&0) as f64;
            let mm = 2.0 * out_n * k;
            (mm + out_n, 2.0 * mm + out_n, 0)
        }
        Op::Embedding => (0.0, out_n, 0),
        Op::PositionalEmbedding => (out_n, out_n, 0),
        Op::LayerNorm { .. } => (8.0 * in_n, 12.0 * in_n, 0),
        Op::CausalSelfAttention { n_head } => {
            let (b, t, c3) = (ins[0][0] as f64, ins[0][1] as f64, ins[0][2] as f64);
            let c = c3 / 3.0;
            let scores = b * (*n_head as f64) * t * t;
            let mm = 4.0 * b * t * t * c;
            (
                mm + 5.0 * scores,
                2.0 * mm + 6.0 * scores,
                (scores as usize) * 4,
            )
        }
        Op::Gelu => (10.0 * in_n, 14.0 * in_n, 0),
        Op::Relu | Op::Add | Op::Flatten => (in_n, in_n, 0),
        Op::Conv2d { kernel, .. } => {
            let c_in = ins[0][1] as f64;
            let mm = 2.0 * out_n * c_in * (*kernel as f64) * (*kernel as f64);
            (mm, 2.0 * mm, 0)
        }
        Op::BatchNorm2d { .. } => (8.0 * in_n, 12.0 * in_n, 0),
        Op::MaxPool2d { kernel, .. } | Op::AvgPool2d { kernel, .. } => {
            let w = (*kernel * *kernel) as f64;
            (out_n * w, out_n * w, 0)
        }
        Op::GlobalAvgPool => (in_n, in_n, 0),
        Op::SoftmaxCrossEntropy => (5.0 * in_n, 3.0 * in_n, (in_n as usize) * 4),
        Op::RmsNorm { .. } => (5.0 * in_n, 9.0 * in_n, 0),
        Op::Silu => (5.0 * in_n, 9.0 * in_n, 0),
        Op::Mul => (in_n, 2.0 * in_n, 0),
        Op::GroupedQueryAttention { n_head, .. } => {
            let (b, t, c) = (ins[0][0] as f64, ins[0][1] as f64, ins[0][2] as f64);
            let scores = b * (*n_head as f64) * t * t;
            let mm = 4.0 * b * t * t * c;
            // The rotations of q and k: a few FLOPs per value.
            let rope = 3.0 * (in_n + numel(ins[1]) as f64);
            (
                mm + 5.0 * scores + rope,
                2.0 * mm + 6.0 * scores + rope,
                (scores as usize) * 4,
            )
        }
    }
}

impl GraphCost {
    pub fn of(g: &Graph) -> GraphCost {
        let mut seen = vec![false; g.params.len()];
        let nodes: Vec<NodeCost> = g
            .nodes
            .iter()
            .map(|n| {
                let (fwd, bwd, saved) = node_flops(g, n);
                let mut params = 0;
                for p in &n.params {
                    if !seen[p.0] && g.param(*p).trainable {
                        seen[p.0] = true;
                        params += g.param(*p).numel();
                    }
                }
                let out = g.tensor(n.outputs[0]);
                NodeCost {
                    name: n.name.clone(),
                    op: n.op.name(),
                    output_shape: out.shape.clone(),
                    params,
                    fwd_flops: fwd,
                    bwd_flops: bwd,
                    activation_bytes: out.bytes(),
                    saved_bytes: saved,
                }
            })
            .collect();
        GraphCost {
            params: nodes.iter().map(|n| n.params).sum(),
            fwd_flops: nodes.iter().map(|n| n.fwd_flops).sum(),
            bwd_flops: nodes.iter().map(|n| n.bwd_flops).sum(),
            activation_bytes: nodes
                .iter()
                .map(|n| n.activation_bytes + n.saved_bytes)
                .sum(),
            nodes,
        }
    }
}
