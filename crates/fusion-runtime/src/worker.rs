//! One node's stage: it runs forward and backward for every micro-batch in the order of the
//! pipeline schedule, takes the activations and gradients it needs from the mailbox, hands the
//! ones it produces to the outbox, accumulates its parameters' gradients, sums the gradients of
//! parameters it shares with other stages, and applies the optimizer to the parameters it holds.
//! This is remote automatic differentiation: each stage runs the hand-written VJPs of its own
//! operators, and the chain rule continues on whichever machine produced the stage's inputs.

mod outer;
mod ring;
mod zero;
pub(crate) use zero::pieces;

use crate::dataplane::Outbox;
use crate::error::{Result, RuntimeError};
use crate::mailbox::{Key, Mailbox, Payload};
use crate::plan::{Plan, Source, StageRoutes};
use crate::progress::Handle;
use fusion_backend::{Backend, BinaryOp, Precision};
use fusion_compress::Codec;
use fusion_data::HostTensor;
use fusion_exec::{passes, Executor, ForwardPass, IdTensor, Mode, Pass, Schedule, Value};
use fusion_graph::Graph;
use fusion_proto::{Direction, Phase, TensorHeader};
use fusion_train::{OptimizerState, OuterOptimizer, PseudoGradientEncoder, TrainConfig};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a step produced on this node.
#[derive(Clone, Debug, Default)]
pub struct StepOutcome {
    pub losses: Vec<f32>,
    pub predictions: Vec<u32>,
    pub grad_square_sum: f64,
    pub compute_seconds: f64,
    pub wait_seconds: f64,
}

pub struct StageWorker<B: Backend> {
    pub stage: usize,
    plan: Arc<Plan>,
    routes: StageRoutes,
    exec: Executor<B>,
    /// Global parameter id of each local parameter.
    pub param_ids: Vec<usize>,
    /// Host master values of the local parameters and buffers.
    pub params: Vec<Vec<f32>>,
    pub opt: OptimizerState,
    cfg: TrainConfig,
    decay: Vec<bool>,
    trainable: Vec<bool>,
    /// Gradients summed over the last step's micro-batches (and over sharing stages).
    grads: Vec<Option<Vec<f32>>>,
    timeout: Duration,
    /// This node's replica index and the number of replicas of its stage (data parallelism).
    replica: usize,
    replicas: usize,
    /// Whether the stage is one of the job's islands (synchronised by the outer optimizer), also
    /// when the others were lost for the round and it is the only one.
    island: bool,
    /// Node id of the previous replica in the ring (all-reduce chunks come from it).
    ring_from: String,
    /// Where the stage is, for the node's heartbeats.
    progress: Handle,
    /// Test hook: the compute thread wedges at this training step (once per process: the flag).
    wedge: Option<(u64, Arc<AtomicBool>)>,
    /// Test hook: from this training step on, computing takes this many times as long.
    slowdown: Option<(u64, f64)>,
    /// Islands: the anchor and outer momentum of this stage's parameters (`worker/outer.rs`).
    outer: Option<OuterOptimizer>,
    /// Islands with sparse (top-k) pseudo-gradients: the encoder keeping each ring's residual
    /// (error feedback) between synchronisations.
    outer_encoder: Option<PseudoGradientEncoder>,
    /// The buffers (batch-norm statistics) as a training step found them, until its update:
    /// its forward passes change them in place, and a step abandoned before its update must
    /// leave them as they were for an assignment that keeps the state.
    buffers_before: Option<Vec<(usize, Vec<f32>)>>,
    /// The loss scale the current training step's backward started from (f16 jobs; else 1):
    /// its gradients are divided by it before the update.
    loss_scale: f32,
    /// The replicas shard the optimizer moments (`worker/zero.rs`): this replica's piece.
    shard: Option<zero::OptimizerShard>,
    /// Islands overlapping their synchronisations: the exchange under way and where this
    /// round began (`worker/outer.rs`).
    overlapped: outer::Overlapped,
    /// Streaming islands: the fragment of each parameter (`Assignment.fragments`; empty: the
    /// job does not stream).
    pub fragments: Vec<u32>,
}

/// The header of a tensor this stage sends.
fn header(step: u64, mb: usize, dir: Direction, id: usize, shape: &[usize]) -> TensorHeader {
    TensorHeader {
        step,
        micro_batch: mb as u32,
        edge: id as u64,
        direction: dir as i32,
        shape: shape.iter().map(|&d| d as u64).collect(),
        ..Default::default()
    }
}

