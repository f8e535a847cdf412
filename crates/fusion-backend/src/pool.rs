//! Pooling loops shared by both backends (host memory, any float element type).

use crate::error::{BackendError, Result};
use crate::Window;

pub(crate) trait Elem:
    Copy
    + PartialOrd
    + Default
    + std::ops::Add<Output = Self>
    + std::ops::Mul<Output = Self>
    + From<f32>
{
}
impl Elem for f32 {}
impl Elem for f64 {}

pub(crate) struct PoolGeom {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub oh: usize,
    pub ow: usize,
}

pub(crate) fn geometry(shape: &[usize], win: Window) -> Result<PoolGeom> {
    if shape.len() != 4 {
        return Err(BackendError::Shape(format!(
            "pooling needs [N, C, H, W], got {shape:?}"
        )));
    }
    Ok(PoolGeom {
        n: shape[0],
        c: shape[1],
        h: shape[2],
        w: shape[3],
        oh: win.out_size(shape[2])?,
        ow: win.out_size(shape[3])?,
    })
}

/// Index (within one H x W plane) of the first maximal element of each window.
fn argmax_plane<T: Elem>(
    plane: &[T],
    g: &PoolGeom,
    win: Window,
    oy: usize,
    ox: usize,
) -> Option<usize> {
    let mut best: Option<(usize, T)> = None;
    for ky in 0..win.kernel {
        let y = (oy * win.stride + ky) as isize - win.padding as isize;
        if y < 0 || y >= g.h as isize {
            continue;
        }
        for kx in 0..win.kernel {
            let x = (ox * win.stride + kx) as isize - win.padding as isize;
            if x < 0 || x >= g.w as isize {
                continue;
            }
            let idx = y as usize * g.w + x as usize;
            let v = plane[idx];
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((idx, v));
            }
        }
    }
    best.map(|(i, _)| i)
}

pub(crate) fn max_pool<T: Elem>(
    x: &[T],
    shape: &[usize],
    win: Window,
) -> Result<(Vec<T>, Vec<usize>)> {
    let g = geometry(shape, win)?;
    let mut out = Vec::with_capacity(g.n * g.c * g.oh * g.ow);
    for plane in x.chunks(g.h * g.w).take(g.n * g.c) {
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                let i = argmax_plane(plane, &g, win, oy, ox).ok_or_else(|| {
                    BackendError::Shape("pooling window covers only padding".into())
                })?;
                out.push(plane[i]);
            }
        }
    }
    Ok((out, vec![g.n, g.c, g.oh, g.ow]))
}

pub(crate) fn max_pool_backward<T: Elem>(
    x: &[T],
    shape: &[usize],
    dy: &[T],
    win: Window,
) -> Result<Vec<T>> {
    let g = geometry(shape, win)?;
    if dy.len() != g.n * g.c * g.oh * g.ow {
        return Err(BackendError::Shape(
            "max pool gradient has the wrong size".into(),
        ));
    }
    let mut dx = vec![T::default(); x.len()];
    let plane_len = g.h * g.w;
    for p in 0..g.n * g.c {
        let plane = &x[p * plane_len..(p + 1) * plane_len];
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                if let Some(i) = argmax_plane(plane, &g, win, oy, ox) {
                    let d = dy[(p * g.oh + oy) * g.ow + ox];
                    dx[p * plane_len + i] = dx[p * plane_len + i] + d;
                }
            }
        }
    }
    Ok(dx)
}

pub(crate) fn avg_pool<T: Elem>(
    x: &[T],
    shape: &[usize],
    win: Window,
) -> Result<(Vec<T>, Vec<usize>)> {
    if win.padding != 0 {
        return Err(BackendError::Shape(
            "average pooling does not support padding".into(),
        ));
    }
    let g = geometry(shape, win)?;
    let scale = T::from(1.0 / (win.kernel * win.kernel) as f32);
    let mut out = Vec::with_capacity(g.n * g.c * g.oh * g.ow);
    for plane in x.chunks(g.h * g.w).take(g.n * g.c) {
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                let mut s = T::default();
                for ky in 0..win.kernel {
                    for kx in 0..win.kernel {
                        s = s + plane[(oy * win.stride + ky) * g.w + ox * win.stride + kx];
                    }
                }
                out.push(s * scale);
            }
        }
    }
    Ok((out, vec![g.n, g.c, g.oh, g.ow]))
}

pub(crate) fn avg_pool_backward<T: Elem>(dy: &[T], shape: &[usize], win: Window) -> Result<Vec<T>> {
    let g = geometry(shape, win)?;
    if dy.len() != g.n * g.c * g.oh * g.ow {
        return Err(BackendError::Shape(
            "average pool gradient has the wrong size".into(),
        ));
    }
    let scale = T::from(1.0 / (win.kernel * win.kernel) as f32);
    let mut dx = vec![T::default(); g.n * g.c * g.h * g.w];
    for p in 0..g.n * g.c {
        let plane = &mut dx[p * g.h * g.w..(p + 1) * g.h * g.w];
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                let d = dy[(p * g.oh + oy) * g.ow + ox] * scale;
                for ky in 0..win.kernel {
                    for kx in 0..win.kernel {
                        let i = (oy * win.stride + ky) * g.w + ox * win.stride + kx;
                        plane[i] = plane[i] + d;
                    }
                }
            }
        }
    }
    Ok(dx)
}
