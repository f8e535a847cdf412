//! The plan file: what `fusionllm plan` writes and `fusionllm simulate` and the broker read.
//! It names devices rather than indices and embeds the testbed, so it stands on its own.

use crate::error::PlanError;
use crate::plan::{Evaluation, Plan, Problem};
use fusion_testbed::Testbed;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const PLAN_FORMAT: &str = "fusionllm-plan";
pub const PLAN_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanStage {
    pub first_op: usize,
    pub first_op_name: String,
    pub last_op_name: String,
    /// The device of each data-parallel replica.
    pub devices: Vec<String>,
    /// Forward plus backward milliseconds per micro-batch on the slowest replica.
    pub compute_ms: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prediction {
    /// The cost model's step time.
    pub step_ms: f64,
    /// The discrete-event simulator's step time.
    pub simulated_step_ms: f64,
    pub bottleneck: String,
    /// Micro-batches per second over all replicas.
    pub micro_batches_per_s: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    pub format: String,
    pub version: u32,
    pub scheduler: String,
    pub model: String,
    /// Sequences (or images) per micro-batch, and tokens per sequence (0 for images).
    pub batch: usize,
    pub seq: usize,
    pub micro_batches: usize,
    /// "gpipe" or "1f1b".
    pub schedule: String,
    pub replicas: usize,
    pub stages: Vec<PlanStage>,
    pub prediction: Prediction,
    pub explanation: Vec<String>,
    pub testbed: Testbed,
    /// The replicas shard their optimizer state (`train --shard-optimizer on`); absent in
    /// files written before sharding was planned.
    #[serde(default)]
    pub shard_optimizer: bool,
}

impl PlanFile {
    /// Describes `plan` of `p` (whose devices are `testbed`'s, in order).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        p: &Problem,
        plan: &Plan,
        e: &Evaluation,
        simulated_step_s: f64,
        scheduler: &str,
        model: &str,
        batch: usize,
        seq: usize,
        schedule: &str,
        testbed: &Testbed,
    ) -> Self {
        let n = p.ops();
        let w = p.workload;
        let stages = (0..plan.stages())
            .map(|s| {
                let r = plan.range(s, n);
                PlanStage {
                    first_op: r.start,
                    first_op_name: w.ops[r.start].name.clone(),
                    last_op_name: w.ops[r.end - 1].name.clone(),
                    devices: plan.devices[s]
                        .iter()
                        .map(|&d| testbed.devices[d].name.clone())
                        .collect(),
                    compute_ms: e.stage_s[s] * 1e3,
                }
            })
            .collect();
        PlanFile {
            format: PLAN_FORMAT.into(),
            version: PLAN_VERSION,
            scheduler: scheduler.into(),
            model: model.into(),
            batch,
            seq,
            micro_batches: p.micro_batches,
            schedule: schedule.into(),
            replicas: plan.replicas(),
            stages,
            prediction: Prediction {
                step_ms: e.step_s * 1e3,
                simulated_step_ms: simulated_step_s * 1e3,
                bottleneck: format!("{:?}", e.bottleneck),
                micro_batches_per_s: (p.micro_batches * plan.replicas()) as f64
                    / simulated_step_s.max(1e-12),
            },
            explanation: crate::explain(p, plan, e),
            testbed: testbed.clone(),
            shard_optimizer: p.shard_optimizer && plan.replicas() > 1,
        }
    }

    pub fn from_file(path: &Path) -> Result<Self, PlanError> {
        let bad = |m: String| PlanError::Invalid(format!("plan file {}: {m}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let f: PlanFile = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if f.format != PLAN_FORMAT || f.version != PLAN_VERSION {
            return Err(bad(format!(
                "format '{}' version {} (expected '{PLAN_FORMAT}' version {PLAN_VERSION})",
                f.format, f.version
            )));
        }
        f.testbed.validate()?;
        Ok(f)
    }

    /// The plan with device names resolved to the testbed's device indices.
    pub fn plan(&self) -> Result<Plan, PlanError> {
        let index = |name: &str| {
            self.testbed
                .devices
                .iter()
                .position(|d| d.name == name)
                .ok_or_else(|| {
                    PlanError::Invalid(format!(
                        "the plan names device '{name}', which its testbed does not have"
                    ))
                })
        };
        Ok(Plan {
            starts: self.stages.iter().map(|s| s.first_op).collect(),
            devices: self
                .stages
                .iter()
                .map(|s| s.devices.iter().map(|d| index(d)).collect())
                .collect::<Result<_, _>>()?,
        })
    }

    /// First operator of every stage after the first (what the broker's `cuts` take).
    pub fn cuts(&self) -> Vec<usize> {
        self.stages.iter().skip(1).map(|s| s.first_op).collect()
    }
}
