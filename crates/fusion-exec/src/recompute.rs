//! Where activation recomputation cuts a graph: runs of nodes in topological order, and the
//! values each run reads from before it (what a recorded pass keeps instead of the tape).

use fusion_graph::{Graph, NodeId, TensorId};
use std::collections::BTreeSet;

/// Nodes `order[start..end]` and the tensors they read that come from before `start` (graph
/// inputs or earlier nodes' outputs), ascending by id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub start: usize,
    pub end: usize,
    pub reads: Vec<TensorId>,
}

/// The segment count recomputation uses by default for `nodes` operators: about their square
/// root, which balances what is kept between segments against the one segment rebuilt at a time.
pub fn default_segments(nodes: usize) -> usize {
    ((nodes as f64).sqrt().ceil() as usize).max(1)
}

/// `k` runs of nearly equal length covering `0..n` (fewer when `n < k`), as `(start, end)`.
pub fn segment_bounds(n: usize, k: usize) -> Vec<(usize, usize)> {
    let k = k.clamp(1, n.max(1));
    (0..k)
        .map(|i| (i * n / k, (i + 1) * n / k))
        .filter(|(a, b)| a < b)
        .collect()
}

/// Splits `order` into `k` runs as [`segment_bounds`] does, with what each reads from before it.
pub fn segments(graph: &Graph, order: &[NodeId], k: usize) -> Vec<Segment> {
    let mut produced_at = vec![usize::MAX; graph.tensors.len()];
    for (pos, nid) in order.iter().enumerate() {
        for t in &graph.node(*nid).outputs {
            produced_at[t.0] = pos;
        }
    }
    segment_bounds(order.len(), k)
        .into_iter()
        .map(|(start, end)| {
            let reads: BTreeSet<TensorId> = order[start..end]
                .iter()
                .flat_map(|nid| graph.node(*nid).inputs.iter().copied())
                .filter(|t| produced_at[t.0] == usize::MAX || produced_at[t.0] < start)
                .collect();
            Segment {
                start,
                end,
                reads: reads.into_iter().collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_cover_every_position_once() {
        for n in 0..40 {
            for k in 1..12 {
                let b = segment_bounds(n, k);
                assert_eq!(b.len(), k.min(n));
                let mut next = 0;
                for (s, e) in b {
                    assert_eq!(s, next);
                    assert!(e > s);
                    next = e;
                }
                assert_eq!(next, n);
            }
        }
        assert_eq!(default_segments(0), 1);
        assert_eq!(default_segments(120), 11);
    }
}
