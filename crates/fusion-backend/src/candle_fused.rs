//! The candle backend's side of the fused host kernels (causal attention, [`crate::attention`];
//! softmax cross-entropy, [`crate::xent`]): reads candle CPU tensors in place (or a contiguous
//! copy of a strided one), runs the kernel in the tensor's own precision (`f32` or `f64`), and
//! wraps the results as tensors. Half-precision tensors (`bf16`, `f16`) are widened to `f32` for
//! the kernel, which accumulates in `f32`, and its results narrowed back, except the
//! log-sum-exp and the per-row losses, which stay `f32`. CUDA tensors return `None`: the
//! operators compose these from primitives there.

use crate::attention::{self, Elem, Heads};
use crate::error::{BackendError, Result};
use crate::{layernorm, xent};
use candle_core::{DType, Device, Storage, Tensor, WithDType};

/// Runs `f` on the host elements of `t` as `T` in row-major order.
fn with_host<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(BackendError::Device(
            "the fused kernels read host tensors".into(),
        ));
    };
    let all = cpu.as_slice::<T>()?;
    let start = layout.start_offset();
    let part = all
        .get(start..start + t.elem_count())
        .ok_or_else(|| BackendError::Shape("tensor storage shorter than its layout".into()))?;
    f(part)
}

/// The dtype the fused kernels run a CPU tensor in: its own for `f32` and `f64`, `f32` for the
/// half-precision ones; `None` elsewhere.
fn host_float(t: &Tensor) -> Option<DType> {
    if !t.device().is_cpu() {
        return None;
    }
    match t.dtype() {
        DType::F64 => Some(DType::F64),
        DType::F32 | DType::BF16 | DType::F16 => Some(DType::F32),
        _ => None,
    }
}

/// `t` in `dt` (a no-op when it already is).
fn as_dtype(t: &Tensor, dt: DType) -> Result<Tensor> {
    Ok(t.to_dtype(dt)?)
}

/// `[N, T, D]` heads of `q`, checked against `k` and `v`.
fn heads(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Heads> {
    match q.dims() {
        &[n, t, d] if k.dims() == q.dims() && v.dims() == q.dims() => Ok(Heads { n, t, d }),
        dims => Err(BackendError::Shape(format!(
            "fused attention needs q, k, v of one shape [N, T, D], got {dims:?}, {:?}, {:?}",
            k.dims(),
            v.dims()
        ))),
    }
}

fn run_forward<T: Elem + WithDType>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    let h = heads(q, k, v)?;
    let s = T::from_f64(scale);
    let (y, lse) = with_host::<T, _>(q, |q| {
        with_host::<T, _>(k, |k| {
            with_host::<T, _>(v, |v| attention::forward(h, s, q, k, v))
        })
    })?;
    Ok((
        Tensor::from_vec(y, (h.n, h.t, h.d), &Device::Cpu)?,
        Tensor::from_vec(lse, (h.n, h.t), &Device::Cpu)?,
    ))
}

/// Fused forward on CPU tensors of `f32` or `f64`; `None` elsewhere.
pub(crate) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
) -> Result<Option<(Tensor, Tensor)>> {
    match host_float(q) {
        Some(DType::F32) => {
            let w = |t: &Tensor| as_dtype(t, DType::F32);
            let (y, lse) = run_forward::<f32>(&w(q)?, &w(k)?, &w(v)?, scale)?;
            Ok(Some((as_dtype(&y, q.dtype())?, lse)))
        }
        Some(_) => run_forward::<f64>(q, k, v, scale).map(Some),
        None => Ok(None),
    }
}

/// The tensors backward reads: inputs, output, log-sum-exp, output gradient.
pub(crate) struct Saved<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub y: &'a Tensor,
    pub lse: &'a Tensor,
    pub dy: &'a Tensor,
}

