//! Simulated annealing over plans, scored by the simulator: a long randomised search that knows
//! nothing of OP-Fence (every chain starts from a random plan), to measure how far the planner's
//! plans are from the best plans such a search finds (`fusionllm bench --planner-anneal`).
//!
//! A flat plan moves by shifting a fence, swapping two devices (or one with an idle device),
//! splitting a stage onto idle devices, merging two stages, adding or removing a replica, or
//! swapping two stages' devices. A hierarchy is a set of islands, each a flat plan on its own
//! devices; it also moves by founding an island on idle devices, dissolving one, or splitting
//! a replica off as an island of its own. Moves are accepted by the Metropolis rule on the log
//! of the score, at a temperature falling geometrically over the budget.

use crate::error::PlanError;
use crate::hierarchy::{best_round, Hierarchy, Island, OuterOptions};
use crate::plan::{Plan, Problem};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

/// How long and how hot the search runs.
#[derive(Clone, Debug)]
pub struct AnnealOptions {
    /// Wall-clock seconds in all (the search also stops after `max_evaluations`).
    pub seconds: f64,
    pub max_evaluations: usize,
    /// Independent chains, each from its own random start, sharing the budget equally.
    pub chains: usize,
    pub seed: u64,
    /// Temperatures on the log of the score: a move 30% worse is taken with probability
    /// `exp(-ln 1.3 / t)`.
    pub t_start: f64,
    pub t_end: f64,
}

impl AnnealOptions {
    /// A budget that ends and temperatures that fall.
    pub fn validate(&self) -> Result<(), PlanError> {
        let t_ok = self.t_start > 0.0 && self.t_end > 0.0 && self.t_end <= self.t_start;
        if !(self.seconds.is_finite() && self.seconds > 0.0 && self.max_evaluations > 0 && t_ok) {
            return Err(PlanError::Invalid(format!(
                "annealing needs a positive, finite time ({} s) and evaluation budget ({}), and \
                 temperatures falling from t_start {} to t_end {} above 0",
                self.seconds, self.max_evaluations, self.t_start, self.t_end
            )));
        }
        Ok(())
    }
}

impl Default for AnnealOptions {
    fn default() -> Self {
        AnnealOptions {
            seconds: 60.0,
            max_evaluations: usize::MAX,
            chains: 4,
            seed: 1,
            t_start: 0.3,
            t_end: 0.002,
        }
    }
}

/// The best flat plan a search found.
#[derive(Clone, Debug)]
pub struct Annealed {
    pub plan: Plan,
    /// Simulated seconds per step, and per step divided by the replicas (lower is better).
    pub step_s: f64,
    pub objective: f64,
    /// Moves tried (each scored, unless it did not apply to the plan at hand).
    pub evaluations: usize,
}

/// A flat plan's score: simulated step over replicas, stretched in proportion to how far it
/// overflows a device's memory (so a chain can walk out of plans that do not fit), and whether
/// it fits.
pub fn score(p: &Problem, plan: &Plan) -> Result<(f64, bool), PlanError> {
    let e = p.evaluate(plan)?;
    let sim = p.simulate(plan, 1.0)?;
    let objective = sim.step_s / plan.replicas() as f64;
    if e.fits() {
        Ok((objective, true))
    } else {
        Ok((objective * (1.0 + 10.0 * (e.memory_use - 1.0)), false))
    }
}

/// Devices `plan` leaves idle among `pool`.
fn idle_of(plan: &Plan, pool: &[usize]) -> Vec<usize> {
    pool.iter()
        .copied()
        .filter(|d| !plan.devices.iter().flatten().any(|x| x == d))
        .collect()
}

/// A random plan on `pool` (at least one device).
fn random_plan(rng: &mut ChaCha8Rng, n: usize, pool: &[usize]) -> Plan {
    let mut devs = pool.to_vec();
    devs.shuffle(rng);
    let r = rng.random_range(1..=devs.len());
    let s = rng.random_range(1..=(devs.len() / r).min(n));
    let mut cuts: Vec<usize> = (1..n).collect();
    cuts.shuffle(rng);
    let mut starts: Vec<usize> = cuts[..s - 1].to_vec();
    starts.push(0);
    starts.sort_unstable();
    let devices = (0..s).map(|k| devs[k * r..(k + 1) * r].to_vec()).collect();
    Plan { starts, devices }
}

