//! A 16-bit run keeps the residual stream in f32: a deep stack of residual updates a few
//! thousandths the size of the stream sums as an f32 run sums it, forward and backward, where a 16-bit
//! stream (8 bits of mantissa in bf16) would round the updates away at every sum.

use fusion_backend::{Backend, CandleBackend, Precision};
use fusion_exec::{init_params, Executor, IdTensor, Mode, Value};
use fusion_graph::{DType, Graph, GraphBuilder, Init, Op};
use std::collections::HashMap;
use std::sync::Arc;

const LAYERS: usize = 24;
const WIDTH: usize = 32;
const VOCAB: usize = 16;
const SHAPE: [usize; 2] = [2, 8];

/// Token and position embeddings, then `LAYERS` residual updates `x + W·LayerNorm(x)` whose
/// size is about 3e-3 of the stream's.
fn stream() -> Graph {
    let mut g = GraphBuilder::new("stream");
    let ids = g.input("ids", SHAPE.to_vec(), DType::I32);
    let wte = g.param("wte", vec![VOCAB, WIDTH], Init::Normal { std: 1.0 });
    let wpe = g.param("wpe", vec![SHAPE[1], WIDTH], Init::Normal { std: 1.0 });
    let tok = g.op_with_params("wte", Op::Embedding, &[ids], vec![wte]);
    let mut x = g
        .op_with_params("wpe", Op::PositionalEmbedding, &[tok.unwrap()], vec![wpe])
        .unwrap();
    for l in 0..LAYERS {
        let h = g.op(&format!("ln{l}"), Op::LayerNorm { eps: 1e-5 }, &[x], None);
        let u = g
            .linear(&format!("fc{l}"), h.unwrap(), WIDTH, false)
            .unwrap();
        let std = 3e-3 / (WIDTH as f32).sqrt();
        for p in g.last_params() {
            g.set_init(p, Init::Normal { std });
        }
        x = g.op(&format!("add{l}"), Op::Add, &[x, u], None).unwrap();
    }
    g.output(x);
    g.finish().unwrap()
}

/// The stream's final value and the gradient of its sum with respect to the positional table,
/// on `b`, from parameters already rounded to bf16 (so that both runs start from the same
/// values).
fn run(b: &CandleBackend, graph: &Graph, params: &[Vec<f32>]) -> (Vec<f32>, Vec<f32>) {
    let params: Vec<_> = graph
        .params
        .iter()
        .zip(params)
        .map(|(s, v)| b.upload(v.clone(), &s.shape).unwrap())
        .collect();
    let exec = Executor::new(b.clone(), Arc::new(graph.clone())).unwrap();
    let n: usize = SHAPE.iter().product();
    let ids = (0..n as u32).map(|i| (i * 5 + 3) % VOCAB as u32).collect();
    let feeds = HashMap::from([(
        graph.inputs[0],
        Value::Ids(IdTensor::new(ids, SHAPE.to_vec()).unwrap()),
    )]);
    let pass = exec.forward(&params, feeds, Mode::Train, true).unwrap();
    let out = graph.outputs[0];
    let y = b
        .to_vec(pass.output(out).unwrap().float().unwrap())
        .unwrap();
    let ones = b.upload(vec![1.0; n * WIDTH], &[SHAPE[0], SHAPE[1], WIDTH]);
    let grads = exec
        .backward(pass, &params, HashMap::from([(out, ones.unwrap())]))
        .unwrap();
    let wpe = graph.params.iter().position(|p| p.name == "wpe").unwrap();
    (y, b.to_vec(grads.params[wpe].as_ref().unwrap()).unwrap())
}

/// Largest difference relative to the largest magnitude of `want`.
fn rel_diff(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs());
    diff.fold(0f32, f32::max) / scale
}

#[test]
fn a_bf16_run_sums_the_residual_stream_as_an_f32_run_does() {
    let graph = stream();
    let f32 = CandleBackend::cpu();
    let bf16 = f32.clone().with_precision(Precision::Bf16).unwrap();
    let params: Vec<Vec<f32>> = graph
        .params
        .iter()
        .zip(init_params(&graph, 7))
        .map(|(s, v)| bf16.to_vec(&bf16.upload(v, &s.shape).unwrap()).unwrap())
        .collect();
    let (y32, g32) = run(&f32, &graph, &params);
    let (y16, g16) = run(&bf16, &graph, &params);
    // The updates moved the stream by far more than the tolerance (they are not negligible).
    let (y0, _) = run(&f32, &graph, &{
        let mut p = params.clone();
        for (s, v) in graph.params.iter().zip(&mut p) {
            if s.name.ends_with(".weight") {
                v.iter_mut().for_each(|w| *w = 0.0);
            }
        }
        p
    });
    assert!(
        rel_diff(&y0, &y32) > 5e-3,
        "the updates are too small to test"
    );
    // A bf16 stream would be off by up to 2^-8 at every sum; a wide one only by the updates'
    // own bf16 rounding (2^-8 of a few thousandths).
    let (dy, dg) = (rel_diff(&y16, &y32), rel_diff(&g16, &g32));
    assert!(dy < 2e-4, "stream off by {dy} of its size");
    assert!(dg < 2e-4, "the stream's gradient off by {dg} of its size");
}
