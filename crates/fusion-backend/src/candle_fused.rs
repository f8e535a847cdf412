//! The candle backend's side of the fused host kernels (causal attention, [`crate::attention`];
//! softmax cross-entropy, [`crate::xent`]): reads candle CPU tensors in place (or a contiguous
//! copy of a strided one), runs the kernel in the tensor's own precision (`f32` or `f64`), and
//! wraps the results as tensors. CUDA tensors return `None`: the operators compose these from
//! primitives there.

use crate::attention::{self, Elem, Heads};
use crate::error::{BackendError, Result};
use crate::xent;
use candle_core::{DType, Device, Storage, Tensor, WithDType};

/// Runs `f` on the host elements of `t` as `T` in row-major order.
fn with_host<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(BackendError::Device(
            "fused attention reads host tensors".into(),
        ));
    };
    let all = cpu.as_slice::<T>()?;
    let start = layout.start_offset();
    let part = all
        .get(start..start + t.elem_count())
        .ok_or_else(|| BackendError::Shape("tensor storage shorter than its layout".into()))?;
    f(part)
}

/// The dtype of a tensor the fused kernels take: `f32` or `f64` on the CPU; `None` elsewhere.
fn host_float(t: &Tensor) -> Option<DType> {
    let dt = t.dtype();
    (t.device().is_cpu() && matches!(dt, DType::F32 | DType::F64)).then_some(dt)
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
        Some(DType::F32) => run_forward::<f32>(q, k, v, scale).map(Some),
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
        Some(DType::F32) => run_backward::<f32>(s, scale).map(Some),
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

/// Per-row softmax cross-entropy of `x [N, V]` on CPU tensors of `f32` or `f64`.
pub(crate) fn cross_entropy(x: &Tensor, targets: &[u32]) -> Result<Option<Tensor>> {
    let Some(dt) = host_float(x).filter(|_| x.rank() == 2) else {
        return Ok(None);
    };
    rows_match(x, targets)?;
    match dt {
        DType::F32 => run_xent::<f32>(x, targets).map(Some),
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

/// Its gradient `(softmax(x) - onehot) * scale`, on CPU tensors of `f32` or `f64`.
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
        DType::F32 => run_xent_backward::<f32>(x, targets, scale).map(Some),
        _ => run_xent_backward::<f64>(x, targets, scale).map(Some),
    }
}
