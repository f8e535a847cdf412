//! Matrix products of host `f32` matrices, split between the threads by columns of the result.
//!
//! candle hands a product to `gemm` with `gemm`'s own threading, which on a 2-core machine ran
//! gpt2-small's shapes at 155-200 GFLOP/s: slowest where the right operand is a weight read
//! transposed (`x · Wᵀ`, 1024x3072 · 3072x768 at 155). Giving each thread its own block of
//! result columns, each one a single-threaded `gemm` call, ran the same products at 190-220
//! (`fusionllm bench`, docs/BENCHMARKS.md). Operands are read in place with their strides
//! (transposed or not); anything else (other dtypes, batched products, CUDA) returns `None` and
//! takes candle's path.

use candle_core::{CpuStorage, Device, Storage, Tensor};
use gemm::Parallelism;

/// Columns of the result per thread are a multiple of this (whole cache lines of a row).
const ALIGN: usize = 16;
/// Below this many multiply-adds one thread does the product.
const PARALLEL_MIN: usize = 1 << 20;

/// A 2-D host `f32` operand: its elements from the first one it reads, and its strides.
struct Operand<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl Operand<'_> {
    /// Whether every element the strides address lies in `data`.
    fn in_bounds(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride
                < self.data.len()
    }
}

/// Runs `f` on `t`'s operand view, if `t` is a 2-D host `f32` tensor.
fn with_operand<R>(t: &Tensor, f: impl FnOnce(Operand) -> Option<R>) -> Option<R> {
    let &[rows, cols] = t.dims() else {
        return None;
    };
    let (storage, layout) = t.storage_and_layout();
    let &[row_stride, col_stride] = layout.stride() else {
        return None;
    };
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => {
            let op = Operand {
                data: v.get(layout.start_offset()..)?,
                rows,
                cols,
                row_stride,
                col_stride,
            };
            op.in_bounds().then_some(())?;
            f(op)
        }
        _ => None,
    }
}

/// A result pointer that may cross into the threads: each writes its own columns.
#[derive(Clone, Copy)]
struct Dst(*mut f32);
// SAFETY: the threads write disjoint column blocks of one buffer that outlives them.
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

/// Columns `c0..c1` of `a · b` into `dst` (row stride `n`), added to what `dst` holds when
/// `accumulate`.
fn block(a: &Operand, b: &Operand, dst: Dst, n: usize, accumulate: bool, (c0, c1): (usize, usize)) {
    let (m, k) = (a.rows, a.cols);
    // SAFETY: `a` and `b` were checked to hold every element their strides address (b's columns
    // c0..c1 lie inside b), and `dst` holds m x n elements of which this call writes columns
    // c0..c1 only; no other thread writes them and nothing reads them until all have finished.
    unsafe {
        gemm::gemm(
            m,
            c1 - c0,
            k,
            dst.0.add(c0),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr().add(c0 * b.col_stride),
            b.col_stride as isize,
            b.row_stride as isize,
            if accumulate { 1.0f32 } else { 0.0f32 },
            1.0f32,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// `a [m, k] · b [k, n]` for 2-D host `f32` tensors (either may be a transposed view), or `None`.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Option<Tensor> {
    product(a, b, None)
}

/// `a [m, k] · b [k, n] + bias [n]`: the rows start as the bias and the product adds into them
/// (one pass over the result instead of a second one for the bias), or `None`.
pub(crate) fn matmul_bias(a: &Tensor, b: &Tensor, bias: &Tensor) -> Option<Tensor> {
    product(a, b, Some(bias))
}

fn product(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Option<Tensor> {
    let bias: Option<Vec<f32>> = match bias {
        Some(t) if t.dims() == [b.dims()[1]] && t.dtype() == candle_core::DType::F32 => {
            Some(t.to_vec1().ok()?)
        }
        Some(_) => return None,
        None => None,
    };
    let out = with_operand(a, |a| {
        with_operand(b, |b| {
            if a.cols != b.rows {
                return None;
            }
            let (m, n) = (a.rows, b.cols);
            let mut out = match &bias {
                Some(row) => row.repeat(m),
                None => vec![0f32; m * n],
            };
            if m == 0 || n == 0 || a.cols == 0 {
                return Some(out);
            }
            let accumulate = bias.is_some();
            let dst = Dst(out.as_mut_ptr());
            let threads = rayon::current_num_threads().max(1);
            let parts = if m * n * a.cols < PARALLEL_MIN {
                1
            } else {
                threads.min(n / ALIGN).max(1)
            };
            let width = n.div_ceil(parts).div_ceil(ALIGN) * ALIGN;
            let spans: Vec<(usize, usize)> = (0..n)
                .step_by(width.max(1))
                .map(|c0| (c0, (c0 + width).min(n)))
                .collect();
            rayon::scope(|s| {
                for &span in &spans {
                    let (a, b) = (&a, &b);
                    s.spawn(move |_| block(a, b, dst, n, accumulate, span));
                }
            });
            Some(out)
        })
    })?;
    Tensor::from_vec(out, (a.dims()[0], b.dims()[1]), &Device::Cpu).ok()
}
