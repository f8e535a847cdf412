//! The candle backend's threaded host kernels (taken for large f32 tensors) agree with the
//! reference backend on every broadcasting pattern and unary op.

use fusion_backend::{Backend, BinaryOp, CandleBackend, ReferenceBackend, UnaryOp};

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0 - 1.0) * 1.5)
        .collect()
}

fn close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let tol = 1e-5 * x.abs().max(y.abs()).max(1.0);
        assert!((x - y).abs() <= tol, "{what}[{i}]: {x} vs {y}");
    }
}

const SHAPE: [usize; 3] = [3, 160, 257]; // 123360 elements: above the threading threshold

#[test]
fn unary_and_affine_match_reference() {
    let (c, r) = (CandleBackend::cpu(), ReferenceBackend);
    let n: usize = SHAPE.iter().product();
    let x = data(n, 1)
        .into_iter()
        .map(|v| v.abs() + 0.1)
        .collect::<Vec<_>>();
    let (xc, xr) = (
        c.upload(x.clone(), &SHAPE).unwrap(),
        r.upload(x, &SHAPE).unwrap(),
    );
    for op in [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Recip,
        UnaryOp::Square,
        UnaryOp::Relu,
        UnaryOp::ReluMask,
        UnaryOp::Gelu,
        UnaryOp::GeluGrad,
    ] {
        close(
            &format!("{op:?}"),
            &c.to_vec(&c.unary(op, &xc).unwrap()).unwrap(),
            &r.to_vec(&r.unary(op, &xr).unwrap()).unwrap(),
        );
    }
    close(
        "affine",
        &c.to_vec(&c.affine(&xc, -0.5, 2.0).unwrap()).unwrap(),
        &r.to_vec(&r.affine(&xr, -0.5, 2.0).unwrap()).unwrap(),
    );
}

#[test]
fn broadcasting_patterns_match_reference() {
    let (c, r) = (CandleBackend::cpu(), ReferenceBackend);
    let n: usize = SHAPE.iter().product();
    let a = data(n, 2);
    let (ac, ar) = (
        c.upload(a.clone(), &SHAPE).unwrap(),
        r.upload(a, &SHAPE).unwrap(),
    );
    let patterns: [&[usize]; 7] = [
        &[3, 160, 257],
        &[3, 160, 1],
        &[1, 1, 257],
        &[1, 160, 257],
        &[1, 1, 1],
        &[3, 1, 1],
        &[1, 160, 1],
    ];
    for bs in patterns {
        let m: usize = bs.iter().product();
        let b = data(m, 3).into_iter().map(|v| v + 2.0).collect::<Vec<_>>();
        let (bc, br) = (c.upload(b.clone(), bs).unwrap(), r.upload(b, bs).unwrap());
        for op in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div] {
            let got = c.to_vec(&c.binary(op, &ac, &bc).unwrap()).unwrap();
            let want = r.to_vec(&r.binary(op, &ar, &br).unwrap()).unwrap();
            close(&format!("{op:?} with {bs:?}"), &got, &want);
        }
    }
}

#[test]
fn add_at_last_matches_reference() {
    let (c, r) = (CandleBackend::cpu(), ReferenceBackend);
    let (rows, v) = (300, 400);
    let x = data(rows * v, 4);
    let ids: Vec<u32> = (0..rows as u32).map(|i| (i * 37) % v as u32).collect();
    let got = c
        .to_vec(
            &c.add_at_last(&c.upload(x.clone(), &[rows, v]).unwrap(), &ids, -1.0)
                .unwrap(),
        )
        .unwrap();
    let want = r
        .to_vec(
            &r.add_at_last(&r.upload(x, &[rows, v]).unwrap(), &ids, -1.0)
                .unwrap(),
        )
        .unwrap();
    close("add_at_last", &got, &want);
}

#[test]
fn causal_fill_matches_reference() {
    let (c, r) = (CandleBackend::cpu(), ReferenceBackend);
    let shape = [6, 130, 130];
    let x = data(shape.iter().product(), 5);
    let got = c
        .to_vec(
            &c.causal_fill(&c.upload(x.clone(), &shape).unwrap(), -7.5)
                .unwrap(),
        )
        .unwrap();
    let want = r
        .to_vec(&r.causal_fill(&r.upload(x, &shape).unwrap(), -7.5).unwrap())
        .unwrap();
    close("causal_fill", &got, &want);
}

#[test]
fn sums_over_leading_dims_match_reference() {
    let (c, r) = (CandleBackend::cpu(), ReferenceBackend);
    let n: usize = SHAPE.iter().product();
    let x = data(n, 5);
    let (xc, xr) = (
        c.upload(x.clone(), &SHAPE).unwrap(),
        r.upload(x, &SHAPE).unwrap(),
    );
    // [0] and [0, 1] take the column sums; [1] (not a leading run) and [0, 2] take candle's path.
    for dims in [vec![0], vec![0, 1], vec![1], vec![0, 2]] {
        let got = c.sum_keepdim(&xc, &dims).unwrap();
        let want = r.sum_keepdim(&xr, &dims).unwrap();
        assert_eq!(c.shape(&got), r.shape(&want), "{dims:?}");
        let (g, w) = (c.to_vec(&got).unwrap(), r.to_vec(&want).unwrap());
        // Sums of up to 480 values of magnitude 1.5.
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            assert!((a - b).abs() <= 1e-4, "{dims:?}[{i}]: {a} vs {b}");
        }
    }
}

