use crate::error::{Result, TrainError};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum OptimizerConfig {
    /// Adam with decoupled weight decay (applied to matrices, not to biases and norm gains).
    AdamW {
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    },
    /// SGD with (heavy-ball) momentum and L2 weight decay on matrices.
    Sgd { momentum: f32, weight_decay: f32 },
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// Linear warm-up to `lr`, then cosine decay to `min_lr` at the last step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ScheduleConfig {
    pub lr: f32,
    pub min_lr: f32,
    pub warmup_steps: u64,
}

/// The peak learning rate a run uses when its user gives none: 1e-2 for models under 10M
/// trainable parameters (the tiny presets, which a lower rate trains far more slowly), else 6e-4
/// (GPT-2 small's published rate). One policy for the single-process trainer, the local
/// launcher and job files.
pub fn default_peak_lr(trainable_params: usize) -> f32 {
    if trainable_params < 10_000_000 {
        1e-2
    } else {
        6e-4
    }
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 20,
        }
    }
}

/// Activation recomputation: keep only the values that cross into each segment of a stage's
/// operators and recompute the rest in backward (bit-identical gradients, one more forward).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    /// The planner turns it on for the stages that fit in memory only so; a single-process run
    /// stores its activations.
    #[default]
    Auto,
    /// Never: a stage that does not fit with its activations is not planned.
    Off,
    /// Every stage, and the single-process trainer.
    On,
}

impl Recompute {
    /// Segments for a graph of `nodes` operators when this policy recomputes it
    /// unconditionally (`On`), else None.
    pub fn forced_segments(self, nodes: usize) -> Option<usize> {
        (self == Recompute::On).then(|| fusion_exec::default_segments(nodes))
    }
}

/// Where the single-process trainer keeps the master weights and optimizer moments between
/// steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerPlacement {
    /// On the compute device where tensors live off the host (a GPU), else in host memory
    /// (the CPU, and `f64` backends, whose runs round the master state to `f32` every step).
    #[default]
    Auto,
    /// In host memory: each step uploads the weights and downloads the gradients, and the update
    /// runs on the host's cores (offloading: the device holds no moments between steps).
    Host,
    /// On the compute device: weights, gradients and moments stay there while training.
    Device,
}

impl OptimizerPlacement {
    /// Whether the state lives on the device, for a backend whose tensors do or do not live in
    /// host memory.
    pub fn on_device(self, in_host_memory: bool) -> bool {
        match self {
            OptimizerPlacement::Auto => !in_host_memory,
            OptimizerPlacement::Host => false,
            OptimizerPlacement::Device => true,
        }
    }
}

/// Whether the data-parallel replicas of a stage shard its optimizer moments (ZeRO stage 1).
/// On the wire `On` and `Off` are `true` and `false` (what a node does, as before this became a
/// choice); `Auto` is `"auto"` and is resolved by the broker at every placement, so a node never
/// receives it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShardOptimizer {
    /// Every replica keeps whole moments.
    #[default]
    Off,
    /// Each replica keeps and updates the moments of its ring chunk.
    On,
    /// The placement shards where memory binds: when the plan would not fit without sharding,
    /// or would have to recompute activations that sharding leaves room to store.
    Auto,
}

impl ShardOptimizer {
    /// Whether the replicas shard (`Auto` has not been resolved to that).
    pub fn is_on(self) -> bool {
        self == ShardOptimizer::On
    }
}

impl std::str::FromStr for ShardOptimizer {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "off" | "false" => Ok(ShardOptimizer::Off),
            "on" | "true" => Ok(ShardOptimizer::On),
            "auto" => Ok(ShardOptimizer::Auto),
            other => Err(TrainError::Config(format!(
                "shard_optimizer is off, on or auto, not '{other}'"
            ))),
        }
    }
}

impl std::fmt::Display for ShardOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShardOptimizer::Off => "off",
            ShardOptimizer::On => "on",
            ShardOptimizer::Auto => "auto",
        })
    }
}

