//! Matrix products of host `f32` matrices, split between the threads by columns of the result.
//!
//! candle hands a product to `gemm` with `gemm`'s own threading, which on a 2-core machine ran
//! gpt2-small's shapes slowest where the right operand is a weight read transposed (`x · Wᵀ`,
//! 1024x3072 · 3072x768 at 150-169 GFLOP/s). Giving each thread its own block of result
//! columns, each one a single-threaded `gemm` call, ran it at 178-180 (`fusionllm bench`,
//! docs/BENCHMARKS.md). Operands are read in place with their strides (transposed or not);
//! anything else (other dtypes, batched products, CUDA) returns `None` and takes candle's path.

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

/// How a product is shared between the threads: result column blocks, each one `gemm` call run
/// with `inner` threading.
struct Split {
    spans: Vec<(usize, usize)>,
    inner: Parallelism,
}

/// The split of an `m x k . k x n` product on `threads` threads. A tall product whose left
/// operand is read transposed (a weight gradient `dyᵀ · x`, 50257 x 1024 . 1024 x 768 for the
/// output head) ran faster with `gemm`'s own threading than split by columns in a one-off probe
/// (387 against 405-414 ms; `fusionllm bench` times the kept path); everything else
/// is split into column blocks of whole cache lines, one per thread.
fn split(m: usize, n: usize, k: usize, a_transposed: bool, threads: usize) -> Split {
    let whole = |inner| Split {
        spans: vec![(0, n)],
        inner,
    };
    if m * n * k < PARALLEL_MIN || threads < 2 {
        return whole(Parallelism::None);
    }
    if a_transposed && m > n {
        return whole(Parallelism::Rayon(threads));
    }
    let parts = threads.min(n / ALIGN).max(1);
    let width = n.div_ceil(parts).div_ceil(ALIGN) * ALIGN;
    Split {
        spans: (0..n)
            .step_by(width.max(1))
            .map(|c0| (c0, (c0 + width).min(n)))
            .collect(),
        inner: Parallelism::None,
    }
}

/// Columns `c0..c1` of `a · b` into `dst` (row stride `n`), added to what `dst` holds when
/// `accumulate`, with `inner` threading.
fn block(
    (a, b): (&Operand, &Operand),
    (dst, n): (Dst, usize),
    accumulate: bool,
    inner: Parallelism,
    (c0, c1): (usize, usize),
) {
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
            inner,
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
    let n = match b.dims() {
        &[_, n] => n,
        _ => return None,
    };
    let bias: Option<Vec<f32>> = match bias {
        Some(t) if t.dims() == [n] && t.dtype() == candle_core::DType::F32 => {
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
            let m = a.rows;
            let mut out = match &bias {
                Some(row) => row.repeat(m),
                None => vec![0f32; m * n],
            };
            if m == 0 || n == 0 || a.cols == 0 {
                return Some(out);
            }
            let accumulate = bias.is_some();
            let dst = Dst(out.as_mut_ptr());
            // (A broadcast operand, stride 0, counts as transposed too: only a speed choice.)
            let a_transposed = a.col_stride != 1 && a.cols > 1;
            let threads = rayon::current_num_threads();
            let Split { spans, inner } = split(m, n, a.cols, a_transposed, threads);
            rayon::scope(|s| {
                for &span in &spans {
                    let ops = (&a, &b);
                    s.spawn(move |_| block(ops, (dst, n), accumulate, inner, span));
                }
            });
            Some(out)
        })
    })?;
    Tensor::from_vec(out, (a.dims()[0], b.dims()[1]), &Device::Cpu).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_every_column_once_in_whole_cache_lines() {
        for (n, threads) in [(70, 2), (768, 2), (50257, 2), (768, 16), (20, 4), (3072, 3)] {
            let s = split(1024, n, 768, false, threads);
            assert!(matches!(s.inner, Parallelism::None));
            assert_eq!(s.spans.first().map(|s| s.0), Some(0));
            assert_eq!(s.spans.last().map(|s| s.1), Some(n));
            assert!(s.spans.windows(2).all(|w| w[0].1 == w[1].0));
            assert!(s.spans.iter().all(|&(c0, _)| c0 % ALIGN == 0));
            assert!(s.spans.len() <= threads, "{n} {threads}: {:?}", s.spans);
        }
        // Small products run on one thread, tall transposed ones with gemm's threading.
        assert_eq!(split(8, 8, 8, false, 2).spans, vec![(0, 8)]);
        let tall = split(50257, 768, 1024, true, 2);
        assert!(matches!(tall.inner, Parallelism::Rayon(2)));
        assert_eq!(tall.spans, vec![(0, 768)]);
    }
}
