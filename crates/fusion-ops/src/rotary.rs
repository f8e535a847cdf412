//! Grouped-query causal attention with rotary position embeddings (Llama-family):
//! `q [B, T, H*D]`, `k, v [B, T, Hkv*D]` -> `[B, T, H*D]`. Each of the `Hkv` key/value heads
//! serves `H / Hkv` consecutive query heads; queries and keys are rotated by their position
//! (the "rotate half" convention of Hugging Face's Llama: the first and second halves of a head
//! are the two coordinates of each rotated pair).

use crate::attention::{core_backward, core_forward};
use crate::error::{saved, OpError, Result};
use crate::{Backward, Forward};
use fusion_backend::{Backend, BinaryOp, UnaryOp};

struct Dims {
    b: usize,
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
}

fn dims<B: Backend>(
    be: &B,
    q: &B::Tensor,
    k: &B::Tensor,
    v: &B::Tensor,
    n_head: usize,
    n_kv_head: usize,
) -> Result<Dims> {
    let (qs, ks, vs) = (be.shape(q), be.shape(k), be.shape(v));
    let bad = || {
        OpError::Shape(format!(
            "attention with {n_head} query and {n_kv_head} key/value heads cannot take q {qs:?}, \
             k {ks:?}, v {vs:?}"
        ))
    };
    let (&[b, t, hd], &[kb, kt, kvd]) = (&qs[..], &ks[..]) else {
        return Err(bad());
    };
    if n_head == 0
        || n_kv_head == 0
        || !n_head.is_multiple_of(n_kv_head)
        || !hd.is_multiple_of(n_head)
    {
        return Err(bad());
    }
    let d = hd / n_head;
    if (kb, kt, kvd) != (b, t, n_kv_head * d) || vs != ks || !d.is_multiple_of(2) {
        return Err(bad());
    }
    Ok(Dims {
        b,
        t,
        h: n_head,
        kv: n_kv_head,
        d,
    })
}

/// The rotation tables `[1, 1, T, D]`: cos and sin of `t * theta^(-2i/D)`, each frequency
/// repeated for both halves of a head, rounded to f32 as the model computes them.
fn tables<B: Backend>(be: &B, t: usize, d: usize, theta: f32) -> Result<[B::Tensor; 2]> {
    let half = d / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| (theta as f64).powf(-2.0 * i as f64 / d as f64) as f32)
        .collect();
    let (mut cos, mut sin) = (Vec::with_capacity(t * d), Vec::with_capacity(t * d));
    for pos in 0..t {
        for j in 0..d {
            let angle = pos as f32 * inv[j % half];
            cos.push(angle.cos() as f64);
            sin.push(angle.sin() as f64);
        }
    }
    Ok([
        be.upload_f64(cos, &[1, 1, t, d])?,
        be.upload_f64(sin, &[1, 1, t, d])?,
    ])
}

/// `[-x2, x1]` (forward) or its transpose `[x2, -x1]` over the last dim's halves.
fn rotate_half<B: Backend>(be: &B, x: &B::Tensor, transpose: bool) -> Result<B::Tensor> {
    let s = be.shape(x);
    let (last, half) = (s.len() - 1, s[s.len() - 1] / 2);
    let (x1, x2) = (
        be.narrow(x, last, 0, half)?,
        be.narrow(x, last, half, half)?,
    );
    Ok(if transpose {
        be.cat(&[&x2, &be.unary(UnaryOp::Neg, &x1)?], last)?
    } else {
        be.cat(&[&be.unary(UnaryOp::Neg, &x2)?, &x1], last)?
    })
}

/// `x * cos + rotate_half(x) * sin` for `x [B, heads, T, D]`, or its transpose (the VJP).
fn rotate<B: Backend>(
    be: &B,
    x: &B::Tensor,
    [cos, sin]: &[B::Tensor; 2],
    transpose: bool,
) -> Result<B::Tensor> {
    let direct = be.binary(BinaryOp::Mul, x, cos)?;
    let turned = if transpose {
        rotate_half(be, &be.binary(BinaryOp::Mul, x, sin)?, true)?
    } else {
        be.binary(BinaryOp::Mul, &rotate_half(be, x, false)?, sin)?
    };
    Ok(be.binary(BinaryOp::Add, &direct, &turned)?)
}