fn run_backward<T: Elem + WithDType>(s: &Saved, scale: f64) -> Result<[Tensor; 3]> {
    let h = heads(s.q, s.k, s.v)?;
    let sc = T::from_f64(scale);
    let grads = with_host::<T, _>(s.q, |q| {
        with_host::<T, _>(s.k, |k| {
            with_host::<T, _>(s.v, |v| {
                with_host::<T, _>(s.y, |y| {
                    with_host::<T, _>(s.lse, |lse| {
                        with_host::<T, _>(s.dy, |dy| {
                            attention::backward(h, sc, (q, k, v), (y, lse), dy)
                        })
                    })
                })
            })
        })
    })?;
    let [dq, dk, dv] = grads;
    let wrap = |g: Vec<T>| Tensor::from_vec(g, (h.n, h.t, h.d), &Device::Cpu);
    Ok([wrap(dq)?, wrap(dk)?, wrap(dv)?])
}

/// Fused backward on CPU tensors of `f32` or `f64`; `None` elsewhere.
pub(crate) fn backward(s: &Saved, scale: f64) -> Result<Option<[Tensor; 3]>> {
    match host_float(s.q) {
        Some(DType::F32) => {
            let w = |t: &Tensor| as_dtype(t, DType::F32);
            let (q, k, v, y, lse, dy) = (w(s.q)?, w(s.k)?, w(s.v)?, w(s.y)?, w(s.lse)?, w(s.dy)?);
            let wide = Saved {
                q: &q,
                k: &k,
                v: &v,
                y: &y,
                lse: &lse,
                dy: &dy,
            };
            let [dq, dk, dv] = run_backward::<f32>(&wide, scale)?;
            let n = |g: Tensor| as_dtype(&g, s.q.dtype());
            Ok(Some([n(dq)?, n(dk)?, n(dv)?]))
        }
        Some(_) => run_backward::<f64>(s, scale).map(Some),
        None => Ok(None),
    }
}

/// One target per row of `x [N, V]`.
fn rows_match(x: &Tensor, targets: &[u32]) -> Result<()> {
    if x.dims()[0] != targets.len() {
        return Err(BackendError::Shape(format!(
            "cross-entropy of {:?} logits against {} targets",
            x.dims(),
            targets.len()
        )));
    }
    Ok(())
}

fn run_xent<T: Elem + WithDType>(x: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let rows = targets.len();
    let loss = with_host::<T, _>(x, |x| xent::forward(x, rows, targets))?;
    Ok(Tensor::from_vec(loss, rows, &Device::Cpu)?)
}

/// Per-row softmax cross-entropy of `x [N, V]` on CPU tensors: `f32` for half-precision
/// logits, so that the loss is not rounded to them.
pub(crate) fn cross_entropy(x: &Tensor, targets: &[u32]) -> Result<Option<Tensor>> {
    let Some(dt) = host_float(x).filter(|_| x.rank() == 2) else {
        return Ok(None);
    };
    rows_match(x, targets)?;
    match dt {
        DType::F32 => run_xent::<f32>(&as_dtype(x, DType::F32)?, targets).map(Some),
        _ => run_xent::<f64>(x, targets).map(Some),
    }
}

fn run_xent_backward<T: Elem + WithDType>(
    x: &Tensor,
    targets: &[u32],
    scale: f64,
) -> Result<Tensor> {
    let rows = targets.len();
    let s = T::from_f64(scale);
    let g = with_host::<T, _>(x, |x| xent::backward(x, rows, targets, s))?;
    Ok(Tensor::from_vec(g, x.dims(), &Device::Cpu)?)
}

/// Its gradient `(softmax(x) - onehot) * scale`, on CPU tensors, in the logits' dtype.
pub(crate) fn cross_entropy_backward(
    x: &Tensor,
    targets: &[u32],
    scale: f64,
) -> Result<Option<Tensor>> {
    let Some(dt) = host_float(x).filter(|_| x.rank() == 2) else {
        return Ok(None);
    };
    rows_match(x, targets)?;
    match dt {
        DType::F32 => {
            let g = run_xent_backward::<f32>(&as_dtype(x, DType::F32)?, targets, scale)?;
            as_dtype(&g, x.dtype()).map(Some)
        }
        _ => run_xent_backward::<f64>(x, targets, scale).map(Some),
    }
}

