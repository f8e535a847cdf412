//! `fusionllm bench --planner`: OP-Fence against the exact optimum on 200 random small
//! instances, simulated speedups over the baselines on the 48-GPU testbeds, and planning time
//! for gpt2-xl on 48 and on 1000 devices.

use crate::plan_cmd::{network, ModelArgs};
use anyhow::{Context, Result};
use fusion_exec::Schedule;
use fusion_plan::{plan, random, PlanOptions, Problem, Scheduler};
use fusion_testbed::{Device, LinkSpec, Site, SiteLink, Testbed};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Serialize)]
struct GapStudy {
    cases: usize,
    within_1pct: usize,
    within_5pct: usize,
    median_gap: f64,
    p95_gap: f64,
    max_gap: f64,
    opfence_ms_mean: f64,
    optimal_ms_mean: f64,
    /// OP-Fence's plan against the closed form's optimal plan, both simulated (OP-Fence ranks
    /// its candidates by the simulator): gaps below 0 mean OP-Fence's plan is faster.
    simulated_within_5pct: usize,
    simulated_median_gap: f64,
    simulated_max_gap: f64,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn gap_study(cases: u64) -> Result<GapStudy> {
    if cases == 0 {
        anyhow::bail!("--planner-cases must be at least 1");
    }
    let (mut gaps, mut t_fence, mut t_opt) = (Vec::new(), 0.0, 0.0);
    let mut sim_gaps = Vec::new();
    for seed in 0..cases {
        let inst = random::instance(seed, 6, 40);
        let p = Problem::new(
            &inst.workload,
            &inst.network,
            inst.micro_batches,
            Schedule::OneFOneB,
        )?;
        let one = PlanOptions {
            replicas: Some(1),
            ..Default::default()
        };
        let t0 = Instant::now();
        let f = plan(&p, Scheduler::OpFence, &one)?;
        t_fence += t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let o = plan(&p, Scheduler::Optimal, &PlanOptions::default())?;
        t_opt += t0.elapsed().as_secs_f64();
        gaps.push(f.evaluation.objective / o.evaluation.objective - 1.0);
        sim_gaps.push(p.simulate(&f.plan, 1.0)?.step_s / p.simulate(&o.plan, 1.0)?.step_s - 1.0);
    }
    gaps.sort_by(f64::total_cmp);
    sim_gaps.sort_by(f64::total_cmp);
    let n = gaps.len();
    Ok(GapStudy {
        cases: n,
        within_1pct: gaps.iter().filter(|&&g| g <= 0.01).count(),
        within_5pct: gaps.iter().filter(|&&g| g <= 0.05).count(),
        median_gap: percentile(&gaps, 0.5),
        p95_gap: percentile(&gaps, 0.95),
        max_gap: gaps[n - 1],
        opfence_ms_mean: t_fence / n as f64 * 1e3,
        optimal_ms_mean: t_opt / n as f64 * 1e3,
        simulated_within_5pct: sim_gaps.iter().filter(|&&g| g <= 0.05).count(),
        simulated_median_gap: percentile(&sim_gaps, 0.5),
        simulated_max_gap: sim_gaps[n - 1],
    })
}

#[derive(Serialize)]
struct SpeedupRow {
    testbed: String,
    model: String,
    /// "pipeline": every scheduler runs one pipeline over all 48 devices;
    /// "free": each may replicate and leave devices idle.
    setup: &'static str,
    opfence_step_ms: f64,
    opfence_shape: String,
    even_speedup: f64,
    compute_speedup: f64,
    dtfm_speedup: f64,
}

fn speedups(testbeds: &[PathBuf], models: &[&str]) -> Result<Vec<SpeedupRow>> {
    let mut rows = Vec::new();
    for path in testbeds {
        let tb = Testbed::from_file(path)?;
        let net = network(&tb, &[])?;
        for &model in models {
            let (w, _, _) = ModelArgs::preset(model).workload()?;
            let p = Problem::new(&w, &net, 8, Schedule::OneFOneB)?;
            for (setup, opts) in [
                (
                    "pipeline",
                    PlanOptions {
                        stages: Some(tb.devices.len()),
                        replicas: Some(1),
                        ..Default::default()
                    },
                ),
                ("free", PlanOptions::default()),
            ] {
                // Simulated seconds per replica-step (M micro-batches), lower is faster.
                let time = |s: Scheduler| -> Result<(f64, String)> {
                    let got = plan(&p, s, &opts)?;
                    let sim = p.simulate(&got.plan, 1.0)?;
                    Ok((
                        sim.step_s / got.plan.replicas() as f64,
                        format!("{}x{}", got.plan.stages(), got.plan.replicas()),
                    ))
                };
                let (fence, shape) = time(Scheduler::OpFence)?;
                let ratio = |s| -> Result<f64> { Ok(time(s)?.0 / fence) };
                rows.push(SpeedupRow {
                    testbed: tb.name.clone(),
                    model: model.to_string(),
                    setup,
                    opfence_step_ms: fence * 1e3,
                    opfence_shape: shape,
                    even_speedup: ratio(Scheduler::Even)?,
                    compute_speedup: ratio(Scheduler::Compute)?,
                    dtfm_speedup: ratio(Scheduler::Dtfm)?,
                });
            }
        }
    }
    Ok(rows)
}

/// `sites` sites of `per_site` devices of rotating GPU classes; 10 Gbit/s inside a site,
/// 20 Mbit/s to 1 Gbit/s (log-uniform, seeded) between sites.
pub fn synthetic_testbed(sites: usize, per_site: usize, seed: u64) -> Result<Testbed> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let classes = ["a100", "v100", "rtx3090", "rtx4090", "rtx3080", "h100"];
    let mut links = Vec::new();
    for a in 0..sites {
        for b in a + 1..sites {
            let mbps = (rng.random_range(20f64.ln()..1000f64.ln())).exp();
            links.push(SiteLink {
                between: [format!("s{a}"), format!("s{b}")],
                spec: LinkSpec {
                    bandwidth_mbps: mbps,
                    latency_ms: rng.random_range(5.0..120.0),
                    loss: 0.0,
                },
            });
        }
    }
    let tb = Testbed {
        name: format!("synthetic-{}", sites * per_site),
        description: format!("{sites} sites of {per_site} GPUs"),
        sites: (0..sites)
            .map(|s| Site {
                name: format!("s{s}"),
                internal: LinkSpec {
                    bandwidth_mbps: 10000.0,
                    latency_ms: 0.05,
                    loss: 0.0,
                },
            })
            .collect(),
        devices: (0..sites * per_site)
            .map(|d| Device {
                name: format!("gpu{d}"),
                site: format!("s{}", d / per_site),
                class: classes[(d / per_site) % classes.len()].to_string(),
                slowdown: 1.0,
                nat: Default::default(),
            })
            .collect(),
        links,
    };
    tb.validate()?;
    Ok(tb)
}

