//! Finite-difference gradient checks of every operator on both backends (the candle backend in
//! f64, running the same kernels and compositions it trains with in f32), and forward/backward
//! agreement between the reference backend and candle in f32, bf16 and f16 (each at its
//! tolerance).

mod common;

use common::{agree, gradcheck, rng, Case, Input};
use fusion_backend::{CandleBackend, Precision, ReferenceBackend};
use fusion_graph::Op;
use rand::Rng;

fn check(case: impl Fn(&mut rand_chacha::ChaCha8Rng) -> Case) {
    for seed in 0..3u64 {
        let c = case(&mut rng(1000 + seed));
        let n_ref = gradcheck(&ReferenceBackend, &c, seed);
        let n_candle = gradcheck(&CandleBackend::for_tests(true).unwrap(), &c, seed);
        assert!(n_ref > 0 && n_ref == n_candle);
        let f32 = CandleBackend::for_tests(false).unwrap();
        agree(&ReferenceBackend, &f32, &c, seed, 1e-4);
        // Half precision: 8 (bf16) or 11 (f16) significant bits, f32 accumulation.
        for (p, rel) in [(Precision::Bf16, BF16_TOL), (Precision::F16, F16_TOL)] {
            let half = f32.clone().with_precision(p).unwrap();
            agree(&ReferenceBackend, &half, &c, seed, rel);
        }
    }
}

/// Largest difference from the f64 reference, relative to the largest magnitude, that a
/// forward or gradient computed in bf16 may show: four roundings at its unit roundoff 2^-8
/// (measured: under 8e-3 for every operator).
const BF16_TOL: f64 = 1.6e-2;
/// The same for f16, unit roundoff 2^-11 (measured: under 1.3e-3, layer norm's input gradient).
const F16_TOL: f64 = 2e-3;

fn dim(r: &mut rand_chacha::ChaCha8Rng, lo: usize, hi: usize) -> usize {
    r.random_range(lo..=hi)
}

#[test]
fn linear() {
    check(|r| {
        let (a, t, i, o) = (dim(r, 1, 3), dim(r, 1, 4), dim(r, 1, 7), dim(r, 1, 6));
        Case::new(
            Op::Linear { bias: true },
            vec![Input::Float(vec![a, t, i])],
            vec![vec![o, i], vec![o]],
        )
    });
}

#[test]
fn linear_without_bias() {
    check(|r| {
        let (n, i, o) = (dim(r, 1, 5), dim(r, 1, 6), dim(r, 1, 6));
        Case::new(
            Op::Linear { bias: false },
            vec![Input::Float(vec![n, i])],
            vec![vec![o, i]],
        )
    });
}

#[test]
fn embedding() {
    check(|r| {
        let (b, t, v, d) = (dim(r, 1, 3), dim(r, 1, 5), dim(r, 2, 9), dim(r, 1, 5));
        Case::new(
            Op::Embedding,
            vec![Input::Ids(vec![b, t], v as u32)],
            vec![vec![v, d]],
        )
    });
}

#[test]
fn positional_embedding() {
    check(|r| {
        let (b, t, d) = (dim(r, 1, 3), dim(r, 1, 5), dim(r, 1, 5));
        let t_max = t + dim(r, 0, 3);
        Case::new(
            Op::PositionalEmbedding,
            vec![Input::Float(vec![b, t, d])],
            vec![vec![t_max, d]],
        )
    });
}

#[test]
fn layer_norm() {
    check(|r| {
        let (b, t, d) = (dim(r, 1, 3), dim(r, 1, 4), dim(r, 2, 9));
        Case::new(
            Op::LayerNorm { eps: 1e-5 },
            vec![Input::Float(vec![b, t, d])],
            vec![vec![d], vec![d]],
        )
    });
}

#[test]
fn causal_self_attention() {
    check(|r| {
        let (b, t, h, d) = (dim(r, 1, 2), dim(r, 1, 6), dim(r, 1, 3), dim(r, 1, 4));
        Case::new(
            Op::CausalSelfAttention { n_head: h },
            vec![Input::Float(vec![b, t, 3 * h * d])],
            vec![],
        )
    });
}

#[test]
fn gelu() {
    check(|r| {
        Case::new(
            Op::Gelu,
            vec![Input::Float(vec![dim(r, 1, 4), dim(r, 1, 9)])],
            vec![],
        )
    });
}

#[test]
fn relu() {
    check(|r| {
        Case::new(
            Op::Relu,
            vec![Input::Float(vec![dim(r, 1, 4), dim(r, 1, 9)])],
            vec![],
        )
    });
}

#[test]
fn add() {
    check(|r| {
        let s = vec![dim(r, 1, 4), dim(r, 1, 5)];
        Case::new(
            Op::Add,
            vec![Input::Float(s.clone()), Input::Float(s)],
            vec![],
        )
    });
}

