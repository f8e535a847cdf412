//! OP-Fence: cluster devices by bandwidth, order the clusters, then place fences by dynamic
//! programming over (operator position, device group) along that order, where a stage costs
//! its compute on its group and a fence costs every tensor crossing it over the link between
//! consecutive groups. A group is one device per data-parallel replica; every replica count
//! that keeps the search small is tried. A local search then polishes the best plan against
//! the exact cost model (skip connections routed to every consuming stage, all-reduce, memory).

use crate::cluster::{
    cluster_by_bandwidth, fastest_first, order_clusters, pair_bandwidth, Clustering,
};
use crate::error::PlanError;
use crate::plan::{Evaluation, Plan, Problem};
use crate::refine::{refine, refine_simulated, simulated_objective};

/// Plans the local search starts from (the best of the programs' candidates).
const STARTS: usize = 4;

/// Up to this many devices, the program orders devices one by one instead of by cluster.
const SMALL_DEVICES: usize = 8;

/// Knobs of the search.
#[derive(Clone, Debug)]
pub struct OpFenceOptions {
    /// Use exactly this many stages, each on its own group, every device busy (what a broker
    /// with a fixed set of nodes needs); None lets the planner leave slow devices idle.
    pub stages: Option<usize>,
    /// Use exactly this many data-parallel replicas; None tries several.
    pub replicas: Option<usize>,
    /// Most fence positions the dynamic program considers (the thinnest cuts and evenly spread
    /// ones); more is slower and rarely better.
    pub max_positions: usize,
    /// Most device groups along the order (bounds the replica counts tried on large testbeds).
    pub max_groups: usize,
    /// Exact evaluations the local search may spend.
    pub refine_budget: usize,
    /// Simulations the last local search may spend: the candidates are ranked, and the best
    /// polished, by the simulator rather than the closed form.
    pub simulated_budget: usize,
}

impl Default for OpFenceOptions {
    fn default() -> Self {
        OpFenceOptions {
            stages: None,
            replicas: None,
            max_positions: 160,
            max_groups: 64,
            refine_budget: 20_000,
            simulated_budget: 400,
        }
    }
}

/// The plan and how OP-Fence got there.
#[derive(Clone, Debug)]
pub struct OpFenceResult {
    pub plan: Plan,
    pub evaluation: Evaluation,
    pub clustering: Clustering,
}

/// Fence positions worth considering: all of them for small graphs; otherwise half the budget
/// on the thinnest cuts (block boundaries of a transformer) and half spread evenly by compute.
pub(crate) fn candidate_positions(p: &Problem, max: usize) -> Vec<usize> {
    let n = p.ops();
    if n <= max + 1 {
        return (0..=n).collect();
    }
    let w = p.workload;
    let mut thin: Vec<usize> = (1..n).collect();
    thin.sort_by(|&a, &b| w.cut_bytes[a].total_cmp(&w.cut_bytes[b]).then(a.cmp(&b)));
    let mut chosen: Vec<usize> = thin.into_iter().take(max / 2).collect();
    let total = p.compute(0, 0, n);
    let spread = max - chosen.len();
    let mut next = 1;
    for k in 1..=spread {
        let target = total * k as f64 / (spread + 1) as f64;
        while next < n - 1 && p.compute(0, 0, next) < target {
            next += 1;
        }
        chosen.push(next);
    }
    chosen.push(0);
    chosen.push(n);
    chosen.sort_unstable();
    chosen.dedup();
    chosen
}

/// Splits the device order into groups of `r`, inside clusters where possible (a replica ring
/// inside a cluster is fast); devices that do not fill a group are left out.
fn groups(p: &Problem, clustering: &Clustering, r: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let mut rest = Vec::new();
    for c in &clustering.clusters {
        let seq = fastest_first(p.network, c);
        let full = seq.len() / r * r;
        out.extend(seq[..full].chunks(r).map(<[usize]>::to_vec));
        rest.extend_from_slice(&seq[full..]);
    }
    out.extend(rest.chunks_exact(r).map(<[usize]>::to_vec));
    out
}

