//! Island-local recovery: a node lost (or failed, or evicted) while the islands compute a
//! training step, or between steps, takes only its island out of the round. The other islands
//! keep what they hold (parameters, moments, the anchor of the last synchronisation, outer
//! momentum): they are re-assigned with `keep_state` on a ring without the lost island and go on
//! from the interrupted step (no update of it was applied anywhere) to the next synchronisation
//! among themselves. There, with every island holding the same parameters, the broker re-forms the
//! job's islands (a replacement, or the lost island's remaining nodes in a new shape) from a
//! snapshot, as any reshape does. Anything else (a loss during the synchronisation itself, when
//! updates were sent, or of the only island), or `[train.outer] recovery = "rollback"`, rolls
//! every island back as before.

use super::*;
use fusion_graph::Stage;
use fusion_train::IslandRecovery;

/// The placement training runs on now, kept for an island-local recovery.
pub(super) struct Current {
    pub plan: Plan,
    pub layout: Layout,
    pub stages: Vec<Stage>,
}

/// A step every island can resume from, with the data position it reads from: the state is the
/// one after the step before on every node (no update of this step was sent, no
/// synchronisation is under way).
#[derive(Clone, Copy, Debug)]
pub(super) struct Resumable {
    pub step: u64,
    pub position: u64,
}

/// The islands that go on when island `lost` of `islands` (nodes by island) is out: the same
/// nodes by island, without it; `None` when none would be left.
pub(super) fn islands_left<T: Clone>(islands: &[Vec<T>], lost: usize) -> Option<Vec<Vec<T>>> {
    let left: Vec<Vec<T>> = islands
        .iter()
        .enumerate()
        .filter(|&(r, _)| r != lost)
        .map(|(_, nodes)| nodes.clone())
        .collect();
    (!left.is_empty() && lost < islands.len()).then_some(left)
}

