//! Islands on a cluster: when the job has an outer optimizer, each data-parallel replica of the
//! pipeline is an island that applies its own gradients, and after the broker's OUTER_SYNC every
//! stage's nodes average their deltas from the anchor (parameters at the last synchronisation
//! minus now: pseudo-gradients, and the change of every buffer) over the islands with ring
//! all-reduces and apply the outer step (`fusion_train::OuterOptimizer`), so every island starts
//! the next round from the same parameters. A parameter shared with another stage (a tied
//! embedding) gets a ring of its own, so every stage holding it computes the same bits.

use super::*;

impl<B: Backend> StageWorker<B> {
    /// Whether this stage's replicas are islands synchronised by an outer optimizer.
    pub fn islands(&self) -> bool {
        self.cfg.outer.is_some() && (self.replicas > 1 || self.island)
    }

    /// Starts the outer optimizer at the parameters the stage holds now: after an assignment,
    /// the last synchronisation's (the broker snapshots islands only right after one).
    pub fn start_outer(&mut self) {
        if let Some(cfg) = &self.cfg.outer {
            self.outer = Some(OuterOptimizer::new(&self.params, &self.trainable));
            // Residuals restart with the anchor (after a rollback the rounds restart too).
            self.outer_encoder = Some(PseudoGradientEncoder::new(cfg.codec, 0));
        }
    }

    /// The outer momentum of each parameter (empty for buffers and frozen ones), which a
    /// snapshot keeps; None for a stage that is not an island.
    pub fn outer_momentum(&self) -> Option<&[Vec<f32>]> {
        self.outer.as_ref().map(|o| &o.momentum[..])
    }

    /// Zeros shaped as [`Self::outer_momentum`]: where a snapshot's outer momentum is received.
    pub fn outer_momentum_buffers(&self) -> Vec<Vec<f32>> {
        OuterOptimizer::zero_momentum(&self.params, &self.trainable)
    }

    /// Continues the outer optimizer (started at the snapshot's anchor) with the snapshot's
    /// outer momentum; `complete[i]` says whether every element of parameter i's arrived.
    pub fn restore_outer_momentum(
        &mut self,
        momentum: Vec<Vec<f32>>,
        complete: &[bool],
    ) -> Result<()> {
        let due = |i: usize| self.trainable[i] && !self.params[i].is_empty();
        let missing =
            (0..self.params.len()).find(|&i| due(i) && !complete.get(i).copied().unwrap_or(false));
        if let Some(i) = missing {
            return Err(RuntimeError::Protocol(format!(
                "the broker sent the outer momentum of some parameters but not of '{}'",
                self.graph().params[i].name
            )));
        }
        let outer = self.outer.as_mut().ok_or_else(|| {
            RuntimeError::Protocol("outer momentum for a stage that is not an island".into())
        })?;
        outer.momentum = momentum;
        Ok(())
    }

    /// Whether this job's pseudo-gradients are sparse (top-k): a ring cannot add those up on
    /// the way, so each island's message travels around whole and every node sums them.
    pub(super) fn sparse_outer(&self) -> bool {
        matches!(
            self.cfg.outer.as_ref().map(|o| o.codec),
            Some(Codec::TopK { .. })
        )
    }

    /// Whether `ring` (one of [`Self::outer_rings`]) travels as whole sparse messages: a
    /// trainable parameter's in a top-k job.
    pub(super) fn sparse_ring(&self, ring: &[usize]) -> bool {
        self.sparse_outer() && ring.iter().all(|&i| self.trainable[i])
    }

    /// Local parameter indices of each ring of a synchronisation: every parameter shared with
    /// another stage alone, by ascending global id, then all the others together. With top-k
    /// pseudo-gradients: every trainable parameter alone (each its own top-k, as in one
    /// process), then the buffers together (exact: batch-norm statistics are averaged, not
    /// sparsified).
    pub(super) fn outer_rings(&self) -> Vec<Vec<usize>> {
        if self.sparse_outer() {
            let n = self.params.len();
            let mut rings: Vec<Vec<usize>> = (0..n)
                .filter(|&i| self.trainable[i])
                .map(|i| vec![i])
                .collect();
            let buffers: Vec<usize> = (0..n).filter(|&i| !self.trainable[i]).collect();
            if !buffers.is_empty() {
                rings.push(buffers);
            }
            return rings;
        }
        let mut shared: Vec<usize> = self
            .routes
            .shared
            .iter()
            .filter_map(|sp| self.param_ids.iter().position(|&p| p == sp.param))
            .collect();
        shared.sort_by_key(|&i| self.param_ids[i]);
        shared.dedup();
        let mut rings: Vec<Vec<usize>> = shared.iter().map(|&i| vec![i]).collect();
        rings.push(
            (0..self.params.len())
                .filter(|i| !shared.contains(i))
                .collect(),
        );
        rings
    }

    /// Values ring `ring` of a synchronisation moves.
    pub(super) fn ring_len(&self, ring: &[usize]) -> usize {
        ring.iter().map(|&i| self.params[i].len()).sum()
    }

