//! Optimizer state sharded among the data-parallel replicas of a stage (ZeRO stage 1). The
//! stage's trainable values, concatenated, are cut into the ring's chunks; each replica keeps
//! the optimizer moments of one chunk only (the one a ring reduce-scatter leaves whole on it).
//! A training step reduce-scatters the gradients instead of all-reducing them, and the update
//! changes that chunk of the parameters and then all-gathers them (on the compute thread,
//! before the node takes its next command). The ring moves the same bytes as the all-reduce it
//! replaces, and each replica holds 1/R of the moments (AdamW: 8/R bytes per parameter instead
//! of 8).
//!
//! The update is element-wise and every replica reduces the same sums as the all-reduce would,
//! so without clipping sharded replicas train to the same bits as unsharded ones; the gradient
//! norm is summed in another order (chunk by chunk across replicas), so a clipped step can
//! differ in its last bit.

use super::*;
use crate::wire::bytes_to_f32;
use fusion_proto::ParamData;

/// Which piece of each local parameter this replica's optimizer moments cover.
#[derive(Debug)]
pub(crate) struct OptimizerShard {
    /// Per local parameter: the first element of its piece and the piece's length (0: no piece
    /// here; always 0 for buffers and frozen parameters).
    offsets: Vec<usize>,
    lens: Vec<usize>,
    /// The last update changed only this replica's chunk: the others' are due before the
    /// parameters are used again.
    gather_due: bool,
    /// Why the last gather failed (reported again by the next step, which cannot run on stale
    /// chunks).
    gather_failed: Option<RuntimeError>,
}

/// The piece of the concatenated trainable values `chunk` (start, length) that falls in each
/// parameter (`sizes`: its element count when trainable): (first element, length) of each.
pub(crate) fn pieces(sizes: &[Option<usize>], chunk: (usize, usize)) -> Vec<(usize, usize)> {
    let (c0, c1) = (chunk.0, chunk.0 + chunk.1);
    let mut at = 0;
    sizes
        .iter()
        .map(|s| {
            let Some(n) = *s else { return (0, 0) };
            let (p0, p1) = (at, at + n);
            at = p1;
            let (a, b) = (p0.max(c0), p1.min(c1));
            if a < b {
                (a - p0, b - a)
            } else {
                (0, 0)
            }
        })
        .collect()
}

impl<B: Backend> StageWorker<B> {
    /// Shards this stage's optimizer moments among its replicas when the job asks for it (not
    /// with one replica, nor for islands, which keep their own moments): the moments of the
    /// other chunks are dropped, so this is done before any are received.
    pub fn shard_optimizer(&mut self) {
        if !self.cfg.shard_optimizer.is_on() || self.replicas < 2 || self.islands() {
            return;
        }
        let sizes: Vec<Option<usize>> = self
            .graph()
            .params
            .iter()
            .map(|p| p.trainable.then(|| p.numel()))
            .collect();
        let chunk = ring_chunks(self.flat_len(), self.replicas)
            [self.ring(Direction::AllReduce).owned_chunk()];
        let (offsets, lens): (Vec<usize>, Vec<usize>) = pieces(&sizes, chunk).into_iter().unzip();
        let piece_sizes: Vec<Option<usize>> = sizes
            .iter()
            .zip(&lens)
            .map(|(s, &l)| s.map(|_| l))
            .collect();
        let step = self.opt.step;
        self.opt = OptimizerState::new(&self.cfg.optimizer, &piece_sizes);
        self.opt.step = step;
        self.shard = Some(OptimizerShard {
            offsets,
            lens,
            gather_due: false,
            gather_failed: None,
        });
    }

    /// Refuses to use the parameters while another replica's chunk of the last update is
    /// missing (its all-gather failed): they would be stale.
    pub(super) fn check_gathered(&mut self) -> Result<()> {
        match self.shard.as_mut() {
            Some(s) if s.gather_due => Err(s.gather_failed.take().unwrap_or_else(|| {
                RuntimeError::Protocol(
                    "the parameters' all-gather after the last update did not finish".into(),
                )
            })),
            _ => Ok(()),
        }
    }

    /// Whether this replica keeps only a shard of the optimizer moments.
    pub fn is_sharded(&self) -> bool {
        self.shard.is_some()
    }

    /// The elements of local parameter `i` whose state this replica saves: None for all of
    /// them (unsharded), else (first element, count), count 0 for none. A sharded replica
    /// saves the values and moments of its own piece; buffers and frozen parameters (not
    /// sharded) are saved whole by replica 0, as an unsharded snapshot takes them.
    pub fn saved_window(&self, i: usize) -> Option<(usize, usize)> {
        let shard = self.shard.as_ref()?;
        if !self.trainable[i] {
            let n = if self.replica == 0 {
                self.params[i].len()
            } else {
                0
            };
            return Some((0, n));
        }
        Some((shard.offsets[i], shard.lens[i]))
    }

