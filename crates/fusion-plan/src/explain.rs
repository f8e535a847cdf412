//! A plan in words: what each stage holds and how busy it is, why each fence is where it is
//! (the bytes that cross it, the link they take, and how that compares with the cuts nearby),
//! and which resource bounds the step.

use crate::plan::{Evaluation, Plan, Problem, Resource};

/// How far around a fence the explanation looks for thinner cuts.
const NEARBY: usize = 8;

fn mb(bytes: f64) -> String {
    format!("{:.2} MB", bytes / 1e6)
}

fn ms(s: f64) -> String {
    format!("{:.1} ms", s * 1e3)
}

/// Why stage `s` recomputes: its memory with and without, and the forward it runs again.
fn recompute_line(p: &Problem, plan: &Plan, s: usize) -> String {
    let r = plan.range(s, p.ops());
    let flight = p.in_flight(s, plan.stages());
    let d = plan.devices[s][0];
    let replicas = plan.devices[s].len();
    format!(
        "stage {s} recomputes its activations in backward: storing them for {flight} micro-batch(es) needs {:.0}% of {}'s memory, recomputing {:.0}%, for {} more compute per micro-batch",
        100.0 * p.memory_use(d, (r.start, r.end), flight, replicas),
        p.network.devices[d].name,
        100.0 * p.memory_use_recomputed(d, (r.start, r.end), flight, replicas),
        ms(p.stage_compute(d, r.start, r.end, true) - p.compute(d, r.start, r.end)),
    )
}

/// One line per stage, fence and verdict.
pub fn explain(p: &Problem, plan: &Plan, e: &Evaluation) -> Vec<String> {
    let n = p.ops();
    let w = p.workload;
    let name = |d: usize| p.network.devices[d].name.as_str();
    let names = |ds: &[usize]| ds.iter().map(|&d| name(d)).collect::<Vec<_>>().join(", ");
    let mut out = Vec::new();
    for s in 0..plan.stages() {
        let r = plan.range(s, n);
        out.push(format!(
            "stage {s}: operators {}..{} ('{}' to '{}') on {}; {} per micro-batch ({:.0}% of the bottleneck)",
            r.start,
            r.end - 1,
            w.ops[r.start].name,
            w.ops[r.end - 1].name,
            names(&plan.devices[s]),
            ms(e.stage_s[s]),
            100.0 * e.stage_s[s] / e.bottleneck_s.max(1e-12)
        ));
        if e.recompute.get(s).copied().unwrap_or(false) {
            out.push(recompute_line(p, plan, s));
        }
        let replicas = plan.devices[s].len();
        if p.shard_optimizer && replicas > 1 {
            let whole = p.state_bytes(r.start, r.end, 1);
            out.push(format!(
                "stage {s} shards its optimizer state over its {replicas} replicas: {} of weights, gradients and moments on each instead of {}",
                mb(p.state_bytes(r.start, r.end, replicas)),
                mb(whole),
            ));
        }
    }
    for s in 1..plan.stages() {
        let at = plan.starts[s];
        let bytes = w.cut_bytes[at];
        let (lo, hi) = (at.saturating_sub(NEARBY).max(1), (at + NEARBY).min(n - 1));
        let thinnest = (lo..=hi)
            .map(|q| w.cut_bytes[q])
            .fold(f64::INFINITY, f64::min);
        let (a, b) = (plan.devices[s - 1][0], plan.devices[s][0]);
        let why = if bytes <= thinnest * 1.0001 {
            format!("the thinnest cut within {NEARBY} operators")
        } else {
            format!(
                "{} wider than the thinnest nearby ({}), which would unbalance compute",
                mb(bytes - thinnest),
                mb(thinnest)
            )
        };
        out.push(format!(
            "fence {s} before '{}' (operator {at}): {} per micro-batch cross it, {} -> {} at {:.0} Mbit/s takes {}; {why}",
            w.ops[at].name,
            mb(bytes),
            name(a),
            name(b),
            p.network.bandwidth[a][b] * 8.0 / 1e6,
            ms(p.transfer(a, b, bytes)),
        ));
    }
    let verdict = match &e.bottleneck {
        Resource::Stage(s) => format!(
            "bottleneck: compute of stage {s} on {} ({} per micro-batch)",
            names(&plan.devices[*s]),
            ms(e.stage_s[*s])
        ),
        Resource::Link { from, to } => format!(
            "bottleneck: the link from stage {from} to stage {to} ({} -> {}, {} per micro-batch)",
            name(plan.devices[*from][0]),
            name(plan.devices[*to][0]),
            ms(e.bottleneck_s)
        ),
        Resource::AllReduce(s) => format!(
            "bottleneck: the gradient all-reduce of stage {s} ({} per step)",
            ms(e.allreduce_s)
        ),
    };
    out.push(verdict);
    out.push(format!(
        "predicted step: {} = ({} - 1) x {} + fill {} + all-reduce {} + shared-gradient exchange {} + update {}; {} replica(s), peak memory {:.0}% of a device",
        ms(e.step_s),
        p.micro_batches,
        ms(e.bottleneck_s),
        ms(e.fill_s),
        ms(e.allreduce_s),
        ms(e.exchange_s),
        ms(e.update_s),
        plan.replicas(),
        100.0 * e.memory_use
    ));
    out
}
