//! `fusionllm bench`: GEMM and operator throughput against the CPU's peak FMA rate, and one
//! gpt2-small training step.

use crate::peak::peak_flops;
use anyhow::{Context, Result};
use clap::Args;
use fusion_backend::{Backend, CandleBackend};
use fusion_data::{Dataset, TextCorpus, Tokenizer};
use fusion_graph::{GraphCost, Op};
use fusion_models::ModelSpec;
use fusion_ops::{backward, forward, Mode, Value};
use fusion_train::{peak_rss_bytes, TrainConfig, Trainer};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args)]
pub struct BenchArgs {
    /// Write the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Skip the gpt2-small training step.
    #[arg(long)]
    no_step: bool,
    /// Only measure the tensor transport (loopback TLS vs plain TCP).
    #[arg(long)]
    transport: bool,
    /// Only measure training steps on the local emulated cluster (default testbed), for each
    /// pipeline schedule: step time against the sum of compute and paced transfer time.
    #[arg(long)]
    cluster: bool,
    /// Only measure faithful link emulation (root): round-trip time and throughput over emulated
    /// links of the default testbed, against their configuration.
    #[arg(long)]
    netns: bool,
    /// Only measure the planner: OP-Fence against the exact optimum on random instances,
    /// simulated speedups on the 48-GPU testbeds, planning time (run from the repository root).
    #[arg(long)]
    planner: bool,
    /// Only measure the simulator's fidelity: real cluster runs of several plans against their
    /// simulated step time.
    #[arg(long)]
    fidelity: bool,
    /// Model preset for --fidelity (gpt2-tiny measures six plans on the synthetic corpus; a
    /// larger model two plans at 1 x 256 tokens per micro-batch on --fidelity-data).
    #[arg(long, default_value = "gpt2-tiny")]
    fidelity_model: String,
    /// Dataset for --fidelity: `synthetic` or a text file (GPT-2's BPE vocabulary).
    #[arg(long, default_value = "synthetic")]
    fidelity_data: String,
    /// Only measure the element-wise kernels (cross-entropy, GELU, broadcast add, fused
    /// attention, AdamW) at every instruction-set level this processor has (baseline SSE2, AVX2,
    /// AVX-512), and check that every level gives the same bits.
    #[arg(long)]
    simd: bool,
    /// Only measure compression: top-k selection and encoding throughput against a memory copy,
    /// message size per codec, sampled against exact selection.
    #[arg(long)]
    compress: bool,
    /// AdaTopK on the emulated cluster: `speed` (even split vs OP-Fence vs OP-Fence + AdaTopK on
    /// testbeds/slow-link.toml) or `convergence` (dense vs fixed top-k vs AdaTopK); arguments
    /// after `--` go to every `fusionllm train` run (e.g. -- --data ../shared/data/shakespeare.txt).
    #[arg(long)]
    adatopk: Option<String>,
    /// Training steps per run with --adatopk.
    #[arg(long, default_value_t = 60)]
    adatopk_steps: u64,
    /// Density of the fixed top-k baseline with --adatopk convergence.
    #[arg(long, default_value_t = 0.05)]
    topk_density: f64,
    /// Evaluation batches of each --adatopk convergence evaluation (the same held-out batches in
    /// every run, so runs compare on equal ground).
    #[arg(long, default_value_t = 8)]
    adatopk_eval_batches: u64,
    /// Extra `fusionllm train` arguments for --adatopk runs.
    #[arg(last = true)]
    train_args: Vec<String>,
    /// Only measure the hierarchical planner: islands against OP-Fence's flat plan and against
    /// DiLoCo without pipelines on the 48-GPU testbeds (simulated, at equal convergence).
    #[arg(long)]
    islands_planner: bool,
    /// Only measure what the dashboard costs: the monitor's work per step in process, and the
    /// default job's step time without and with `--dashboard` (a viewer on its event stream,
    /// /metrics scraped every second).
    #[arg(long)]
    dashboard: bool,
    /// Pairs of runs (without, with) for --dashboard.
    #[arg(long, default_value_t = 3)]
    dashboard_pairs: usize,
    /// Training steps per run for --dashboard.
    #[arg(long, default_value_t = 150)]
    dashboard_steps: u64,
    /// Only check the planner against a long randomised search: OP-Fence's flat plans and the
    /// hierarchical planner's islands against simulated annealing from random plans, scored by
    /// the simulator, on the 48-GPU testbeds (run from the repository root).
    #[arg(long)]
    planner_anneal: bool,
    /// Seconds of annealing per case with --planner-anneal.
    #[arg(long, default_value_t = 60.0)]
    anneal_seconds: f64,
    /// Models for --planner-anneal (comma-separated presets).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "gpt2-small,gpt2-medium,gpt2-large,gpt2-xl,resnet101"
    )]
    anneal_models: Vec<String>,
    /// Random instances for --planner.
    #[arg(long, default_value_t = 200)]
    planner_cases: u64,
    /// Training steps per schedule with --cluster (the first 5 are warm-up).
    #[arg(long, default_value_t = 40)]
    cluster_steps: u64,
    /// Only measure what faults cost on the local cluster: a node SIGKILLed, a node leaving on
    /// SIGTERM, against an undisturbed run (steps lost, recovery time, snapshot cost); and as
    /// two islands, a node SIGKILLed under local and under rollback island recovery.
    #[arg(long)]
    recovery: bool,
    /// Training steps per run with --recovery.
    #[arg(long, default_value_t = 150)]
    recovery_steps: u64,
    /// Only soak the local cluster (a broker and four node processes) in seeded random faults:
    /// node SIGKILL, SIGSTOP and SIGTERM (then a join), a partition of one node's data plane,
    /// broker SIGKILL and restart.
    #[arg(long)]
    soak: bool,
    /// Minutes of faults with --soak.
    #[arg(long, default_value_t = 60)]
    soak_minutes: u64,
    /// Mean seconds between faults with --soak (each gap drawn within ±25%).
    #[arg(long, default_value_t = 120.0)]
    soak_every: f64,
    /// The fault schedule's seed with --soak.
    #[arg(long, default_value_t = 1)]
    soak_seed: u64,
    /// Training steps of the soaked job (gpt2-tiny), to last about --soak-minutes.
    #[arg(long, default_value_t = 12000)]
    soak_steps: u64,
    /// Snapshots of the soaked job between its checkpoints: the broker's (gathered) or sharded.
    #[arg(long, value_enum, default_value_t = crate::cluster::SnapshotMode::Broker)]
    soak_snapshots: crate::cluster::SnapshotMode,
    /// Timed repetitions per kernel.
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