#[derive(Clone, Copy)]
struct Cell {
    score: f64,
    bottleneck: f64,
    fill: f64,
    from: (usize, usize),
}

/// The dynamic program for one replica count. Returns the best plan it finds, if any fits.
fn place_fences(
    p: &Problem,
    groups: &[Vec<usize>],
    positions: &[usize],
    stages: Option<usize>,
) -> Option<Plan> {
    let g_count = groups.len();
    let n_pos = positions.len();
    if g_count == 0 || stages.is_some_and(|s| s > g_count || s + 1 > n_pos) {
        return None;
    }
    let m1 = (p.micro_batches - 1) as f64;
    // The slowest member decides a group's compute; the slowest pair its links.
    let rep: Vec<usize> = groups
        .iter()
        .map(|g| {
            *g.iter()
                .max_by(|&&a, &&b| {
                    p.compute(a, 0, p.ops())
                        .total_cmp(&p.compute(b, 0, p.ops()))
                })
                .unwrap_or(&g[0])
        })
        .collect();
    let link = |a: usize, b: usize| -> (f64, f64) {
        let (mut bw, mut lat) = (f64::INFINITY, 0.0f64);
        for (&x, &y) in groups[a].iter().zip(&groups[b]) {
            bw = bw.min(pair_bandwidth(p.network, x, y));
            lat = lat.max(p.network.latency[x][y].max(p.network.latency[y][x]));
        }
        (bw, lat)
    };
    let links: Vec<Vec<(f64, f64)>> = (0..g_count)
        .map(|a| {
            (0..g_count)
                .map(|b| if a < b { link(a, b) } else { (0.0, 0.0) })
                .collect()
        })
        .collect();
    // A stage's time on its group, recomputing its activations when it fits only so.
    let stage_time = |g: usize, a: usize, b: usize, flight: usize| {
        p.stage_fit(&groups[g], a, b, flight)
            .map(|again| p.stage_compute(rep[g], a, b, again))
    };
    let flight = |g: usize| match p.schedule {
        fusion_exec::Schedule::GPipe => p.micro_batches,
        fusion_exec::Schedule::OneFOneB => p.micro_batches.min(g_count - g).max(1),
    };
    let none = Cell {
        score: f64::INFINITY,
        bottleneck: 0.0,
        fill: 0.0,
        from: (usize::MAX, usize::MAX),
    };
    // f[i][g]: operators 0..positions[i] placed, the last stage on group g.
    let mut f = vec![vec![none; g_count]; n_pos];
    for i in 1..n_pos {
        let b = positions[i];
        for g in 0..g_count {
            let fl = flight(g);
            let mut best = none;
            let first_ok = stages.is_none() || g == 0;
            if let Some(t) = first_ok.then(|| stage_time(g, 0, b, fl)).flatten() {
                best = Cell {
                    score: m1 * t + t,
                    bottleneck: t,
                    fill: t,
                    from: (0, usize::MAX),
                };
            }
            for j in 1..i {
                let a = positions[j];
                // Without recomputation as a lower bound: skip hopeless ranges before the
                // memory check.
                if (m1 + 1.0) * p.compute(rep[g], a, b) >= best.score {
                    continue;
                }
                let Some(t) = stage_time(g, a, b, fl) else {
                    continue;
                };
                if m1 * t + t >= best.score {
                    continue;
                }
                let cut = p.workload.cut_bytes[a];
                let lo = if stages.is_some() {
                    g.saturating_sub(1)
                } else {
                    0
                };
                for h in lo..g {
                    let prev = &f[j][h];
                    if !prev.score.is_finite() {
                        continue;
                    }
                    let (bw, lat) = links[h][g];
                    let comm = p.wire_seconds(cut, bw, prev.bottleneck.max(t));
                    let bottleneck = prev.bottleneck.max(t).max(comm);
                    let fill = prev.fill + t + 2.0 * (comm + lat);
                    let score = m1 * bottleneck + fill;
                    if score < best.score {
                        best = Cell {
                            score,
                            bottleneck,
                            fill,
                            from: (j, h),
                        };
                    }
                }
            }
            f[i][g] = best;
        }
    }
    let last = n_pos - 1;
    let end = match stages {
        Some(_) => Some(g_count - 1).filter(|&g| f[last][g].score.is_finite()),
        None => (0..g_count)
            .filter(|&g| f[last][g].score.is_finite())
            .min_by(|&a, &b| f[last][a].score.total_cmp(&f[last][b].score)),
    }?;
    let (mut starts, mut devices) = (Vec::new(), Vec::new());
    let (mut i, mut g) = (last, end);
    loop {
        let c = f[i][g];
        starts.push(positions[c.from.0]);
        devices.push(groups[g].clone());
        if c.from.1 == usize::MAX {
            break;
        }
        (i, g) = c.from;
    }
    starts.reverse();
    devices.reverse();
    if stages.is_some_and(|s| s != starts.len()) {
        return None;
    }
    Some(Plan { starts, devices })
}

