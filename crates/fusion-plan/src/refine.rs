//! Local search against the exact cost model (or the simulator): shift fences, swap the devices
//! of two stages, move a stage to an idle device, merge two stages, or split one onto an idle
//! device; keep any change that lowers the objective, until none does or the budget is spent.

use crate::error::PlanError;
use crate::plan::{Evaluation, Plan, Problem};

/// How far (in operators) a fence moves in one try.
const SHIFT: usize = 8;

fn neighbours(p: &Problem, plan: &Plan, fixed: bool) -> Vec<Plan> {
    let n = p.ops();
    let s_count = plan.stages();
    let mut out = Vec::new();
    for s in 1..s_count {
        let lo = plan.starts[s - 1] + 1;
        let hi = plan.starts.get(s + 1).copied().unwrap_or(n) - 1;
        let cur = plan.starts[s];
        for d in 1..=SHIFT {
            for next in [cur.checked_sub(d), Some(cur + d)].into_iter().flatten() {
                if (lo..=hi).contains(&next) {
                    let mut q = plan.clone();
                    q.starts[s] = next;
                    out.push(q);
                }
            }
        }
    }
    for a in 0..s_count {
        for b in a + 1..s_count {
            let mut q = plan.clone();
            q.devices.swap(a, b);
            out.push(q);
        }
    }
    // Merging two stages frees a device per replica, whatever the replica count.
    if !fixed {
        for s in 1..s_count {
            let mut q = plan.clone();
            q.starts.remove(s);
            q.devices.remove(s);
            out.push(q);
        }
    }
    if plan.replicas() == 1 {
        let mut used = vec![false; p.devices()];
        plan.devices.iter().flatten().for_each(|&d| used[d] = true);
        let idle: Vec<usize> = (0..p.devices()).filter(|&d| !used[d]).collect();
        for s in 0..s_count {
            for &u in &idle {
                let mut q = plan.clone();
                q.devices[s][0] = u;
                out.push(q);
            }
        }
        if !fixed {
            if let Some(&u) = idle
                .iter()
                .max_by(|&&a, &&b| p.compute(b, 0, n).total_cmp(&p.compute(a, 0, n)))
            {
                for s in 0..s_count {
                    let r = plan.range(s, n);
                    if r.len() < 2 {
                        continue;
                    }
                    let d = plan.devices[s][0];
                    let half = p.compute(d, r.start, r.end) / 2.0;
                    let mut mid = r.start + 1;
                    while mid < r.end - 1 && p.compute(d, r.start, mid) < half {
                        mid += 1;
                    }
                    for (first, second) in [(d, u), (u, d)] {
                        let mut q = plan.clone();
                        q.devices[s] = vec![first];
                        q.starts.insert(s + 1, mid);
                        q.devices.insert(s + 1, vec![second]);
                        out.push(q);
                    }
                }
            }
        }
    }
    out
}

/// Improves `plan` by local search against `score` (lower is better); `fixed` keeps the number
/// of stages and devices used. Returns the plan and its score.
fn descend(
    p: &Problem,
    mut plan: Plan,
    budget: usize,
    fixed: bool,
    score: impl Fn(&Plan) -> Result<f64, PlanError>,
) -> Result<(Plan, f64), PlanError> {
    let mut best = score(&plan)?;
    let mut spent = 0;
    'search: while spent < budget {
        for q in neighbours(p, &plan, fixed) {
            if spent >= budget {
                break 'search;
            }
            spent += 1;
            let s = score(&q)?;
            if s < best * (1.0 - 1e-12) {
                (plan, best) = (q, s);
                continue 'search;
            }
        }
        break;
    }
    Ok((plan, best))
}

/// Improves `plan` by local search against the cost model.
pub(crate) fn refine(
    p: &Problem,
    plan: Plan,
    budget: usize,
    fixed: bool,
) -> Result<(Plan, Evaluation), PlanError> {
    let (plan, _) = descend(p, plan, budget, fixed, |q| Ok(p.evaluate(q)?.objective))?;
    let e = p.evaluate(&plan)?;
    Ok((plan, e))
}

/// Seconds per step and replica of `plan` in the simulator (infinite when it does not fit).
pub(crate) fn simulated_objective(p: &Problem, plan: &Plan) -> Result<f64, PlanError> {
    if !p.evaluate(plan)?.fits() {
        return Ok(f64::INFINITY);
    }
    Ok(p.simulate(plan, 1.0)?.step_s / plan.replicas() as f64)
}

/// Improves `plan` by local search against the simulator (which replays how unequal stages
/// and links interleave, where the closed form only bounds it), spending at most `budget`
/// simulations. Returns the plan and its simulated seconds per step and replica.
pub(crate) fn refine_simulated(
    p: &Problem,
    plan: Plan,
    budget: usize,
    fixed: bool,
) -> Result<(Plan, f64), PlanError> {
    descend(p, plan, budget, fixed, |q| simulated_objective(p, q))
}
