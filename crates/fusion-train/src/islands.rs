//! Islands in one process: `count` copies of the model, each trained on its own share of the
//! data, synchronised every H inner steps by the outer optimizer (`outer.rs`). It computes
//! exactly what islands on separate machines compute (the same data, the same pseudo-gradient
//! messages, the same outer step), one island after another, so convergence against tokens can
//! be measured, and the outer optimizer's settings and codecs compared, on one machine.
//!
//! Data: island `i`'s inner step `t` reads its share `m_i` of micro-batches at positions
//! `t·count·M + m_0 + .. + m_(i-1) ..` (equal shares: `(t·count + i)·M ..`), so `count` islands
//! together read, step by step, what one synchronous trainer with `count · M` micro-batches per
//! step reads. One process is one device: `auto` shares are equal here; fixed ones are honoured,
//! and the outer step weighs each island by its share.

use crate::error::{Result, TrainError};
use crate::optim::OptimizerState;
use crate::outer::{
    decode_pseudo_gradient, fragment_due, fragment_of, weighted_mean, OuterConfig, OuterOptimizer,
    PseudoGradientEncoder,
};
use crate::report::{EvalRecord, OuterReport, Report, StepRecord};
use crate::trainer::Trainer;
use fusion_backend::Backend;
use std::time::Instant;

/// One island's own state between its turns on the shared trainer.
struct Island {
    params: Vec<Vec<f32>>,
    opt: OptimizerState,
    encoder: PseudoGradientEncoder,
    /// Overlapped synchronisation: per tensor, where the island began the round whose
    /// exchange is under way (None: the anchor; only the pending round's tensors are Some).
    start: Vec<Option<Vec<f32>>>,
}

/// An averaged round of pseudo-gradients, as the outer step takes it: the mean delta of every
/// trainable parameter (None elsewhere) and the value of every buffer (empty elsewhere).
type Averaged = (Vec<Option<Vec<f32>>>, Vec<Vec<f32>>);

/// Trains islands of one model in this process; see the module documentation.
pub struct IslandTrainer<B: Backend> {
    trainer: Trainer<B>,
    islands: Vec<Island>,
    outer: OuterOptimizer,
    cfg: OuterConfig,
    /// Micro-batches each island runs per inner step (they add up to count × M).
    shares: Vec<usize>,
    /// Overlapped synchronisation: the last round's average, applied at the next one.
    pending: Option<Averaged>,
    /// Inner steps every island has taken.
    step: u64,
    /// Synchronisations that overlapped the next round.
    overlapped: u64,
    /// Synchronisations of one fragment of the parameters (streaming).
    partial: u64,
    /// Streaming synchronisation: the fragment of each tensor.
    fragment: Vec<u32>,
    sent_bytes: u64,
    dense_bytes: u64,
}

impl<B: Backend> IslandTrainer<B> {
    /// `count` islands starting from `trainer`'s parameters and (zero) optimizer state.
    pub fn new(mut trainer: Trainer<B>, count: usize, cfg: OuterConfig) -> Result<Self> {
        cfg.validate()?;
        if count == 0 {
            return Err(TrainError::Config("at least one island".into()));
        }
        if trainer.step != 0 {
            return Err(TrainError::Config(
                "islands start from step 0 (their checkpoints hold the synchronised weights: \
                 start another run from them with --init-from)"
                    .into(),
            ));
        }
        trainer.keep_optimizer_on_host()?;
        let trainable: Vec<bool> = trainer.graph().params.iter().map(|p| p.trainable).collect();
        let outer = OuterOptimizer::new(&trainer.params, &trainable);
        let shares = cfg.shares.initial(count, trainer.cfg.micro_batches)?;
        let sizes: Vec<usize> = trainer.params.iter().map(Vec::len).collect();
        if cfg.fragments as usize > sizes.len() {
            return Err(TrainError::Config(format!(
                "{} fragments for a model of {} parameter tensors (a fragment is a band of \
                 whole tensors)",
                cfg.fragments,
                sizes.len()
            )));
        }
        let fragment = fragment_of(&sizes, cfg.fragments);
        let islands = (0..count)
            .map(|i| Island {
                params: trainer.params.clone(),
                opt: trainer.opt.clone(),
                encoder: PseudoGradientEncoder::new(cfg.codec, trainer.cfg.seed + i as u64),
                start: vec![None; sizes.len()],
            })
            .collect();
        Ok(IslandTrainer {
            trainer,
            islands,
            outer,
            cfg,
            shares,
            pending: None,
            overlapped: 0,
            partial: 0,
            fragment,
            step: 0,
            sent_bytes: 0,
            dense_bytes: 0,
        })
    }

    /// The synchronised parameters (where every island started its current round).
    pub fn anchor(&self) -> &[Vec<f32>] {
        &self.outer.anchor
    }

