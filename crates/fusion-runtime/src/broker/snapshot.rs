//! Snapshots of the training state: when to take one (a pure policy), gathering it from the nodes
//! that hold it, and writing checkpoints to disk on a blocking thread, off the coordinator's path.

use super::*;
use std::path::Path;

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
}

impl Default for SnapshotPolicy {
    fn default() -> Self {
        SnapshotPolicy {
            every_steps: 0,
            max_share: 0.05,
            max_interval: 1000,
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
    /// Checkpoint writes that failed (the run went on with its in-memory snapshot).
    pub write_failures: Vec<String>,
}

/// What the report says of the run's snapshots.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SnapshotStats {
    pub taken: u64,
    pub mean_seconds: f64,
    /// The interval in force at the end, in steps.
    pub interval_steps: u64,
    pub checkpoint_write_failures: Vec<String>,
}

impl Coordinator<'_> {
    /// Whether a snapshot is due after `step` (steps counted from 1): the policy's interval since
    /// the last one, a disk checkpoint due, or the last step.
    pub(super) fn snapshot_due(&self, step: u64, step_s: Option<f64>) -> bool {
        let cfg = &self.job.train;
        let interval = self
            .snapshots
            .policy
            .interval(self.snapshots.last_cost_s, step_s);
        step == cfg.steps
            || step.saturating_sub(self.master.step) >= interval
            || self.checkpoint_due(step)
    }

    fn checkpoint_due(&self, step: u64) -> bool {
        let cfg = &self.job.train;
        cfg.checkpoint_dir.is_some()
            && (step == cfg.steps
                || (cfg.checkpoint_every > 0 && step.is_multiple_of(cfg.checkpoint_every)))
    }

    /// Gathers the state after `step` from the first replica's stages, makes it the broker's copy
    /// (what a recovery rolls back to) and starts writing a checkpoint when one is due.
    pub(super) async fn snapshot(
        &mut self,
        plan: &Plan,
        first: &[usize],
        step: u64,
        position: u64,
    ) -> Flow<()> {
        let t0 = Instant::now();
        let state = self.collect_state(plan, first, step, position).await?;
        let stall = std::mem::take(&mut self.cfg.test_snapshot_stall);
        if !stall.is_zero() {
            // Test hook: the coordinator stalls once, as a slow serialisation would.
            std::thread::sleep(stall);
        }
        self.master = Arc::new(state);
        let cost = t0.elapsed().as_secs_f64();
        let s = &mut self.snapshots;
        s.last_cost_s = Some(cost);
        s.taken += 1;
        s.total_s += cost;
        tracing::debug!("snapshot at step {step} took {cost:.3} s");
        if self.checkpoint_due(step) {
            self.start_checkpoint_write().await;
        }
        Ok(())
    }

