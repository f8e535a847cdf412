//! Snapshots of the training state: when to take one (a pure policy), gathering it from the nodes
//! that hold it, and writing checkpoints to disk on a blocking thread, off the coordinator's path.

use super::shard_snapshot::{background_cost, InFlight};
use super::store::{GatherError, Gathered, Stored};
use super::*;

/// Steps a snapshot waits at least after one the broker could not write.
const FAILED_BACKOFF: u64 = 5;

/// How often the broker tries again to write the final snapshot.
const FINAL_RETRY: Duration = Duration::from_secs(5);

/// When the broker refreshes its copy of the state. A lost node costs the steps since the last
/// snapshot; a snapshot costs the time to gather it from the nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SnapshotPolicy {
    /// Fixed interval in steps (0: adaptive).
    pub every_steps: u64,
    /// Adaptive: the largest share of training time snapshots may take.
    pub max_share: f64,
    /// Adaptive: never more steps apart than this.
    pub max_interval: u64,
    /// Snapshots stay on the nodes (each stage's shard on its node's disk and a buddy's, the
    /// broker writing a manifest) instead of streaming to the broker; checkpoints the user asked
    /// for and the final state are still gathered into single-file checkpoints.
    pub sharded: bool,
}

impl Default for SnapshotPolicy {
    fn default() -> Self {
        SnapshotPolicy {
            every_steps: 0,
            max_share: 0.05,
            max_interval: 1000,
            sharded: false,
        }
    }
}

impl SnapshotPolicy {
    /// Steps between snapshots: the fixed interval, or the fewest that keep the last snapshot's
    /// cost (`cost_s`) under `max_share` of the steps' time (`step_s` each). Without figures yet,
    /// every step (the first snapshot measures the cost).
    pub fn interval(&self, cost_s: Option<f64>, step_s: Option<f64>) -> u64 {
        if self.every_steps > 0 {
            return self.every_steps;
        }
        match (cost_s, step_s) {
            (Some(c), Some(t)) if c.is_finite() && t.is_finite() && t > 0.0 => {
                let k = (c / (self.max_share * t)).ceil();
                (k.max(1.0) as u64).min(self.max_interval.max(1))
            }
            _ => 1,
        }
    }
}

/// Snapshot bookkeeping of a run.
#[derive(Default)]
pub(super) struct Snapshots {
    pub policy: SnapshotPolicy,
    /// Seconds the last gather took.
    pub last_cost_s: Option<f64>,
    pub taken: u64,
    pub total_s: f64,
    /// The checkpoint being written, on a blocking thread.
    pub writing: Option<tokio::task::JoinHandle<std::result::Result<PathBuf, String>>>,
    /// Checkpoint writes that failed (the run went on with its snapshot).
    pub write_failures: Vec<String>,
    /// Snapshots the broker could not take (the run went on with the one before).
    pub failures: Vec<String>,
    /// Of `taken`, the sharded ones, the seconds they were in flight and the seconds the
    /// pipeline paused for them.
    pub sharded_taken: u64,
    pub sharded_total_s: f64,
    pub sharded_pause_s: f64,
    /// The sharded snapshot being written and copied beside training.
    pub in_flight: Option<InFlight>,
    /// Training steps taken with no snapshot in flight: count and seconds.
    pub quiet_steps: (u64, f64),
    /// The step of the last snapshot the broker could not write, until one succeeds.
    pub failed_at: Option<u64>,
    /// Writers that accept no connections were told once that their shards have no copy.
    pub warned_unbuddied: bool,
}

impl Snapshots {
    /// Records a sharded snapshot made beside training: the adaptive interval spaces them by
    /// their pause and the slowdown of the steps beside them.
    pub fn count_sharded(&mut self, f: &InFlight, in_flight_s: f64) {
        let quiet =
            (self.quiet_steps.0 > 0).then(|| self.quiet_steps.1 / self.quiet_steps.0 as f64);
        let cost = background_cost(f.pause_s, f.busy_steps, quiet, in_flight_s);
        if self.policy.sharded || self.last_cost_s.is_none() {
            self.last_cost_s = Some(cost);
        }
        self.sharded_taken += 1;
        self.sharded_total_s += in_flight_s;
        self.sharded_pause_s += f.pause_s;
        self.taken += 1;
        self.total_s += cost;
        self.failed_at = None;
        tracing::debug!("sharded snapshot at step {} cost {cost:.3} s", f.step);
    }
}

