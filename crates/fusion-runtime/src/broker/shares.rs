//! Islands' batch shares on a cluster: how many of a step's micro-batches each island runs.
//!
//! A placement starts from the job's shares (`[train.outer] shares`: equal for `auto`). With
//! `auto`, every training step measures each island's rate (its micro-batches over its slowest
//! node's compute and waiting), and at a synchronisation, after
//! [`fusion_train::REBALANCE_AFTER_STEPS`] measured steps, the shares move in proportion to the
//! rates' medians when that shortens the islands' inner step enough
//! ([`fusion_train::rebalance_shares`]); not at the last one, whose shares would never run. Shares change only at a synchronisation, so every round
//! runs one set of shares, and the outer step weighs each island's pseudo-gradient by its share
//! of the round's tokens (`RunStep.micro_batches` over `total_micro_batches`).

use super::*;
use fusion_train::{rebalance_shares, Shares, MAX_SHARE_FACTOR, REBALANCE_AFTER_STEPS};

/// Rates kept per island: the most recent steps' (the median of a longer window would follow a
/// changed machine too slowly).
const RATE_WINDOW: usize = 8;

impl Coordinator<'_> {
    /// Micro-batches each of `replicas` replicas (islands) runs per step in this placement.
    pub(super) fn shares(&self, replicas: usize) -> Vec<usize> {
        if self.placed.shares.len() == replicas {
            self.placed.shares.clone()
        } else {
            vec![self.job.train.micro_batches; replicas]
        }
    }

    /// Sets the placement's starting shares: the job's fixed ones, else equal.
    pub(super) fn start_shares(&mut self) -> Result<()> {
        let r = self.job.replicas.max(1);
        let m = self.job.train.micro_batches;
        self.placed.shares = match (&self.job.train.outer, self.islands()) {
            (Some(o), true) => {
                let shares = o.shares.initial(r, m).map_err(RuntimeError::from)?;
                if self.job.schedule == Schedule::GPipe && shares.iter().any(|&s| s > m) {
                    tracing::warn!(
                        "island shares {} give an island more than the job's {m} micro-batches \
                         under GPipe, where all of them are in flight at once: the plan sized \
                         memory for {m}",
                        fusion_train::join_shares(&shares)
                    );
                }
                shares
            }
            _ => vec![m; r],
        };
        Ok(())
    }

    /// Notes each island's rate in a training step (`results` in `Layout::all` order): its
    /// micro-batches over the longest compute and waiting of its nodes.
    pub(super) fn note_island_rates(&mut self, results: &[fusion_proto::StepResult]) {
        let shares = self.placed.shares.clone();
        if !self.islands() || shares.is_empty() || !results.len().is_multiple_of(shares.len()) {
            return;
        }
        let stages = results.len() / shares.len();
        let rates: Vec<f64> = results
            .chunks(stages.max(1))
            .zip(&shares)
            .map(|(nodes, &m)| {
                let busy = nodes
                    .iter()
                    .map(|r| r.compute_seconds + r.wait_seconds)
                    .fold(0.0, f64::max);
                m as f64 / busy
            })
            .collect();
        self.placed.island_rates.push(rates);
        let n = self.placed.island_rates.len();
        if n > RATE_WINDOW {
            self.placed.island_rates.drain(..n - RATE_WINDOW);
        }
    }

    /// At a synchronisation (after step `step`): with `auto` shares and enough steps measured,
    /// moves the shares in proportion to the islands' median rates when that pays, and says so.
    pub(super) fn rebalance_if_due(&mut self, step: u64) {
        let auto = matches!(
            self.job.train.outer.as_ref().map(|o| &o.shares),
            Some(Shares::Auto)
        );
        if !auto || !self.islands() || self.placed.island_rates.len() < REBALANCE_AFTER_STEPS {
            return;
        }
        let current = self.placed.shares.clone();
        let rates: Vec<f64> = (0..current.len())
            .map(|i| median(self.placed.island_rates.iter().map(|r| r[i])))
            .collect();
        // Under 1F1B a stage holds at most as many micro-batches in flight as stages after it,
        // whatever its share; under GPipe every micro-batch of a step is in flight, and the plan
        // sized memory for the job's micro-batches: no island goes above them there (automatic
        // shares stay equal).
        let m = self.job.train.micro_batches;
        let cap = match self.job.schedule {
            Schedule::GPipe => m,
            _ => MAX_SHARE_FACTOR * m,
        };
        let Some(next) = rebalance_shares(&current, &rates, cap) else {
            return;
        };
        let line = format!(
            "after step {}: island shares {} -> {} micro-batches (measured micro-batches per \
             second {})",
            step + 1,
            fusion_train::join_shares(&current),
            fusion_train::join_shares(&next),
            rates
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        tracing::info!("{line}");
        self.outer.rebalances.push(line);
        self.placed.shares = next;
        self.placed.island_rates.clear();
    }
}

/// The median of finite values (NaN when there are none).
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_skips_what_is_not_a_number() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), 2.0);
        assert_eq!(median([4.0, 1.0, f64::NAN, 2.0, 3.0].into_iter()), 2.5);
        assert!(median([f64::INFINITY].into_iter()).is_nan());
    }
}
