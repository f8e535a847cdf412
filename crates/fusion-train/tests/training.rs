//! Training behaviour: exact resume, checkpoint validation, learning.

use fusion_backend::{CandleBackend, ReferenceBackend};
use fusion_data::{Dataset, MarkovCorpus, SyntheticImages};
use fusion_models::ModelSpec;
use fusion_train::{OptimizerConfig, ScheduleConfig, TrainConfig, Trainer};
use std::sync::Arc;

fn lm_config(steps: u64) -> TrainConfig {
    TrainConfig {
        steps,
        batch_size: 2,
        seq_len: 8,
        micro_batches: 2,
        schedule: ScheduleConfig {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 2,
        },
        eval_batches: Some(1),
        ..TrainConfig::default()
    }
}

fn markov() -> Arc<dyn Dataset> {
    Arc::new(MarkovCorpus::new(32, 4, 0.5, 9).unwrap())
}

#[test]
fn resume_is_bit_exact_on_reference_backend() {
    let model = ModelSpec::preset("gpt2-tiny").unwrap();
    let mut straight =
        Trainer::new(ReferenceBackend, model.clone(), markov(), lm_config(6)).unwrap();
    straight.run(|_, _| {}).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let mut first = Trainer::new(ReferenceBackend, model.clone(), markov(), lm_config(6)).unwrap();
    for _ in 0..3 {
        first.train_step().unwrap();
    }
    first.save_checkpoint(dir.path()).unwrap();
    drop(first);
    let mut resumed = Trainer::new(ReferenceBackend, model, markov(), lm_config(6)).unwrap();
    resumed.load_checkpoint(dir.path()).unwrap();
    assert_eq!(resumed.step(), 3);
    resumed.run(|_, _| {}).unwrap();
    assert_eq!(
        straight.params(),
        resumed.params(),
        "resumed run differs from the uninterrupted one"
    );
}

#[test]
fn resume_with_batch_norm_and_sgd_is_exact() {
    let cfg = TrainConfig {
        steps: 4,
        batch_size: 4,
        optimizer: OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 1e-4,
        },
        schedule: ScheduleConfig {
            lr: 0.05,
            min_lr: 0.0,
            warmup_steps: 1,
        },
        eval_batches: Some(1),
        ..TrainConfig::default()
    };
    let data = || -> Arc<dyn Dataset> { Arc::new(SyntheticImages::new(8, 3, 0.3, 2)) };
    let mut model = ModelSpec::preset("resnet-tiny").unwrap();
    if let fusion_models::ModelKind::ResNet(c) = &mut model.kind {
        c.widths = vec![4, 4, 8];
    }
    let mut straight =
        Trainer::new(CandleBackend::cpu(), model.clone(), data(), cfg.clone()).unwrap();
    straight.run(|_, _| {}).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut first = Trainer::new(CandleBackend::cpu(), model.clone(), data(), cfg.clone()).unwrap();
    first.train_step().unwrap();
    first.train_step().unwrap();
    first.save_checkpoint(dir.path()).unwrap();
    let mut resumed = Trainer::new(CandleBackend::cpu(), model, data(), cfg).unwrap();
    resumed.load_checkpoint(dir.path()).unwrap();
    resumed.run(|_, _| {}).unwrap();
    assert_eq!(straight.params(), resumed.params());
}

#[test]
fn corrupt_and_mismatched_checkpoints_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let model = ModelSpec::preset("gpt2-tiny").unwrap();
    let mut t = Trainer::new(CandleBackend::cpu(), model.clone(), markov(), lm_config(2)).unwrap();
    t.train_step().unwrap();
    let path = t.save_checkpoint(dir.path()).unwrap();

    // Another model (different vocabulary) refuses the checkpoint.
    let other: Arc<dyn Dataset> = Arc::new(MarkovCorpus::new(40, 4, 0.5, 9).unwrap());
    let mut t2 = Trainer::new(CandleBackend::cpu(), model.clone(), other, lm_config(2)).unwrap();
    let err = t2.load_checkpoint(dir.path()).unwrap_err().to_string();
    assert!(err.contains("written for model"), "{err}");

    // A flipped byte in the tensors is detected.
    let tensors = path.join("model.safetensors");
    let mut bytes = std::fs::read(&tensors).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x55;
    std::fs::write(&tensors, &bytes).unwrap();
    let mut t3 = Trainer::new(CandleBackend::cpu(), model.clone(), markov(), lm_config(2)).unwrap();
    let err = t3.load_checkpoint(dir.path()).unwrap_err().to_string();
    assert!(err.contains("corrupt"), "{err}");

    // A truncated sidecar is a clear error too, and the trainer keeps its own state.
    std::fs::write(path.join("state.json"), b"{\"format\": ").unwrap();
    let err = t3.load_checkpoint(dir.path()).unwrap_err().to_string();
    assert!(err.contains("state.json"), "{err}");
    assert_eq!(t3.step(), 0);

    // No half-written checkpoint directories are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("partial"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn gpt2_tiny_learns_the_markov_source() {
    let data: Arc<dyn Dataset> = Arc::new(MarkovCorpus::new(64, 4, 0.5, 3).unwrap());
    let floor = data.entropy_floor().unwrap();
    let cfg = TrainConfig {
        steps: 150,
        batch_size: 8,
        seq_len: 32,
        schedule: ScheduleConfig {
            lr: 1e-2,
            min_lr: 1e-3,
            warmup_steps: 10,
        },
        eval_batches: Some(4),
        ..TrainConfig::default()
    };
    let mut t = Trainer::new(
        CandleBackend::cpu(),
        ModelSpec::preset("gpt2-tiny").unwrap(),
        data,
        cfg,
    )
    .unwrap();
    let report = t.run(|_, _| {}).unwrap();
    let first = report.steps[0].loss as f64;
    let eval = report.evals.last().unwrap().loss as f64;
    assert!(
        first > (64f64).ln() * 0.9,
        "initial loss {first} should be near ln(64)"
    );
    assert!(
        eval < floor * 1.3,
        "eval loss {eval} should approach the entropy floor {floor}"
    );
}