/// What the report says of the run's snapshots.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SnapshotStats {
    pub taken: u64,
    pub mean_seconds: f64,
    /// Of those, the sharded snapshots (kept on the nodes); the mean time from the pause until
    /// every shard was written and copied (training went on meanwhile), and the mean pause.
    pub sharded: u64,
    pub sharded_mean_seconds: f64,
    pub sharded_pause_mean_seconds: f64,
    /// The interval in force at the end, in steps.
    pub interval_steps: u64,
    pub checkpoint_write_failures: Vec<String>,
    pub snapshot_failures: Vec<String>,
}

impl Coordinator<'_> {
    /// Whether a snapshot is due after `step` (steps counted from 1): the policy's interval since
    /// the last one, a disk checkpoint due, or the last step.
    pub(super) fn snapshot_due(&self, step: u64, step_s: Option<f64>) -> bool {
        let cfg = &self.job.train;
        // Islands that overlap their synchronisations, or stream them by fragments, block one
        // of the whole model for a snapshot: its cost too.
        let overlap = cfg
            .outer
            .as_ref()
            .is_some_and(|o| o.overlap || o.fragments > 1)
            && self.islands();
        let blocking = if overlap { self.blocking_sync_s } else { None };
        let cost = self
            .snapshots
            .last_cost_s
            .map(|c| c + blocking.unwrap_or(0.0));
        let interval = self.snapshots.policy.interval(cost, step_s);
        // After a snapshot the broker could not write, the next try waits at least an interval
        // (and FAILED_BACKOFF steps): every try costs the nodes a transfer of the whole state.
        if let Some(failed) = self.snapshots.failed_at {
            if step.saturating_sub(failed) < interval.max(FAILED_BACKOFF) {
                return false;
            }
        }
        step == cfg.steps
            || step.saturating_sub(self.latest().step) >= interval
            || self.checkpoint_due(step)
    }

    fn checkpoint_due(&self, step: u64) -> bool {
        let cfg = &self.job.train;
        let every = cfg.checkpoint_every;
        // Islands are snapshotted only right after a synchronisation, every H steps (streaming:
        // a synchronisation point every H / fragments): the first one at or after each
        // multiple of `every`.
        let crossed = match &cfg.outer {
            Some(o) if self.islands() => {
                let period = (o.every / u64::from(o.fragments.max(1))).max(1);
                step / every.max(1) > step.saturating_sub(period) / every.max(1)
            }
            _ => step.is_multiple_of(every.max(1)),
        };
        cfg.checkpoint_dir.is_some() && (step == cfg.steps || (every > 0 && crossed))
    }

    /// The snapshot of the last step, which the run cannot end without: while the broker cannot
    /// write it (a full disk), the nodes keep the state and the broker tries again, every
    /// `FINAL_RETRY` for at most `cfg.final_snapshot_patience`, saying what to free.
    pub(super) async fn final_snapshot(
        &mut self,
        plan: &Plan,
        layout: &Layout,
        step: u64,
        position: u64,
    ) -> Flow<()> {
        let since = Instant::now();
        while !self.gathered_snapshot(plan, layout, step, position).await? {
            if since.elapsed() >= self.cfg.final_snapshot_patience {
                let why = self.snapshots.failures.last().cloned().unwrap_or_default();
                return Err(RuntimeError::FinalStateUnsaved {
                    seconds: self.cfg.final_snapshot_patience.as_secs(),
                    why,
                }
                .into());
            }
            tracing::warn!(
                "the final state of step {step} is held by the nodes until the broker can write \
                 it to {}: free space there; trying again in {FINAL_RETRY:?}",
                self.state_dir.path().display()
            );
            tokio::time::sleep(FINAL_RETRY).await;
        }
        Ok(())
    }

    /// Takes a snapshot after `step`: sharded on the nodes when the policy says so and no
    /// checkpoint is due, else gathered into the broker's state file. A sharded one is begun and
    /// made beside the next steps; with `wait` it is finished first (a change of placement goes
    /// on from it), else one still in flight makes this one wait for a later step. false: not
    /// taken (the run goes on from the one before).
    pub(super) async fn snapshot(
        &mut self,
        plan: &Plan,
        layout: &Layout,
        step: u64,
        position: u64,
        wait: bool,
    ) -> Flow<bool> {
        // (Islands take gathered snapshots: the policy is never sharded for them; nor for a
        // placement whose replicas shard their optimizer state, whose pieces are gathered.)
        if self.snapshots.policy.sharded
            && !self.optimizer_sharded(layout)
            && !self.checkpoint_due(step)
        {
            if self.snapshots.in_flight.is_some() {
                if !wait {
                    return Ok(false);
                }
                self.finish_sharded(layout).await?;
            }
            if self.latest().step != step
                && !self.begin_sharded(plan, layout, step, position).await?
            {
                return Ok(false);
            }
            if wait {
                self.finish_sharded(layout).await?;
                return Ok(self.latest().step == step);
            }
            return Ok(true);
        }
        self.gathered_snapshot(plan, layout, step, position).await
    }

    /// Records a snapshot of `step` that was not taken (`line` says why): reported, and the next
    /// try waits; false.
    pub(super) fn not_taken(&mut self, step: u64, line: String) -> bool {
        tracing::warn!(
            "{line}; training goes on from the snapshot of step {}",
            self.latest().step
        );
        (self.on_event)(BrokerEvent::CheckpointFailed { reason: &line });
        self.snapshots.failures.push(line);
        self.snapshots.failed_at = Some(step);
        false
    }

    /// Records the cost of a gathered snapshot of `step` begun at `t0`. With sharded snapshots
    /// a gathered checkpoint is not what the adaptive interval spaces.
    fn count_snapshot(&mut self, step: u64, t0: Instant) {
        let cost = t0.elapsed().as_secs_f64();
        let s = &mut self.snapshots;
        if !s.policy.sharded || s.last_cost_s.is_none() {
            s.last_cost_s = Some(cost);
        }
        s.taken += 1;
        s.total_s += cost;
        tracing::debug!("snapshot at step {step} took {cost:.3} s");
    }

    /// Gathers the state after `step` from the first replica's stages (islands: and every
    /// island's optimizer moments) into a new state file, makes it the broker's copy (what a
    /// recovery rolls back to) and starts writing a checkpoint when one is due. A snapshot the
    /// broker cannot write (a full disk) is skipped, with a warning, and the run goes on with
    /// the last one: false.
    async fn gathered_snapshot(
        &mut self,
        plan: &Plan,
        layout: &Layout,
        step: u64,
        position: u64,
    ) -> Flow<bool> {
        let t0 = Instant::now();
        let state = match self.collect_state(plan, layout, step, position).await? {
            Ok(state) => state,
            Err(why) => {
                let line = format!("the snapshot of step {step} was not taken: {why}");
                return Ok(self.not_taken(step, line));
            }
        };
        let stall = std::mem::take(&mut self.cfg.test_snapshot_stall);
        if !stall.is_zero() {
            // Test hook: the coordinator stalls once, as a slow serialisation would.
            std::thread::sleep(stall);
        }
        self.saved = Arc::new(state);
        self.saved_scaler = self.scaler.clone();
        self.sharded = None;
        self.snapshots.in_flight = None;
        self.snapshots.failed_at = None;
        self.count_snapshot(step, t0);
        if self.checkpoint_due(step) {
            self.start_checkpoint_write().await;
        }
        Ok(true)
    }

    /// Writes the broker's copy to the checkpoint directory on a blocking thread. A write still
    /// running is waited for first, so at most one is in flight.
    async fn start_checkpoint_write(&mut self) {
        self.finish_checkpoint_write().await;
        let Some(dir) = self.job.train.checkpoint_dir.clone() else {
            return;
        };
        let cfg = self.job.train.clone();
        let saved = self.saved.clone();
        let ck = CheckpointState {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            model: self.job.model.name.clone(),
            model_signature: model_signature(&self.graph),
            step: saved.step,
            data_position: saved.data_position,
            optimizer: cfg.optimizer.clone(),
            optimizer_step: saved.opt_step,
            config: cfg,
            tensors_sha256: String::new(),
            run_id: Some(self.run_id.clone()),
            model_spec: Some(self.job.model.clone()),
            loss_scale: self.scaler.clone(),
        };
        // The snapshot's file is complete and never written again: the checkpoint links it.
        self.snapshots.writing = Some(tokio::task::spawn_blocking(move || {
            fusion_train::save_checkpoint_from_file(&dir, saved.path(), ck).map_err(|e| {
                format!(
                    "writing the checkpoint of step {} to {}: {e}",
                    saved.step,
                    dir.display()
                )
            })
        }));
    }

    /// Waits for the checkpoint being written; a failed write is reported and the run goes on.
    pub(super) async fn finish_checkpoint_write(&mut self) {
        let Some(handle) = self.snapshots.writing.take() else {
            return;
        };
        let result = handle
            .await
            .unwrap_or_else(|e| Err(format!("the checkpoint writer failed: {e}")));
        match result {
            Ok(path) => tracing::info!("checkpoint written: {}", path.display()),
            Err(e) => {
                tracing::warn!("{e}; training goes on with the snapshot it has");
                (self.on_event)(BrokerEvent::CheckpointFailed { reason: &e });
                self.snapshots.write_failures.push(e);
            }
        }
    }

    pub(super) fn snapshot_stats(&self, step_s: Option<f64>) -> SnapshotStats {
        let s = &self.snapshots;
        SnapshotStats {
            taken: s.taken,
            mean_seconds: s.total_s / s.taken.max(1) as f64,
            sharded: s.sharded_taken,
            sharded_mean_seconds: s.sharded_total_s / s.sharded_taken.max(1) as f64,
            sharded_pause_mean_seconds: s.sharded_pause_s / s.sharded_taken.max(1) as f64,
            interval_steps: s.policy.interval(s.last_cost_s, step_s),
            checkpoint_write_failures: s.write_failures.clone(),
            snapshot_failures: s.failures.clone(),
        }
    }

    /// Sends member `me` the saved value and moments of `params` (and to island `island` its own
    /// optimizer moments and the outer momentum, where the snapshot holds them), piece by piece
    /// from disk.
    pub(super) async fn ship_state(
        &self,
        me: usize,
        island: usize,
        params: impl Iterator<Item = usize>,
    ) -> Flow<()> {
        let saved = self.saved.clone();
        // Islands continue their outer momentum and moments where the snapshot kept them;
        // replicas without islands all take island 0's (the same optimizer state everywhere).
        let outer = self.islands().then_some(ParamPart::OuterMomentum);
        let island = if self.islands() { island } else { 0 };
        for p in params {
            let parts = [
                ParamPart::Value,
                ParamPart::FirstMoment,
                ParamPart::SecondMoment,
            ];
            for part in parts.into_iter().chain(outer) {
                for piece in saved.pieces(island, p, part) {
                    self.send(me, broker_message::Body::Param(piece?)).await?;
                }
            }
        }
        Ok(())
    }

    /// Every parameter, buffer and optimizer moment, gathered from the stages that hold them
    /// (stage s of the first replica; islands: the optimizer moments of every island's stage s
    /// too, and the outer momentum; replicas that shard their optimizer state: each replica's
    /// piece, in the order of the pieces) into a new state file. Each piece must belong to its
    /// sender's stage and be finite, and every element of every part must arrive (else the
    /// sender failed); the inner error is the broker's own (its disk).
    async fn collect_state(
        &mut self,
        plan: &Plan,
        layout: &Layout,
        step: u64,
        position: u64,
    ) -> Flow<std::result::Result<Stored, GatherError>> {
        let outer = self.islands();
        let islands = if outer { layout.replicas.len() } else { 1 };
        let stages = layout.replicas[0].len().max(1);
        let mut st = match Gathered::new(
            &mut self.state_dir,
            &self.graph,
            &self.job.train,
            step,
            outer,
            islands,
        ) {
            Ok(st) => st,
            Err(e) => return Ok(Err(e)),
        };
        let keeper = keepers(plan, self.graph.params.len());
        let rounds = match self.optimizer_sharded(layout) {
            // Chunk c of a stage is replica c - 1's (mod R): its pieces follow chunk c - 1's.
            true => {
                let r = layout.replicas.len();
                (0..r).map(|c| (vec![(c + r - 1) % r], Some(c))).collect()
            }
            false => vec![((0..islands).collect::<Vec<usize>>(), None)],
        };
        let last = rounds.len() - 1;
        for (round, (replicas, chunk)) in rounds.into_iter().enumerate() {
            let req = Round {
                replicas,
                stages,
                outer,
                whole: round == last,
                chunk: chunk.map(|c| (c, layout.replicas.len())),
            };
            self.save_round(&mut st, plan, layout, &keeper, step, &req)
                .await?;
        }
        let mut saved = match st.finish(&self.graph) {
            Ok(s) => s,
            Err(GatherError::Peer(reason)) => {
                return Err(Interrupt::Failed {
                    node: "a stage".into(),
                    reason,
                })
            }
            Err(e) => return Ok(Err(e)),
        };
        let since = self.latest();
        saved.opt_step = since.opt_step + self.updates_between(since.step, step);
        saved.step = step;
        saved.data_position = position;
        Ok(Ok(saved))
    }

    /// Asks the stages of `req.replicas` for their state and takes it into `st`: replica 0 (or
    /// island 0) sends values and moments (islands: and the outer momentum), the other islands
    /// their moments only; replicas sharding their optimizer state each send their piece.
    async fn save_round(
        &mut self,
        st: &mut Gathered,
        plan: &Plan,
        layout: &Layout,
        keeper: &[usize],
        step: u64,
        req: &Round,
    ) -> Flow<()> {
        let nodes: Vec<usize> = req
            .replicas
            .iter()
            .flat_map(|&r| layout.replicas[r].iter().copied())
            .collect();
        let stages = req.stages;
        let graph = self.graph.clone();
        for (pos, &i) in nodes.iter().enumerate() {
            let first = req.replicas[pos / stages] == 0 || !req.outer;
            let save = SaveState {
                step,
                outer: req.outer && first,
                moments_only: !first,
            };
            self.send(i, broker_message::Body::Save(save)).await?;
        }
        // Islands keep a slot each; replicas (sharded or not) fill island 0's.
        let island_of = |pos: usize| match req.outer {
            true => req.replicas[pos / stages],
            false => 0,
        };
        self.gather(&nodes, "checkpoint state", Watch::Liveness, |c, pos, m| {
            let (island, stage) = (island_of(pos), pos % stages);
            match m.body {
                // State that is not the sender's, not finite or not whole is its fault.
                Some(node_message::Body::Param(p)) => {
                    let held = plan.stage_params.get(stage).map_or(&[][..], Vec::as_slice);
                    st.absorb(keeper, stage, island, held, &p)
                        .map_err(|reason| c.eviction(nodes[pos], reason))?;
                    Ok(None)
                }
                // A sharded replica's piece completes its stage's state with the last round;
                // before it, the piece must end where the replica's chunk ends.
                Some(node_message::Body::ParamsDone(_)) if !req.whole => {
                    let due = due_after_chunk(&graph, plan, stage, req.chunk.unwrap_or((0, 1)));
                    st.complete_to(keeper, stage, |i| due.get(&i).copied().unwrap_or(0))
                        .map_err(|reason| c.eviction(nodes[pos], reason))?;
                    Ok(Some(()))
                }
                Some(node_message::Body::ParamsDone(_)) => {
                    st.complete_from(keeper, stage, island)
                        .map_err(|reason| c.eviction(nodes[pos], reason))?;
                    Ok(Some(()))
                }
                _ => Ok(None),
            }
        })
        .await?;
        Ok(())
    }

    /// Whether the replicas of `layout` shard their optimizer state (the job asks for it, they
    /// are replicas that all-reduce, not islands, and there are several).
    pub(super) fn optimizer_sharded(&self, layout: &Layout) -> bool {
        self.job.train.shard_optimizer.is_on() && !self.islands() && layout.replicas.len() > 1
    }
}

