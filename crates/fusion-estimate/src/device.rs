//! How fast a device runs operators: a calibrated roofline. Dense operators (matrix products,
//! convolutions, attention) take `flops / dense_flops_per_s`; the others take
//! `bytes / memory_bytes_per_s`; each is scaled by `calibration` and every forward and backward
//! pass of an operator adds `op_overhead_s` (dispatch, allocation, small-shape inefficiency).
//! Both come from timing real graphs of two sizes ([`DeviceProfile::calibrate_two`]): one
//! small graph alone would charge its per-operator overhead to the flops and overestimate large
//! matrix products several times (1 and 0 for a device class nobody has measured).

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
/// Calibration factors a fit may give (outside: not a measurement).
pub const CALIBRATION_RANGE: (f64, f64) = (0.01, 100.0);
/// How much more roofline per operator pass the large calibration graph needs than the small
/// one for a two-point fit.
pub const MIN_ROOFLINE_RATIO: f64 = 4.0;

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
    /// Seconds every forward and every backward pass of an operator adds (0: unknown, the
    /// calibration alone scales the roofline).
    #[serde(default)]
    pub op_overhead_s: f64,
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
            op_overhead_s: 0.0,
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
        let overhead_ok = self.op_overhead_s.is_finite() && self.op_overhead_s >= 0.0;
        if overhead_ok && figures.iter().all(|v| v.is_finite() && *v > 0.0) {
            Ok(())
        } else {
            Err(EstimateError::InvalidProfile {
                name: self.name.clone(),
                message: format!(
                    "speeds, memory and calibration must be positive and the operator overhead not negative, got {figures:?} and {}",
                    self.op_overhead_s
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
        let o = self.op_overhead_s;
        (f * self.calibration + o, b * self.calibration + o)
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

    /// Uncalibrated forward-plus-backward seconds of all of `w`, and its operator passes.
    fn roofline_sum(&self, w: &Workload) -> (f64, f64) {
        let r = w.ops.iter().map(|o| {
            let (f, b) = self.roofline(o);
            f + b
        });
        (r.sum(), 2.0 * w.len() as f64)
    }

    /// Sets `calibration` (and no operator overhead) so that the model predicts `measured_s`
    /// for one forward and backward pass over all of `w`.
    pub fn calibrate(&mut self, w: &Workload, measured_s: f64) {
        let (predicted, _) = self.roofline_sum(w);
        if predicted > 0.0 && measured_s.is_finite() && measured_s > 0.0 {
            self.calibration = measured_s / predicted;
            self.op_overhead_s = 0.0;
        }
    }

    /// Fits `calibration` and `op_overhead_s` to two timed passes, `small` and `large`:
    /// `measured = calibration × roofline + overhead × passes` through both points. The large
    /// graph must have at least [`MIN_ROOFLINE_RATIO`] times the small one's roofline per
    /// operator pass, else timing noise decides the split. Where the points do not pin both
    /// down (too alike, a negative term, a scale outside [`CALIBRATION_RANGE`]), falls back to
    /// [`DeviceProfile::calibrate`] on `large`.
    pub fn calibrate_two(&mut self, small: (&Workload, f64), large: (&Workload, f64)) {
        let (r1, n1) = self.roofline_sum(small.0);
        let (r2, n2) = self.roofline_sum(large.0);
        let (m1, m2) = (small.1, large.1);
        let ok = |v: f64| v.is_finite() && v > 0.0;
        let apart = ok(r1) && ok(n1) && ok(n2) && r2 / n2 >= MIN_ROOFLINE_RATIO * r1 / n1;
        if ok(m1) && ok(m2) && apart {
            let det = r1 * n2 - r2 * n1;
            let c = (m1 * n2 - m2 * n1) / det;
            let o = (r1 * m2 - r2 * m1) / det;
            let (lo, hi) = CALIBRATION_RANGE;
            if c.is_finite() && (lo..=hi).contains(&c) && o.is_finite() && o >= 0.0 {
                self.calibration = c;
                self.op_overhead_s = o;
                return;
            }
        }
        self.calibrate(large.0, m2);
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
    fn two_sizes_pin_down_the_scale_and_the_operator_overhead() {
        let cat = DeviceCatalog::builtin().expect("catalog");
        let graph = |d: usize, t: usize| {
            let c = fusion_models::Gpt2Config {
                vocab: 512,
                n_ctx: 64,
                n_embd: d,
                n_layer: 2,
                n_head: 2,
            };
            Workload::of(&c.graph("g", 2, t).expect("graph"), 0.0).expect("workload")
        };
        let (small, large) = (graph(32, 8), graph(256, 64));
        // A device whose truth is 1.7 x the roofline plus 25 us per operator pass.
        let mut truth = DeviceProfile::from_class("x", cat.get("cpu").expect("cpu"));
        truth.calibration = 1.7;
        truth.op_overhead_s = 25e-6;
        let time = |w: &Workload| *truth.prefix_times(w).last().expect("total");
        let mut p = DeviceProfile::from_class("x", cat.get("cpu").expect("cpu"));
        p.calibrate_two((&small, time(&small)), (&large, time(&large)));
        assert!((p.calibration / 1.7 - 1.0).abs() < 1e-9, "{p:?}");
        assert!((p.op_overhead_s / 25e-6 - 1.0).abs() < 1e-9, "{p:?}");
        // A third size is predicted, which one factor fitted to the small graph cannot do.
        let other = graph(128, 32);
        let predicted = *p.prefix_times(&other).last().expect("total");
        assert!((predicted / time(&other) - 1.0).abs() < 1e-9);
        let mut one = DeviceProfile::from_class("x", cat.get("cpu").expect("cpu"));
        one.calibrate(&small, time(&small));
        let scaled = *one.prefix_times(&large).last().expect("total");
        assert!(scaled > 1.5 * time(&large), "{scaled} {}", time(&large));
        // Timings that imply a negative overhead fall back to scaling to the large graph.
        let mut q = DeviceProfile::from_class("x", cat.get("cpu").expect("cpu"));
        q.calibrate_two((&small, 1e-9), (&large, time(&large)));
        assert_eq!(q.op_overhead_s, 0.0);
        let got = *q.prefix_times(&large).last().expect("total");
        assert!((got / time(&large) - 1.0).abs() < 1e-9);
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
