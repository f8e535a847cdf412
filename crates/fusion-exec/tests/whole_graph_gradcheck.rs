//! The executor's reverse pass over whole models (tied embeddings, residual fan-out, batch-norm
//! buffers) agrees with finite differences of the loss, on both backends.

mod common;

use common::feeds;

use fusion_backend::{Backend, CandleBackend, ReferenceBackend};
use fusion_exec::{init_params, Executor, IdTensor, Mode, Value};
use fusion_graph::Graph;
use fusion_models::{Block, Gpt2Config, LlamaConfig, ModelSpec, ResNetConfig, Stem};
use std::collections::HashMap;
use std::sync::Arc;

fn loss<B: Backend>(exec: &Executor<B>, params: &[Vec<f64>]) -> f64 {
    let b = exec.backend();
    let g = exec.graph();
    let dev: Vec<B::Tensor> = g
        .params
        .iter()
        .zip(params)
        .map(|(s, p)| b.upload_f64(p.clone(), &s.shape).unwrap())
        .collect();
    let pass = exec
        .forward(&dev, feeds(b, g, 3), Mode::Train, false)
        .unwrap();
    b.to_f64(pass.output(g.outputs[0]).unwrap().float().unwrap())
        .unwrap()[0]
}

fn check<B: Backend>(b: B, graph: Graph) {
    let graph = Arc::new(graph);
    let exec = Executor::new(b.clone(), graph.clone()).unwrap();
    let params: Vec<Vec<f64>> = init_params(&graph, 5)
        .into_iter()
        .map(|p| p.into_iter().map(|x| x as f64 * 5.0 + 0.01).collect())
        .collect();
    let dev: Vec<B::Tensor> = graph
        .params
        .iter()
        .zip(&params)
        .map(|(s, p)| b.upload_f64(p.clone(), &s.shape).unwrap())
        .collect();
    let pass = exec
        .forward(&dev, feeds(&b, &graph, 3), Mode::Train, true)
        .unwrap();
    let seed = b.upload_f64(vec![1.0], &[1]).unwrap();
    let grads = exec
        .backward(pass, &dev, HashMap::from([(graph.outputs[0], seed)]))
        .unwrap();
    let h = 1e-5;
    let mut checked = 0;
    for (pi, spec) in graph.params.iter().enumerate() {
        if !spec.trainable {
            continue;
        }
        let g = b
            .to_f64(
                grads.params[pi]
                    .as_ref()
                    .unwrap_or_else(|| panic!("no gradient for {}", spec.name)),
            )
            .unwrap();
        for j in [0, spec.numel() / 2, spec.numel() - 1] {
            let mut p = params.clone();
            p[pi][j] += h;
            let up = loss(&exec, &p);
            p[pi][j] -= 2.0 * h;
            let down = loss(&exec, &p);
            let num = (up - down) / (2.0 * h);
            let tol = 1e-6 * num.abs().max(g[j].abs()).max(1e-2);
            assert!(
                (num - g[j]).abs() <= tol,
                "{} [{j}] on {}: analytic {} numeric {num}",
                spec.name,
                b.name(),
                g[j]
            );
            checked += 1;
        }
    }
    assert!(checked > 10);
}

fn tiny_gpt() -> Graph {
    let cfg = Gpt2Config {
        vocab: 5,
        n_ctx: 6,
        n_embd: 8,
        n_layer: 2,
        n_head: 2,
    };
    cfg.graph("gpt-test", 2, 4).unwrap()
}

/// Grouped-query (4 query, 2 key/value heads of 4), rotary positions, SwiGLU, untied head.
fn tiny_llama() -> Graph {
    let cfg = LlamaConfig {
        vocab: 5,
        n_ctx: 6,
        n_embd: 16,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        intermediate: 12,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        tie_embeddings: false,
    };
    cfg.graph("llama-test", 2, 4).unwrap()
}

fn tiny_resnet() -> Graph {
    let cfg = ResNetConfig {
        block: Block::Bottleneck,
        layers: vec![1, 1],
        widths: vec![2, 3],
        stem: Stem::ImageNet,
        in_channels: 1,
        image_size: 12,
        classes: 3,
    };
    cfg.graph("resnet-test", 2).unwrap()
}

#[test]
fn gpt2_whole_graph_gradients() {
    check(ReferenceBackend, tiny_gpt());
    check(CandleBackend::for_tests(true).unwrap(), tiny_gpt());
}

#[test]
fn llama_whole_graph_gradients() {
    check(ReferenceBackend, tiny_llama());
    check(CandleBackend::for_tests(true).unwrap(), tiny_llama());
}

#[test]
fn resnet_whole_graph_gradients() {
    check(ReferenceBackend, tiny_resnet());
    check(CandleBackend::for_tests(true).unwrap(), tiny_resnet());
}

#[test]
fn bad_feeds_are_rejected() {
    let g = Arc::new(ModelSpec::preset("gpt2-tiny").unwrap().graph(1, 4).unwrap());
    let exec = Executor::new(ReferenceBackend, g.clone()).unwrap();
    let params = exec.upload_params(&init_params(&g, 0)).unwrap();
    let mut f = feeds(&ReferenceBackend, &g, 3);
    f.insert(
        g.inputs[0],
        Value::Ids(IdTensor::new(vec![1, 2, 3], vec![1, 3]).unwrap()),
    );
    let err = exec
        .forward(&params, f, Mode::Train, false)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("tokens"), "{err}");
    let mut f = feeds(&ReferenceBackend, &g, 3);
    f.remove(&g.inputs[1]);
    let err = exec
        .forward(&params, f, Mode::Train, false)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("targets") && err.contains("not fed"), "{err}");
    // A token id beyond the vocabulary is an error, not a panic.
    let mut f = feeds(&ReferenceBackend, &g, 3);
    f.insert(
        g.inputs[0],
        Value::Ids(IdTensor::new(vec![0, 1, 2, 999_999], vec![1, 4]).unwrap()),
    );
    let err = exec
        .forward(&params, f, Mode::Train, false)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("999999"), "{err}");
}
