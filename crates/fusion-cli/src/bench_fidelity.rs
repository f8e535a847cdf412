//! `fusionllm bench --fidelity`: the simulator against measured step times. Each plan is a real
//! `fusionllm train` on the local emulated cluster (default testbed, paced links); its report
//! gives the placement, each stage's measured compute per step and the mean step time. The same
//! plan is then simulated twice: with the stages' measured compute (the simulator's model of the
//! schedule and the links alone), and with compute predicted by the workload estimator from the
//! nodes' profiles taken at join (estimator and simulator end to end). Both use the links as the
//! nodes probed them at join. `--fidelity-model` measures a real-sized model (gpt2-small,
//! gpt2-medium) on a text corpus with GPT-2's vocabulary instead of gpt2-tiny on the synthetic
//! corpus.

use crate::bench_cluster::run_train;
use crate::plan_cmd::network;
use anyhow::{Context, Result};
use fusion_estimate::{DeviceProfile, ProfileSource, Workload, ADAM_STATE_BYTES_PER_PARAM};
use fusion_models::ModelSpec;
use fusion_plan::{Network, Plan, Problem};
use fusion_runtime::Schedule;
use fusion_sim::{simulate, StageTime};
use fusion_testbed::Testbed;
use serde::Serialize;
use serde_json::Value;
use std::path::Path;

#[derive(Serialize)]
struct Row {
    plan: String,
    stages: Vec<usize>,
    measured_step_ms: f64,
    simulated_measured_compute_ms: f64,
    error_measured_compute: f64,
    simulated_estimated_compute_ms: f64,
    error_estimated_compute: f64,
    /// Per stage: compute per micro-batch measured, and as the estimator predicted it from the
    /// node's profile at join (its calibration and per-operator overhead).
    stage_measured_ms: Vec<f64>,
    stage_estimated_ms: Vec<f64>,
    calibration: Vec<f64>,
    op_overhead_us: Vec<f64>,
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// What the runs train: a model preset on a dataset (`synthetic` or a text file).
pub struct Subject<'a> {
    pub model: &'a str,
    pub data: &'a str,
}

fn one(label: &str, args: &[&str], steps: u64, tb: &Testbed, subject: &Subject) -> Result<Row> {
    let mut all = vec!["--model", subject.model, "--data", subject.data];
    all.extend_from_slice(args);
    let (v, used) = run_train(&all, steps)?;
    let cfg = &v["config"];
    let (batch, seq, m) = (
        f(&cfg["batch_size"]) as usize,
        f(&cfg["seq_len"]) as usize,
        f(&cfg["micro_batches"]) as usize,
    );
    // The model as the run built it: matched to the default data's vocabulary.
    let data = fusion_runtime::open_dataset(subject.data, "gpt2", 0)?;
    let model = fusion_train::adapt_model(ModelSpec::preset(subject.model)?, data.kind())?;
    let graph = model.graph(batch, seq)?;
    let w = Workload::of(&graph, ADAM_STATE_BYTES_PER_PARAM)?;
    let placement = v["placement"]
        .as_array()
        .context("report without placement")?;
    let mut starts = vec![0];
    let mut devices = Vec::new();
    let mut profiles = Vec::new();
    for p in placement {
        let ops = f(&p["operators"]) as usize;
        starts.push(starts[starts.len() - 1] + ops);
        let node = p["node"].as_str().unwrap_or("");
        let d = tb
            .devices
            .iter()
            .position(|d| d.name == node)
            .with_context(|| format!("node {node} is not in the testbed"))?;
        devices.push(vec![d]);
        profiles.push((
            d,
            DeviceProfile {
                name: node.to_string(),
                class: "cpu".into(),
                dense_flops_per_s: f(&p["measured_gflops"]) * 1e9,
                memory_bytes_per_s: f(&p["measured_memory_gbs"]) * 1e9,
                memory_capacity_bytes: 24e9,
                calibration: f(&p["calibration"]).max(1e-3),
                op_overhead_s: f(&p["op_overhead_us"]).max(0.0) * 1e-6,
                source: ProfileSource::Measured,
            },
        ));
    }
    starts.pop();
    let plan = Plan {
        starts: starts.clone(),
        devices,
    };
    let schedule = if v["schedule"].as_str() == Some("GPipe") {
        Schedule::GPipe
    } else {
        Schedule::OneFOneB
    };
    let mut net: Network = network(tb, &[])?;
    for (d, prof) in profiles {
        net.devices[d] = prof;
    }
    // The links as the nodes probed them (what the broker planned with), where measured.
    let index = |name: &str| tb.devices.iter().position(|d| d.name == name);
    for l in v["measured_links"].as_array().into_iter().flatten() {
        let (Some(a), Some(b)) = (
            index(l["from"].as_str().unwrap_or("")),
            index(l["to"].as_str().unwrap_or("")),
        ) else {
            continue;
        };
        net.bandwidth[a][b] = f(&l["bandwidth_mbps"]) * 1e6 / 8.0;
        net.latency[a][b] = f(&l["latency_ms"]) / 1e3;
    }
    let p = Problem::new(&w, &net, m, schedule)?;
    let estimated = p.simulate(&plan, 1.0)?;
    // The same pipeline with each stage's measured compute, split forward:backward as estimated.
    let mut pipe = p.pipeline(&plan, 1.0)?;
    let n = used.len() as f64;
    let (mut stage_measured_ms, mut stage_estimated_ms) = (Vec::new(), Vec::new());
    for (s, st) in pipe.stages.iter_mut().enumerate() {
        let measured: f64 = used.iter().map(|t| f(&t["compute_s"][s])).sum::<f64>() / n / m as f64;
        stage_measured_ms.push(measured * 1e3);
        stage_estimated_ms.push((st.forward_s + st.backward_s) * 1e3);
        let share = st.forward_s / (st.forward_s + st.backward_s).max(1e-12);
        *st = StageTime {
            forward_s: measured * share,
            backward_s: measured * (1.0 - share),
        };
    }
    let with_measured = simulate(&pipe)?;
    let step = used.iter().map(|t| f(&t["wall_s"])).sum::<f64>() / n;
    Ok(Row {
        plan: label.into(),
        stages: starts,
        measured_step_ms: step * 1e3,
        simulated_measured_compute_ms: with_measured.step_s * 1e3,
        error_measured_compute: with_measured.step_s / step - 1.0,
        simulated_estimated_compute_ms: estimated.step_s * 1e3,
        error_estimated_compute: estimated.step_s / step - 1.0,
        stage_measured_ms,
        stage_estimated_ms,
        calibration: placement.iter().map(|p| f(&p["calibration"])).collect(),
        op_overhead_us: placement.iter().map(|p| f(&p["op_overhead_us"])).collect(),
    })
}