/// Replica counts worth trying: 1 to 8, divisors of the device count and powers of two, as
/// long as the groups stay within `max_groups` and there are operators enough to use them.
fn replica_counts(devices: usize, ops: usize, max_groups: usize) -> Vec<usize> {
    let mut out: Vec<usize> = (1..=devices)
        .filter(|&r| r <= 8 || devices.is_multiple_of(r) || r.is_power_of_two())
        .filter(|&r| devices / r <= max_groups.max(1))
        .filter(|&r| devices / r <= ops.max(1) || r == devices)
        .collect();
    if out.is_empty() {
        out.push(devices.div_ceil(max_groups.max(1)).max(1));
    }
    out
}

/// Plans `p` with OP-Fence.
pub fn opfence(p: &Problem, opts: &OpFenceOptions) -> Result<OpFenceResult, PlanError> {
    let mut clustering = cluster_by_bandwidth(p.network);
    order_clusters(p.network, &mut clustering);
    let positions = candidate_positions(p, opts.max_positions.max(2));
    let counts = match (opts.replicas, opts.stages) {
        (Some(r), _) => vec![r],
        (None, Some(s)) => vec![(p.devices() / s).max(1)],
        (None, None) => replica_counts(p.devices(), p.ops(), opts.max_groups),
    };
    let mut found: Vec<(Plan, Evaluation)> = Vec::new();
    for r in counts {
        if r == 0 || r > p.devices() {
            return Err(PlanError::Invalid(format!(
                "{r} replicas on {} devices",
                p.devices()
            )));
        }
        let small = (r == 1 && p.devices() <= SMALL_DEVICES)
            .then(|| place_fences_small(p, &positions, opts.stages, STARTS))
            .flatten();
        let plans = match small {
            Some(plans) => plans,
            None => {
                let mut gs = groups(p, &clustering, r);
                gs.truncate(opts.stages.unwrap_or(opts.max_groups.max(1)));
                place_fences(p, &gs, &positions, opts.stages)
                    .into_iter()
                    .collect()
            }
        };
        for plan in plans {
            let e = p.evaluate(&plan)?;
            found.push((plan, e));
        }
    }
    found.sort_by(|a, b| a.1.objective.total_cmp(&b.1.objective));
    // The closed form's best plan of every replica count also goes before the simulator, which
    // may rank the counts differently (an all-reduce against a pipeline's bubbles).
    let mut shortlist: Vec<Plan> = Vec::new();
    for (plan, e) in &found[STARTS.min(found.len())..] {
        if e.fits() && !shortlist.iter().any(|q| q.replicas() == plan.replicas()) {
            shortlist.push(plan.clone());
        }
    }
    found.truncate(STARTS);
    if found.is_empty() {
        return Err(PlanError::Infeasible(format!(
            "no split of {} operators over {} devices fits in memory{}",
            p.ops(),
            p.devices(),
            opts.stages
                .map_or(String::new(), |s| format!(" with {s} stages"))
        )));
    }
    let fixed = opts.stages.is_some();
    for (plan, _) in found {
        shortlist.push(refine(p, plan, opts.refine_budget / STARTS, fixed)?.0);
    }
    let (plan, evaluation) = by_simulator(p, shortlist, opts.simulated_budget, fixed)?;
    Ok(OpFenceResult {
        plan,
        evaluation,
        clustering,
    })
}

