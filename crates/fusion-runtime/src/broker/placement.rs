//! Placement: which member runs which stage, from the scheduler's plan; sending assignments.

use super::relay_share::Relays;
use super::*;
use fusion_graph::Stage;
use fusion_train::{Recompute, ShardOptimizer};

impl Coordinator<'_> {
    /// Each stage's compute per micro-batch as the estimator predicts it on its node's profile.
    pub(super) fn predicted_stage_compute(&self, plan: &Plan, nodes: &[usize]) -> Vec<f64> {
        let mut t = vec![0.0; nodes.len()];
        let Ok(w) = Workload::of(&self.graph, ADAM_STATE_BYTES_PER_PARAM) else {
            return t;
        };
        let profiles: Vec<DeviceProfile> = nodes.iter().map(|&m| self.profile(m)).collect();
        for (pos, op) in w.ops.iter().enumerate() {
            let s = plan.assignment[w.node_of_position[pos]];
            if let Some(p) = profiles.get(s) {
                let (f, b) = p.op_time(op);
                // A recomputing stage runs its forward twice.
                let again = if plan.recompute_segments(s).is_some() {
                    f
                } else {
                    0.0
                };
                t[s] += f + b + again;
            }
        }
        t
    }

    /// The scheduler's view of member `m`'s device, from what it measured at join, derated when
    /// it computed slower than that predicted.
    pub(super) fn profile(&self, m: usize) -> DeviceProfile {
        let c = &self.members[m].caps;
        let derate = self.members[m].derate;
        let or = |v: f64, default: f64| if v.is_finite() && v > 0.0 { v } else { default };
        DeviceProfile {
            name: self.members[m].id.clone(),
            class: c.backend.clone(),
            dense_flops_per_s: or(c.measured_gflops, 1.0) * 1e9,
            memory_bytes_per_s: or(c.measured_memory_gbs, 1.0) * 1e9,
            memory_capacity_bytes: or(c.memory_bytes as f64, 8e9),
            calibration: or(c.calibration, 1.0) * derate,
            // Derated with the calibration: a node slower than it claimed is slower throughout.
            op_overhead_s: or(c.op_overhead_us, 0.0) * 1e-6 * derate,
            source: ProfileSource::Measured,
        }
    }

    /// Compares each node's measured compute per micro-batch in the last step with what its
    /// profile predicts; a node far slower than the others relative to their claims is derated
    /// for later plans and reported.
    pub(super) fn check_claims(&mut self, plan: &Plan, layout: &Layout) {
        let Some(last) = self.history.timings.last() else {
            return;
        };
        let m = self.job.train.micro_batches.max(1);
        let measured: Vec<f64> = last.compute_at(m).iter().map(|c| c / m as f64).collect();
        let predicted: Vec<f64> = layout
            .replicas
            .iter()
            .flat_map(|nodes| self.predicted_stage_compute(plan, nodes))
            .collect();
        let flagged = claims::overclaims(&predicted, &measured);
        for (&member, factor) in layout.all().iter().zip(flagged) {
            let Some(f) = factor else { continue };
            let mem = &mut self.members[member];
            mem.derate *= f;
            let line = format!(
                "{} computed {f:.1}x slower than its reported capabilities predict ({:.1} GFLOP/s \
                 claimed); its figures are derated for later plans",
                mem.id, mem.caps.measured_gflops
            );
            tracing::warn!("{line}");
            self.overclaims.push(line);
        }
    }

    /// The operator assignment and the member running each (stage, replica) slot, in slot order
    /// `s * R + r`: fixed cuts in name order, the even split in name order, or the scheduler's
    /// plan over the members' measured speed and the testbed's links.
    pub(super) fn placement_plan(
        &mut self,
        active: &[usize],
        stages: usize,
    ) -> Result<(Vec<usize>, Vec<usize>)> {
        self.placed = Placed::default();
        self.start_shares()?;
        if self.islands() {
            return self.island_placement(active, stages);
        }
        if let Some(c) = &self.job.cuts {
            return Ok((assignment_from_cuts(&self.graph, c)?, active.to_vec()));
        }
        if self.job.scheduler == Scheduler::Even {
            let a = self
                .graph
                .even_assignment(stages)
                .map_err(RuntimeError::from)?;
            return Ok((a, active.to_vec()));
        }
        let workload = self.workload()?;
        // A relayed link's bytes cross both of its relay's legs (see `relay_share`).
        let (planned, network, relays, why) =
            self.plan_resolving_sharding(&workload, active, stages)?;
        let problem = self.problem(&workload, &network)?;
        self.placed.scheduled = Some(planned.plan.clone());
        self.placed.recompute = planned.evaluation.recompute.clone();
        self.placed.active = active.to_vec();
        self.plan_explanation = explain(&problem, &planned.plan, &planned.evaluation);
        self.plan_explanation.extend(why);
        self.plan_explanation.extend(self.relay_lines(
            active,
            &workload,
            &planned.plan,
            &network,
            &relays,
        ));
        let order = planned
            .plan
            .devices
            .iter()
            .flat_map(|replicas| replicas.iter().map(|&d| active[d]))
            .collect();
        Ok((workload.assignment(&planned.plan.starts), order))
    }

    /// `plan_charged` under the job's sharding policy, with the explanation's line when it
    /// shards. `auto` plans with and without sharded optimizer state and sets this placement's
    /// `shard_optimizer` to the choice (`fusion_plan::sharding_verdict`: only where memory binds);
    /// a placement that would shard cannot restore a sharded snapshot (its shards hold whole
    /// moments): `RuntimeError::ShardingNeeded` then sends the run back to the broker's snapshot.
    fn plan_resolving_sharding(
        &mut self,
        workload: &Workload,
        active: &[usize],
        stages: usize,
    ) -> Result<(fusion_plan::Planned, Network, Relays, Option<String>)> {
        let auto = self.sharding_policy == ShardOptimizer::Auto;
        if auto {
            self.job.train.shard_optimizer = ShardOptimizer::Off;
        }
        let plain = self.plan_charged(workload, active, stages);
        if !auto || self.job.replicas < 2 {
            return plain.map(|(p, n, r)| (p, n, r, None));
        }
        self.job.train.shard_optimizer = ShardOptimizer::On;
        let sharded = self.plan_charged(workload, active, stages);
        self.job.train.shard_optimizer = ShardOptimizer::Off;
        let Ok((s, net, relays)) = sharded else {
            return plain.map(|(p, n, r)| (p, n, r, None));
        };
        let unsharded = self.evaluate_on(workload, &net, &s.plan).ok();
        let best = plain.as_ref().ok().map(|x| &x.0.evaluation);
        let Some(why) = fusion_plan::sharding_verdict(best, &s.evaluation, unsharded.as_ref())
        else {
            return plain.map(|(p, n, r)| (p, n, r, None));
        };
        if self.sharded.is_some() {
            return Err(RuntimeError::ShardingNeeded(why));
        }
        tracing::info!("{why}");
        self.job.train.shard_optimizer = ShardOptimizer::On;
        Ok((s, net, relays, Some(why)))
    }

    /// Recomputation segments per stage under the job's policy: every stage (`on`), the stages
    /// the scheduler found fit only so (`auto`), or none.
    fn recompute_segments(&self, stages: &[Stage]) -> Vec<usize> {
        let policy = self.job.train.recompute;
        let wanted = |s: usize| match policy {
            Recompute::On => true,
            Recompute::Auto => self.placed.recompute.get(s).copied().unwrap_or(false),
            Recompute::Off => false,
        };
        stages
            .iter()
            .enumerate()
            .map(|(s, g)| {
                if wanted(s) {
                    fusion_exec::default_segments(g.graph.nodes.len())
                } else {
                    0
                }
            })
            .collect()
    }

    /// The graph's workload as the scheduler sees it.
    pub(super) fn workload(&self) -> Result<Workload> {
        Workload::of(&self.graph, ADAM_STATE_BYTES_PER_PARAM)
            .map_err(|e| RuntimeError::Config(format!("planning the placement: {e}")))
    }

    /// `active`'s devices (their profiles) and the links between them.
    pub(super) fn network(&self, active: &[usize]) -> Network {
        let devices = active.iter().map(|&m| self.profile(m)).collect();
        let n = active.len();
        let (mut bandwidth, mut latency) = (vec![vec![f64::INFINITY; n]; n], vec![vec![0.0; n]; n]);
        for i in 0..n {
            for j in 0..n {
                if i != j {
                    // Probed figures first, then the testbed's; without either the link is
                    // unknown: plan as if on a 1 Gbit/s LAN.
                    let (mbps, ms) = self
                        .measured_between(active[i], active[j])
                        .or_else(|| self.testbed_path(active[i], active[j]))
                        .unwrap_or((1000.0, 0.1));
                    bandwidth[i][j] = mbps * 1e6 / 8.0;
                    latency[i][j] = ms / 1e3;
                }
            }
        }
        Network {
            devices,
            bandwidth,
            latency,
        }
    }

    /// The scheduler's problem: the job's micro-batches and schedule on `network`.
    pub(super) fn problem<'a>(
        &self,
        workload: &'a Workload,
        network: &'a Network,
    ) -> Result<Problem<'a>> {
        let mut problem = Problem::new(
            workload,
            network,
            self.job.train.micro_batches,
            self.job.schedule,
        )
        .map_err(|e| RuntimeError::Config(format!("planning the placement: {e}")))?;
        problem = match self.job.train.recompute {
            Recompute::Off => problem.without_recompute(),
            Recompute::On => problem.always_recompute(),
            Recompute::Auto => problem,
        };
        if self.job.train.shard_optimizer.is_on() {
            problem = problem.sharding_optimizer();
        }
        if self.job.compression.adaptive() {
            // Fences may sit on a slow link when AdaTopK will shrink what crosses it.
            problem = problem.with_compression(self.job.compression.policy());
        }
        Ok(problem)
    }

    /// The scheduler's best plan of `problem` with `stages` stages of the job's replicas.
    pub(super) fn schedule(
        &self,
        problem: &Problem<'_>,
        stages: usize,
    ) -> Result<fusion_plan::Planned> {
        let options = PlanOptions {
            stages: Some(stages),
            replicas: Some(self.job.replicas),
            ..Default::default()
        };
        fusion_plan::plan(problem, self.job.scheduler, &options)
            .map_err(|e| RuntimeError::Config(format!("planning the placement: {e}")))
    }

    /// Places the stages on `active` (a new generation): plans, tells every node its stage and
    /// state (from the broker's snapshot or the nodes' shards) and waits until all are ready.
    pub(super) async fn assign(&mut self, active: &[usize]) -> Flow<(Plan, Layout, Vec<Stage>)> {
        self.generation += 1;
        let r_count = self.job.replicas;
        let stages = active.len() / r_count;
        self.placed_nodes = active.to_vec();
        // The new placement chooses its relays afresh.
        self.pinned_relays.clear();
        if self.job.probe.enabled {
            self.probe_new_links(active).await?;
            // Then the links that are not dialled directly, over the paths they take.
            let n = active.len();
            let pairs: Vec<(usize, usize)> = (0..n)
                .flat_map(|a| (0..n).filter(move |&b| b != a).map(move |b| (a, b)))
                .collect();
            self.probe_paths(active, &pairs, false).await?;
        }
        let (assignment, order) = match self.placement_plan(active, stages) {
            Err(RuntimeError::ShardingNeeded(why)) => {
                self.sharded = None;
                return Err(Interrupt::Failed {
                    node: "the sharded snapshot".into(),
                    reason: format!("{why}; rolling back to the broker's snapshot"),
                });
            }
            other => other?,
        };
        let layout = Layout {
            replicas: (0..r_count)
                .map(|r| (0..stages).map(|s| order[s * r_count + r]).collect())
                .collect(),
        };
        let first = self.ids(&layout.replicas[0]);
        let (mut plan, stage_graphs) = Plan::new(&self.graph, assignment, first)?;
        plan.recompute = self.recompute_segments(&stage_graphs);
        if let Some(why) = self.unroutable(&plan, &layout) {
            return Err(Interrupt::Fatal(Box::new(RuntimeError::Config(why))));
        }
        self.record_placement(&plan, &layout, &stage_graphs);
        // Stages restored from a sharded snapshot: their nodes fetch the shards they lack first.
        let from_shards = match self.place_shards(&layout, &plan.stage_params).await? {
            Ok(m) => m,
            Err(why) => {
                self.sharded = None;
                return Err(Interrupt::Failed {
                    node: "the sharded snapshot".into(),
                    reason: format!("cannot restore from it ({why}); rolling back further"),
                });
            }
        };
        for r in 0..r_count {
            for (s, stage) in stage_graphs.iter().enumerate() {
                let me = layout.replicas[r][s];
                let a = self.assignment_for(&plan, &layout, r, s, stage)?;
                self.send(me, broker_message::Body::Assignment(a)).await?;
                match from_shards.get(&me) {
                    Some(shards) => self.load_shards(me, shards).await?,
                    None => {
                        self.ship_state(me, r, stage.params.iter().map(|p| p.0))
                            .await?
                    }
                }
                let done = fusion_proto::ParamsDone {
                    step: self.latest().step,
                };
                self.send(me, broker_message::Body::ParamsDone(done))
                    .await?;
            }
        }
        self.await_ready(&layout, !from_shards.is_empty()).await?;
        Ok((plan, layout, stage_graphs))
    }

    /// The node ids of `nodes` (members).
    pub(super) fn ids(&self, nodes: &[usize]) -> Vec<String> {
        nodes.iter().map(|&i| self.members[i].id.clone()).collect()
    }

    /// Measures every pair of `active` not measured yet (the nodes that just joined).
    async fn probe_new_links(&mut self, active: &[usize]) -> Flow<()> {
        let n = active.len();
        let fresh: Vec<(usize, usize)> = (0..n)
            .flat_map(|a| (0..n).map(move |b| (a, b)))
            .filter(|&(a, b)| a != b)
            .filter(|&(a, b)| {
                self.measured_between(active[a], active[b]).is_none()
                    || self.measured_between(active[b], active[a]).is_none()
            })
            .collect();
        self.probe_links(active, &fresh).await
    }

    /// Keeps what the straggler check and the report need of the new placement, and says it.
    pub(super) fn record_placement(
        &mut self,
        plan: &Plan,
        layout: &Layout,
        stage_graphs: &[Stage],
    ) {
        self.placed.predicted_s = layout
            .replicas
            .iter()
            .flat_map(|nodes| self.predicted_stage_compute(plan, nodes))
            .collect();
        self.placed.derates = layout
            .all()
            .iter()
            .map(|&m| self.members[m].derate)
            .collect();
        // Also reached from the islands' re-assignments, which do not go through `assign`.
        self.placed_nodes = layout.all();
        let used = links::used_links(plan, layout, &self.placed_nodes);
        let members: Vec<(usize, usize)> = used
            .iter()
            .map(|&(x, y)| (self.placed_nodes[x], self.placed_nodes[y]))
            .collect();
        self.pin_relays(&members);
        let paths_from = |m: usize| -> Vec<String> {
            used.iter()
                .map(|&(x, y)| (self.placed_nodes[x], self.placed_nodes[y]))
                .filter(|&(a, _)| a == m)
                .map(|(a, b)| (b, self.path_between(a, b)))
                .filter(|(_, p)| *p != crate::path::LinkPath::Direct)
                .map(|(b, p)| format!("to {}: {}", self.members[b].id, p.name()))
                .collect()
        };
        self.placement = layout
            .replicas
            .iter()
            .enumerate()
            .flat_map(|(r, nodes)| nodes.iter().enumerate().map(move |(s, &m)| (r, s, m)))
            .map(|(r, s, m)| {
                let mem = &self.members[m];
                let st = &stage_graphs[s];
                let site = self.job.testbed.as_ref().and_then(|t| t.device(&mem.id));
                StagePlacement {
                    stage: s,
                    replica: r,
                    node: mem.id.clone(),
                    site: site.map(|d| d.site.clone()).unwrap_or_default(),
                    backend: mem.caps.backend.clone(),
                    device: mem.caps.device.clone(),
                    operators: st.graph.nodes.len(),
                    params: st.graph.num_trainable(),
                    recompute_segments: plan.recompute_segments(s).unwrap_or(0),
                    measured_gflops: mem.caps.measured_gflops,
                    measured_memory_gbs: mem.caps.measured_memory_gbs,
                    calibration: mem.caps.calibration,
                    op_overhead_us: mem.caps.op_overhead_us,
                    reachable: self.reachable(m),
                    paths: paths_from(m),
                }
            })
            .collect();
        self.placement.sort_by_key(|p| (p.stage, p.replica));
        let placement = self.placement.clone();
        (self.on_event)(BrokerEvent::Placement(&placement));
        if self.job.cuts.is_none() && !self.plan_explanation.is_empty() {
            let lines = self.plan_explanation.clone();
            (self.on_event)(BrokerEvent::Plan(&lines));
        }
    }

    /// The assignment of stage `s` of replica `r`: its graph, the replica's plan, who it sends
    /// to (the stages that read its outputs, the next replica's same stage) and whose
    /// certificates it accepts tensors from.
    pub(super) fn assignment_for(
        &self,
        plan: &Plan,
        layout: &Layout,
        r: usize,
        s: usize,
        stage: &Stage,
    ) -> Flow<Assignment> {
        let json = |e: serde_json::Error| RuntimeError::Protocol(e.to_string());
        let r_count = layout.replicas.len();
        let nodes = &layout.replicas[r];
        let me = nodes[s];
        let ring: Vec<usize> = layout.replicas.iter().map(|n| n[s]).collect();
        let mut targets: Vec<(usize, usize)> = plan
            .peers_of(s)
            .into_iter()
            .map(|p| (p, nodes[p]))
            .collect();
        let mut senders: Vec<usize> = (0..nodes.len())
            .filter(|&p| plan.peers_of(p).contains(&s))
            .map(|p| nodes[p])
            .collect();
        if r_count > 1 {
            targets.push((s, ring[(r + 1) % r_count]));
            senders.push(ring[(r + r_count - 1) % r_count]);
        }
        let dial_senders = if self.reachable(me) {
            Vec::new()
        } else {
            senders
                .iter()
                .map(|&m| self.routed_link(me, m, 0, (m, me)))
                .collect()
        };
        let sender_certificates = senders
            .into_iter()
            .map(|m| {
                let mem = &self.members[m];
                (mem.id.clone(), mem.certificate.to_vec().into())
            })
            .collect();
        let replica_plan = Plan {
            stage_nodes: self.ids(nodes),
            ..plan.clone()
        };
        Ok(Assignment {
            generation: self.generation,
            stage: s as u32,
            stage_graph_json: serde_json::to_string(&stage.graph).map_err(json)?,
            plan_json: serde_json::to_string(&replica_plan).map_err(json)?,
            config_json: serde_json::to_string(&self.job.train).map_err(json)?,
            schedule: schedule_to_wire(self.job.schedule) as i32,
            peers: targets
                .into_iter()
                .map(|(p, m)| self.peer_link(me, m, p as u32))
                .collect(),
            optimizer_step: self.latest().opt_step,
            replica: r as u32,
            replicas: r_count as u32,
            ring: if r_count > 1 {
                self.ids(&ring)
            } else {
                Vec::new()
            },
            sender_certificates,
            islands: self.islands(),
            keep_state: false,
            dial_senders,
            relay_pairs: self.relay_pairs(plan, layout, me),
            fragments: self.stage_fragments(&stage.params),
        })
    }

    /// Waits until every node of `layout` has set its stage up. A node that could not load its
    /// stage from the shards (`from_shards`: a damaged copy, a full disk) makes the next attempt
    /// restore from the broker's own snapshot instead of looping.
    pub(super) async fn await_ready(&mut self, layout: &Layout, from_shards: bool) -> Flow<()> {
        let generation = self.generation;
        let ready = self
            .gather(
                &layout.all(),
                "nodes to set up their stages",
                Watch::Liveness,
                |_, _, m| {
                    Ok(match m.body {
                        Some(node_message::Body::Ready(r)) if r.generation == generation => {
                            Some(())
                        }
                        _ => None,
                    })
                },
            )
            .await;
        if let (Err(Interrupt::Failed { reason, .. }), true) = (&ready, from_shards) {
            tracing::warn!(
                "restoring from the sharded snapshot failed ({reason}); rolling back to the \
                 broker's snapshot"
            );
            self.sharded = None;
        }
        ready.map(|_| ())
    }
}