    /// Writes a received moment piece (`first`: the first moment, else the second) of local
    /// parameter `i`: whole without a shard, else only where it meets this replica's piece.
    /// Whether the piece ends the parameter.
    pub fn write_moment_piece(&mut self, i: usize, first: bool, p: &ParamData) -> Result<bool> {
        let numel = self.params[i].len();
        if self.shard.is_some() && !self.trainable[i] {
            return Err(RuntimeError::Protocol(format!(
                "optimizer moments for parameter #{}, which is not trainable",
                p.param
            )));
        }
        let target = match first {
            true => &mut self.opt.first[i],
            false => &mut self.opt.second[i],
        };
        let Some(shard) = &self.shard else {
            crate::wire::write_piece(target, p)?;
            return Ok(p.offset as usize * 4 + p.data.len() == target.len() * 4);
        };
        let (w0, wl) = (shard.offsets[i], shard.lens[i]);
        let values = bytes_to_f32(&p.data);
        let start = usize::try_from(p.offset).unwrap_or(usize::MAX);
        let end = start.saturating_add(values.len());
        if p.total_elements != numel as u64
            || !p.data.len().is_multiple_of(4)
            || end > numel
            || (wl > 0 && target.len() != wl)
        {
            return Err(RuntimeError::Protocol(format!(
                "a moment piece of parameter #{} ({} values at element {}, total {}) does not \
                 fit its {numel} elements",
                p.param,
                values.len(),
                p.offset,
                p.total_elements
            )));
        }
        let (a, b) = (start.max(w0), end.min(w0 + wl));
        if a < b {
            target[a - w0..b - w0].copy_from_slice(&values[a - start..b - start]);
        }
        Ok(end == numel)
    }

    /// Reduce-scatters the step's trainable gradients among the replicas: the chunk this
    /// replica owns ends up summed over all of them, written back into `host` (the rest of
    /// `host` holds partial sums, which no update reads). The sum of squares of the owned
    /// gradients that count in the global norm.
    pub(super) fn shard_gradients(
        &self,
        step: u64,
        host: &mut [Option<Vec<f32>>],
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<f64> {
        let shard = self.shard.as_ref().ok_or_else(|| {
            RuntimeError::Protocol("a sharded gradient sum without a shard".into())
        })?;
        let graph = self.exec.graph();
        let mut flat = self.flat_gradients(host);
        self.ring(Direction::AllReduce).reduce_scatter(
            step,
            0,
            &mut flat,
            Codec::None,
            mailbox,
            outbox,
        )?;
        let mut square_sum = 0.0f64;
        let mut at = 0;
        for (i, (g, spec)) in host.iter_mut().zip(&graph.params).enumerate() {
            if !spec.trainable {
                continue;
            }
            let (off, len) = (shard.offsets[i], shard.lens[i]);
            let mine = &flat[at + off..at + off + len];
            at += spec.numel();
            let g = g.get_or_insert_with(|| vec![0.0; spec.numel()]);
            g[off..off + len].copy_from_slice(mine);
            if self.counts_in_norm(i) {
                square_sum += fusion_train::square_sum(mine);
            }
        }
        Ok(square_sum)
    }

    /// Applies the optimizer to this replica's piece of every parameter; the other replicas'
    /// pieces arrive with the next [`gather_parameters`](Self::gather_parameters).
    pub(super) fn update_shard(&mut self, lr: f32, grads: &[Option<Vec<f32>>]) -> bool {
        let Some(shard) = self.shard.as_mut() else {
            return false;
        };
        let cfg = &self.cfg.optimizer;
        let offsets = &shard.offsets;
        self.opt
            .update_pieces(cfg, &mut self.params, grads, &self.decay, lr, offsets);
        shard.gather_due = true;
        true
    }

    /// After a sharded update: every replica's updated chunk of the parameters travels around
    /// the ring (exact f32), so every replica holds the whole updated stage again (nothing to
    /// do when no sharded update is due). Ring steps are numbered after the step's gradient
    /// ring's, so the two never meet.
    pub fn gather_parameters(
        &mut self,
        step: u64,
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<()> {
        if !self.shard.as_ref().is_some_and(|s| s.gather_due) {
            return Ok(());
        }
        let trainable: Vec<usize> = (0..self.params.len())
            .filter(|&i| self.trainable[i])
            .collect();
        let mut flat: Vec<f32> = Vec::with_capacity(self.flat_len());
        for &i in &trainable {
            flat.extend_from_slice(&self.params[i]);
        }
        let k0 = 2 * (self.replicas - 1);
        if let Err(e) = self.ring(Direction::AllReduce).all_gather(
            step,
            k0,
            0,
            &mut flat,
            Codec::None,
            mailbox,
            outbox,
        ) {
            let why = RuntimeError::Protocol(format!("the parameters' all-gather failed: {e}"));
            if let Some(s) = self.shard.as_mut() {
                s.gather_failed = Some(why);
            }
            return Err(e);
        }
        let mut at = 0;
        for &i in &trainable {
            let n = self.params[i].len();
            self.params[i].copy_from_slice(&flat[at..at + n]);
            at += n;
        }
        if let Some(s) = self.shard.as_mut() {
            s.gather_due = false;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::pieces;

    #[test]
    fn a_chunk_falls_into_the_pieces_of_the_parameters_it_spans() {
        // Trainable parameters of 4, 6 and 5 elements around a buffer (None): 15 values.
        let sizes = [Some(4), None, Some(6), Some(5)];
        assert_eq!(pieces(&sizes, (2, 7)), vec![(2, 2), (0, 0), (0, 5), (0, 0)]);
        assert_eq!(pieces(&sizes, (9, 6)), vec![(0, 0), (0, 0), (5, 1), (0, 5)]);
        // Chunks that tile the vector give pieces that tile every parameter.
        let chunks = crate::worker::ring_chunks(15, 4);
        for (i, n) in sizes.iter().enumerate() {
            let covered: usize = chunks.iter().map(|&c| pieces(&sizes, c)[i].1).sum();
            assert_eq!(covered, n.unwrap_or(0));
        }
    }
}
