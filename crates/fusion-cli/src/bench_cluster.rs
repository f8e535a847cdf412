//! `fusionllm bench --cluster`: gpt2-tiny on the local emulated cluster (default testbed: two
//! sites, 50 Mbit/s and 40 ms between them), once per pipeline schedule. Each run is a real
//! `fusionllm train` (broker plus node processes); its report gives per-step wall time, each
//! stage's compute time, and the bytes and tensors sent over each link. The table compares the
//! measured step time with the serial sum of compute and paced transfer time (bytes over the
//! link's bandwidth plus one latency per tensor): what the step would take without overlap.

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

const WARMUP: usize = 5;

#[derive(Serialize)]
struct ScheduleRow {
    schedule: String,
    micro_batches: u64,
    steps_measured: usize,
    step_s: f64,
    compute_sum_s: f64,
    compute_max_stage_s: f64,
    transfer_s: f64,
    /// Serialisation time of the busiest link (bytes over bandwidth): no step can be shorter.
    busiest_link_s: f64,
    serial_sum_s: f64,
    /// Measured step time over the serial sum (below 1: pipelining overlaps work).
    ratio: f64,
    tokens_per_s: f64,
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// Runs `fusionllm train` with `args` for `steps` steps and returns its report and the step
/// timings worth measuring (warm-up and the last step, which also evaluates, left out).
pub fn run_train(args: &[&str], steps: u64) -> Result<(Value, Vec<Value>)> {
    run_train_evaluating(args, steps, 0, 1)
}

/// [`run_train`], evaluating on `eval_batches` batches every `eval_every` steps (0: at the end).
pub fn run_train_evaluating(
    args: &[&str],
    steps: u64,
    eval_every: u64,
    eval_batches: u64,
) -> Result<(Value, Vec<Value>)> {
    let dir = tempfile::tempdir()?;
    let report = dir.path().join("report.json");
    let out = Command::new(std::env::current_exe()?)
        .args([
            "train",
            "--steps",
            &steps.to_string(),
            "--eval-every",
            &eval_every.to_string(),
            "--eval-batches",
            &eval_batches.to_string(),
        ])
        .args(args)
        .arg("--report")
        .arg(&report)
        .output()
        .context("running fusionllm train")?;
    if !out.status.success() {
        bail!(
            "the cluster run failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: Value = serde_json::from_slice(&std::fs::read(&report)?)?;
    let timings = v["timings"].as_array().context("report without timings")?;
    // Skip warm-up and the last step (it also evaluates and gathers the final state).
    let used: Vec<Value> = timings
        .iter()
        .skip(WARMUP)
        .take(timings.len().saturating_sub(WARMUP + 1))
        .cloned()
        .collect();
    if used.is_empty() {
        bail!("--cluster-steps must be above {}", WARMUP + 1);
    }
    Ok((v, used))
}

fn measure(schedule: &str, steps: u64) -> Result<ScheduleRow> {
    let (v, used) = run_train(&["--schedule", schedule, "--scheduler", "even"], steps)?;
    let timings = v["timings"].as_array().context("report without timings")?;
    let n = used.len() as f64;
    let mean = |g: &dyn Fn(&Value) -> f64| used.iter().map(g).sum::<f64>() / n;
    let sum_of = |t: &Value| t.as_array().map_or(0.0, |a| a.iter().map(f).sum());
    let max_of = |t: &Value| {
        t.as_array()
            .map_or(0.0, |a| a.iter().map(f).fold(0.0, f64::max))
    };
    let step_s = mean(&|t| f(&t["wall_s"]));
    let compute_sum_s = mean(&|t| sum_of(&t["compute_s"]));
    let compute_max_stage_s = mean(&|t| max_of(&t["compute_s"]));
    let total_steps = timings.len() as f64;
    // Per link: (serialisation, serialisation + one latency per tensor), per step.
    let per_link: Vec<(f64, f64)> = v["links"]
        .as_array()
        .map(|links| {
            links
                .iter()
                .filter(|l| f(&l["bandwidth_mbps"]) > 0.0)
                .map(|l| {
                    let bw = f(&l["bandwidth_mbps"]) * 1e6 / 8.0;
                    let ser = f(&l["bytes"]) / total_steps / bw;
                    let lat = f(&l["tensors"]) / total_steps * f(&l["latency_ms"]) / 1e3;
                    (ser, ser + lat)
                })
                .collect()
        })
        .unwrap_or_default();
    let transfer_s: f64 = per_link.iter().map(|l| l.1).sum();
    let busiest_link_s = per_link.iter().map(|l| l.0).fold(0.0, f64::max);
    let cfg = &v["config"];
    let tokens = f(&cfg["batch_size"]) * f(&cfg["seq_len"]) * f(&cfg["micro_batches"]);
    let serial = compute_sum_s + transfer_s;
    Ok(ScheduleRow {
        schedule: v["schedule"].as_str().unwrap_or(schedule).to_string(),
        micro_batches: cfg["micro_batches"].as_u64().unwrap_or(0),
        steps_measured: used.len(),
        step_s,
        compute_sum_s,
        compute_max_stage_s,
        transfer_s,
        busiest_link_s,
        serial_sum_s: serial,
        ratio: step_s / serial.max(1e-9),
        tokens_per_s: tokens / step_s.max(1e-9),
    })
}

pub fn run(steps: u64, json: Option<&Path>) -> Result<()> {
    let rows = ["gpipe", "1f1b"]
        .iter()
        .map(|s| measure(s, steps))
        .collect::<Result<Vec<_>>>()?;
    println!(
        "gpt2-tiny on the default testbed (4 node processes, 2 sites, 50 Mbit/s 40 ms between)"
    );
    println!(
        "{:<10} {:>4} {:>9} {:>12} {:>12} {:>12} {:>12} {:>12} {:>7} {:>9}",
        "schedule",
        "M",
        "step ms",
        "compute ms",
        "max stage",
        "transfer ms",
        "busiest link",
        "serial ms",
        "ratio",
        "tok/s"
    );
    for r in &rows {
        println!(
            "{:<10} {:>4} {:>9.1} {:>12.1} {:>12.1} {:>12.1} {:>12.1} {:>12.1} {:>7.2} {:>9.0}",
            r.schedule,
            r.micro_batches,
            r.step_s * 1e3,
            r.compute_sum_s * 1e3,
            r.compute_max_stage_s * 1e3,
            r.transfer_s * 1e3,
            r.busiest_link_s * 1e3,
            r.serial_sum_s * 1e3,
            r.ratio,
            r.tokens_per_s
        );
    }
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
