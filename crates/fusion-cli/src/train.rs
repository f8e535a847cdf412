//! `fusionllm train`.

use crate::weights::{run_model, Init};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use fusion_backend::{Backend, CandleBackend, Precision, ReferenceBackend};
use fusion_data::{DataKind, Dataset};
use fusion_models::ModelSpec;
use fusion_train::{
    EvalRecord, IslandRecovery, IslandTrainer, OptimizerConfig, OptimizerPlacement, OuterConfig,
    Recompute, Report, ScheduleConfig, Shares, StepRecord, TrainConfig, Trainer,
};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Clone, Copy, ValueEnum)]
pub enum BackendChoice {
    /// candle-core tensors in f32 (CPU, or CUDA when built with the `cuda` feature)
    Candle,
    /// candle-core on CUDA device 0
    CandleCuda,
    /// plain-Rust f64 loops: slow, the numerical oracle
    Reference,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum RecomputeChoice {
    Auto,
    Off,
    On,
}

/// The format the candle backend computes in.
#[derive(Clone, Copy, Default, ValueEnum)]
pub enum PrecisionChoice {
    #[default]
    F32,
    /// bfloat16: f32's range with 8 significant bits
    Bf16,
    /// IEEE half: 11 significant bits, a narrow range (dynamic loss scaling)
    F16,
}

impl PrecisionChoice {
    pub fn precision(self) -> Precision {
        match self {
            PrecisionChoice::F32 => Precision::F32,
            PrecisionChoice::Bf16 => Precision::Bf16,
            PrecisionChoice::F16 => Precision::F16,
        }
    }
}

/// The candle backend on the CPU or CUDA device 0, computing in `precision`.
pub(crate) fn candle_backend(cuda: bool, precision: PrecisionChoice) -> Result<CandleBackend> {
    let b = if cuda {
        CandleBackend::cuda(0)?
    } else {
        CandleBackend::cpu()
    };
    Ok(b.with_precision(precision.precision())?)
}

/// Where a single-process run keeps its master weights and optimizer moments between steps.
#[derive(Clone, Copy, ValueEnum)]
pub enum OptimizerOnChoice {
    /// On the GPU when training on one, else in host memory.
    Auto,
    /// In host memory (offloaded: the GPU holds no moments between steps).
    Host,
    /// On the compute device.
    Device,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum OptimizerChoice {
    Adamw,
    Sgd,
}

#[derive(Args)]
pub struct TrainArgs {
    /// Model preset (default: gpt2-tiny for text, resnet-tiny for images).
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// `synthetic` (Markov text with known entropy), `synthetic-images`, a UTF-8 text file, or a
    /// directory of MNIST-style IDX files.
    #[arg(long, default_value = "synthetic")]
    pub(crate) data: String,
    /// Tokenizer for text files: gpt2 (BPE) or bytes.
    #[arg(long, default_value = "gpt2")]
    pub(crate) tokenizer: String,
    #[arg(long, default_value_t = 400)]
    pub(crate) steps: u64,
    /// Sequences or images per micro-batch (default: 16 in one process, 4 on a cluster).
    #[arg(long)]
    pub(crate) batch: Option<usize>,
    /// Tokens per sequence (default: 64, or what a model file's graph was built for).
    #[arg(long)]
    pub(crate) seq: Option<usize>,
    /// Micro-batches per optimizer step (default: 1 in one process, 4 on a cluster, so a step
    /// sees 16 sequences either way).
    #[arg(long)]
    pub(crate) micro_batches: Option<usize>,
    #[arg(long, value_enum, default_value = "adamw")]
    pub(crate) optimizer: OptimizerChoice,
    /// Peak learning rate (default: 1e-2 below 10M parameters, else 6e-4).
    #[arg(long)]
    pub(crate) lr: Option<f32>,
    /// Final learning rate of the cosine schedule (default lr / 10).
    #[arg(long)]
    pub(crate) min_lr: Option<f32>,
    #[arg(long, default_value_t = 20)]
    pub(crate) warmup: u64,
    #[arg(long, default_value_t = 0.1)]
    pub(crate) weight_decay: f32,
    /// Global gradient-norm clip (0 disables).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) clip: f32,
    #[arg(long, value_enum, default_value = "candle")]
    pub(crate) backend: BackendChoice,
    /// Run the model as this many pipeline stages in this process (an even split by operator
    /// count), passing activations and gradients across the cuts as machines will.
    #[arg(long, default_value_t = 1)]
    pub(crate) stages: usize,
    /// Activation recomputation: keep only segment boundaries and recompute the rest in
    /// backward. `auto`: the planner turns it on for stages that fit in memory only so (a
    /// single-process run stores activations); `on`: every stage; `off`: never.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) recompute: RecomputeChoice,
    /// Where a single-process run keeps the master weights and optimizer moments between
    /// steps: `auto` on the GPU when training on one (no weights cross to the host during
    /// training), else in host memory; `host` offloads them from a GPU (each step uploads the
    /// weights and downloads the gradients); `device` keeps them beside the compute.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) optimizer_on: OptimizerOnChoice,
    /// On a cluster, shard each stage's optimizer moments across its data-parallel replicas
    /// (ZeRO stage 1): each replica keeps and updates 1/R of them, and the replicas
    /// reduce-scatter the gradients and all-gather the updated parameters (the bytes of one
    /// all-reduce). Trains to the same results as unsharded replicas (bit for bit without
    /// clipping; the gradient norm is summed in another order). `auto` (default): each
    /// placement shards where memory binds (the plan would not fit, or would recompute,
    /// without it); `on`: always; `off`: never. `--shard-optimizer` alone is `on`.
    #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "on")]
    pub(crate) shard_optimizer: fusion_train::ShardOptimizer,
    /// Let f32 matrix products on the GPU use TF32 tensor cores (10-bit mantissa inputs, f32
    /// accumulation); only with --backend candle-cuda in one process.
    #[arg(long)]
    pub(crate) tf32: bool,
    /// Compute precision of the candle backend: bf16 or f16 keep activations and gradients in
    /// 16 bits (the residual stream, master weights and optimizer state stay f32; f16 scales the
    /// loss dynamically) and send them between a cluster's stages in that format.
    #[arg(long, value_enum, default_value = "f32")]
    pub(crate) precision: PrecisionChoice,
    /// Evaluate every N steps (0: only at the end).
    #[arg(long, default_value_t = 50)]
    pub(crate) eval_every: u64,
    /// Evaluation batches (default: the dataset's full evaluation).
    #[arg(long)]
    pub(crate) eval_batches: Option<usize>,
    /// Directory for checkpoints.
    #[arg(long)]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub(crate) checkpoint_every: u64,
    /// Resume from a checkpoint directory (its `latest`, or a `step-N` directory).
    #[arg(long)]
    pub(crate) resume: Option<PathBuf>,
    /// Start from these weights instead of random ones: a Hugging Face model directory
    /// (config.json and safetensors, GPT-2 or Llama family; it also gives the model) or a
    /// fusionllm checkpoint (its parameters; the optimizer starts afresh). Not with --resume,
    /// which continues a run from its own state.
    #[arg(long, conflicts_with = "resume")]
    pub(crate) init_from: Option<PathBuf>,
    /// Write a JSON report (loss curve, evaluations, throughput, peak memory).
    #[arg(long)]
    pub(crate) report: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) dashboard: crate::dashboard::DashboardArgs,
    #[arg(long, default_value_t = 1234)]
    pub(crate) seed: u64,
    /// Node processes of the local emulated cluster (1: train in this process).
    #[arg(long, default_value_t = 4)]
    pub(crate) nodes: usize,
    /// Testbed file placing the nodes at sites with emulated links (default: the built-in
    /// two-site testbed, testbeds/default.toml).
    #[arg(long)]
    pub(crate) testbed: Option<PathBuf>,
    /// Data-parallel replicas of every pipeline stage on a cluster (--nodes = stages x replicas);
    /// replicas of a stage sum their gradients with a ring all-reduce.
    #[arg(long, default_value_t = 1)]
    pub(crate) replicas: usize,
    /// Pipeline schedule on a cluster: 1f1b or gpipe.
    #[arg(long, default_value = "1f1b")]
    pub(crate) schedule: String,
    /// Backend of each node, comma-separated (default: --backend for all), e.g.
    /// candle,reference,candle,candle.
    #[arg(long)]
    pub(crate) node_backends: Option<String>,
    /// First operator of every stage after the first (default: the scheduler's plan).
    #[arg(long, value_delimiter = ',')]
    pub(crate) cuts: Option<Vec<usize>>,
    /// Who places stages on a cluster: opfence (measured node speed and testbed links), even
    /// (equal operator counts in node order), compute or dtfm.
    #[arg(long, default_value = "opfence")]
    pub(crate) scheduler: String,
    /// Compress activations and gradients on the links: none, fp16, bf16, int8[:block],
    /// topk:D, randomk:D or adatopk (each link's density from its bandwidth).
    #[arg(long, default_value = "none")]
    pub(crate) compress: String,
    /// Codec for activations only (overrides --compress downstream).
    #[arg(long)]
    pub(crate) compress_forward: Option<String>,
    /// Codec for gradients only (overrides --compress upstream).
    #[arg(long)]
    pub(crate) compress_backward: Option<String>,
    /// Steps sent dense before compression starts.
    #[arg(long, default_value_t = 0)]
    pub(crate) compress_warmup: u64,
    /// AdaTopK's floor: the smallest share of values a message keeps.
    #[arg(long, default_value_t = 0.5)]
    pub(crate) compress_floor: f64,
    /// Precision of sparse values: f32, f16, bf16 or i8 (a scale per 256 values).
    #[arg(long, default_value = "f16")]
    pub(crate) compress_values: String,
    /// AdaTopK: go straight to top-k on links that do not fit, instead of first trying an fp16
    /// cast and int8 quantisation.
    #[arg(long)]
    pub(crate) compress_no_quantize: bool,
    /// Send what compression leaves out of gradients with the next message of the same tensor
    /// (off by default: across micro-batches the residual belongs to other inputs).
    #[arg(long)]
    pub(crate) error_feedback: bool,
    /// Do not probe the links between nodes; plan with the testbed's figures.
    #[arg(long)]
    pub(crate) no_link_probe: bool,
    /// Re-probe the links the placement uses every this many steps (0: only at join).
    #[arg(long, default_value_t = 100)]
    pub(crate) probe_every: u64,
    /// Emulate the testbed faithfully (root): a network namespace per node, links shaped by tc
    /// and delayed by a userspace bridge, instead of pacing inside the nodes.
    #[arg(long)]
    pub(crate) faithful: bool,
    /// Keep the node processes' logs in this directory.
    #[arg(long)]
    pub(crate) logs: Option<PathBuf>,
    /// Where a cluster's snapshots (what a lost node rolls back to) are kept: `broker` streams
    /// the whole state to the broker's disk; `sharded` keeps each stage's state on its node's
    /// disk and a buddy node's, the broker writing only a manifest (checkpoints and the final
    /// state are gathered either way; islands always take gathered snapshots).
    #[arg(long, value_enum, default_value = "broker")]
    pub(crate) snapshots: crate::cluster::SnapshotMode,
    /// On a cluster, take a snapshot every this many steps (0: adaptive, so that snapshots take
    /// at most 5% of the training time).
    #[arg(long, default_value_t = 0)]
    pub(crate) snapshot_every: u64,
    /// Train this many islands, each its own copy of the model on its own share of the data,
    /// synchronised every --outer-every steps by an outer optimizer (DiLoCo-style). On a
    /// cluster each island is a pipeline of --nodes / N nodes (a site of the testbed where it
    /// has sites); in one process the islands take turns, with the same arithmetic.
    /// `auto` (on a cluster): one island per bandwidth cluster of the testbed (its sites).
    #[arg(long, default_value = "1", value_parser = parse_islands)]
    pub(crate) islands: Islands,
    /// Inner steps between the islands' synchronisations (H).
    #[arg(long, default_value_t = 50)]
    pub(crate) outer_every: u64,
    /// Outer learning rate (SGD on the averaged pseudo-gradients; 1 without momentum: plain
    /// averaging, which our runs found best; DiLoCo's setting is 0.7 with momentum 0.9).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) outer_lr: f32,
    /// Outer Nesterov momentum (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) outer_momentum: f32,
    /// How pseudo-gradients travel: none (dense f32), fp16, bf16, int8[:block] or topk:D (the
    /// largest fraction D, as SparseLoCo; each island's message travels whole around the ring);
    /// in one process also randomk:D. Lossy codecs carry their error into the next round.
    #[arg(long, default_value = "none")]
    pub(crate) outer_codec: String,
    /// How islands split each step's micro-batches: `auto` (on a cluster: in proportion to
    /// each island's measured speed, re-balanced at synchronisations; equal in one process),
    /// `equal`, or counts such as `6,2` adding up to islands × --micro-batches. The outer step
    /// weighs each island by its share.
    #[arg(long, default_value = "auto", value_parser = parse_shares)]
    pub(crate) island_shares: Shares,
    /// What a node lost mid-round costs on a cluster: `local` (only its island is taken out
    /// until the next synchronisation; the others go on, keeping their state) or `rollback`
    /// (every island goes back to the last snapshot, reproducible bit for bit with equal or
    /// fixed shares and no momentum).
    #[arg(long, default_value = "local", value_parser = parse_recovery)]
    pub(crate) island_recovery: IslandRecovery,
    /// Overlap each synchronisation's exchange with the next --outer-every inner steps: its
    /// average is applied one round late and every island keeps the progress it made
    /// meanwhile, so no island waits for the slow links unless the exchange outlasts a round.
    /// Synchronisations before an evaluation, a snapshot and the last step still block. On a
    /// cluster a lost node takes only its island out (with --island-recovery local): the
    /// islands left drop the exchange under way and their next synchronisation carries its
    /// round.
    #[arg(long)]
    pub(crate) outer_overlap: bool,
    /// Streaming synchronisation (as Streaming DiLoCo): cut the model into this many fragments,
    /// contiguous bands of layers of about equal size, and synchronise one every
    /// --outer-every / F inner steps in turn, so each is still synchronised every --outer-every
    /// steps while an exchange carries 1 / F of the model (with --outer-overlap, 1 / F of the
    /// model is held for the exchange too). Must divide --outer-every. Synchronisations before
    /// an evaluation, a snapshot and the last step take every fragment.
    #[arg(long, default_value_t = 1)]
    pub(crate) outer_fragments: u32,
}

fn parse_recovery(s: &str) -> std::result::Result<IslandRecovery, String> {
    s.parse()
        .map_err(|e: fusion_train::TrainError| e.to_string())
}

fn parse_shares(s: &str) -> std::result::Result<Shares, String> {
    s.parse()
        .map_err(|e: fusion_train::TrainError| e.to_string())
}

/// `--islands`: a count, or one per bandwidth cluster of a cluster's testbed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Islands {
    Count(usize),
    Auto,
}

