//! `fusionllm bench --planner-anneal`: the planner's plans against the best plans a long
//! simulated-annealing search finds on the 48-GPU testbeds, both scored by the simulator. The
//! search starts from random plans (never from OP-Fence's); flat plans are compared with
//! OP-Fence, hierarchies (islands) with the hierarchical planner. Run from the repository root.

use crate::plan_cmd::{network, ModelArgs};
use anyhow::{Context, Result};
use fusion_exec::Schedule;
use fusion_plan::anneal::{anneal, anneal_hierarchy, AnnealOptions};
use fusion_plan::{
    opfence, plan_hierarchy, simulate_hierarchy, OpFenceOptions, OuterOptions, Plan, Problem,
};
use fusion_testbed::Testbed;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

#[derive(Serialize)]
struct Row {
    testbed: String,
    model: String,
    /// What is compared: "flat" (OP-Fence) or "islands" (the hierarchical planner).
    kind: &'static str,
    planner_shape: String,
    /// Simulated micro-batches per second (at equal convergence for islands).
    planner_rate: f64,
    planner_s: f64,
    search_shape: String,
    search_rate: f64,
    search_evaluations: usize,
    search_s: f64,
    /// Search rate over planner rate: above 1, the search found a faster plan.
    search_over_planner: f64,
}

fn shape(plan: &Plan) -> String {
    format!("{}x{}", plan.stages(), plan.replicas())
}

fn flat(p: &Problem, tb: &str, model: &str, o: &AnnealOptions) -> Result<Row> {
    let t0 = Instant::now();
    let planned = opfence(p, &OpFenceOptions::default())?;
    let planner_s = t0.elapsed().as_secs_f64();
    let sim = p.simulate(&planned.plan, 1.0)?;
    let planner_rate = (p.micro_batches * planned.plan.replicas()) as f64 / sim.step_s;
    let t0 = Instant::now();
    let found = anneal(p, o)?;
    let search_rate = p.micro_batches as f64 / found.objective;
    Ok(Row {
        testbed: tb.into(),
        model: model.into(),
        kind: "flat",
        planner_shape: shape(&planned.plan),
        planner_rate,
        planner_s,
        search_shape: shape(&found.plan),
        search_rate,
        search_evaluations: found.evaluations,
        search_s: t0.elapsed().as_secs_f64(),
        search_over_planner: search_rate / planner_rate,
    })
}

fn islands_shape(h: &fusion_plan::Hierarchy) -> String {
    let parts: Vec<String> = h.islands.iter().map(|i| shape(&i.plan)).collect();
    format!("{} H={} {}", parts.join("+"), h.every, h.codec.name)
}

fn islands(p: &Problem, tb: &str, model: &str, o: &AnnealOptions) -> Result<Row> {
    let outer = OuterOptions::default();
    let t0 = Instant::now();
    let h = plan_hierarchy(p, &outer)?;
    let planner_s = t0.elapsed().as_secs_f64();
    let planner_rate = simulate_hierarchy(p, &h, outer.overlap)?.effective_rate;
    let t0 = Instant::now();
    let found = anneal_hierarchy(p, &outer, o)?;
    let search_rate = simulate_hierarchy(p, &found.hierarchy, outer.overlap)?.effective_rate;
    Ok(Row {
        testbed: tb.into(),
        model: model.into(),
        kind: "islands",
        planner_shape: islands_shape(&h),
        planner_rate,
        planner_s,
        search_shape: islands_shape(&found.hierarchy),
        search_rate,
        search_evaluations: found.evaluations,
        search_s: t0.elapsed().as_secs_f64(),
        search_over_planner: search_rate / planner_rate,
    })
}

/// Runs the comparison with `seconds` of search per case (split over its chains).
pub fn run(seconds: f64, models: &[String], json: Option<&Path>) -> Result<()> {
    let o = AnnealOptions {
        seconds,
        ..Default::default()
    };
    let mut rows = Vec::new();
    println!(
        "planner against {seconds:.0} s of simulated annealing per case (simulated micro-batches per second; 1F1B, 8 micro-batches)"
    );
    println!(
        "{:<10} {:<12} {:<8} {:>28} {:>9} {:>28} {:>9} {:>8} {:>7}",
        "testbed", "model", "kind", "planner", "rate", "search", "rate", "evals", "ratio"
    );
    for t in ["paper-a", "paper-b", "paper-c", "worldwide"] {
        let path = Path::new("testbeds").join(format!("{t}.toml"));
        let tb = Testbed::from_file(&path)
            .with_context(|| format!("{} (run from the repository root)", path.display()))?;
        let net = network(&tb, &[])?;
        for model in models {
            let (w, _, _) = ModelArgs::preset(model).workload()?;
            let p = Problem::new(&w, &net, 8, Schedule::OneFOneB)?;
            for r in [flat(&p, t, model, &o)?, islands(&p, t, model, &o)?] {
                println!(
                    "{:<10} {:<12} {:<8} {:>28} {:>9.3} {:>28} {:>9.3} {:>8} {:>7.3}",
                    r.testbed,
                    r.model,
                    r.kind,
                    r.planner_shape,
                    r.planner_rate,
                    r.search_shape,
                    r.search_rate,
                    r.search_evaluations,
                    r.search_over_planner
                );
                rows.push(r);
            }
        }
    }
    let within = rows
        .iter()
        .filter(|r| r.search_over_planner <= 1.05)
        .count();
    println!(
        "the planner is within 5% of the search (or ahead of it) in {within} of {} cases",
        rows.len()
    );
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
