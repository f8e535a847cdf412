//! What nodes claim of their devices, distrusted: figures are bounded when a node joins, and
//! once a placement has run a few steps each node's measured compute is compared with what its
//! claims predict. A node far slower than it claimed (relative to the others, so that the
//! estimator's own error cancels) has its figures derated for every later plan. Pure functions.

use fusion_backend::Precision;
use fusion_proto::Capabilities;

/// Largest plausible dense speed, GFLOP/s (ten times the fastest accelerator of 2026).
pub const MAX_GFLOPS: f64 = 1e5;
/// Largest plausible memory throughput, GB/s.
pub const MAX_MEMORY_GBS: f64 = 1e5;
/// Largest plausible memory, bytes (16 TiB).
pub const MAX_MEMORY_BYTES: u64 = 1 << 44;
/// Calibration factors outside this range are not measurements (the estimator's own bounds).
pub const CALIBRATION: (f64, f64) = fusion_estimate::CALIBRATION_RANGE;
/// Largest plausible per-operator overhead, microseconds (a tenth of a second).
pub const MAX_OP_OVERHEAD_US: f64 = 1e5;
/// A node whose measured-to-predicted compute ratio is this many times the others' is flagged.
pub const OVERCLAIM: f64 = 4.0;
/// Steps a placement runs before its nodes' claims are checked (the first ones warm caches up).
pub const CHECK_AFTER_STEPS: u64 = 3;

/// `c` with every figure finite and within what a device can have; an implausible figure
/// becomes 0 ("unknown"), which the planner replaces with a modest default.
pub fn bounded(c: &Capabilities) -> Capabilities {
    let within = |v: f64, max: f64| {
        if v.is_finite() && v > 0.0 && v <= max {
            v
        } else {
            0.0
        }
    };
    let (lo, hi) = CALIBRATION;
    let calibrated = (lo..=hi).contains(&c.calibration);
    Capabilities {
        measured_gflops: within(c.measured_gflops, MAX_GFLOPS),
        measured_memory_gbs: within(c.measured_memory_gbs, MAX_MEMORY_GBS),
        memory_bytes: if c.memory_bytes <= MAX_MEMORY_BYTES {
            c.memory_bytes
        } else {
            0
        },
        calibration: if calibrated { c.calibration } else { 0.0 },
        // The overhead was fitted together with the calibration: without it, it means nothing.
        op_overhead_us: if calibrated {
            within(c.op_overhead_us, MAX_OP_OVERHEAD_US)
        } else {
            0.0
        },
        ..c.clone()
    }
}

/// Whether a node whose backend is named `backend` (`candle-cpu-bf16`, `reference-f64`,
/// `numpy-f32`: the precision last) computes in the job's `precision`: a half-precision job
/// takes only nodes of that precision, an f32 job any that computes in 32 bits or more.
pub fn precision_matches(backend: &str, precision: Precision) -> Result<(), String> {
    let half = [Precision::Bf16, Precision::F16]
        .into_iter()
        .find(|p| backend.ends_with(&format!("-{}", p.as_str())));
    if half == Some(precision) || (half.is_none() && precision == Precision::F32) {
        return Ok(());
    }
    let flag = precision.as_str();
    let remedy = match half {
        // A 16-bit node: it may be the job that was meant to be 16-bit.
        Some(own) => format!(
            "start it with --precision {flag}, or give the job precision = \"{own}\" \
             (fusionllm train --precision {own}) to train in {own}",
            own = own.as_str()
        ),
        None if backend.starts_with("candle") => format!("start it with --precision {flag}"),
        // The Python node and others that compute in 32 or 64 bits only.
        None => format!("join a node started with --precision {flag} (fusionllm node) instead"),
    };
    Err(format!(
        "its backend {backend} does not compute in {flag}, the precision of this job: {remedy}"
    ))
}

/// For each node, how much slower it computes than its claims predict relative to the others:
/// `Some(factor)` for a node whose ratio of measured to predicted compute is more than
/// [`OVERCLAIM`] times the lower median of all ratios, None for the rest. Needs three nodes with
/// figures at least: the compute times are the nodes' own reports, and of two, either could be
/// the liar.
pub fn overclaims(predicted_s: &[f64], measured_s: &[f64]) -> Vec<Option<f64>> {
    relative_slowdowns(predicted_s, measured_s, 3)
        .into_iter()
        .map(|f| f.filter(|&f| f > OVERCLAIM))
        .collect()
}

