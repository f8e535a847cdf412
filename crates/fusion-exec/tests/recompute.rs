//! Activation recomputation: a pass that keeps only segment boundaries and recomputes each
//! segment in backward gives bit-identical loss and gradients to one that stores the whole
//! tape, for every segment count, on both backends. (Buffer updates come from the first forward
//! only, by construction: the recomputing forward drops them.)

mod common;

use common::{feeds, small_gpt, small_resnet};

use fusion_backend::{Backend, CandleBackend, ReferenceBackend};
use fusion_exec::{init_params, Executor, Mode};
use fusion_graph::Graph;
use std::collections::HashMap;
use std::sync::Arc;

/// Loss, every parameter gradient and every float input gradient, as f64 bit patterns.
type Run = (u64, Vec<Option<Vec<u64>>>, Vec<(usize, Vec<u64>)>);

fn run<B: Backend>(b: &B, graph: &Graph, classes: u32, segments: Option<usize>) -> Run {
    let params: Vec<B::Tensor> = graph
        .params
        .iter()
        .zip(init_params(graph, 5))
        .map(|(s, v)| b.upload(v, &s.shape).unwrap())
        .collect();
    let exec = Executor::new(b.clone(), Arc::new(graph.clone()))
        .unwrap()
        .with_recompute(segments);
    // Recomputation really is on: the segments asked for (at most one per node).
    let n = graph.nodes.len();
    assert_eq!(
        exec.recompute_segments(),
        segments.map_or(0, |k| k.clamp(1, n))
    );
    let pass = exec
        .forward(&params, feeds(b, graph, classes), Mode::Train, true)
        .unwrap();
    let bits =
        |t: &B::Tensor| -> Vec<u64> { b.to_f64(t).unwrap().iter().map(|x| x.to_bits()).collect() };
    let loss = bits(pass.output(graph.outputs[0]).unwrap().float().unwrap())[0];
    let seed = HashMap::from([(graph.outputs[0], b.upload(vec![1.0], &[1]).unwrap())]);
    let grads = exec.backward(pass, &params, seed).unwrap();
    let params = grads.params.iter().map(|g| g.as_ref().map(bits)).collect();
    let mut inputs: Vec<(usize, Vec<u64>)> =
        grads.inputs.iter().map(|(t, g)| (t.0, bits(g))).collect();
    inputs.sort();
    (loss, params, inputs)
}

fn assert_identical<B: Backend>(b: B, graph: Graph, classes: u32) {
    let stored = run(&b, &graph, classes, None);
    for (g, spec) in stored.1.iter().zip(&graph.params) {
        assert_eq!(
            g.is_some(),
            spec.trainable,
            "{}: gradient iff trainable",
            spec.name
        );
    }
    for k in [1, 2, 3, 7, graph.nodes.len(), graph.nodes.len() + 5] {
        let recomputed = run(&b, &graph, classes, Some(k));
        assert_eq!(stored.0, recomputed.0, "loss with {k} segments");
        assert_eq!(stored.2, recomputed.2, "input gradients with {k} segments");
        for (i, (a, r)) in stored.1.iter().zip(&recomputed.1).enumerate() {
            assert!(
                a == r,
                "{}: gradient differs with {k} segments",
                graph.params[i].name
            );
        }
    }
}

#[test]
fn recomputed_gpt2_gradients_are_bit_identical() {
    assert_identical(ReferenceBackend, small_gpt(), 13);
    assert_identical(CandleBackend::for_tests(false).unwrap(), small_gpt(), 13);
}

#[test]
fn recomputed_resnet_gradients_are_bit_identical() {
    assert_identical(ReferenceBackend, small_resnet(), 3);
    assert_identical(CandleBackend::for_tests(false).unwrap(), small_resnet(), 3);
}

#[test]
fn a_stage_with_a_fed_activation_recomputes_from_it() {
    // A middle pipeline stage: its inputs are activations, and the input gradients it sends
    // upstream must match too.
    let g = small_gpt();
    let assignment = g.even_assignment(3).unwrap();
    let stage = g.split(&assignment).unwrap().remove(1).graph;
    assert!(stage
        .inputs
        .iter()
        .any(|t| stage.tensor(*t).dtype.is_float()));
    let b = CandleBackend::for_tests(false).unwrap();
    let params: Vec<_> = stage
        .params
        .iter()
        .zip(init_params(&stage, 2))
        .map(|(s, v)| b.upload(v, &s.shape).unwrap())
        .collect();
    let seeds = |b: &CandleBackend| -> HashMap<_, _> {
        stage
            .outputs
            .iter()
            .map(|t| {
                let n = stage.tensor(*t).numel();
                let v = (0..n).map(|i| (i % 5) as f32 * 0.1 - 0.2).collect();
                (*t, b.upload(v, &stage.tensor(*t).shape).unwrap())
            })
            .collect()
    };
    let grads = |k: Option<usize>| {
        let exec = Executor::new(b.clone(), Arc::new(stage.clone()))
            .unwrap()
            .with_recompute(k);
        let pass = exec
            .forward(&params, feeds(&b, &stage, 13), Mode::Train, true)
            .unwrap();
        let g = exec.backward(pass, &params, seeds(&b)).unwrap();
        let mut v: Vec<(usize, Vec<f32>)> = g
            .inputs
            .iter()
            .map(|(t, x)| (t.0, b.to_vec(x).unwrap()))
            .collect();
        v.sort_by_key(|x| x.0);
        assert!(!v.is_empty());
        v
    };
    assert_eq!(grads(None), grads(Some(1)));
    assert_eq!(grads(None), grads(Some(4)));
}
