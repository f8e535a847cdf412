//! `fusionllm plan --islands`: the hierarchical plan (islands, their own OP-Fence plans, the
//! outer synchronisation between them), simulated, explained and compared with the flat plan.

use anyhow::{bail, Result};
use fusion_plan::{
    plan_hierarchy, simulate_hierarchy, Hierarchy, OuterOptions, Plan, Problem, SimulatedHierarchy,
};
use fusion_testbed::Testbed;
use serde::Serialize;

/// What the command line asks of the hierarchical planner.
pub struct IslandsArgs {
    pub islands: Option<usize>,
    pub every: Option<u64>,
    pub codec: Option<String>,
    pub overlap: bool,
    pub fragments: u32,
}

/// The flat plan the hierarchy is compared with.
pub struct Flat<'a> {
    pub plan: &'a Plan,
    pub model_step_s: f64,
    pub simulated_step_s: f64,
}

#[derive(Serialize)]
pub struct IslandsReport {
    pub hierarchy: Hierarchy,
    pub simulated: SimulatedHierarchy,
    /// Micro-batches per second of the flat plan (cost model, simulator).
    pub flat_rate: f64,
    pub flat_simulated_rate: f64,
    /// The hierarchy's rate at equal convergence over the flat plan's (simulated).
    pub speedup: f64,
    pub planning_s: f64,
}

fn options(a: &IslandsArgs) -> Result<OuterOptions> {
    let mut o = OuterOptions {
        islands: a.islands,
        overlap: a.overlap,
        fragments: a.fragments,
        ..OuterOptions::default()
    };
    if a.fragments == 0 {
        bail!("--outer-fragments must be at least 1");
    }
    if let Some(h) = a.every {
        if h == 0 {
            bail!("--outer-every must be at least 1");
        }
        o.every = vec![h];
    }
    if let Some(c) = &a.codec {
        // `train`'s name for dense f32 pseudo-gradients is `none`.
        let name = if c == "none" { "dense" } else { c.as_str() };
        o.codecs.retain(|k| k.name == name);
        if o.codecs.is_empty() {
            bail!(
                "--outer-codec: the planner models dense (train's none) and int8 \
                 pseudo-gradients, not '{c}'"
            );
        }
    }
    Ok(o)
}

pub fn plan(p: &Problem, a: &IslandsArgs, flat: Flat) -> Result<IslandsReport> {
    let o = options(a)?;
    let t0 = std::time::Instant::now();
    let hierarchy = plan_hierarchy(p, &o)?;
    let planning_s = t0.elapsed().as_secs_f64();
    let simulated = simulate_hierarchy(p, &hierarchy, o.overlap)?;
    let per_step = (p.micro_batches * flat.plan.replicas()) as f64;
    let flat_simulated_rate = per_step / flat.simulated_step_s;
    Ok(IslandsReport {
        speedup: simulated.effective_rate / flat_simulated_rate,
        flat_rate: per_step / flat.model_step_s,
        flat_simulated_rate,
        hierarchy,
        simulated,
        planning_s,
    })
}

fn names(tb: &Testbed, devices: &[usize]) -> String {
    let named: Vec<&str> = devices
        .iter()
        .map(|&d| tb.devices[d].name.as_str())
        .collect();
    match named.len() {
        0..=4 => named.join(", "),
        n => format!(
            "{}, … {} ({n} devices)",
            named[..2].join(", "),
            named[n - 1]
        ),
    }
}

/// Which island holds cluster `c`, if any.
fn island_of(h: &Hierarchy, c: usize) -> Option<usize> {
    h.islands.iter().position(|i| i.clusters.contains(&c))
}

/// One line per link between consecutive clusters: cut across it, synchronise across it, or
/// leave the far side idle.
fn link_decisions(h: &Hierarchy, tb: &Testbed) -> Vec<String> {
    let name = |c: usize| tb.devices[h.clusters[c][0]].site.clone();
    (1..h.clusters.len())
        .map(|c| {
            let what = match (island_of(h, c - 1), island_of(h, c)) {
                (Some(a), Some(b)) if a == b => format!("pipeline cut inside island {a}"),
                (Some(a), Some(b)) => format!("outer synchronisation (islands {a} and {b})"),
                _ => "unused: a cluster on it is idle".into(),
            };
            format!("link {} - {}: {what}", name(c - 1), name(c))
        })
        .collect()
}

pub fn print(r: &IslandsReport, tb: &Testbed) {
    let h = &r.hierarchy;
    println!(
        "\nislands: {} island(s), synchronised every {} steps with {} pseudo-gradients, planned in {:.2} s",
        h.islands.len(),
        h.every,
        h.codec.name,
        r.planning_s
    );
    for (i, isl) in h.islands.iter().enumerate() {
        let devices: Vec<usize> = isl.plan.devices.iter().flatten().copied().collect();
        println!(
            "  island {i}: {} stage(s) x {} replica(s) on {}; {:.1} micro-batches/s, {:.0}% of each step's batch",
            isl.plan.stages(),
            isl.plan.replicas(),
            names(tb, &devices),
            isl.rate,
            100.0 * isl.share
        );
    }
    if !h.idle.is_empty() {
        println!("  idle: {}", names(tb, &h.idle));
    }
    for line in link_decisions(h, tb) {
        println!("  {line}");
    }
    if h.islands.len() > 1 {
        let compute = h.every as f64 * h.inner_step_s;
        let how = if (h.round_s - compute - h.sync_s).abs() <= 1e-9 * h.round_s {
            format!(
                "the islands wait for it: {:.0}% of the round",
                100.0 * h.sync_s / h.round_s
            )
        } else if h.round_s > compute {
            "overlapped, it stretches the round".to_string()
        } else {
            "overlapped behind compute".to_string()
        };
        if h.fragments > 1 {
            let (lo, hi) = h
                .fragment_sync_s
                .iter()
                .fold((f64::INFINITY, 0.0f64), |(l, u), &x| (l.min(x), u.max(x)));
            println!(
                "  streamed in {} fragments, one every {} steps: {:.2}-{:.2} s per fragment's exchange",
                h.fragments,
                h.every / u64::from(h.fragments),
                lo,
                hi
            );
        }
        println!(
            "  exchange: {:.2} s per round against {} inner steps of {:.1} ms ({how}); round {:.2} s",
            h.sync_s,
            h.every,
            h.inner_step_s * 1e3,
            h.round_s
        );
    }
    println!(
        "  convergence penalty x{:.3} in tokens; {:.1} micro-batches/s at equal convergence (simulated {:.1}, inner step {:.1} ms)",
        h.penalty,
        h.effective_rate,
        r.simulated.effective_rate,
        r.simulated.inner_step_s * 1e3
    );
    println!(
        "  against the flat plan ({:.1} micro-batches/s simulated): {:.2}x",
        r.flat_simulated_rate, r.speedup
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(codec: &str) -> IslandsArgs {
        IslandsArgs {
            islands: Some(2),
            every: Some(25),
            codec: Some(codec.into()),
            overlap: false,
            fragments: 1,
        }
    }

    #[test]
    fn train_s_codec_names_plan_the_same_pseudo_gradients() {
        let dense = options(&args("none")).expect("none is dense");
        let names: Vec<&str> = dense.codecs.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["dense"]);
        let int8 = options(&args("int8")).expect("int8");
        assert_eq!(int8.codecs.len(), 1);
        let e = options(&args("topk:0.1")).expect_err("not modelled");
        assert!(e.to_string().contains("not 'topk:0.1'"), "{e}");
    }
}
