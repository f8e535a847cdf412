//! Mixed precision: the candle backend computing in bf16 or f16 while the trainer keeps f32
//! master weights and optimizer state, against the same runs in f32; f16's dynamic loss
//! scaling under a real overflow; checkpoints of a half-precision run.

use fusion_backend::{Backend, CandleBackend, Precision};
use fusion_data::{Dataset, MarkovCorpus, SyntheticImages};
use fusion_graph::{Graph, ParamSpec};
use fusion_models::ModelSpec;
use fusion_train::{
    LossScaler, OptimizerPlacement, Report, ScheduleConfig, TrainConfig, Trainer, WeightSource,
};
use std::collections::HashMap;
use std::sync::Arc;

fn backend(p: Precision) -> CandleBackend {
    CandleBackend::for_tests(false)
        .expect("the test device")
        .with_precision(p)
        .expect("a half-precision candle backend")
}

fn markov() -> Arc<dyn Dataset> {
    Arc::new(MarkovCorpus::new(32, 4, 0.5, 9).expect("corpus"))
}

fn config(steps: u64) -> TrainConfig {
    TrainConfig {
        steps,
        batch_size: 4,
        seq_len: 16,
        micro_batches: 2,
        schedule: ScheduleConfig {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 3,
        },
        eval_every: 0,
        eval_batches: Some(2),
        ..TrainConfig::default()
    }
}

fn train(p: Precision, model: &str, data: Arc<dyn Dataset>, cfg: TrainConfig) -> Report {
    let spec = ModelSpec::preset(model).expect("preset");
    let mut t = Trainer::new(backend(p), spec, data, cfg).expect("trainer");
    t.run(|_, _| {}).expect("run")
}

fn final_eval(r: &Report) -> f32 {
    r.evals.last().expect("a final evaluation").loss
}

/// The largest relative difference between two runs' step losses.
fn loss_gap(a: &Report, b: &Report) -> f32 {
    a.steps
        .iter()
        .zip(&b.steps)
        .map(|(x, y)| (x.loss - y.loss).abs() / y.loss.abs())
        .fold(0.0, f32::max)
}

#[test]
fn half_precision_language_model_training_follows_f32() {
    let reference = train(Precision::F32, "gpt2-tiny", markov(), config(30));
    for (p, step_tol) in [(Precision::Bf16, 0.03), (Precision::F16, 0.01)] {
        let half = train(p, "gpt2-tiny", markov(), config(30));
        assert_eq!(half.backend, backend(p).name());
        assert!(half.backend.ends_with(p.as_str()), "{}", half.backend);
        let gap = loss_gap(&half, &reference);
        assert!(
            gap < step_tol,
            "{}: step losses differ by {gap}",
            p.as_str()
        );
        let (h, r) = (final_eval(&half), final_eval(&reference));
        assert!(
            (h - r).abs() / r < 0.01,
            "{}: eval loss {h} against f32's {r}",
            p.as_str()
        );
        assert!(
            h < reference.steps[0].loss * 0.8,
            "{} did not learn",
            p.as_str()
        );
        // Only f16 scales its loss.
        assert_eq!(half.loss_scale.is_some(), p == Precision::F16);
    }
}

#[test]
fn master_weights_stay_f32_under_bf16_compute() {
    let spec = ModelSpec::preset("gpt2-tiny").expect("preset");
    let b = backend(Precision::Bf16);
    let mut t = Trainer::new(b.clone(), spec, markov(), config(3)).expect("trainer");
    assert_eq!(
        t.optimizer_on_device(),
        !b.in_host_memory(),
        "auto keeps the optimizer beside tensors off the host"
    );
    t.run(|_, _| {}).expect("run");
    // Values that bf16 cannot hold survive the steps: the weights were not rounded to it.
    let (mut total, mut off_grid) = (0usize, 0usize);
    for p in t.params() {
        let rounded = b
            .to_vec(&b.upload(p.clone(), &[p.len()]).expect("upload"))
            .expect("download");
        total += p.len();
        off_grid += p.iter().zip(&rounded).filter(|(x, y)| x != y).count();
    }
    assert!(
        off_grid > total / 2,
        "only {off_grid} of {total} weights are off bf16's grid"
    );
}

