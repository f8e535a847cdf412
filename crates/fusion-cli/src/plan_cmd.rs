//! `fusionllm estimate`, `fusionllm plan` and `fusionllm simulate`: the workload estimator, the
//! schedulers and the simulator from the command line.

use anyhow::{bail, Context, Result};
use clap::Args;
use fusion_backend::CandleBackend;
use fusion_estimate::{profile_backend, DeviceProfile, Workload, ADAM_STATE_BYTES_PER_PARAM};
use fusion_models::ModelSpec;
use fusion_plan::{
    plan, plan_sharding_where_memory_binds, Network, PlanError, PlanFile, PlanOptions, Planned,
    Problem, Scheduler, ShardingChoice,
};
use fusion_runtime::parse_schedule;
use fusion_testbed::{DeviceCatalog, Testbed};
use fusion_train::ShardOptimizer;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// What to plan for: a model preset and its micro-batch.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// Model preset (see `fusionllm model list`) or model file (`fusionllm model export`).
    #[arg(long, default_value = "gpt2-small")]
    model: String,
    /// Sequences (or images) per micro-batch (default: 4 sequences, or 32 images, or what a
    /// model file's graph was built for).
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence (default: the model's context, or a model file's).
    #[arg(long)]
    seq: Option<usize>,
}

impl ModelArgs {
    /// A preset at its default micro-batch.
    pub fn preset(model: &str) -> Self {
        ModelArgs {
            model: model.to_string(),
            batch: None,
            seq: None,
        }
    }

    /// The model's workload per micro-batch, with its batch and sequence length.
    pub fn workload(&self) -> Result<(Workload, usize, usize)> {
        let spec = ModelSpec::resolve(&self.model, None)?;
        let (batch, seq) = match spec.fixed_shape() {
            Some((b, s)) => (self.batch.unwrap_or(b), self.seq.unwrap_or(s)),
            None if spec.is_language_model() => {
                (self.batch.unwrap_or(4), self.seq.unwrap_or(spec.context()))
            }
            None => (self.batch.unwrap_or(32), 0),
        };
        let graph = spec.graph(batch, seq)?;
        Ok((
            Workload::of(&graph, ADAM_STATE_BYTES_PER_PARAM)?,
            batch,
            seq,
        ))
    }

    /// A small and a larger graph of the same family, for profiling this machine.
    fn calibration_graphs(&self) -> Result<Vec<fusion_graph::Graph>> {
        let spec = ModelSpec::resolve(&self.model, None)?;
        Ok(fusion_models::calibration_graphs(spec.is_language_model())?)
    }
}

#[derive(Args)]
pub struct EstimateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Device class to time the operators on (see testbeds/device-classes.toml).
    #[arg(long, default_value = "a100")]
    class: String,
    /// Time the operators with this device profile (JSON) instead of a class.
    #[arg(long)]
    device_profile: Option<PathBuf>,
    /// Profile this machine (the CPU backend, a few hundred milliseconds) instead of a class.
    #[arg(long)]
    measure: bool,
    /// Write the device profile used (e.g. a measured one) to this file.
    #[arg(long)]
    save_profile: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct OpRow<'a> {
    #[serde(flatten)]
    op: &'a fusion_estimate::OpWorkload,
    cut_bytes_before: f64,
    fwd_ms: f64,
    bwd_ms: f64,
}

fn total_memory() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(8e9, |kb| kb * 1024.0)
}