#[derive(Serialize)]
struct Row {
    name: String,
    shape: String,
    gflops: f64,
    pct_of_peak: f64,
    ms: f64,
}

#[derive(Serialize)]
struct StepResult {
    batch: usize,
    seq: usize,
    step_s: f64,
    matmul_gflop: f64,
    matmul_time_at_gemm_rate_s: f64,
    ratio: f64,
    peak_rss_mb: f64,
}

#[derive(Serialize)]
struct BenchReport {
    threads: usize,
    isa: &'static str,
    peak_gflops: f64,
    gemm: Vec<Row>,
    operators: Vec<Row>,
    gpt2_small_step: Option<StepResult>,
}

/// Best time of `reps` runs of `f`, after one warm-up.
fn best<F: FnMut() -> Result<()>>(reps: usize, mut f: F) -> Result<f64> {
    f()?;
    let mut best = f64::MAX;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn random(b: &CandleBackend, shape: &[usize]) -> Result<candle_tensor::T> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 2_654_435_761) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    Ok(b.upload(v, shape)?)
}

mod candle_tensor {
    pub type T = <fusion_backend::CandleBackend as fusion_backend::Backend>::Tensor;
}

fn gemm_rows(b: &CandleBackend, peak: f64, reps: usize) -> Result<Vec<Row>> {
    let shapes = [
        (512, 512, 512),
        (1024, 1024, 1024),
        (2048, 2048, 2048),
        (1024, 768, 2304),
        (1024, 3072, 768),
        (1024, 768, 50257),
    ];
    let mut rows = Vec::new();
    // The output head's backward products: dx = dy · W and dW = dyᵀ · x (a transposed left
    // operand, which keeps gemm's own threading).
    for (name, m, k, n, ta) in [
        ("gemm dy·W", 1024, 50257, 768, false),
        ("gemm dyᵀ·x", 50257, 1024, 768, true),
    ] {
        let a = random(b, &if ta { [k, m] } else { [m, k] })?;
        let x = random(b, &[k, n])?;
        let t = best(reps, || {
            b.matmul(&a, &x, ta, false)?;
            Ok(())
        })?;
        rows.push(product_row(name, (m, k, n), t, peak));
    }
    for (m, k, n) in shapes {
        let a = random(b, &[m, k])?;
        let w = random(b, &[n, k])?;
        let t = best(reps, || {
            b.matmul(&a, &w, false, true)?;
            Ok(())
        })?;
        rows.push(product_row("gemm x·Wᵀ", (m, k, n), t, peak));
    }
    Ok(rows)
}