/// One random move of `plan` within `pool`, or None when the drawn move does not apply.
fn neighbour(rng: &mut ChaCha8Rng, plan: &Plan, n: usize, pool: &[usize]) -> Option<Plan> {
    let (s_count, r) = (plan.stages(), plan.replicas());
    let mut idle = idle_of(plan, pool);
    idle.shuffle(rng);
    let mut q = plan.clone();
    match rng.random_range(0..7) {
        0 if s_count > 1 => {
            let s = rng.random_range(1..s_count);
            let lo = q.starts[s - 1] + 1;
            let hi = q.starts.get(s + 1).copied().unwrap_or(n) - 1;
            q.starts[s] = if rng.random_bool(0.3) {
                rng.random_range(lo..=hi)
            } else {
                let d = rng.random_range(1..=8usize);
                let next = if rng.random_bool(0.5) {
                    q.starts[s].saturating_sub(d)
                } else {
                    q.starts[s] + d
                };
                next.clamp(lo, hi)
            };
        }
        1 => {
            let slots = s_count * r;
            let a = rng.random_range(0..slots);
            if !idle.is_empty() && (slots < 2 || rng.random_bool(0.5)) {
                q.devices[a / r][a % r] = idle[0];
            } else if slots >= 2 {
                // Another slot than `a`.
                let b = (a + rng.random_range(1..slots)) % slots;
                let x = q.devices[b / r][b % r];
                q.devices[b / r][b % r] = q.devices[a / r][a % r];
                q.devices[a / r][a % r] = x;
            } else {
                return None;
            }
        }
        2 if idle.len() >= r => {
            let s = rng.random_range(0..s_count);
            let range = plan.range(s, n);
            if range.len() < 2 {
                return None;
            }
            let mid = rng.random_range(range.start + 1..range.end);
            q.starts.insert(s + 1, mid);
            // The idle devices take either half.
            let at = if rng.random_bool(0.5) { s } else { s + 1 };
            q.devices.insert(at, idle[..r].to_vec());
        }
        3 if s_count > 1 => {
            let s = rng.random_range(1..s_count);
            q.starts.remove(s);
            q.devices.remove(s);
        }
        4 if idle.len() >= s_count => {
            for (s, row) in q.devices.iter_mut().enumerate() {
                row.push(idle[s]);
            }
        }
        5 if r > 1 => {
            let k = rng.random_range(0..r);
            q.devices.iter_mut().for_each(|row| {
                row.remove(k);
            });
        }
        6 if s_count > 1 => {
            let a = rng.random_range(0..s_count);
            let b = (a + rng.random_range(1..s_count)) % s_count;
            q.devices.swap(a, b);
        }
        _ => return None,
    }
    Some(q)
}

/// Metropolis acceptance of a move from `old` to `new` (scores, lower is better) at `t`.
fn accept(rng: &mut ChaCha8Rng, old: f64, new: f64, t: f64) -> bool {
    new <= old || (new.is_finite() && rng.random::<f64>() < (-(new / old).ln() / t).exp())
}

/// The temperature after `frac` of the budget.
fn temperature(o: &AnnealOptions, frac: f64) -> f64 {
    o.t_start * (o.t_end / o.t_start).powf(frac.clamp(0.0, 1.0))
}