/// Splits `n` values into `parts` nearly equal contiguous chunks: (start, len) of each.
pub fn ring_chunks(n: usize, parts: usize) -> Vec<(usize, usize)> {
    let parts = parts.max(1);
    (0..parts)
        .map(|c| {
            let start = c * n / parts;
            (start, (c + 1) * n / parts - start)
        })
        .collect()
}

impl<B: Backend> StageWorker<B> {
    pub fn new(
        backend: B,
        stage: usize,
        plan: Arc<Plan>,
        graph: Graph,
        param_ids: Vec<usize>,
        cfg: TrainConfig,
        timeout: Duration,
    ) -> Result<Self> {
        graph.validate()?;
        let routes = plan
            .stages
            .get(stage)
            .cloned()
            .ok_or_else(|| RuntimeError::Protocol(format!("the plan has no stage {stage}")))?;
        if routes.inputs.len() != graph.inputs.len() || routes.outputs.len() != graph.outputs.len()
        {
            return Err(RuntimeError::Protocol(format!(
                "stage {stage}'s graph has {} inputs and {} outputs, its routes {} and {}",
                graph.inputs.len(),
                graph.outputs.len(),
                routes.inputs.len(),
                routes.outputs.len()
            )));
        }
        if param_ids.len() != graph.params.len() {
            return Err(RuntimeError::Protocol(format!(
                "stage {stage} has {} parameters but {} global ids",
                graph.params.len(),
                param_ids.len()
            )));
        }
        let sizes: Vec<Option<usize>> = graph
            .params
            .iter()
            .map(|p| p.trainable.then(|| p.numel()))
            .collect();
        let opt = OptimizerState::new(&cfg.optimizer, &sizes);
        let decay = fusion_train::decay_mask(&graph);
        let trainable = graph.params.iter().map(|p| p.trainable).collect();
        let params = graph.params.iter().map(|p| vec![0.0; p.numel()]).collect();
        let n = graph.params.len();
        let segments = plan.recompute_segments(stage);
        Ok(StageWorker {
            stage,
            plan,
            routes,
            exec: Executor::new(backend, Arc::new(graph))?.with_recompute(segments),
            param_ids,
            params,
            opt,
            cfg,
            decay,
            trainable,
            grads: vec![None; n],
            timeout,
            replica: 0,
            replicas: 1,
            island: false,
            ring_from: String::new(),
            progress: Handle::detached(),
            wedge: None,
            slowdown: None,
            outer: None,
            outer_encoder: None,
            overlapped: outer::Overlapped::default(),
            fragments: Vec::new(),
            buffers_before: None,
            loss_scale: 1.0,
            shard: None,
        })
    }

    /// Makes this stage replica `replica` of `replicas` (gradients are all-reduced among them,
    /// or with `island` and an outer optimizer, the replicas are islands that synchronise);
    /// `ring_from` is the node the all-reduce chunks come from.
    pub fn set_replica(&mut self, replica: usize, replicas: usize, island: bool, ring_from: &str) {
        self.replica = replica;
        self.replicas = replicas.max(1);
        self.island = island;
        self.ring_from = ring_from.to_string();
    }

    /// Takes over the training state of `old`, the worker of the same stage before a
    /// re-assignment that kept it (island-local recovery: only the ring changed): parameters,
    /// optimizer moments and step, and the islands' anchor, outer momentum and residuals.
    pub fn adopt_state(&mut self, old: StageWorker<B>) -> Result<()> {
        let same = old.param_ids == self.param_ids
            && old.params.len() == self.params.len()
            && old
                .params
                .iter()
                .zip(&self.params)
                .all(|(a, b)| a.len() == b.len());
        if self.shard.is_some() || old.shard.is_some() {
            return Err(RuntimeError::Protocol(
                "an assignment keeping a sharded optimizer state (replicas restore from a \
                 snapshot)"
                    .into(),
            ));
        }
        if !same {
            return Err(RuntimeError::Protocol(format!(
                "an assignment keeping the state of stage {} for a stage of other parameters \
                 (stage {} held here)",
                self.stage, old.stage
            )));
        }
        self.params = old.params;
        // A step abandoned before its update leaves the buffers as it found them.
        for (i, values) in old.buffers_before.into_iter().flatten() {
            self.params[i] = values;
        }
        self.opt = old.opt;
        self.outer = old.outer;
        self.outer_encoder = match old.overlapped.in_progress() || old.outer_encoder.is_none() {
            // The exchange under way belonged to the old placement (its ring had the lost
            // island): dropped on every island left alike. A failed one took its encoder.
            true => self.abandon_exchange(old.overlapped),
            false => old.outer_encoder,
        };
        Ok(())
    }

