//! The exact optimum of the cost model for small instances (one replica): a depth-first search
//! over every ordered choice of devices and every fence position, pruned by a lower bound that
//! never overestimates (the bottleneck and fill so far only grow, and the operators still to
//! place need at least their fastest per-operator time). Used to measure OP-Fence's gap.

use crate::error::PlanError;
use crate::plan::{Evaluation, Plan, Problem};

/// Largest instance the search accepts.
pub const MAX_DEVICES: usize = 8;
pub const MAX_OPS: usize = 64;

struct Search<'p, 'a> {
    p: &'p Problem<'a>,
    /// Prefix sums of every operator's fastest time on any device.
    min_prefix: Vec<f64>,
    /// The best complete plan found so far, and its objective (or the starting incumbent's).
    best: Option<(Plan, Evaluation)>,
    incumbent: f64,
    starts: Vec<usize>,
    devices: Vec<usize>,
    nodes: u64,
    node_limit: u64,
}

impl Search<'_, '_> {
    /// Bytes stage `k` (operators `a..b`) receives from each earlier stage.
    fn inbound(&self, a: usize, b: usize) -> Vec<f64> {
        let k = self.starts.len();
        let mut bytes = vec![0.0; k];
        for f in &self.p.workload.flows {
            if f.producer >= a {
                continue;
            }
            if f.consumers.iter().any(|&c| c >= a && c < b) {
                let from = self.starts.partition_point(|&s| s <= f.producer) - 1;
                bytes[from] += f.bytes;
            }
        }
        bytes
    }

    fn dfs(&mut self, a: usize, bottleneck: f64, fill: f64, used: u32) {
        self.nodes += 1;
        let p = self.p;
        let n = p.ops();
        let m1 = (p.micro_batches - 1) as f64;
        if a == n {
            let plan = Plan {
                starts: self.starts.clone(),
                devices: self.devices.iter().map(|&d| vec![d]).collect(),
            };
            if let Ok(e) = p.evaluate(&plan) {
                if e.objective < self.incumbent {
                    self.incumbent = e.objective;
                    self.best = Some((plan, e));
                }
            }
            return;
        }
        if self.nodes > self.node_limit {
            return;
        }
        let free = (0..p.devices()).filter(|d| used & (1 << d) == 0).count();
        if free == 0 {
            return;
        }
        let rest = self.min_prefix[n] - self.min_prefix[a];
        let bound = m1 * bottleneck.max(rest / free as f64) + fill + rest;
        if bound >= self.incumbent {
            return;
        }
        for d in 0..p.devices() {
            if used & (1 << d) != 0 {
                continue;
            }
            // The last stage must reach the end; an earlier one leaves room for nothing less.
            for b in (a + 1..=n).rev() {
                let t = p.compute(d, a, b);
                let rest_after = self.min_prefix[n] - self.min_prefix[b];
                if m1 * bottleneck.max(t) + fill + t + rest_after >= self.incumbent {
                    continue;
                }
                let inbound = self.inbound(a, b);
                let mut bn = bottleneck.max(t);
                let mut hop = 0.0;
                for (j, &bytes) in inbound.iter().enumerate() {
                    let x = self.devices[j];
                    let secs = p.transfer(x, d, bytes).max(p.transfer(d, x, bytes));
                    bn = bn.max(secs);
                    if j + 1 == inbound.len() {
                        let lat = p.network.latency[x][d].max(p.network.latency[d][x]);
                        hop = 2.0 * (secs + lat);
                    }
                }
                self.starts.push(a);
                self.devices.push(d);
                self.dfs(b, bn, fill + t + hop, used | (1 << d));
                self.starts.pop();
                self.devices.pop();
            }
        }
    }
}

/// The optimal one-replica plan, starting from `incumbent` (a known plan's objective, to prune).
/// Gives up with an error past `node_limit` search nodes rather than run for hours.
pub fn optimal(
    p: &Problem,
    incumbent: Option<(Plan, Evaluation)>,
    node_limit: u64,
) -> Result<(Plan, Evaluation), PlanError> {
    if p.devices() > MAX_DEVICES || p.ops() > MAX_OPS {
        return Err(PlanError::TooLarge {
            scheduler: "optimal",
            why: format!(
                "{} devices and {} operators (exhaustive search takes up to {MAX_DEVICES} and {MAX_OPS})",
                p.devices(),
                p.ops()
            ),
        });
    }
    let n = p.ops();
    let mut min_prefix = vec![0.0; n + 1];
    for i in 0..n {
        let fastest = (0..p.devices())
            .map(|d| p.compute(d, i, i + 1))
            .fold(f64::INFINITY, f64::min);
        min_prefix[i + 1] = min_prefix[i] + fastest;
    }
    let incumbent_value = incumbent
        .as_ref()
        .map_or(f64::INFINITY, |(_, e)| e.objective * (1.0 + 1e-12));
    let mut s = Search {
        p,
        min_prefix,
        best: None,
        incumbent: incumbent_value,
        starts: Vec::new(),
        devices: Vec::new(),
        nodes: 0,
        node_limit,
    };
    s.dfs(0, 0.0, 0.0, 0);
    if s.nodes > node_limit {
        return Err(PlanError::TooLarge {
            scheduler: "optimal",
            why: format!("the search passed {node_limit} nodes"),
        });
    }
    match (s.best, incumbent) {
        (Some(b), _) => Ok(b),
        (None, Some(i)) => Ok(i),
        (None, None) => Err(PlanError::Infeasible(
            "no one-replica plan fits in memory".into(),
        )),
    }
}
