//! Steps: feeding data, running train and evaluation steps, applying updates.

use super::*;

/// What a training step returns to the broker.
struct StepDone {
    loss: f32,
    norm: f32,
    lr: f32,
    results: Vec<fusion_proto::StepResult>,
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

    /// Runs a step on every node (`active`: whole replicas of `stages` nodes each, stage order)
    /// and returns each node's result, checked against the node's role: a node that answers out
    /// of its role (losses from a stage that has none, a count that is not its micro-batches')
    /// is evicted as faulty.
    pub(super) async fn run_step(
        &mut self,
        active: &[usize],
        stages: usize,
        step: u64,
        mode: RunMode,
        m: usize,
        total: usize,
    ) -> Flow<Vec<fusion_proto::StepResult>> {
        for &i in active {
            self.send(
                i,
                broker_message::Body::Run(RunStep {
                    step,
                    mode: mode as i32,
                    micro_batches: m as u32,
                    total_micro_batches: total as u32,
                }),
            )
            .await?;
        }
        self.gather(
            active,
            "step results",
            Watch::Progress,
            |c, pos, msg| match msg.body {
                Some(node_message::Body::Result(mut r)) if r.step == step => {
                    let last = pos % stages.max(1) == stages.max(1) - 1;
                    c.check_result(active[pos], &mut r, last, m)?;
                    let from = c.members[active[pos]].id.clone();
                    for l in &r.sent {
                        // Only links between members are counted (a node cannot grow the table).
                        if c.members.iter().any(|x| x.id == l.peer) {
                            let e = c.links.entry((from.clone(), l.peer.clone())).or_default();
                            e.0 += l.bytes;
                            e.1 += l.tensors;
                        }
                    }
                    Ok(Some(r))
                }
                _ => Ok(None),
            },
        )
        .await
    }