/// Anneals flat plans of `p` on all its devices; the best plan that fits, or Infeasible.
pub fn anneal(p: &Problem, o: &AnnealOptions) -> Result<Annealed, PlanError> {
    o.validate()?;
    let n = p.ops();
    let pool: Vec<usize> = (0..p.devices()).collect();
    let mut best: Option<Annealed> = None;
    let evaluations = run_chains(
        o,
        |rng| {
            let plan = random_plan(rng, n, &pool);
            let s = score(p, &plan)?;
            Ok((plan, s))
        },
        |rng, plan| {
            let Some(q) = neighbour(rng, plan, n, &pool) else {
                return Ok(None);
            };
            let s = score(p, &q)?;
            Ok(Some((q, s)))
        },
        |plan, (v, fits)| {
            if fits && best.as_ref().is_none_or(|b| v < b.objective) {
                best = Some(Annealed {
                    plan: plan.clone(),
                    step_s: v * plan.replicas() as f64,
                    objective: v,
                    evaluations: 0,
                });
            }
        },
    )?;
    let mut b = best.ok_or_else(|| {
        PlanError::Infeasible("the search found no plan that fits in memory".into())
    })?;
    b.evaluations = evaluations;
    Ok(b)
}

/// Runs `o.chains` Metropolis chains, each from `start` and moving by `step` (None: the drawn
/// move does not apply), on scores `(value, _)` where lower values are better; a chain at an
/// infinite score takes any move. `keep` sees every state a chain holds. Every move tried
/// counts against the budget, applied or not, so a chain always ends. Returns the moves tried.
fn run_chains<T: Clone, X: Clone>(
    o: &AnnealOptions,
    mut start: impl FnMut(&mut ChaCha8Rng) -> Result<(T, (f64, X)), PlanError>,
    mut step: impl FnMut(&mut ChaCha8Rng, &T) -> Result<Option<(T, (f64, X))>, PlanError>,
    mut keep: impl FnMut(&T, (f64, X)),
) -> Result<usize, PlanError> {
    let chains = o.chains.max(1);
    let per_chain = o.seconds / chains as f64;
    let per_chain_moves = (o.max_evaluations / chains).max(1);
    let mut moves = 0;
    for c in 0..chains {
        let mut rng = ChaCha8Rng::seed_from_u64(o.seed.wrapping_mul(1000).wrapping_add(c as u64));
        let (mut cur, mut cur_score) = start(&mut rng)?;
        keep(&cur, cur_score.clone());
        let (t0, mut done) = (Instant::now(), 0usize);
        loop {
            let frac =
                (t0.elapsed().as_secs_f64() / per_chain).max(done as f64 / per_chain_moves as f64);
            if frac >= 1.0 {
                break;
            }
            done += 1;
            let Some((q, s)) = step(&mut rng, &cur)? else {
                continue;
            };
            let old = cur_score.0;
            if !old.is_finite() || accept(&mut rng, old, s.0, temperature(o, frac)) {
                (cur, cur_score) = (q, s);
                keep(&cur, cur_score.clone());
            }
        }
        moves += done;
    }
    Ok(moves)
}

/// The best hierarchy a search found, and how many moves it tried.
#[derive(Clone, Debug)]
pub struct AnnealedHierarchy {
    pub hierarchy: Hierarchy,
    pub evaluations: usize,
}

/// An island of `plan` for the round's composition: its simulated rate, or None when it does
/// not fit.
fn island(p: &Problem, plan: &Plan) -> Result<Option<Island>, PlanError> {
    let evaluation = p.evaluate(plan)?;
    if !evaluation.fits() {
        return Ok(None);
    }
    let rate = (p.micro_batches * plan.replicas()) as f64 / p.simulate(plan, 1.0)?.step_s;
    Ok(Some(Island {
        clusters: Vec::new(),
        plan: plan.clone(),
        evaluation,
        rate,
        share: 0.0,
    }))
}

/// A hierarchy's score (seconds per micro-batch at equal convergence; lower is better), the
/// best composition of its islands, or infinity when an island does not fit.
fn hierarchy_score(
    p: &Problem,
    plans: &[Plan],
    o: &OuterOptions,
) -> Result<(f64, Option<Hierarchy>), PlanError> {
    let mut islands = Vec::with_capacity(plans.len());
    for plan in plans {
        match island(p, plan)? {
            Some(i) => islands.push(i),
            None => return Ok((f64::INFINITY, None)),
        }
    }
    Ok(match best_round(p, islands, o) {
        Some(h) => (1.0 / h.effective_rate, Some(h)),
        None => (f64::INFINITY, None),
    })
}