fn parse_islands(s: &str) -> std::result::Result<Islands, String> {
    match s {
        "auto" => Ok(Islands::Auto),
        n => match n.parse::<usize>() {
            Ok(k) if k >= 1 => Ok(Islands::Count(k)),
            _ => Err(format!(
                "`auto` or a number of islands (at least 1), not '{n}'"
            )),
        },
    }
}

impl TrainArgs {
    /// Whether the run has islands (more than one, or as many as the testbed has clusters).
    pub(crate) fn wants_islands(&self) -> bool {
        self.islands != Islands::Count(1)
    }
}

/// The outer synchronisation the command line asks for.
fn outer_config(a: &TrainArgs) -> Result<OuterConfig> {
    let codec = fusion_compress::Codec::parse(&a.outer_codec)
        .map_err(|e| anyhow::anyhow!("--outer-codec: {e}"))?;
    let cfg = OuterConfig {
        every: a.outer_every,
        lr: a.outer_lr,
        momentum: a.outer_momentum,
        nesterov: true,
        codec,
        shares: a.island_shares.clone(),
        recovery: a.island_recovery,
        overlap: a.outer_overlap,
        fragments: a.outer_fragments,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The run's settings; a model file's graph gives the default micro-batch and sequence length.
fn config(a: &TrainArgs, lr: f32, model: &ModelSpec) -> TrainConfig {
    let cluster = a.nodes > 1;
    let fixed = model.fixed_shape();
    TrainConfig {
        steps: a.steps,
        batch_size: a
            .batch
            .or(fixed.map(|f| f.0))
            .unwrap_or(if cluster { 4 } else { 16 }),
        seq_len: a.seq.or(fixed.map(|f| f.1)).unwrap_or(64),
        micro_batches: a.micro_batches.unwrap_or(if cluster { 4 } else { 1 }),
        optimizer: match a.optimizer {
            OptimizerChoice::Adamw => OptimizerConfig::AdamW {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: a.weight_decay,
            },
            OptimizerChoice::Sgd => OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: a.weight_decay,
            },
        },
        schedule: ScheduleConfig {
            lr,
            min_lr: a.min_lr.unwrap_or(lr / 10.0),
            warmup_steps: a.warmup,
        },
        clip_norm: (a.clip > 0.0).then_some(a.clip),
        eval_every: a.eval_every,
        eval_batches: a.eval_batches,
        checkpoint_every: a.checkpoint_every,
        checkpoint_dir: a.checkpoint_dir.clone().or_else(|| a.resume.clone()),
        seed: a.seed,
        pipeline_stages: a.stages,
        recompute: match a.recompute {
            RecomputeChoice::Auto => Recompute::Auto,
            RecomputeChoice::Off => Recompute::Off,
            RecomputeChoice::On => Recompute::On,
        },
        outer: None,
        optimizer_on: match a.optimizer_on {
            OptimizerOnChoice::Auto => OptimizerPlacement::Auto,
            OptimizerOnChoice::Host => OptimizerPlacement::Host,
            OptimizerOnChoice::Device => OptimizerPlacement::Device,
        },
        shard_optimizer: a.shard_optimizer,
    }
}

/// The peak learning rate: the user's, or the default policy's for the model's size.
fn default_lr(a: &TrainArgs, model: &ModelSpec) -> f32 {
    a.lr.unwrap_or(fusion_train::default_peak_lr(model.parameters()))
}

fn train_with<B: Backend>(
    backend: B,
    a: &TrainArgs,
    model: ModelSpec,
    data: Arc<dyn Dataset>,
    init: Option<Init>,
) -> Result<Report> {
    let lr = default_lr(a, &model);
    let cfg = config(a, lr, &model);
    let source = init.as_ref().map(Init::source);
    let mut trainer = Trainer::with_weights(backend, model, data.clone(), cfg, source.as_deref())?;
    if let Some(source) = &source {
        eprintln!("initial weights from {}", source.describe());
    }
    if let Some(dir) = &a.resume {
        trainer
            .load_checkpoint(dir)
            .with_context(|| format!("resuming from {}", dir.display()))?;
        eprintln!("resumed from {} at step {}", dir.display(), trainer.step());
    }
    eprintln!(
        "training {} ({} parameters) on {} with the {} backend",
        trainer.graph().name,
        trainer.graph().num_trainable(),
        data.describe(),
        trainer.backend_name()
    );
    let bar = progress_bar(a.steps);
    bar.set_position(trainer.step());
    let unit = match data.kind() {
        DataKind::Text { .. } => "tok/s",
        DataKind::Images { .. } => "img/s",
    };
    let report = if let Islands::Count(n @ 2..) = a.islands {
        let outer = outer_config(a)?;
        eprintln!(
            "{n} islands, synchronised every {} steps (outer lr {}, momentum {}, pseudo-gradients \
             {}, shares {})",
            outer.every, outer.lr, outer.momentum, outer.codec, outer.shares
        );
        let mut islands = IslandTrainer::new(trainer, n, outer)?;
        islands.run(show_progress(&bar, a.steps, unit))?
    } else {
        trainer.run(show_progress(&bar, a.steps, unit))?
    };
    bar.finish();
    Ok(report)
}

/// Shows each step on the bar (or, without a terminal, as about 20 lines per run) and each
/// evaluation as a line.
fn show_progress<'a>(
    bar: &'a ProgressBar,
    steps: u64,
    unit: &'a str,
) -> impl FnMut(&StepRecord, Option<&EvalRecord>) + 'a {
    let every = (steps / 20).max(1);
    move |s, eval| {
        bar.set_position(s.step);
        let status = format!(
            "loss {:.4} lr {:.2e} |g| {:.2} {:.0} {unit}",
            s.loss, s.lr, s.grad_norm, s.throughput
        );
        if bar.is_hidden() && (s.step.is_multiple_of(every) || eval.is_some()) {
            eprintln!("step {:>6}/{steps}: {status}", s.step);
        }
        bar.set_message(status);
        if let Some(e) = eval {
            let line = format!(
                "step {:>6}: eval loss {:.4}, accuracy {:.2}%",
                e.step,
                e.loss,
                100.0 * e.accuracy
            );
            if bar.is_hidden() {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
        }
    }
}

