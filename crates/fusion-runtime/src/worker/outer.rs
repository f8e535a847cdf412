//! Islands on a cluster: when the job has an outer optimizer, each data-parallel replica of the
//! pipeline is an island that applies its own gradients, and after the broker's OUTER_SYNC every
//! stage's nodes average their deltas from the anchor (parameters at the last synchronisation
//! minus now: pseudo-gradients, and the change of every buffer) over the islands with ring
//! all-reduces and apply the outer step (`fusion_train::OuterOptimizer`), so every island starts
//! the next round from the same parameters. A parameter shared with another stage (a tied
//! embedding) gets a ring of its own, so every stage holding it computes the same bits.

use super::ring::Ring;
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
            // Residuals restart with the anchor (after a rollback the rounds restart too), and
            // an exchange still under way belongs to the abandoned placement (its mailbox is
            // poisoned: its thread ends on its own).
            self.outer_encoder = Some(PseudoGradientEncoder::new(cfg.codec, 0));
            self.overlapped = Overlapped::default();
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

    /// Which of the stage's tensors a synchronisation takes: fragment `fragment`'s
    /// (`RunStep.fragment`, by the assignment's `fragments`), or every one.
    pub(super) fn sync_members(&self, fragment: Option<u32>) -> Result<Vec<bool>> {
        let count = self.cfg.outer.as_ref().map_or(1, |o| o.fragments);
        match fragment {
            None => Ok(vec![true; self.params.len()]),
            Some(f) if f >= count => Err(RuntimeError::Protocol(format!(
                "a synchronisation of fragment {f} in a job of {count}"
            ))),
            Some(f) if self.fragments.len() == self.params.len() => {
                Ok(self.fragments.iter().map(|&g| g == f).collect())
            }
            Some(f) => Err(RuntimeError::Protocol(format!(
                "a synchronisation of fragment {f} for a stage assigned no fragments"
            ))),
        }
    }

    /// The rings of a synchronisation of the tensors `members` says: [`Self::outer_rings`]
    /// without the other tensors, rings left empty dropped (the same on every island).
    pub(super) fn member_rings(&self, members: &[bool]) -> Vec<Vec<usize>> {
        let member = |i: &usize| members.get(*i).copied().unwrap_or(false);
        self.outer_rings()
            .into_iter()
            .map(|ring| ring.into_iter().filter(member).collect::<Vec<_>>())
            .filter(|ring| !ring.is_empty())
            .collect()
    }

    /// The first edge id of each ring set: the whole model's rings first, then fragment 0's,
    /// 1's, ..; ring `j` of a set starting at `base` sends chunk `c` as edge
    /// `base + j · replicas + c`. Gives (set, first edge) for each.
    fn ring_sets(&self) -> Vec<(Option<u32>, usize)> {
        let count = match self.fragments.is_empty() {
            true => 0,
            false => self.cfg.outer.as_ref().map_or(0, |o| o.fragments),
        };
        let mut base = 0;
        let mut sets = Vec::new();
        for set in std::iter::once(None).chain((0..count).map(Some)) {
            sets.push((set, base));
            let members = self.sync_members(set).unwrap_or_default();
            base += self.member_rings(&members).len() * self.replicas;
        }
        sets
    }

    /// Every ring this stage may run in an outer synchronisation, with the first edge id of
    /// its chunks (for the shapes it receives).
    pub(super) fn all_outer_rings(&self) -> Vec<(usize, Vec<usize>)> {
        let mut all = Vec::new();
        for (set, base) in self.ring_sets() {
            let members = self.sync_members(set).unwrap_or_default();
            for (j, ring) in self.member_rings(&members).into_iter().enumerate() {
                all.push((base + j * self.replicas, ring));
            }
        }
        all
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

    /// The outer synchronisation after step `step`'s update (see the module documentation) of
    /// the tensors of `fragment` (None: all): the islands' progress on them since
    /// their round began, each weighed by its island's share of the round's micro-batches
    /// (`weight`), is averaged by the rings. Blocking: the outer step follows at once and every
    /// island's stage holds the new anchor on them (the same bits on every island). With
    /// `overlap`, the exchange runs on a thread of its own beside the next inner steps. Either
    /// way the previous overlapped exchange (if any) is applied first: the anchor takes its
    /// outer step and the stage moves onto it, keeping what it learnt since that exchange
    /// began. The result's `grad_square_sum` is the anchor's sum of squares, so the broker can
    /// check that the islands agree.
    pub fn outer_sync(
        &mut self,
        step: u64,
        weight: f32,
        overlap: bool,
        fragment: Option<u32>,
        mailbox: &Arc<Mailbox>,
        outbox: &Arc<Outbox>,
    ) -> Result<StepOutcome> {
        if !self.islands() {
            return Err(RuntimeError::Protocol(
                "an outer synchronisation for a stage that is not one of several islands".into(),
            ));
        }
        let t0 = Instant::now();
        self.progress.enter(Phase::Updating, step, 0, "");
        let cfg = self.cfg.outer.clone().ok_or_else(no_islands)?;
        let members = self.sync_members(fragment)?;
        let deltas = self.member_deltas(&members)?;
        let mut wait = self.apply_pending(step, &cfg)?;
        mailbox.begin_outer(step);
        let base = self
            .ring_sets()
            .into_iter()
            .find(|&(set, _)| set == fragment)
            .map_or(0, |(_, base)| base);
        let exchange = self.exchange(step, weight, cfg.codec, (&members, base), deltas)?;
        if overlap {
            self.launch(exchange, &members, mailbox, outbox)?;
        } else {
            let tj = Instant::now();
            let (mean, encoder) = exchange.run(mailbox, outbox)?;
            wait += tj.elapsed();
            self.outer_encoder = Some(encoder);
            self.apply_mean(&cfg, mean)?;
            let outer = self.outer.as_ref().ok_or_else(no_islands)?;
            for (i, p) in self.params.iter_mut().enumerate() {
                if members[i] {
                    p.clone_from(&outer.anchor[i]);
                }
            }
        }
        self.progress.idle();
        let outer = self.outer.as_ref().ok_or_else(no_islands)?;
        let square_sum = outer
            .anchor
            .iter()
            .fold(0.0, |sum, a| sum + fusion_train::square_sum(a));
        Ok(StepOutcome {
            grad_square_sum: square_sum,
            wait_seconds: wait.as_secs_f64(),
            compute_seconds: t0.elapsed().saturating_sub(wait).as_secs_f64(),
            ..StepOutcome::default()
        })
    }

    /// The stage's progress on each member tensor since its round began, `start − value`
    /// (`start`: where the tensor's overlapped exchange began, else the anchor); None for the
    /// others.
    pub(super) fn member_deltas(&self, members: &[bool]) -> Result<Vec<Option<Vec<f32>>>> {
        let anchor = &self.outer.as_ref().ok_or_else(no_islands)?.anchor;
        let started = |i: usize| self.overlapped.start.get(i).and_then(Option::as_ref);
        Ok((0..self.params.len())
            .map(|i| {
                members[i].then(|| {
                    let start = started(i).unwrap_or(&anchor[i]);
                    start
                        .iter()
                        .zip(&self.params[i])
                        .map(|(s, p)| s - p)
                        .collect()
                })
            })
            .collect())
    }

    /// Applies the overlapped exchange under way, if any: waits for it (waiting on the
    /// previous island in the ring, as the node's progress says), takes the outer step and
    /// carries what this stage learnt on those tensors since the exchange began onto the new
    /// anchor (`value += anchor − start`). Returns the time waited.
    fn apply_pending(&mut self, step: u64, cfg: &fusion_train::OuterConfig) -> Result<Duration> {
        let Some(pending) = self.overlapped.pending.take() else {
            return Ok(Duration::ZERO);
        };
        // The exchanged round's starts go whatever its outcome: a failed exchange leaves no
        // round to measure from them.
        let starts = std::mem::take(&mut self.overlapped.start);
        let tj = Instant::now();
        self.progress
            .enter(Phase::Waiting, step, 0, &self.ring_from);
        let mean = self.finish(pending);
        self.progress.resume();
        let wait = tj.elapsed();
        self.apply_mean(cfg, mean?)?;
        let outer = self.outer.as_ref().ok_or_else(no_islands)?;
        for ((p, a), s) in self.params.iter_mut().zip(&outer.anchor).zip(starts) {
            if let Some(start) = s {
                for ((p, a), s) in p.iter_mut().zip(a).zip(&start) {
                    *p += a - s;
                }
            }
        }
        Ok(wait)
    }

    /// Runs `exchange` on a thread of its own beside the next inner steps; the stage goes on
    /// from where it is, which the `members`' next delta is measured from. A failed exchange
    /// fails the step then under way at once (its error is returned again at the next
    /// synchronisation).
    fn launch(
        &mut self,
        mut exchange: Exchange,
        members: &[bool],
        mailbox: &Arc<Mailbox>,
        outbox: &Arc<Outbox>,
    ) -> Result<()> {
        // The node's progress is the compute thread's: the exchange's waits beside the next
        // round are not what the stage is doing.
        exchange.ring.progress = None;
        let step = exchange.step;
        let (mb, ob) = (Arc::clone(mailbox), Arc::clone(outbox));
        let thread = std::thread::Builder::new()
            .name(format!("outer-exchange-{step}"))
            .spawn(move || {
                let out = exchange.run(&mb, &ob);
                if let Err(e) = &out {
                    fail_fast(&mb, step, e);
                }
                out
            })
            .map_err(|e| {
                RuntimeError::Protocol(format!("starting the outer exchange's thread: {e}"))
            })?;
        self.overlapped.pending = Some(thread);
        self.overlapped.start = self
            .params
            .iter()
            .zip(members)
            .map(|(p, &m)| m.then(|| p.clone()))
            .collect();
        Ok(())
    }

    /// The exchange of one synchronisation: the weighted deltas of the `members`, ring by
    /// ring ([`Self::member_rings`], their edges from `base` on), with what the rings need.
    fn exchange(
        &mut self,
        step: u64,
        weight: f32,
        codec: Codec,
        (members, base): (&[bool], usize),
        deltas: Vec<Option<Vec<f32>>>,
    ) -> Result<Exchange> {
        let rings = self.member_rings(members);
        let flats = rings
            .iter()
            .map(|ring| {
                let mut flat = Vec::with_capacity(self.ring_len(ring));
                for d in ring.iter().filter_map(|&i| deltas[i].as_ref()) {
                    flat.extend(d.iter().map(|d| d * weight));
                }
                flat
            })
            .collect();
        let sparse = rings.iter().map(|r| self.sparse_ring(r)).collect();
        let encoder = self.outer_encoder.take().ok_or_else(|| {
            RuntimeError::Protocol("an outer synchronisation while another is under way".into())
        })?;
        Ok(Exchange {
            ring: self.ring(Direction::OuterExchange),
            step,
            base,
            lens: self.params.iter().map(Vec::len).collect(),
            rings,
            sparse,
            // Buffers of a top-k job travel exact: a ring cannot add sparse chunks up.
            dense_codec: if self.sparse_outer() {
                Codec::None
            } else {
                codec
            },
            codec,
            flats,
            encoder,
        })
    }

    /// Drops an overlapped exchange of an abandoned placement (island-local recovery: its ring
    /// held the island taken out), whether or not it ended: its round is not applied, and with
    /// every tensor's start back at the anchor the next synchronisation's delta holds that
    /// round's progress too, so nothing an island left learnt is lost. Its thread ends on the
    /// old placement's mailbox; the residuals it held restart (a fresh encoder is returned).
    pub(super) fn abandon_exchange(&mut self, old: Overlapped) -> Option<PseudoGradientEncoder> {
        drop(old.pending);
        self.overlapped = Overlapped::default();
        let codec = self.cfg.outer.as_ref()?.codec;
        tracing::warn!(
            "stage {}: the overlapped exchange under way is dropped with the placement; \
             the next synchronisation carries its round",
            self.stage
        );
        Some(PseudoGradientEncoder::new(codec, 0))
    }

    /// Waits for the overlapped exchange under way and takes back its encoder.
    fn finish(&mut self, pending: Pending) -> Result<Vec<Option<Vec<f32>>>> {
        let (mean, encoder) = pending
            .join()
            .map_err(|_| RuntimeError::Protocol("the outer exchange's thread panicked".into()))??;
        self.outer_encoder = Some(encoder);
        Ok(mean)
    }

    /// The outer step along the averaged deltas `mean` (None: not synchronised now):
    /// trainable parameters through the outer optimizer, buffers to the anchor's minus theirs.
    fn apply_mean(
        &mut self,
        cfg: &fusion_train::OuterConfig,
        mean: Vec<Option<Vec<f32>>>,
    ) -> Result<()> {
        let outer = self.outer.as_mut().ok_or_else(no_islands)?;
        let (mut delta, mut buffers) = (Vec::new(), Vec::new());
        for (i, m) in mean.into_iter().enumerate() {
            match m {
                Some(m) if !self.trainable[i] => {
                    buffers.push(outer.anchor[i].iter().zip(&m).map(|(a, d)| a - d).collect());
                    delta.push(None);
                }
                m => {
                    buffers.push(Vec::new());
                    delta.push(m);
                }
            }
        }
        outer.step(cfg, &delta, &buffers)?;
        Ok(())
    }
}