/// Each node's measured-to-predicted compute ratio divided by the lower median of all nodes'
/// (None where a figure is missing or not positive, or fewer than `min_nodes` have figures).
pub fn relative_slowdowns(
    predicted_s: &[f64],
    measured_s: &[f64],
    min_nodes: usize,
) -> Vec<Option<f64>> {
    let ratios: Vec<Option<f64>> = predicted_s
        .iter()
        .zip(measured_s)
        .map(|(&p, &m)| (p.is_finite() && p > 0.0 && m.is_finite() && m > 0.0).then(|| m / p))
        .collect();
    let mut known: Vec<f64> = ratios.iter().flatten().copied().collect();
    if known.len() < min_nodes.max(1) {
        return vec![None; ratios.len()];
    }
    known.sort_by(f64::total_cmp);
    let median = known[(known.len() - 1) / 2];
    ratios.iter().map(|r| r.map(|r| r / median)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn implausible_figures_become_unknown_and_plausible_ones_stay() {
        let honest = Capabilities {
            measured_gflops: 90.0,
            measured_memory_gbs: 20.0,
            memory_bytes: 24 << 30,
            calibration: 1.5,
            op_overhead_us: 12.0,
            ..Default::default()
        };
        assert_eq!(bounded(&honest), honest);
        // An overhead beyond a tenth of a second, or fitted with a rejected calibration, is not
        // a measurement.
        let slow = bounded(&Capabilities {
            op_overhead_us: 1e9,
            ..honest.clone()
        });
        assert_eq!((slow.calibration, slow.op_overhead_us), (1.5, 0.0));
        let orphan = bounded(&Capabilities {
            calibration: 1e6,
            ..honest.clone()
        });
        assert_eq!((orphan.calibration, orphan.op_overhead_us), (0.0, 0.0));
        let liar = Capabilities {
            measured_gflops: 1e12,
            measured_memory_gbs: f64::INFINITY,
            memory_bytes: u64::MAX,
            calibration: 1e-9,
            ..Default::default()
        };
        let b = bounded(&liar);
        assert_eq!(
            (
                b.measured_gflops,
                b.measured_memory_gbs,
                b.memory_bytes,
                b.calibration
            ),
            (0.0, 0.0, 0, 0.0)
        );
        let nan = bounded(&Capabilities {
            measured_gflops: f64::NAN,
            calibration: -1.0,
            ..Default::default()
        });
        assert_eq!((nan.measured_gflops, nan.calibration), (0.0, 0.0));
    }

    #[test]
    fn a_node_joins_only_a_job_of_its_precision() {
        let ok = |b: &str, p| precision_matches(b, p).is_ok();
        assert!(ok("candle-cpu-f32", Precision::F32));
        assert!(ok("reference-f64", Precision::F32));
        assert!(ok("candle-cuda-tf32", Precision::F32));
        assert!(ok("numpy-f32", Precision::F32));
        assert!(ok("candle-cpu-bf16", Precision::Bf16));
        assert!(ok("candle-cuda-f16", Precision::F16));
        assert!(!ok("candle-cpu-bf16", Precision::F32));
        assert!(!ok("candle-cpu-f32", Precision::Bf16));
        assert!(!ok("candle-cpu-bf16", Precision::F16));
        // Each refusal says what to change: a Python node cannot compute in 16 bits at all.
        let why = precision_matches("numpy-f32", Precision::F16).unwrap_err();
        assert!(
            why.contains("numpy-f32") && why.contains("node started with --precision f16"),
            "{why}"
        );
        let why = precision_matches("candle-cpu-f32", Precision::Bf16).unwrap_err();
        assert!(why.ends_with("start it with --precision bf16"), "{why}");
        // A 16-bit node against an f32 job: perhaps the job file lacks its precision.
        let why = precision_matches("candle-cpu-bf16", Precision::F32).unwrap_err();
        assert!(
            why.contains("--precision f32") && why.contains("precision = \"bf16\""),
            "{why}"
        );
    }

    #[test]
    fn a_node_far_slower_than_it_claimed_relative_to_the_others_is_flagged() {
        // The estimator is 3x optimistic for everyone: nobody is flagged.
        assert_eq!(
            overclaims(&[1.0, 2.0, 1.0], &[3.0, 6.0, 3.1]),
            vec![None; 3]
        );
        // Node 1 claimed 100x its speed.
        let f = overclaims(&[1.0, 0.02, 1.0], &[3.0, 6.0, 3.0]);
        assert_eq!(f[0], None);
        assert!((f[1].expect("flagged") - 100.0).abs() < 1e-9);
        assert_eq!(f[2], None);
        // Of two, either could be lying about its compute time: nobody is flagged.
        assert_eq!(overclaims(&[1.0, 0.01], &[1.0, 1.0]), vec![None, None]);
        // Missing or nonsense figures flag nobody.
        assert_eq!(
            overclaims(&[1.0, 0.0, 1.0], &[1.0, 1.0, 1.0]),
            vec![None; 3]
        );
        assert_eq!(overclaims(&[1.0], &[100.0]), vec![None]);
        assert_eq!(
            overclaims(&[f64::NAN, 1.0, 1.0], &[1.0, 1.0, 9.0]),
            vec![None; 3]
        );
    }
}