/// `[B, T, heads*D]` -> `[B, heads, T, D]`.
fn heads<B: Backend>(
    be: &B,
    x: &B::Tensor,
    b: usize,
    t: usize,
    n: usize,
    d: usize,
) -> Result<B::Tensor> {
    Ok(be.permute(&be.reshape(x, &[b, t, n, d])?, &[0, 2, 1, 3])?)
}

/// `[B, heads, T, D]` -> `[B, T, heads*D]`.
fn unheads<B: Backend>(
    be: &B,
    x: &B::Tensor,
    b: usize,
    t: usize,
    n: usize,
    d: usize,
) -> Result<B::Tensor> {
    Ok(be.reshape(&be.permute(x, &[0, 2, 1, 3])?, &[b, t, n * d])?)
}

/// Each key/value head repeated for its group of query heads: `[B, Hkv, T, D]` -> `[B*H, T, D]`.
fn repeat_kv<B: Backend>(be: &B, x: &B::Tensor, dm: &Dims) -> Result<B::Tensor> {
    let g = dm.h / dm.kv;
    let x = be.reshape(x, &[dm.b, dm.kv, 1, dm.t, dm.d])?;
    let copies: Vec<&B::Tensor> = (0..g).map(|_| &x).collect();
    Ok(be.reshape(&be.cat(&copies, 2)?, &[dm.b * dm.h, dm.t, dm.d])?)
}

/// The VJP of [`repeat_kv`]: sums each group's gradients, `[B*H, T, D]` -> `[B, Hkv, T, D]`.
fn sum_groups<B: Backend>(be: &B, dx: &B::Tensor, dm: &Dims) -> Result<B::Tensor> {
    let g = dm.h / dm.kv;
    let x = be.reshape(dx, &[dm.b, dm.kv, g, dm.t, dm.d])?;
    Ok(be.reshape(&be.sum_keepdim(&x, &[2])?, &[dm.b, dm.kv, dm.t, dm.d])?)
}

pub fn forward<B: Backend>(
    be: &B,
    inputs: [&B::Tensor; 3],
    n_head: usize,
    n_kv_head: usize,
    theta: f32,
) -> Result<Forward<B>> {
    let [q, k, v] = inputs;
    let dm = dims(be, q, k, v, n_head, n_kv_head)?;
    let Dims { b, t, h, kv, d } = dm;
    let rot = tables(be, t, d, theta)?;
    let q = be.reshape(
        &rotate(be, &heads(be, q, b, t, h, d)?, &rot, false)?,
        &[b * h, t, d],
    )?;
    let k = repeat_kv(
        be,
        &rotate(be, &heads(be, k, b, t, kv, d)?, &rot, false)?,
        &dm,
    )?;
    let v = repeat_kv(be, &heads(be, v, b, t, kv, d)?, &dm)?;
    let (y, extras) = core_forward(be, &q, &k, &v)?;
    let y = unheads(be, &be.reshape(&y, &[b, h, t, d])?, b, t, h, d)?;
    Ok(Forward {
        output: y,
        saved: [vec![q, k, v], extras].concat(),
        buffer_updates: vec![],
    })
}