#[test]
fn split_products_match_reference_for_every_transposition() {
    let (c, r) = (CandleBackend::cpu(), ReferenceBackend);
    // 100 x 300 . 300 x 70 (2.1 M multiply-adds: split between threads, 70 columns not a
    // multiple of the split's alignment) and a small one under the threading threshold.
    for (m, k, n) in [(100, 300, 70), (9, 5, 3)] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let a_shape = if ta { [k, m] } else { [m, k] };
            let b_shape = if tb { [n, k] } else { [k, n] };
            let (a, b) = (data(m * k, 7), data(k * n, 8));
            let got = c
                .matmul(
                    &c.upload(a.clone(), &a_shape).unwrap(),
                    &c.upload(b.clone(), &b_shape).unwrap(),
                    ta,
                    tb,
                )
                .unwrap();
            let want = r
                .matmul(
                    &r.upload(a, &a_shape).unwrap(),
                    &r.upload(b, &b_shape).unwrap(),
                    ta,
                    tb,
                )
                .unwrap();
            assert_eq!(c.shape(&got), vec![m, n]);
            let what = format!("{m}x{k}x{n} ta={ta} tb={tb}");
            close(&what, &c.to_vec(&got).unwrap(), &r.to_vec(&want).unwrap());
        }
    }
}

#[test]
fn linear_with_its_bias_in_the_product_matches_reference() {
    let (c, r) = (CandleBackend::cpu(), ReferenceBackend);
    let (rows, inp, out) = (64, 200, 90);
    let (x, w, bias) = (data(rows * inp, 9), data(out * inp, 10), data(out, 11));
    let got = c
        .linear_bias(
            &c.upload(x.clone(), &[rows, inp]).unwrap(),
            &c.upload(w.clone(), &[out, inp]).unwrap(),
            &c.upload(bias.clone(), &[out]).unwrap(),
        )
        .unwrap()
        .expect("the candle backend fuses the bias on the CPU");
    let (xr, wr) = (
        r.upload(x, &[rows, inp]).unwrap(),
        r.upload(w, &[out, inp]).unwrap(),
    );
    let want = r
        .binary(
            BinaryOp::Add,
            &r.matmul(&xr, &wr, false, true).unwrap(),
            &r.upload(bias, &[1, out]).unwrap(),
        )
        .unwrap();
    close(
        "linear",
        &c.to_vec(&got).unwrap(),
        &r.to_vec(&want).unwrap(),
    );
    assert!(r.linear_bias(&xr, &wr, &xr).unwrap().is_none());
    // A bias of the wrong length is refused, not read out of bounds.
    let short = c.upload(vec![0.0; out - 1], &[out - 1]).unwrap();
    let xc = c.upload(vec![0.0; rows * inp], &[rows, inp]).unwrap();
    let wc = c.upload(vec![0.0; out * inp], &[out, inp]).unwrap();
    assert!(!matches!(c.linear_bias(&xc, &wc, &short), Ok(Some(_))));
}

#[test]
fn gelu_backward_in_one_pass_has_the_bits_of_the_derivative_times_dy() {
    let c = CandleBackend::cpu();
    let n: usize = SHAPE.iter().product();
    let (x, dy) = (
        c.upload(data(n, 12), &SHAPE).unwrap(),
        c.upload(data(n, 13), &SHAPE).unwrap(),
    );
    let fused = c.gelu_backward(&x, &dy).unwrap().expect("fused on the CPU");
    let composed = c
        .binary(BinaryOp::Mul, &dy, &c.unary(UnaryOp::GeluGrad, &x).unwrap())
        .unwrap();
    let bits = |t| -> Vec<u32> { c.to_vec(t).unwrap().iter().map(|v| v.to_bits()).collect() };
    assert!(bits(&fused) == bits(&composed));
    // Other shapes take the composed path.
    let short = c.upload(data(n / 3, 14), &[n / 3]).unwrap();
    assert!(c.gelu_backward(&x, &short).unwrap().is_none());
}

#[test]
fn fused_layer_norm_declines_what_it_does_not_handle() {
    let c = CandleBackend::cpu();
    let x = c.upload(data(6 * 5, 15), &[6, 5]).unwrap();
    let g = c.upload(data(5, 16), &[5]).unwrap();
    assert!(c.layer_norm_rows(&x, &g, &g, 1e-5).unwrap().is_some());
    // A gain of another shape, rows of width 0, and a rank-3 input take the composed path.
    let g2 = c.upload(data(5, 16), &[1, 5]).unwrap();
    assert!(c.layer_norm_rows(&x, &g2, &g, 1e-5).unwrap().is_none());
    let empty = c.upload(vec![], &[3, 0]).unwrap();
    let none = c.upload(vec![], &[0]).unwrap();
    assert!(c
        .layer_norm_rows(&empty, &none, &none, 1e-5)
        .unwrap()
        .is_none());
    let x3 = c.upload(data(6 * 5, 15), &[2, 3, 5]).unwrap();
    assert!(c.layer_norm_rows(&x3, &g, &g, 1e-5).unwrap().is_none());
    // Its backward reads the forward's tensors and declines an rstd of the wrong shape.
    let [_, xhat, rstd] = c.layer_norm_rows(&x, &g, &g, 1e-5).unwrap().unwrap();
    assert!(c
        .layer_norm_rows_backward(&x, &xhat, &rstd, &g)
        .unwrap()
        .is_some());
    assert!(c
        .layer_norm_rows_backward(&x, &xhat, &g, &g)
        .unwrap()
        .is_none());
}
