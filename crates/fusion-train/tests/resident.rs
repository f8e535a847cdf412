//! The optimizer on the compute device (`optimizer_on = "device"`, what `auto` picks on a GPU) against
//! the host optimizer, and its checkpoints. Candle runs on the CPU here, or on the GPU that
//! `FUSION_TEST_DEVICE=cuda` names.

use fusion_backend::{CandleBackend, ReferenceBackend};
use fusion_data::{Dataset, MarkovCorpus, SyntheticImages};
use fusion_models::ModelSpec;
use fusion_train::{OptimizerConfig, OptimizerPlacement, ScheduleConfig, TrainConfig, Trainer};
use std::sync::Arc;

fn backend() -> CandleBackend {
    CandleBackend::for_tests(false).expect("the test device")
}

fn markov() -> Arc<dyn Dataset> {
    Arc::new(MarkovCorpus::new(32, 4, 0.5, 9).expect("corpus"))
}

fn lm_config(steps: u64, optimizer: OptimizerConfig, on: OptimizerPlacement) -> TrainConfig {
    TrainConfig {
        steps,
        batch_size: 2,
        seq_len: 8,
        micro_batches: 2,
        optimizer,
        schedule: ScheduleConfig {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 2,
        },
        // Small enough that every step clips, so the folded clipping scale is exercised.
        clip_norm: Some(0.05),
        eval_every: 3,
        eval_batches: Some(1),
        optimizer_on: on,
        ..TrainConfig::default()
    }
}

fn adamw() -> OptimizerConfig {
    OptimizerConfig::AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "parameter counts differ");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "a parameter's size differs");
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

/// Trains `steps` steps with the optimizer state on the device or on the host; returns each
/// step's (loss, gradient norm) and the final parameters.
fn train(
    model: &ModelSpec,
    data: Arc<dyn Dataset>,
    cfg: TrainConfig,
) -> (Vec<(f32, f32)>, Vec<Vec<f32>>) {
    let mut t = Trainer::new(backend(), model.clone(), data, cfg).expect("trainer");
    let report = t.run(|_, _| {}).expect("run");
    let curve = report.steps.iter().map(|s| (s.loss, s.grad_norm)).collect();
    (curve, t.params().to_vec())
}

fn assert_follows(
    device: &(Vec<(f32, f32)>, Vec<Vec<f32>>),
    host: &(Vec<(f32, f32)>, Vec<Vec<f32>>),
) {
    for (step, (d, h)) in device.0.iter().zip(&host.0).enumerate() {
        assert!(
            (d.0 - h.0).abs() <= 1e-4 * h.0.abs().max(1.0),
            "step {step}: loss {} on the device, {} on the host",
            d.0,
            h.0
        );
        assert!(
            (d.1 - h.1).abs() <= 1e-4 * h.1.abs().max(1.0),
            "step {step}: gradient norm {} on the device, {} on the host",
            d.1,
            h.1
        );
    }
    let diff = max_diff(&device.1, &host.1);
    assert!(diff < 2e-5, "parameters differ by {diff}");
}

#[test]
fn adamw_on_the_device_follows_adamw_on_the_host() {
    let model = ModelSpec::preset("gpt2-tiny").expect("model");
    let device = train(
        &model,
        markov(),
        lm_config(7, adamw(), OptimizerPlacement::Device),
    );
    let host = train(
        &model,
        markov(),
        lm_config(7, adamw(), OptimizerPlacement::Host),
    );
    assert_eq!(device.0.len(), 7);
    assert!(
        host.0.iter().all(|&(_, norm)| norm > 0.05),
        "every step must clip"
    );
    assert_follows(&device, &host);
    // It moved: the comparison is not between two untrained models.
    let start = Trainer::new(
        backend(),
        model.clone(),
        markov(),
        lm_config(7, adamw(), OptimizerPlacement::Host),
    )
    .expect("trainer");
    assert!(max_diff(start.params(), &device.1) > 1e-3);
}