pub fn estimate(a: EstimateArgs) -> Result<()> {
    let (w, batch, seq) = a.model.workload()?;
    let device = if a.measure {
        let g = a.model.calibration_graphs()?;
        let run = profile_backend(&CandleBackend::cpu(), "this-machine", &g, total_memory(), 3)?;
        let ms = |v: &[f64]| {
            v.iter()
                .map(|s| format!("{:.1}", s * 1e3))
                .collect::<Vec<_>>()
                .join(" and ")
        };
        eprintln!(
            "measured: {:.1} GFLOP/s dense, {:.1} GB/s element-wise, calibration {:.2} and {:.1} us per operator pass ({} ms measured vs {} ms roofline on the small and large calibration graphs)",
            run.profile.dense_flops_per_s / 1e9,
            run.profile.memory_bytes_per_s / 1e9,
            run.profile.calibration,
            run.profile.op_overhead_s * 1e6,
            ms(&run.graph_s),
            ms(&run.roofline_s)
        );
        // This machine is the catalog's `cpu` class: `plan --device-profile` then applies the
        // measured figures to every `cpu` device of a testbed.
        DeviceProfile {
            class: "cpu".into(),
            ..run.profile
        }
    } else if let Some(path) = &a.device_profile {
        DeviceProfile::from_file(path)?
    } else {
        let cat = DeviceCatalog::builtin()?;
        let c = cat
            .get(&a.class)
            .with_context(|| format!("unknown device class '{}'", a.class))?;
        DeviceProfile::from_class(&a.class, c)
    };
    if let Some(path) = &a.save_profile {
        std::fs::write(path, serde_json::to_string_pretty(&device)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let rows: Vec<OpRow> = w
        .ops
        .iter()
        .enumerate()
        .map(|(i, op)| {
            let (f, b) = device.op_time(op);
            OpRow {
                op,
                cut_bytes_before: w.cut_bytes[i],
                fwd_ms: f * 1e3,
                bwd_ms: b * 1e3,
            }
        })
        .collect();
    let (state, act) = w.memory(0..w.len());
    let (fwd, bwd) = device.range_time(&w, 0..w.len());
    if a.json {
        let out = serde_json::json!({
            "model": a.model.model,
            "batch": batch,
            "seq": seq,
            "device": device,
            "flops": w.flops(0..w.len()),
            "state_bytes": state,
            "activation_bytes_per_micro_batch": act,
            "fwd_ms": fwd * 1e3,
            "bwd_ms": bwd * 1e3,
            "ops": rows,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} (batch {batch}, seq {seq}) on {} ({:.1} TFLOP/s dense, {:.0} GB/s, calibration {:.2}): {} operators",
        a.model.model,
        device.name,
        device.dense_flops_per_s / 1e12,
        device.memory_bytes_per_s / 1e9,
        device.calibration,
        w.len()
    );
    println!(
        "{:<34} {:<14} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "operator", "op", "fwd FLOP", "bwd FLOP", "params", "act MB", "cut MB", "fwd ms", "bwd ms"
    );
    for r in &rows {
        println!(
            "{:<34} {:<14} {:>10.3e} {:>10.3e} {:>10} {:>10.2} {:>10.2} {:>9.3} {:>9.3}",
            r.op.name,
            r.op.op,
            r.op.fwd_flops,
            r.op.bwd_flops,
            r.op.params,
            r.op.activation_bytes / 1e6,
            r.cut_bytes_before / 1e6,
            r.fwd_ms,
            r.bwd_ms
        );
    }
    println!(
        "total: {:.3e} FLOP, {:.1} ms forward + {:.1} ms backward per micro-batch; {:.2} GB of weights, gradients and Adam state; {:.2} GB of activations per micro-batch in flight",
        w.flops(0..w.len()),
        fwd * 1e3,
        bwd * 1e3,
        state / 1e9,
        act / 1e9
    );
    Ok(())
}

#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Testbed file (see testbeds/).
    #[arg(long, default_value = "testbeds/paper-a.toml")]
    testbed: PathBuf,
    /// opfence, even, compute, dtfm or optimal.
    #[arg(long, default_value = "opfence")]
    scheduler: String,
    /// Micro-batches per step and replica.
    #[arg(long, default_value_t = 8)]
    micro_batches: usize,
    /// gpipe or 1f1b.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Exactly this many stages, every device busy.
    #[arg(long)]
    stages: Option<usize>,
    /// Exactly this many data-parallel replicas.
    #[arg(long)]
    replicas: Option<usize>,
    /// Device profile (JSON, e.g. from `estimate --measure --save-profile`) replacing the
    /// published figures of the devices of its class; repeatable.
    #[arg(long)]
    device_profile: Vec<PathBuf>,
    /// Plan and predict with AdaTopK compressing the links slower than the slowest stage.
    #[arg(long)]
    adatopk: bool,
    /// AdaTopK's floor: the smallest share of values a message keeps.
    #[arg(long, default_value_t = 0.5)]
    adatopk_floor: f64,
    /// AdaTopK without the fp16 and int8 rungs: links that do not fit go straight to top-k.
    #[arg(long)]
    adatopk_no_quantize: bool,
    /// Never recompute activations: a stage that does not fit storing them is not planned.
    #[arg(long)]
    no_recompute: bool,
    /// Replicas that shard their optimizer state (as `train --shard-optimizer on` runs them:
    /// each of a stage's R replicas holds 1/R of the moments and updates 1/R of them): `auto`
    /// (default) shards where memory binds, when the plan would not fit or would recompute
    /// without it; `on` always; `off` never. `--shard-optimizer` alone is `on`.
    #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "on")]
    shard_optimizer: ShardOptimizer,
    /// Do not plan with the other schedulers for comparison.
    #[arg(long)]
    no_compare: bool,
    /// Also plan islands (`auto`: the planner's choice, one included; `N`: exactly N): OP-Fence
    /// plans each island, and for every slow link between its clusters the planner chooses a
    /// pipeline cut or an outer synchronisation (DiLoCo-style) across it.
    #[arg(long)]
    islands: Option<String>,
    /// With --islands: synchronise every H inner steps (default: the planner's choice among 10,
    /// 25, 50, 100, 200; with --outer-fragments F, those F divides).
    #[arg(long, requires = "islands")]
    outer_every: Option<u64>,
    /// With --islands: how pseudo-gradients travel, dense or int8 (default: the planner's
    /// choice).
    #[arg(long, requires = "islands")]
    outer_codec: Option<String>,
    /// With --islands: plan as if the exchange ran beside the next round's compute (what
    /// `train --outer-overlap` does: a round costs the longer of its compute and its exchange;
    /// with fragments, each fragment's slot of H / F steps against its exchange).
    #[arg(long, requires = "islands")]
    overlap: bool,
    /// With --islands: plan as if the model were synchronised in F fragments, one every H / F
    /// steps (what `train --outer-fragments F` does): F smaller exchanges per round, each
    /// paying the ring's latencies, an overlapped one hidden behind H / F steps only. The
    /// whole-model synchronisations a run adds at evaluations, snapshots and its end are not
    /// priced.
    #[arg(long, default_value_t = 1, requires = "islands")]
    outer_fragments: u32,
    /// Write the plan file here.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

/// The devices of `tb` at their class's figures, or at a measured profile of their class.
pub fn network(tb: &Testbed, profiles: &[PathBuf]) -> Result<Network> {
    let cat = DeviceCatalog::builtin()?;
    let loaded: Vec<DeviceProfile> = profiles
        .iter()
        .map(|p| DeviceProfile::from_file(p))
        .collect::<Result<_, _>>()?;
    let mut net = Network::from_testbed(tb, &cat)?;
    for (d, dev) in tb.devices.iter().enumerate() {
        if let Some(p) = loaded
            .iter()
            .find(|p| p.name == dev.name || p.class == dev.class)
        {
            net.devices[d] = DeviceProfile {
                name: dev.name.clone(),
                ..p.clone()
            };
        }
    }
    Ok(net)
}

#[derive(Serialize)]
struct Comparison {
    scheduler: &'static str,
    step_ms: Option<f64>,
    simulated_step_ms: Option<f64>,
    stages: Option<usize>,
    replicas: Option<usize>,
    speedup_of_chosen: Option<f64>,
    note: Option<String>,
}

impl PlanArgs {
    /// What `--islands N|auto` and the outer flags ask the hierarchical planner for.
    fn islands_args(&self, n: &str) -> Result<crate::islands_plan::IslandsArgs> {
        let islands = match n {
            "auto" => None,
            n => Some(
                n.parse::<usize>()
                    .ok()
                    .filter(|&k| k >= 1)
                    .with_context(|| {
                        format!("--islands takes `auto` or a number of islands, got '{n}'")
                    })?,
            ),
        };
        Ok(crate::islands_plan::IslandsArgs {
            islands,
            every: self.outer_every,
            codec: self.outer_codec.clone(),
            overlap: self.overlap,
            fragments: self.outer_fragments,
        })
    }
}

/// `scheduler`'s plan of `p`, sharding the optimizer state where memory binds when `auto`.
fn plan_choosing_sharding(
    p: &Problem,
    scheduler: Scheduler,
    opts: &PlanOptions,
    auto: bool,
) -> Result<ShardingChoice, PlanError> {
    if auto {
        return plan_sharding_where_memory_binds(p, scheduler, opts);
    }
    let planned = plan(p, scheduler, opts)?;
    Ok(ShardingChoice {
        sharded: p.shard_optimizer && planned.plan.replicas() > 1,
        planned,
        why: None,
    })
}

fn options(a: &PlanArgs) -> PlanOptions {
    PlanOptions {
        stages: a.stages,
        replicas: a.replicas,
        ..Default::default()
    }
}

pub fn run_plan(a: PlanArgs) -> Result<()> {
    let (w, batch, seq) = a.model.workload()?;
    let tb = Testbed::from_file(&a.testbed)?;
    let net = network(&tb, &a.device_profile)?;
    let schedule = parse_schedule(&a.schedule)?;
    let mut p = Problem::new(&w, &net, a.micro_batches, schedule)?;
    if a.no_recompute {
        p = p.without_recompute();
    }
    if a.shard_optimizer.is_on() {
        p = p.sharding_optimizer();
    }
    if a.adatopk {
        if !(a.adatopk_floor > 0.0 && a.adatopk_floor <= 1.0) {
            anyhow::bail!("--adatopk-floor must be in (0, 1], got {}", a.adatopk_floor);
        }
        p = p.with_compression(fusion_compress::AdaTopKPolicy {
            floor: a.adatopk_floor,
            quantize: !a.adatopk_no_quantize,
            ..Default::default()
        });
    }
    let chosen = Scheduler::parse(&a.scheduler)?;
    let opts = options(&a);
    let auto = a.shard_optimizer == ShardOptimizer::Auto;
    let t0 = std::time::Instant::now();
    let choice = plan_choosing_sharding(&p, chosen, &opts, auto)?;
    let planning_s = t0.elapsed().as_secs_f64();
    // The problem each plan runs under: sharded where its choice shards.
    let twin = p.with_sharding(true)?;
    let under = |c: &ShardingChoice| if c.sharded { &twin } else { &p };
    let got: &Planned = &choice.planned;
    let sim = under(&choice).simulate(&got.plan, 1.0)?;
    let mut file = PlanFile::new(
        under(&choice),
        &got.plan,
        &got.evaluation,
        sim.step_s,
        chosen.name(),
        &a.model.model,
        batch,
        seq,
        &a.schedule,
        &tb,
    );
    file.explanation.extend(choice.why.clone());
    let mut comparisons = Vec::new();
    if !a.no_compare {
        for s in Scheduler::ALL {
            let row = match plan_choosing_sharding(&p, s, &opts, auto) {
                Ok(c) => {
                    let other = &c.planned;
                    let sim_other = under(&c).simulate(&other.plan, 1.0)?;
                    Comparison {
                        scheduler: s.name(),
                        step_ms: Some(other.evaluation.step_s * 1e3),
                        simulated_step_ms: Some(sim_other.step_s * 1e3),
                        stages: Some(other.plan.stages()),
                        replicas: Some(other.plan.replicas()),
                        speedup_of_chosen: Some(
                            (sim_other.step_s / other.plan.replicas() as f64)
                                / (sim.step_s / got.plan.replicas() as f64),
                        ),
                        note: match (other.evaluation.fits(), c.sharded) {
                            (false, _) => Some("does not fit in memory".to_string()),
                            (true, true) => Some("shards its optimizer state".to_string()),
                            (true, false) => None,
                        },
                    }
                }
                Err(e @ (PlanError::TooLarge { .. } | PlanError::Infeasible(_))) => Comparison {
                    scheduler: s.name(),
                    step_ms: None,
                    simulated_step_ms: None,
                    stages: None,
                    replicas: None,
                    speedup_of_chosen: None,
                    note: Some(e.to_string()),
                },
                Err(e) => return Err(e.into()),
            };
            comparisons.push(row);
        }
    }
    if let Some(path) = &a.out {
        std::fs::write(path, serde_json::to_string_pretty(&file)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let hierarchy = match &a.islands {
        Some(n) => {
            let flat = crate::islands_plan::Flat {
                plan: &got.plan,
                model_step_s: got.evaluation.step_s,
                simulated_step_s: sim.step_s,
            };
            Some(crate::islands_plan::plan(&p, &a.islands_args(n)?, flat)?)
        }
        None => None,
    };
    if a.json {
        let out = serde_json::json!({
            "plan": file,
            "planning_s": planning_s,
            "simulation": sim,
            "comparison": comparisons,
            "hierarchy": hierarchy,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} on {} ({} devices) with {}: {} stages x {} replicas, planned in {:.3} s",
        a.model.model,
        tb.name,
        tb.devices.len(),
        chosen.name(),
        got.plan.stages(),
        got.plan.replicas(),
        planning_s
    );
    for line in &file.explanation {
        println!("  {line}");
    }
    println!(
        "simulated step: {:.1} ms ({:?} bound), {:.2} micro-batches/s",
        sim.step_s * 1e3,
        sim.bottleneck,
        file.prediction.micro_batches_per_s
    );
    if !comparisons.is_empty() {
        println!(
            "\n{:<10} {:>12} {:>14} {:>7} {:>9} {:>10}  note",
            "scheduler", "model ms", "simulated ms", "stages", "replicas", "speedup"
        );
        let opt =
            |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |x| format!("{x:.prec$}"));
        for c in &comparisons {
            println!(
                "{:<10} {:>12} {:>14} {:>7} {:>9} {:>10}  {}",
                c.scheduler,
                opt(c.step_ms, 1),
                opt(c.simulated_step_ms, 1),
                c.stages.map_or("-".into(), |s| s.to_string()),
                c.replicas.map_or("-".into(), |s| s.to_string()),
                opt(c.speedup_of_chosen, 2),
                c.note.as_deref().unwrap_or("")
            );
        }
        println!(
            "(speedup: the other scheduler's simulated time per replica-step over {}'s)",
            chosen.name()
        );
    }
    if let Some(h) = &hierarchy {
        crate::islands_plan::print(h, &tb);
    }
    Ok(())
}

#[derive(Args)]
pub struct SimulateArgs {
    /// A plan file written by `fusionllm plan --out`.
    #[arg(long)]
    plan: PathBuf,
    /// Compression ratio on every edge between stages (1: none).
    #[arg(long, default_value_t = 1.0)]
    compression: f64,
    /// Override the plan's micro-batches per step.
    #[arg(long)]
    micro_batches: Option<usize>,
    /// Override the plan's schedule (gpipe or 1f1b).
    #[arg(long)]
    schedule: Option<String>,
    /// Device profiles replacing class figures, as with `plan`.
    #[arg(long)]
    device_profile: Vec<PathBuf>,
    #[arg(long)]
    json: bool,
}

pub fn simulate(a: SimulateArgs) -> Result<()> {
    let f = PlanFile::from_file(&a.plan)?;
    let model = ModelArgs {
        model: f.model.clone(),
        batch: Some(f.batch),
        seq: (f.seq > 0).then_some(f.seq),
    };
    let (w, _, _) = model.workload()?;
    check_stages(&f, &w, &a.plan)?;
    let net = network(&f.testbed, &a.device_profile)?;
    let schedule = parse_schedule(a.schedule.as_deref().unwrap_or(&f.schedule))?;
    let p = Problem::new(
        &w,
        &net,
        a.micro_batches.unwrap_or(f.micro_batches),
        schedule,
    )?
    .with_sharding(f.shard_optimizer)?;
    let plan = f.plan()?;
    let e = p.evaluate(&plan)?;
    let sim = p.simulate(&plan, a.compression)?;
    if a.json {
        let out = serde_json::json!({ "evaluation": e, "simulation": sim });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} on {}: {} stages x {} replicas, {} micro-batches, compression {}",
        f.model,
        f.testbed.name,
        plan.stages(),
        plan.replicas(),
        p.micro_batches,
        a.compression
    );
    println!(
        "simulated step {:.1} ms (cost model {:.1} ms); all-reduce {:.1} ms; bound by {:?}",
        sim.step_s * 1e3,
        e.step_s * 1e3,
        sim.allreduce_s * 1e3,
        sim.bottleneck
    );
    for (s, u) in sim.stage_utilisation.iter().enumerate() {
        println!(
            "  stage {s:>2} on {:<14} busy {:>8.1} ms ({:>5.1}%)",
            f.stages[s].devices.join(","),
            sim.stage_busy_s[s] * 1e3,
            100.0 * u
        );
    }
    Ok(())
}

/// A plan file is only valid for the graph it was made for.
fn check_stages(f: &PlanFile, w: &Workload, path: &Path) -> Result<()> {
    for s in &f.stages {
        match w.ops.get(s.first_op) {
            Some(op) if op.name == s.first_op_name => {}
            _ => bail!(
                "{}: stage starting at operator {} ('{}') does not match model {} (batch {}, seq {})",
                path.display(),
                s.first_op,
                s.first_op_name,
                f.model,
                f.batch,
                f.seq
            ),
        }
    }
    Ok(())
}
