//! Measuring a device: a matrix-product probe and an element-wise probe set the roofline, and
//! one forward and backward pass of a real graph on the node's backend calibrates it. The whole
//! run is a few hundred milliseconds on a CPU, so a node can do it when it joins.

use crate::device::{DeviceProfile, ProfileSource};
use crate::error::EstimateError;
use crate::workload::Workload;
use fusion_backend::{Backend, BinaryOp};
use fusion_exec::{init_params, Executor, IdTensor, Mode, Value};
use fusion_graph::{DType, Graph};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// What a profiling run measured.
#[derive(Clone, Debug, Serialize)]
pub struct ProfileRun {
    pub profile: DeviceProfile,
    /// Seconds of one forward and backward pass over each calibration graph.
    pub graph_s: Vec<f64>,
    /// What the uncalibrated roofline predicted for each.
    pub roofline_s: Vec<f64>,
    /// Which of the graphs given were timed (positions; the small one first).
    pub timed: Vec<usize>,
}

fn err(e: impl std::fmt::Display) -> EstimateError {
    EstimateError::Profile(e.to_string())
}

/// Best of `reps` timings of `f`.
fn best_of<F: FnMut() -> Result<(), EstimateError>>(
    reps: usize,
    mut f: F,
) -> Result<f64, EstimateError> {
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best.max(1e-9))
}

/// Roofline seconds the large calibration graph may take at the probed speeds: a slow backend
/// (the f64 reference, a weak device) times a smaller one, so that joining stays quick.
pub const LARGE_GRAPH_BUDGET_S: f64 = 0.1;

/// Profiles `backend`: roofline probes, then `reps` forward and backward passes (best time
/// kept) of calibration graphs. With one graph, its time scales the roofline. With more
/// (`fusion_models::calibration_graphs`: a small one, then larger ones from the largest down),
/// the small one and the largest whose roofline fits [`LARGE_GRAPH_BUDGET_S`] (else the last)
/// also fit a per-operator overhead. `memory_capacity_bytes` is what the node can give
/// training.
pub fn profile_backend<B: Backend>(
    backend: &B,
    name: &str,
    graphs: &[Graph],
    memory_capacity_bytes: f64,
    reps: usize,
) -> Result<ProfileRun, EstimateError> {
    let Some(small) = graphs.first() else {
        return Err(err("profiling needs at least one calibration graph"));
    };
    let reps = reps.max(1);
    let n = 256;
    let a = backend.upload(vec![0.5; n * n], &[n, n]).map_err(err)?;
    let mm = best_of(3, || {
        let c = backend.matmul(&a, &a, false, false).map_err(err)?;
        backend.to_vec(&c).map(|_| ()).map_err(err)
    })?;
    let len = 1 << 20;
    let x = backend.upload(vec![0.25; len], &[len]).map_err(err)?;
    let add = best_of(3, || {
        let y = backend.binary(BinaryOp::Add, &x, &x).map_err(err)?;
        backend.to_vec(&y).map(|_| ()).map_err(err)
    })?;
    let mut profile = DeviceProfile {
        name: name.into(),
        class: backend.name(),
        dense_flops_per_s: 2.0 * (n * n * n) as f64 / mm,
        // Reads two operands, writes one, and copies the result back to the host.
        memory_bytes_per_s: (4 * 4 * len) as f64 / add,
        memory_capacity_bytes,
        calibration: 1.0,
        op_overhead_s: 0.0,
        source: ProfileSource::Measured,
    };
    let mut timed = vec![(Workload::of(small, 0.0)?, small)];
    let mut positions = vec![0];
    if let Some((w, g, i)) = affordable(&profile, &graphs[1..])? {
        timed.push((w, g));
        positions.push(1 + i);
    }
    let (mut graph_s, mut roofline_s) = (Vec::new(), Vec::new());
    for (w, g) in &timed {
        roofline_s.push(*profile.prefix_times(w).last().unwrap_or(&0.0));
        graph_s.push(time_training_pass(backend, g, reps)?);
    }
    match timed.as_slice() {
        [(w, _)] => profile.calibrate(w, graph_s[0]),
        [(ws, _), (wl, _), ..] => profile.calibrate_two((ws, graph_s[0]), (wl, graph_s[1])),
        [] => {}
    }
    profile.validate()?;
    Ok(ProfileRun {
        profile,
        graph_s,
        roofline_s,
        timed: positions,
    })
}

/// Of the larger calibration graphs (largest first), the first whose uncalibrated roofline at
/// `profile`'s speeds fits [`LARGE_GRAPH_BUDGET_S`], else the last (with its position); None
/// without any.
fn affordable<'g>(
    profile: &DeviceProfile,
    larger: &'g [Graph],
) -> Result<Option<(Workload, &'g Graph, usize)>, EstimateError> {
    let mut last = None;
    for (i, g) in larger.iter().enumerate() {
        let w = Workload::of(g, 0.0)?;
        let roofline = *profile.prefix_times(&w).last().unwrap_or(&0.0);
        if roofline <= LARGE_GRAPH_BUDGET_S {
            return Ok(Some((w, g, i)));
        }
        last = Some((w, g, i));
    }
    Ok(last)
}