impl Serialize for ShardOptimizer {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            ShardOptimizer::Off => s.serialize_bool(false),
            ShardOptimizer::On => s.serialize_bool(true),
            ShardOptimizer::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for ShardOptimizer {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Given {
            Flag(bool),
            Name(String),
        }
        match Given::deserialize(d)? {
            Given::Flag(true) => Ok(ShardOptimizer::On),
            Given::Flag(false) => Ok(ShardOptimizer::Off),
            Given::Name(n) => n.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainConfig {
    pub steps: u64,
    /// Sequences (or images) per micro-batch.
    pub batch_size: usize,
    /// Tokens per sequence (language models).
    pub seq_len: usize,
    /// Micro-batches whose gradients are summed into one optimizer step.
    pub micro_batches: usize,
    pub optimizer: OptimizerConfig,
    pub schedule: ScheduleConfig,
    /// Global gradient-norm clipping threshold.
    pub clip_norm: Option<f32>,
    /// Evaluate every this many steps (and at the end); 0 = only at the end.
    pub eval_every: u64,
    /// Cap on evaluation batches (None = the dataset's full evaluation).
    pub eval_batches: Option<usize>,
    /// Write a checkpoint every this many steps (0 = only at the end) when `checkpoint_dir` is set.
    pub checkpoint_every: u64,
    pub checkpoint_dir: Option<PathBuf>,
    pub seed: u64,
    /// Run forward and backward as this many pipeline stages in this process (an even split by
    /// operator count), moving boundary tensors as the distributed runtime does. 1 = whole graph.
    #[serde(default = "one")]
    pub pipeline_stages: usize,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// On a cluster: each data-parallel replica is an island that applies its own gradients and
    /// synchronises with the others through this outer optimizer (None: replicas all-reduce
    /// their gradients every step).
    pub outer: Option<crate::OuterConfig>,
    /// Where the master weights and optimizer moments live between steps.
    pub optimizer_on: OptimizerPlacement,
    /// On a cluster: the data-parallel replicas of a stage shard its optimizer moments (ZeRO
    /// stage 1): each keeps and updates 1/R of them, gradients are reduce-scattered and the
    /// updated parameters all-gathered (the same bytes on the ring as an all-reduce).
    pub shard_optimizer: ShardOptimizer,
}

fn one() -> usize {
    1
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 300,
            batch_size: 16,
            seq_len: 64,
            micro_batches: 1,
            optimizer: OptimizerConfig::default(),
            schedule: ScheduleConfig::default(),
            clip_norm: Some(1.0),
            eval_every: 0,
            eval_batches: None,
            checkpoint_every: 0,
            checkpoint_dir: None,
            seed: 1234,
            pipeline_stages: 1,
            recompute: Recompute::Auto,
            outer: None,
            optimizer_on: OptimizerPlacement::Auto,
            shard_optimizer: ShardOptimizer::Off,
        }
    }
}

impl TrainConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(TrainError::Config(m.to_string()));
        if self.pipeline_stages == 0 {
            return bad("pipeline stages must be at least 1");
        }
        if self.batch_size == 0 || self.micro_batches == 0 {
            return bad("batch size and micro-batches must be at least 1");
        }
        if !(self.schedule.lr.is_finite() && self.schedule.lr > 0.0 && self.schedule.min_lr >= 0.0)
        {
            return bad("learning rate must be positive and finite");
        }
        if let Some(c) = self.clip_norm {
            if !(c.is_finite() && c > 0.0) {
                return bad("clip norm must be positive");
            }
        }
        if let Some(outer) = &self.outer {
            outer.validate()?;
            if self.shard_optimizer.is_on() {
                return bad(
                    "sharded optimizer state applies to replicas that all-reduce their gradients; \
                     islands keep their own moments",
                );
            }
        }
        match &self.optimizer {
            OptimizerConfig::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                if !(0.0..1.0).contains(beta1)
                    || !(0.0..1.0).contains(beta2)
                    || *eps <= 0.0
                    || *weight_decay < 0.0
                {
                    return bad("AdamW needs 0 <= beta < 1, eps > 0, weight decay >= 0");
                }
            }
            OptimizerConfig::Sgd {
                momentum,
                weight_decay,
            } => {
                if !(0.0..1.0).contains(momentum) || *weight_decay < 0.0 {
                    return bad("SGD needs 0 <= momentum < 1 and weight decay >= 0");
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_optimizer_reads_flags_and_names_and_writes_what_a_node_reads() {
        let read = |json: &str| serde_json::from_str::<ShardOptimizer>(json);
        assert_eq!(read("true").expect("flag"), ShardOptimizer::On);
        assert_eq!(read("false").expect("flag"), ShardOptimizer::Off);
        assert_eq!(read("\"auto\"").expect("name"), ShardOptimizer::Auto);
        assert_eq!(read("\"on\"").expect("name"), ShardOptimizer::On);
        let bad = read("\"sometimes\"").expect_err("unknown name");
        assert!(bad.to_string().contains("off, on or auto"), "{bad}");
        assert!(read("3").is_err());
        // On and off travel as the booleans nodes (and the Python node) read.
        let write = |s: ShardOptimizer| serde_json::to_string(&s).expect("json");
        assert_eq!(write(ShardOptimizer::On), "true");
        assert_eq!(write(ShardOptimizer::Off), "false");
        assert_eq!(write(ShardOptimizer::Auto), "\"auto\"");
        // A configuration without the field does not shard.
        let cfg: TrainConfig = serde_json::from_str("{}").expect("config");
        assert_eq!(cfg.shard_optimizer, ShardOptimizer::Off);
    }
}