    /// Writes the broker's copy to the checkpoint directory on a blocking thread. A write still
    /// running is waited for first, so at most one is in flight.
    async fn start_checkpoint_write(&mut self) {
        self.finish_checkpoint_write().await;
        let Some(dir) = self.job.train.checkpoint_dir.clone() else {
            return;
        };
        let cfg = self.job.train.clone();
        let (master, graph) = (self.master.clone(), self.graph.clone());
        let ck = CheckpointState {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            model: self.job.model.name.clone(),
            model_signature: model_signature(&graph),
            step: master.step,
            data_position: master.data_position,
            optimizer: cfg.optimizer.clone(),
            optimizer_step: master.opt.step,
            config: cfg,
            tensors_sha256: String::new(),
            run_id: Some(self.run_id.clone()),
        };
        self.snapshots.writing = Some(tokio::task::spawn_blocking(move || {
            write_checkpoint(&dir, &graph, &master, ck)
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
                tracing::warn!("{e}; training goes on with the snapshot in memory");
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
            interval_steps: s.policy.interval(s.last_cost_s, step_s),
            checkpoint_write_failures: s.write_failures.clone(),
        }
    }

    /// Every parameter, buffer and optimizer moment, gathered from the stages that hold them
    /// (`first`: stage s of one replica at position s). Each piece must belong to its sender's
    /// stage and be finite; every element of every part must arrive.
    async fn collect_state(
        &mut self,
        plan: &Plan,
        first: &[usize],
        step: u64,
        position: u64,
    ) -> Flow<Master> {
        for &i in first {
            self.send(i, broker_message::Body::Save(SaveState { step }))
                .await?;
        }
        let mut st = Gathered::like(&self.master);
        // A tied parameter lives on several stages (bit-identical copies): keep the first
        // stage's.
        let mut keeper = vec![usize::MAX; st.parts[0].len()];
        for (s, ids) in plan.stage_params.iter().enumerate().rev() {
            for &i in ids {
                if let Some(k) = keeper.get_mut(i) {
                    *k = s;
                }
            }
        }
        self.gather(
            first,
            "checkpoint state",
            Watch::Liveness,
            |c, pos, m| match m.body {
                Some(node_message::Body::Param(p)) => {
                    st.absorb(&keeper, pos, &p)
                        .map_err(|reason| Interrupt::Failed {
                            node: c.members[first[pos]].id.clone(),
                            reason,
                        })?;
                    Ok(None)
                }
                Some(node_message::Body::ParamsDone(_)) => Ok(Some(())),
                _ => Ok(None),
            },
        )
        .await?;
        let mut master = st.finish(&self.graph).map_err(|reason| Interrupt::Failed {
            node: "a stage".into(),
            reason,
        })?;
        // Every step since the broker's copy applied exactly one optimizer update on every node.
        master.opt.step = self.master.opt.step + (step - self.master.step);
        master.step = step;
        master.data_position = position;
        Ok(master)
    }
}

/// A state being gathered: buffers shaped like the broker's copy and how many elements of each
/// part have arrived.
struct Gathered {
    parts: [Vec<Vec<f32>>; 3],
    filled: [Vec<usize>; 3],
}

impl Gathered {
    fn like(m: &Master) -> Self {
        let zeros = |v: &Vec<Vec<f32>>| v.iter().map(|p| vec![0.0f32; p.len()]).collect::<Vec<_>>();
        let counts = |v: &Vec<Vec<f32>>| vec![0usize; v.len()];
        Gathered {
            parts: [zeros(&m.params), zeros(&m.opt.first), zeros(&m.opt.second)],
            filled: [
                counts(&m.params),
                counts(&m.opt.first),
                counts(&m.opt.second),
            ],
        }
    }

    /// Takes one piece from stage `stage`; `keeper[i]` is the stage whose copy of parameter i is
    /// kept (other holders' pieces of it are ignored).
    fn absorb(
        &mut self,
        keeper: &[usize],
        stage: usize,
        p: &fusion_proto::ParamData,
    ) -> std::result::Result<(), String> {
        let i = p.param as usize;
        match keeper.get(i) {
            Some(&k) if k == stage => {}
            Some(&k) if k < stage => return Ok(()),
            _ => {
                return Err(format!(
                    "sent state for parameter #{}, which its stage does not hold",
                    p.param
                ))
            }
        }
        let k = match p.part() {
            ParamPart::Value => 0,
            ParamPart::FirstMoment => 1,
            ParamPart::SecondMoment => 2,
            ParamPart::Unspecified => return Err("sent state with no part".into()),
        };
        // Pieces come in order, each starting where the last ended: every element exactly once.
        if p.offset != self.filled[k][i] as u64 {
            return Err(format!(
                "sent a piece of parameter #{} at element {} where {} was due",
                p.param, p.offset, self.filled[k][i]
            ));
        }
        let target = &mut self.parts[k][i];
        write_piece(target, p).map_err(|e| e.to_string())?;
        let n = p.data.len() / 4;
        let off = p.offset as usize;
        if target[off..off + n].iter().any(|v| !v.is_finite()) {
            return Err(format!("sent non-finite state for parameter #{}", p.param));
        }
        self.filled[k][i] += n;
        Ok(())
    }

    fn finish(self, graph: &Graph) -> std::result::Result<Master, String> {
        for k in 0..3 {
            for (i, (v, &n)) in self.parts[k].iter().zip(&self.filled[k]).enumerate() {
                if n != v.len() {
                    return Err(format!(
                        "the state of parameter '{}' arrived incomplete ({n} of {} elements)",
                        graph.params[i].name,
                        v.len()
                    ));
                }
            }
        }
        let [params, first, second] = self.parts;
        Ok(Master {
            params,
            opt: OptimizerState {
                step: 0,
                first,
                second,
            },
            step: 0,
            data_position: 0,
        })
    }
}

/// Writes one checkpoint (a blocking thread's job); the error says what failed, with the path.
fn write_checkpoint(
    dir: &Path,
    graph: &Graph,
    m: &Master,
    ck: CheckpointState,
) -> std::result::Result<PathBuf, String> {
    fusion_train::save_checkpoint(dir, graph, &m.params, &m.opt, ck).map_err(|e| {
        format!(
            "writing the checkpoint of step {} to {}: {e}",
            m.step,
            dir.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::{Gathered, Master, SnapshotPolicy};
    use crate::wire::param_messages;
    use fusion_proto::ParamPart;
    use fusion_train::OptimizerState;

    fn master() -> Master {
        Master {
            params: vec![vec![1.0; 4], vec![2.0; 3]],
            opt: OptimizerState {
                step: 0,
                first: vec![vec![0.0; 4], vec![0.0; 3]],
                second: vec![vec![0.0; 4], vec![0.0; 3]],
            },
            step: 0,
            data_position: 0,
        }
    }

    #[test]
    fn gathered_state_must_come_whole_finite_and_from_the_stage_that_holds_it() {
        let graph = fusion_models::ModelSpec::preset("gpt2-tiny")
            .and_then(|m| m.graph(1, 4))
            .expect("graph");
        // Parameter 0 is kept from stage 0, parameter 1 from stage 1.
        let keeper = [0, 1];
        let mut g = Gathered::like(&master());
        let piece = |i: usize, part, v: &[f32]| param_messages(i, part, v).remove(0);
        let err = g.absorb(&keeper, 0, &piece(1, ParamPart::Value, &[5.0; 3]));
        assert!(err.is_err_and(|e| e.contains("does not hold")));
        let err = g.absorb(
            &keeper,
            0,
            &piece(0, ParamPart::Value, &[1.0, f32::NAN, 1.0, 1.0]),
        );
        assert!(err.is_err_and(|e| e.contains("non-finite")));
        let err = g.absorb(&keeper, 0, &piece(0, ParamPart::Value, &[1.0; 5]));
        assert!(err.is_err_and(|e| e.contains("does not fit")));
        // A later stage's copy of a parameter kept elsewhere is ignored, not an error.
        assert!(g
            .absorb(&keeper, 1, &piece(0, ParamPart::Value, &[9.0; 4]))
            .is_ok());
        let mut g = Gathered::like(&master());
        for (i, n) in [(0usize, 4usize), (1, 3)] {
            for part in [ParamPart::Value, ParamPart::FirstMoment] {
                g.absorb(&keeper, i, &piece(i, part, &vec![3.0; n]))
                    .expect("piece");
            }
        }
        let incomplete = g.finish(&graph).err().expect("second moments missing");
        assert!(incomplete.contains("incomplete"), "{incomplete}");
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
