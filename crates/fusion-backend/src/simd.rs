//! The instruction set of the element-wise loops, chosen when the program runs.
//!
//! The workspace compiles for baseline x86-64 (SSE2: four `f32` lanes) so that one binary runs on
//! every node of a cluster, whatever its processor. The matrix products (`gemm`) already pick
//! AVX2 or AVX-512 at run time; the loops written here (softmax, cross-entropy, GELU, the
//! element-wise maps, AdamW) do the same through [`dispatch`], which runs a closure inside a
//! function compiled for the best level this processor has, so the closure's loops, inlined
//! there, use its vector width.
//!
//! The level changes speed, never results: Rust does not fuse multiplies and adds or reorder
//! floating-point sums on its own, so each level computes the same operations in the same order
//! and gives the same bits (asserted by `tests/simd_levels.rs`). Reductions that should
//! vectorise are written with explicit lanes ([`LANES`] partial sums added in a fixed order).
//!
//! `FUSION_SIMD=baseline|avx2|avx512` caps the level (to compare them, or to rule them out).

use num_traits::Float;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// Partial sums of a vectorised reduction: 16 `f32` fill one AVX-512 register.
pub const LANES: usize = 16;

/// An instruction-set level of the element-wise loops, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// What the binary is compiled for (SSE2 on x86-64; any other architecture).
    Baseline = 1,
    /// AVX2 with FMA (256-bit).
    Avx2 = 2,
    /// AVX-512 F/BW/DQ/VL (512-bit).
    Avx512 = 3,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Level; 3] = [Level::Baseline, Level::Avx2, Level::Avx512];

    /// The name `FUSION_SIMD` takes.
    pub fn name(self) -> &'static str {
        match self {
            Level::Baseline => "baseline",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    fn parse(s: &str) -> Option<Level> {
        Level::ALL.into_iter().find(|l| l.name() == s.trim())
    }

    fn from_u8(v: u8) -> Option<Level> {
        Level::ALL.into_iter().find(|l| *l as u8 == v)
    }
}

/// The best level this processor supports: every feature its `#[target_feature]` function
/// below enables is detected (a virtual machine may hide some of them).
pub fn supported() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2")
            && has!("avx")
            && has!("fma")
            && has!("bmi1")
            && has!("bmi2")
            && has!("f16c");
        let avx512 = has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl");
        if avx2 && avx512 {
            return Level::Avx512;
        }
        if avx2 {
            return Level::Avx2;
        }
    }
    Level::Baseline
}

/// The level in force unless [`force`] says otherwise: [`supported`], capped by `FUSION_SIMD`
/// (an unknown value is ignored with a warning).
fn configured() -> Level {
    static CONFIGURED: OnceLock<Level> = OnceLock::new();
    *CONFIGURED.get_or_init(|| {
        let best = supported();
        match std::env::var("FUSION_SIMD") {
            Ok(v) => match Level::parse(&v) {
                Some(cap) => cap.min(best),
                None => {
                    eprintln!(
                        "warning: FUSION_SIMD={v:?} is not baseline, avx2 or avx512; using {}",
                        best.name()
                    );
                    best
                }
            },
            Err(_) => best,
        }
    })
}

/// A level set by [`force`] (0: none).
static FORCED: AtomicU8 = AtomicU8::new(0);

/// Runs the element-wise loops at `level` (capped at [`supported`], not at `FUSION_SIMD`) from
/// now on, in every thread; `None` goes back to the configured level. For benchmarks and tests: the level never
/// changes results, so a test forcing it does not disturb others running beside it.
pub fn force(level: Option<Level>) {
    let v = level.map_or(0, |l| l.min(supported()) as u8);
    FORCED.store(v, Ordering::Relaxed);
}

/// The level [`dispatch`] runs at now.
pub fn level() -> Level {
    Level::from_u8(FORCED.load(Ordering::Relaxed)).unwrap_or_else(configured)
}