/// The candidate the simulator finds fastest, polished by a local search against the
/// simulator: the closed form bounds a pipeline's step from below and misses how unequal
/// stages and slow links interleave (6-20% on wide-area pipelines), so it shortlists and the
/// simulator decides. Candidates that do not fit score infinity either way (the first of them
/// is kept when none fits, and the caller's memory check reports it).
fn by_simulator(
    p: &Problem,
    candidates: Vec<Plan>,
    budget: usize,
    fixed: bool,
) -> Result<(Plan, Evaluation), PlanError> {
    let mut best: Option<(Plan, f64, f64)> = None;
    for plan in candidates {
        let sim = simulated_objective(p, &plan)?;
        let model = p.evaluate(&plan)?.objective;
        if best
            .as_ref()
            .is_none_or(|(_, s, m)| (sim, model) < (*s, *m))
        {
            best = Some((plan, sim, model));
        }
    }
    let Some((plan, sim, _)) = best else {
        return Err(PlanError::Infeasible("no plan survived refinement".into()));
    };
    let plan = if sim.is_finite() && budget > 0 {
        refine_simulated(p, plan, budget, fixed)?.0
    } else {
        plan
    };
    let e = p.evaluate(&plan)?;
    Ok((plan, e))
}

/// One partial plan of the small-instance program: its bottleneck and fill so far, and the
/// state and frontier entry it extends.
#[derive(Clone, Copy)]
struct Partial {
    bottleneck: f64,
    fill: f64,
    from: Option<(usize, usize)>,
}

/// Keeps the plans no other beats on both bottleneck and fill, at most `cap` of them (those
/// with the best step estimate).
fn prune(front: &mut Vec<Partial>, m1: f64, cap: usize) {
    front.sort_by(|a, b| {
        a.bottleneck
            .total_cmp(&b.bottleneck)
            .then(a.fill.total_cmp(&b.fill))
    });
    let mut kept: Vec<Partial> = Vec::with_capacity(front.len());
    for c in front.drain(..) {
        if kept.last().is_none_or(|k| c.fill < k.fill) {
            kept.push(c);
        }
    }
    if kept.len() > cap {
        kept.sort_by(|a, b| (m1 * a.bottleneck + a.fill).total_cmp(&(m1 * b.bottleneck + b.fill)));
        kept.truncate(cap);
    }
    *front = kept;
}

/// Frontier entries kept per state of the small-instance program.
const FRONTIER: usize = 6;

