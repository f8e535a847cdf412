use crate::config::ScheduleConfig;

/// Learning rate at `step` (0-based) of a run of `total` steps.
pub fn learning_rate(s: &ScheduleConfig, step: u64, total: u64) -> f32 {
    if step < s.warmup_steps {
        return s.lr * (step + 1) as f32 / s.warmup_steps as f32;
    }
    let span = total.saturating_sub(s.warmup_steps).max(1) as f64;
    let progress = ((step - s.warmup_steps) as f64 / span).min(1.0);
    let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    (s.min_lr as f64 + (s.lr - s.min_lr) as f64 * cos) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = ScheduleConfig {
            lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 10,
        };
        assert!((learning_rate(&s, 0, 110) - 0.1).abs() < 1e-6);
        assert!((learning_rate(&s, 9, 110) - 1.0).abs() < 1e-6);
        assert!((learning_rate(&s, 10, 110) - 1.0).abs() < 1e-6);
        assert!((learning_rate(&s, 60, 110) - 0.55).abs() < 1e-4);
        assert!((learning_rate(&s, 110, 110) - 0.1).abs() < 1e-6);
    }
}