/// Fails the step under way on this node when an overlapped exchange failed because of a peer
/// or a path, blaming what the exchange blamed (the compute thread would otherwise learn of it
/// only at the next synchronisation). Other failures (a reset: the mailbox is poisoned already)
/// wait for that synchronisation.
fn fail_fast(mailbox: &Mailbox, step: u64, e: &RuntimeError) {
    let why = |reason: &str| format!("the outer exchange of step {step}: {reason}");
    match e {
        RuntimeError::Peer {
            peer,
            reason,
            proven,
        } => mailbox.poison_blaming(why(reason), peer, *proven),
        RuntimeError::PathFailed { peer, reason } => mailbox.poison_path(why(reason), peer),
        _ => {}
    }
}

fn no_islands() -> RuntimeError {
    RuntimeError::Protocol("an outer synchronisation without islands".into())
}

/// What an exchange gives back: the mean delta of every tensor it took (None elsewhere), and
/// the encoder.
type Exchanged = (Vec<Option<Vec<f32>>>, PseudoGradientEncoder);

/// An overlapped exchange under way, on its own thread.
type Pending = std::thread::JoinHandle<Result<Exchanged>>;

/// Islands overlapping their synchronisations: the exchange under way beside the inner steps,
/// and per tensor where this stage began the exchanged round (None: at the anchor; empty: no
/// exchange began).
#[derive(Default)]
pub(crate) struct Overlapped {
    pub(super) pending: Option<Pending>,
    pub(super) start: Vec<Option<Vec<f32>>>,
}