/// Runs `f` compiled for [`level`]: the closure is inlined into a function built with that
/// level's instruction set. Call it around a loop over at least a few hundred elements (it costs
/// an atomic load and a branch), inside any parallel split (a `rayon` task runs outside it).
#[inline(always)]
pub fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    match level() {
        // SAFETY: `level()` never exceeds `supported()`, so the processor has these features.
        Level::Avx512 => return unsafe { avx512(f) },
        Level::Avx2 => return unsafe { avx2(f) },
        Level::Baseline => {}
    }
    f()
}

// The feature lists must match what `supported` detects.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,avx,fma,bmi1,bmi2,f16c")]
unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx,fma,bmi1,bmi2,f16c")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Adds the whole groups of [`LANES`] at the front of `xs` into `acc` (element `i` into lane
/// `i % LANES`) and returns the elements left over (fewer than [`LANES`]).
#[inline(always)]
pub fn add_lanes<'a, T: Copy + std::ops::Add<Output = T>>(
    acc: &mut [T; LANES],
    xs: &'a [T],
) -> &'a [T] {
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = *a + x;
        }
    }
    rest
}

/// The sum of `xs`: element `i` goes to partial sum `i % LANES`, the partial sums are folded
/// ([`fold_lanes`]) and the elements past the last whole group added after, in order: the same
/// order on every level, in a loop that vectorises.
#[inline(always)]
pub fn lanes_sum<T: Float>(xs: &[T]) -> T {
    let mut acc = [T::zero(); LANES];
    let rest = add_lanes(&mut acc, xs);
    rest.iter().fold(fold_lanes(acc), |s, &x| s + x)
}

/// `sum(a[i] * b[i])` over the shorter of the two, in the order of [`lanes_sum`].
#[inline(always)]
pub fn lanes_dot<T: Float>(a: &[T], b: &[T]) -> T {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [T::zero(); LANES];
    let whole = n / LANES * LANES;
    for (ca, cb) in a[..whole]
        .chunks_exact(LANES)
        .zip(b[..whole].chunks_exact(LANES))
    {
        for ((s, &x), &y) in acc.iter_mut().zip(ca).zip(cb) {
            *s = *s + x * y;
        }
    }
    a[whole..]
        .iter()
        .zip(&b[whole..])
        .fold(fold_lanes(acc), |s, (&x, &y)| s + x * y)
}

/// The largest element of `xs` (`-inf` for none), in [`LANES`] lanes so the loop vectorises; a
/// maximum does not depend on the order.
#[inline(always)]
pub fn lanes_max<T: Float>(xs: &[T]) -> T {
    let mut acc = [T::neg_infinity(); LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.max(x);
        }
    }
    let max = acc.iter().fold(T::neg_infinity(), |m, &x| m.max(x));
    rest.iter().fold(max, |m, &x| m.max(x))
}

/// Adds [`LANES`] partial sums in a fixed order (pairwise), the same on every level.
#[inline(always)]
pub fn fold_lanes<T: Copy + std::ops::Add<Output = T>>(mut acc: [T; LANES]) -> T {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for j in 0..width {
            acc[j] = acc[j] + acc[j + width];
        }
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_and_never_exceed_the_processor() {
        for l in Level::ALL {
            assert_eq!(Level::parse(l.name()), Some(l));
        }
        assert_eq!(Level::parse("sse9"), None);
        assert!(level() <= supported());
    }

    #[test]
    fn lane_reductions_cover_every_element() {
        for n in [0usize, 1, 15, 16, 17, 40] {
            let xs: Vec<f64> = (0..n).map(|i| (i * 7 % 11) as f64 - 3.0).collect();
            assert_eq!(lanes_sum(&xs), xs.iter().sum::<f64>(), "sum of {n}");
            let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(lanes_max(&xs), max, "max of {n}");
        }
    }

    #[test]
    fn lanes_fold_pairwise() {
        let acc: [f64; LANES] = std::array::from_fn(|i| (i + 1) as f64);
        assert_eq!(fold_lanes(acc), (1..=LANES).sum::<usize>() as f64);
    }
}
