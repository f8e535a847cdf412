use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    pub loss: f32,
    pub lr: f32,
    pub grad_norm: f32,
    /// Seconds since the run started.
    pub elapsed_s: f64,
    /// Tokens (language models) or samples (image models) per second over this step.
    pub throughput: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EvalRecord {
    pub step: u64,
    pub loss: f32,
    /// Classification accuracy (image models) or next-token accuracy (language models).
    pub accuracy: f32,
}

/// What a run writes with `--report`.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub model: String,
    pub backend: String,
    pub data: String,
    pub params: usize,
    pub config: crate::TrainConfig,
    pub start_step: u64,
    pub steps: Vec<StepRecord>,
    pub evals: Vec<EvalRecord>,
    /// Mean throughput over the run, in tokens or samples per second.
    pub throughput: f64,
    pub throughput_unit: &'static str,
    pub wall_s: f64,
    pub peak_rss_bytes: Option<u64>,
    pub entropy_floor: Option<f64>,
    pub unigram_entropy: Option<f64>,
    /// Islands synchronised by an outer optimizer (None: one synchronous model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outer: Option<OuterReport>,
    /// Where an f16 run's loss scale ended, and how many steps it skipped for overflow.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<crate::LossScaler>,
}

/// How a run of islands synchronised.
#[derive(Clone, Debug, Serialize)]
pub struct OuterReport {
    pub islands: usize,
    pub config: crate::OuterConfig,
    /// Outer steps taken.
    pub syncs: u64,
    /// Synchronisations whose exchange overlapped the next round ([`crate::OuterConfig::overlap`]).
    pub overlapped: u64,
    /// Synchronisations that took one fragment of the parameters
    /// ([`crate::OuterConfig::fragments`]).
    #[serde(default)]
    pub partial: u64,
    /// Bytes of pseudo-gradient messages the islands encoded, in all, and what dense f32 would
    /// have been.
    pub sent_bytes: u64,
    pub dense_bytes: u64,
    /// Micro-batches each island ran per inner step at the end (they add up to islands ×
    /// micro-batches).
    pub shares: Vec<usize>,
    /// On a cluster: when and why the shares changed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rebalances: Vec<String>,
    /// On a cluster: synchronisations after which the islands did not hold the same bits.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub disagreements: Vec<String>,
}

/// Peak resident memory of this process (VmHWM), where the OS reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