    /// Reports this stage's progress through `progress` (the node's heartbeats read it).
    pub fn set_progress(&mut self, progress: Handle) {
        self.progress = progress;
    }

    /// Test hook: wedge the compute thread at training step `step` (once: `fired` is set).
    pub fn set_wedge(&mut self, step: u64, fired: Arc<AtomicBool>) {
        self.wedge = Some((step, fired));
    }

    /// Test hook: from training step `step` on, every step's compute takes `factor` times as
    /// long (the thread sleeps for the difference), as on a throttled or shared device.
    pub fn set_slowdown(&mut self, step: u64, factor: f64) {
        self.slowdown = Some((step, factor));
    }

    /// Test hook: stretches a step's `spent` compute seconds by the slowdown factor.
    fn maybe_slow(&self, step: u64, mode: Mode, spent: Duration) {
        if let Some((from, factor)) = self.slowdown {
            if mode == Mode::Train && step >= from && factor > 1.0 {
                std::thread::sleep(spent.mul_f64((factor - 1.0).min(1000.0)));
            }
        }
    }

    /// The node a received tensor comes from (empty when the plan does not say).
    fn peer_of(&self, key: &Key) -> String {
        if key.direction == Direction::AllReduce as i32
            || key.direction == Direction::OuterExchange as i32
        {
            return self.ring_from.clone();
        }
        self.plan
            .stage_nodes
            .get(key.from_stage as usize)
            .cloned()
            .unwrap_or_default()
    }

