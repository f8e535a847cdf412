//! Convolution as matrix products on the CPU: `im2col` unrolls the receptive fields so the
//! convolution, and both of its gradients, become single large GEMMs; `col2im` folds them back,
//! summing overlaps (the input gradient).

use crate::error::{BackendError, Result};
use crate::pool::Elem;
use crate::Window;
use rayon::prelude::*;

/// Geometry of one convolution: input `[n, c, h, w]`, weight `[o, c, k, k]`, output `[n, o, oh, ow]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConvGeom {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub o: usize,
    pub oh: usize,
    pub ow: usize,
    pub win: Window,
}

impl ConvGeom {
    pub fn new(x: &[usize], w: &[usize], win: Window) -> Result<Self> {
        if x.len() != 4 || w.len() != 4 || x[1] != w[1] || w[2] != win.kernel || w[3] != win.kernel
        {
            return Err(BackendError::Shape(format!(
                "conv2d input {x:?} does not fit weight {w:?}"
            )));
        }
        Ok(ConvGeom {
            n: x[0],
            c: x[1],
            h: x[2],
            w: x[3],
            o: w[0],
            oh: win.out_size(x[2])?,
            ow: win.out_size(x[3])?,
            win,
        })
    }
    /// Output positions over the batch (the unrolled matrix's row length).
    pub fn rows(&self) -> usize {
        self.n * self.oh * self.ow
    }
    /// Kernel taps: one per (input channel, kernel row, kernel column).
    pub fn cols(&self) -> usize {
        self.c * self.win.kernel * self.win.kernel
    }

    /// Input coordinate of output position `o` and kernel offset `k` along one axis, if inside.
    fn src(&self, o: usize, k: usize, size: usize) -> Option<usize> {
        let i = (o * self.win.stride + k) as isize - self.win.padding as isize;
        (i >= 0 && (i as usize) < size).then_some(i as usize)
    }
}

/// Unrolls `x [n, c, h, w]` into `[c * k * k, n * oh * ow]`: row `(c, ky, kx)` holds, for every
/// output position, the input element under that kernel tap (zero in the padding). With this
/// layout the convolution is `W [o, c*k*k] x cols`, and every row is filled by contiguous runs.
pub(crate) fn im2col<T: Elem + Send + Sync>(x: &[T], g: &ConvGeom) -> Vec<T> {
    let k = g.win.kernel;
    let row_len = g.rows();
    let mut out = vec![T::default(); g.cols() * row_len];
    out.par_chunks_mut(row_len)
        .enumerate()
        .for_each(|(r, row)| {
            let (c, ky, kx) = (r / (k * k), (r / k) % k, r % k);
            for b in 0..g.n {
                for oy in 0..g.oh {
                    let Some(iy) = g.src(oy, ky, g.h) else {
                        continue;
                    };
                    let src = &x[((b * g.c + c) * g.h + iy) * g.w..][..g.w];
                    let dst = &mut row[(b * g.oh + oy) * g.ow..][..g.ow];
                    for (ox, d) in dst.iter_mut().enumerate() {
                        if let Some(ix) = g.src(ox, kx, g.w) {
                            *d = src[ix];
                        }
                    }
                }
            }
        });
    out
}

/// The adjoint of [`im2col`]: sums every entry of `cols [c * k * k, n * oh * ow]` back into the
/// input element it was read from (the convolution's input gradient). Parallel over input
/// planes, so no two threads write the same element.
pub(crate) fn col2im<T: Elem + Send + Sync>(cols: &[T], g: &ConvGeom) -> Vec<T> {
    let k = g.win.kernel;
    let row_len = g.rows();
    let mut out = vec![T::default(); g.n * g.c * g.h * g.w];
    out.par_chunks_mut(g.h * g.w)
        .enumerate()
        .for_each(|(plane_index, plane)| {
            let (b, c) = (plane_index / g.c, plane_index % g.c);
            for ky in 0..k {
                for kx in 0..k {
                    let row = &cols[((c * k + ky) * k + kx) * row_len..][..row_len];
                    for oy in 0..g.oh {
                        let Some(iy) = g.src(oy, ky, g.h) else {
                            continue;
                        };
                        let src = &row[(b * g.oh + oy) * g.ow..][..g.ow];
                        let dst = &mut plane[iy * g.w..][..g.w];
                        for (ox, &v) in src.iter().enumerate() {
                            if let Some(ix) = g.src(ox, kx, g.w) {
                                dst[ix] = dst[ix] + v;
                            }
                        }
                    }
                }
            }
        });
    out
}
