//! Steps: feeding data, running train and evaluation steps, applying updates.

use super::*;

/// What a training step returns to the broker.
struct StepDone {
    loss: f32,
    norm: f32,
    lr: f32,
    results: Vec<fusion_proto::StepResult>,
    /// Islands: the outer synchronisation after the step (same order as `results`), if any.
    synced: Vec<fusion_proto::StepResult>,
    /// Micro-batches each node ran (same order as `results`).
    micro_batches: Vec<usize>,
    /// Micro-batches the step read (every replica's).
    total: usize,
}

impl Coordinator<'_> {
    /// Sends one batch's graph inputs of micro-batch `mb` to the stages that read them.
    pub(super) async fn feed(
        &self,
        plan: &Plan,
        active: &[usize],
        step: u64,
        mb: usize,
        inputs: [HostTensor; 2],
    ) -> Flow<()> {
        for (input, value) in self.graph.inputs.iter().zip(inputs) {
            let (dtype, shape, data) = match value {
                HostTensor::Float { data, shape } => (DType::F32, shape, f32_to_bytes(&data)),
                HostTensor::Ids { data, shape } => (
                    DType::I32,
                    shape,
                    data.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ),
            };
            for (s, routes) in plan.stages.iter().enumerate() {
                if routes
                    .inputs
                    .iter()
                    .any(|r| r.tensor == input.0 && r.source == Source::Data)
                {
                    let f = Feed {
                        step,
                        micro_batch: mb as u32,
                        tensor: input.0 as u64,
                        dtype: dtype as i32,
                        shape: shape.iter().map(|&d| d as u64).collect(),
                        data: data.clone().into(),
                    };
                    self.send(active[s], broker_message::Body::Feed(f)).await?;
                }
            }
        }
        Ok(())
    }

    /// Runs a step on every node (`active`: whole replicas, one node per stage in stage order;
    /// `sizes`: each one's micro-batches and what its losses are scaled by) and returns each
    /// node's result, checked against its stage's role in `plan`: a node that answers out of
    /// its role (losses or predictions its stage does not compute, a count that is not its
    /// micro-batches') is evicted as faulty; so is a lone node reporting a non-finite value (see
    /// [`Coordinator::judge_non_finite`]).
    pub(super) async fn run_step(
        &mut self,
        plan: &Plan,
        active: &[usize],
        step: u64,
        mode: RunMode,
        sizes: &[(usize, usize)],
    ) -> Flow<Vec<fusion_proto::StepResult>> {
        debug_assert_eq!(active.len(), sizes.len(), "a step size per node");
        let loss_scale = match (&self.scaler, mode) {
            (Some(s), RunMode::Train) => s.scale,
            _ => 0.0,
        };
        for (&i, &(m, total)) in active.iter().zip(sizes) {
            self.send(
                i,
                broker_message::Body::Run(RunStep {
                    step,
                    mode: mode as i32,
                    micro_batches: m as u32,
                    total_micro_batches: total as u32,
                    loss_scale,
                    overlap: mode == RunMode::OuterSync && self.overlapped.contains(&step),
                    fragment: match mode {
                        RunMode::OuterSync => self.sync_fragment(step),
                        _ => None,
                    },
                }),
            )
            .await?;
        }
        let roles = roles(plan);
        let results = self
            .gather(
                active,
                "step results",
                Watch::Progress,
                |c, pos, msg| match msg.body {
                    Some(node_message::Body::Result(mut r)) if r.step == step => {
                        let role = roles.get(pos % roles.len().max(1)).copied();
                        // A synchronisation's counts are weights: it computes no losses.
                        let m = match mode {
                            RunMode::OuterSync => 0,
                            _ => sizes.get(pos).map_or(0, |s| s.0),
                        };
                        c.check_result(active[pos], &mut r, role.unwrap_or_default(), m)?;
                        c.count_links(active[pos], &r.sent);
                        Ok(Some(r))
                    }
                    _ => Ok(None),
                },
            )
            .await?;
        // An f16 step's gradients may overflow at its loss scale: not a fault while the scale
        // can still fall (`train_step` skips the step).
        let overflow_ok = loss_scale > 1.0;
        self.judge_non_finite(active, &results, step, overflow_ok)?;
        Ok(results)
    }

    /// Adds a node's reported bytes per link, for links between members only (a node cannot
    /// grow the table).
    /// Islands: bytes between nodes of one stage are outer exchanges (islands' pipelines send
    /// nothing to other islands), whichever step's result reports them (an overlapped exchange
    /// sends beside later steps).
    fn count_links(&mut self, member: usize, sent: &[fusion_proto::LinkBytes]) {
        let from = self.members[member].id.clone();
        let stage_of = |node: &str| {
            self.placement
                .iter()
                .find(|p| p.node == node)
                .map(|p| p.stage)
        };
        if self.islands() {
            let own = stage_of(&from);
            self.outer.sent_bytes += sent
                .iter()
                .filter(|l| own.is_some() && stage_of(&l.peer) == own)
                .map(|l| l.bytes)
                .sum::<u64>();
        }
        for l in sent {
            if self.members.iter().any(|x| x.id == l.peer) {
                let e = self
                    .links
                    .entry((from.clone(), l.peer.clone()))
                    .or_default();
                e.0 += l.bytes;
                e.1 += l.tensors;
            }
        }
    }

    /// Checks one node's step result against its stage's `role` (one loss per micro-batch of
    /// `m` from the stage computing the loss, predictions only from the one computing the
    /// logits); clamps its timings.
    fn check_result(
        &mut self,
        member: usize,
        r: &mut fusion_proto::StepResult,
        role: Role,
        m: usize,
    ) -> Flow<()> {
        let want = if role.loss { m } else { 0 };
        if r.losses.len() != want {
            let reason = format!(
                "sent {} losses for step {} where its stage computes {want}",
                r.losses.len(),
                r.step
            );
            return Err(self.eviction(member, reason));
        }
        if !role.predictions && !r.predictions.is_empty() {
            let reason = format!(
                "sent predictions for step {} from a stage that computes none",
                r.step
            );
            return Err(self.eviction(member, reason));
        }
        let clamp = |s: f64| {
            if s.is_finite() {
                s.clamp(0.0, 1e6)
            } else {
                0.0
            }
        };
        r.compute_seconds = clamp(r.compute_seconds);
        r.wait_seconds = clamp(r.wait_seconds);
        Ok(())
    }

    /// Non-finite losses or gradient norms in a step's results. A model that diverges makes
    /// every stage report one (NaN flows backward through the whole pipeline), a faulty or lying
    /// node only itself: a lone reporter among several nodes is evicted and the step retried
    /// from the snapshot on others; two reporters, every node, or a second report at a step
    /// already retried for one, mean the run diverged. With `overflow_ok` (an f16 step whose
    /// loss scale can still fall) an infinite or NaN gradient norm is an overflow, not a fault.
    fn judge_non_finite(
        &mut self,
        active: &[usize],
        results: &[fusion_proto::StepResult],
        step: u64,
        overflow_ok: bool,
    ) -> Flow<()> {
        let bad: Vec<usize> = results
            .iter()
            .enumerate()
            .filter(|(_, r)| {
                r.losses.iter().any(|l| !l.is_finite())
                    || (!r.grad_square_sum.is_finite() && !overflow_ok)
                    || r.grad_square_sum < 0.0
            })
            .map(|(pos, _)| pos)
            .collect();
        let Some(&first) = bad.first() else {
            return Ok(());
        };
        let names: Vec<&str> = bad
            .iter()
            .map(|&p| self.members[active[p]].id.as_str())
            .collect();
        if bad.len() >= 2 || bad.len() == active.len() || self.diverged_at == Some(step) {
            tracing::error!(
                "step {step}: non-finite losses or gradients from {}: the run diverged",
                names.join(", ")
            );
            return Err(Interrupt::from(TrainError::Diverged {
                step,
                value: f32::NAN,
            }));
        }
        self.diverged_at = Some(step);
        let r = &results[first];
        let reason = format!(
            "reported a non-finite loss or gradient norm at step {step} (losses {:?}, squared \
             gradient norm {}) while the other nodes' were finite",
            r.losses, r.grad_square_sum
        );
        Err(self.eviction(active[first], reason))
    }

    /// Trains from the broker's copy of the state to the last step, snapshotting as the policy
    /// says; stops early (Reshape) at a step boundary where the membership should change.
    pub(super) async fn train(&mut self, plan: &Plan, layout: &Layout) -> Flow<()> {
        let active = layout.all();
        let first = &layout.replicas[0];
        let cfg = self.job.train.clone();
        // After an island-local recovery: the interrupted step, else the last snapshot (with
        // the loss scale it was taken at: the steps after it run again as they ran first).
        let at = match self.resume_at.take() {
            Some(at) => at,
            None => {
                self.restore_scaler();
                island_loss::Resumable {
                    step: self.latest().step,
                    position: self.latest().data_position,
                }
            }
        };
        let (mut step, mut position) = (at.step, at.position);
        let first_step = step;
        let mut evaluated = step;
        while step < cfg.steps {
            self.reprobe_if_due(plan, layout, step, first_step).await?;
            let eval_due =
                cfg.eval_every > 0 && (step + 1) / cfg.eval_every > evaluated / cfg.eval_every;
            self.plan_sync(step, eval_due);
            let t0 = Instant::now();
            let done = self.train_step(plan, layout, step, position).await?;
            if step > first_step {
                // The first step of a placement warms up: not a measure of the others.
                self.note_train_step(t0.elapsed().as_secs_f64());
                self.note_island_rates(&done.results);
            }
            // Streaming: shares change only where every fragment's round ends, so each
            // fragment's round runs one set of them and its weight is its share.
            if self.sync_after(step) && step + 1 < cfg.steps && !self.partial.contains(&step) {
                self.rebalance_if_due(step);
            }
            step += 1;
            // Every replica runs `micro_batches` (islands: their shares); a step reads them all.
            position += done.total as u64;
            // Islands: only a synchronised state is evaluated, snapshotted or reshaped.
            let synced = self.synchronised(step);
            let due = cfg.eval_every > 0 && step / cfg.eval_every > evaluated / cfg.eval_every;
            let eval = if step == cfg.steps || (synced && due) {
                evaluated = step;
                Some(self.evaluate(plan, first, step).await?)
            } else {
                None
            };
            self.record(step, t0, done, eval, layout);
            // The state after this step (update, synchronisation and record done) is
            // resumable, but for the last one's: the run ends with its final snapshot.
            self.resumable =
                (step < cfg.steps).then_some(island_loss::Resumable { step, position });
            if step == first_step + claims::CHECK_AFTER_STEPS {
                self.check_claims(plan, layout);
            }
            if !self.cfg.test_step_delay.is_zero() {
                tokio::time::sleep(self.cfg.test_step_delay).await;
            }
            self.advance_sharded(layout).await?;
            if step == cfg.steps {
                self.final_snapshot(plan, layout, step, position).await?;
            } else if synced && self.snapshot_due(step, self.history.mean_step_s()) {
                self.snapshot(plan, layout, step, position, false).await?;
            }
            if step < cfg.steps && synced {
                // With islands taken out, the placement is not the planned one: re-form the
                // islands when the members can, and no straggler check until then.
                let why = match layout.replicas.len() < self.job.replicas {
                    true => self
                        .reform_due(layout)
                        .or_else(|| self.reshape_due(&active)),
                    false => self
                        .reshape_due(&active)
                        .or_else(|| self.straggler_due(layout, first_step)),
                };
                if let Some(why) = why {
                    // A reshape goes on from the snapshot: without one of this step it waits.
                    if self.latest().step == step
                        || self.snapshot(plan, layout, step, position, true).await?
                    {
                        return Err(Interrupt::Reshape(why));
                    }
                }
            }
        }
        self.finish_checkpoint_write().await;
        Ok(())
    }

    /// Re-measures the placement's links every `probe.every_steps` and re-adapts compression.
    async fn reprobe_if_due(
        &mut self,
        plan: &Plan,
        layout: &Layout,
        step: u64,
        first_step: u64,
    ) -> Flow<()> {
        let every = self.job.probe.every_steps;
        if !self.job.probe.enabled
            || every == 0
            || step == first_step
            || !step.is_multiple_of(every)
        {
            return Ok(());
        }
        let active = layout.all();
        let pairs = used_links(plan, layout, &active);
        self.probe_links(&active, &pairs).await?;
        // The links that are not dialled directly, again over their paths.
        self.probe_paths(&active, &pairs, true).await?;
        // Re-adapt to the new figures and the compute the nodes actually measured.
        let m = self.job.train.micro_batches.max(1);
        let measured = self.history.timings.last().map(|t| {
            t.compute_at(m)
                .iter()
                .map(|c| c / m as f64)
                .fold(0.0, f64::max)
        });
        self.set_compression(plan, layout, measured).await
    }

    /// Feeds a training step: replica `r` reads its `shares[r]` micro-batches after the ones of
    /// the replicas before it, from `position` on.
    async fn feed_train(
        &self,
        plan: &Plan,
        layout: &Layout,
        step: u64,
        position: u64,
        shares: &[usize],
    ) -> Flow<()> {
        let cfg = &self.job.train;
        let mut first = position;
        for (nodes, &m) in layout.replicas.iter().zip(shares) {
            for mb in 0..m {
                let batch = self
                    .job
                    .data
                    .batch(Split::Train, first + mb as u64, cfg.batch_size, cfg.seq_len)
                    .map_err(RuntimeError::from)?;
                self.feed(plan, nodes, step, mb, batch.into_inputs())
                    .await?;
            }
            first += m as u64;
        }
        Ok(())
    }

    /// One training step on every replica: feed, run, check the loss, clip and update.
    async fn train_step(
        &mut self,
        plan: &Plan,
        layout: &Layout,
        step: u64,
        position: u64,
    ) -> Flow<StepDone> {
        let cfg = self.job.train.clone();
        let shares = self.shares(layout.replicas.len());
        let total: usize = shares.iter().sum();
        self.skipped_updates.remove(&step);
        // Until an update is sent, an island's loss can stay local (`island_loss.rs`).
        self.resumable = Some(island_loss::Resumable { step, position });
        self.feed_train(plan, layout, step, position, &shares)
            .await?;
        let active = layout.all();
        let stages = layout.replicas[0].len();
        // Islands apply their own gradients: each averages over its own micro-batches.
        let islands = self.islands();
        let sizes: Vec<(usize, usize)> = shares
            .iter()
            .flat_map(|&m| std::iter::repeat_n((m, if islands { m } else { total }), stages))
            .collect();
        let results = self
            .run_step(plan, &active, step, RunMode::Train, &sizes)
            .await?;
        let losses: Vec<f32> = results
            .iter()
            .flat_map(|r| r.losses.iter().copied())
            .collect();
        if losses.len() != total {
            return Err(Interrupt::from(RuntimeError::Protocol(format!(
                "{} losses for {total} micro-batches",
                losses.len()
            ))));
        }
        let loss = losses.iter().sum::<f32>() / total as f32;
        if !loss.is_finite() {
            return Err(Interrupt::from(TrainError::Diverged { step, value: loss }));
        }
        let verdict = self.judge_scale(&results, step);
        if verdict == Verdict::Skip {
            self.skipped_updates.insert(step);
        }
        let used = match verdict {
            Verdict::Apply { scale } => scale,
            Verdict::Skip => f32::INFINITY,
        };
        // Replicas hold identical all-reduced gradients: count the first one's (replicas that
        // shard the optimizer state each hold their chunk's: count them all). Islands apply
        // their own, each clipped by its own norm (the step reports their mean). The nodes'
        // figures are of gradients times the loss scale (f16); a skipped step's norm is 0.
        let per_norm = if self.optimizer_sharded(layout) {
            results.len()
        } else {
            stages
        };
        let norms: Vec<f32> = results
            .chunks(per_norm)
            .map(|r| r.iter().map(|r| r.grad_square_sum).sum::<f64>().sqrt() as f32 / used)
            .map(|n| if n.is_finite() { n } else { 0.0 })
            .collect();
        let scale = |norm: f32| match cfg.clip_norm {
            Some(max) if norm > max && norm.is_finite() => max / (norm + 1e-6),
            _ => 1.0,
        };
        let norm = if islands {
            norms.iter().sum::<f32>() / norms.len() as f32
        } else {
            norms[0]
        };
        let lr = learning_rate(&cfg.schedule, step, cfg.steps);
        self.resumable = None;
        for (pos, &i) in active.iter().enumerate() {
            let own = if islands { norms[pos / stages] } else { norm };
            let update = ApplyUpdate {
                step,
                lr,
                grad_scale: scale(own),
                skip: verdict == Verdict::Skip,
            };
            self.send(i, broker_message::Body::Update(update)).await?;
        }
        let mut synced = Vec::new();
        if self.sync_after(step) {
            // Each island's pseudo-gradient weighs its share of the round's micro-batches.
            let weights: Vec<(usize, usize)> = sizes.iter().map(|&(m, _)| (m, total)).collect();
            let t0 = Instant::now();
            synced = self
                .run_step(plan, &active, step, RunMode::OuterSync, &weights)
                .await?;
            if !self.overlapped.contains(&step) && !self.partial.contains(&step) {
                self.blocking_sync_s = Some(t0.elapsed().as_secs_f64());
            }
            self.note_sync(step, &synced, layout.replicas.len());
        }
        Ok(StepDone {
            loss,
            norm,
            lr,
            results,
            synced,
            micro_batches: sizes.iter().map(|s| s.0).collect(),
            total,
        })
    }

    /// Optimizer updates every node applied in steps `from..to`: one per step, but none in an
    /// f16 step skipped for overflow.
    pub(super) fn updates_between(&self, from: u64, to: u64) -> u64 {
        let skipped = self.skipped_updates.range(from..to.max(from)).count() as u64;
        to.saturating_sub(from) - skipped
    }

    /// f16 jobs: back to the loss scaler of the snapshot training resumes from.
    fn restore_scaler(&mut self) {
        if self.scaler.is_none() {
            return;
        }
        let saved = match &self.sharded {
            Some(s) => s.loss_scale.clone(),
            None => self.saved_scaler.clone(),
        };
        if let Some(saved) = saved {
            if self.scaler.as_ref() != Some(&saved) {
                tracing::info!(
                    "back to the snapshot's loss scale {} (was {})",
                    saved.scale,
                    self.scaler.as_ref().map_or(0.0, |s| s.scale)
                );
            }
            self.scaler = Some(saved);
        }
    }

    /// f16 jobs: whether every node's gradients of `step` were finite at the loss scale it
    /// used, which moves the scale for the next step. Any overflow skips the step everywhere
    /// (replicas share their gradients; islands keep one scale). Other jobs always apply.
    fn judge_scale(&mut self, results: &[fusion_proto::StepResult], step: u64) -> Verdict {
        let Some(scaler) = &mut self.scaler else {
            return Verdict::Apply { scale: 1.0 };
        };
        let used = scaler.scale;
        let finite = results.iter().all(|r| r.grad_square_sum.is_finite());
        let verdict = scaler.judge(finite);
        if verdict == Verdict::Skip {
            tracing::warn!(
                "step {step}: gradients overflowed f16 at loss scale {used}; the step is skipped \
                 and the scale halved to {}",
                scaler.scale
            );
        }
        verdict
    }

    /// Records a finished step (and its evaluation) and reports it.
    fn record(
        &mut self,
        step: u64,
        t0: Instant,
        done: StepDone,
        eval: Option<EvalRecord>,
        layout: &Layout,
    ) {
        let cfg = &self.job.train;
        let total = done.total;
        let per_step = match self.job.data.kind() {
            DataKind::Text { .. } => cfg.batch_size * cfg.seq_len * total,
            DataKind::Images { .. } => cfg.batch_size * total,
        } as f64;
        let wall = t0.elapsed().as_secs_f64();
        self.history.timings.push(StepTiming {
            step,
            wall_s: wall,
            compute_s: done.results.iter().map(|r| r.compute_seconds).collect(),
            wait_s: done.results.iter().map(|r| r.wait_seconds).collect(),
            micro_batches: done.micro_batches.clone(),
            read: total,
        });
        let rec = StepRecord {
            step,
            loss: done.loss,
            lr: done.lr,
            grad_norm: done.norm,
            elapsed_s: self.history.start.elapsed().as_secs_f64(),
            throughput: per_step / wall.max(1e-9),
        };
        (self.on_event)(BrokerEvent::Step(&rec, eval.as_ref()));
        let detail = self.step_detail(step, wall, &done, layout);
        (self.on_event)(BrokerEvent::StepDetail(&detail));
        self.history.steps.push(rec);
        self.history.evals.extend(eval);
    }

    /// Per node and per link, what the step cost, its outer synchronisation included (results
    /// in `layout.all()` order).
    fn step_detail(&self, step: u64, wall_s: f64, done: &StepDone, layout: &Layout) -> StepDetail {
        let mut nodes = Vec::new();
        let mut links = Vec::new();
        let places = layout
            .replicas
            .iter()
            .enumerate()
            .flat_map(|(replica, stages)| {
                stages
                    .iter()
                    .enumerate()
                    .map(move |(stage, &m)| (replica, stage, m))
            });
        let none = fusion_proto::StepResult::default();
        let synced = done.synced.iter().chain(std::iter::repeat(&none));
        for (((replica, stage, m), r), sync) in places.zip(&done.results).zip(synced) {
            let member = &self.members[m];
            nodes.push(NodeStep {
                node: member.id.clone(),
                stage,
                replica,
                compute_s: r.compute_seconds,
                wait_s: r.wait_seconds,
                peak_memory_bytes: r.peak_memory_bytes,
                heartbeat_age_s: member.live.silent_for().as_secs_f64(),
            });
            // Peers that are members only: a node cannot add rows (or metric labels).
            let known = |l: &&fusion_proto::LinkBytes| self.members.iter().any(|x| x.id == l.peer);
            let sent = r.sent.iter().chain(&sync.sent);
            links.extend(sent.filter(known).map(|l| LinkStep {
                from: member.id.clone(),
                to: l.peer.clone(),
                bytes: l.bytes,
            }));
        }
        StepDetail {
            step,
            wall_s,
            nodes,
            links,
            snapshot_step: self.latest().step,
        }
    }

    pub(super) async fn evaluate(
        &mut self,
        plan: &Plan,
        active: &[usize],
        step: u64,
    ) -> Flow<EvalRecord> {
        let cfg = self.job.train.clone();
        let n = cfg
            .eval_batches
            .unwrap_or(usize::MAX)
            .min(self.job.data.eval_batches(cfg.batch_size))
            .max(1);
        let mut targets = Vec::new();
        for i in 0..n {
            let batch = self
                .job
                .data
                .batch(Split::Eval, i as u64, cfg.batch_size, cfg.seq_len)
                .map_err(RuntimeError::from)?;
            targets.extend_from_slice(batch.targets());
            self.feed(plan, active, step, i, batch.into_inputs())
                .await?;
        }
        let results = self
            .run_step(
                plan,
                active,
                step,
                RunMode::Eval,
                &vec![(n, n); active.len()],
            )
            .await?;
        let losses: Vec<f32> = results
            .iter()
            .flat_map(|r| r.losses.iter().copied())
            .collect();
        let predictions: Vec<u32> = results
            .iter()
            .flat_map(|r| r.predictions.iter().copied())
            .collect();
        if losses.len() != n || predictions.len() != targets.len() {
            // Only the last stage answers with losses and predictions.
            let reason = format!(
                "returned {} losses and {} predictions for {n} evaluation batches and {} targets",
                losses.len(),
                predictions.len(),
                targets.len()
            );
            // Every node answered within its role: the one computing the logits miscounted.
            let stage = roles(plan).iter().position(|r| r.predictions);
            return Err(match stage.and_then(|s| active.get(s)) {
                Some(&node) => self.eviction(node, reason),
                None => Interrupt::from(RuntimeError::Protocol(reason)),
            });
        }
        let loss = losses.iter().map(|&l| l as f64).sum::<f64>() / n as f64;
        let correct = predictions
            .iter()
            .zip(&targets)
            .filter(|(p, t)| p == t)
            .count();
        Ok(EvalRecord {
            step,
            loss: loss as f32,
            accuracy: correct as f32 / targets.len().max(1) as f32,
        })
    }
}

/// What a stage reports in its step results.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Role {
    /// It computes the loss (graph output 0): one per micro-batch.
    loss: bool,
    /// It computes the logits (graph output 1): predictions in evaluation.
    predictions: bool,
}

/// Every stage's role, from the graph outputs its routes produce.
pub(super) fn roles(plan: &Plan) -> Vec<Role> {
    plan.stages
        .iter()
        .map(|r| Role {
            loss: r.outputs.iter().any(|o| o.graph_output == Some(0)),
            predictions: r.outputs.iter().any(|o| o.graph_output == Some(1)),
        })
        .collect()
}