/// The row of an `m x k · k x n` product that took `t` seconds.
fn product_row(name: &str, (m, k, n): (usize, usize, usize), t: f64, peak: f64) -> Row {
    let gflops = 2.0 * (m * k * n) as f64 / t / 1e9;
    Row {
        name: name.into(),
        shape: format!("{m}x{k} · {k}x{n}"),
        gflops,
        pct_of_peak: 100.0 * gflops * 1e9 / peak,
        ms: t * 1e3,
    }
}

/// (label, operator, input shape, parameter shapes)
type OpCase = (&'static str, Op, Vec<usize>, Vec<Vec<usize>>);

fn operator_rows(b: &CandleBackend, peak: f64, reps: usize) -> Result<Vec<Row>> {
    // gpt2-small shapes at batch 4 x 256 tokens.
    let (bs, t, d, v) = (4usize, 256usize, 768usize, 50257usize);
    let cases: Vec<OpCase> = vec![
        (
            "linear c_attn",
            Op::Linear { bias: true },
            vec![bs, t, d],
            vec![vec![3 * d, d], vec![3 * d]],
        ),
        (
            "linear mlp.c_fc",
            Op::Linear { bias: true },
            vec![bs, t, d],
            vec![vec![4 * d, d], vec![4 * d]],
        ),
        (
            "linear mlp.c_proj",
            Op::Linear { bias: true },
            vec![bs, t, 4 * d],
            vec![vec![d, 4 * d], vec![d]],
        ),
        (
            "linear lm_head",
            Op::Linear { bias: false },
            vec![bs, t, d],
            vec![vec![v, d]],
        ),
        (
            "attention core",
            Op::CausalSelfAttention { n_head: 12 },
            vec![bs, t, 3 * d],
            vec![],
        ),
    ];
    let mut rows = Vec::new();
    for (name, op, in_shape, p_shapes) in cases {
        let x = Value::<CandleBackend>::Float(random(b, &in_shape)?);
        let params: Vec<_> = p_shapes
            .iter()
            .map(|s| random(b, s))
            .collect::<Result<_>>()?;
        let prefs: Vec<_> = params.iter().collect();
        let flops = {
            let mut g = fusion_graph::GraphBuilder::new("bench");
            let xi = g.input("x", in_shape.clone(), fusion_graph::DType::F32);
            match &op {
                Op::Linear { bias } => g.linear("op", xi, p_shapes[0][0], *bias)?,
                _ => g.op("op", op.clone(), &[xi], None)?,
            };
            let c = GraphCost::of(&g.finish()?);
            c.fwd_flops + c.bwd_flops
        };
        let out_shape = b.shape(&forward(b, &op, &[&x], &prefs, Mode::Train)?.output);
        let dy = random(b, &out_shape)?;
        let t = best(reps, || {
            let f = forward(b, &op, &[&x], &prefs, Mode::Train)?;
            backward(b, &op, &[&x], &prefs, &f.saved, &dy, Mode::Train)?;
            Ok(())
        })?;
        let gflops = flops / t / 1e9;
        rows.push(Row {
            name: format!("{name} fwd+bwd"),
            shape: format!("{in_shape:?}"),
            gflops,
            pct_of_peak: 100.0 * gflops * 1e9 / peak,
            ms: t * 1e3,
        });
    }
    rows.push(fused_attention_row(b, peak, reps, [bs * 12, t, 64])?);
    Ok(rows)
}

/// The fused causal attention kernel alone on separate `q, k, v [N, T, D]` (what PyTorch's
/// `scaled_dot_product_attention` takes), forward and backward; FLOPs counted as for the full
/// `T x T` products (the causal kernel skips the masked half).
fn fused_attention_row(
    b: &CandleBackend,
    peak: f64,
    reps: usize,
    shape: [usize; 3],
) -> Result<Row> {
    let [n, t, d] = shape;
    let (q, k, v, dy) = (
        random(b, &shape)?,
        random(b, &shape)?,
        random(b, &shape)?,
        random(b, &shape)?,
    );
    let scale = 1.0 / (d as f64).sqrt();
    let secs = best(reps, || {
        let (y, lse) = b
            .causal_attention(&q, &k, &v, scale)?
            .context("the candle backend has a fused attention kernel on the CPU")?;
        b.causal_attention_backward(&q, &k, &v, &y, &lse, &dy, scale)?;
        Ok(())
    })?;
    let flops = 6.0 * 2.0 * (n * t * t * d) as f64;
    let gflops = flops / secs / 1e9;
    Ok(Row {
        name: "fused attention kernel fwd+bwd".into(),
        shape: format!("{shape:?}"),
        gflops,
        pct_of_peak: 100.0 * gflops * 1e9 / peak,
        ms: secs * 1e3,
    })
}

/// FLOPs of the matrix products of one forward+backward pass (linear layers and attention).
fn matmul_flops(g: &fusion_graph::Graph) -> f64 {
    GraphCost::of(g)
        .nodes
        .iter()
        .zip(&g.nodes)
        .map(|(c, n)| match n.op {
            Op::Linear { .. } => {
                let k = *g.tensor(n.inputs[0]).shape.last().unwrap_or(&0) as f64;
                3.0 * 2.0 * c.output_shape.iter().product::<usize>() as f64 * k
            }
            Op::CausalSelfAttention { .. } => {
                let s = &g.tensor(n.inputs[0]).shape;
                3.0 * 4.0 * (s[0] * s[1] * s[1] * s[2] / 3) as f64
            }
            _ => 0.0,
        })
        .sum()
}

/// The gpt2-small step, run before the kernel rows so that its peak resident set is its own
/// (the kernel rows' large operands would otherwise stay in the heap the step grows into);
/// the ratio to the GEMM rate is filled in once that is measured.
fn gpt2_small_step() -> Result<StepResult> {
    let (batch, seq) = (4, 256);
    let tokens: Vec<u32> = (0..200_000u64)
        .map(|i| ((i * 2_654_435_761) % 50257) as u32)
        .collect();
    let data: Arc<dyn Dataset> = Arc::new(TextCorpus::from_tokens(
        "random tokens".into(),
        tokens,
        Tokenizer::Gpt2,
        0,
    )?);
    let cfg = TrainConfig {
        steps: 4,
        batch_size: batch,
        seq_len: seq,
        ..TrainConfig::default()
    };
    let mut trainer = Trainer::new(
        CandleBackend::cpu(),
        ModelSpec::preset("gpt2-small")?,
        data,
        cfg,
    )?;
    trainer.train_step()?;
    let mut best_t = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        trainer.train_step()?;
        best_t = best_t.min(t.elapsed().as_secs_f64());
    }
    let flops = matmul_flops(trainer.graph());
    Ok(StepResult {
        batch,
        seq,
        step_s: best_t,
        matmul_gflop: flops / 1e9,
        matmul_time_at_gemm_rate_s: 0.0,
        ratio: 0.0,
        peak_rss_mb: peak_rss_bytes().unwrap_or(0) as f64 / 1e6,
    })
}

