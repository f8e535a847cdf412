//! Islands on a cluster (a job with an outer optimizer and several replicas): each replica is an
//! island on consecutive nodes, a site where the testbed has sites, that applies its own
//! gradients (clipped by its own norm); after every H steps' updates the broker has the nodes
//! synchronise (OUTER_SYNC). Evaluations, snapshots and reshapes happen only right after a
//! synchronisation, where every island holds the same parameters.

use super::*;
use fusion_plan::{cluster_by_bandwidth, device_sequence, order_clusters, sub_network};
use fusion_train::{fragment_due, fragment_of};
use std::collections::BTreeSet;

/// Puts `step` in `set` or takes it out.
fn set_member(set: &mut BTreeSet<u64>, step: u64, member: bool) {
    if member {
        set.insert(step);
    } else {
        set.remove(&step);
    }
}

impl Coordinator<'_> {
    /// Whether this job's replicas are islands.
    pub(super) fn islands(&self) -> bool {
        self.job.train.outer.is_some() && self.job.replicas > 1
    }

    /// Whether the islands synchronise after the update of step `step` (0-based): every H
    /// steps (streaming: one fragment every H / fragments steps) and after the last.
    pub(super) fn sync_after(&self, step: u64) -> bool {
        match &self.job.train.outer {
            Some(o) if self.islands() => {
                fragment_due(step + 1, o).is_some() || step + 1 == self.job.train.steps
            }
            _ => false,
        }
    }

    /// Whether the state after `done` steps is one every island holds (always without islands):
    /// after a synchronisation of every fragment that did not overlap the next inner steps.
    pub(super) fn synchronised(&self, done: u64) -> bool {
        done == 0
            || !self.islands()
            || (self.sync_after(done - 1)
                && !self.overlapped.contains(&(done - 1))
                && !self.partial.contains(&(done - 1)))
    }

    /// Whether the state right after step `step`'s update must be one every island holds, so
    /// its synchronisation neither overlaps nor takes one fragment: the last step, an
    /// evaluation due (`eval_due`), a snapshot or a checkpoint, or islands to re-form.
    fn must_synchronise_all(&self, step: u64, eval_due: bool) -> bool {
        step + 1 >= self.job.train.steps
            || eval_due
            || self.islands_out.is_some()
            || self.snapshot_due(step + 1, self.history.mean_step_s())
    }

    /// Decides how the islands synchronise after step `step`'s update, before it runs: whether
    /// the exchange overlaps the next inner steps (the job asks for it) and whether it takes
    /// only the scheduled fragment (a streaming job); neither where the state after it must be
    /// one every island holds.
    pub(super) fn plan_sync(&mut self, step: u64, eval_due: bool) {
        let outer = self.job.train.outer.clone().unwrap_or_default();
        let staggered = self.sync_after(step) && !self.must_synchronise_all(step, eval_due);
        set_member(&mut self.overlapped, step, staggered && outer.overlap);
        set_member(&mut self.partial, step, staggered && outer.fragments > 1);
    }

    /// The fragment the synchronisation after step `step` takes (`RunStep.fragment`): the
    /// scheduled one when it takes one, None for a synchronisation of the whole model.
    pub(super) fn sync_fragment(&self, step: u64) -> Option<u32> {
        let outer = self.job.train.outer.as_ref()?;
        match self.partial.contains(&step) {
            true => fragment_due(step + 1, outer),
            false => None,
        }
    }

    /// The fragment of every parameter and buffer of the model (`fusion_train::fragment_of`
    /// over its tensors in order); empty when the job does not stream.
    fn model_fragments(&self) -> Vec<u32> {
        match &self.job.train.outer {
            Some(o) if self.islands() && o.fragments > 1 => {
                let sizes: Vec<usize> = self.graph.params.iter().map(|p| p.numel()).collect();
                fragment_of(&sizes, o.fragments)
            }
            _ => Vec::new(),
        }
    }

    /// `Assignment.fragments` of a stage holding the parameters `params` (global ids).
    pub(super) fn stage_fragments(&self, params: &[fusion_graph::ParamId]) -> Vec<u32> {
        let all = self.model_fragments();
        match all.is_empty() {
            true => Vec::new(),
            false => params
                .iter()
                .filter_map(|p| all.get(p.0).copied())
                .collect(),
        }
    }

    /// Counts an outer synchronisation and what dense f32 would have sent (each of R nodes of
    /// a stage sends 2 (R - 1) / R of the stage's values); the bytes the rings sent are counted
    /// as the nodes report them (`count_links`).
    pub(super) fn note_sync(
        &mut self,
        step: u64,
        results: &[fusion_proto::StepResult],
        islands: usize,
    ) {
        self.check_islands_agree(step, results, islands);
        let r = islands as u64;
        let fragment = self.sync_fragment(step);
        let values: u64 = self
            .graph
            .params
            .iter()
            .zip(
                self.model_fragments()
                    .into_iter()
                    .map(Some)
                    .chain(std::iter::repeat(None)),
            )
            .filter(|(_, f)| fragment.is_none() || *f == fragment)
            .map(|(p, _)| p.numel() as u64)
            .sum();
        self.outer.syncs += 1;
        self.outer.overlapped += u64::from(self.overlapped.contains(&step));
        self.outer.partial += u64::from(self.partial.contains(&step));
        self.outer.dense_bytes += 2 * (r - 1) * 4 * values;
    }

    /// After a synchronisation every island holds the same bits: each node reports the sum of
    /// squares of its stage's parameters, and a stage whose islands differ is reported in the
    /// islands' part of the report (a node that did not apply the synchronisation as the others
    /// did; not a failure, which would count against the recoveries).
    fn check_islands_agree(
        &mut self,
        step: u64,
        results: &[fusion_proto::StepResult],
        islands: usize,
    ) {
        let stages = results.len() / islands.max(1);
        for s in 0..stages {
            let sums: Vec<f64> = results
                .iter()
                .skip(s)
                .step_by(stages.max(1))
                .map(|r| r.grad_square_sum)
                .collect();
            if sums.iter().any(|x| x.to_bits() != sums[0].to_bits()) {
                let line = format!(
                    "islands disagree after the synchronisation of step {}: stage {s}'s parameters \
                     have sums of squares {sums:?}",
                    step + 1
                );
                tracing::warn!("{line}");
                self.outer.disagreements.push(line);
            }
        }
    }

    /// What the islands are, before the first island's plan explanation.
    fn islands_explanation(&self, islands: &[Vec<usize>]) -> Vec<String> {
        let outer = self.job.train.outer.clone().unwrap_or_default();
        let mut lines = vec![format!(
            "islands: {} pipelines, one per run of consecutive bandwidth clusters (sites); each \
             applies its own gradients and they synchronise every {} steps ({} pseudo-gradients, \
             outer lr {}, momentum {}); the plan below is the first island's",
            islands.len(),
            outer.every,
            outer.codec,
            outer.lr,
            outer.momentum
        )];
        for (i, nodes) in islands.iter().enumerate() {
            lines.push(format!("island {i}: {}", self.ids(nodes).join(", ")));
        }
        lines
    }

    /// The links islands are grouped by: the testbed's where it names them (a site is a site,
    /// whatever one probe on a loaded machine measured), else the probed ones.
    fn site_network(&self, active: &[usize]) -> Network {
        let mut net = self.network(active);
        for (i, &a) in active.iter().enumerate() {
            for (j, &b) in active.iter().enumerate() {
                if let Some((mbps, ms)) = self.link_between(a, b).filter(|_| i != j) {
                    net.bandwidth[i][j] = mbps * 1e6 / 8.0;
                    net.latency[i][j] = ms / 1e3;
                }
            }
        }
        net
    }

    /// Island placement in slot order `s * R + r`: island `r` runs on the `r`-th run of `stages`
    /// members, in name order for fixed cuts and the even split, else in the order of OP-Fence's
    /// bandwidth clusters (sites stay together), with the fences OP-Fence places on the first
    /// island.
    pub(super) fn island_placement(
        &mut self,
        active: &[usize],
        stages: usize,
    ) -> Result<(Vec<usize>, Vec<usize>)> {
        let r_count = self.job.replicas;
        if stages == 0 || active.len() < stages * r_count {
            return Err(RuntimeError::Config(format!(
                "{} nodes cannot form {r_count} islands of {stages} stages",
                active.len()
            )));
        }
        let slots = |runs: &[Vec<usize>]| -> Vec<usize> {
            (0..stages * r_count)
                .map(|slot| runs[slot % r_count][slot / r_count])
                .collect()
        };
        let by_name: Vec<Vec<usize>> = active.chunks(stages).map(<[usize]>::to_vec).collect();
        if let Some(c) = &self.job.cuts {
            return Ok((assignment_from_cuts(&self.graph, c)?, slots(&by_name)));
        }
        if self.job.scheduler == Scheduler::Even {
            let a = self
                .graph
                .even_assignment(stages)
                .map_err(RuntimeError::from)?;
            return Ok((a, slots(&by_name)));
        }
        let network = self.network(active);
        let sites = self.site_network(active);
        let mut clustering = cluster_by_bandwidth(&sites);
        order_clusters(&sites, &mut clustering);
        let sequence = device_sequence(&network, &clustering);
        let mut runs: Vec<Vec<usize>> = sequence.chunks(stages).map(<[usize]>::to_vec).collect();
        let first = sub_network(&network, &runs[0]);
        let workload = self.workload()?;
        let problem = self.problem(&workload, &first)?;
        let options = PlanOptions {
            stages: Some(stages),
            replicas: Some(1),
            ..Default::default()
        };
        let planned = fusion_plan::plan(&problem, self.job.scheduler, &options)
            .map_err(|e| RuntimeError::Config(format!("planning the first island: {e}")))?;
        runs[0] = planned.plan.devices.iter().map(|d| runs[0][d[0]]).collect();
        self.placed.recompute = planned.evaluation.recompute.clone();
        let members: Vec<Vec<usize>> = runs
            .iter()
            .map(|run| run.iter().map(|&d| active[d]).collect())
            .collect();
        self.plan_explanation = self.islands_explanation(&members);
        self.plan_explanation
            .extend(explain(&problem, &planned.plan, &planned.evaluation));
        Ok((workload.assignment(&planned.plan.starts), slots(&members)))
    }
}
