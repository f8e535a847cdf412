//! The schedulers OP-Fence is compared with.
//!
//! - `even`: what a naive pipeline does: every device in testbed order, equal operator counts.
//! - `compute`: every device in testbed order, work in proportion to device speed; blind to links.
//! - `dtfm`: in the spirit of DT-FM (Yuan et al., 2022): devices are matched into data-parallel
//!   groups of well-connected devices, the groups ordered along fast links (a greedy open tour),
//!   then a seeded local search swaps devices between slots; the model is split into stages of
//!   equal compute, as DT-FM assumes uniform layers.

use crate::cluster::pair_bandwidth;
use crate::error::PlanError;
use crate::plan::{Evaluation, Plan, Problem};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Stage starts that split operators `0..n` into `shares.len()` runs whose compute on the
/// reference device follows `shares` (each run non-empty).
fn split_by_shares(p: &Problem, shares: &[f64]) -> Vec<usize> {
    let n = p.ops();
    let total = p.compute(0, 0, n);
    let sum: f64 = shares.iter().sum();
    let mut starts = vec![0];
    let mut acc = 0.0;
    let mut pos = 0;
    for (k, s) in shares.iter().enumerate().take(shares.len() - 1) {
        acc += s / sum;
        let left = shares.len() - 1 - k; // stages still to start after this one
        pos += 1;
        while pos < n - left && p.compute(0, 0, pos) < acc * total {
            pos += 1;
        }
        starts.push(pos);
    }
    starts
}

fn one_replica(devices: &[usize]) -> Vec<Vec<usize>> {
    devices.iter().map(|&d| vec![d]).collect()
}

/// Even split by operator count over the first `stages` devices (default: all) in testbed order.
pub fn even(p: &Problem, stages: Option<usize>) -> Result<(Plan, Evaluation), PlanError> {
    let n = p.ops();
    let s = stages.unwrap_or(p.devices()).min(n).min(p.devices());
    let plan = Plan {
        starts: (0..s).map(|k| k * n / s).collect(),
        devices: one_replica(&(0..s).collect::<Vec<_>>()),
    };
    let e = p.evaluate(&plan)?;
    Ok((plan, e))
}

/// Compute-proportional split over the first `stages` devices in testbed order.
pub fn compute(p: &Problem, stages: Option<usize>) -> Result<(Plan, Evaluation), PlanError> {
    let n = p.ops();
    let s = stages.unwrap_or(p.devices()).min(n).min(p.devices());
    let devices: Vec<usize> = (0..s).collect();
    let shares: Vec<f64> = devices.iter().map(|&d| 1.0 / p.compute(d, 0, n)).collect();
    let plan = Plan {
        starts: split_by_shares(p, &shares),
        devices: one_replica(&devices),
    };
    let e = p.evaluate(&plan)?;
    Ok((plan, e))
}

/// Groups of `r` devices, each seeded by the first free device and filled with the free devices
/// best connected to it.
fn match_groups(p: &Problem, r: usize) -> Vec<Vec<usize>> {
    let mut free: Vec<usize> = (0..p.devices()).collect();
    let mut groups = Vec::new();
    while free.len() >= r {
        let seed = free.remove(0);
        free.sort_by(|&a, &b| {
            pair_bandwidth(p.network, seed, b).total_cmp(&pair_bandwidth(p.network, seed, a))
        });
        let mut g = vec![seed];
        g.extend(free.drain(..r - 1));
        free.sort_unstable();
        groups.push(g);
    }
    groups
}

/// Orders groups as a greedy open tour along the fastest links between them.
fn order_groups(p: &Problem, groups: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
    let speed = |a: &[usize], b: &[usize]| {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| pair_bandwidth(p.network, x, y))
            .fold(f64::INFINITY, f64::min)
    };
    let mut left = groups;
    let mut order = vec![left.remove(0)];
    while !left.is_empty() {
        let last = &order[order.len() - 1];
        let (i, _) = left
            .iter()
            .enumerate()
            .max_by(|a, b| speed(last, a.1).total_cmp(&speed(last, b.1)))
            .unwrap_or((0, &left[0]));
        order.push(left.remove(i));
    }
    order
}

/// DT-FM-like search with `budget` evaluations per replica count, seeded for reproducibility.
pub fn dtfm(
    p: &Problem,
    stages: Option<usize>,
    replicas: Option<usize>,
    budget: usize,
    seed: u64,
) -> Result<(Plan, Evaluation), PlanError> {
    let n = p.ops();
    let counts: Vec<usize> = match (replicas, stages) {
        (Some(r), _) => vec![r],
        (None, Some(s)) => vec![(p.devices() / s).max(1)],
        (None, None) => (1..=p.devices())
            .filter(|r| {
                p.devices().is_multiple_of(*r) && p.devices() / r <= n && p.devices() / r <= 64
            })
            .collect(),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut best: Option<(Plan, Evaluation)> = None;
    for r in counts {
        let mut groups = order_groups(p, match_groups(p, r));
        if let Some(s) = stages {
            groups.truncate(s);
        }
        let s = groups.len().min(n);
        groups.truncate(s);
        if s == 0 {
            continue;
        }
        let mut plan = Plan {
            starts: split_by_shares(p, &vec![1.0; s]),
            devices: groups,
        };
        let mut e = p.evaluate(&plan)?;
        let slots = s * r;
        for _ in 0..budget {
            let (a, b) = (rng.random_range(0..slots), rng.random_range(0..slots));
            if a == b {
                continue;
            }
            let mut q = plan.clone();
            let (x, y) = (q.devices[a / r][a % r], q.devices[b / r][b % r]);
            q.devices[a / r][a % r] = y;
            q.devices[b / r][b % r] = x;
            let qe = p.evaluate(&q)?;
            if qe.objective < e.objective {
                (plan, e) = (q, qe);
            }
        }
        if best.as_ref().is_none_or(|(_, b)| e.objective < b.objective) {
            best = Some((plan, e));
        }
    }
    best.ok_or_else(|| PlanError::Infeasible("no replica count divides the devices".into()))
}