    /// Test hook: sleeps for an hour at the wedge step, as a compute thread stuck in a kernel
    /// (heartbeats go on; progress does not).
    fn maybe_wedge(&self, step: u64, mode: Mode) {
        if let Some((at, fired)) = &self.wedge {
            if mode == Mode::Train && step == *at && !fired.swap(true, Ordering::SeqCst) {
                tracing::warn!("test hook: the compute thread wedges at step {step}");
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }

    /// Number of trainable gradient values the ring all-reduce moves.
    fn flat_len(&self) -> usize {
        self.exec
            .graph()
            .params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.numel())
            .sum()
    }

    pub fn graph(&self) -> &Graph {
        self.exec.graph()
    }

    pub fn optimizer(&self) -> &fusion_train::OptimizerConfig {
        &self.cfg.optimizer
    }

    /// Shapes of everything this stage receives, by (direction, id): activations of its inputs
    /// from other stages, gradients of its outputs read by other stages, and shared parameters'
    /// gradients.
    pub fn expected_inbound(&self) -> HashMap<(i32, u64), Vec<usize>> {
        let g = self.exec.graph();
        let mut m = HashMap::new();
        for (route, local) in self.routes.inputs.iter().zip(&g.inputs) {
            if matches!(route.source, Source::Stage(_)) {
                m.insert(
                    (Direction::Activation as i32, route.tensor as u64),
                    g.tensor(*local).shape.clone(),
                );
            }
        }
        for (route, local) in self.routes.outputs.iter().zip(&g.outputs) {
            if !route.consumers.is_empty() {
                m.insert(
                    (Direction::Gradient as i32, route.tensor as u64),
                    g.tensor(*local).shape.clone(),
                );
            }
        }
        for sp in &self.routes.shared {
            if let Some(local) = self.param_ids.iter().position(|&p| p == sp.param) {
                m.insert(
                    (Direction::ParamGradient as i32, sp.param as u64),
                    g.params[local].shape.clone(),
                );
            }
        }
        if self.islands() {
            for (base, ring) in self.all_outer_rings() {
                let (len, sparse) = (self.ring_len(&ring), self.sparse_ring(&ring));
                for (c, (_, chunk)) in ring_chunks(len, self.replicas).into_iter().enumerate() {
                    let edge = (base + c) as u64;
                    // Sparse rounds pass each island's whole message around (edge: its island).
                    let n = if sparse { len } else { chunk };
                    m.insert((Direction::OuterExchange as i32, edge), vec![n]);
                }
            }
        } else if self.replicas > 1 {
            for (c, (_, len)) in ring_chunks(self.flat_len(), self.replicas)
                .into_iter()
                .enumerate()
            {
                m.insert((Direction::AllReduce as i32, c as u64), vec![len]);
            }
        }
        m
    }

    /// Waits for a peer's tensor (reported as waiting on that peer); a timeout is the peer's
    /// fault.
    fn take(&self, mailbox: &Mailbox, key: Key, what: impl Fn() -> String) -> Result<Payload> {
        let peer = self.peer_of(&key);
        let mb = key.micro_batch as usize;
        self.progress.enter(Phase::Waiting, key.step, mb, &peer);
        let got = mailbox.take(key, self.timeout, what);
        self.progress.resume();
        got.map_err(|e| match e {
            RuntimeError::Timeout(why) if !peer.is_empty() => RuntimeError::Peer {
                reason: format!("timed out: {why} ({peer})"),
                peer,
                proven: false,
            },
            e => e,
        })
    }

    /// Runs one training or evaluation step over `m` micro-batches; each loss is scaled by
    /// `1 / total` (`total` counts the micro-batches of every data-parallel replica).
    #[allow(clippy::too_many_arguments)]
    pub fn run_step(
        &mut self,
        step: u64,
        mode: Mode,
        m: usize,
        total: usize,
        schedule: Schedule,
        feeds: &mut HashMap<(usize, usize), HostTensor>,
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<StepOutcome> {
        if mode == Mode::Train && self.buffers_before.is_none() {
            let buffers = (0..self.params.len()).filter(|&i| !self.trainable[i]);
            self.buffers_before = Some(buffers.map(|i| (i, self.params[i].clone())).collect());
        }
        // Sharded optimizer state: not on parameters whose last all-gather failed.
        self.check_gathered()?;
        let b = self.exec.backend().clone();
        let t_start = Instant::now();
        let mut wait = Duration::ZERO;
        let mut device = self.exec.upload_params(&self.params)?;
        let graph = self.exec.graph().clone();
        let mut out = StepOutcome::default();
        let mut losses = vec![f32::NAN; m];
        let mut predictions: Vec<Vec<u32>> = vec![Vec::new(); m];
        let mut passes_held: HashMap<usize, ForwardPass<B>> = HashMap::new();
        let mut sum: Vec<Option<B::Tensor>> = (0..graph.params.len()).map(|_| None).collect();
        let seed = b.upload(vec![self.loss_scale / total.max(m).max(1) as f32], &[1])?;
        // f16 training: gradients that overflowed are contained on this node (see
        // `contain_overflow`), which then reports the overflow.
        let f16 = mode == Mode::Train && b.precision() == Precision::F16;
        let mut overflowed = false;
        let order = match mode {
            Mode::Train => passes(schedule, self.stage, self.plan.num_stages(), m),
            Mode::Eval => (0..m).map(Pass::Forward).collect(),
        };
        self.progress.enter(Phase::Computing, step, 0, "");
        self.maybe_wedge(step, mode);
        for pass in order {
            let (Pass::Forward(mb) | Pass::Backward(mb)) = pass;
            mailbox.check()?;
            self.progress.enter(Phase::Computing, step, mb, "");
            match pass {
                Pass::Forward(mb) => {
                    let mut local = HashMap::new();
                    for (route, lid) in self.routes.inputs.iter().zip(&graph.inputs) {
                        let info = graph.tensor(*lid);
                        let v = match route.source {
                            Source::Data => match feeds.remove(&(mb, route.tensor)) {
                                Some(HostTensor::Ids { data, shape }) => Value::Ids(
                                    IdTensor::new(data, shape)
                                        .map_err(|e| RuntimeError::Protocol(e.to_string()))?,
                                ),
                                Some(HostTensor::Float { data, shape }) => {
                                    Value::Float(b.upload(data, &shape)?)
                                }
                                None => {
                                    return Err(RuntimeError::Protocol(format!(
                                        "no feed for '{}' of micro-batch {mb} in step {step}",
                                        info.name
                                    )))
                                }
                            },
                            Source::Stage(p) => {
                                let t0 = Instant::now();
                                let data = self.take(
                                    mailbox,
                                    Key::new(
                                        step,
                                        mb as u32,
                                        Direction::Activation,
                                        route.tensor,
                                        p,
                                    ),
                                    || {
                                        format!(
                                            "activation '{}' of micro-batch {mb} from stage {p}",
                                            info.name
                                        )
                                    },
                                )?;
                                wait += t0.elapsed();
                                Value::Float(data.upload(&b, &info.shape)?)
                            }
                        };
                        local.insert(*lid, v);
                    }
                    let mut fp = self
                        .exec
                        .forward(&device, local, mode, mode == Mode::Train)?;
                    for (pid, t) in std::mem::take(&mut fp.buffer_updates) {
                        self.params[pid.0] = b.to_vec(&t)?;
                        device[pid.0] = t;
                    }
                    for (route, lid) in self.routes.outputs.iter().zip(&graph.outputs) {
                        let Some(v) = fp.output(*lid) else { continue };
                        let t = v
                            .float()
                            .map_err(|e| RuntimeError::Protocol(e.to_string()))?;
                        if !route.consumers.is_empty() {
                            let data = Payload::download(&b, t)?;
                            for &c in &route.consumers {
                                outbox.send(
                                    c,
                                    header(
                                        step,
                                        mb,
                                        Direction::Activation,
                                        route.tensor,
                                        &graph.tensor(*lid).shape,
                                    ),
                                    &data,
                                )?;
                            }
                        }
                        match route.graph_output {
                            Some(0) => {
                                losses[mb] = b.to_vec(t)?.first().copied().unwrap_or(f32::NAN)
                            }
                            Some(1) if mode == Mode::Eval => {
                                predictions[mb] = argmax_rows(
                                    &b.to_vec(t)?,
                                    graph.tensor(*lid).shape.last().copied().unwrap_or(1),
                                )
                            }
                            _ => {}
                        }
                    }
                    if mode == Mode::Train {
                        passes_held.insert(mb, fp);
                    }
                }
                Pass::Backward(mb) => {
                    let fp = passes_held.remove(&mb).ok_or_else(|| {
                        RuntimeError::Protocol(format!(
                            "backward of micro-batch {mb} before its forward"
                        ))
                    })?;
                    let mut seeds = HashMap::new();
                    for (route, lid) in self.routes.outputs.iter().zip(&graph.outputs) {
                        let info = graph.tensor(*lid);
                        let mut acc: Option<B::Tensor> = None;
                        if route.graph_output == Some(0) {
                            acc = Some(seed.clone());
                        }
                        for &c in &route.consumers {
                            let t0 = Instant::now();
                            let g = self.take(
                                mailbox,
                                Key::new(step, mb as u32, Direction::Gradient, route.tensor, c),
                                || {
                                    format!(
                                        "gradient of '{}' of micro-batch {mb} from stage {c}",
                                        info.name
                                    )
                                },
                            )?;
                            wait += t0.elapsed();
                            let g = g.upload(&b, &info.shape)?;
                            acc = Some(match acc {
                                Some(a) => b.binary(BinaryOp::Add, &a, &g)?,
                                None => g,
                            });
                        }
                        if let Some(a) = acc {
                            seeds.insert(*lid, a);
                        }
                    }
                    let grads = self.exec.backward(fp, &device, seeds)?;
                    for (route, lid) in self.routes.inputs.iter().zip(&graph.inputs) {
                        if let Source::Stage(p) = route.source {
                            let data = match grads.inputs.get(lid) {
                                Some(g) => {
                                    let mut p = Payload::download(&b, g)?;
                                    overflowed |= f16 && contain_overflow(&mut p);
                                    p
                                }
                                None => Payload::F32(vec![0.0; graph.tensor(*lid).numel()]),
                            };
                            outbox.send(
                                p,
                                header(
                                    step,
                                    mb,
                                    Direction::Gradient,
                                    route.tensor,
                                    &graph.tensor(*lid).shape,
                                ),
                                &data,
                            )?;
                        }
                    }
                    for (slot, g) in sum.iter_mut().zip(grads.params) {
                        if let Some(g) = g {
                            *slot = Some(b.accumulate(slot.take(), g)?);
                        }
                    }
                }
            }
        }
        if mode == Mode::Train {
            let mut host: Vec<Option<Vec<f32>>> = sum
                .iter()
                .zip(&self.trainable)
                .map(|(g, &tr)| match (g, tr) {
                    (Some(g), true) => b.to_vec(g).map(Some),
                    _ => Ok(None),
                })
                .collect::<std::result::Result<_, _>>()?;
            if f16 {
                for g in host.iter_mut().flatten() {
                    overflowed |= contain_overflow_in(g);
                }
            }
            let t0 = Instant::now();
            overflowed |= self.sum_shared(step, &sum, &mut host, mailbox, outbox)?;
            if self.is_sharded() {
                out.grad_square_sum = self.shard_gradients(step, &mut host, mailbox, outbox)?;
            } else {
                // Islands apply their own gradients; they meet at the outer synchronisation.
                if self.replicas > 1 && !self.islands() {
                    self.ring_all_reduce(step, &mut host, mailbox, outbox)?;
                }
                out.grad_square_sum = self.square_sum(&host);
            }
            wait += t0.elapsed();
            if overflowed {
                out.grad_square_sum = f64::INFINITY;
            }
            self.grads = host;
        }
        if self
            .routes
            .outputs
            .iter()
            .any(|o| o.graph_output == Some(0))
        {
            out.losses = losses;
        }
        out.predictions = predictions.concat();
        self.progress.idle();
        self.maybe_slow(step, mode, t_start.elapsed().saturating_sub(wait));
        out.wait_seconds = wait.as_secs_f64();
        out.compute_seconds = t_start.elapsed().saturating_sub(wait).as_secs_f64();
        Ok(out)
    }

    /// The sum of squares of the gradients that count in the global norm here.
    fn square_sum(&self, host: &[Option<Vec<f32>>]) -> f64 {
        host.iter()
            .enumerate()
            .filter(|(i, _)| self.counts_in_norm(*i))
            .filter_map(|(_, g)| g.as_ref())
            .fold(0.0, |sum, g| sum + fusion_train::square_sum(g))
    }

    /// Whether local parameter `i` counts in the global gradient norm here (a shared parameter
    /// counts once, on the first stage that holds it).
    fn counts_in_norm(&self, i: usize) -> bool {
        let gid = self.param_ids[i];
        self.routes
            .shared
            .iter()
            .find(|sp| sp.param == gid)
            .is_none_or(|sp| sp.stages.first() == Some(&self.stage))
    }

    /// Exchanges the gradients of shared parameters with the other stages holding them and sums
    /// the parts in stage order, in f64, so every holder ends with bit-identical sums (and
    /// parameters). Parts travel at the sender's precision. Whether this stage's part
    /// overflowed (f16 training: it travels as zeros).
    fn sum_shared(
        &self,
        step: u64,
        sum: &[Option<B::Tensor>],
        host: &mut [Option<Vec<f32>>],
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<bool> {
        let b = self.exec.backend();
        let f16 = b.precision() == Precision::F16;
        let mut overflowed = false;
        for sp in &self.routes.shared {
            let Some(local) = self.param_ids.iter().position(|&p| p == sp.param) else {
                continue;
            };
            let spec = &self.exec.graph().params[local];
            let mut mine = match &sum[local] {
                Some(g) => Payload::download(b, g)?,
                None => Payload::F32(vec![0.0; spec.numel()]),
            };
            overflowed |= f16 && contain_overflow(&mut mine);
            for &s in &sp.stages {
                if s != self.stage {
                    outbox.send(
                        s,
                        header(step, 0, Direction::ParamGradient, sp.param, &spec.shape),
                        &mine,
                    )?;
                }
            }
            let mut total = vec![0.0f64; spec.numel()];
            for &s in &sp.stages {
                let part = if s == self.stage {
                    mine.clone()
                } else {
                    self.take(
                        mailbox,
                        Key::new(step, 0, Direction::ParamGradient, sp.param, s),
                        || {
                            format!(
                                "gradient of shared parameter '{}' from stage {s}",
                                spec.name
                            )
                        },
                    )?
                };
                total
                    .iter_mut()
                    .zip(part.into_f64())
                    .for_each(|(a, p)| *a += p);
            }
            host[local] = Some(total.into_iter().map(|v| v as f32).collect());
        }
        Ok(overflowed)
    }

    /// Sums the gradients of every replica of this stage with a ring all-reduce: the trainable
    /// gradients, concatenated, are cut into one chunk per replica; in R-1 reduce-scatter steps
    /// each replica adds the chunk its predecessor passes on, in R-1 all-gather steps the fully
    /// reduced chunks travel around. Each replica sends 2(R-1)/R of the gradient bytes, whatever R,
    /// and all replicas end with identical sums.
    fn ring_all_reduce(
        &self,
        step: u64,
        host: &mut [Option<Vec<f32>>],
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<()> {
        let graph = self.exec.graph();
        let mut flat = self.flat_gradients(host);
        self.ring(Direction::AllReduce).ring_sum(
            step,
            0,
            &mut flat,
            Codec::None,
            mailbox,
            outbox,
        )?;
        let mut off = 0;
        for (g, spec) in host.iter_mut().zip(&graph.params) {
            if spec.trainable {
                *g = Some(flat[off..off + spec.numel()].to_vec());
                off += spec.numel();
            }
        }
        Ok(())
    }

    /// The trainable gradients of `host`, concatenated in parameter order (zeros where a
    /// parameter got none): the vector the replicas' rings sum.
    fn flat_gradients(&self, host: &[Option<Vec<f32>>]) -> Vec<f32> {
        let mut flat: Vec<f32> = Vec::with_capacity(self.flat_len());
        for (g, spec) in host.iter().zip(&self.exec.graph().params) {
            if spec.trainable {
                match g {
                    Some(g) => flat.extend_from_slice(g),
                    None => flat.extend(std::iter::repeat_n(0.0, spec.numel())),
                }
            }
        }
        flat
    }

    /// Sets the loss scale of the next training step (`RunStep.loss_scale`; 0: none), checked to
    /// be one backward's seed can start from (positive, finite, within f16's range).
    pub fn set_loss_scale(&mut self, scale: f32) -> Result<()> {
        self.loss_scale = match scale {
            0.0 => 1.0,
            s if s.is_finite() && (1.0..=65504.0).contains(&s) => s,
            s => {
                return Err(RuntimeError::Protocol(format!(
                    "a loss scale of {s} (1 to 65504, or 0 for none)"
                )))
            }
        };
        Ok(())
    }

    /// Drops the step's gradients without an update (an f16 step whose gradients overflowed on
    /// some node): parameters and optimizer moments stay as they are, the buffers keep what the
    /// step's forward passes made of them, as in one process.
    pub fn skip_update(&mut self, step: u64) {
        self.progress.enter(Phase::Updating, step, 0, "");
        self.buffers_before = None;
        self.grads = vec![None; self.params.len()];
        self.progress.idle();
    }

    /// Divides the step's gradients by its loss scale, scales them by `scale` (clipping) and
    /// applies the optimizer (replicas sharding their optimizer state: to their own chunk, and
    /// [`gather_parameters`](Self::gather_parameters) must follow).
    pub fn apply_update(&mut self, step: u64, lr: f32, scale: f32) {
        self.progress.enter(Phase::Updating, step, 0, "");
        self.buffers_before = None;
        if self.loss_scale != 1.0 {
            fusion_train::unscale_gradients(&mut self.grads, self.loss_scale);
        }
        if scale != 1.0 {
            for g in self.grads.iter_mut().flatten() {
                g.iter_mut().for_each(|x| *x *= scale);
            }
        }
        let grads = std::mem::take(&mut self.grads);
        if !self.update_shard(lr, &grads) {
            self.opt.update(
                &self.cfg.optimizer,
                &mut self.params,
                &grads,
                &self.decay,
                lr,
            );
        }
        self.grads = vec![None; self.params.len()];
        self.progress.idle();
    }
}

/// An f16 training step's gradient holding an infinite or NaN value (an overflow at the loss
/// scale) is zeroed before it leaves the node or joins a sum: peers refuse non-finite values as
/// a fault, and the node reports the overflow itself (an infinite gradient norm), so the broker
/// skips the step everywhere, as one f16 process skips it. Whether it overflowed.
fn contain_overflow(p: &mut Payload) -> bool {
    match p {
        Payload::F32(v) => contain_overflow_in(v),
        Payload::F64(_) => false,
    }
}

fn contain_overflow_in(v: &mut [f32]) -> bool {
    if v.iter().all(|x| x.is_finite()) {
        return false;
    }
    v.iter_mut().for_each(|x| *x = 0.0);
    true
}

/// Index of the largest value in each row of `classes` values.
fn argmax_rows(logits: &[f32], classes: usize) -> Vec<u32> {
    logits
        .chunks(classes.max(1))
        .map(|row| {
            row.iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |acc, (i, &v)| {
                    if v > acc.1 {
                        (i, v)
                    } else {
                        acc
                    }
                })
                .0 as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignment::{check_assignment, first_of_two};
    use fusion_backend::ReferenceBackend;

    /// Stage 0 of two of resnet-tiny (it holds batch-norm statistics, buffers).
    fn stage0() -> StageWorker<ReferenceBackend> {
        let graph = fusion_models::ModelSpec::preset("resnet-tiny")
            .and_then(|m| m.graph(2, 1))
            .expect("graph");
        let a = first_of_two(&graph).expect("assignment");
        let c = check_assignment(&a, 0).expect("checked");
        let plan = Arc::new(c.plan);
        let w = StageWorker::new(
            ReferenceBackend,
            c.stage,
            plan,
            c.graph,
            c.param_ids,
            c.train,
            Duration::from_secs(1),
        );
        w.expect("worker")
    }

    /// A worker kept across an assignment hands over its parameters, moments and step, with
    /// the buffers a step abandoned before its update moved put back as it found them; a worker
    /// of other parameters is refused.
    #[test]
    fn a_kept_state_moves_over_with_an_abandoned_steps_buffers_put_back() {
        let mut old = stage0();
        let buffer = old.trainable.iter().position(|t| !t).expect("a buffer");
        let weight = old.trainable.iter().position(|&t| t).expect("a weight");
        old.params[weight].fill(0.25);
        old.params[buffer].fill(9.0);
        old.opt.step = 7;
        old.buffers_before = Some(vec![(buffer, vec![1.5; old.params[buffer].len()])]);
        let mut new = stage0();
        new.adopt_state(old).expect("same stage");
        assert!(new.params[weight].iter().all(|&x| x == 0.25));
        assert!(new.params[buffer].iter().all(|&x| x == 1.5));
        assert_eq!(new.opt.step, 7);
        // An applied update commits the buffers: nothing to put back.
        new.apply_update(7, 0.0, 1.0);
        assert!(new.buffers_before.is_none());
        let mut other = stage0();
        other.param_ids.push(usize::MAX);
        let err = stage0().adopt_state(other).expect_err("other parameters");
        assert!(err.to_string().contains("keeping the state"), "{err}");
    }

    /// [`stage0`] as island 0 of 2 of a streaming job of 3 fragments, its tensors cut as the
    /// broker cuts the model's.
    fn streaming_island() -> StageWorker<ReferenceBackend> {
        let mut w = stage0();
        w.cfg.outer = Some(fusion_train::OuterConfig {
            fragments: 3,
            ..fusion_train::OuterConfig::averaging(3)
        });
        w.set_replica(0, 2, true, "peer");
        let sizes: Vec<usize> = w.params.iter().map(Vec::len).collect();
        w.fragments = fusion_train::fragment_of(&sizes, 3);
        w.start_outer();
        w
    }

    /// Every ring a streaming island may run (the whole model's, then each fragment's) sends on
    /// edges of its own, each fragment's rings hold exactly its tensors, and a fragment the
    /// job does not have, or one for a stage assigned none, is refused.
    #[test]
    fn streaming_ring_sets_use_distinct_edges_and_cover_each_fragment() {
        let w = streaming_island();
        let mut edges = std::collections::HashSet::new();
        for (base, ring) in w.all_outer_rings() {
            assert!(!ring.is_empty());
            for c in 0..w.replicas {
                assert!(edges.insert(base + c), "edge {} twice", base + c);
            }
        }
        for f in 0..3 {
            let members = w.sync_members(Some(f)).expect("a fragment of the job");
            let mut held: Vec<usize> = w.member_rings(&members).concat();
            held.sort_unstable();
            let want: Vec<usize> = (0..w.params.len()).filter(|&i| members[i]).collect();
            assert_eq!(held, want, "fragment {f}");
        }
        let err = w.sync_members(Some(3)).expect_err("no fragment 3");
        assert!(
            err.to_string().contains("fragment 3 in a job of 3"),
            "{err}"
        );
        let mut none = streaming_island();
        none.fragments.clear();
        let err = none.sync_members(Some(0)).expect_err("no fragments");
        assert!(err.to_string().contains("assigned no fragments"), "{err}");
    }

    /// Island-local recovery with an overlapped exchange under way: the new worker drops it
    /// (its thread's result is not applied), gets an encoder back, and measures its next
    /// delta from the anchor, so the dropped round's progress is in it.
    #[test]
    fn a_kept_state_drops_the_exchange_under_way_and_keeps_its_progress() {
        let mut old = streaming_island();
        let weight = old.trainable.iter().position(|&t| t).expect("a weight");
        let anchor = old.params[weight].clone();
        old.params[weight].iter_mut().for_each(|x| *x += 0.5);
        let launched = old.params[weight].clone();
        old.overlapped.start = vec![None; old.params.len()];
        old.overlapped.start[weight] = Some(launched);
        let encoder = old.outer_encoder.take().expect("an encoder");
        // An exchange that ended with a mean that must not be applied.
        let n = old.params.len();
        old.overlapped.pending = Some(std::thread::spawn(move || {
            Ok((vec![Some(vec![1e6f32]); n], encoder))
        }));
        old.params[weight].iter_mut().for_each(|x| *x += 0.25);
        let mut new = streaming_island();
        new.adopt_state(old).expect("same stage");
        assert!(new.outer_encoder.is_some());
        let outer = new.outer.as_ref().expect("islands");
        assert_eq!(
            outer.anchor[weight], anchor,
            "the dropped round was not applied"
        );
        let every = vec![true; new.params.len()];
        let deltas = new.member_deltas(&every).expect("deltas");
        let d = deltas[weight].as_ref().expect("a member");
        assert!(
            d.iter().all(|&x| (x + 0.75).abs() < 1e-6),
            "both rounds' progress"
        );
    }
}
