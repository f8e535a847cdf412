//! `fusionllm bench --adatopk`: AdaTopK on a real (emulated) cluster. Runs `fusionllm train`
//! with the same data, model and steps in three setups and compares step time, bytes on the slow
//! link and the loss curves (against step and wall-clock time):
//!
//! - *speed* (`--adatopk speed`): the even split without compression, OP-Fence without
//!   compression, OP-Fence with AdaTopK, on `testbeds/slow-link.toml` (10 Mbit/s between sites).
//! - *convergence* (`--adatopk convergence`): OP-Fence with no compression, with fixed top-k on
//!   every link (both directions), and with AdaTopK, for `--data` and `--model`.

use crate::bench_cluster::run_train_evaluating;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;
use std::path::Path;

#[derive(Serialize)]
struct Run {
    setup: String,
    args: Vec<String>,
    /// Mean step time over the steps after warm-up (evaluation steps left out).
    step_ms: f64,
    /// Bytes per step over links whose bandwidth is below 100 Mbit/s.
    slow_link_bytes_per_step: f64,
    final_eval_loss: f64,
    final_eval_accuracy: f64,
    wall_s: f64,
    /// (step, elapsed seconds, eval loss, eval accuracy) of every evaluation.
    curve: Vec<(u64, f64, f64, f64)>,
    /// Codecs in force at the end.
    compression: Value,
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

fn one(
    setup: &str,
    args: Vec<String>,
    steps: u64,
    eval_every: u64,
    eval_batches: u64,
) -> Result<Run> {
    eprintln!("{setup}: fusionllm train {}", args.join(" "));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (v, used) = run_train_evaluating(&refs, steps, eval_every, eval_batches)?;
    let (evals, records) = (
        v["evals"].as_array().context("report without evals")?,
        v["steps"].as_array().context("report without steps")?,
    );
    let elapsed = |step: u64| {
        records
            .iter()
            .find(|r| r["step"].as_u64() == Some(step))
            .map_or(0.0, |r| f(&r["elapsed_s"]))
    };
    let curve: Vec<(u64, f64, f64, f64)> = evals
        .iter()
        .map(|e| {
            let s = e["step"].as_u64().unwrap_or(0);
            (s, elapsed(s), f(&e["loss"]), f(&e["accuracy"]))
        })
        .collect();
    let Some(last) = curve.last().copied() else {
        bail!("{setup}: the run evaluated nothing");
    };
    // Timings with no evaluation in them.
    let eval_steps: Vec<u64> = curve.iter().map(|c| c.0).collect();
    let clean: Vec<f64> = used
        .iter()
        .filter(|t| !eval_steps.contains(&t["step"].as_u64().unwrap_or(0)))
        .map(|t| f(&t["wall_s"]))
        .collect();
    let step_ms = 1e3 * clean.iter().sum::<f64>() / clean.len().max(1) as f64;
    let slow: u64 = v["links"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|l| l["bandwidth_mbps"].as_f64().is_some_and(|b| b < 100.0))
        .map(|l| l["bytes"].as_u64().unwrap_or(0))
        .sum();
    Ok(Run {
        setup: setup.into(),
        args,
        step_ms,
        slow_link_bytes_per_step: slow as f64 / steps as f64,
        final_eval_loss: last.2,
        final_eval_accuracy: last.3,
        wall_s: f(&v["wall_s"]),
        curve,
        compression: v["compression"].clone(),
    })
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// `mode`: `speed` or `convergence`; `common` is passed to every run (data, model, testbed...).
pub fn run(
    mode: &str,
    steps: u64,
    topk: f64,
    eval_batches: u64,
    common: &[String],
    json: Option<&Path>,
) -> Result<()> {
    let setups: Vec<(&str, Vec<String>)> = match mode {
        "speed" => vec![
            ("even split, dense", strings(&["--scheduler", "even"])),
            ("OP-Fence, dense", strings(&["--scheduler", "opfence"])),
            (
                "OP-Fence + AdaTopK",
                strings(&["--scheduler", "opfence", "--compress", "adatopk"]),
            ),
        ],
        "convergence" => vec![
            ("dense", strings(&["--compress", "none"])),
            (
                "fixed top-k",
                vec!["--compress".into(), format!("topk:{topk}")],
            ),
            ("AdaTopK", strings(&["--compress", "adatopk"])),
        ],
        m => bail!("--adatopk takes speed or convergence, not '{m}'"),
    };
    let mut runs = Vec::new();
    for (name, mut args) in setups {
        args.extend(common.iter().cloned());
        let eval_every = if mode == "speed" {
            0
        } else {
            (steps / 10).max(1)
        };
        runs.push(one(name, args, steps, eval_every, eval_batches)?);
    }
    let base = &runs[0];
    println!(
        "{:<22} {:>10} {:>9} {:>16} {:>11} {:>9} {:>8}",
        "setup", "step", "speedup", "slow-link B/step", "eval loss", "vs dense", "acc"
    );
    for r in &runs {
        println!(
            "{:<22} {:>8.1}ms {:>8.2}x {:>16.0} {:>11.4} {:>8.2}% {:>7.2}%",
            r.setup,
            r.step_ms,
            base.step_ms / r.step_ms,
            r.slow_link_bytes_per_step,
            r.final_eval_loss,
            100.0 * (r.final_eval_loss / base.final_eval_loss - 1.0),
            100.0 * r.final_eval_accuracy
        );
    }
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&runs)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
