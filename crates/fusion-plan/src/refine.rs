//! Local search against the exact cost model: shift fences, swap the devices of two stages,
//! move a stage to an idle device, merge two stages, or split one onto an idle device; keep any
//! change that lowers the objective, until none does or the evaluation budget is spent.

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
            for s in 1..s_count {
                let mut q = plan.clone();
                q.starts.remove(s);
                q.devices.remove(s);
                out.push(q);
            }
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

/// Improves `plan` by local search; `fixed` keeps the number of stages and devices used.
pub(crate) fn refine(
    p: &Problem,
    mut plan: Plan,
    budget: usize,
    fixed: bool,
) -> Result<(Plan, Evaluation), PlanError> {
    let mut best = p.evaluate(&plan)?;
    let mut spent = 0;
    'search: while spent < budget {
        for q in neighbours(p, &plan, fixed) {
            if spent >= budget {
                break 'search;
            }
            spent += 1;
            let e = p.evaluate(&q)?;
            if e.objective < best.objective * (1.0 - 1e-12) {
                (plan, best) = (q, e);
                continue 'search;
            }
        }
        break;
    }
    Ok((plan, best))
}
