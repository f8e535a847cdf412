//! Top-k selection by magnitude: which `k` of `n` values a sparse message keeps.
//!
//! `exact` finds the k-th largest magnitude with a linear-time selection on a copy of the
//! magnitudes, then keeps everything above it (and enough ties) in one pass. `approx` estimates
//! that threshold from a random sample and keeps everything at or above it in one pass, trimming
//! to at most `k` with an exact selection over the (few) candidates: it never sends more than
//! asked, sometimes a little less. Both return ascending indices.

use serde::{Deserialize, Serialize};

/// How top-k indices are chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    Exact,
    /// Threshold from a sample of at most [`SAMPLE`] values, then one pass.
    #[default]
    Approx,
}

/// Most values sampled to estimate the threshold.
pub const SAMPLE: usize = 32 * 1024;

/// How many values to sample from `n` to keep `k`.
///
/// A sample of s values puts the threshold about 3·k/√(s·k/n) candidates too low (the margin
/// that keeps the pass from finding fewer than k), and those candidates must be gathered and
/// trimmed. A draw costs about 4 ns (a random load); a surplus candidate about 7 ns. The total
/// 4·s + 21·k/√(s·k/n) is least at s = (2.6 · n · √(k/n))^(2/3): about n/160 values for 1 MB at
/// 1%, n/256 for 4 MB, n/640 for 64 MB.
fn sample_size(n: usize, k: usize) -> usize {
    let density = k as f64 / n as f64;
    let best = (2.6 * n as f64 * density.sqrt()).powf(2.0 / 3.0);
    (best as usize).clamp(1024, SAMPLE).min(n / 8)
}

/// Ascending indices of the `k` values of `x` with the largest magnitude.
pub fn top_k(x: &[f32], k: usize, how: Selection, seed: u64) -> Vec<u32> {
    match how {
        Selection::Exact => exact(x, k),
        Selection::Approx => approx(x, k, seed),
    }
}

/// [`top_k`] with the kept values beside their indices. The sampled selection picks the values
/// up while it scans, so an encoder need not gather them again from a tensor that has long left
/// the cache.
pub fn top_k_with_values(x: &[f32], k: usize, how: Selection, seed: u64) -> (Vec<u32>, Vec<f32>) {
    match how {
        Selection::Approx if k < x.len() && x.len() > 8 * 1024 && k > 0 => {
            approx_with_values(x, k, seed)
        }
        _ => {
            let idx = top_k(x, k, how, seed);
            let vals = idx.iter().map(|&i| x[i as usize]).collect();
            (idx, vals)
        }
    }
}

/// The exact top-k (ties at the threshold broken by position).
pub fn exact(x: &[f32], k: usize) -> Vec<u32> {
    let n = x.len();
    if k >= n {
        return (0..n as u32).collect();
    }
    if k == 0 {
        return Vec::new();
    }
    // Magnitudes as integers (see `magnitude`): the same order as the floats, a cheaper compare.
    let mut mags: Vec<u32> = x.iter().map(|&v| magnitude(v)).collect();
    let (_, t, above) = mags.select_nth_unstable(n - k);
    let t = *t;
    let greater = above.iter().filter(|&&m| m > t).count();
    keep_above(x.iter().map(|&v| magnitude(v)), t, k - greater)
}

/// Positions of the magnitudes above `t`, and of the first `ties` equal to it.
fn keep_above(mags: impl Iterator<Item = u32>, t: u32, mut ties: usize) -> Vec<u32> {
    let mut out = Vec::new();
    for (i, m) in mags.enumerate() {
        if m > t {
            out.push(i as u32);
        } else if m == t && ties > 0 {
            ties -= 1;
            out.push(i as u32);
        }
    }
    out
}

/// |v| as an integer that orders like the magnitude: for non-negative floats the bit patterns
/// order like the values, and integer compares vectorise on every x86-64 (a float max does not,
/// because of its NaN rules). NaN magnitudes sort above infinity, as `f32::total_cmp` has them.
#[inline(always)]
fn magnitude(v: f32) -> u32 {
    v.to_bits() & 0x7fff_ffff
}

/// Approximate top-k: at most `k` indices, usually within a few percent of `k`.
pub fn approx(x: &[f32], k: usize, seed: u64) -> Vec<u32> {
    if k >= x.len() || x.len() <= 8 * 1024 || k == 0 {
        return exact(x, k);
    }
    approx_with_values(x, k, seed).0
}