/// Training as four in-process pipeline stages (remote autodiff over the cuts, batch-norm
/// statistics included) follows single-process training step for step.
fn pipeline_matches_single_process(model: ModelSpec, data: Arc<dyn Dataset>, mut cfg: TrainConfig) {
    cfg.pipeline_stages = 1;
    let mut single =
        Trainer::new(ReferenceBackend, model.clone(), data.clone(), cfg.clone()).unwrap();
    let single_report = single.run(|_, _| {}).unwrap();
    cfg.pipeline_stages = 4;
    let mut piped = Trainer::new(ReferenceBackend, model, data, cfg).unwrap();
    let piped_report = piped.run(|_, _| {}).unwrap();
    for (a, b) in single_report.steps.iter().zip(&piped_report.steps) {
        assert!(
            ((a.loss - b.loss) / a.loss).abs() <= 1e-5,
            "step {}: loss {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
    }
    for (spec, (a, b)) in single
        .graph()
        .params
        .iter()
        .zip(single.params().iter().zip(piped.params()))
    {
        let scale = a.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff / scale <= 1e-5, "{}: max difference {diff}", spec.name);
    }
}

#[test]
fn four_stage_pipeline_training_matches_single_process_gpt2() {
    pipeline_matches_single_process(
        ModelSpec::preset("gpt2-tiny").unwrap(),
        markov(),
        lm_config(20),
    );
}

#[test]
fn four_stage_pipeline_training_matches_single_process_resnet() {
    let mut model = ModelSpec::preset("resnet-tiny").unwrap();
    if let fusion_models::ModelKind::ResNet(c) = &mut model.kind {
        c.widths = vec![4, 4, 8];
    }
    let cfg = TrainConfig {
        steps: 20,
        batch_size: 4,
        eval_batches: Some(1),
        ..TrainConfig::default()
    };
    pipeline_matches_single_process(model, Arc::new(SyntheticImages::new(8, 3, 0.3, 2)), cfg);
}

#[test]
fn a_corrupt_latest_falls_back_to_the_newest_valid_checkpoint_of_the_same_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = ModelSpec::preset("gpt2-tiny").unwrap();
    let mut t = Trainer::new(ReferenceBackend, model.clone(), markov(), lm_config(3)).unwrap();
    let mut paths = Vec::new();
    for _ in 0..3 {
        t.train_step().unwrap();
        paths.push(t.save_checkpoint(dir.path()).unwrap());
    }
    let graph = t.graph().clone();
    let opt = t.config().optimizer.clone();
    // The newest checkpoint (step 3, which `latest` names) loses a byte of its tensors.
    let tensors = paths[2].join("model.safetensors");
    let mut bytes = std::fs::read(&tensors).unwrap();
    bytes.truncate(bytes.len() - 1);
    std::fs::write(&tensors, &bytes).unwrap();
    let (found, skipped) =
        fusion_train::newest_valid_checkpoint(dir.path(), &graph, &opt, None).unwrap();
    let (path, state) = found.expect("an older checkpoint");
    assert_eq!((path, state.step), (paths[1].clone(), 2));
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(skipped[0].1.contains("corrupt"), "{skipped:?}");

    // Step 2 was written by another run: a run only continues its own checkpoints.
    let state = paths[1].join("state.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    v["run_id"] = "other-run".into();
    std::fs::write(&state, serde_json::to_vec(&v).unwrap()).unwrap();
    let (found, skipped) =
        fusion_train::newest_valid_checkpoint(dir.path(), &graph, &opt, Some("other-run")).unwrap();
    assert_eq!(found.map(|f| f.1.step), Some(2), "{skipped:?}");
    let (found, skipped) =
        fusion_train::newest_valid_checkpoint(dir.path(), &graph, &opt, Some("this-run")).unwrap();
    assert!(found.is_none(), "{skipped:?}");
    assert!(
        skipped
            .iter()
            .any(|(_, why)| why.contains("written by run other-run")),
        "{skipped:?}"
    );

    // A `latest` naming something outside the directory is passed over, not followed.
    std::fs::write(dir.path().join("latest"), "../elsewhere").unwrap();
    let (found, _) = fusion_train::newest_valid_checkpoint(dir.path(), &graph, &opt, None).unwrap();
    assert_eq!(found.map(|f| f.1.step), Some(2));
}
