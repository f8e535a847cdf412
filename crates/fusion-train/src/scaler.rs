//! Dynamic loss scaling for f16 training. Gradients below f16's smallest normal value (6e-5)
//! lose precision and below 6e-8 vanish, so backward starts from the loss times a large scale,
//! and the host divides the f32 gradient sum by it. A step whose gradients overflowed (an
//! infinite or NaN value anywhere) is skipped and the scale halved; after a run of good steps it
//! doubles again, so it sits just under the overflow point. bf16 has f32's exponent range and
//! needs none of this.

use serde::{Deserialize, Serialize};

/// The scale a run starts from and the most it grows to: 2^15, the largest power of two f16
/// holds (backward's seed, the scale itself, is an f16 value; PyTorch's `GradScaler` starts at
/// 2^16 on an f32 loss).
pub const INITIAL_SCALE: f32 = 32768.0;
/// Good steps in a row before the scale doubles.
pub const GROWTH_INTERVAL: u32 = 2000;
/// The scale never falls below 1 (gradients then simply flush as f16 would).
const MIN_SCALE: f32 = 1.0;
const MAX_SCALE: f32 = INITIAL_SCALE;

/// The scaler's state, saved in checkpoints so that a resumed run scales as it would have.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f32,
    /// Good steps since the scale last changed.
    pub good_steps: u32,
    pub growth_interval: u32,
    /// Steps skipped for overflow over the run so far.
    pub skipped: u64,
}

/// What to do with a step's gradients.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    /// Finite: divide by the scale the step used and apply.
    Apply { scale: f32 },
    /// Overflowed: leave the weights and optimizer state as they are.
    Skip,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler {
            scale: INITIAL_SCALE,
            good_steps: 0,
            growth_interval: GROWTH_INTERVAL,
            skipped: 0,
        }
    }
}

impl LossScaler {
    /// Judges a step taken at the current scale by whether all its gradients were finite, and
    /// moves the scale for the next one.
    pub fn judge(&mut self, finite: bool) -> Verdict {
        let used = self.scale;
        if !finite {
            self.scale = (self.scale / 2.0).max(MIN_SCALE);
            self.good_steps = 0;
            self.skipped += 1;
            return Verdict::Skip;
        }
        self.good_steps += 1;
        if self.good_steps >= self.growth_interval {
            self.scale = (self.scale * 2.0).min(MAX_SCALE);
            self.good_steps = 0;
        }
        Verdict::Apply { scale: used }
    }
}

/// Whether every value of every gradient is finite.
pub fn all_finite(grads: &[Option<Vec<f32>>]) -> bool {
    grads.iter().flatten().flatten().all(|v| v.is_finite())
}

/// Divides every gradient by `scale`.
pub fn unscale(grads: &mut [Option<Vec<f32>>], scale: f32) {
    let inv = 1.0 / scale;
    grads.iter_mut().flatten().flatten().for_each(|v| *v *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_skips_and_halves() {
        let mut s = LossScaler::default();
        assert_eq!(s.judge(false), Verdict::Skip);
        assert_eq!(s.scale, INITIAL_SCALE / 2.0);
        assert_eq!(s.skipped, 1);
        assert_eq!(
            s.judge(true),
            Verdict::Apply {
                scale: INITIAL_SCALE / 2.0
            }
        );
    }

    #[test]
    fn a_run_of_good_steps_doubles_the_scale_after_the_step_that_used_it() {
        let mut s = LossScaler {
            growth_interval: 3,
            ..LossScaler::default()
        };
        s.judge(false);
        let half = INITIAL_SCALE / 2.0;
        for _ in 0..2 {
            assert_eq!(s.judge(true), Verdict::Apply { scale: half });
        }
        // The third good step still used the old scale; the next one gets the doubled one.
        assert_eq!(s.judge(true), Verdict::Apply { scale: half });
        assert_eq!(s.scale, INITIAL_SCALE);
        assert_eq!(s.good_steps, 0);
    }

    #[test]
    fn the_scale_stays_within_its_bounds() {
        let mut s = LossScaler::default();
        (0..40).for_each(|_| {
            s.judge(false);
        });
        assert_eq!(s.scale, MIN_SCALE);
        let mut s = LossScaler {
            growth_interval: 1,
            ..LossScaler::default()
        };
        (0..3).for_each(|_| {
            s.judge(false);
        });
        (0..40).for_each(|_| {
            s.judge(true);
        });
        assert_eq!(s.scale, MAX_SCALE);
    }

    #[test]
    fn unscaling_divides_and_nan_anywhere_is_not_finite() {
        let mut g = vec![Some(vec![4.0, -8.0]), None, Some(vec![2.0])];
        assert!(all_finite(&g));
        unscale(&mut g, 4.0);
        assert_eq!(g[0], Some(vec![1.0, -2.0]));
        assert_eq!(g[2], Some(vec![0.5]));
        g[2] = Some(vec![f32::NAN]);
        assert!(!all_finite(&g));
        g[2] = Some(vec![f32::INFINITY]);
        assert!(!all_finite(&g));
    }
}
