//! The AdaTopK rule: how dense may each link's traffic stay?
//!
//! In a pipeline in steady state every stage does one forward and one backward pass per
//! micro-batch period, and every link direction carries one micro-batch of tensors per period.
//! A link is therefore not the bottleneck when sending its tensors takes no longer than the
//! slowest stage's compute per micro-batch (or a target the scheduler sets). The rule keeps a link
//! dense when it already fits, and otherwise picks the largest density whose message fits,
//! never below a floor. The message size model counts the header, the cheapest index encoding
//! and the values, exactly as `wire` writes them.

use crate::wire::ValueType;
use serde::{Deserialize, Serialize};

/// Bytes of a sparse message of `k` of `n` values: header, cheapest index encoding (estimated
/// for evenly spread indices), values.
pub fn sparse_bytes(n: usize, k: usize, values: ValueType) -> f64 {
    let k = k.min(n);
    let absolute = 4.0 * k as f64;
    let bitmap = n.div_ceil(8) as f64;
    let gap = if k == 0 { 1.0 } else { n as f64 / k as f64 };
    let varint = k as f64 * ((gap.log2() / 7.0).floor().clamp(0.0, 4.0) + 1.0);
    29.0 + absolute.min(bitmap).min(varint) + (k * values.size()) as f64
}

/// Bytes of the dense f32 message of `n` values.
pub fn dense_bytes(n: usize) -> f64 {
    12.0 + 4.0 * n as f64
}

/// The AdaTopK settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdaTopKPolicy {
    /// Never keep fewer than this share of the values.
    pub floor: f64,
    /// Precision of the values sent.
    pub values: ValueType,
    /// Fraction of the target a link may use (headroom for latency jitter and framing).
    pub headroom: f64,
}

impl Default for AdaTopKPolicy {
    fn default() -> Self {
        AdaTopKPolicy {
            // gpt2-tiny on the emulated cluster learns within 2% of dense at half the activations;
            // at 10-30% it falls far behind (docs/BENCHMARKS.md).
            floor: 0.5,
            values: ValueType::F16,
            headroom: 0.9,
        }
    }
}

impl AdaTopKPolicy {
    /// The density (share of values kept, 1 = dense f32) for `elements` values per micro-batch
    /// over a link of `bytes_per_s`, so that sending them takes at most `target_s`.
    pub fn density(&self, elements: usize, bytes_per_s: f64, target_s: f64) -> f64 {
        let usable = |v: f64| v.is_finite() && v > 0.0;
        if elements == 0 || !usable(bytes_per_s) || !usable(target_s) {
            return 1.0;
        }
        let budget = self.headroom * target_s * bytes_per_s;
        if dense_bytes(elements) <= budget {
            return 1.0;
        }
        let floor = self.floor.clamp(1.0 / elements as f64, 1.0);
        let fits = |d: f64| {
            sparse_bytes(elements, (d * elements as f64).ceil() as usize, self.values) <= budget
        };
        if !fits(floor) {
            return floor;
        }
        let (mut lo, mut hi) = (floor, 1.0);
        for _ in 0..40 {
            let mid = 0.5 * (lo + hi);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Bytes sent per micro-batch for `elements` values at `density`.
    pub fn bytes(&self, elements: usize, density: f64) -> f64 {
        if density >= 1.0 {
            dense_bytes(elements)
        } else {
            sparse_bytes(
                elements,
                (density * elements as f64).ceil() as usize,
                self.values,
            )
        }
    }
}

/// Keeps one density per link direction and changes it only when the rule's answer moves by
/// more than `hysteresis` (relative), so measurement noise does not flip codecs every step.
#[derive(Clone, Debug)]
pub struct DensityController {
    pub policy: AdaTopKPolicy,
    pub hysteresis: f64,
    current: std::collections::BTreeMap<(String, String), f64>,
}

/// A density change for one link direction.
#[derive(Clone, Debug, PartialEq)]
pub struct DensityChange {
    pub from: String,
    pub to: String,
    pub before: Option<f64>,
    pub after: f64,
}

impl DensityController {
    pub fn new(policy: AdaTopKPolicy) -> Self {
        DensityController {
            policy,
            hysteresis: 0.1,
            current: Default::default(),
        }
    }

    /// The density in force from `from` to `to` (1 when never set).
    pub fn get(&self, from: &str, to: &str) -> f64 {
        self.current
            .get(&(from.to_string(), to.to_string()))
            .copied()
            .unwrap_or(1.0)
    }

    /// Re-applies the rule to a link direction; returns the change when there is one.
    pub fn update(
        &mut self,
        from: &str,
        to: &str,
        elements: usize,
        bytes_per_s: f64,
        target_s: f64,
    ) -> Option<DensityChange> {
        let want = self.policy.density(elements, bytes_per_s, target_s);
        let key = (from.to_string(), to.to_string());
        let before = self.current.get(&key).copied();
        let moved = match before {
            None => true,
            Some(b) => (want - b).abs() > self.hysteresis * b,
        };
        if !moved {
            return None;
        }
        self.current.insert(key, want);
        Some(DensityChange {
            from: from.into(),
            to: to.into(),
            before,
            after: want,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::encode_sparse;

    #[test]
    fn the_size_model_matches_the_encoder() {
        let n = 100_000;
        let x = vec![1.0f32; n];
        for k in [10, 1000, 5000, 40_000] {
            let step = n / k;
            let idx: Vec<u32> = (0..k).map(|i| (i * step) as u32).collect();
            let real = encode_sparse(&x, &idx, ValueType::F32).len() as f64;
            let model = sparse_bytes(n, k, ValueType::F32);
            assert!(
                (model - real).abs() <= 0.05 * real,
                "k={k}: {model} vs {real}"
            );
        }
    }

    #[test]
    fn fast_links_stay_dense_slow_ones_get_just_enough_sparsity() {
        let p = AdaTopKPolicy {
            floor: 0.01,
            values: ValueType::F32,
            ..Default::default()
        };
        let n = 1 << 20; // 4 MB dense per micro-batch
                         // 10 Gbit/s, 10 ms of compute: 4 MB takes 3.4 ms: dense.
        assert_eq!(p.density(n, 1.25e9, 0.010), 1.0);
        // 10 Mbit/s, 50 ms: 56 KB of budget: about 1% at 5 bytes per value.
        let d = p.density(n, 1.25e6, 0.050);
        assert!(d > 0.005 && d < 0.02, "{d}");
        let sent = p.bytes(n, d);
        assert!(sent <= 0.9 * 0.050 * 1.25e6 + 1.0 && sent > 0.8 * 0.9 * 0.050 * 1.25e6);
        // A hopeless link gets the floor.
        assert_eq!(p.density(n, 1e3, 0.001), 0.01);
        // Slower link, sparser.
        assert!(p.density(n, 0.5e6, 0.050) < d);
    }

    #[test]
    fn the_controller_ignores_noise_and_reports_real_changes() {
        let mut c = DensityController::new(AdaTopKPolicy {
            floor: 0.001,
            ..Default::default()
        });
        let n = 1 << 20;
        let first = c.update("a", "b", n, 1.25e6, 0.05).expect("first setting");
        assert_eq!(first.before, None);
        assert!(c.update("a", "b", n, 1.27e6, 0.05).is_none(), "2% noise");
        let halved = c
            .update("a", "b", n, 0.6e6, 0.05)
            .expect("bandwidth halved");
        assert!(halved.after < 0.6 * first.after);
        assert_eq!(c.get("a", "b"), halved.after);
        assert_eq!(c.get("b", "a"), 1.0);
    }
}