fn print_rows(title: &str, rows: &[Row]) {
    println!("\n{title}");
    println!(
        "{:<26} {:>24} {:>10} {:>9} {:>9}",
        "kernel", "shape", "GFLOP/s", "% peak", "ms"
    );
    for r in rows {
        println!(
            "{:<26} {:>24} {:>10.1} {:>8.1}% {:>9.2}",
            r.name, r.shape, r.gflops, r.pct_of_peak, r.ms
        );
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.netns {
        return crate::testbed_cmd::bench(a.json.as_deref());
    }
    if a.cluster {
        return crate::bench_cluster::run(a.cluster_steps, a.json.as_deref());
    }
    if a.soak {
        let soak = crate::bench_soak::SoakConfig {
            seed: a.soak_seed,
            minutes: a.soak_minutes,
            every_s: a.soak_every,
            steps: a.soak_steps,
            sharded: a.soak_snapshots == crate::cluster::SnapshotMode::Sharded,
        };
        return crate::bench_soak::run(&soak, a.json.as_deref());
    }
    if a.recovery {
        return crate::bench_recovery::run(a.recovery_steps, a.json.as_deref());
    }
    if a.fidelity {
        let subject = crate::bench_fidelity::Subject {
            model: &a.fidelity_model,
            data: &a.fidelity_data,
        };
        return crate::bench_fidelity::run(a.cluster_steps, &subject, a.json.as_deref());
    }
    if let Some(mode) = &a.adatopk {
        return crate::bench_adatopk::run(
            mode,
            a.adatopk_steps,
            a.topk_density,
            a.adatopk_eval_batches,
            &a.train_args,
            a.json.as_deref(),
        );
    }
    if a.simd {
        return crate::bench_simd::run(a.reps, a.json.as_deref());
    }
    if a.compress {
        return crate::bench_compress::run(a.reps.min(3), a.json.as_deref());
    }
    if a.planner_anneal {
        return crate::bench_anneal::run(a.anneal_seconds, &a.anneal_models, a.json.as_deref());
    }
    if a.planner {
        return crate::bench_planner::run(a.planner_cases, a.json.as_deref());
    }
    if a.dashboard {
        return crate::bench_dashboard::run(
            a.dashboard_pairs,
            a.dashboard_steps,
            a.json.as_deref(),
        );
    }
    if a.islands_planner {
        return crate::bench_islands::run(a.json.as_deref());
    }
    if a.transport {
        let r = crate::bench_transport::run()?;
        println!(
            "tensor transport on loopback ({} tensors of {} MB)",
            r.tensors,
            r.tensor_bytes >> 20
        );
        println!("{:<34} {:>10}", "path", "MB/s");
        println!(
            "{:<34} {:>10.0}",
            "plain TCP stream (raw bytes)", r.plain_tcp_mb_s
        );
        println!(
            "{:<34} {:>10.0}",
            "framed + validated, TCP", r.framed_tcp_mb_s
        );
        println!(
            "{:<34} {:>10.0}",
            "framed + validated, mutual TLS", r.framed_tls_mb_s
        );
        println!("TLS framed / plain TCP: {:.0}%", 100.0 * r.tls_vs_plain);
        println!(
            "small messages ({} B, TLS): {:.0} messages/s, {:.1} us each",
            r.small_message_bytes, r.small_messages_per_s, r.us_per_small_message
        );
        println!("\npaced loopback links (sender-side emulation, 2 s of data each)");
        println!(
            "{:>10} {:>11} {:>16} {:>8} {:>14}",
            "Mbit/s", "latency ms", "achieved Mbit/s", "ratio", "first byte ms"
        );
        for p in &r.pacing {
            println!(
                "{:>10.1} {:>11.1} {:>16.1} {:>7.1}% {:>14.2}",
                p.configured_mbps,
                p.configured_latency_ms,
                p.achieved_mbps,
                100.0 * p.rate_ratio,
                p.first_byte_ms
            );
        }
        if let Some(path) = &a.json {
            std::fs::write(path, serde_json::to_string_pretty(&r)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(());
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let (peak, isa) = peak_flops(threads);
    println!(
        "peak FMA rate: {:.1} GFLOP/s f32 on {threads} threads ({isa})",
        peak / 1e9
    );
    let mut step = (!a.no_step).then(gpt2_small_step).transpose()?;
    if let Some(s) = &step {
        println!(
            "gpt2-small training step (batch {} x {} tokens, before the kernel rows): {:.2} s; peak RSS {:.0} MB",
            s.batch, s.seq, s.step_s, s.peak_rss_mb
        );
    }
    let b = CandleBackend::cpu();
    let gemm = gemm_rows(&b, peak, a.reps)?;
    print_rows("GEMM (candle, f32)", &gemm);
    let operators = operator_rows(&b, peak, a.reps)?;
    print_rows(
        "Operators, forward + backward (gpt2-small shapes, batch 4 x 256)",
        &operators,
    );
    let gemm_rate = gemm.iter().map(|r| r.gflops).fold(0.0, f64::max) * 1e9;
    if let Some(s) = &mut step {
        s.matmul_time_at_gemm_rate_s = s.matmul_gflop * 1e9 / gemm_rate;
        s.ratio = s.step_s / s.matmul_time_at_gemm_rate_s;
        println!(
            "\ngpt2-small training step: matmul work {:.0} GFLOP = {:.2} s at the best GEMM rate; step {:.2} s, ratio {:.2}",
            s.matmul_gflop, s.matmul_time_at_gemm_rate_s, s.step_s, s.ratio
        );
    }
    let report = BenchReport {
        threads,
        isa,
        peak_gflops: peak / 1e9,
        gemm,
        operators,
        gpt2_small_step: step,
    };
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("results written to {}", path.display());
    }
    Ok(())
}
