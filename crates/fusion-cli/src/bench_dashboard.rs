//! `fusionllm bench --dashboard`: what watching a run costs.
//!
//! 1. In process: the monitor's work for one training step (folding the step and its per-node
//!    and per-link detail into the view and the metrics, serialising the patch for a connected
//!    viewer) for the default job's shape (4 stages) and for 8 stages × 6 replicas (48 nodes,
//!    every pair probed).
//! 2. End to end: the default job (`fusionllm train`) run alternately without and with
//!    `--dashboard`, a viewer reading the event stream and `/metrics` scraped every second
//!    while it trains; the median step time of each run.

use anyhow::{bail, Context, Result};
use fusion_monitor::{Monitor, RunInfo};
use fusion_runtime::{BrokerEvent, LinkStep, MeasuredLink, NodeStep, StepDetail};
use fusion_train::StepRecord;
use serde::Serialize;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Serialize)]
struct InProcess {
    nodes: usize,
    probed_links: usize,
    used_links: usize,
    steps: u64,
    us_per_step: f64,
    /// JSON a viewer is sent per step.
    patch_bytes_per_step: f64,
}

#[derive(Serialize)]
struct EndToEnd {
    run: usize,
    dashboard: bool,
    steps: usize,
    median_step_s: f64,
    /// Patches the viewer read and scrapes of /metrics made during the run.
    patches_read: u64,
    scrapes: u64,
}

#[derive(Serialize)]
struct Results {
    in_process: Vec<InProcess>,
    end_to_end: Vec<EndToEnd>,
    median_step_s_without: f64,
    median_step_s_with: f64,
    overhead_pct: f64,
}

/// The links a run of `stages` × `replicas` nodes uses: both ways between neighbouring stages
/// of a pipeline, and from each replica of a stage to the next (its all-reduce ring).
fn used_links(stages: usize, replicas: usize) -> Vec<(usize, usize)> {
    let id = |r: usize, s: usize| r * stages + s;
    let mut out = Vec::new();
    for r in 0..replicas {
        for s in 0..stages {
            if s + 1 < stages {
                out.extend([(id(r, s), id(r, s + 1)), (id(r, s + 1), id(r, s))]);
            }
            if replicas > 1 {
                out.push((id(r, s), id((r + 1) % replicas, s)));
            }
        }
    }
    out
}

fn name(i: usize) -> String {
    format!("node{i}")
}

/// One step's events for a run of `stages` × `replicas` nodes.
fn step_events(step: u64, stages: usize, replicas: usize) -> (StepRecord, StepDetail) {
    let rec = StepRecord {
        step,
        loss: 3.0,
        lr: 1e-3,
        grad_norm: 0.7,
        elapsed_s: step as f64 * 0.3,
        throughput: 3500.0,
    };
    let detail = StepDetail {
        step,
        wall_s: 0.3,
        nodes: (0..stages * replicas)
            .map(|i| NodeStep {
                node: name(i),
                stage: i % stages,
                replica: i / stages,
                compute_s: 0.1,
                wait_s: 0.2,
                peak_memory_bytes: 300 << 20,
                heartbeat_age_s: 0.5,
            })
            .collect(),
        links: used_links(stages, replicas)
            .into_iter()
            .map(|(a, b)| LinkStep {
                from: name(a),
                to: name(b),
                bytes: 262_144,
            })
            .collect(),
        snapshot_step: step,
    };
    (rec, detail)
}

/// Every ordered pair of `nodes` nodes, as a probe round reports them.
fn probed(nodes: usize) -> Vec<MeasuredLink> {
    (0..nodes)
        .flat_map(|a| (0..nodes).filter(move |&b| b != a).map(move |b| (a, b)))
        .map(|(a, b)| MeasuredLink {
            from: name(a),
            to: name(b),
            bandwidth_mbps: 1000.0,
            latency_ms: 1.0,
            samples: 1,
            last_bandwidth_mbps: 1000.0,
            last_latency_ms: 1.0,
            path: fusion_runtime::path::LinkPath::Direct,
        })
        .collect()
}

fn in_process(stages: usize, replicas: usize, steps: u64) -> Result<InProcess> {
    let nodes = stages * replicas;
    let monitor = Monitor::new(RunInfo {
        unit: "tok/s".into(),
        steps,
        ..Default::default()
    })?;
    let (_, mut viewer) = monitor.subscribe();
    monitor.observe(&BrokerEvent::Links {
        round: 1,
        changed: &probed(nodes),
    });
    let events: Vec<_> = (1..=steps)
        .map(|s| step_events(s, stages, replicas))
        .collect();
    let mut patch_bytes = 0;
    let t0 = Instant::now();
    for (rec, detail) in &events {
        monitor.observe(&BrokerEvent::Step(rec, None));
        monitor.observe(&BrokerEvent::StepDetail(detail));
        while let Ok(p) = viewer.try_recv() {
            patch_bytes += p.len();
        }
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / steps as f64;
    Ok(InProcess {
        nodes,
        probed_links: nodes * (nodes - 1),
        used_links: events[0].1.links.len(),
        steps,
        us_per_step: us,
        patch_bytes_per_step: patch_bytes as f64 / steps as f64,
    })
}

/// Reads the dashboard's event stream and scrapes `/metrics` every second until `stop`.
async fn watch(url: String, stop: Arc<AtomicBool>) -> (u64, u64) {
    let base = url.trim_end_matches('/').to_string();
    let http = reqwest::Client::new();
    let (mut patches, mut scrapes) = (0u64, 0u64);
    let Ok(mut stream) = http.get(format!("{base}/api/events")).send().await else {
        return (0, 0);
    };
    let mut next_scrape = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if Instant::now() >= next_scrape {
            if let Ok(r) = http.get(format!("{base}/metrics")).send().await {
                scrapes += u64::from(r.text().await.is_ok());
            }
            next_scrape += Duration::from_secs(1);
        }
        match tokio::time::timeout(Duration::from_millis(200), stream.chunk()).await {
            Ok(Ok(Some(chunk))) => {
                patches += chunk.windows(12).filter(|w| w == b"event: patch").count() as u64;
            }
            Ok(_) => break,
            Err(_) => {}
        }
    }
    (patches, scrapes)
}