/// [`approx`] on a tensor of more than 8 Ki values and `0 < k < n`, with the kept values.
fn approx_with_values(x: &[f32], k: usize, seed: u64) -> (Vec<u32>, Vec<f32>) {
    let n = x.len();
    let samples = sample_size(n, k);
    let mut sample = stratified_sample(x, samples, seed);
    // Two quantiles of the sample, three standard deviations of the sample count either side of
    // the (1 − k/n) one. Everything at or above the low one is a candidate, so the pass rarely
    // finds fewer than k; everything at or above the high one is almost surely in the top k, so
    // only the band between them needs an exact selection when the surplus is trimmed.
    let c = k as f64 / n as f64 * samples as f64;
    let margin = 3.0 * c.sqrt() + 1.0;
    let low = samples - ((c + margin).ceil() as usize).clamp(1, samples);
    let high_count = (c - margin).floor().max(0.0) as usize;
    let (_, &mut t_low, upper) = sample.select_nth_unstable(low);
    let t_high = match upper.len().checked_sub(high_count) {
        Some(at) if high_count > 0 && at < upper.len() => *upper.select_nth_unstable(at).1,
        _ => u32::MAX,
    };
    let expect = (c + margin) / samples as f64 * n as f64;
    // Magnitudes fit in 31 bits, so a signed compare (one SSE2 instruction) is exact.
    let idx = at_or_above(x, t_low as i32, expect as usize);
    let vals: Vec<f32> = idx.iter().map(|&i| x[i as usize]).collect();
    if idx.len() <= k {
        return (idx, vals);
    }
    trim(idx, vals, k, t_high)
}

/// The `k` largest of more than `k` candidates (ties broken by position), selecting exactly
/// only among those below `t_high` when fewer than `k` reach it. Compacts in place: at high
/// densities the candidates run to megabytes, and fresh buffers would cost more in page faults
/// than the selection itself.
fn trim(mut idx: Vec<u32>, mut vals: Vec<f32>, k: usize, t_high: u32) -> (Vec<u32>, Vec<f32>) {
    let mags = || vals.iter().map(|&v| magnitude(v));
    let sure = mags().filter(|&m| m >= t_high).count();
    let (t, greater) = if sure < k {
        // The k-th largest overall is the (k − sure)-th largest below t_high.
        let mut band: Vec<u32> = mags().filter(|&m| m < t_high).collect();
        let at = band.len() - (k - sure);
        let (_, t, above) = band.select_nth_unstable(at);
        (*t, sure + above.iter().filter(|&&m| m > *t).count())
    } else {
        let mut all: Vec<u32> = mags().collect();
        let at = all.len() - k;
        let (_, t, above) = all.select_nth_unstable(at);
        (*t, above.iter().filter(|&&m| m > *t).count())
    };
    let mut ties = k - greater;
    let mut kept = 0;
    for j in 0..idx.len() {
        let m = magnitude(vals[j]);
        let keep = m > t || (m == t && ties > 0);
        ties -= (keep && m == t) as usize;
        idx[kept] = idx[j];
        vals[kept] = vals[j];
        kept += keep as usize;
    }
    idx.truncate(kept);
    vals.truncate(kept);
    (idx, vals)
}

/// Magnitudes (see [`magnitude`]) of `samples` values of `x`: one drawn uniformly from each of
/// `samples` equal strata. Stratifying is at least as accurate as independent draws, and hashing
/// the stratum number (instead of stepping a generator) leaves no dependency between draws, so
/// the hashes vectorise and the loads overlap.
fn stratified_sample(x: &[f32], samples: usize, seed: u64) -> Vec<u32> {
    let stride = (x.len() / samples) as u64;
    let salt = (seed ^ (seed >> 32)) as u32;
    (0..samples as u32)
        .map(|s| {
            // A 32-bit integer hash with low bias (two multiply-xorshift rounds).
            let mut z = s ^ salt.wrapping_mul(0x9E37_79B9);
            z = (z ^ (z >> 16)).wrapping_mul(0x7FEB_352D);
            z = (z ^ (z >> 15)).wrapping_mul(0x846C_A68B);
            z ^= z >> 16;
            let offset = (z as u64 * stride) >> 32;
            magnitude(x[(s as u64 * stride + offset) as usize])
        })
        .collect()
}