/// One random move of a hierarchy's islands.
fn hierarchy_neighbour(
    rng: &mut ChaCha8Rng,
    plans: &[Plan],
    n: usize,
    devices: usize,
    o: &OuterOptions,
) -> Option<Vec<Plan>> {
    let used: Vec<usize> = plans
        .iter()
        .flat_map(|pl| pl.devices.iter().flatten().copied())
        .collect();
    let idle: Vec<usize> = (0..devices).filter(|d| !used.contains(d)).collect();
    // Room for another island: the asked number, else the most the penalty is trusted for.
    let (room, fewer) = match o.islands {
        Some(k) => (plans.len() < k, plans.len() > k),
        None => (plans.len() < o.max_islands, plans.len() > 1),
    };
    let mut q = plans.to_vec();
    match rng.random_range(0..10) {
        // Found an island on idle devices.
        0 if !idle.is_empty() && room => {
            q.push(random_plan(rng, n, &idle));
        }
        // Dissolve an island.
        1 if fewer => {
            q.remove(rng.random_range(0..plans.len()));
        }
        // A replica leaves its island as an island of its own.
        2 if room => {
            let i = rng.random_range(0..plans.len());
            let r = plans[i].replicas();
            if r < 2 {
                return None;
            }
            let k = rng.random_range(0..r);
            let mut own = plans[i].clone();
            own.devices = plans[i].devices.iter().map(|row| vec![row[k]]).collect();
            q[i].devices.iter_mut().for_each(|row| {
                row.remove(k);
            });
            q.push(own);
        }
        // A flat move inside one island, which may take idle devices.
        _ => {
            let i = rng.random_range(0..plans.len());
            let mut pool: Vec<usize> = plans[i].devices.iter().flatten().copied().collect();
            pool.extend(&idle);
            q[i] = neighbour(rng, &plans[i], n, &pool)?;
        }
    }
    Some(q)
}

/// A random start: one or more islands over a random share of the devices.
fn random_hierarchy(rng: &mut ChaCha8Rng, n: usize, devices: usize, o: &OuterOptions) -> Vec<Plan> {
    let mut devs: Vec<usize> = (0..devices).collect();
    devs.shuffle(rng);
    let k = o
        .islands
        .unwrap_or_else(|| rng.random_range(1..=devices.min(o.max_islands.max(1))))
        .clamp(1, devices);
    (0..k)
        .map(|i| {
            let part: Vec<usize> = devs.iter().copied().skip(i).step_by(k).collect();
            random_plan(rng, n, &part)
        })
        .collect()
}