/// The default job for `steps` steps, with a dashboard and a viewer when `dashboard`.
fn end_to_end(run: usize, steps: u64, dashboard: bool) -> Result<EndToEnd> {
    let dir = tempfile::tempdir()?;
    let report = dir.path().join("report.json");
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["train", "--steps", &steps.to_string(), "--report"])
        .arg(&report);
    if dashboard {
        cmd.args(["--dashboard", "127.0.0.1:0"]);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("running fusionllm train")?;
    let stderr = child.stderr.take().context("stderr")?;
    let stop = Arc::new(AtomicBool::new(false));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut viewer = None;
    let mut tail = Vec::new();
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        // The URL line (the launcher also says when the dashboard closes).
        let url = line
            .strip_prefix("dashboard: ")
            .filter(|rest| viewer.is_none() && rest.starts_with("http"));
        if let Some(url) = url {
            let url = url
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
            viewer = Some(rt.spawn(watch(url, stop.clone())));
        }
        tail.push(line);
    }
    let status = child.wait()?;
    stop.store(true, Ordering::Relaxed);
    let (patches_read, scrapes) = match viewer {
        Some(v) => rt.block_on(v).unwrap_or((0, 0)),
        None => (0, 0),
    };
    if !status.success() {
        bail!("the run failed:\n{}", tail.join("\n"));
    }
    let v: Value = serde_json::from_slice(&std::fs::read(&report)?)?;
    let mut walls: Vec<f64> = v["timings"]
        .as_array()
        .map(|t| {
            t.iter()
                .skip(5)
                .filter_map(|t| t["wall_s"].as_f64())
                .collect()
        })
        .unwrap_or_default();
    walls.sort_by(f64::total_cmp);
    Ok(EndToEnd {
        run,
        dashboard,
        steps: walls.len(),
        median_step_s: walls.get(walls.len() / 2).copied().unwrap_or(f64::NAN),
        patches_read,
        scrapes,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

pub fn run(pairs: usize, steps: u64, json: Option<&std::path::Path>) -> Result<()> {
    // The default job (4 stages), and 8 stages x 6 replicas.
    let in_proc = vec![in_process(4, 1, 20_000)?, in_process(8, 6, 2_000)?];
    println!(
        "{:>6} {:>7} {:>6} {:>8} {:>12} {:>14}",
        "nodes", "probed", "used", "steps", "us per step", "patch B/step"
    );
    for r in &in_proc {
        println!(
            "{:>6} {:>7} {:>6} {:>8} {:>12.1} {:>14.0}",
            r.nodes, r.probed_links, r.used_links, r.steps, r.us_per_step, r.patch_bytes_per_step
        );
    }
    let mut runs = Vec::new();
    for i in 0..pairs {
        for dashboard in [false, true] {
            eprintln!("dashboard bench: run {i}, dashboard {dashboard}, {steps} steps");
            runs.push(end_to_end(i, steps, dashboard)?);
        }
    }
    println!(
        "\n{:>4} {:>10} {:>6} {:>12} {:>8} {:>8}",
        "run", "dashboard", "steps", "step ms", "patches", "scrapes"
    );
    for r in &runs {
        println!(
            "{:>4} {:>10} {:>6} {:>12.2} {:>8} {:>8}",
            r.run,
            r.dashboard,
            r.steps,
            1e3 * r.median_step_s,
            r.patches_read,
            r.scrapes
        );
    }
    let of = |d: bool| {
        median(
            runs.iter()
                .filter(|r| r.dashboard == d)
                .map(|r| r.median_step_s)
                .collect(),
        )
    };
    let (without, with) = (of(false), of(true));
    let overhead_pct = 100.0 * (with - without) / without;
    println!(
        "\nmedian step: {:.2} ms without, {:.2} ms with the dashboard and a viewer: {overhead_pct:+.2}%",
        1e3 * without,
        1e3 * with
    );
    let results = Results {
        in_process: in_proc,
        end_to_end: runs,
        median_step_s_without: without,
        median_step_s_with: with,
        overhead_pct,
    };
    if let Some(p) = json {
        std::fs::write(p, serde_json::to_string_pretty(&results)?)?;
    }
    Ok(())
}