/// With few devices OP-Fence orders individual devices rather than clusters: the program runs
/// over (operator position, last device, set of devices used) and keeps, per state, the plans
/// not dominated in (bottleneck, fill). `stages` demands exactly that many stages.
/// Returns the `candidates` best plans by the program's own estimate (the local search then
/// polishes each against the exact model).
pub(crate) fn place_fences_small(
    p: &Problem,
    positions: &[usize],
    stages: Option<usize>,
    candidates: usize,
) -> Option<Vec<Plan>> {
    let d_count = p.devices();
    if d_count > 12 {
        return None;
    }
    let masks = 1usize << d_count;
    let n_pos = positions.len();
    let m1 = (p.micro_batches - 1) as f64;
    let index = |i: usize, d: usize, mask: usize| (i * d_count + d) * masks + mask;
    let mut states: Vec<Vec<Partial>> = vec![Vec::new(); n_pos * d_count * masks];
    let flight = |used: usize| match p.schedule {
        fusion_exec::Schedule::GPipe => p.micro_batches,
        fusion_exec::Schedule::OneFOneB => p
            .micro_batches
            .min(stages.unwrap_or(d_count) - used.min(d_count - 1)),
    };
    for i in 1..n_pos {
        let b = positions[i];
        for d in 0..d_count {
            let bit = 1 << d;
            // The first stage.
            if let Some(again) = p.stage_fit(&[d], 0, b, flight(0)) {
                let t = p.stage_compute(d, 0, b, again);
                states[index(i, d, bit)].push(Partial {
                    bottleneck: t,
                    fill: t,
                    from: None,
                });
            }
            for (j, &a) in positions.iter().enumerate().take(i).skip(1) {
                let cut = p.workload.cut_bytes[a];
                for mask in 0..masks {
                    if mask & bit != 0 || mask == 0 {
                        continue;
                    }
                    let used = mask.count_ones() as usize;
                    if stages.is_some_and(|s| used >= s) {
                        continue;
                    }
                    let has_states = (0..d_count)
                        .any(|h| mask & (1 << h) != 0 && !states[index(j, h, mask)].is_empty());
                    if !has_states {
                        continue;
                    }
                    let Some(again) = p.stage_fit(&[d], a, b, flight(used)) else {
                        continue;
                    };
                    let t = p.stage_compute(d, a, b, again);
                    let mut fresh = Vec::new();
                    for h in 0..d_count {
                        if mask & (1 << h) == 0 {
                            continue;
                        }
                        let from = index(j, h, mask);
                        if states[from].is_empty() {
                            continue;
                        }
                        let bw = pair_bandwidth(p.network, h, d);
                        let lat = p.network.latency[h][d].max(p.network.latency[d][h]);
                        for (k, prev) in states[from].iter().enumerate() {
                            let comm = p.wire_seconds(cut, bw, prev.bottleneck.max(t));
                            fresh.push(Partial {
                                bottleneck: prev.bottleneck.max(t).max(comm),
                                fill: prev.fill + t + 2.0 * (comm + lat),
                                from: Some((from, k)),
                            });
                        }
                    }
                    if fresh.is_empty() {
                        continue;
                    }
                    let slot = &mut states[index(i, d, mask | bit)];
                    slot.extend(fresh);
                    prune(slot, m1, FRONTIER);
                }
            }
        }
    }
    let last = n_pos - 1;
    let mut ends: Vec<(f64, usize, usize)> = Vec::new();
    for d in 0..d_count {
        for mask in 1..masks {
            if stages.is_some_and(|s| mask.count_ones() as usize != s) {
                continue;
            }
            for (k, c) in states[index(last, d, mask)].iter().enumerate() {
                ends.push((m1 * c.bottleneck + c.fill, index(last, d, mask), k));
            }
        }
    }
    ends.sort_by(|a, b| a.0.total_cmp(&b.0));
    ends.truncate(candidates);
    let plans = ends
        .into_iter()
        .map(|(_, state, k)| trace(&states, state, k, positions, d_count, masks))
        .collect();
    Some(plans)
}

/// Follows back-pointers from a final state to the plan.
fn trace(
    states: &[Vec<Partial>],
    mut state: usize,
    mut k: usize,
    positions: &[usize],
    d_count: usize,
    masks: usize,
) -> Plan {
    let (mut starts, mut devices) = (Vec::new(), Vec::new());
    loop {
        let d = (state / masks) % d_count;
        let c = states[state][k];
        devices.push(vec![d]);
        match c.from {
            Some((s, kk)) => {
                starts.push(positions[s / (d_count * masks)]);
                (state, k) = (s, kk);
            }
            None => {
                starts.push(0);
                break;
            }
        }
    }
    starts.reverse();
    devices.reverse();
    Plan { starts, devices }
}
