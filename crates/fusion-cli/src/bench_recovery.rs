//! `fusionllm bench --recovery`: what a fault costs on the local cluster (the default job:
//! gpt2-tiny, 4 node processes, two emulated sites). Each run is a real `fusionllm train`; a
//! node process is signalled once training is a third of the way through: SIGKILL (the launcher
//! restarts the process; the broker rolls back to its last snapshot) or SIGTERM (the node leaves;
//! its stage is handed over at the next step boundary). The report of each run gives the steps
//! lost, the time from the fault's detection to the new placement being ready, and the
//! snapshots' cost; an undisturbed run gives the step time to compare with. The same job as two
//! islands (one per site, synchronised every 10 steps) is killed the same way under each
//! island recovery: `local` (only node1's island sits out until the next synchronisation) and
//! `rollback` (every island goes back to the last snapshot).

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

#[derive(Serialize)]
struct Row {
    fault: String,
    steps: u64,
    wall_s: f64,
    median_step_s: f64,
    steps_lost: u64,
    /// From the fault's detection (or the step boundary of a leave) to every node of the new
    /// placement being ready.
    recovery_s: f64,
    nodes_after: u64,
    snapshots: u64,
    snapshot_mean_s: f64,
    snapshot_interval_steps: u64,
    final_eval_loss: f64,
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// Runs the default job for `steps` steps with `extra` arguments, sending `signal` (e.g.
/// "KILL") to node1's process once `at` steps are done; returns the run's report.
fn run_with_fault(steps: u64, signal: Option<&str>, at: u64, extra: &[&str]) -> Result<Value> {
    let dir = tempfile::tempdir()?;
    let report = dir.path().join("report.json");
    let mut child = Command::new(std::env::current_exe()?)
        .args(["train", "--steps", &steps.to_string(), "--report"])
        .arg(&report)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("running fusionllm train")?;
    let stderr = child.stderr.take().context("stderr")?;
    let mut signalled = signal.is_none();
    let mut tail = Vec::new();
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        let step = line
            .strip_prefix("step")
            .and_then(|r| r.trim_start().split('/').next()?.trim().parse::<u64>().ok());
        if let (false, Some(sig), Some(s)) = (signalled, signal, step) {
            if s >= at {
                let pattern = "fusionllm node .*--name node1( |$)";
                let ok = Command::new("pkill")
                    .args([&format!("-{sig}"), "-f", pattern])
                    .status()
                    .context("pkill (procps) is needed to signal a node")?;
                if !ok.success() {
                    bail!("no node1 process to signal");
                }
                signalled = true;
            }
        }
        tail.push(line);
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("the cluster run failed:\n{}", tail.join("\n"));
    }
    Ok(serde_json::from_slice(&std::fs::read(&report)?)?)
}

fn row(fault: &str, v: &Value) -> Row {
    let mut walls: Vec<f64> = v["timings"]
        .as_array()
        .map(|t| t.iter().map(|t| f(&t["wall_s"])).collect())
        .unwrap_or_default();
    walls.sort_by(f64::total_cmp);
    let change = v["recoveries"]
        .as_array()
        .and_then(|r| r.first())
        .or_else(|| v["reshapes"].as_array().and_then(|r| r.first()));
    let at = |k: &str| change.map_or(0.0, |c| f(&c[k]));
    Row {
        fault: fault.into(),
        steps: v["steps"].as_array().map_or(0, |s| s.len() as u64),
        wall_s: f(&v["wall_s"]),
        median_step_s: walls.get(walls.len() / 2).copied().unwrap_or(0.0),
        steps_lost: at("steps_lost") as u64,
        recovery_s: at("seconds"),
        nodes_after: change.map_or(
            v["placement"].as_array().map_or(0, |p| p.len() as u64),
            |c| c["nodes_after"].as_u64().unwrap_or(0),
        ),
        snapshots: v["snapshots"]["taken"].as_u64().unwrap_or(0),
        snapshot_mean_s: f(&v["snapshots"]["mean_seconds"]),
        snapshot_interval_steps: v["snapshots"]["interval_steps"].as_u64().unwrap_or(0),
        final_eval_loss: v["evals"]
            .as_array()
            .and_then(|e| e.last())
            .map_or(f64::NAN, |e| f(&e["loss"])),
    }
}

pub fn run(steps: u64, json: Option<&std::path::Path>) -> Result<()> {
    if steps < 30 {
        bail!("--recovery-steps must be at least 30");
    }
    let mut rows = Vec::new();
    let islands = |recovery| {
        [
            "--islands",
            "2",
            "--outer-every",
            "10",
            "--island-recovery",
            recovery,
        ]
    };
    let (local, rollback) = (islands("local"), islands("rollback"));
    // A third of the way through; the islands half-way through a round of 10 steps.
    let (third, mid_round) = (steps / 3, steps / 3 / 10 * 10 + 5);
    let runs: [(&str, Option<&str>, u64, &[&str]); 6] = [
        ("none", None, third, &[]),
        ("node1 SIGKILL", Some("KILL"), third, &[]),
        ("node1 SIGTERM (leave)", Some("TERM"), third, &[]),
        ("islands: none", None, mid_round, &local),
        ("islands: SIGKILL local", Some("KILL"), mid_round, &local),
        (
            "islands: SIGKILL rollback",
            Some("KILL"),
            mid_round,
            &rollback,
        ),
    ];
    for (fault, signal, at, extra) in runs {
        eprintln!("recovery bench: {fault}, {steps} steps");
        rows.push(row(fault, &run_with_fault(steps, signal, at, extra)?));
    }
    println!(
        "{:<26} {:>6} {:>8} {:>9} {:>6} {:>10} {:>6} {:>6} {:>10} {:>8} {:>9}",
        "fault",
        "steps",
        "wall s",
        "step ms",
        "lost",
        "recovery s",
        "nodes",
        "snaps",
        "snap ms",
        "interval",
        "eval loss"
    );
    for r in &rows {
        println!(
            "{:<26} {:>6} {:>8.1} {:>9.1} {:>6} {:>10.2} {:>6} {:>6} {:>10.1} {:>8} {:>9.4}",
            r.fault,
            r.steps,
            r.wall_s,
            r.median_step_s * 1e3,
            r.steps_lost,
            r.recovery_s,
            r.nodes_after,
            r.snapshots,
            r.snapshot_mean_s * 1e3,
            r.snapshot_interval_steps,
            r.final_eval_loss
        );
    }
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