pub fn backward<B: Backend>(
    be: &B,
    inputs: [&B::Tensor; 3],
    n_head: usize,
    n_kv_head: usize,
    theta: f32,
    saved_t: &[B::Tensor],
    dy: &B::Tensor,
) -> Result<Backward<B>> {
    let [q_in, k_in, v_in] = inputs;
    let dm = dims(be, q_in, k_in, v_in, n_head, n_kv_head)?;
    let Dims { b, t, h, kv, d } = dm;
    let name = "grouped_query_attention";
    let (q, k, v) = (
        saved(saved_t, 0, name)?,
        saved(saved_t, 1, name)?,
        saved(saved_t, 2, name)?,
    );
    let extras = saved_t.get(3..).unwrap_or(&[]);
    let dy = be.reshape(&heads(be, dy, b, t, h, d)?, &[b * h, t, d])?;
    let [dq, dk, dv] = core_backward(be, q, k, v, extras, &dy)?;
    let rot = tables(be, t, d, theta)?;
    let dq = rotate(be, &be.reshape(&dq, &[b, h, t, d])?, &rot, true)?;
    let dk = rotate(be, &sum_groups(be, &dk, &dm)?, &rot, true)?;
    let dv = sum_groups(be, &dv, &dm)?;
    Ok(Backward {
        inputs: vec![
            Some(unheads(be, &dq, b, t, h, d)?),
            Some(unheads(be, &dk, b, t, kv, d)?),
            Some(unheads(be, &dv, b, t, kv, d)?),
        ],
        params: vec![],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusion_backend::ReferenceBackend;

    /// Position p turns each pair (x[i], x[i + D/2]) by p * theta^(-2i/D), as Hugging Face's
    /// Llama does; position 0 is the identity.
    #[test]
    fn rotation_matches_a_hand_loop_in_the_rotate_half_convention() {
        let be = ReferenceBackend;
        let (t, d, theta) = (3usize, 4usize, 100.0f32);
        let x: Vec<f64> = (0..t * d).map(|i| (i as f64 * 0.37).sin()).collect();
        let xt = be.upload_f64(x.clone(), &[1, 1, t, d]).expect("x");
        let rot = tables(&be, t, d, theta).expect("tables");
        let y = be
            .to_f64(&rotate(&be, &xt, &rot, false).expect("rotate"))
            .expect("y");
        for p in 0..t {
            for i in 0..d / 2 {
                let inv = (theta as f64).powf(-2.0 * i as f64 / d as f64);
                let (c, s) = ((p as f64 * inv).cos(), (p as f64 * inv).sin());
                let (a, b) = (x[p * d + i], x[p * d + i + d / 2]);
                let (ya, yb) = (y[p * d + i], y[p * d + i + d / 2]);
                assert!((ya - (a * c - b * s)).abs() < 1e-6, "pos {p} pair {i}");
                assert!((yb - (b * c + a * s)).abs() < 1e-6, "pos {p} pair {i}");
            }
        }
        // The transpose undoes the rotation (a rotation's inverse).
        let back = rotate(
            &be,
            &be.upload_f64(y, &[1, 1, t, d]).expect("y"),
            &rot,
            true,
        )
        .and_then(|b| be.to_f64(&b).map_err(Into::into))
        .expect("back");
        for (a, b) in x.iter().zip(back) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    /// One position: each query head's output is the value of the key/value head that serves
    /// it, head h reading key/value head h / (H / Hkv).
    #[test]
    fn query_heads_read_the_key_value_head_of_their_group() {
        let be = ReferenceBackend;
        let (h, kv, d) = (6usize, 2usize, 2usize);
        let q = be.upload_f64(vec![0.5; h * d], &[1, 1, h * d]).expect("q");
        let k = be
            .upload_f64(vec![0.25; kv * d], &[1, 1, kv * d])
            .expect("k");
        let v: Vec<f64> = (0..kv * d).map(|i| (i / d) as f64 + 1.0).collect();
        let v = be.upload_f64(v, &[1, 1, kv * d]).expect("v");
        let out = forward(&be, [&q, &k, &v], h, kv, 10000.0).expect("forward");
        let y = be.to_f64(&out.output).expect("y");
        for head in 0..h {
            let want = (head / (h / kv)) as f64 + 1.0;
            assert_eq!(&y[head * d..(head + 1) * d], &[want, want], "head {head}");
        }
    }
}
