//! Hierarchical plans: islands that each run their own OP-Fence plan, synchronised every H inner
//! steps by an outer optimizer (DiLoCo-style) across the slow links between them.
//!
//! OP-Fence's clusters, in its pipeline order, are joined by slow links. For each such link the
//! planner decides whether to cut the pipeline across it (the two clusters form one island) or
//! to synchronise across it (they are different islands), and which islands take part at all.
//! Each island is planned by OP-Fence on its own devices. A round of H inner steps costs the
//! islands' inner step (batch shares in proportion to each island's throughput make them reach
//! the synchronisation together) and the exchange of the pseudo-gradients (which stalls the
//! islands, or with `overlap` runs beside the next round's compute; with fragments, one smaller
//! exchange every H / F steps: `exchange`); islands pay a convergence penalty in tokens
//! ([`ConvergencePenalty`]). The objective is micro-batches per second at equal convergence.

use crate::cluster::{cluster_by_bandwidth, order_clusters, Clustering};
use crate::error::PlanError;
use crate::exchange::{fragment_seconds, parameterised_ops, round_seconds};
use crate::network::Network;
use crate::opfence::{opfence, OpFenceOptions};
use crate::plan::{Evaluation, Plan, Problem};
use serde::{Deserialize, Serialize};

/// Up to this many clusters every grouping of consecutive clusters into islands is tried.
const EXHAUSTIVE_CLUSTERS: usize = 8;

/// The best hierarchies (besides the best of each island count) whose replicated islands are
/// tried split into islands of their own.
const SPLIT_CANDIDATES: usize = 4;

/// Islands planned so far, by their devices (None: no plan fits there).
type Memo = std::collections::HashMap<Vec<usize>, Option<Island>>;

/// Tokens islands need, relative to one synchronous job, to reach the same loss:
/// `1 + (per_log_every · ln H + per_island · ln I) · codec penalty` for I ≥ 2 islands
/// synchronising every H steps (1 for one island). Fitted to our own convergence runs
/// (`docs/BENCHMARKS.md`, "Islands").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConvergencePenalty {
    pub per_log_every: f64,
    pub per_island: f64,
}

impl ConvergencePenalty {
    /// The token factor (at least 1) of `islands` islands synchronising every `every` steps with
    /// a codec whose own penalty multiplies the islands' (1 for dense).
    pub fn factor(&self, every: u64, islands: usize, codec: f64) -> f64 {
        if islands < 2 {
            return 1.0;
        }
        let h = (every.max(1) as f64).ln();
        let i = (islands as f64).ln();
        1.0 + codec * (self.per_log_every * h + self.per_island * i).max(0.0)
    }
}

/// A way to send pseudo-gradients: its bytes relative to dense f32 and how much it multiplies
/// the convergence penalty.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OuterCodec {
    pub name: String,
    pub ratio: f64,
    pub penalty: f64,
}

/// What the hierarchical planner may choose from.
#[derive(Clone, Debug)]
pub struct OuterOptions {
    /// Candidate inner steps between synchronisations.
    pub every: Vec<u64>,
    pub codecs: Vec<OuterCodec>,
    pub penalty: ConvergencePenalty,
    /// Exactly this many islands (None: the planner's choice, one included).
    pub islands: Option<usize>,
    /// The exchange runs beside the next round's compute (`train --outer-overlap`); otherwise
    /// it stalls the islands (a blocking synchronisation).
    pub overlap: bool,
    /// The model is synchronised in this many fragments, one every `every / fragments` steps
    /// (`train --outer-fragments`); only the candidate `every`s it divides are tried.
    pub fragments: u32,
    /// OP-Fence's knobs for each island.
    pub fence: OpFenceOptions,
    /// Islands may run pipelines and span several clusters. Without: DiLoCo across clusters,
    /// every cluster one data-parallel island (one stage per device).
    pub pipelines: bool,
    /// Most islands a hierarchy may have. The penalty is measured at 2 and 4 islands; its
    /// logarithmic form is trusted one doubling further and no more (48 one-device islands
    /// would look cheap to it, which nothing we measured supports).
    pub max_islands: usize,
}