/// Anneals hierarchies of `p` (islands, each a flat plan) under `o`'s outer options; the best
/// hierarchy found whose islands all fit, or Infeasible.
pub fn anneal_hierarchy(
    p: &Problem,
    outer: &OuterOptions,
    o: &AnnealOptions,
) -> Result<AnnealedHierarchy, PlanError> {
    o.validate()?;
    outer.validate(p)?;
    if outer.islands == Some(0) || outer.max_islands == 0 {
        return Err(PlanError::Invalid(
            "a hierarchy needs at least one island".into(),
        ));
    }
    let (n, devices) = (p.ops(), p.devices());
    let mut best: Option<(f64, Hierarchy)> = None;
    let evaluations = run_chains(
        o,
        |rng| {
            let plans = random_hierarchy(rng, n, devices, outer);
            let s = hierarchy_score(p, &plans, outer)?;
            Ok((plans, s))
        },
        |rng, plans| {
            let Some(q) = hierarchy_neighbour(rng, plans, n, devices, outer) else {
                return Ok(None);
            };
            let s = hierarchy_score(p, &q, outer)?;
            Ok(Some((q, s)))
        },
        |_, (v, h)| {
            if let Some(h) = h {
                if best.as_ref().is_none_or(|(b, _)| v < *b) {
                    best = Some((v, h));
                }
            }
        },
    )?;
    let (_, mut hierarchy) = best.ok_or_else(|| {
        PlanError::Infeasible("the search found no hierarchy whose islands fit".into())
    })?;
    hierarchy.set_idle(devices);
    Ok(AnnealedHierarchy {
        hierarchy,
        evaluations,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random;
    use fusion_exec::Schedule;

    /// Every plan of a tiny instance (replicas, stages, fences, ordered devices), scored as the
    /// search scores them; the best score of a plan that fits.
    fn exhaustive(p: &Problem) -> f64 {
        let (n, d) = (p.ops(), p.devices());
        let mut best = f64::INFINITY;
        let mut stack: Vec<Vec<usize>> = vec![vec![]];
        let mut orders = Vec::new();
        while let Some(cur) = stack.pop() {
            if !cur.is_empty() {
                orders.push(cur.clone());
            }
            for x in (0..d).filter(|x| !cur.contains(x)) {
                stack.push([&cur[..], &[x]].concat());
            }
        }
        for devs in &orders {
            for r in (1..=devs.len()).filter(|r| devs.len() % r == 0) {
                let s = devs.len() / r;
                if s > n {
                    continue;
                }
                for mask in 0u32..1 << (n - 1) {
                    if mask.count_ones() as usize != s - 1 {
                        continue;
                    }
                    let mut starts = vec![0];
                    starts.extend((1..n).filter(|i| mask >> (i - 1) & 1 == 1));
                    let devices = (0..s).map(|k| devs[k * r..(k + 1) * r].to_vec()).collect();
                    let plan = Plan { starts, devices };
                    if let Ok((v, true)) = score(p, &plan) {
                        best = best.min(v);
                    }
                }
            }
        }
        best
    }

    #[test]
    fn the_search_finds_the_best_plan_of_tiny_instances() {
        for seed in 0..6 {
            let inst = random::instance(500 + seed, 3, 6);
            let p = Problem::new(
                &inst.workload,
                &inst.network,
                inst.micro_batches,
                Schedule::OneFOneB,
            )
            .expect("problem");
            let o = AnnealOptions {
                seconds: 1e9,
                max_evaluations: 20_000,
                chains: 4,
                seed,
                ..AnnealOptions::default()
            };
            let found = anneal(&p, &o).expect("anneal");
            p.check(&found.plan).expect("a valid plan");
            let (again, fits) = score(&p, &found.plan).expect("score");
            assert!(fits && again == found.objective);
            let truth = exhaustive(&p);
            assert!(
                (found.objective / truth - 1.0).abs() < 1e-9,
                "seed {seed}: search {} against every plan {truth}",
                found.objective
            );
            assert_eq!(found.evaluations, 20_000);
        }
    }

    #[test]
    fn hierarchies_found_have_disjoint_fitting_islands_of_the_asked_number() {
        let inst = random::instance(7, 6, 12);
        let p = Problem::new(
            &inst.workload,
            &inst.network,
            inst.micro_batches,
            Schedule::OneFOneB,
        )
        .expect("problem");
        let outer = OuterOptions {
            islands: Some(2),
            ..OuterOptions::default()
        };
        let o = AnnealOptions {
            seconds: 1e9,
            max_evaluations: 3_000,
            chains: 2,
            ..AnnealOptions::default()
        };
        let h = anneal_hierarchy(&p, &outer, &o).expect("anneal").hierarchy;
        assert_eq!(h.islands.len(), 2);
        let mut seen = vec![false; p.devices()];
        for isl in &h.islands {
            p.check(&isl.plan).expect("valid island");
            assert!(isl.evaluation.fits());
            for &d in isl.plan.devices.iter().flatten() {
                assert!(!std::mem::replace(&mut seen[d], true), "device {d} twice");
            }
        }
        assert_eq!(
            h.idle,
            (0..p.devices()).filter(|&d| !seen[d]).collect::<Vec<_>>()
        );
        assert!(h.effective_rate > 0.0 && h.effective_rate.is_finite());
    }
}