/// One round of a snapshot's gather: the replicas asked (positions in the layout), the stages
/// of each, whether the run has islands, whether the round completes every stage's state, and
/// for replicas that shard their optimizer state, the chunk the round ends with (of how many).
struct Round {
    replicas: Vec<usize>,
    stages: usize,
    outer: bool,
    whole: bool,
    chunk: Option<(usize, usize)>,
}

/// Elements of each parameter of stage `stage` that a sharded snapshot holds once chunks 0 to
/// `c` of `r` have been sent: the stage's trainable values (in its order) up to chunk c's end,
/// and its buffers whole once replica 0 (chunk 1's) has sent them.
fn due_after_chunk(
    graph: &Graph,
    plan: &Plan,
    stage: usize,
    (c, r): (usize, usize),
) -> HashMap<usize, usize> {
    let ids = plan.stage_params.get(stage).map_or(&[][..], Vec::as_slice);
    let param = |i: usize| graph.params.get(i);
    let sizes: Vec<Option<usize>> = ids
        .iter()
        .map(|&i| param(i).filter(|p| p.trainable).map(|p| p.numel()))
        .collect();
    let len: usize = sizes.iter().flatten().sum();
    let end = crate::worker::ring_chunks(len, r)
        .get(c)
        .map_or(len, |&(s, l)| s + l);
    // What chunks 0..=c cover of each parameter: the piece of values 0..end in it (the split
    // the sharded replicas themselves use).
    let sent = crate::worker::pieces(&sizes, (0, end));
    ids.iter()
        .zip(sizes.iter().zip(sent))
        .filter_map(|(&i, (size, (_, n)))| {
            let p = param(i)?;
            let buffer = if c >= 1 { p.numel() } else { 0 };
            Some((i, if size.is_some() { n } else { buffer }))
        })
        .collect()
}

