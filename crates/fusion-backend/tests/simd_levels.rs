//! The element-wise kernels give the same bits at every instruction-set level this processor
//! has (baseline, AVX2, AVX-512): the level changes their speed only. (Across processors other
//! parts still differ: `gemm`'s products and the C library's `logf` pick their own code.)

use fusion_backend::simd::{self, Level};
use fusion_backend::{Backend, BinaryOp, CandleBackend, UnaryOp};

type T = <CandleBackend as Backend>::Tensor;

/// Values spread over [-6, 6), with some row lengths that are not multiples of the lanes.
fn tensor(b: &CandleBackend, shape: &[usize], seed: u64) -> T {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 12.0 - 6.0
        })
        .collect();
    b.upload(v, shape).expect("upload")
}

/// The bits of every output of every kernel, at the level in force.
fn outputs(b: &CandleBackend) -> Vec<(String, Vec<u32>)> {
    let bits = |t: &T| -> Vec<u32> { b.to_vec(t).unwrap().iter().map(|x| x.to_bits()).collect() };
    let mut out = Vec::new();
    // Rows of 1,001 logits: 62 full lanes of 16 and a tail of 9.
    let (rows, vocab) = (131, 1001);
    let logits = tensor(b, &[rows, vocab], 1);
    let targets: Vec<u32> = (0..rows as u32).map(|i| (i * 37) % vocab as u32).collect();
    let loss = b.cross_entropy_rows(&logits, &targets).unwrap().unwrap();
    let g = b
        .cross_entropy_rows_backward(&logits, &targets, 0.01)
        .unwrap()
        .unwrap();
    out.push(("cross-entropy".into(), bits(&loss)));
    out.push(("cross-entropy gradient".into(), bits(&g)));
    let x = tensor(b, &[3, 97, 771], 2);
    for op in [
        UnaryOp::Exp,
        UnaryOp::Gelu,
        UnaryOp::GeluGrad,
        UnaryOp::Square,
    ] {
        out.push((format!("{op:?}"), bits(&b.unary(op, &x).unwrap())));
    }
    let row = tensor(b, &[1, 1, 771], 3);
    let y = tensor(b, &[3, 97, 771], 4);
    for op in [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Div] {
        out.push((
            format!("{op:?} row"),
            bits(&b.binary(op, &x, &row).unwrap()),
        ));
        out.push((format!("{op:?}"), bits(&b.binary(op, &x, &y).unwrap())));
    }
    out.push((
        "GELU backward".into(),
        bits(&b.gelu_backward(&x, &y).unwrap().unwrap()),
    ));
    // Layer norm of 291 rows of 771 (lanes and a tail), forward and backward.
    let rows = b.reshape(&x, &[3 * 97, 771]).unwrap();
    let (gain, shift) = (tensor(b, &[771], 5), tensor(b, &[771], 6));
    let [yn, xhat, rstd] = b
        .layer_norm_rows(&rows, &gain, &shift, 1e-5)
        .unwrap()
        .unwrap();
    let dy = b.reshape(&y, &[3 * 97, 771]).unwrap();
    let [dx, dgain, dshift] = b
        .layer_norm_rows_backward(&dy, &xhat, &rstd, &gain)
        .unwrap()
        .unwrap();
    for (name, t) in [
        ("layer norm", &yn),
        ("layer norm dx", &dx),
        ("layer norm dgamma", &dgain),
        ("layer norm dbeta", &dshift),
    ] {
        out.push((name.into(), bits(t)));
    }
    // A bias gradient's column sums over leading dims (771 columns: blocks and a tail).
    out.push((
        "sum over leading dims".into(),
        bits(&b.sum_keepdim(&x, &[0, 1]).unwrap()),
    ));
    // Attention rows of up to 150 keys: blocks of 64 rows and rows that end mid-lane.
    let heads = [6, 150, 32];
    let (q, k, v, dy) = (
        tensor(b, &heads, 5),
        tensor(b, &heads, 6),
        tensor(b, &heads, 7),
        tensor(b, &heads, 8),
    );
    let (att, lse) = b.causal_attention(&q, &k, &v, 0.17).unwrap().unwrap();
    let [dq, dk, dv] = b
        .causal_attention_backward(&q, &k, &v, &att, &lse, &dy, 0.17)
        .unwrap()
        .unwrap();
    for (name, t) in [
        ("attention", &att),
        ("lse", &lse),
        ("dq", &dq),
        ("dk", &dk),
        ("dv", &dv),
    ] {
        out.push((name.into(), bits(t)));
    }
    out
}

#[test]
fn every_level_computes_the_same_bits() {
    let b = CandleBackend::cpu();
    let levels: Vec<Level> = Level::ALL
        .into_iter()
        .filter(|&l| l <= simd::supported())
        .collect();
    simd::force(Some(Level::Baseline));
    let want = outputs(&b);
    for &level in &levels[1..] {
        simd::force(Some(level));
        assert_eq!(simd::level(), level);
        let got_all = outputs(&b);
        assert_eq!(got_all.len(), want.len());
        for ((name, w), (_, got)) in want.iter().zip(got_all) {
            assert_eq!(w.len(), got.len(), "{name}: output length at {level:?}");
            let differ = w.iter().zip(&got).filter(|(a, b)| a != b).count();
            assert_eq!(
                differ, 0,
                "{name}: {differ} values differ at {level:?} from baseline"
            );
        }
    }
    simd::force(None);
}