/// A step progress bar (hidden without a terminal; callers then log lines instead).
pub fn progress_bar(steps: u64) -> ProgressBar {
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// The last evaluation, and how far it is from the data's entropy floor or unigram entropy.
pub fn print_final_eval(r: &Report) {
    let Some(e) = r.evals.last() else { return };
    println!(
        "final eval loss {:.4}, accuracy {:.2}%",
        e.loss,
        100.0 * e.accuracy
    );
    if let Some(h) = r.entropy_floor {
        println!(
            "entropy floor {h:.4} nats: eval loss is {:.1}% above it",
            100.0 * (e.loss as f64 / h - 1.0)
        );
    }
    if let Some(h) = r.unigram_entropy {
        println!(
            "unigram entropy {h:.4} nats: eval loss is {:.1}% of it",
            100.0 * e.loss as f64 / h
        );
    }
}

pub fn run(a: TrainArgs) -> Result<()> {
    let data = fusion_runtime::open_dataset(&a.data, &a.tokenizer, a.seed)?;
    let init = a.init_from.as_deref().map(Init::open).transpose()?;
    let model = run_model(a.model.as_deref(), init.as_ref(), data.as_ref(), None)?;
    if a.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    if a.nodes == 1 && a.wants_islands() && a.resume.is_some() {
        bail!(
            "--islands with --nodes 1 (islands in one process, for convergence studies) does not \
             resume; an islands run on a cluster (--nodes 2 or more) does"
        );
    }
    if a.nodes == 1 && a.dashboard.dashboard.is_some() {
        bail!(
            "--dashboard is served by the broker of a cluster run; --nodes 1 trains in this \
             process (watch it with --report and `fusionllm report RUN.json --html OUT.html`)"
        );
    }
    if a.nodes == 1 && a.islands == Islands::Auto {
        bail!("--islands auto groups a cluster's nodes by its testbed's clusters: in one process give a number");
    }
    if a.tf32 && (a.nodes > 1 || !matches!(a.backend, BackendChoice::CandleCuda)) {
        bail!("--tf32 is for one process on a GPU: give --backend candle-cuda and --nodes 1");
    }
    check_precision(&a)?;
    if !matches!(a.optimizer_on, OptimizerOnChoice::Auto) && a.nodes > 1 {
        bail!("--optimizer-on is for one process (--nodes 1): a cluster's nodes keep their optimizer state in host memory");
    }
    if matches!(a.optimizer_on, OptimizerOnChoice::Device) && a.wants_islands() {
        bail!("--optimizer-on device: islands in one process exchange their states through host memory");
    }
    if a.shard_optimizer.is_on() && (a.nodes == 1 || a.wants_islands() || a.replicas == 1) {
        bail!(
            "--shard-optimizer shards the optimizer state across a cluster's data-parallel \
             replicas (--nodes N --replicas R, R >= 2); islands keep their own moments"
        );
    }
    if a.shard_optimizer.is_on() && matches!(a.snapshots, crate::cluster::SnapshotMode::Sharded) {
        bail!(
            "--shard-optimizer takes gathered snapshots (each replica sends its piece of the \
             moments); a node's shard file holds whole moments: not with --snapshots sharded"
        );
    }
    if a.nodes > 1 {
        if a.wants_islands() && a.replicas != 1 {
            bail!("--islands makes each island a pipeline replica of its own: not with --replicas");
        }
        if let Islands::Count(n @ 2..) = a.islands {
            if !a.nodes.is_multiple_of(n) {
                bail!(
                    "--islands {n}: --nodes ({}) must be a multiple of it",
                    a.nodes
                );
            }
        }
        if a.stages != 1 {
            bail!("--stages splits a model inside one process; with --nodes the cluster's nodes are the stages");
        }
        let mut cfg = config(&a, default_lr(&a, &model), &model);
        if a.wants_islands() {
            let outer = outer_config(&a)?;
            if matches!(outer.codec, fusion_compress::Codec::RandomK { .. }) {
                bail!(
                    "--outer-codec {}: islands on a cluster send pseudo-gradients as none, fp16, \
                     bf16, int8 or topk:D",
                    a.outer_codec
                );
            }
            cfg.outer = Some(outer);
        }
        cfg.validate()?;
        return crate::cluster::launch_local(&a, cfg, model, data, init);
    }
    let report = match a.backend {
        BackendChoice::Candle => {
            let b = candle_backend(false, a.precision)?;
            train_with(b, &a, model, data, init)?
        }
        BackendChoice::CandleCuda => {
            let b = candle_backend(true, a.precision)?;
            let b = if a.tf32 { b.with_tf32()? } else { b };
            train_with(b, &a, model, data, init)?
        }
        BackendChoice::Reference => train_with(ReferenceBackend, &a, model, data, init)?,
    };
    println!(
        "done: {} steps in {:.1}s, {:.0} {}, peak memory {:.0} MB",
        report.steps.len(),
        report.wall_s,
        report.throughput,
        report.throughput_unit,
        report.peak_rss_bytes.unwrap_or(0) as f64 / 1e6
    );
    print_final_eval(&report);
    if let Some(path) = &a.report {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("report written to {}", path.display());
    }
    Ok(())
}

/// Refuses precisions the chosen backend or job cannot compute in.
fn check_precision(a: &TrainArgs) -> Result<()> {
    let p = a.precision.precision();
    if !p.is_half() {
        return Ok(());
    }
    if matches!(a.backend, BackendChoice::Reference) {
        bail!("--precision {}: the reference backend computes in f64; give --backend candle or candle-cuda", p.as_str());
    }
    if a.tf32 {
        bail!(
            "--tf32 is a mode of f32 matrix products: not with --precision {}",
            p.as_str()
        );
    }
    Ok(())
}

/// The link codec for `--compress none` under a compute precision: activations and gradients
/// of a 16-bit run are 16-bit values, which f32 would only pad.
fn dense_codec(a: &TrainArgs) -> &str {
    match (a.compress.as_str(), a.precision) {
        ("none" | "dense", PrecisionChoice::Bf16) => "bf16",
        ("none" | "dense", PrecisionChoice::F16) => "fp16",
        (other, _) => other,
    }
}

/// The compression settings the command line asks for.
pub fn compression(a: &TrainArgs) -> Result<fusion_compress::CompressionConfig> {
    use fusion_compress::{Codec, ValueType};
    let codec = |s: &str| Codec::parse(s).map_err(|e| anyhow::anyhow!("--compress: {e}"));
    let both = codec(dense_codec(a))?;
    let cfg = fusion_compress::CompressionConfig {
        forward: match &a.compress_forward {
            Some(s) => codec(s)?,
            None => both,
        },
        backward: match &a.compress_backward {
            Some(s) => codec(s)?,
            None => both,
        },
        error_feedback: a.error_feedback,
        warmup_steps: a.compress_warmup,
        values: ValueType::parse(&a.compress_values)
            .map_err(|e| anyhow::anyhow!("--compress-values: {e}"))?,
        floor: a.compress_floor,
        quantize: !a.compress_no_quantize,
        ..Default::default()
    };
    cfg.validate()
        .map_err(|e| anyhow::anyhow!("compression: {e}"))?;
    Ok(cfg)
}
