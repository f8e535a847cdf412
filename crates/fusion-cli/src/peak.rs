//! Peak fused-multiply-add rate of this CPU: independent FMA chains in registers on every thread,
//! the ceiling any f32 GEMM can reach.

use std::time::Instant;

const CHAINS: usize = 12;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut s = _mm256_setzero_ps();
    for x in acc {
        s = _mm256_add_ps(s, x);
    }
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    out.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_avx512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in acc {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}

/// (lanes, kernel) for the widest FMA this CPU has.
fn kernel() -> (usize, &'static str, fn(u64) -> f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was detected at run time.
            return (16, "avx512", |n| unsafe { fma_avx512(n) });
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the features were detected at run time.
            return (8, "avx2+fma", |n| unsafe { fma_avx2(n) });
        }
    }
    (1, "scalar", |n| {
        let mut acc = [1.0f32; CHAINS];
        for _ in 0..n {
            for x in acc.iter_mut() {
                *x = x.mul_add(0.999_999, 1e-7);
            }
        }
        acc.iter().sum()
    })
}

/// Measured peak f32 FLOP/s over `threads` threads, and the instruction set used.
pub fn peak_flops(threads: usize) -> (f64, &'static str) {
    let (lanes, isa, f) = kernel();
    let iters: u64 = 50_000_000;
    f(iters / 50); // warm up clocks
    let start = Instant::now();
    let sink: f32 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(move || f(iters))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    });
    let secs = start.elapsed().as_secs_f64();
    std::hint::black_box(sink);
    let flops = (threads as u64 * iters * CHAINS as u64 * lanes as u64 * 2) as f64;
    (flops / secs, isa)
}