impl OuterOptions {
    /// Refuses no candidate interval, fragments no candidate interval can take (each fragment
    /// goes every H / F steps) and more fragments than the model has operators with parameters
    /// (stricter than the broker, which counts tensors: a band is cut between operators).
    pub fn validate(&self, p: &Problem) -> Result<(), PlanError> {
        if self.every.is_empty() {
            return Err(PlanError::Invalid(
                "no synchronisation interval to choose from".into(),
            ));
        }
        let f = u64::from(self.fragments.max(1));
        if !self.every.iter().any(|e| e.is_multiple_of(f)) {
            return Err(PlanError::Invalid(format!(
                "{f} fragments divide none of the synchronisation intervals {:?}: each \
                 fragment goes every H / {f} steps",
                self.every
            )));
        }
        let bytes: Vec<f64> = p.workload.ops.iter().map(|o| o.param_bytes).collect();
        let most = parameterised_ops(&bytes) as u64;
        if f > most.max(1) {
            return Err(PlanError::Invalid(format!(
                "{f} fragments of a model with {most} operators that hold parameters"
            )));
        }
        Ok(())
    }
}

impl Default for OuterOptions {
    fn default() -> Self {
        OuterOptions {
            // The range our convergence runs cover (the penalty is not known beyond it). With
            // the fitted penalty, which does not grow with H, the largest H amortises the
            // exchange best and wins.
            every: vec![10, 25, 50, 100, 200],
            codecs: vec![
                OuterCodec {
                    name: "dense".into(),
                    ratio: 1.0,
                    penalty: 1.0,
                },
                OuterCodec {
                    name: "int8".into(),
                    ratio: 0.254,
                    penalty: 1.0,
                },
            ],
            // Fitted to our 600-step runs (the best setting per H and island count; the
            // 2000-step runs showed no penalty at all): docs/BENCHMARKS.md, "Islands".
            penalty: ConvergencePenalty {
                per_log_every: 0.0,
                per_island: 0.0232,
            },
            islands: None,
            overlap: false,
            fragments: 1,
            fence: OpFenceOptions::default(),
            pipelines: true,
            max_islands: 8,
        }
    }
}

/// One island: some of OP-Fence's clusters and their own plan. Islands split off a replicated
/// one keep its clusters, so several islands may name the same cluster; a search's islands
/// (`anneal`) name none.
#[derive(Clone, Debug, Serialize)]
pub struct Island {
    /// Indices into the clustering's clusters (consecutive in its order).
    pub clusters: Vec<usize>,
    /// The island's plan, in the whole network's device numbers.
    pub plan: Plan,
    pub evaluation: Evaluation,
    /// Micro-batches per second at the plan's simulated step (every replica's micro-batches).
    pub rate: f64,
    /// The island's share of each inner step's micro-batches.
    pub share: f64,
}

/// The planner's answer: islands, how often and how they synchronise, and what that yields.
#[derive(Clone, Debug, Serialize)]
pub struct Hierarchy {
    /// OP-Fence's clusters (device numbers), in its pipeline order.
    pub clusters: Vec<Vec<usize>>,
    pub islands: Vec<Island>,
    /// Devices no island uses.
    pub idle: Vec<usize>,
    pub every: u64,
    pub codec: OuterCodec,
    /// Seconds of a round's exchanges of pseudo-gradients (the slowest device's part of each
    /// ring), all fragments together: with one fragment, the whole model's exchange.
    pub sync_s: f64,
    /// Fragments the model is synchronised in, and each one's exchange seconds in turn.
    pub fragments: u32,
    pub fragment_sync_s: Vec<f64>,
    /// Seconds of the islands' inner step at their shares, and of a round of `every` of them.
    pub inner_step_s: f64,
    pub round_s: f64,
    /// Micro-batches per second the islands train together, and at equal convergence (divided
    /// by the penalty, stretched by a blocking exchange or by an overlapped one longer than the
    /// compute it runs beside: the round's, or a fragment's H / F steps).
    pub inner_rate: f64,
    pub penalty: f64,
    pub effective_rate: f64,
}

