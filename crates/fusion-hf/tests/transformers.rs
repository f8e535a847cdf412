//! fusionllm against `transformers`, without Python: the fixtures under `tests/fixtures` are small
//! random models saved by `transformers` (scripts/hf_interop.py), with the logits it computed
//! on fixed tokens and the losses of five AdamW steps in PyTorch. Imported here, the models must
//! give the same logits (within 1e-4) and the same fine-tuning losses (within 1e-3), and an
//! export must give back the very tensors under the very names `transformers` wrote.

use fusion_backend::{Backend, CandleBackend, ReferenceBackend};
use fusion_data::{Batch, DataKind, Dataset, Split};
use fusion_exec::{Executor, IdTensor, Mode, Value};
use fusion_hf::{export_hf, HfModel, SafetensorsDir};
use fusion_train::{
    load_all_weights, OptimizerConfig, ScheduleConfig, TrainConfig, Trainer, WeightSource,
};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

const FIXTURES: [&str; 3] = ["gpt2", "llama", "llama-tied-bf16-sharded"];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

#[derive(Deserialize)]
struct Expected {
    tokens: Vec<Vec<u32>>,
    logits: Vec<f32>,
    finetune: Option<Finetune>,
}

#[derive(Deserialize)]
struct Finetune {
    lr: f32,
    weight_decay: f32,
    betas: [f32; 2],
    eps: f32,
    batches: Vec<TokenBatch>,
    losses: Vec<f32>,
}

#[derive(Clone, Deserialize)]
struct TokenBatch {
    inputs: Vec<Vec<u32>>,
    targets: Vec<Vec<u32>>,
}

fn expected(name: &str) -> Expected {
    let text = std::fs::read(fixture(name).join("expected.json")).expect("expected.json");
    serde_json::from_slice(&text).expect("valid expected.json")
}

