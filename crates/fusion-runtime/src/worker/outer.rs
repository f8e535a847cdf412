//! Islands on a cluster: when the job has an outer optimizer, each data-parallel replica of the
//! pipeline is an island that applies its own gradients, and after the broker's OUTER_SYNC every
//! stage's nodes exchange their pseudo-gradients (parameters at the last synchronisation minus
//! now) with a ring all-reduce across the islands and apply the outer step
//! (`fusion_train::OuterOptimizer`), so every island starts the next round from the same
//! parameters. Buffers (batch-norm statistics) are averaged.

use super::*;
use fusion_train::{decode_pseudo_gradient, PseudoGradientEncoder};

impl<B: Backend> StageWorker<B> {
    /// Whether this stage's replicas are islands synchronised by an outer optimizer.
    pub fn islands(&self) -> bool {
        self.cfg.outer.is_some() && self.replicas > 1
    }

    /// Starts the outer optimizer at the parameters the stage holds now: after an assignment,
    /// the last synchronisation's (the broker snapshots islands only right after one).
    pub fn start_outer(&mut self) {
        if let Some(cfg) = &self.cfg.outer {
            self.outer = Some(OuterOptimizer::new(&self.params, &self.trainable));
            self.outer_encoder = Some(PseudoGradientEncoder::new(cfg.codec, self.cfg.seed));
        }
    }

    /// Values one outer exchange moves: every parameter's pseudo-gradient and every buffer.
    pub(super) fn outer_len(&self) -> usize {
        self.params.iter().map(Vec::len).sum()
    }

    /// The stage's pseudo-gradients (through the codec, its error kept for the next round) and
    /// buffers, concatenated in parameter order.
    fn outer_flat(&mut self) -> Result<Vec<f32>> {
        let no_state = || RuntimeError::Protocol("an outer synchronisation without islands".into());
        let len = self.outer_len();
        let outer = self.outer.as_ref().ok_or_else(no_state)?;
        let encoder = self.outer_encoder.as_mut().ok_or_else(no_state)?;
        let delta = outer.pseudo_gradient(&self.params)?;
        let mut flat = Vec::with_capacity(len);
        for (i, d) in delta.into_iter().enumerate() {
            match d {
                Some(d) => {
                    let sent = decode_pseudo_gradient(&encoder.encode(i, &d), d.len())?;
                    flat.extend_from_slice(&sent);
                }
                None => flat.extend_from_slice(&self.params[i]),
            }
        }
        Ok(flat)
    }

    /// The outer synchronisation after step `step`'s update: the ring averages the islands'
    /// pseudo-gradients and buffers, the outer optimizer moves the anchor, and the stage's
    /// parameters become the new anchor (identical on every island).
    pub fn outer_sync(
        &mut self,
        step: u64,
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<StepOutcome> {
        let t0 = Instant::now();
        let cfg = self.cfg.outer.clone().ok_or_else(|| {
            RuntimeError::Protocol("an outer synchronisation without islands".into())
        })?;
        let mut flat = self.outer_flat()?;
        let t_ring = Instant::now();
        self.ring_sum(step, &mut flat, cfg.codec, mailbox, outbox)?;
        let wait = t_ring.elapsed();
        let scale = 1.0 / self.replicas as f32;
        let (mut mean, mut buffers, mut off) = (Vec::new(), Vec::new(), 0);
        for (p, &trainable) in self.params.iter().zip(&self.trainable) {
            let part: Vec<f32> = flat[off..off + p.len()].iter().map(|v| v * scale).collect();
            off += p.len();
            if trainable {
                mean.push(Some(part));
                buffers.push(Vec::new());
            } else {
                mean.push(None);
                buffers.push(part);
            }
        }
        let outer = self.outer.as_mut().ok_or_else(|| {
            RuntimeError::Protocol("an outer synchronisation without islands".into())
        })?;
        outer.step(&cfg, &mean, &buffers)?;
        self.params.clone_from(&outer.anchor);
        self.progress.idle();
        Ok(StepOutcome {
            wait_seconds: wait.as_secs_f64(),
            compute_seconds: t0.elapsed().saturating_sub(wait).as_secs_f64(),
            ..StepOutcome::default()
        })
    }
}