impl Coordinator<'_> {
    /// The island whose node `node` is, when its loss can stay local: the job has islands, the
    /// nodes hold a state to resume from (no update sent, no synchronisation under way, no
    /// placement being set up), and another island is left.
    pub(super) fn local_loss(&self, node: &str) -> Option<usize> {
        let current = self.current.as_ref()?;
        self.resumable?;
        let recovery = self.job.train.outer.as_ref().map(|o| o.recovery);
        // Islands that overlap drop the exchange under way with the placement (its ring held
        // the lost island); their next synchronisation's delta carries its round.
        if recovery != Some(IslandRecovery::Local)
            || !self.islands()
            || current.layout.replicas.len() < 2
        {
            return None;
        }
        current
            .layout
            .replicas
            .iter()
            .position(|nodes| nodes.iter().any(|&m| self.members[m].id == node))
    }

    /// Takes island `lost` of `islands` (node ids by island) out of the round after the loss
    /// of `node` (already removed from the members when it is gone): its other nodes stand by,
    /// the islands left keep their state and their shares, and training resumes at the
    /// interrupted step. The caller records the recovery once the islands left are ready.
    pub(super) fn take_island_out(
        &mut self,
        lost: usize,
        node: &str,
        reason: &str,
        islands: Vec<Vec<String>>,
        nodes_before: usize,
    ) -> Result<RecoveryRecord> {
        let left_ids = islands_left(&islands, lost).ok_or_else(|| {
            RuntimeError::Protocol(format!("island {lost} of {} taken out", islands.len()))
        })?;
        let at = self.resumable.ok_or_else(|| {
            RuntimeError::Protocol("an island-local recovery without a step to resume".into())
        })?;
        let index = |id: &String| self.members.iter().position(|m| &m.id == id);
        let layout = Layout {
            replicas: left_ids
                .iter()
                .map(|ids| ids.iter().map(index).collect::<Option<Vec<usize>>>())
                .collect::<Option<Vec<Vec<usize>>>>()
                .ok_or_else(|| {
                    RuntimeError::Protocol("a node of the islands left is not a member".into())
                })?,
        };
        let why = format!("island {lost} is out until the next synchronisation ({node}: {reason})");
        // Its other nodes drop their stage and stand by.
        for m in self
            .members
            .iter()
            .filter(|m| islands[lost].contains(&m.id))
        {
            let body = broker_message::Body::Reset(Reset {
                reason: why.clone(),
            });
            let _ = m.tx.try_send(Ok(msg(body)));
        }
        self.resumable = None;
        if lost < self.placed.shares.len() {
            self.placed.shares.remove(lost);
        }
        self.placed.island_rates.clear();
        if let Some(c) = self.current.as_mut() {
            c.layout = layout;
        }
        self.resume_at = Some(at);
        self.islands_out
            .get_or_insert((Instant::now(), nodes_before));
        let left = left_ids.len();
        tracing::warn!("step {}: {why}; the islands left ({left}) go on", at.step);
        if let Some(s) = self.exchange_under_way(at.step) {
            tracing::warn!(
                "step {}: the islands left drop the overlapped exchange of step {} (its ring \
                 held island {lost}); their next synchronisation carries its round",
                at.step,
                s + 1
            );
        }
        (self.on_event)(BrokerEvent::IslandOut {
            island: lost,
            step: at.step,
            islands_left: left_ids.len(),
        });
        Ok(RecoveryRecord {
            node: node.to_string(),
            reason: reason.to_string(),
            interrupted_at_step: at.step,
            resumed_from_step: at.step,
            from_shards: false,
            steps_lost: 0,
            nodes_before,
            nodes_after: 0,
            seconds: 0.0,
            evicted: false,
            island_out: Some(lost),
        })
    }

    /// The step (0-based) whose overlapped exchange is under way when training resumes at
    /// `step`: the last synchronisation before it, when that one overlapped.
    fn exchange_under_way(&self, step: u64) -> Option<u64> {
        let last = (0..step).rev().find(|&s| self.sync_after(s))?;
        self.overlapped.contains(&last).then_some(last)
    }

    /// The node ids of the current islands, by island.
    pub(super) fn island_ids(&self) -> Option<Vec<Vec<String>>> {
        let current = self.current.as_ref()?;
        Some(
            current
                .layout
                .replicas
                .iter()
                .map(|nodes| self.ids(nodes))
                .collect(),
        )
    }

    /// Re-assigns the islands left, keeping their state; returns their plan and layout, which
    /// train on from the interrupted step.
    pub(super) async fn keep_islands(&mut self) -> Flow<(Plan, Layout)> {
        let current = self.current.take().ok_or_else(|| {
            Interrupt::from(RuntimeError::Protocol("no placement to go on with".into()))
        })?;
        self.snapshots.quiet_steps = (0, 0.0);
        // A sharded snapshot whose shards are all copied still counts (settling commits it);
        // one still in flight is dropped.
        self.settle_sharded().await;
        self.check_shards();
        self.keep_assign(&current).await?;
        let (plan, layout) = (current.plan.clone(), current.layout.clone());
        self.current = Some(current);
        Ok((plan, layout))
    }

    /// Sends every node of `current` an assignment that keeps its stage's state (its ring is
    /// the islands left) and waits until all are ready. Results a node sent for the interrupted
    /// step arrive before its `Ready` on the same stream, and the wait drops them, so the
    /// step run again is answered afresh. When this fails, `current` stays empty and the next
    /// fault handling rolls every island back.
    async fn keep_assign(&mut self, current: &Current) -> Flow<()> {
        self.generation += 1;
        let (plan, layout) = (&current.plan, &current.layout);
        self.record_placement(plan, layout, &current.stages);
        for (r, nodes) in layout.replicas.iter().enumerate() {
            for (s, stage) in current.stages.iter().enumerate() {
                let mut a = self.assignment_for(plan, layout, r, s, stage)?;
                a.keep_state = true;
                self.send(nodes[s], broker_message::Body::Assignment(a))
                    .await?;
                let done = fusion_proto::ParamsDone {
                    step: self.latest().step,
                };
                self.send(nodes[s], broker_message::Body::ParamsDone(done))
                    .await?;
            }
        }
        self.await_ready(layout, false).await
    }

    /// Whether the islands should be re-formed at this synchronised step boundary: some were
    /// taken out, and the members can form the job's islands on as many nodes as the placement
    /// had before (a replacement joined), or, once `replace_grace` has passed without one, on
    /// more nodes than the islands left use (smaller islands).
    pub(super) fn reform_due(&self, layout: &Layout) -> Option<String> {
        let out = self.job.replicas.saturating_sub(layout.replicas.len());
        let (since, before) = self.islands_out?;
        if out == 0 || !self.islands() {
            return None;
        }
        let n = self.usable_nodes(self.available(), true)?;
        let waited = since.elapsed() >= self.cfg.replace_grace;
        (n >= before || (waited && n > layout.all().len())).then(|| {
            format!(
                "re-forming {} islands on {n} nodes ({out} taken out since the last placement)",
                self.job.replicas
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_islands_left_are_the_others_in_their_order_and_none_when_none_is_left() {
        let islands = vec![vec!["a", "b"], vec!["c", "d"], vec!["e", "f"]];
        assert_eq!(
            islands_left(&islands, 1),
            Some(vec![vec!["a", "b"], vec!["e", "f"]])
        );
        assert_eq!(
            islands_left(&islands, 0),
            Some(vec![vec!["c", "d"], vec!["e", "f"]])
        );
        assert_eq!(islands_left(&[vec!["a"]], 0), None);
        assert_eq!(islands_left(&islands, 3), None);
    }
}