/// The stage whose copy of each parameter a snapshot keeps: a tied parameter lives on several
/// stages (bit-identical copies), and the first stage's is kept.
fn keepers(plan: &Plan, params: usize) -> Vec<usize> {
    let mut keeper = vec![usize::MAX; params];
    for (s, ids) in plan.stage_params.iter().enumerate().rev() {
        for &i in ids {
            if let Some(k) = keeper.get_mut(i) {
                *k = s;
            }
        }
    }
    keeper
}

#[cfg(test)]
mod tests {
    use super::SnapshotPolicy;

    #[test]
    fn a_sharded_snapshot_is_due_each_chunks_values_in_stage_order() {
        let graph = fusion_models::ModelSpec::preset("gpt2-tiny")
            .and_then(|m| m.graph(1, 8))
            .expect("graph");
        let one_stage = vec![0; graph.nodes.len()];
        let (plan, _) =
            crate::plan::Plan::new(&graph, one_stage, vec!["node0".into()]).expect("plan");
        let ids = &plan.stage_params[0];
        let trainable: Vec<usize> = ids
            .iter()
            .filter(|&&i| graph.params[i].trainable)
            .map(|&i| graph.params[i].numel())
            .collect();
        let len: usize = trainable.iter().sum();
        let chunks = crate::worker::ring_chunks(len, 3);
        for (c, &(start, n)) in chunks.iter().enumerate() {
            let due = super::due_after_chunk(&graph, &plan, 0, (c, 3));
            let got: usize = ids
                .iter()
                .filter(|&&i| graph.params[i].trainable)
                .map(|i| due[i])
                .sum();
            assert_eq!(got, start + n, "after chunk {c}");
            // Each parameter is due a prefix: whole before the chunk's end, none after it.
            let mut at = 0;
            for &i in ids.iter().filter(|&&i| graph.params[i].trainable) {
                let size = graph.params[i].numel();
                assert_eq!(due[&i], (start + n).saturating_sub(at).min(size));
                at += size;
            }
        }
    }

    #[test]
    fn snapshots_are_spaced_so_that_they_cost_at_most_the_share_of_training_time() {
        let p = SnapshotPolicy::default();
        // No figures yet: every step, so the first snapshot measures its cost.
        assert_eq!(p.interval(None, None), 1);
        assert_eq!(p.interval(Some(0.1), None), 1);
        // Cheap snapshots: every step. 0.5 s against 1 s steps at 5%: every 10 steps.
        assert_eq!(p.interval(Some(0.01), Some(1.0)), 1);
        assert_eq!(p.interval(Some(0.5), Some(1.0)), 10);
        assert_eq!(p.interval(Some(0.51), Some(1.0)), 11);
        // Bounded, and nonsense figures fall back to every step.
        assert_eq!(p.interval(Some(1e9), Some(1.0)), 1000);
        assert_eq!(p.interval(Some(f64::NAN), Some(1.0)), 1);
        assert_eq!(p.interval(Some(1.0), Some(0.0)), 1);
        // A fixed interval wins.
        let fixed = SnapshotPolicy {
            every_steps: 7,
            ..p
        };
        assert_eq!(fixed.interval(Some(100.0), Some(1.0)), 7);
    }
}