#[test]
fn half_precision_batch_norm_and_convolutions_train() {
    let data = || -> Arc<dyn Dataset> { Arc::new(SyntheticImages::new(8, 4, 0.3, 5)) };
    let cfg = TrainConfig {
        batch_size: 8,
        seq_len: 1,
        micro_batches: 1,
        ..config(12)
    };
    let reference = train(Precision::F32, "resnet-tiny", data(), cfg.clone());
    let half = train(Precision::Bf16, "resnet-tiny", data(), cfg);
    let gap = loss_gap(&half, &reference);
    assert!(
        gap < 0.03,
        "resnet-tiny in bf16: step losses differ by {gap}"
    );
}

/// The weights of a trainer, with the final layer norm's gain scaled by `factor`.
struct Scaled {
    weights: HashMap<String, Vec<f32>>,
}

impl Scaled {
    fn from(t: &Trainer<CandleBackend>, factor: f32) -> Self {
        let weights = t
            .graph()
            .params
            .iter()
            .zip(t.params())
            .map(|(spec, v)| {
                let f = if spec.name == "ln_f.gamma" {
                    factor
                } else {
                    1.0
                };
                (spec.name.clone(), v.iter().map(|x| x * f).collect())
            })
            .collect();
        Scaled { weights }
    }
}

impl WeightSource for Scaled {
    fn describe(&self) -> String {
        "scaled weights".into()
    }
    fn check(&self, _graph: &Graph) -> fusion_train::Result<()> {
        Ok(())
    }
    fn load(&self, param: &ParamSpec) -> fusion_train::Result<Vec<f32>> {
        Ok(self.weights.get(&param.name).cloned().unwrap_or_default())
    }
}

#[test]
fn f16_overflow_skips_the_step_and_halves_the_scale_until_gradients_fit() {
    let spec = ModelSpec::preset("gpt2-tiny").expect("preset");
    let seed_run =
        Trainer::new(backend(Precision::F16), spec.clone(), markov(), config(8)).expect("trainer");
    // A final layer norm gain 30x its size makes the (tied) output embedding's gradient far
    // larger than 65504 / 2^15 = 2, so at the initial scale the f16 gradients overflow for real
    // (the gain scales the features the output layer's gradient is taken against; a gain
    // anywhere before a normalisation would be normalised away).
    let init = Scaled::from(&seed_run, 30.0);
    let mut t = Trainer::with_weights(
        backend(Precision::F16),
        spec,
        markov(),
        config(8),
        Some(&init),
    )
    .expect("trainer");
    let before = t.params().to_vec();
    let (loss, norm, _) = t.train_step().expect("a skipped step is not an error");
    assert!(loss.is_finite());
    assert_eq!(norm, 0.0, "a skipped step reports no gradient norm");
    // On a GPU the state stays there between steps: bring it back to compare.
    t.settle().expect("settle");
    assert_eq!(t.params(), &before[..], "a skipped step moved the weights");
    let report = t.run(|_, _| {}).expect("the run goes on");
    let scaler = report.loss_scale.expect("f16 reports its loss scale");
    let skipped_in_run = report.steps.iter().filter(|s| s.grad_norm == 0.0).count();
    assert_eq!(scaler.skipped, 1 + skipped_in_run as u64);
    assert!(
        scaler.skipped >= 2,
        "one halving sufficed: the overflow was marginal"
    );
    assert!(scaler.scale < LossScaler::default().scale);
    assert!(
        scaler.skipped < 8,
        "every step overflowed: the scale never came down far enough"
    );
    assert!(report.steps.iter().all(|s| s.loss.is_finite()));
    assert_ne!(t.params(), &before[..], "no step was ever applied");
}

#[test]
fn an_f16_run_resumes_bit_exactly_with_its_loss_scale() {
    let spec = ModelSpec::preset("gpt2-tiny").expect("preset");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut whole =
        Trainer::new(backend(Precision::F16), spec.clone(), markov(), config(6)).expect("trainer");
    let whole_report = whole.run(|_, _| {}).expect("run");
    let first = TrainConfig {
        checkpoint_dir: Some(dir.path().to_path_buf()),
        ..config(3)
    };
    let mut t =
        Trainer::new(backend(Precision::F16), spec.clone(), markov(), first).expect("trainer");
    t.run(|_, _| {}).expect("first half");
    let mut resumed =
        Trainer::new(backend(Precision::F16), spec, markov(), config(6)).expect("trainer");
    resumed.load_checkpoint(dir.path()).expect("resume");
    let report = resumed.run(|_, _| {}).expect("second half");
    assert_eq!(report.start_step, 3);
    assert_eq!(resumed.params(), whole.params(), "not bit-exact");
    assert_eq!(report.loss_scale, whole_report.loss_scale);
    assert_eq!(
        report.loss_scale.map(|s| s.good_steps),
        Some(6),
        "the loss scale's run of good steps was not carried over"
    );
}

