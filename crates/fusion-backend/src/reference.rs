//! The reference backend: plain loops over `f64`, written to be obviously correct.

use crate::error::{BackendError, Result};
use crate::pool;
use crate::shape::{check_broadcast, check_ids, check_row_ids, matmul_shape, numel, strides};
use crate::{Backend, BinaryOp, UnaryOp, Window};
use rayon::prelude::*;
use std::sync::Arc;

/// A dense row-major tensor of `f64`.
#[derive(Clone, Debug, PartialEq)]
pub struct RefTensor {
    pub shape: Vec<usize>,
    pub data: Arc<Vec<f64>>,
}

impl RefTensor {
    fn new(data: Vec<f64>, shape: Vec<usize>) -> Result<Self> {
        if data.len() != numel(&shape) {
            return Err(BackendError::Shape(format!(
                "{} values do not fill shape {shape:?}",
                data.len()
            )));
        }
        Ok(RefTensor {
            shape,
            data: Arc::new(data),
        })
    }
}

#[derive(Clone, Debug, Default)]
pub struct ReferenceBackend;

/// Calls `f(flat_index, multi_index)` for every element of `shape` in row-major order.
fn for_each_index(shape: &[usize], mut f: impl FnMut(usize, &[usize])) {
    let n = numel(shape);
    let mut idx = vec![0usize; shape.len()];
    for flat in 0..n {
        f(flat, &idx);
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Folds `a` over `dims` (kept with size 1), starting every output element at `init`.
fn reduce_keepdim(
    a: &RefTensor,
    dims: &[usize],
    init: f64,
    fold: impl Fn(f64, f64) -> f64,
) -> Result<RefTensor> {
    if dims.iter().any(|&d| d >= a.shape.len()) {
        return Err(BackendError::Shape(format!(
            "reduction over {dims:?} of {:?}",
            a.shape
        )));
    }
    let mut out_shape = a.shape.clone();
    for &d in dims {
        out_shape[d] = 1;
    }
    let os = strides(&out_shape);
    let mut out = vec![init; numel(&out_shape)];
    for_each_index(&a.shape, |flat, idx| {
        let oi: usize = idx
            .iter()
            .zip(&out_shape)
            .zip(&os)
            .map(|((i, &n), s)| if n == 1 { 0 } else { i * s })
            .sum();
        out[oi] = fold(out[oi], a.data[flat]);
    });
    RefTensor::new(out, out_shape)
}

/// Visits every (output, input, weight) index triple of a convolution that touches real input.
fn conv_taps(
    xs: &[usize],
    ws: &[usize],
    win: Window,
    mut f: impl FnMut(usize, usize, usize),
) -> Result<Vec<usize>> {
    if xs.len() != 4
        || ws.len() != 4
        || xs[1] != ws[1]
        || ws[2] != win.kernel
        || ws[3] != win.kernel
    {
        return Err(BackendError::Shape(format!(
            "conv2d input {xs:?} does not fit weight {ws:?}"
        )));
    }
    let (n, c, h, w) = (xs[0], xs[1], xs[2], xs[3]);
    let o = ws[0];
    let (oh, ow) = (win.out_size(h)?, win.out_size(w)?);
    for b in 0..n {
        for oc in 0..o {
            for oy in 0..oh {
                for ox in 0..ow {
                    let yi = ((b * o + oc) * oh + oy) * ow + ox;
                    for ic in 0..c {
                        for ky in 0..win.kernel {
                            let iy = (oy * win.stride + ky) as isize - win.padding as isize;
                            if iy < 0 || iy >= h as isize {
                                continue;
                            }
                            for kx in 0..win.kernel {
                                let ix = (ox * win.stride + kx) as isize - win.padding as isize;
                                if ix < 0 || ix >= w as isize {
                                    continue;
                                }
                                let xi = ((b * c + ic) * h + iy as usize) * w + ix as usize;
                                let wi = ((oc * c + ic) * win.kernel + ky) * win.kernel + kx;
                                f(yi, xi, wi);
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(vec![n, o, oh, ow])
}

impl Backend for ReferenceBackend {
    type Tensor = RefTensor;

    fn name(&self) -> String {
        "reference".into()
    }

    fn is_f64(&self) -> bool {
        true
    }

    fn upload(&self, data: Vec<f32>, shape: &[usize]) -> Result<RefTensor> {
        RefTensor::new(data.into_iter().map(f64::from).collect(), shape.to_vec())
    }

    fn to_vec(&self, t: &RefTensor) -> Result<Vec<f32>> {
        Ok(t.data.iter().map(|&v| v as f32).collect())
    }

    fn upload_f64(&self, data: Vec<f64>, shape: &[usize]) -> Result<RefTensor> {
        RefTensor::new(data, shape.to_vec())
    }

    fn to_f64(&self, t: &RefTensor) -> Result<Vec<f64>> {
        Ok(t.data.as_ref().clone())
    }

    fn shape(&self, t: &RefTensor) -> Vec<usize> {
        t.shape.clone()
    }

    fn zeros(&self, shape: &[usize]) -> Result<RefTensor> {
        RefTensor::new(vec![0.0; numel(shape)], shape.to_vec())
    }

    fn reshape(&self, t: &RefTensor, shape: &[usize]) -> Result<RefTensor> {
        if numel(shape) != t.data.len() {
            return Err(BackendError::Shape(format!(
                "cannot reshape {:?} to {shape:?}",
                t.shape
            )));
        }
        Ok(RefTensor {
            shape: shape.to_vec(),
            data: t.data.clone(),
        })
    }

    fn permute(&self, t: &RefTensor, dims: &[usize]) -> Result<RefTensor> {
        let mut sorted = dims.to_vec();
        sorted.sort_unstable();
        if sorted != (0..t.shape.len()).collect::<Vec<_>>() {
            return Err(BackendError::Shape(format!(
                "bad permutation {dims:?} of {:?}",
                t.shape
            )));
        }
        let in_strides = strides(&t.shape);
        let out_shape: Vec<usize> = dims.iter().map(|&d| t.shape[d]).collect();
        let mut out = vec![0.0; t.data.len()];
        for_each_index(&out_shape, |flat, idx| {
            let src: usize = idx.iter().zip(dims).map(|(i, &d)| i * in_strides[d]).sum();
            out[flat] = t.data[src];
        });
        RefTensor::new(out, out_shape)
    }

    fn narrow(&self, t: &RefTensor, dim: usize, start: usize, len: usize) -> Result<RefTensor> {
        if dim >= t.shape.len() || start + len > t.shape[dim] {
            return Err(BackendError::Shape(format!(
                "narrow({dim}, {start}, {len}) out of {:?}",
                t.shape
            )));
        }
        let outer: usize = t.shape[..dim].iter().product();
        let inner: usize = t.shape[dim + 1..].iter().product();
        let mut out = Vec::with_capacity(outer * len * inner);
        for o in 0..outer {
            let base = (o * t.shape[dim] + start) * inner;
            out.extend_from_slice(&t.data[base..base + len * inner]);
        }
        let mut shape = t.shape.clone();
        shape[dim] = len;
        RefTensor::new(out, shape)
    }

    fn cat(&self, ts: &[&RefTensor], dim: usize) -> Result<RefTensor> {
        let first = ts
            .first()
            .ok_or_else(|| BackendError::Shape("cat of nothing".into()))?;
        if dim >= first.shape.len() {
            return Err(BackendError::Shape(format!(
                "cat dim {dim} out of {:?}",
                first.shape
            )));
        }
        for t in ts {
            let same = t.shape.len() == first.shape.len()
                && t.shape
                    .iter()
                    .zip(&first.shape)
                    .enumerate()
                    .all(|(d, (a, b))| d == dim || a == b);
            if !same {
                return Err(BackendError::Shape(format!(
                    "cannot cat {:?} with {:?}",
                    t.shape, first.shape
                )));
            }
        }
        let outer: usize = first.shape[..dim].iter().product();
        let inner: usize = first.shape[dim + 1..].iter().product();
        let mut out = Vec::new();
        for o in 0..outer {
            for t in ts {
                let chunk = t.shape[dim] * inner;
                out.extend_from_slice(&t.data[o * chunk..(o + 1) * chunk]);
            }
        }
        let mut shape = first.shape.clone();
        shape[dim] = ts.iter().map(|t| t.shape[dim]).sum();
        RefTensor::new(out, shape)
    }

    fn binary(&self, op: BinaryOp, a: &RefTensor, b: &RefTensor) -> Result<RefTensor> {
        check_broadcast(&a.shape, &b.shape)?;
        let f = |x: f64, y: f64| match op {
            BinaryOp::Add => x + y,
            BinaryOp::Sub => x - y,
            BinaryOp::Mul => x * y,
            BinaryOp::Div => x / y,
        };
        if a.shape == b.shape {
            let out = a
                .data
                .iter()
                .zip(b.data.iter())
                .map(|(&x, &y)| f(x, y))
                .collect();
            return RefTensor::new(out, a.shape.clone());
        }
        let bs = strides(&b.shape);
        let mut out = vec![0.0; a.data.len()];
        for_each_index(&a.shape, |flat, idx| {
            let bi: usize = idx
                .iter()
                .zip(&b.shape)
                .zip(&bs)
                .map(|((i, &n), s)| if n == 1 { 0 } else { i * s })
                .sum();
            out[flat] = f(a.data[flat], b.data[bi]);
        });
        RefTensor::new(out, a.shape.clone())
    }

    fn unary(&self, op: UnaryOp, a: &RefTensor) -> Result<RefTensor> {
        RefTensor::new(
            a.data
                .iter()
                .map(|&x| crate::scalar::unary(op, x))
                .collect(),
            a.shape.clone(),
        )
    }

    fn affine(&self, a: &RefTensor, mul: f64, add: f64) -> Result<RefTensor> {
        RefTensor::new(
            a.data.iter().map(|&x| x * mul + add).collect(),
            a.shape.clone(),
        )
    }

    fn sum_keepdim(&self, a: &RefTensor, dims: &[usize]) -> Result<RefTensor> {
        reduce_keepdim(a, dims, 0.0, |acc, x| acc + x)
    }

    fn max_keepdim(&self, a: &RefTensor, dim: usize) -> Result<RefTensor> {
        reduce_keepdim(a, &[dim], f64::NEG_INFINITY, f64::max)
    }

    fn matmul(&self, a: &RefTensor, b: &RefTensor, ta: bool, tb: bool) -> Result<RefTensor> {
        let (batch, m, k, n) = matmul_shape(&a.shape, &b.shape, ta, tb)?;
        let at = |bi: usize, i: usize, p: usize| {
            if ta {
                a.data[(bi * k + p) * m + i]
            } else {
                a.data[(bi * m + i) * k + p]
            }
        };
        let bt = |bi: usize, p: usize, j: usize| {
            if tb {
                b.data[(bi * n + j) * k + p]
            } else {
                b.data[(bi * k + p) * n + j]
            }
        };
        let mut out = vec![0.0; batch * m * n];
        out.par_chunks_mut(n).enumerate().for_each(|(row, dst)| {
            let (bi, i) = (row / m, row % m);
            for p in 0..k {
                let av = at(bi, i, p);
                for (j, d) in dst.iter_mut().enumerate() {
                    *d += av * bt(bi, p, j);
                }
            }
        });
        let shape = if a.shape.len() == 3 {
            vec![batch, m, n]
        } else {
            vec![m, n]
        };
        RefTensor::new(out, shape)
    }

    fn gather_rows(&self, table: &RefTensor, ids: &[u32]) -> Result<RefTensor> {
        if table.shape.len() != 2 {
            return Err(BackendError::Shape(format!(
                "gather_rows needs [V, D], got {:?}",
                table.shape
            )));
        }
        check_ids(ids, table.shape[0])?;
        let d = table.shape[1];
        let mut out = Vec::with_capacity(ids.len() * d);
        for &i in ids {
            out.extend_from_slice(&table.data[i as usize * d..(i as usize + 1) * d]);
        }
        RefTensor::new(out, vec![ids.len(), d])
    }

    fn scatter_add_rows(&self, src: &RefTensor, ids: &[u32], rows: usize) -> Result<RefTensor> {
        if src.shape.len() != 2 || src.shape[0] != ids.len() {
            return Err(BackendError::Shape(format!(
                "scatter_add_rows: {:?} rows vs {} ids",
                src.shape,
                ids.len()
            )));
        }
        check_ids(ids, rows)?;
        let d = src.shape[1];
        let mut out = vec![0.0; rows * d];
        for (r, &i) in ids.iter().enumerate() {
            for j in 0..d {
                out[i as usize * d + j] += src.data[r * d + j];
            }
        }
        RefTensor::new(out, vec![rows, d])
    }

    fn pick_last(&self, x: &RefTensor, ids: &[u32]) -> Result<RefTensor> {
        let v = check_row_ids("pick_last", &x.shape, ids)?;
        let out = ids
            .iter()
            .enumerate()
            .map(|(r, &i)| x.data[r * v + i as usize])
            .collect();
        RefTensor::new(out, vec![ids.len(), 1])
    }

    fn add_at_last(&self, x: &RefTensor, ids: &[u32], value: f64) -> Result<RefTensor> {
        let v = check_row_ids("add_at_last", &x.shape, ids)?;
        let mut out = x.data.as_ref().clone();
        for (r, &i) in ids.iter().enumerate() {
            out[r * v + i as usize] += value;
        }
        RefTensor::new(out, x.shape.clone())
    }

    fn causal_fill(&self, x: &RefTensor, fill: f64) -> Result<RefTensor> {
        let r = x.shape.len();
        if r < 2 || x.shape[r - 1] != x.shape[r - 2] {
            return Err(BackendError::Shape(format!(
                "causal_fill needs [.., T, T], got {:?}",
                x.shape
            )));
        }
        let t = x.shape[r - 1];
        let mut out = x.data.as_ref().clone();
        for (i, v) in out.iter_mut().enumerate() {
            if i % t > (i / t) % t {
                *v = fill;
            }
        }
        RefTensor::new(out, x.shape.clone())
    }

    fn conv2d(&self, x: &RefTensor, w: &RefTensor, win: Window) -> Result<RefTensor> {
        let mut acc = Vec::new();
        let shape = conv_taps(&x.shape, &w.shape, win, |_, _, _| {})?;
        acc.resize(numel(&shape), 0.0);
        conv_taps(&x.shape, &w.shape, win, |yi, xi, wi| {
            acc[yi] += x.data[xi] * w.data[wi]
        })?;
        RefTensor::new(acc, shape)
    }

    fn conv2d_backward_input(
        &self,
        dy: &RefTensor,
        w: &RefTensor,
        input_shape: &[usize],
        win: Window,
    ) -> Result<RefTensor> {
        let mut dx = vec![0.0; numel(input_shape)];
        let shape = conv_taps(input_shape, &w.shape, win, |yi, xi, wi| {
            dx[xi] += dy.data.get(yi).copied().unwrap_or(0.0) * w.data[wi]
        })?;
        if shape != dy.shape {
            return Err(BackendError::Shape(format!(
                "conv2d gradient {:?} does not match output {shape:?}",
                dy.shape
            )));
        }
        RefTensor::new(dx, input_shape.to_vec())
    }

    fn conv2d_backward_weight(
        &self,
        x: &RefTensor,
        dy: &RefTensor,
        win: Window,
    ) -> Result<RefTensor> {
        if dy.shape.len() != 4 || x.shape.len() != 4 {
            return Err(BackendError::Shape(format!(
                "conv2d weight gradient: {:?}, {:?}",
                x.shape, dy.shape
            )));
        }
        let ws = vec![dy.shape[1], x.shape[1], win.kernel, win.kernel];
        let mut dw = vec![0.0; numel(&ws)];
        let shape = conv_taps(&x.shape, &ws, win, |yi, xi, wi| {
            dw[wi] += dy.data.get(yi).copied().unwrap_or(0.0) * x.data[xi]
        })?;
        if shape != dy.shape {
            return Err(BackendError::Shape(format!(
                "conv2d gradient {:?} does not match output {shape:?}",
                dy.shape
            )));
        }
        RefTensor::new(dw, ws)
    }

    fn max_pool2d(&self, x: &RefTensor, win: Window) -> Result<RefTensor> {
        let (out, shape) = pool::max_pool(&x.data, &x.shape, win)?;
        RefTensor::new(out, shape)
    }

    fn max_pool2d_backward(&self, x: &RefTensor, dy: &RefTensor, win: Window) -> Result<RefTensor> {
        let dx = pool::max_pool_backward(&x.data, &x.shape, &dy.data, win)?;
        RefTensor::new(dx, x.shape.clone())
    }

    fn avg_pool2d(&self, x: &RefTensor, win: Window) -> Result<RefTensor> {
        let (out, shape) = pool::avg_pool(&x.data, &x.shape, win)?;
        RefTensor::new(out, shape)
    }

    fn avg_pool2d_backward(
        &self,
        dy: &RefTensor,
        input_shape: &[usize],
        win: Window,
    ) -> Result<RefTensor> {
        let dx = pool::avg_pool_backward(&dy.data, input_shape, win)?;
        RefTensor::new(dx, input_shape.to_vec())
    }
}