/// The ascending indices of the values of `x` whose magnitude (see [`magnitude`]) is at least
/// `t_bits`, about `expect` of them.
fn at_or_above(x: &[f32], t_bits: i32, expect: usize) -> Vec<u32> {
    // Write about twice the expected number of hits per run unconditionally (see
    // `at_or_above_runs`): rarely more, so the branch for more is rarely taken.
    let per_run = expect as f64 * RUN as f64 / x.len().max(1) as f64;
    if per_run <= 1.5 {
        at_or_above_runs::<4>(x, t_bits, expect)
    } else if per_run <= 4.0 {
        at_or_above_runs::<8>(x, t_bits, expect)
    } else if per_run <= 10.0 {
        at_or_above_runs::<16>(x, t_bits, expect)
    } else {
        at_or_above_runs::<32>(x, t_bits, expect)
    }
}

/// Values per run: one bit each in a `u64` mask.
const RUN: usize = 64;

/// [`at_or_above`], writing `U` indices of each run unconditionally.
///
/// Each run of 64 values becomes a bitmask in two vectorised steps (compare into bytes, then
/// eight bytes to eight bits with one multiply), and the set bits are written out without a
/// branch per value: the first `U` unconditionally (writes past the count are overwritten by
/// the next run), more only when a run holds more than `U`. That keeps the pass close to the
/// speed of a plain compare-and-count. Compiled for AVX2 as well as the baseline, picked at run
/// time.
#[multiversion::multiversion(targets("x86_64+avx2", "aarch64+neon"))]
fn at_or_above_runs<const U: usize>(x: &[f32], t_bits: i32, expect: usize) -> Vec<u32> {
    let above = |v: f32| magnitude(v) as i32 >= t_bits;
    let mut out = vec![0u32; expect + RUN];
    let mut len = 0;
    let runs = x.chunks_exact(RUN);
    let tail = runs.remainder();
    for (r, run) in runs.enumerate() {
        let mut hit = [0u8; RUN];
        for (h, &v) in hit.iter_mut().zip(run) {
            *h = above(v) as u8;
        }
        let mut mask = 0u64;
        for (g, bytes) in hit.chunks_exact(8).enumerate() {
            let mut eight = [0u8; 8];
            eight.copy_from_slice(bytes);
            // Byte j (0 or 1) lands on bit 56 + j of the product; no two partial products share a
            // bit, so nothing carries.
            let bits = u64::from_le_bytes(eight).wrapping_mul(0x0102_0408_1020_4080) >> 56;
            mask |= bits << (8 * g);
        }
        if out.len() < len + RUN {
            out.resize(2 * out.len(), 0);
        }
        let base = (r * RUN) as u32;
        let count = mask.count_ones() as usize;
        let dst = &mut out[len..len + RUN];
        for d in &mut dst[..U] {
            *d = base + mask.trailing_zeros();
            mask &= mask.wrapping_sub(1);
        }
        if count > U {
            for d in &mut dst[U..count] {
                *d = base + mask.trailing_zeros();
                mask &= mask.wrapping_sub(1);
            }
        }
        len += count;
    }
    out.truncate(len);
    let base = x.len() - tail.len();
    for (j, &v) in tail.iter().enumerate() {
        if above(v) {
            out.push((base + j) as u32);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn exact_keeps_the_largest_magnitudes_in_order() {
        let x = [0.1, -5.0, 3.0, 0.0, -3.0, 2.0];
        assert_eq!(exact(&x, 2), vec![1, 2], "ties broken by position");
        assert_eq!(exact(&x, 3), vec![1, 2, 4]);
        assert_eq!(exact(&x, 0), Vec::<u32>::new());
        assert_eq!(exact(&x, 9), vec![0, 1, 2, 3, 4, 5]);
        // All equal: the first k.
        assert_eq!(exact(&[1.0; 5], 2), vec![0, 1]);
    }

    #[test]
    fn approx_never_exceeds_k_and_finds_nearly_all_of_the_exact_set() {
        let x = data(1 << 20, 7);
        for density in [0.001, 0.01, 0.1] {
            let k = (density * x.len() as f64) as usize;
            let a = approx(&x, k, 3);
            let e = exact(&x, k);
            assert!(
                a.len() <= k && a.len() as f64 >= 0.9 * k as f64,
                "{} of {k}",
                a.len()
            );
            assert!(a.windows(2).all(|w| w[0] < w[1]));
            let exact_set: std::collections::HashSet<u32> = e.into_iter().collect();
            let hit = a.iter().filter(|i| exact_set.contains(i)).count();
            assert!(hit as f64 >= 0.9 * k as f64, "recall {hit} of {k}");
        }
    }

    #[test]
    fn approx_at_high_densities_keeps_nearly_the_exact_set_and_trims_within_the_band() {
        let x = data(1 << 18, 13);
        for density in [0.3, 0.5, 0.7, 0.95] {
            let k = (density * x.len() as f64) as usize;
            let (a, vals) = approx_with_values(&x, k, 21);
            assert!(
                a.len() <= k && a.len() as f64 >= 0.99 * k as f64,
                "{} of {k}",
                a.len()
            );
            assert!(a.windows(2).all(|w| w[0] < w[1]));
            let want: Vec<f32> = a.iter().map(|&i| x[i as usize]).collect();
            assert_eq!(vals, want);
            let exact_set: std::collections::HashSet<u32> = exact(&x, k).into_iter().collect();
            let hit = a.iter().filter(|i| exact_set.contains(i)).count();
            assert!(
                hit as f64 >= 0.99 * k as f64,
                "recall {hit} of {k} at {density}"
            );
        }
    }

    #[test]
    fn trimming_picks_the_k_largest_whether_or_not_the_high_threshold_holds() {
        let vals: Vec<f32> = vec![0.5, -3.0, 2.0, 2.0, -1.0, 4.0, 2.0, 0.1];
        let idx: Vec<u32> = (0..8).map(|i| 10 * i).collect();
        // k = 4: 4.0, -3.0 and two of the three 2.0s (the first two by position).
        let want = (vec![10, 20, 30, 50], vec![-3.0, 2.0, 2.0, 4.0]);
        for t_high in [magnitude(3.5), magnitude(2.5), magnitude(1.5), 0, u32::MAX] {
            assert_eq!(trim(idx.clone(), vals.clone(), 4, t_high), want, "{t_high}");
        }
    }

    /// The plain filter `at_or_above` must agree with.
    fn naive(x: &[f32], t_bits: i32) -> Vec<u32> {
        (0..x.len() as u32)
            .filter(|&i| magnitude(x[i as usize]) as i32 >= t_bits)
            .collect()
    }

    #[test]
    fn the_run_pass_agrees_with_a_plain_filter_at_every_unroll_and_density() {
        // 64 · 300 + 37 values: whole runs and a tail; NaN and infinities among them.
        let mut x = data(64 * 300 + 37, 11);
        x[5] = f32::NAN;
        x[64 * 7 + 63] = f32::INFINITY;
        x[64 * 300 + 36] = f32::NEG_INFINITY;
        for t in [0.0f32, 0.5, 0.9, 0.999, 2.0] {
            let t_bits = magnitude(t) as i32;
            let want = naive(&x, t_bits);
            // Every unroll, from a room that fits to one that must grow many times.
            for expect in [0, 1, want.len()] {
                assert_eq!(at_or_above_runs::<4>(&x, t_bits, expect), want, "U 4 t {t}");
                assert_eq!(at_or_above_runs::<8>(&x, t_bits, expect), want, "U 8 t {t}");
                assert_eq!(at_or_above_runs::<16>(&x, t_bits, expect), want, "U 16");
                assert_eq!(at_or_above_runs::<32>(&x, t_bits, expect), want, "U 32");
                assert_eq!(at_or_above(&x, t_bits, expect), want, "dispatch t {t}");
            }
        }
    }

    #[test]
    fn kept_values_are_the_values_at_the_kept_indices() {
        let x = data(100_003, 5);
        for how in [Selection::Exact, Selection::Approx] {
            for k in [0, 1, 1000, 60_000, 100_003] {
                let (idx, vals) = top_k_with_values(&x, k, how, 9);
                assert_eq!(idx, top_k(&x, k, how, 9), "{how:?} k {k}");
                let want: Vec<f32> = idx.iter().map(|&i| x[i as usize]).collect();
                assert_eq!(vals, want, "{how:?} k {k}");
            }
        }
    }

    #[test]
    fn the_stratified_sample_draws_once_from_every_stratum() {
        let x: Vec<f32> = (0..64 * 1024).map(|i| i as f32).collect();
        let s = stratified_sample(&x, 1024, 3);
        for (stratum, m) in s.iter().enumerate() {
            let i = f32::from_bits(*m) as usize;
            assert_eq!(i / 64, stratum);
        }
        // Not the same offset in every stratum, and another seed draws other values.
        let offsets: std::collections::HashSet<u32> =
            s.iter().map(|m| f32::from_bits(*m) as u32 % 64).collect();
        assert!(offsets.len() > 32, "{} distinct offsets", offsets.len());
        assert_ne!(s, stratified_sample(&x, 1024, 4));
    }
}