/// A run of `cfg` in precision `p` with the optimizer state where `on` says, from `init`'s
/// weights when given.
fn train_on(
    p: Precision,
    on: OptimizerPlacement,
    cfg: TrainConfig,
    init: Option<&dyn WeightSource>,
) -> (Report, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let spec = ModelSpec::preset("gpt2-tiny").expect("preset");
    let cfg = TrainConfig {
        optimizer_on: on,
        ..cfg
    };
    let mut t = Trainer::with_weights(backend(p), spec, markov(), cfg, init).expect("trainer");
    assert_eq!(t.optimizer_on_device(), on == OptimizerPlacement::Device);
    let start = t.params().to_vec();
    let report = t.run(|_, _| {}).expect("run");
    (report, start, t.params().to_vec())
}

/// How far apart two runs moved the weights from where they started: the L2 distance between
/// their updates over the L2 length of `b`'s. (Element by element, Adam turns the rounding
/// noise of a 16-bit gradient near zero into whole steps of either sign.)
fn update_gap(start: &[Vec<f32>], a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut apart, mut moved) = (0.0f64, 0.0f64);
    for ((s, x), y) in start
        .iter()
        .flatten()
        .zip(a.iter().flatten())
        .zip(b.iter().flatten())
    {
        apart += ((x - y) as f64).powi(2);
        moved += ((y - s) as f64).powi(2);
    }
    (apart / moved).sqrt()
}

#[test]
fn the_optimizer_on_the_device_follows_the_host_in_half_precision() {
    for p in [Precision::Bf16, Precision::F16] {
        // One step from the same weights takes the same gradients: the masters then differ by
        // the rounding of the update's f32 kernels alone.
        let (_, start, dw) = train_on(p, OptimizerPlacement::Device, config(1), None);
        let (_, _, hw) = train_on(p, OptimizerPlacement::Host, config(1), None);
        let gap = update_gap(&start, &dw, &hw);
        assert!(gap < 1e-5, "{p:?}: one step's updates differ by {gap}");
        // Later steps compute with 16-bit copies of masters that differ in their last f32 bits,
        // and a copy that rounds the other way changes that step's gradients a little.
        let (device, start, dw) = train_on(p, OptimizerPlacement::Device, config(8), None);
        let (host, _, hw) = train_on(p, OptimizerPlacement::Host, config(8), None);
        let gap = loss_gap(&device, &host);
        assert!(gap < 2e-3, "{p:?}: losses differ by {gap} relative");
        let gap = update_gap(&start, &dw, &hw);
        assert!(gap < 5e-2, "{p:?}: 8 steps' updates differ by {gap}");
        assert_eq!(device.loss_scale, host.loss_scale, "{p:?}");
        // The masters are f32: most trained weights are off the 16-bit grid.
        let b = backend(p);
        let on_grid = dw
            .iter()
            .flatten()
            .filter(|&&x| {
                let up = b.upload(vec![x], &[1]).expect("upload");
                b.to_vec(&up).expect("download")[0] == x
            })
            .count();
        let total = dw.iter().map(Vec::len).sum::<usize>();
        assert!(
            on_grid < total / 2,
            "{p:?}: {on_grid} of {total} master weights are on the 16-bit grid"
        );
    }
}

#[test]
fn f16_on_the_device_skips_the_overflowing_steps_the_host_skips() {
    let spec = ModelSpec::preset("gpt2-tiny").expect("preset");
    let seed_run =
        Trainer::new(backend(Precision::F16), spec, markov(), config(8)).expect("trainer");
    let init = Scaled::from(&seed_run, 30.0);
    let (device, start, dw) = train_on(
        Precision::F16,
        OptimizerPlacement::Device,
        config(8),
        Some(&init),
    );
    let (host, _, hw) = train_on(
        Precision::F16,
        OptimizerPlacement::Host,
        config(8),
        Some(&init),
    );
    let skips = |r: &Report| -> Vec<u64> {
        r.steps
            .iter()
            .filter(|s| s.grad_norm == 0.0)
            .map(|s| s.step)
            .collect()
    };
    assert!(skips(&host).len() >= 2, "the overflow was not real");
    assert_eq!(skips(&device), skips(&host), "different steps were skipped");
    assert_eq!(device.loss_scale, host.loss_scale);
    let gap = update_gap(&start, &dw, &hw);
    assert!(gap < 1e-2, "weights differ by {gap} relative");
}