impl Hierarchy {
    /// Sets `idle`: the devices among `0..devices` that no island uses.
    pub fn set_idle(&mut self, devices: usize) {
        let mut used = vec![false; devices];
        for d in self
            .islands
            .iter()
            .flat_map(|i| i.plan.devices.iter().flatten())
        {
            if let Some(u) = used.get_mut(*d) {
                *u = true;
            }
        }
        self.idle = (0..devices).filter(|&d| !used[d]).collect();
    }
}

/// The network restricted to `devices` (in that order).
pub fn sub_network(net: &Network, devices: &[usize]) -> Network {
    Network {
        devices: devices.iter().map(|&d| net.devices[d].clone()).collect(),
        bandwidth: devices
            .iter()
            .map(|&a| devices.iter().map(|&b| net.bandwidth[a][b]).collect())
            .collect(),
        latency: devices
            .iter()
            .map(|&a| devices.iter().map(|&b| net.latency[a][b]).collect())
            .collect(),
    }
}

/// OP-Fence on the devices of `clusters`: the island, or None when no plan fits there.
fn plan_island(
    p: &Problem,
    clustering: &Clustering,
    clusters: Vec<usize>,
    fence: &OpFenceOptions,
    memo: &mut Memo,
) -> Result<Option<Island>, PlanError> {
    let devices: Vec<usize> = clusters
        .iter()
        .flat_map(|&c| clustering.clusters[c].iter().copied())
        .collect();
    plan_on(p, &devices, clusters, fence, memo)
}

/// OP-Fence on `devices` (labelled with the `clusters` they come from): the island, or None
/// when no plan fits there. Remembered in `memo`.
fn plan_on(
    p: &Problem,
    devices: &[usize],
    clusters: Vec<usize>,
    fence: &OpFenceOptions,
    memo: &mut Memo,
) -> Result<Option<Island>, PlanError> {
    if let Some(known) = memo.get(devices) {
        return Ok(known.clone());
    }
    let island = plan_fresh(p, devices, clusters, fence)?;
    memo.insert(devices.to_vec(), island.clone());
    Ok(island)
}