    /// Island `i`'s current parameters.
    pub fn island_params(&self, i: usize) -> Option<&[Vec<f32>]> {
        self.islands.get(i).map(|isl| isl.params.as_slice())
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    /// One inner step of island `i`: its state goes into the trainer, trains, and comes back.
    /// Returns (loss, gradient norm, learning rate).
    fn inner_step(&mut self, i: usize) -> Result<(f32, f32, f32)> {
        let total: usize = self.shares.iter().sum();
        let before: usize = self.shares[..i].iter().sum();
        let m = self.trainer.cfg.micro_batches;
        let island = &mut self.islands[i];
        std::mem::swap(&mut self.trainer.params, &mut island.params);
        std::mem::swap(&mut self.trainer.opt, &mut island.opt);
        self.trainer.step = self.step;
        self.trainer.data_position = self.step * total as u64 + before as u64;
        self.trainer.cfg.micro_batches = self.shares[i];
        let out = self.trainer.train_step();
        self.trainer.cfg.micro_batches = m;
        std::mem::swap(&mut self.trainer.params, &mut island.params);
        std::mem::swap(&mut self.trainer.opt, &mut island.opt);
        out
    }

    /// Each island's share of a step's micro-batches, as a weight (they add up to 1).
    fn weights(&self) -> Vec<f64> {
        let total = self.shares.iter().sum::<usize>().max(1) as f64;
        self.shares.iter().map(|&m| m as f64 / total).collect()
    }

    /// Every island trains one inner step; returns the mean loss of the step's micro-batches,
    /// the islands' mean gradient norm and the learning rate.
    pub fn train_step(&mut self) -> Result<(f32, f32, f32)> {
        let (mut loss, mut norm, mut lr) = (0.0f64, 0.0f64, 0.0f32);
        let weights = self.weights();
        for (i, w) in weights.into_iter().enumerate() {
            let (l, n, r) = self.inner_step(i)?;
            loss += w * l as f64;
            norm += n as f64;
            lr = r;
        }
        self.step += 1;
        let k = self.islands.len() as f64;
        Ok((loss as f32, (norm / k) as f32, lr))
    }

    /// The outer step: every island's pseudo-gradient is encoded as it would be sent, decoded,
    /// averaged (weighted by the islands' shares of the tokens) and applied to the anchor,
    /// which every island then starts from. Buffers (batch-norm statistics) are averaged.
    /// After overlapped synchronisations this is a blocking [`Self::synchronise_overlapped`].
    pub fn synchronise(&mut self) -> Result<()> {
        let started = |isl: &Island| isl.start.iter().any(Option::is_some);
        if self.pending.is_some() || self.islands.iter().any(started) {
            // After overlapped synchronisations: the round under way is applied first.
            return self.synchronise_overlapped(true);
        }
        let count = self.islands.len();
        let weights = self.weights();
        let mut received: Vec<Vec<Option<Vec<f32>>>> = Vec::with_capacity(count);
        for island in &mut self.islands {
            let delta = self.outer.pseudo_gradient(&island.params)?;
            let mut got = Vec::with_capacity(delta.len());
            for (p, d) in delta.into_iter().enumerate() {
                got.push(match d {
                    Some(d) => {
                        let msg = island.encoder.encode(p, &d);
                        self.sent_bytes += msg.len() as u64;
                        self.dense_bytes += 4 * d.len() as u64;
                        Some(decode_pseudo_gradient(&msg, d.len())?)
                    }
                    None => None,
                });
            }
            received.push(got);
        }
        let params = self.outer.anchor.len();
        let mut mean = Vec::with_capacity(params);
        let mut buffers = Vec::with_capacity(params);
        for p in 0..params {
            match received
                .iter_mut()
                .map(|r| r[p].take())
                .collect::<Option<Vec<_>>>()
            {
                Some(parts) => {
                    mean.push(Some(weighted_mean(&parts, &weights)?));
                    buffers.push(Vec::new());
                }
                None => {
                    mean.push(None);
                    let parts: Vec<Vec<f32>> =
                        self.islands.iter().map(|i| i.params[p].clone()).collect();
                    buffers.push(weighted_mean(&parts, &weights)?);
                }
            }
        }
        self.outer.step(&self.cfg, &mean, &buffers)?;
        for island in &mut self.islands {
            island.params.clone_from(&self.outer.anchor);
        }
        Ok(())
    }

    /// The overlapped synchronisation ([`OuterConfig::overlap`]) of the whole model: see
    /// [`Self::synchronise_part`].
    pub fn synchronise_overlapped(&mut self, block: bool) -> Result<()> {
        let every = vec![true; self.outer.anchor.len()];
        self.synchronise_part(&every, block)
    }

    /// Synchronises the tensors `members` says (a fragment, or all). The previous round's
    /// average, if one is pending, moves the anchor first, and every island onto it keeping
    /// the progress it made since that round's exchange began. Then the members' progress
    /// since their round began is averaged: with `block` the anchor takes it at once and every
    /// island holds the members' anchor; otherwise it becomes the pending average, which a
    /// cluster would now be exchanging beside the next inner steps.
    pub fn synchronise_part(&mut self, members: &[bool], block: bool) -> Result<()> {
        if members.len() != self.outer.anchor.len() {
            return Err(TrainError::PseudoGradient(format!(
                "a synchronisation of {} tensors' membership for a model of {}",
                members.len(),
                self.outer.anchor.len()
            )));
        }
        let deltas: Vec<Vec<Option<Vec<f32>>>> = self
            .islands
            .iter()
            .map(|isl| self.member_deltas(isl, members))
            .collect();
        if let Some(prev) = self.pending.take() {
            self.outer.step(&self.cfg, &prev.0, &prev.1)?;
            for isl in &mut self.islands {
                carry_started(isl, &self.outer.anchor);
            }
        }
        let averaged = self.average(deltas)?;
        if members.iter().any(|m| !m) {
            self.partial += 1;
        }
        if block {
            self.outer.step(&self.cfg, &averaged.0, &averaged.1)?;
            for isl in &mut self.islands {
                for (i, p) in isl.params.iter_mut().enumerate() {
                    if members[i] {
                        p.clone_from(&self.outer.anchor[i]);
                    }
                }
            }
        } else {
            self.overlapped += 1;
            self.pending = Some(averaged);
            for isl in &mut self.islands {
                for (i, s) in isl.start.iter_mut().enumerate() {
                    if members[i] {
                        *s = Some(isl.params[i].clone());
                    }
                }
            }
        }
        Ok(())
    }

    /// An island's progress on each member tensor since its round began (where the round's
    /// exchange began, else the anchor), `start - params`; None for the others.
    fn member_deltas(&self, isl: &Island, members: &[bool]) -> Vec<Option<Vec<f32>>> {
        (0..members.len())
            .map(|i| {
                members[i].then(|| {
                    let start = isl.start[i].as_ref().unwrap_or(&self.outer.anchor[i]);
                    start
                        .iter()
                        .zip(&isl.params[i])
                        .map(|(s, p)| s - p)
                        .collect()
                })
            })
            .collect()
    }

    /// The islands' deltas (None: not synchronised now), each trainable one encoded as it
    /// would be sent and decoded, averaged by the islands' shares; buffers become the anchor's
    /// minus their mean delta.
    fn average(&mut self, deltas: Vec<Vec<Option<Vec<f32>>>>) -> Result<Averaged> {
        let weights = self.weights();
        let tensors = self.outer.anchor.len();
        let mut parts: Vec<Vec<Vec<f32>>> = vec![Vec::with_capacity(deltas.len()); tensors];
        for (isl, delta) in self.islands.iter_mut().zip(deltas) {
            for (p, d) in delta.into_iter().enumerate() {
                let Some(d) = d else { continue };
                let trainable = self.trainer.graph().params[p].trainable;
                parts[p].push(if trainable {
                    let msg = isl.encoder.encode(p, &d);
                    self.sent_bytes += msg.len() as u64;
                    self.dense_bytes += 4 * d.len() as u64;
                    decode_pseudo_gradient(&msg, d.len())?
                } else {
                    d
                });
            }
        }
        let (mut mean, mut buffers) = (Vec::with_capacity(tensors), Vec::with_capacity(tensors));
        for (p, parts) in parts.into_iter().enumerate() {
            if parts.is_empty() {
                mean.push(None);
                buffers.push(Vec::new());
                continue;
            }
            let m = weighted_mean(&parts, &weights)?;
            if self.trainer.graph().params[p].trainable {
                mean.push(Some(m));
                buffers.push(Vec::new());
            } else {
                let a = &self.outer.anchor[p];
                buffers.push(a.iter().zip(&m).map(|(a, d)| a - d).collect());
                mean.push(None);
            }
        }
        Ok((mean, buffers))
    }

    /// Which tensors the synchronisation after this step takes: None when none is due; every
    /// tensor when the state must be one every island holds (`full`) or the model is one
    /// fragment; else the scheduled fragment's.
    fn due_members(&self, last: bool, full: bool) -> Option<Vec<bool>> {
        let f = fragment_due(self.step, &self.cfg);
        if !last && f.is_none() {
            return None;
        }
        Some(match f {
            Some(f) if !full && !last && self.cfg.fragments > 1 => {
                self.fragment.iter().map(|&g| g == f).collect()
            }
            _ => vec![true; self.fragment.len()],
        })
    }

    /// Evaluates the synchronised parameters.
    pub fn evaluate(&mut self) -> Result<EvalRecord> {
        let own = std::mem::replace(&mut self.trainer.params, self.outer.anchor.clone());
        self.trainer.step = self.step;
        let record = self.trainer.evaluate();
        self.trainer.params = own;
        record
    }

    /// Trains every island until `cfg.steps` inner steps, synchronising every H steps and after
    /// the last; evaluates the synchronised model at the first synchronisation at or after each
    /// `eval_every` steps, and writes the synchronised model as the final checkpoint when a
    /// checkpoint directory is set.
    pub fn run(
        &mut self,
        mut on_step: impl FnMut(&StepRecord, Option<&EvalRecord>),
    ) -> Result<Report> {
        let start = Instant::now();
        let total = self.trainer.cfg.steps;
        let (eval_every, per_step) = (self.trainer.cfg.eval_every, self.samples_per_step());
        let (mut steps, mut evals) = (Vec::new(), Vec::new());
        let (mut evaluated_at, mut saved_at) = (0u64, 0u64);
        while self.step < total {
            let t0 = Instant::now();
            let (loss, grad_norm, lr) = self.train_step()?;
            let last = self.step == total;
            let due = eval_every > 0 && self.step / eval_every > evaluated_at / eval_every;
            let every = self.trainer.cfg.checkpoint_every;
            let save = every > 0 && self.step / every > saved_at / every;
            // Only the synchronisations whose state is evaluated or saved, and the last, must
            // leave every island on the same parameters: they block and take every fragment.
            let full = last || due || save;
            let members = self.due_members(last, full);
            let synchronised = match &members {
                None => false,
                Some(_) if full => {
                    self.synchronise()?;
                    true
                }
                Some(m) if self.cfg.fragments > 1 || self.cfg.overlap => {
                    self.synchronise_part(m, !self.cfg.overlap)?;
                    false
                }
                Some(_) => {
                    self.synchronise()?;
                    true
                }
            };
            let eval = if synchronised && (last || due) {
                evaluated_at = self.step;
                Some(self.evaluate()?)
            } else {
                None
            };
            if synchronised && (last || save) {
                saved_at = self.step;
                self.save_checkpoint()?;
            }
            let rec = StepRecord {
                step: self.step,
                loss,
                lr,
                grad_norm,
                elapsed_s: start.elapsed().as_secs_f64(),
                throughput: per_step / t0.elapsed().as_secs_f64().max(1e-9),
            };
            on_step(&rec, eval.as_ref());
            steps.push(rec);
            evals.extend(eval);
        }
        let mut report = self.trainer.report(
            0,
            steps,
            evals,
            per_step * self.step as f64,
            start.elapsed(),
        );
        report.outer = Some(OuterReport {
            islands: self.islands.len(),
            config: self.cfg.clone(),
            syncs: self.outer.syncs,
            overlapped: self.overlapped,
            partial: self.partial,
            sent_bytes: self.sent_bytes,
            dense_bytes: self.dense_bytes,
            shares: self.shares.clone(),
            rebalances: Vec::new(),
            disagreements: Vec::new(),
        });
        Ok(report)
    }

    /// Writes the synchronised model, with island 0's inner optimizer state, as a checkpoint of
    /// the configured directory (none configured: nothing to do). Resuming from it continues
    /// as one synchronous run; the outer momentum and the other islands' moments are not kept.
    fn save_checkpoint(&mut self) -> Result<()> {
        let Some(dir) = self.trainer.cfg.checkpoint_dir.clone() else {
            return Ok(());
        };
        let own = std::mem::replace(&mut self.trainer.params, self.outer.anchor.clone());
        let opt = std::mem::replace(&mut self.trainer.opt, self.islands[0].opt.clone());
        self.trainer.step = self.step;
        let saved = self.trainer.save_checkpoint(&dir);
        self.trainer.params = own;
        self.trainer.opt = opt;
        saved.map(|_| ())
    }

    /// Tokens or samples all islands together see per inner step.
    pub fn samples_per_step(&self) -> f64 {
        self.trainer.samples_per_step() * self.islands.len() as f64
    }
}

/// Moves an island whose pending round's exchange just arrived onto the new `anchor`, keeping
/// what it learnt since that exchange began: every tensor with a start (the pending round's)
/// gets `params += anchor - start`, and its next round is measured from the anchor.
fn carry_started(isl: &mut Island, anchor: &[Vec<f32>]) {
    for ((p, a), s) in isl.params.iter_mut().zip(anchor).zip(&mut isl.start) {
        if let Some(start) = s.take() {
            for ((p, a), s) in p.iter_mut().zip(a).zip(&start) {
                *p += a - s;
            }
        }
    }
}