impl Overlapped {
    /// Whether an exchange is under way or a round began off the anchor.
    pub(crate) fn in_progress(&self) -> bool {
        self.pending.is_some() || self.start.iter().any(Option::is_some)
    }
}

/// One round's exchange, owning what it needs so that it can run on a thread of its own.
struct Exchange {
    ring: Ring,
    step: u64,
    /// The first edge id of this synchronisation's rings.
    base: usize,
    /// Values of every local parameter and buffer.
    lens: Vec<usize>,
    /// Local parameter indices of each ring ([`StageWorker::outer_rings`]).
    rings: Vec<Vec<usize>>,
    /// Whether each ring travels as whole top-k messages.
    sparse: Vec<bool>,
    codec: Codec,
    dense_codec: Codec,
    /// Each ring's weighted deltas, laid end to end.
    flats: Vec<Vec<f32>>,
    encoder: PseudoGradientEncoder,
}

impl Exchange {
    /// Sums the islands' weighted deltas over the rings: every parameter's and buffer's mean
    /// delta, and the encoder (its residuals moved on).
    fn run(mut self, mailbox: &Mailbox, outbox: &Outbox) -> Result<Exchanged> {
        let replicas = self.ring.replicas;
        let (sparse, dense): (Vec<usize>, Vec<usize>) =
            (0..self.rings.len()).partition(|&j| self.sparse[j]);
        // Sparse rings all at once: one round trip per ring step, not one per parameter.
        if !sparse.is_empty() {
            let items: Vec<(usize, usize, Vec<f32>)> = sparse
                .iter()
                .map(|&j| {
                    let flat = std::mem::take(&mut self.flats[j]);
                    // The residual is the parameter's (a sparse ring holds one), whichever
                    // ring of this synchronisation carries it.
                    let param = self.rings[j].first().copied().unwrap_or(j);
                    (self.base + j * replicas, param, flat)
                })
                .collect();
            let sums = self.ring.sparse_sums(
                self.step,
                items,
                self.codec,
                &mut self.encoder,
                mailbox,
                outbox,
            )?;
            for (&j, sum) in sparse.iter().zip(sums) {
                self.flats[j] = sum;
            }
        }
        for j in dense {
            let (base, codec) = (self.base + j * replicas, self.dense_codec);
            let flat = &mut self.flats[j];
            self.ring
                .ring_sum(self.step, base, flat, codec, mailbox, outbox)?;
        }
        let mut mean = vec![None; self.lens.len()];
        for (ring, flat) in self.rings.iter().zip(&self.flats) {
            let mut off = 0;
            for &i in ring {
                let n = self.lens[i];
                mean[i] = Some(flat[off..off + n].to_vec());
                off += n;
            }
        }
        Ok((mean, self.encoder))
    }
}
