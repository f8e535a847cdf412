//! Stragglers: a node persistently slower than its plan predicts, relative to the others, is
//! reported; the plan is re-made with its figures derated (less work for it) or without it,
//! whichever the planner predicts is faster, when that gains enough. Pure functions of the step
//! timings and the planner's predictions.

use super::claims::relative_slowdowns;
use super::{Coordinator, Layout};
use crate::error::Result;

/// A node is a straggler when it computes this many times slower than planned, relative to the
/// others (the lower median of every node's measured-to-predicted ratio), at every step of the
/// window.
pub const STRAGGLER_FACTOR: f64 = 3.0;

/// Consecutive steps of one placement a node must be that slow.
pub const STRAGGLER_STEPS: usize = 5;

/// ... and its compute must be at least this share of the step's wall time: a light stage (an
/// embedding, the loss) whose few milliseconds the estimator predicts poorly, or that carries
/// work the plan does not model (compressing what it sends), is not what holds the step up.
pub const STRAGGLER_SHARE: f64 = 0.25;

/// A re-plan is made only when it predicts a step at most this share of the current one's.
pub const REPLAN_GAIN: f64 = 0.9;

/// One step of a straggler window: each node's compute seconds scaled to the job's
/// micro-batches (islands' shares may differ; for the ratios against the plan) and as spent
/// (for its share of the step), in the order of the predictions, and the step's wall seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowStep {
    pub scaled_s: Vec<f64>,
    pub spent_s: Vec<f64>,
    pub wall_s: f64,
}

/// The straggler among the nodes, if any: the node whose relative slowdown exceeded
/// [`STRAGGLER_FACTOR`], with compute of at least [`STRAGGLER_SHARE`] of the step, at every one
/// of the last [`STRAGGLER_STEPS`] steps of `window`, with the smallest slowdown it showed (the
/// conservative figure to derate it by). Of several, the slowest.
pub fn straggler(predicted_s: &[f64], window: &[WindowStep]) -> Option<(usize, f64)> {
    if window.len() < STRAGGLER_STEPS {
        return None;
    }
    let recent = &window[window.len() - STRAGGLER_STEPS..];
    let mut least = vec![f64::INFINITY; predicted_s.len()];
    for step in recent {
        let slow = relative_slowdowns(predicted_s, &step.scaled_s, 2);
        for ((l, s), &m) in least.iter_mut().zip(slow).zip(&step.spent_s) {
            let holds_up = m >= STRAGGLER_SHARE * step.wall_s;
            *l = l.min(s.filter(|_| holds_up).unwrap_or(0.0));
        }
    }
    least
        .into_iter()
        .enumerate()
        .filter(|&(_, f)| f > STRAGGLER_FACTOR)
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

/// What to do about a straggler.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Remedy {
    /// Re-plan on the same nodes with the straggler's figures derated.
    Rebalance,
    /// Re-plan without the straggler (it stands by).
    Without,
}

/// The remedy whose predicted step time is lowest, if it is below [`REPLAN_GAIN`] times
/// `current_s` (the current placement's step as the planner predicts it with the straggler's
/// figures derated). `without_s` is None when the job cannot run without the node.
pub fn remedy(current_s: f64, rebalanced_s: f64, without_s: Option<f64>) -> Option<(Remedy, f64)> {
    let mut best: Option<(Remedy, f64)> = None;
    for (r, s) in [
        (Remedy::Rebalance, Some(rebalanced_s)),
        (Remedy::Without, without_s),
    ] {
        let Some(s) = s.filter(|s| s.is_finite() && *s > 0.0) else {
            continue;
        };
        if best.is_none_or(|(_, b)| s < b) {
            best = Some((r, s));
        }
    }
    best.filter(|&(_, s)| current_s.is_finite() && s < REPLAN_GAIN * current_s)
}