    /// Checks one node's step result against its role (`last`: the last stage of its replica,
    /// which alone computes losses, one per micro-batch of `m`); clamps its timings.
    fn check_result(
        &mut self,
        member: usize,
        r: &mut fusion_proto::StepResult,
        last: bool,
        m: usize,
    ) -> Flow<()> {
        let want = if last { m } else { 0 };
        if r.losses.len() != want {
            let reason = format!(
                "sent {} losses for step {} where its stage computes {want}",
                r.losses.len(),
                r.step
            );
            return Err(self.eviction(member, reason));
        }
        if !last && !r.predictions.is_empty() {
            let reason = format!("sent predictions for step {} from a middle stage", r.step);
            return Err(self.eviction(member, reason));
        }
        if let Some(bad) = r.losses.iter().find(|l| !l.is_finite()) {
            return Err(self.non_finite(member, r.step, format!("a loss of {bad}")));
        }
        if !r.grad_square_sum.is_finite() || r.grad_square_sum < 0.0 {
            let what = format!("a squared gradient norm of {}", r.grad_square_sum);
            return Err(self.non_finite(member, r.step, what));
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

    /// A node reported a non-finite value at `step`. Either it is faulty (a bad device, a lying
    /// node) or the model diverged, and one report cannot tell: the node is evicted and the step
    /// retried from the snapshot on others; a second node reporting one at the same step means
    /// the run has diverged.
    fn non_finite(&mut self, member: usize, step: u64, what: String) -> Interrupt {
        let node = self.members[member].id.clone();
        match self.diverged_at.take() {
            Some((s, first)) if s == step && first != node => {
                tracing::error!(
                    "step {step}: {node} reported {what} after {first} did: the run diverged"
                );
                Interrupt::from(TrainError::Diverged {
                    step,
                    value: f32::NAN,
                })
            }
            _ => {
                self.diverged_at = Some((step, node));
                let reason = format!(
                    "reported {what} at step {step} (if another node reports one at this step, \
                     the run has diverged)"
                );
                self.eviction(member, reason)
            }
        }
    }

    /// Trains from the broker's copy of the state to the last step, snapshotting as the policy
    /// says; stops early (Reshape) at a step boundary where the membership should change.
    pub(super) async fn train(&mut self, plan: &Plan, layout: &Layout) -> Flow<()> {
        let active = layout.all();
        let first = &layout.replicas[0];
        let cfg = self.job.train.clone();
        // Every replica runs `micro_batches`; a step covers all of them.
        let total = cfg.micro_batches * layout.replicas.len();
        let mut step = self.saved.step;
        let first_step = step;
        let mut position = self.saved.data_position;
        while step < cfg.steps {
            self.reprobe_if_due(plan, layout, step, first_step).await?;
            let t0 = Instant::now();
            let done = self.train_step(plan, layout, step, position).await?;
            step += 1;
            position += total as u64;
            let eval = if step == cfg.steps
                || (cfg.eval_every > 0 && step.is_multiple_of(cfg.eval_every))
            {
                Some(self.evaluate(plan, first, step).await?)
            } else {
                None
            };
            self.record(step, t0, done, eval, total);
            if !self.cfg.test_step_delay.is_zero() {
                tokio::time::sleep(self.cfg.test_step_delay).await;
            }
            if step == cfg.steps {
                self.final_snapshot(plan, first, step, position).await?;
            } else if self.snapshot_due(step, self.history.mean_step_s()) {
                self.snapshot(plan, first, step, position).await?;
            }
            if step < cfg.steps {
                if let Some(why) = self.reshape_due(&active) {
                    // A reshape goes on from the snapshot: without one of this step it waits.
                    if self.saved.step == step || self.snapshot(plan, first, step, position).await?
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
        // Re-adapt to the new figures and the compute the nodes actually measured.
        let m = self.job.train.micro_batches.max(1) as f64;
        let measured = self
            .history
            .timings
            .last()
            .map(|t| t.compute_s.iter().map(|c| c / m).fold(0.0, f64::max));
        self.set_compression(plan, layout, measured).await
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
        let m = cfg.micro_batches;
        let total = m * layout.replicas.len();
        for (r, nodes) in layout.replicas.iter().enumerate() {
            for mb in 0..m {
                let index = position + (r * m + mb) as u64;
                let batch = self
                    .job
                    .data
                    .batch(Split::Train, index, cfg.batch_size, cfg.seq_len)
                    .map_err(RuntimeError::from)?;
                self.feed(plan, nodes, step, mb, batch.into_inputs())
                    .await?;
            }
        }
        let active = layout.all();
        let results = self
            .run_step(
                &active,
                layout.replicas[0].len(),
                step,
                RunMode::Train,
                m,
                total,
            )
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
        // Replicas hold identical all-reduced gradients: count the first one's.
        let stages = layout.replicas[0].len();
        let norm = results[..stages]
            .iter()
            .map(|r| r.grad_square_sum)
            .sum::<f64>()
            .sqrt() as f32;
        let grad_scale = match cfg.clip_norm {
            Some(max) if norm > max && norm.is_finite() => max / (norm + 1e-6),
            _ => 1.0,
        };
        let lr = learning_rate(&cfg.schedule, step, cfg.steps);
        for &i in &active {
            self.send(
                i,
                broker_message::Body::Update(ApplyUpdate {
                    step,
                    lr,
                    grad_scale,
                }),
            )
            .await?;
        }
        Ok(StepDone {
            loss,
            norm,
            lr,
            results,
        })
    }

    /// Records a finished step (and its evaluation) and reports it.
    fn record(
        &mut self,
        step: u64,
        t0: Instant,
        done: StepDone,
        eval: Option<EvalRecord>,
        total: usize,
    ) {
        let cfg = &self.job.train;
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
        self.history.steps.push(rec);
        self.history.evals.extend(eval);
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
            .run_step(active, active.len(), step, RunMode::Eval, n, n)
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
            return Err(match active.last() {
                Some(&last) => self.eviction(last, reason),
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