/// Plans measured for gpt2-tiny: both schedules, OP-Fence, fixed cuts, and heavier steps.
fn tiny_plans() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        (
            "even, gpipe",
            vec!["--scheduler", "even", "--schedule", "gpipe"],
        ),
        (
            "even, 1f1b",
            vec!["--scheduler", "even", "--schedule", "1f1b"],
        ),
        (
            "opfence, 1f1b",
            vec!["--scheduler", "opfence", "--schedule", "1f1b"],
        ),
        (
            "cuts 6,12,18, gpipe",
            vec!["--cuts", "6,12,18", "--schedule", "gpipe"],
        ),
        // Compute-heavier steps: 8x the tokens per micro-batch.
        (
            "opfence, 1f1b, 16x128",
            vec![
                "--scheduler",
                "opfence",
                "--schedule",
                "1f1b",
                "--batch",
                "16",
                "--seq",
                "128",
            ],
        ),
        (
            "even, gpipe, 16x128",
            vec![
                "--scheduler",
                "even",
                "--schedule",
                "gpipe",
                "--batch",
                "16",
                "--seq",
                "128",
            ],
        ),
    ]
}

/// Plans measured for a real-sized model: one sequence of 256 tokens per micro-batch, four
/// micro-batches, as OP-Fence plans it and evenly split.
fn large_plans() -> Vec<(&'static str, Vec<&'static str>)> {
    let shape = ["--batch", "1", "--seq", "256", "--micro-batches", "4"];
    let with = |extra: &[&'static str]| [extra, &shape[..]].concat();
    vec![
        (
            "opfence, 1f1b",
            with(&["--scheduler", "opfence", "--schedule", "1f1b"]),
        ),
        (
            "even, gpipe",
            with(&["--scheduler", "even", "--schedule", "gpipe"]),
        ),
    ]
}

pub fn run(steps: u64, subject: &Subject, json: Option<&Path>) -> Result<()> {
    let tb = Testbed::from_toml(include_str!("../../../testbeds/default.toml"))?;
    let plans = if subject.model == "gpt2-tiny" {
        tiny_plans()
    } else {
        large_plans()
    };
    let mut rows = Vec::new();
    for (label, args) in plans {
        rows.push(one(label, &args, steps, &tb, subject)?);
    }
    println!(
        "{} on {} on the default testbed (4 node processes, paced links): simulator vs measurement",
        subject.model, subject.data
    );
    println!(
        "{:<24} {:<16} {:>10} {:>14} {:>7} {:>14} {:>7}",
        "plan", "stage starts", "measured", "sim (meas. c)", "error", "sim (est. c)", "error"
    );
    for r in &rows {
        println!(
            "{:<24} {:<16} {:>8.1}ms {:>12.1}ms {:>6.1}% {:>12.1}ms {:>6.1}%",
            r.plan,
            format!("{:?}", r.stages),
            r.measured_step_ms,
            r.simulated_measured_compute_ms,
            100.0 * r.error_measured_compute,
            r.simulated_estimated_compute_ms,
            100.0 * r.error_estimated_compute
        );
    }
    println!(
        "per stage, compute per micro-batch measured / estimated (calibration, overhead at join):"
    );
    for r in &rows {
        let stages: Vec<String> = (0..r.stage_measured_ms.len())
            .map(|s| {
                format!(
                    "{:.1}/{:.1} ms ({:.2}, {:.0} us)",
                    r.stage_measured_ms[s],
                    r.stage_estimated_ms[s],
                    r.calibration.get(s).copied().unwrap_or(0.0),
                    r.op_overhead_us.get(s).copied().unwrap_or(0.0)
                )
            })
            .collect();
        println!("  {:<24} {}", r.plan, stages.join("; "));
    }
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