#[derive(Serialize)]
struct Timing {
    case: String,
    devices: usize,
    operators: usize,
    planning_s: f64,
    shape: String,
}

fn planning_speed(paper_a: &Path) -> Result<Vec<Timing>> {
    let (w, _, _) = ModelArgs::preset("gpt2-xl").workload()?;
    let mut out = Vec::new();
    for (case, tb) in [
        ("gpt2-xl on paper-a", Testbed::from_file(paper_a)?),
        ("gpt2-xl on 1000 GPUs", synthetic_testbed(40, 25, 1)?),
    ] {
        let net = network(&tb, &[])?;
        let t0 = Instant::now();
        let p = Problem::new(&w, &net, 8, Schedule::OneFOneB)?;
        let got = plan(&p, Scheduler::OpFence, &PlanOptions::default())?;
        out.push(Timing {
            case: case.into(),
            devices: tb.devices.len(),
            operators: w.len(),
            planning_s: t0.elapsed().as_secs_f64(),
            shape: format!("{}x{}", got.plan.stages(), got.plan.replicas()),
        });
    }
    Ok(out)
}

pub fn run(cases: u64, json: Option<&Path>) -> Result<()> {
    let root = Path::new("testbeds");
    let testbeds: Vec<PathBuf> = ["paper-a", "paper-b", "paper-c", "worldwide"]
        .iter()
        .map(|t| root.join(format!("{t}.toml")))
        .collect();
    let speed =
        planning_speed(&testbeds[0]).context("planning speed (run from the repository root)")?;
    println!("planning time (OP-Fence, all replica counts, local search):");
    for t in &speed {
        println!(
            "  {:<24} {:>5} devices {:>4} operators: {:.3} s -> {}",
            t.case, t.devices, t.operators, t.planning_s, t.shape
        );
    }
    let gaps = gap_study(cases)?;
    println!(
        "\nOP-Fence vs exact optimum on {} random instances (2-6 devices, 8-40 operators, 8 Mbit/s-10 Gbit/s):",
        gaps.cases
    );
    println!(
        "  within 1%: {}  within 5%: {}  median gap {:.2}%  p95 {:.2}%  max {:.1}%  (OP-Fence {:.1} ms, optimum {:.1} ms per case)",
        gaps.within_1pct,
        gaps.within_5pct,
        100.0 * gaps.median_gap,
        100.0 * gaps.p95_gap,
        100.0 * gaps.max_gap,
        gaps.opfence_ms_mean,
        gaps.optimal_ms_mean
    );
    println!(
        "  simulated, OP-Fence's plan against the optimum's: within 5% (or faster): {}  median gap {:.2}%  max {:.1}%",
        gaps.simulated_within_5pct,
        100.0 * gaps.simulated_median_gap,
        100.0 * gaps.simulated_max_gap
    );
    let models = [
        "gpt2-small",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "resnet101",
    ];
    let rows = speedups(&testbeds, &models)?;
    println!("\nsimulated speedup of OP-Fence (1F1B, 8 micro-batches per replica-step):");
    println!(
        "{:<10} {:<12} {:<9} {:>12} {:>8} {:>7} {:>8} {:>6}",
        "testbed", "model", "setup", "opfence ms", "shape", "even", "compute", "dtfm"
    );
    for r in &rows {
        println!(
            "{:<10} {:<12} {:<9} {:>12.0} {:>8} {:>7.2} {:>8.2} {:>6.2}",
            r.testbed,
            r.model,
            r.setup,
            r.opfence_step_ms,
            r.opfence_shape,
            r.even_speedup,
            r.compute_speedup,
            r.dtfm_speedup
        );
    }
    if let Some(path) = json {
        let out = serde_json::json!({ "planning": speed, "optimality": gaps, "speedups": rows });
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