/// `[N, D]` rows of `x` whose last dim `params` (`[D]` each, host tensors of `x`'s dtype)
/// match; `None` if not, or if the rows are empty (the composed operator handles those).
fn norm_rows(x: &Tensor, params: &[&Tensor]) -> Option<(usize, usize)> {
    let &[n, d] = x.dims() else { return None };
    let fits = |p: &&Tensor| p.dims() == [d] && p.dtype() == x.dtype() && p.device().is_cpu();
    (d > 0 && params.iter().all(fits)).then_some((n, d))
}

/// The host dtype of a fused layer norm: `f32` and `f64` CPU tensors only (a half-precision
/// operator widens its rows before it gets here).
fn norm_dtype(x: &Tensor) -> Option<DType> {
    (x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64)).then(|| x.dtype())
}

fn run_layer_norm<T: Elem + WithDType>(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
    (n, d): (usize, usize),
) -> Result<[Tensor; 3]> {
    let (y, xhat, rstd) = with_host::<T, _>(x, |x| {
        with_host::<T, _>(gamma, |g| {
            with_host::<T, _>(beta, |b| layernorm::forward(x, d, g, b, T::from_f64(eps)))
        })
    })?;
    Ok([
        Tensor::from_vec(y, (n, d), &Device::Cpu)?,
        Tensor::from_vec(xhat, (n, d), &Device::Cpu)?,
        Tensor::from_vec(rstd, (n, 1), &Device::Cpu)?,
    ])
}

/// Fused layer norm of rows `x [N, D]`: `[y, xhat, rstd [N, 1]]`, or `None` for other tensors.
pub(crate) fn layer_norm(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
) -> Result<Option<[Tensor; 3]>> {
    let (Some(dt), Some(shape)) = (norm_dtype(x), norm_rows(x, &[gamma, beta])) else {
        return Ok(None);
    };
    match dt {
        DType::F32 => run_layer_norm::<f32>(x, gamma, beta, eps, shape).map(Some),
        _ => run_layer_norm::<f64>(x, gamma, beta, eps, shape).map(Some),
    }
}

fn run_layer_norm_backward<T: Elem + WithDType>(
    dy: &Tensor,
    xhat: &Tensor,
    rstd: &Tensor,
    gamma: &Tensor,
    (n, d): (usize, usize),
) -> Result<[Tensor; 3]> {
    let (dx, dgamma, dbeta) = with_host::<T, _>(dy, |dy| {
        with_host::<T, _>(xhat, |h| {
            with_host::<T, _>(rstd, |r| {
                with_host::<T, _>(gamma, |g| layernorm::backward(dy, h, r, g, d))
            })
        })
    })?;
    Ok([
        Tensor::from_vec(dx, (n, d), &Device::Cpu)?,
        Tensor::from_vec(dgamma, d, &Device::Cpu)?,
        Tensor::from_vec(dbeta, d, &Device::Cpu)?,
    ])
}

/// Its backward: `[dx, dgamma, dbeta]` from `dy`, `xhat [N, D]`, `rstd [N, 1]` and `gamma`.
pub(crate) fn layer_norm_backward(
    dy: &Tensor,
    xhat: &Tensor,
    rstd: &Tensor,
    gamma: &Tensor,
) -> Result<Option<[Tensor; 3]>> {
    let same = |t: &Tensor| t.dtype() == dy.dtype() && t.device().is_cpu();
    let Some(dt) = norm_dtype(dy).filter(|_| same(xhat) && same(rstd)) else {
        return Ok(None);
    };
    let Some(shape) = norm_rows(dy, &[gamma]).filter(|_| xhat.dims() == dy.dims()) else {
        return Ok(None);
    };
    if rstd.dims() != [shape.0, 1] {
        return Ok(None);
    }
    match dt {
        DType::F32 => run_layer_norm_backward::<f32>(dy, xhat, rstd, gamma, shape).map(Some),
        _ => run_layer_norm_backward::<f64>(dy, xhat, rstd, gamma, shape).map(Some),
    }
}