/// The model's logits on `tokens` (a batch of equal-length rows), computed on `backend`.
fn logits<B: Backend>(backend: B, model: &HfModel, tokens: &[Vec<u32>]) -> Vec<f32> {
    let (b, t) = (tokens.len(), tokens[0].len());
    let graph = Arc::new(model.spec().graph(b, t).expect("graph"));
    let params = load_all_weights(model, &graph).expect("weights");
    let exec = Executor::new(backend, graph.clone()).expect("executor");
    let device = exec.upload_params(&params).expect("upload");
    let ids: Vec<u32> = tokens.concat();
    let feeds = HashMap::from([
        (
            graph.inputs[0],
            Value::Ids(IdTensor::new(ids.clone(), vec![b, t]).expect("ids")),
        ),
        (
            graph.inputs[1],
            Value::Ids(IdTensor::new(ids, vec![b, t]).expect("ids")),
        ),
    ]);
    let pass = exec
        .forward(&device, feeds, Mode::Eval, false)
        .expect("forward");
    let out = pass.output(graph.outputs[1]).expect("logits");
    exec.backend()
        .to_vec(out.float().expect("float"))
        .expect("to host")
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn imported_models_give_the_logits_transformers_gives() {
    for name in FIXTURES {
        let model = HfModel::open(&fixture(name)).expect("open");
        let want = expected(name);
        let candle = max_abs_diff(
            &logits(CandleBackend::cpu(), &model, &want.tokens),
            &want.logits,
        );
        let reference = max_abs_diff(
            &logits(ReferenceBackend, &model, &want.tokens),
            &want.logits,
        );
        println!(
            "HF-INTEROP {}",
            serde_json::json!({"fixture": name, "check": "logits",
                "max_abs_logit_diff": candle, "reference_backend_max_abs_logit_diff": reference})
        );
        assert!(candle <= 1e-4, "{name}: candle logits differ by {candle}");
        assert!(
            reference <= 1e-4,
            "{name}: reference logits differ by {reference}"
        );
    }
}

/// The fixture's fine-tuning batches, in order.
struct FixedBatches {
    vocab: usize,
    batches: Vec<TokenBatch>,
}

impl Dataset for FixedBatches {
    fn describe(&self) -> String {
        format!("{} fixed batches", self.batches.len())
    }
    fn kind(&self) -> DataKind {
        DataKind::Text { vocab: self.vocab }
    }
    fn batch(&self, _: Split, index: u64, batch: usize, seq: usize) -> fusion_data::Result<Batch> {
        let b = &self.batches[index as usize % self.batches.len()];
        Ok(Batch::Tokens {
            inputs: b.inputs.concat(),
            targets: b.targets.concat(),
            batch,
            seq,
        })
    }
    fn eval_batches(&self, _: usize) -> usize {
        1
    }
}

fn finetune_config(f: &Finetune) -> TrainConfig {
    TrainConfig {
        steps: f.losses.len() as u64,
        batch_size: f.batches[0].inputs.len(),
        seq_len: f.batches[0].inputs[0].len(),
        micro_batches: 1,
        optimizer: OptimizerConfig::AdamW {
            beta1: f.betas[0],
            beta2: f.betas[1],
            eps: f.eps,
            weight_decay: f.weight_decay,
        },
        schedule: ScheduleConfig {
            lr: f.lr,
            min_lr: f.lr,
            warmup_steps: 0,
        },
        clip_norm: None,
        eval_every: 0,
        ..TrainConfig::default()
    }
}

#[test]
fn fine_tuning_an_imported_model_gives_pytorchs_losses() {
    for name in FIXTURES {
        let want = expected(name);
        let Some(f) = want.finetune else { continue };
        let model = HfModel::open(&fixture(name)).expect("open");
        let vocab = model.spec().vocab().expect("a language model");
        let data = Arc::new(FixedBatches {
            vocab,
            batches: f.batches.clone(),
        });
        let cfg = finetune_config(&f);
        let mut trainer =
            Trainer::new(CandleBackend::cpu(), model.spec().clone(), data, cfg).expect("trainer");
        trainer.init_from(&model).expect("init");
        let losses: Vec<f32> = (0..f.losses.len())
            .map(|_| trainer.train_step().expect("step").0)
            .collect();
        let diff = max_abs_diff(&losses, &f.losses);
        println!(
            "HF-INTEROP {}",
            serde_json::json!({"fixture": name, "check": "finetune", "steps": losses.len(),
                "fusionllm_losses": losses, "pytorch_losses": f.losses, "max_abs_loss_diff": diff})
        );
        assert!(diff <= 1e-3, "{name}: losses {losses:?} vs {:?}", f.losses);
        assert!(
            losses.last() < losses.first(),
            "{name}: fine-tuning did not lower the loss: {losses:?}"
        );
    }
}

#[test]
fn an_export_holds_transformers_tensors_under_transformers_names() {
    for name in FIXTURES {
        let model = HfModel::open(&fixture(name)).expect("open");
        let graph = model.spec().graph(1, 4).expect("graph");
        let out = tempfile::tempdir().expect("tempdir");
        export_hf(out.path(), model.spec(), &graph, &model).expect("export");
        let original = SafetensorsDir::open(&fixture(name)).expect("original");
        let exported = SafetensorsDir::open(out.path()).expect("exported");
        let names: Vec<&str> = exported.names().collect();
        assert_eq!(names, original.names().collect::<Vec<_>>(), "{name}");
        for n in names {
            assert_eq!(
                exported.entry(n).map(|e| &e.shape),
                original.entry(n).map(|e| &e.shape),
                "{name}: {n}"
            );
            let a = exported.read_f32(n).expect("read");
            let b = original.read_f32(n).expect("read");
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name}: {n} changed on the way through"
            );
        }
        // Read back, the export is the same model with the same weights.
        let again = HfModel::open(out.path()).expect("reopen");
        assert_eq!(again.spec().kind, model.spec().kind, "{name}");
        again.check(&graph).expect("complete");
    }
}
