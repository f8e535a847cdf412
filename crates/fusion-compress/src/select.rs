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
    /// Threshold from a sample of [`SAMPLE`] values, then one pass.
    #[default]
    Approx,
}

/// Most values sampled to estimate the threshold (an eighth of a smaller tensor).
pub const SAMPLE: usize = 16 * 1024;

/// Ascending indices of the `k` values of `x` with the largest magnitude.
pub fn top_k(x: &[f32], k: usize, how: Selection, seed: u64) -> Vec<u32> {
    match how {
        Selection::Exact => exact(x, k),
        Selection::Approx => approx(x, k, seed),
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
    let mut mags: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let (_, t, above) = mags.select_nth_unstable_by(n - k, f32::total_cmp);
    let t = *t;
    let greater = above.iter().filter(|&&m| m > t).count();
    let mut ties = k - greater;
    let mut out = Vec::with_capacity(k);
    for (i, v) in x.iter().enumerate() {
        let m = v.abs();
        if m > t {
            out.push(i as u32);
        } else if m == t && ties > 0 {
            ties -= 1;
            out.push(i as u32);
        }
    }
    out
}

/// Approximate top-k: at most `k` indices, usually within a few percent of `k`.
pub fn approx(x: &[f32], k: usize, seed: u64) -> Vec<u32> {
    let n = x.len();
    if k >= n || n <= 8 * 1024 {
        return exact(x, k);
    }
    if k == 0 {
        return Vec::new();
    }
    // A fast xorshift sampler: drawing the sample must not cost more than the pass itself.
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let samples = (n / 64).clamp(1024, SAMPLE);
    let mut sample: Vec<f32> = (0..samples)
        .map(|_| x[(((next() >> 32) * n as u64) >> 32) as usize].abs())
        .collect();
    // The sample's (1 − k/n) quantile, three standard deviations of the sample count below it,
    // so that the pass rarely finds fewer than k; the surplus is trimmed exactly.
    let c = k as f64 / n as f64 * samples as f64;
    let want = (c + 3.0 * c.sqrt() + 1.0).ceil() as usize;
    let pos = samples - want.clamp(1, samples);
    let (_, t, _) = sample.select_nth_unstable_by(pos, f32::total_cmp);
    let t = *t;
    let mut out = Vec::with_capacity(k + k / 4);
    // Magnitudes compare as integers: for non-negative floats the bit patterns order like the
    // values, and an integer compare-and-count vectorises on every x86-64 (a float max does
    // not, because of its NaN rules). Masked magnitudes fit in 31 bits, so a signed compare (one
    // SSE2 instruction) is exact. NaN magnitudes sort above infinity and are kept, as in `exact`.
    let t_bits = (t.to_bits() & 0x7fff_ffff) as i32;
    let above = |v: f32| (v.to_bits() & 0x7fff_ffff) as i32 >= t_bits;
    // Most blocks hold no candidate: test a whole block at once, and compact the few that do
    // without branching on each value.
    const BLOCK: usize = 8;
    let blocks = x.chunks_exact(BLOCK);
    let tail = blocks.remainder();
    let mut found = [0u32; BLOCK];
    for (c, block) in blocks.enumerate() {
        let hits: u32 = block.iter().map(|&v| above(v) as u32).sum();
        if hits > 0 {
            let mut m = 0;
            for (j, &v) in block.iter().enumerate() {
                found[m.min(BLOCK - 1)] = (c * BLOCK + j) as u32;
                m += above(v) as usize;
            }
            out.extend_from_slice(&found[..m]);
        }
    }
    let base = n - tail.len();
    for (j, &v) in tail.iter().enumerate() {
        if above(v) {
            out.push((base + j) as u32);
        }
    }
    if out.len() > k {
        let vals: Vec<f32> = out.iter().map(|&i| x[i as usize]).collect();
        out = exact(&vals, k)
            .into_iter()
            .map(|j| out[j as usize])
            .collect();
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
}
