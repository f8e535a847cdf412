//! The run's report.

use super::*;

impl Coordinator<'_> {
    pub(super) fn report(&mut self) -> ClusterReport {
        let h = std::mem::replace(&mut self.history, History::new());
        let (start, start_step, steps, evals, timings) =
            (h.start, h.start_step, h.steps, h.evals, h.timings);
        let step_s = timings.iter().map(|t| t.wall_s).sum::<f64>() / timings.len().max(1) as f64;
        let cfg = &self.job.train;
        // Every step read every replica's (island's) micro-batches: fewer while islands were out.
        let micro_batches: usize = timings.iter().map(|t| t.read).sum();
        let read = match self.job.data.kind() {
            DataKind::Text { .. } => cfg.batch_size * cfg.seq_len * micro_batches,
            DataKind::Images { .. } => cfg.batch_size * micro_batches,
        } as f64;
        let wall = start.elapsed().as_secs_f64();
        let mut backends: Vec<String> = self.placement.iter().map(|p| p.backend.clone()).collect();
        backends.dedup();
        let ids: HashMap<&str, usize> = self
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| (m.id.as_str(), i))
            .collect();
        let links = self
            .links
            .iter()
            .map(|((from, to), (bytes, tensors))| {
                let pair = ids.get(from.as_str()).zip(ids.get(to.as_str()));
                let link = pair.and_then(|(&a, &b)| self.testbed_path(a, b));
                let path = pair.map_or("unknown".into(), |(&a, &b)| self.path_between(a, b).name());
                LinkRecord {
                    from: from.clone(),
                    to: to.clone(),
                    bytes: *bytes,
                    tensors: *tensors,
                    bandwidth_mbps: link.map(|l| l.0),
                    latency_ms: link.map(|l| l.1),
                    path,
                }
            })
            .collect();
        ClusterReport {
            report: Report {
                model: self.job.model.name.clone(),
                backend: format!("{} nodes: {}", self.placement.len(), backends.join(" + ")),
                data: self.job.data.describe(),
                params: self.graph.num_trainable(),
                config: cfg.clone(),
                start_step,
                throughput: read / wall.max(1e-9),
                steps,
                evals,
                throughput_unit: match self.job.data.kind() {
                    DataKind::Text { .. } => "tokens/s",
                    DataKind::Images { .. } => "samples/s",
                },
                wall_s: wall,
                peak_rss_bytes: peak_rss_bytes(),
                entropy_floor: self.job.data.entropy_floor(),
                unigram_entropy: self.job.data.unigram_entropy(),
                outer: self.islands().then(|| fusion_train::OuterReport {
                    shares: self.placed.shares.clone(),
                    ..self.outer.clone()
                }),
                loss_scale: self.scaler.clone(),
            },
            schedule: format!("{:?}", self.job.schedule),
            placement: self.placement.clone(),
            links,
            timings,
            failures: self.failures.clone(),
            plan: self.plan_explanation.clone(),
            measured_links: self.measured.values().cloned().collect(),
            compression: self.codecs.clone(),
            run_id: self.run_id.clone(),
            recoveries: self.recoveries.clone(),
            reshapes: self.reshapes.clone(),
            snapshots: self.snapshot_stats(Some(step_s)),
            overclaims: self.overclaims.clone(),
            stragglers: self.stragglers.clone(),
        }
    }
}
