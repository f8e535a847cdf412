//! The KV-cache decoder computes what the training graph computes and what `transformers`
//! computed (fusion-hf's fixtures): the logits at every position, within 1e-4.

use fusion_backend::{Backend, CandleBackend};
use fusion_exec::{Executor, IdTensor, Mode, Value};
use fusion_hf::HfModel;
use fusion_infer::{generate, Decoder, InferError, Sampler};
use fusion_train::load_all_weights;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

const FIXTURES: [&str; 3] = ["gpt2", "llama", "llama-tied-bf16-sharded"];

fn model(name: &str) -> HfModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fusion-hf/tests/fixtures")
        .join(name);
    HfModel::open(&dir).expect("fixture")
}

/// The decoder's logits after each token of `tokens`, concatenated.
fn decoded(decoder: &mut Decoder, tokens: &[u32]) -> Vec<f32> {
    decoder.reset();
    tokens
        .iter()
        .flat_map(|&t| decoder.step(t).expect("step"))
        .collect()
}

/// The training graph's logits for one sequence.
fn graph_logits(model: &HfModel, tokens: &[u32]) -> Vec<f32> {
    let graph = Arc::new(model.spec().graph(1, tokens.len()).expect("graph"));
    let params = load_all_weights(model, &graph).expect("weights");
    let exec = Executor::new(CandleBackend::cpu(), graph.clone()).expect("executor");
    let device = exec.upload_params(&params).expect("upload");
    let ids = || Value::Ids(IdTensor::new(tokens.to_vec(), vec![1, tokens.len()]).expect("ids"));
    let feeds = HashMap::from([(graph.inputs[0], ids()), (graph.inputs[1], ids())]);
    let pass = exec
        .forward(&device, feeds, Mode::Eval, false)
        .expect("forward");
    let out = pass.output(graph.outputs[1]).expect("logits");
    exec.backend()
        .to_vec(out.float().expect("float"))
        .expect("host")
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn the_cached_decoder_gives_transformers_logits_at_every_position() {
    #[derive(serde::Deserialize)]
    struct Expected {
        tokens: Vec<Vec<u32>>,
        logits: Vec<f32>,
    }
    for name in FIXTURES {
        let m = model(name);
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../fusion-hf/tests/fixtures")
            .join(name)
            .join("expected.json");
        let want: Expected =
            serde_json::from_slice(&std::fs::read(path).expect("read")).expect("json");
        let mut decoder = Decoder::new(m.spec(), &m).expect("decoder");
        let got: Vec<f32> = want
            .tokens
            .iter()
            .flat_map(|row| decoded(&mut decoder, row))
            .collect();
        let diff = max_abs_diff(&got, &want.logits);
        assert!(diff <= 1e-4, "{name}: decoder logits differ by {diff}");
    }
}

#[test]
fn the_cached_decoder_matches_the_training_graph_over_a_long_sequence() {
    for name in FIXTURES {
        let m = model(name);
        let mut decoder = Decoder::new(m.spec(), &m).expect("decoder");
        let n = decoder.context().min(30);
        let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 11) % 256).collect();
        let diff = max_abs_diff(&decoded(&mut decoder, &tokens), &graph_logits(&m, &tokens));
        assert!(diff <= 1e-4, "{name}: decoder and graph differ by {diff}");
    }
}

#[test]
fn generation_is_repeatable_and_goes_past_the_context() {
    let m = model("gpt2");
    let mut decoder = Decoder::new(m.spec(), &m).expect("decoder");
    let run = |decoder: &mut Decoder, n| {
        decoder.reset();
        let mut seen = Vec::new();
        let out = generate(decoder, &[5, 6, 7], n, &mut Sampler::new(0.8, 20, 9), |t| {
            seen.push(t)
        })
        .expect("generate");
        assert_eq!(out, seen, "every token is handed over as it comes");
        out
    };
    let a = run(&mut decoder, 10);
    assert_eq!(a.len(), 10);
    assert_eq!(a, run(&mut decoder, 10), "same seed, same text");
    // The fixture reads 32 positions: past them, the latest 16 tokens are read again and the
    // text goes on; before that point it is the same text.
    let long = run(&mut decoder, 100);
    assert_eq!(long.len(), 100);
    assert_eq!(long[..10], a[..]);
    assert!(decoder.position() <= decoder.context());
    decoder.reset();
    let err = generate(
        &mut decoder,
        &[300],
        1,
        &mut Sampler::new(0.0, 0, 1),
        |_| {},
    );
    assert!(matches!(
        err,
        Err(InferError::TokenOutOfRange {
            token: 300,
            vocab: 256
        })
    ));
    assert!(matches!(
        generate(&mut decoder, &[], 1, &mut Sampler::new(0.0, 0, 1), |_| {}),
        Err(InferError::EmptyPrompt)
    ));
}
