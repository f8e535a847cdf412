//! Choosing the next token from logits: greedy at temperature 0, else a draw from the softmax
//! at that temperature over the `top_k` most likely tokens, from a seeded generator (the same
//! seed gives the same text).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug)]
pub struct Sampler {
    /// 0: always the most likely token.
    pub temperature: f32,
    /// Draw among this many most likely tokens (0: all).
    pub top_k: usize,
    /// Draw only among the first this many tokens (a tokenizer smaller than the vocabulary).
    pub limit: Option<usize>,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(temperature: f32, top_k: usize, seed: u64) -> Sampler {
        Sampler {
            temperature: temperature.max(0.0),
            top_k,
            limit: None,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// Draws only among tokens `0..n`.
    pub fn limited_to(mut self, n: usize) -> Sampler {
        self.limit = Some(n);
        self
    }

    /// The next token.
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        let n = self.limit.map_or(logits.len(), |l| l.min(logits.len()));
        // A NaN logit counts as impossible.
        let value = |i: usize| match logits[i] {
            x if x.is_nan() => f32::NEG_INFINITY,
            x => x,
        };
        // The most likely token: the answer at temperature 0, and the scale of the weights.
        let best = (0..n)
            .max_by(|&a, &b| value(a).total_cmp(&value(b)))
            .unwrap_or(0);
        if self.temperature == 0.0 || n <= 1 {
            return best as u32;
        }
        let mut order: Vec<usize> = (0..n).collect();
        if self.top_k > 0 && self.top_k < n {
            // The k most likely, in no particular order (no sort of the whole vocabulary).
            order.select_nth_unstable_by(self.top_k - 1, |&a, &b| value(b).total_cmp(&value(a)));
            order.truncate(self.top_k);
        }
        let top = value(best);
        let weights: Vec<f64> = order
            .iter()
            .map(|&i| (((value(i) - top) / self.temperature) as f64).exp())
            .map(|w| if w.is_finite() { w } else { 0.0 })
            .collect();
        let total: f64 = weights.iter().sum();
        let mut draw = self.rng.random::<f64>() * total;
        for (&i, w) in order.iter().zip(&weights) {
            if draw < *w {
                return i as u32;
            }
            draw -= w;
        }
        best as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temperature_zero_and_top_one_are_greedy() {
        let logits = [0.1, 2.5, -1.0, 2.4];
        assert_eq!(Sampler::new(0.0, 0, 1).pick(&logits), 1);
        let mut s = Sampler::new(1.0, 1, 7);
        assert!((0..50).all(|_| s.pick(&logits) == 1));
    }

    #[test]
    fn draws_follow_the_softmax_and_the_seed_repeats_them() {
        let logits = [0.0, (3.0f32).ln(), f32::NEG_INFINITY];
        let mut s = Sampler::new(1.0, 0, 42);
        let draws: Vec<u32> = (0..20_000).map(|_| s.pick(&logits)).collect();
        let ones = draws.iter().filter(|&&t| t == 1).count() as f64 / draws.len() as f64;
        // P(1) = 3/4 exactly; 20,000 draws from a fixed seed land well within 0.02 of it.
        assert!((ones - 0.75).abs() < 0.02, "{ones}");
        assert!(!draws.contains(&2), "a token of probability 0 was drawn");
        let mut again = Sampler::new(1.0, 0, 42);
        assert!(draws.iter().all(|&t| again.pick(&logits) == t));
    }

    #[test]
    fn nan_is_never_chosen_and_a_limit_keeps_draws_below_it() {
        let logits = [0.5, f32::NAN, 0.2, 9.0];
        assert_eq!(Sampler::new(0.0, 0, 1).pick(&logits), 3);
        let mut s = Sampler::new(1.0, 0, 5).limited_to(3);
        assert!((0..500).all(|_| matches!(s.pick(&logits), 0 | 2)));
    }

    #[test]
    fn top_k_draws_only_among_the_k_most_likely() {
        let logits = [1.0, 0.9, 0.8, 5.0, 0.7];
        let mut s = Sampler::new(2.0, 2, 3);
        assert!((0..500).all(|_| matches!(s.pick(&logits), 3 | 0)));
    }
}
