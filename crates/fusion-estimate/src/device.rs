//! How fast a device runs operators: a calibrated roofline. Dense operators (matrix products,
//! convolutions, attention) take `flops / dense_flops_per_s`; the others take
//! `bytes / memory_bytes_per_s`; the sum is scaled by `calibration`, the ratio of a measured
//! whole-graph run to this model's prediction (1 for a device class nobody has measured).

use crate::error::EstimateError;
use crate::workload::{OpKind, OpWorkload, Workload};
use fusion_testbed::DeviceClass;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::Path;

/// Share of a GPU's published FP16 tensor-core peak that mixed-precision training sustains on
/// the dense operators (model FLOPs utilisation of 30 to 50% is typical for GPT-2-sized models).
pub const GPU_DENSE_EFFICIENCY: f64 = 0.4;
/// Share of the published memory bandwidth element-wise kernels reach.
pub const GPU_MEMORY_EFFICIENCY: f64 = 0.7;
/// Bytes an f32 Adam update moves per parameter: reads value, gradient and two moments, writes
/// value and moments.
pub const ADAM_UPDATE_BYTES_PER_PARAM: f64 = 28.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProfileSource {
    /// Published figures of a device class.
    Class,
    /// A profiling run on the device itself.
    Measured,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceProfile {
    pub name: String,
    pub class: String,
    pub dense_flops_per_s: f64,
    pub memory_bytes_per_s: f64,
    pub memory_capacity_bytes: f64,
    pub calibration: f64,
    pub source: ProfileSource,
}

impl DeviceProfile {
    /// A device of a published class. CPUs are taken at their measured FP32 peak.
    pub fn from_class(name: &str, c: &DeviceClass) -> Self {
        let (dense, mem) = if c.kind == "gpu" {
            (
                c.fp16_tflops * 1e12 * GPU_DENSE_EFFICIENCY,
                c.memory_bandwidth_gbs * 1e9 * GPU_MEMORY_EFFICIENCY,
            )
        } else {
            (c.fp32_tflops * 1e12, c.memory_bandwidth_gbs * 1e9)
        };
        DeviceProfile {
            name: name.into(),
            class: c.name.clone(),
            dense_flops_per_s: dense,
            memory_bytes_per_s: mem,
            memory_capacity_bytes: c.memory_bytes(),
            calibration: 1.0,
            source: ProfileSource::Class,
        }
    }

    pub fn validate(&self) -> Result<(), EstimateError> {
        let figures = [
            self.dense_flops_per_s,
            self.memory_bytes_per_s,
            self.memory_capacity_bytes,
            self.calibration,
        ];
        if figures.iter().all(|v| v.is_finite() && *v > 0.0) {
            Ok(())
        } else {
            Err(EstimateError::InvalidProfile {
                name: self.name.clone(),
                message: format!(
                    "speeds, memory and calibration must be positive, got {figures:?}"
                ),
            })
        }
    }

    pub fn from_file(path: &Path) -> Result<Self, EstimateError> {
        let bad = |message: String| EstimateError::ProfileFile {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let p: DeviceProfile = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        p.validate()?;
        Ok(p)
    }

    /// Uncalibrated forward and backward seconds of one operator.
    fn roofline(&self, op: &OpWorkload) -> (f64, f64) {
        match op.kind {
            OpKind::Dense => (
                op.fwd_flops / self.dense_flops_per_s,
                op.bwd_flops / self.dense_flops_per_s,
            ),
            OpKind::Memory => (
                op.fwd_bytes / self.memory_bytes_per_s,
                op.bwd_bytes / self.memory_bytes_per_s,
            ),
        }
    }

    /// Forward and backward seconds of one operator for one micro-batch.
    pub fn op_time(&self, op: &OpWorkload) -> (f64, f64) {
        let (f, b) = self.roofline(op);
        (f * self.calibration, b * self.calibration)
    }

    /// Forward and backward seconds of the operators in `range`.
    pub fn range_time(&self, w: &Workload, range: Range<usize>) -> (f64, f64) {
        w.ops[range].iter().fold((0.0, 0.0), |(f, b), o| {
            let (of, ob) = self.op_time(o);
            (f + of, b + ob)
        })
    }

    /// Forward-plus-backward seconds of every prefix: `out[p]` covers positions `0..p`, so a
    /// range costs `out[b] - out[a]` (the planner's inner loop).
    pub fn prefix_times(&self, w: &Workload) -> Vec<f64> {
        let mut out = Vec::with_capacity(w.len() + 1);
        let mut acc = 0.0;
        out.push(0.0);
        for o in &w.ops {
            let (f, b) = self.op_time(o);
            acc += f + b;
            out.push(acc);
        }
        out
    }

    /// Forward seconds of every prefix, as [`DeviceProfile::prefix_times`]: what recomputing
    /// activations repeats.
    pub fn forward_prefix_times(&self, w: &Workload) -> Vec<f64> {
        let mut out = Vec::with_capacity(w.len() + 1);
        let mut acc = 0.0;
        out.push(0.0);
        for o in &w.ops {
            acc += self.op_time(o).0;
            out.push(acc);
        }
        out
    }

    /// Seconds of one Adam update of `params` f32 parameters: a streaming pass that reads the
    /// parameter, its gradient and two moments and writes back three (28 bytes per parameter).
    pub fn update_time(&self, params: f64) -> f64 {
        params.max(0.0) * ADAM_UPDATE_BYTES_PER_PARAM / self.memory_bytes_per_s
    }

    /// Sets `calibration` so that the model predicts `measured_s` for one forward and backward
    /// pass over all of `w`.
    pub fn calibrate(&mut self, w: &Workload, measured_s: f64) {
        let predicted: f64 = w
            .ops
            .iter()
            .map(|o| {
                let (f, b) = self.roofline(o);
                f + b
            })
            .sum();
        if predicted > 0.0 && measured_s.is_finite() && measured_s > 0.0 {
            self.calibration = measured_s / predicted;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusion_testbed::DeviceCatalog;

    #[test]
    fn classes_rank_like_their_published_figures_and_calibration_scales_time() {
        let cat = DeviceCatalog::builtin().expect("catalog");
        let g = fusion_models::ModelSpec::preset("gpt2-small")
            .expect("preset")
            .graph(1, 128)
            .expect("graph");
        let w = Workload::of(&g, 8.0).expect("workload");
        let t = |class: &str| {
            let p = DeviceProfile::from_class(class, cat.get(class).expect("class"));
            p.validate().expect("valid");
            *p.prefix_times(&w).last().expect("total")
        };
        let (h100, a100, v100, r3080, cpu) =
            (t("h100"), t("a100"), t("v100"), t("rtx3080"), t("cpu"));
        assert!(h100 < a100 && a100 < v100 && v100 < r3080 && r3080 < cpu);
        // gpt2-small, 128 tokens: about 6 * 124M * 128 = 95 GFLOP of training work.
        let flops = w.flops(0..w.len());
        assert!((7e10..1.4e11).contains(&flops), "{flops}");
        let mut p = DeviceProfile::from_class("x", cat.get("cpu").expect("cpu"));
        let before = *p.prefix_times(&w).last().expect("total");
        p.calibrate(&w, 2.0 * before);
        let after = *p.prefix_times(&w).last().expect("total");
        assert!((after / before - 2.0).abs() < 1e-9);
        let (f, b) = p.range_time(&w, 0..w.len());
        assert!((f + b - after).abs() < 1e-9 * after);
    }

    #[test]
    fn bad_profiles_are_rejected_with_the_reason() {
        let dir = std::env::temp_dir().join(format!("fusion-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("p.json");
        std::fs::write(&path, "{\"name\": \"x\"").expect("write");
        let err = DeviceProfile::from_file(&path).expect_err("truncated");
        assert!(err.to_string().contains("p.json"), "{err}");
        let mut p = DeviceProfile::from_class(
            "x",
            DeviceCatalog::builtin()
                .expect("catalog")
                .get("a100")
                .expect("a100"),
        );
        p.memory_bytes_per_s = -1.0;
        std::fs::write(&path, serde_json::to_string(&p).expect("json")).expect("write");
        let err = DeviceProfile::from_file(&path).expect_err("negative");
        assert!(err.to_string().contains("must be positive"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