fn plan_fresh(
    p: &Problem,
    devices: &[usize],
    clusters: Vec<usize>,
    fence: &OpFenceOptions,
) -> Result<Option<Island>, PlanError> {
    let net = sub_network(p.network, devices);
    let q = p.on_network(&net)?;
    let found = match opfence(&q, fence) {
        Ok(r) => r,
        Err(PlanError::Infeasible(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    if !found.evaluation.fits() {
        return Ok(None);
    }
    let plan = Plan {
        starts: found.plan.starts,
        devices: found
            .plan
            .devices
            .iter()
            .map(|r| r.iter().map(|&d| devices[d]).collect())
            .collect(),
    };
    // Islands are ranked by the simulator's step: the closed form and the simulator differ by
    // up to 20% on pipelines over wide-area links, and the hierarchy is judged by the latter.
    let rate = (p.micro_batches * plan.replicas()) as f64 / p.simulate(&plan, 1.0)?.step_s;
    Ok(Some(Island {
        clusters,
        plan,
        evaluation: found.evaluation,
        rate,
        share: 0.0,
    }))
}

/// `isl` as `k` islands, each running the same stages on `R / k` of its replicas; None when a
/// part does not fit (defensive: a smaller ring needs no more memory than the island did).
fn split_island(p: &Problem, isl: &Island, k: usize) -> Result<Option<Vec<Island>>, PlanError> {
    let per = isl.plan.replicas() / k;
    let mut parts = Vec::with_capacity(k);
    for part in 0..k {
        let plan = Plan {
            starts: isl.plan.starts.clone(),
            devices: isl
                .plan
                .devices
                .iter()
                .map(|row| row[part * per..(part + 1) * per].to_vec())
                .collect(),
        };
        let evaluation = p.evaluate(&plan)?;
        if !evaluation.fits() {
            return Ok(None);
        }
        let rate = (p.micro_batches * per) as f64 / p.simulate(&plan, 1.0)?.step_s;
        parts.push(Island {
            clusters: isl.clusters.clone(),
            plan,
            evaluation,
            rate,
            share: 0.0,
        });
    }
    Ok(Some(parts))
}

/// Splits replicated islands into islands of their own while that trains faster at equal
/// convergence, within `o.max_islands`: inside a cluster an all-reduce every step can cost more
/// than the penalty of synchronising rarely (gpt2-xl's 6 GB of gradients over 10 Gbit/s take
/// seconds). Greedy: the best single split at a time.
fn split_replicas(p: &Problem, h: Hierarchy, o: &OuterOptions) -> Result<Hierarchy, PlanError> {
    let mut best = h;
    loop {
        let mut improved: Option<Hierarchy> = None;
        let count = best.islands.len();
        for (i, isl) in best.islands.iter().enumerate() {
            let r = isl.plan.replicas();
            for k in (2..=r).filter(|k| r % k == 0 && count - 1 + k <= o.max_islands) {
                let Some(parts) = split_island(p, isl, k)? else {
                    continue;
                };
                let mut islands = best.islands.clone();
                islands.splice(i..=i, parts);
                let Some(c) = best_round(p, islands, o) else {
                    continue;
                };
                let to_beat = improved.as_ref().unwrap_or(&best).effective_rate;
                if c.effective_rate > to_beat * (1.0 + 1e-9) {
                    improved = Some(c);
                }
            }
        }
        match improved {
            Some(c) => best = c,
            None => return Ok(best),
        }
    }
}

/// Groupings of `k` clusters (in order) into runs of consecutive clusters: every one up to
/// [`EXHAUSTIVE_CLUSTERS`]; above, each cluster alone and the runs of the flat plan's clusters.
fn groupings(k: usize, flat: &[usize]) -> Vec<Vec<Vec<usize>>> {
    if k <= EXHAUSTIVE_CLUSTERS {
        return (0..1u64 << (k - 1))
            .map(|cuts| {
                let mut runs = vec![vec![0]];
                for c in 1..k {
                    if cuts >> (c - 1) & 1 == 1 {
                        runs.push(vec![c]);
                    } else if let Some(last) = runs.last_mut() {
                        last.push(c);
                    }
                }
                runs
            })
            .collect();
    }
    let singles: Vec<Vec<usize>> = (0..k).map(|c| vec![c]).collect();
    let mut merged: Vec<Vec<usize>> = vec![flat.to_vec()];
    merged.extend((0..k).filter(|c| !flat.contains(c)).map(|c| vec![c]));
    vec![singles, merged]
}

/// The best `every` and codec for these islands (shares set), as a hierarchy.
pub(crate) fn best_round(
    p: &Problem,
    mut islands: Vec<Island>,
    o: &OuterOptions,
) -> Option<Hierarchy> {
    let inner_rate: f64 = islands.iter().map(|i| i.rate).sum();
    if islands.is_empty() || inner_rate <= 0.0 {
        return None;
    }
    for isl in &mut islands {
        isl.share = isl.rate / inner_rate;
    }
    let batch: f64 = islands
        .iter()
        .map(|i| (p.micro_batches * i.plan.replicas()) as f64)
        .sum();
    let inner_step_s = batch / inner_rate;
    let mut best: Option<Hierarchy> = None;
    let fragments = if islands.len() < 2 {
        1
    } else {
        o.fragments.max(1)
    };
    let everies: Vec<u64> = if islands.len() < 2 {
        vec![1]
    } else {
        let f = u64::from(fragments);
        o.every
            .iter()
            .copied()
            .filter(|e| e.is_multiple_of(f))
            .collect()
    };
    for codec in &o.codecs {
        let exchanges = fragment_seconds(p, &islands, codec.ratio, fragments);
        let sync_s: f64 = exchanges.iter().sum();
        for &every in &everies {
            let round_s = round_seconds(inner_step_s, every, &exchanges, o.overlap);
            let penalty = o.penalty.factor(every, islands.len(), codec.penalty);
            let effective = batch * every as f64 / round_s / penalty;
            if best.as_ref().is_none_or(|b| effective > b.effective_rate) {
                best = Some(Hierarchy {
                    clusters: Vec::new(),
                    islands: islands.clone(),
                    idle: Vec::new(),
                    every,
                    codec: codec.clone(),
                    sync_s,
                    fragments,
                    fragment_sync_s: exchanges.clone(),
                    inner_step_s,
                    round_s,
                    inner_rate,
                    penalty,
                    effective_rate: effective,
                });
            }
        }
        if islands.len() < 2 {
            break;
        }
    }
    best
}

/// `h` with each island planned anew by OP-Fence on its own devices where that is faster (an
/// island split off a replicated one kept its parent's stages, which suit it less).
fn replan(
    p: &Problem,
    h: Hierarchy,
    o: &OuterOptions,
    memo: &mut Memo,
) -> Result<Hierarchy, PlanError> {
    let mut islands = h.islands.clone();
    for isl in &mut islands {
        let devices: Vec<usize> = isl.plan.devices.iter().flatten().copied().collect();
        if let Some(fresh) = plan_on(p, &devices, isl.clusters.clone(), &o.fence, memo)? {
            if fresh.rate > isl.rate {
                *isl = fresh;
            }
        }
    }
    Ok(match best_round(p, islands, o) {
        Some(c) if c.effective_rate > h.effective_rate => c,
        _ => h,
    })
}

/// Of `islands`, the subsets worth training: the fastest islands first, every prefix (a slow
/// island adds throughput but may stretch the exchange and adds to the penalty), keeping the
/// clusters' order for the ring; one hierarchy per prefix length.
fn subsets(p: &Problem, islands: Vec<Island>, o: &OuterOptions) -> Vec<Hierarchy> {
    let mut by_rate: Vec<usize> = (0..islands.len()).collect();
    by_rate.sort_by(|&a, &b| islands[b].rate.total_cmp(&islands[a].rate));
    let sizes: Vec<usize> = match o.islands {
        Some(n) if n <= islands.len() => vec![n],
        Some(_) => return Vec::new(),
        None => (1..=islands.len().min(o.max_islands.max(1))).collect(),
    };
    sizes
        .into_iter()
        .filter_map(|n| {
            let mut chosen: Vec<usize> = by_rate[..n].to_vec();
            chosen.sort_unstable();
            best_round(p, chosen.iter().map(|&i| islands[i].clone()).collect(), o)
        })
        .collect()
}

/// The hierarchies worth splitting further: the best of each island count, and the best few.
fn shortlist(all: Vec<Hierarchy>) -> Vec<Hierarchy> {
    let mut all = all;
    all.sort_by(|a, b| b.effective_rate.total_cmp(&a.effective_rate));
    let mut out: Vec<Hierarchy> = Vec::new();
    for h in all {
        let fewer = out.len() < SPLIT_CANDIDATES;
        if fewer || !out.iter().any(|b| b.islands.len() == h.islands.len()) {
            out.push(h);
        }
    }
    out
}

/// Plans `p` as islands (see the module documentation). One island over every cluster is
/// OP-Fence on every device, so the flat plan is among the candidates (in cluster order).
pub fn plan_hierarchy(p: &Problem, o: &OuterOptions) -> Result<Hierarchy, PlanError> {
    o.validate(p)?;
    let mut clustering = cluster_by_bandwidth(p.network);
    order_clusters(p.network, &mut clustering);
    let k = clustering.clusters.len();
    let flat = opfence(p, &o.fence)?;
    let flat_clusters: Vec<usize> = (0..k)
        .filter(|&c| {
            clustering.clusters[c]
                .iter()
                .any(|d| flat.plan.devices.iter().flatten().any(|x| x == d))
        })
        .collect();
    let mut memo = Memo::default();
    let mut found: Vec<Hierarchy> = Vec::new();
    let (candidates, fence) = if o.pipelines {
        (groupings(k, &flat_clusters), o.fence.clone())
    } else {
        let one_stage = OpFenceOptions {
            stages: Some(1),
            ..o.fence.clone()
        };
        (vec![(0..k).map(|c| vec![c]).collect()], one_stage)
    };
    for grouping in candidates {
        let mut islands = Vec::new();
        for run in grouping {
            islands.extend(plan_island(p, &clustering, run, &fence, &mut memo)?);
        }
        found.extend(subsets(p, islands, o));
    }
    // Replicated islands split where that pays (unless the number of islands is fixed, or
    // islands do not run pipelines: the DiLoCo baseline).
    let split = o.pipelines && o.islands.is_none();
    let mut best: Option<Hierarchy> = None;
    for h in shortlist(found) {
        let h = if split { split_replicas(p, h, o)? } else { h };
        if best
            .as_ref()
            .is_none_or(|b| h.effective_rate > b.effective_rate)
        {
            best = Some(h);
        }
    }
    if split {
        if let Some(b) = best.take() {
            best = Some(replan(p, b, o, &mut memo)?);
        }
    }
    let mut h = best.ok_or_else(|| {
        PlanError::Infeasible(match o.islands {
            Some(n) => format!("no {n} islands of this testbed's clusters fit the model"),
            None => "no island of this testbed's clusters fits the model".into(),
        })
    })?;
    h.clusters = clustering.clusters;
    h.set_idle(p.devices());
    Ok(h)
}

/// The simulator's view of a hierarchy: each island's plan replayed step by step at its share.
#[derive(Clone, Debug, Serialize)]
pub struct SimulatedHierarchy {
    /// Simulated seconds of each island's step at its share of the inner step's micro-batches.
    pub island_step_s: Vec<f64>,
    pub inner_step_s: f64,
    pub round_s: f64,
    pub effective_rate: f64,
}

/// Simulates every island's plan and composes the round as the cost model does: the slowest
/// island at its share, `every` times, against the exchange.
pub fn simulate_hierarchy(
    p: &Problem,
    h: &Hierarchy,
    overlap: bool,
) -> Result<SimulatedHierarchy, PlanError> {
    let batch: f64 = h
        .islands
        .iter()
        .map(|i| (p.micro_batches * i.plan.replicas()) as f64)
        .sum();
    let island_step_s = h
        .islands
        .iter()
        .map(|i| {
            let sim = p.simulate(&i.plan, 1.0)?;
            let own = (p.micro_batches * i.plan.replicas()) as f64;
            Ok(sim.step_s * i.share * batch / own)
        })
        .collect::<Result<Vec<f64>, PlanError>>()?;
    let inner_step_s = island_step_s.iter().copied().fold(0.0, f64::max);
    let round_s = round_seconds(inner_step_s, h.every, &h.fragment_sync_s, overlap);
    Ok(SimulatedHierarchy {
        island_step_s,
        inner_step_s,
        round_s,
        effective_rate: batch * h.every as f64 / round_s / h.penalty,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groupings_cover_every_cut_or_sync_choice() {
        let g = groupings(3, &[0, 1, 2]);
        assert_eq!(g.len(), 4);
        assert!(g.contains(&vec![vec![0, 1, 2]]));
        assert!(g.contains(&vec![vec![0], vec![1], vec![2]]));
        assert!(g.contains(&vec![vec![0, 1], vec![2]]));
        assert!(g.contains(&vec![vec![0], vec![1, 2]]));
        let big = groupings(12, &[0, 1]);
        assert_eq!(big.len(), 2);
        assert_eq!(big[1][0], vec![0, 1]);
        assert_eq!(big[1].len(), 11);
    }

    #[test]
    fn the_penalty_grows_with_every_and_islands_and_vanishes_for_one() {
        let p = ConvergencePenalty {
            per_log_every: 0.02,
            per_island: 0.05,
        };
        assert_eq!(p.factor(500, 1, 1.0), 1.0);
        assert!(p.factor(10, 2, 1.0) < p.factor(100, 2, 1.0));
        assert!(p.factor(100, 2, 1.0) < p.factor(100, 4, 1.0));
        assert!(p.factor(100, 4, 1.0) < p.factor(100, 4, 2.0));
        assert!(p.factor(1, 2, 1.0) >= 1.0);
    }
}