impl Coordinator<'_> {
    /// After a step: whether a straggler calls for a re-plan (the reason, for the reshape). A
    /// straggler is reported once per placement and its figures derated by what it showed; when
    /// the job is predicted to run faster without it, it is benched (stands by).
    pub(super) fn straggler_due(&mut self, layout: &Layout, first_step: u64) -> Option<String> {
        if self.placed.handled {
            return self.placed.replan.clone();
        }
        // The last steps of this placement only (this runs after every step), per step of the
        // job's micro-batches (islands' shares may differ), not per micro-batch: the ratios are
        // relative, the scale cancels.
        let m = self.job.train.micro_batches.max(1);
        let window: Vec<WindowStep> = self
            .history
            .timings
            .iter()
            .rev()
            .take_while(|t| t.step > first_step)
            .take(STRAGGLER_STEPS)
            .map(|t| WindowStep {
                scaled_s: t.compute_at(m),
                spent_s: t.compute_s.clone(),
                wall_s: t.wall_s,
            })
            .collect();
        let (pos, factor) = straggler(&self.placed.predicted_s, &window)?;
        self.placed.handled = true;
        let member = *layout.all().get(pos)?;
        let derate = self.placed.derates.get(pos).copied().unwrap_or(1.0) * factor;
        self.members[member].derate = self.members[member].derate.max(derate);
        let id = self.members[member].id.clone();
        let found = format!(
            "{id} computed {factor:.1}x slower than planned, relative to the others, for \
             {STRAGGLER_STEPS} steps"
        );
        let (line, why) = match self.remedy_for(member) {
            Err(e) => (
                format!("{found}; re-planning around it failed ({e}): it keeps its stage"),
                None,
            ),
            Ok(None) if self.placed.scheduled.is_none() => (
                format!(
                    "{found}; the placement is fixed (cuts or the even split): it keeps its stage"
                ),
                None,
            ),
            Ok(None) => (
                format!("{found}; no re-plan is predicted 10% faster: it keeps its stage"),
                None,
            ),
            Ok(Some((Remedy::Rebalance, now, then))) => {
                let why = format!(
                    "{found}; re-planning with its figures derated (step {now:.3} s -> {then:.3} s \
                     predicted)"
                );
                (why.clone(), Some(why))
            }
            Ok(Some((Remedy::Without, now, then))) => {
                self.members[member].benched = Some(found.clone());
                let why = format!(
                    "{found}; re-planning without it, it stands by (step {now:.3} s -> \
                     {then:.3} s predicted)"
                );
                (why.clone(), Some(why))
            }
        };
        tracing::warn!("{line}");
        self.stragglers.push(line);
        self.placed.replan = why.clone();
        why
    }

    /// The better re-plan around `member` (already derated), with the current placement's and
    /// the re-plan's predicted step seconds; None when the placement was not the scheduler's or
    /// no re-plan gains enough.
    fn remedy_for(&self, member: usize) -> Result<Option<(Remedy, f64, f64)>> {
        let Some(current) = &self.placed.scheduled else {
            return Ok(None);
        };
        let active = &self.placed.active;
        let replicas = self.job.replicas.max(1);
        let workload = self.workload()?;
        let (network, relays) = (self.network(active), self.relays_among(active));
        let current_s = self
            .judge_charged(&workload, &network, &relays, current)?
            .0
            .step_s;
        let stages = active.len() / replicas;
        let rebalanced_s = self
            .plan_charged(&workload, active, stages)?
            .0
            .evaluation
            .step_s;
        let rest: Vec<usize> = active.iter().copied().filter(|&m| m != member).collect();
        let without_s =
            if !rest.is_empty() && self.usable_nodes(rest.len(), true) == Some(rest.len()) {
                let stages = rest.len() / replicas;
                Some(
                    self.plan_charged(&workload, &rest, stages)?
                        .0
                        .evaluation
                        .step_s,
                )
            } else {
                None
            };
        Ok(remedy(current_s, rebalanced_s, without_s).map(|(r, s)| (r, current_s, s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` steps of `measured` compute seconds, each step as long as its slowest node.
    fn steps(n: usize, measured: &[f64]) -> Vec<WindowStep> {
        let wall = measured.iter().copied().fold(0.0, f64::max);
        vec![one(measured, wall); n]
    }

    /// A step whose nodes ran the job's micro-batches: scaled and spent compute are the same.
    fn one(measured: &[f64], wall: f64) -> WindowStep {
        WindowStep {
            scaled_s: measured.to_vec(),
            spent_s: measured.to_vec(),
            wall_s: wall,
        }
    }

    #[test]
    fn a_node_persistently_slower_than_planned_is_the_straggler() {
        // node1 is planned at half the others' work and takes twice as long: its ratio 8 against
        // the others' lower median of 2.1.
        let predicted = [1.0, 0.5, 1.0];
        let found = straggler(&predicted, &steps(5, &[2.0, 4.0, 2.1]));
        let (node, factor) = found.expect("straggler");
        assert_eq!(node, 1);
        assert!((factor - 8.0 / 2.1).abs() < 1e-9, "{factor}");
        // Two nodes suffice: the slower one's ratio against the faster one's.
        assert_eq!(
            straggler(&[1.0, 1.0], &steps(5, &[1.0, 3.5])).map(|s| s.0),
            Some(1)
        );
    }

    #[test]
    fn a_short_window_a_single_slow_step_or_a_uniform_slowdown_is_not_a_straggler() {
        let predicted = [1.0, 1.0, 1.0];
        assert_eq!(straggler(&predicted, &steps(4, &[1.0, 9.0, 1.0])), None);
        let mut window = steps(5, &[1.0, 9.0, 1.0]);
        window[2] = one(&[1.0, 1.2, 1.0], 1.2);
        assert_eq!(straggler(&predicted, &window), None);
        // Slow against its prediction but a small part of the step (a light stage whose
        // milliseconds are predicted poorly): not what holds the step up.
        let light = [1.0, 0.01, 1.0];
        assert_eq!(straggler(&light, &steps(5, &[1.0, 0.2, 1.0])), None);
        // Everyone three times slower than planned (a busy host): nobody stands out.
        assert_eq!(straggler(&predicted, &steps(5, &[3.0, 3.1, 3.2])), None);
        // Only the last STRAGGLER_STEPS count: an early slow patch is forgotten.
        let mut window = steps(5, &[1.0, 1.0, 1.0]);
        window.insert(0, one(&[1.0, 9.0, 1.0], 9.0));
        assert_eq!(straggler(&predicted, &window), None);
        // Missing figures make no straggler.
        assert_eq!(
            straggler(&predicted, &steps(5, &[0.0, 9.0, f64::NAN])),
            None
        );
    }

    #[test]
    fn a_straggler_on_an_island_of_a_larger_share_is_found() {
        // node1's island runs 4x the job's micro-batches: scaled to the job's it computes 6.4x
        // slower than the others relative to the plan, and what it spent is most of the step
        // (its scaled figure alone would be under a quarter of it).
        let predicted = [1.0, 1.0, 1.0];
        let large = WindowStep {
            scaled_s: vec![0.5, 3.2, 0.5],
            spent_s: vec![0.5, 12.8, 0.5],
            wall_s: 14.0,
        };
        let found = straggler(&predicted, &vec![large; 5]).expect("straggler");
        assert_eq!(found.0, 1);
        assert!((found.1 - 6.4).abs() < 1e-9, "{found:?}");
    }

    #[test]
    fn the_remedy_is_the_faster_re_plan_when_it_gains_enough() {
        assert_eq!(remedy(10.0, 6.0, Some(7.0)), Some((Remedy::Rebalance, 6.0)));
        assert_eq!(remedy(10.0, 8.0, Some(5.0)), Some((Remedy::Without, 5.0)));
        assert_eq!(remedy(10.0, 8.0, None), Some((Remedy::Rebalance, 8.0)));
        // Less than 10% faster: not worth a re-plan.
        assert_eq!(remedy(10.0, 9.5, Some(9.2)), None);
        assert_eq!(remedy(10.0, f64::NAN, Some(f64::INFINITY)), None);
        assert_eq!(remedy(f64::NAN, 1.0, None), None);
    }
}