    /// This island's weight in a synchronisation: its share `m` of the round's `total`
    /// micro-batches (`RunStep`'s counts), or `1 / R` where the broker sends none (equal shares).
    pub fn sync_weight(&self, m: u32, total: u32) -> Result<f32> {
        match (m, total) {
            (0, 0) => Ok(1.0 / self.replicas as f32),
            (m, total) if m > 0 && m <= total => Ok(m as f32 / total as f32),
            _ => Err(RuntimeError::Protocol(format!(
                "an outer synchronisation weighing {m} of {total} micro-batches"
            ))),
        }
    }

    /// The islands' mean delta from the anchor of every parameter and buffer, each island's
    /// delta weighed by its share (`weight`) before the rings sum them.
    fn mean_deltas(
        &mut self,
        step: u64,
        weight: f32,
        codec: Codec,
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<Vec<Vec<f32>>> {
        let outer = self.outer.as_ref().ok_or_else(|| {
            RuntimeError::Protocol("an outer synchronisation without islands".into())
        })?;
        let rings = self.outer_rings();
        let mut flats: Vec<Vec<f32>> = rings
            .iter()
            .map(|ring| {
                let mut flat = Vec::with_capacity(self.ring_len(ring));
                for &i in ring {
                    let (a, p) = (&outer.anchor[i], &self.params[i]);
                    flat.extend(a.iter().zip(p).map(|(a, p)| (a - p) * weight));
                }
                flat
            })
            .collect();
        let (sparse, dense): (Vec<usize>, Vec<usize>) =
            (0..rings.len()).partition(|&j| self.sparse_ring(&rings[j]));
        // Sparse rings all at once: one round trip per ring step, not one per parameter.
        if !sparse.is_empty() {
            let items: Vec<(usize, usize, Vec<f32>)> = sparse
                .iter()
                .map(|&j| (j * self.replicas, j, std::mem::take(&mut flats[j])))
                .collect();
            let sums = self.sparse_sums(step, items, codec, mailbox, outbox)?;
            for (&j, sum) in sparse.iter().zip(sums) {
                flats[j] = sum;
            }
        }
        // Buffers of a top-k job travel exact: a ring cannot add sparse chunks up.
        let dense_codec = if self.sparse_outer() {
            Codec::None
        } else {
            codec
        };
        for j in dense {
            let edge_base = j * self.replicas;
            self.ring_sum(step, edge_base, &mut flats[j], dense_codec, mailbox, outbox)?;
        }
        let mut mean = vec![Vec::new(); self.params.len()];
        for (ring, flat) in rings.into_iter().zip(flats) {
            let mut off = 0;
            for &i in &ring {
                let n = self.params[i].len();
                mean[i] = flat[off..off + n].to_vec();
                off += n;
            }
        }
        Ok(mean)
    }

    /// The outer synchronisation after step `step`'s update: the rings average the islands'
    /// deltas (each weighed by its island's share of the round's micro-batches, `weight`), the
    /// outer optimizer moves the anchor along the pseudo-gradients, buffers take their mean,
    /// and the stage's parameters become the new anchor (the same bits on every island). The
    /// result's `grad_square_sum` is the sum of squares of the new parameters, so the broker
    /// can check that the islands agree.
    pub fn outer_sync(
        &mut self,
        step: u64,
        weight: f32,
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<StepOutcome> {
        if !self.islands() {
            return Err(RuntimeError::Protocol(
                "an outer synchronisation for a stage that is not one of several islands".into(),
            ));
        }
        let t0 = Instant::now();
        self.progress.enter(Phase::Updating, step, 0, "");
        let cfg = self.cfg.outer.clone().ok_or_else(|| {
            RuntimeError::Protocol("an outer synchronisation without islands".into())
        })?;
        let mean = self.mean_deltas(step, weight, cfg.codec, mailbox, outbox)?;
        let wait = t0.elapsed();
        let no_state = || RuntimeError::Protocol("an outer synchronisation without islands".into());
        let outer = self.outer.as_mut().ok_or_else(no_state)?;
        let (mut delta, mut buffers) = (Vec::new(), Vec::new());
        for (i, m) in mean.into_iter().enumerate() {
            if self.trainable[i] {
                delta.push(Some(m));
                buffers.push(Vec::new());
            } else {
                buffers.push(outer.anchor[i].iter().zip(&m).map(|(a, d)| a - d).collect());
                delta.push(None);
            }
        }
        outer.step(&cfg, &delta, &buffers)?;
        self.params.clone_from(&outer.anchor);
        self.progress.idle();
        let square_sum = self
            .params
            .iter()
            .flatten()
            .map(|&x| (x as f64) * (x as f64))
            .sum();
        Ok(StepOutcome {
            grad_square_sum: square_sum,
            wait_seconds: wait.as_secs_f64(),
            compute_seconds: t0.elapsed().saturating_sub(wait).as_secs_f64(),
            ..StepOutcome::default()
        })
    }
}