#[test]
fn sgd_with_batch_norm_on_the_device_follows_the_host() {
    let mut model = ModelSpec::preset("resnet-tiny").expect("model");
    if let fusion_models::ModelKind::ResNet(c) = &mut model.kind {
        c.widths = vec![4, 4, 8];
    }
    let data = || -> Arc<dyn Dataset> { Arc::new(SyntheticImages::new(8, 3, 0.3, 2)) };
    let sgd = OptimizerConfig::Sgd {
        momentum: 0.9,
        weight_decay: 1e-3,
    };
    let cfg = |on| TrainConfig {
        batch_size: 4,
        clip_norm: Some(1.0),
        ..lm_config(5, sgd.clone(), on)
    };
    let device = train(&model, data(), cfg(OptimizerPlacement::Device));
    let host = train(&model, data(), cfg(OptimizerPlacement::Host));
    // The batch-norm statistics (buffers, no optimizer state) come back with the weights.
    assert_follows(&device, &host);
}

#[test]
fn a_device_resident_run_checkpoints_and_resumes_exactly() {
    let model = ModelSpec::preset("gpt2-tiny").expect("model");
    let cfg = || lm_config(6, adamw(), OptimizerPlacement::Device);
    let straight = train(&model, markov(), cfg());

    let dir = tempfile::tempdir().expect("tempdir");
    let mut first = Trainer::new(backend(), model.clone(), markov(), cfg()).expect("trainer");
    assert!(first.optimizer_on_device());
    for _ in 0..3 {
        first.train_step().expect("step");
    }
    assert!(
        first.params().is_empty(),
        "between device steps the host holds no stale copy"
    );
    first.save_checkpoint(dir.path()).expect("save");
    drop(first);
    let mut resumed = Trainer::new(backend(), model, markov(), cfg()).expect("trainer");
    resumed.load_checkpoint(dir.path()).expect("load");
    assert_eq!(resumed.step(), 3);
    resumed.run(|_, _| {}).expect("run");
    assert_eq!(
        straight.1,
        resumed.params(),
        "the resumed run differs from the uninterrupted one"
    );
}

#[test]
fn settling_mid_run_changes_nothing() {
    let model = ModelSpec::preset("gpt2-tiny").expect("model");
    let cfg = lm_config(4, adamw(), OptimizerPlacement::Device);
    let straight = train(&model, markov(), cfg.clone());
    let mut t = Trainer::new(backend(), model, markov(), cfg).expect("trainer");
    for _ in 0..2 {
        t.train_step().expect("step");
        t.settle().expect("settle");
        assert!(!t.params().is_empty());
    }
    t.run(|_, _| {}).expect("run");
    assert_eq!(straight.1, t.params());
}

#[test]
fn an_f64_backend_keeps_the_f32_master_state_on_the_host() {
    let model = ModelSpec::preset("gpt2-tiny").expect("model");
    let auto = lm_config(2, adamw(), OptimizerPlacement::Auto);
    let t = Trainer::new(ReferenceBackend, model.clone(), markov(), auto).expect("trainer");
    assert!(!t.optimizer_on_device());
    let asked = lm_config(2, adamw(), OptimizerPlacement::Device);
    let e = Trainer::new(ReferenceBackend, model, markov(), asked)
        .err()
        .expect("refused");
    assert!(
        e.to_string()
            .contains("the optimizer on the device keeps f32 state"),
        "{e}"
    );
}

#[test]
fn a_diverged_device_run_still_hands_its_state_back() {
    let model = ModelSpec::preset("gpt2-tiny").expect("model");
    let mut cfg = lm_config(4, adamw(), OptimizerPlacement::Device);
    cfg.schedule = ScheduleConfig {
        lr: 1e30,
        min_lr: 1e30,
        warmup_steps: 0,
    };
    let mut t = Trainer::new(backend(), model, markov(), cfg).expect("trainer");
    let Err(e) = t.run(|_, _| {}) else {
        panic!("the run must diverge");
    };
    assert!(
        matches!(e, fusion_train::TrainError::Diverged { .. }),
        "{e}"
    );
    assert!(!t.params().is_empty(), "the state came back to the host");
    let dir = tempfile::tempdir().expect("tempdir");
    t.save_checkpoint(dir.path())
        .expect("the state can still be saved");
}