/// Best time of one forward and backward pass over `graph` with made-up inputs (token and label
/// 0, images of 0.5) and its initial parameters.
fn time_training_pass<B: Backend>(
    backend: &B,
    graph: &Graph,
    reps: usize,
) -> Result<f64, EstimateError> {
    let exec = Executor::new(backend.clone(), Arc::new(graph.clone())).map_err(err)?;
    let params = exec.upload_params(&init_params(graph, 1)).map_err(err)?;
    let loss = *graph
        .outputs
        .first()
        .ok_or_else(|| err("the calibration graph has no output"))?;
    best_of(reps, || {
        let mut feeds = HashMap::new();
        for t in &graph.inputs {
            let info = graph.tensor(*t);
            let v = match info.dtype {
                DType::I32 => Value::Ids(
                    IdTensor::new(vec![0; info.numel()], info.shape.clone()).map_err(err)?,
                ),
                DType::F32 => Value::Float(
                    backend
                        .upload(vec![0.5; info.numel()], &info.shape)
                        .map_err(err)?,
                ),
            };
            feeds.insert(*t, v);
        }
        let pass = exec
            .forward(&params, feeds, Mode::Train, true)
            .map_err(err)?;
        let seed = backend
            .upload(vec![1.0], &graph.tensor(loss).shape)
            .map_err(err)?;
        let grads = exec
            .backward(pass, &params, HashMap::from([(loss, seed)]))
            .map_err(err)?;
        drop(grads);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusion_backend::{CandleBackend, ReferenceBackend};

    #[test]
    fn profiling_a_real_backend_calibrates_the_roofline_to_the_measured_pass() {
        let g = fusion_models::ModelSpec::preset("gpt2-tiny")
            .expect("preset")
            .graph(1, 16)
            .expect("graph");
        let run = profile_backend(
            &CandleBackend::cpu(),
            "me",
            std::slice::from_ref(&g),
            1e9,
            2,
        )
        .expect("profile");
        let p = &run.profile;
        assert_eq!(p.source, ProfileSource::Measured);
        assert!(
            p.dense_flops_per_s > 1e8 && p.memory_bytes_per_s > 1e7,
            "{p:?}"
        );
        let w = Workload::of(&g, 0.0).expect("workload");
        let predicted = *p.prefix_times(&w).last().expect("total");
        assert!((predicted / run.graph_s[0] - 1.0).abs() < 1e-9);
        assert_eq!(p.op_overhead_s, 0.0);
        // The f64 reference backend profiles too (a node of another software stack).
        let r = profile_backend(&ReferenceBackend, "ref", &[g], 1e9, 1).expect("reference");
        assert!(r.graph_s[0] > 0.0 && r.profile.calibration > 0.0);
    }

    #[test]
    fn two_graphs_fit_the_overhead_and_predict_both_passes() {
        let graphs = fusion_models::calibration_graphs(true).expect("graphs");
        let run = profile_backend(&CandleBackend::cpu(), "me", &graphs, 1e9, 2).expect("profile");
        let p = &run.profile;
        let predict = |g: &Graph| {
            let w = Workload::of(g, 0.0).expect("workload");
            *p.prefix_times(&w).last().expect("total")
        };
        // The shipped graphs are far enough apart for a two-point fit: the large one has
        // several times the small one's roofline per operator pass, and takes longer.
        // (Every larger candidate, whichever this machine's speed picks.)
        let per_pass = |g: &Graph| {
            let w = Workload::of(g, 0.0).expect("workload");
            let mut speeds = p.clone();
            speeds.calibration = 1.0;
            speeds.op_overhead_s = 0.0;
            *speeds.prefix_times(&w).last().expect("total") / (2.0 * w.len() as f64)
        };
        for g in &graphs[1..] {
            let ratio = per_pass(g) / per_pass(&graphs[0]);
            assert!(
                ratio >= crate::device::MIN_ROOFLINE_RATIO,
                "{ratio} {run:?}"
            );
        }
        assert_eq!(run.timed.len(), 2);
        assert!(run.graph_s[1] > run.graph_s[0], "{run:?}");
        p.validate().expect("a valid profile");
        let large = predict(&graphs[run.timed[1]]);
        assert!((large / run.graph_s[1] - 1.0).abs() < 1e-9, "{run:?}");
        // Both points are matched, unless the timings implied a negative overhead and the
        // profile fell back to scaling the roofline to the large graph.
        if p.op_overhead_s > 0.0 {
            assert!(
                (predict(&graphs[0]) / run.graph_s[0] - 1.0).abs() < 1e-9,
                "{run:?}"
            );
        }
        let none = profile_backend(&CandleBackend::cpu(), "me", &[], 1e9, 1).expect_err("none");
        assert!(none.to_string().contains("at least one"), "{none}");
    }

    #[test]
    fn a_graph_without_outputs_is_a_clear_error() {
        let mut g = fusion_models::ModelSpec::preset("gpt2-tiny")
            .expect("preset")
            .graph(1, 4)
            .expect("graph");
        g.outputs.clear();
        let err = profile_backend(&ReferenceBackend, "x", &[g], 1e9, 1).expect_err("no output");
        assert!(err.to_string().contains("no output"), "{err}");
    }
}
