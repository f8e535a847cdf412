//! `fusionllm bench --islands-planner`: on the 48-GPU testbeds, the hierarchical plan (islands
//! that pipeline inside, synchronised across slow links) against OP-Fence's flat plan and
//! against DiLoCo across every cluster without pipelines, in simulated micro-batches per
//! second at equal convergence (the penalty applied). Run from the repository root.

use crate::plan_cmd::{network, ModelArgs};
use anyhow::{Context, Result};
use fusion_exec::Schedule;
use fusion_plan::{
    opfence, plan_hierarchy, simulate_hierarchy, Hierarchy, OpFenceOptions, OuterOptions, Problem,
};
use fusion_testbed::Testbed;
use serde::Serialize;
use std::path::Path;

#[derive(Serialize)]
struct Row {
    testbed: String,
    model: String,
    /// OP-Fence's flat plan: shape, devices used, simulated micro-batches per second.
    flat_shape: String,
    flat_devices: usize,
    flat_rate: f64,
    /// The hierarchy: islands, devices used, H, codec, penalty, simulated effective rate.
    islands: usize,
    devices: usize,
    every: u64,
    codec: String,
    penalty: f64,
    rate: f64,
    /// Cost model over simulator for the hierarchy's effective rate.
    model_vs_simulator: f64,
    /// DiLoCo across every cluster, one stage per device (None: the model does not fit one).
    diloco_rate: Option<f64>,
    speedup_over_flat: f64,
    speedup_over_diloco: Option<f64>,
    planning_s: f64,
}

fn used(h: &Hierarchy) -> usize {
    h.islands
        .iter()
        .map(|i| i.plan.devices.iter().flatten().count())
        .sum()
}

fn row(tb: &Testbed, model: &str) -> Result<Row> {
    let net = network(tb, &[])?;
    let (w, _, _) = ModelArgs::preset(model).workload()?;
    let p = Problem::new(&w, &net, 8, Schedule::OneFOneB)?;
    let flat = opfence(&p, &OpFenceOptions::default())?;
    let flat_sim = p.simulate(&flat.plan, 1.0)?;
    let flat_rate = (8 * flat.plan.replicas()) as f64 / flat_sim.step_s;
    let t0 = std::time::Instant::now();
    let h = plan_hierarchy(&p, &OuterOptions::default())?;
    let planning_s = t0.elapsed().as_secs_f64();
    let sim = simulate_hierarchy(&p, &h, false)?;
    let no_pipelines = OuterOptions {
        pipelines: false,
        ..OuterOptions::default()
    };
    let diloco_rate = match plan_hierarchy(&p, &no_pipelines) {
        Ok(d) => Some(simulate_hierarchy(&p, &d, false)?.effective_rate),
        Err(fusion_plan::PlanError::Infeasible(_)) => None,
        Err(e) => return Err(e.into()),
    };
    Ok(Row {
        testbed: tb.name.clone(),
        model: model.into(),
        flat_shape: format!("{}x{}", flat.plan.stages(), flat.plan.replicas()),
        flat_devices: flat.plan.devices.iter().flatten().count(),
        flat_rate,
        islands: h.islands.len(),
        devices: used(&h),
        every: h.every,
        codec: h.codec.name.clone(),
        penalty: h.penalty,
        rate: sim.effective_rate,
        model_vs_simulator: h.effective_rate / sim.effective_rate,
        speedup_over_flat: sim.effective_rate / flat_rate,
        speedup_over_diloco: diloco_rate.map(|d| sim.effective_rate / d),
        diloco_rate,
        planning_s,
    })
}

pub fn run(json: Option<&Path>) -> Result<()> {
    let models = [
        "gpt2-small",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "resnet101",
    ];
    println!(
        "{:<10} {:<12} {:>7} {:>5} {:>8} | {:>3} {:>5} {:>4} {:>5} {:>6} {:>8} {:>6} | {:>8} | {:>7} {:>7} {:>6}",
        "testbed", "model", "flat", "devs", "mb/s", "isl", "devs", "H", "codec", "pen.", "mb/s", "m/sim", "diloco", "x flat", "x dilo", "plan s"
    );
    let mut rows = Vec::new();
    for name in ["paper-a", "paper-b", "paper-c", "worldwide"] {
        let path = Path::new("testbeds").join(format!("{name}.toml"));
        let tb = Testbed::from_file(&path)
            .with_context(|| format!("{} (run from the repository root)", path.display()))?;
        for model in models {
            let r = row(&tb, model)?;
            let opt = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.2}"));
            println!(
                "{:<10} {:<12} {:>7} {:>5} {:>8.1} | {:>3} {:>5} {:>4} {:>5} {:>6.3} {:>8.1} {:>6.3} | {:>8} | {:>7.2} {:>7} {:>6.2}",
                r.testbed, r.model, r.flat_shape, r.flat_devices, r.flat_rate, r.islands, r.devices,
                r.every, r.codec, r.penalty, r.rate, r.model_vs_simulator,
                r.diloco_rate.map_or("no fit".to_string(), |d| format!("{d:.1}")),
                r.speedup_over_flat, opt(r.speedup_over_diloco), r.planning_s
            );
            rows.push(r);
        }
    }
    println!(
        "(mb/s: simulated micro-batches per second at equal convergence; pen.: the token penalty)"
    );
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