#[test]
fn conv2d() {
    check(|r| {
        let (n, c, o) = (dim(r, 1, 2), dim(r, 1, 3), dim(r, 1, 3));
        let (kernel, stride, padding) = (dim(r, 1, 3), dim(r, 1, 2), dim(r, 0, 1));
        let (h, w) = (dim(r, kernel, 7), dim(r, kernel, 7));
        Case::new(
            Op::Conv2d {
                kernel,
                stride,
                padding,
                bias: true,
            },
            vec![Input::Float(vec![n, c, h, w])],
            vec![vec![o, c, kernel, kernel], vec![o]],
        )
    });
}

#[test]
fn batch_norm2d() {
    check(|r| {
        let (n, c, h, w) = (dim(r, 2, 3), dim(r, 1, 3), dim(r, 1, 4), dim(r, 1, 4));
        let mut case = Case::new(
            Op::BatchNorm2d {
                eps: 1e-5,
                momentum: 0.1,
            },
            vec![Input::Float(vec![n, c, h, w])],
            vec![vec![c], vec![c], vec![c], vec![c]],
        );
        case.frozen = vec![2, 3];
        case.positive = vec![3];
        case
    });
}

#[test]
fn max_pool2d() {
    check(|r| {
        let (kernel, stride) = (dim(r, 2, 3), dim(r, 1, 2));
        let padding = dim(r, 0, kernel / 2);
        Case::new(
            Op::MaxPool2d {
                kernel,
                stride,
                padding,
            },
            vec![Input::Float(vec![
                dim(r, 1, 2),
                dim(r, 1, 2),
                dim(r, kernel, 7),
                dim(r, kernel, 7),
            ])],
            vec![],
        )
    });
}

#[test]
fn avg_pool2d() {
    check(|r| {
        let (kernel, stride) = (dim(r, 1, 3), dim(r, 1, 3));
        Case::new(
            Op::AvgPool2d { kernel, stride },
            vec![Input::Float(vec![
                dim(r, 1, 2),
                dim(r, 1, 2),
                dim(r, kernel, 7),
                dim(r, kernel, 7),
            ])],
            vec![],
        )
    });
}

#[test]
fn global_avg_pool() {
    check(|r| {
        Case::new(
            Op::GlobalAvgPool,
            vec![Input::Float(vec![
                dim(r, 1, 3),
                dim(r, 1, 4),
                dim(r, 1, 4),
                dim(r, 1, 4),
            ])],
            vec![],
        )
    });
}

#[test]
fn flatten() {
    check(|r| {
        Case::new(
            Op::Flatten,
            vec![Input::Float(vec![dim(r, 1, 3), dim(r, 1, 4), dim(r, 1, 4)])],
            vec![],
        )
    });
}

#[test]
fn softmax_cross_entropy() {
    check(|r| {
        let (b, t, v) = (dim(r, 1, 3), dim(r, 1, 4), dim(r, 2, 11));
        Case::new(
            Op::SoftmaxCrossEntropy,
            vec![
                Input::Float(vec![b, t, v]),
                Input::Ids(vec![b, t], v as u32),
            ],
            vec![],
        )
    });
}

#[test]
fn rms_norm() {
    check(|r| {
        let (b, t, d) = (dim(r, 1, 3), dim(r, 1, 4), dim(r, 2, 9));
        Case::new(
            Op::RmsNorm { eps: 1e-5 },
            vec![Input::Float(vec![b, t, d])],
            vec![vec![d]],
        )
    });
}

#[test]
fn silu() {
    check(|r| {
        let (b, d) = (dim(r, 1, 4), dim(r, 1, 9));
        Case::new(Op::Silu, vec![Input::Float(vec![b, d])], vec![])
    });
}

#[test]
fn mul() {
    check(|r| {
        let (b, t, d) = (dim(r, 1, 3), dim(r, 1, 4), dim(r, 1, 6));
        Case::new(
            Op::Mul,
            vec![Input::Float(vec![b, t, d]), Input::Float(vec![b, t, d])],
            vec![],
        )
    });
}

#[test]
fn grouped_query_attention_with_rotary_positions() {
    check(|r| {
        let (b, t, kv) = (dim(r, 1, 2), dim(r, 1, 6), dim(r, 1, 2));
        let (g, d) = (dim(r, 1, 3), 2 * dim(r, 1, 3));
        let h = kv * g;
        Case::new(
            Op::GroupedQueryAttention {
                n_head: h,
                n_kv_head: kv,
                rope_theta: 10000.0,
            },
            vec![
                Input::Float(vec![b, t, h * d]),
                Input::Float(vec![b, t, kv * d]),
                Input::Float(vec![b, t, kv * d]),
            ],
            vec![],
        )
    });
}
