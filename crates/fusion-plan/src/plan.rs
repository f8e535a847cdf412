//! A plan (which operators form each stage, which devices run it) and the cost model every
//! scheduler optimises: predicted step time per replica from the busiest resource per
//! micro-batch, the pipeline's fill and drain, and the all-reduce of replicated stages.

use crate::error::PlanError;
use crate::network::Network;
use fusion_compress::AdaTopKPolicy;
use fusion_estimate::Workload;
use fusion_exec::Schedule;
use fusion_sim::{Edge, Exchange, Link, Pipeline, Prediction, Replication, StageTime};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Stages cut from the operators in topological order, each run by one device per replica.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// First operator position of each stage (`starts[0] = 0`, ascending).
    pub starts: Vec<usize>,
    /// `devices[s][r]`: the device running stage `s` in data-parallel replica `r`.
    pub devices: Vec<Vec<usize>>,
}

impl Plan {
    pub fn stages(&self) -> usize {
        self.starts.len()
    }

    pub fn replicas(&self) -> usize {
        self.devices.first().map_or(0, Vec::len)
    }

    /// Operator positions of stage `s` in a graph of `n` operators.
    pub fn range(&self, s: usize, n: usize) -> Range<usize> {
        self.starts[s]..self.starts.get(s + 1).copied().unwrap_or(n)
    }

    /// Fences: the first operator of every stage after the first.
    pub fn cuts(&self) -> &[usize] {
        &self.starts[1..]
    }
}

/// What a scheduler plans for: the workload, the devices and links, and the step's shape.
pub struct Problem<'a> {
    pub workload: &'a Workload,
    pub network: &'a Network,
    /// Micro-batches per step and replica.
    pub micro_batches: usize,
    pub schedule: Schedule,
    /// Compute seconds of every operator prefix on every device (`prefix[d][p]`).
    prefix: Vec<Vec<f64>>,
    /// Forward seconds of every operator prefix on every device: what recomputation repeats.
    fwd_prefix: Vec<Vec<f64>>,
    /// Whether a stage that does not fit in memory may recompute its activations in backward
    /// (on by default; see [`Problem::without_recompute`]).
    pub recompute: bool,
    /// Every stage recomputes, whether it needs to or not ([`Problem::always_recompute`]).
    pub recompute_always: bool,
    /// `Workload::recompute_memory` of the ranges asked so far (the programs ask for the same
    /// range once per device and per set of devices used).
    recompute_memo: std::sync::Mutex<std::collections::HashMap<(usize, usize), (f64, f64)>>,
    /// Prefix sums of state bytes (weights, gradients, optimizer), of the optimizer's share of
    /// them, and of activation bytes.
    state_prefix: Vec<f64>,
    optimizer_prefix: Vec<f64>,
    activation_prefix: Vec<f64>,
    /// The replicas of a stage shard its optimizer state (ZeRO stage 1, the runtime's
    /// `--shard-optimizer`): each holds 1/R of the moments and updates 1/R of the parameters
    /// ([`Problem::sharding_optimizer`]).
    pub shard_optimizer: bool,
    /// AdaTopK on every link that needs it (None: tensors travel dense).
    pub compression: Option<AdaTopKPolicy>,
}

/// The resource that bounds throughput.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resource {
    Stage(usize),
    Link { from: usize, to: usize },
    AllReduce(usize),
}

/// The cost model's verdict on a plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Evaluation {
    /// Predicted seconds per step: `(M - 1) * bottleneck + fill + all-reduce + exchange + update`.
    pub step_s: f64,
    /// Step seconds divided by the replicas: what the schedulers minimise (lower is faster).
    pub objective: f64,
    /// Busy seconds per micro-batch of the busiest stage or link.
    pub bottleneck_s: f64,
    pub bottleneck: Resource,
    /// One micro-batch's way through every stage and back.
    pub fill_s: f64,
    pub allreduce_s: f64,
    /// The slowest exchange of shared-parameter gradients between stages after the pipeline.
    pub exchange_s: f64,
    /// The slowest stage's optimizer update.
    pub update_s: f64,
    /// Forward plus backward seconds per micro-batch of each stage (its slowest replica).
    pub stage_s: Vec<f64>,
    /// `(from, to, bytes per micro-batch, seconds on the slowest replica's link)`.
    pub links: Vec<(usize, usize, f64, f64)>,
    /// Largest share of a device's memory a stage needs (above 1: does not fit).
    pub memory_use: f64,
    /// Per stage: whether it recomputes its activations in backward (it fits only so).
    pub recompute: Vec<bool>,
}

impl Evaluation {
    pub fn fits(&self) -> bool {
        self.memory_use <= 1.0
    }
}

impl<'a> Problem<'a> {
    pub fn new(
        workload: &'a Workload,
        network: &'a Network,
        micro_batches: usize,
        schedule: Schedule,
    ) -> Result<Self, PlanError> {
        if workload.is_empty() {
            return Err(PlanError::Invalid("the workload has no operators".into()));
        }
        if micro_batches == 0 {
            return Err(PlanError::Invalid(
                "at least one micro-batch per step".into(),
            ));
        }
        network.validate()?;
        let mut prefix: Vec<Vec<f64>> = Vec::with_capacity(network.len());
        let mut fwd_prefix: Vec<Vec<f64>> = Vec::with_capacity(network.len());
        for (i, d) in network.devices.iter().enumerate() {
            // Devices of one class share their figures: compute their prefix sums once.
            let same = network.devices[..i].iter().position(|e| {
                e.dense_flops_per_s == d.dense_flops_per_s
                    && e.memory_bytes_per_s == d.memory_bytes_per_s
                    && e.calibration == d.calibration
                    && e.op_overhead_s == d.op_overhead_s
            });
            let (p, f) = match same {
                Some(j) => (prefix[j].clone(), fwd_prefix[j].clone()),
                None => (d.prefix_times(workload), d.forward_prefix_times(workload)),
            };
            prefix.push(p);
            fwd_prefix.push(f);
        }
        let (mut state_prefix, mut activation_prefix) = (vec![0.0], vec![0.0]);
        let mut optimizer_prefix = vec![0.0];
        for o in &workload.ops {
            let (s, a, opt) = (
                state_prefix[state_prefix.len() - 1],
                activation_prefix[activation_prefix.len() - 1],
                optimizer_prefix[optimizer_prefix.len() - 1],
            );
            state_prefix.push(s + o.param_bytes + o.grad_bytes + o.optimizer_bytes);
            optimizer_prefix.push(opt + o.optimizer_bytes);
            activation_prefix.push(a + o.activation_bytes);
        }
        Ok(Problem {
            workload,
            network,
            micro_batches,
            schedule,
            prefix,
            fwd_prefix,
            recompute: true,
            recompute_always: false,
            recompute_memo: Default::default(),
            state_prefix,
            optimizer_prefix,
            activation_prefix,
            shard_optimizer: false,
            compression: None,
        })
    }

    /// Plans without activation recomputation: a stage fits with its whole tape or not at all.
    pub fn without_recompute(mut self) -> Self {
        self.recompute = false;
        self.recompute_always = false;
        self
    }

    /// Plans as the runtime runs a job with recomputation forced on: every stage recomputes,
    /// and pays its forward again.
    pub fn always_recompute(mut self) -> Self {
        self.recompute = true;
        self.recompute_always = true;
        self
    }

    /// Plans as the runtime runs a job whose replicas shard their optimizer state: a stage of R
    /// replicas keeps 1/R of its optimizer bytes on each device and each replica updates 1/R of
    /// the parameters (the ring moves the bytes of an all-reduce either way).
    pub fn sharding_optimizer(mut self) -> Self {
        self.shard_optimizer = true;
        self
    }

    /// The same problem (workload, schedule, recomputation, sharding, compression) on the
    /// devices and links of `network`.
    pub fn on_network<'b>(&self, network: &'b Network) -> Result<Problem<'b>, PlanError>
    where
        'a: 'b,
    {
        let mut q = Problem::new(self.workload, network, self.micro_batches, self.schedule)?;
        q.recompute = self.recompute;
        q.recompute_always = self.recompute_always;
        q.shard_optimizer = self.shard_optimizer;
        q.compression = self.compression;
        Ok(q)
    }

    /// This problem with the replicas sharding their optimizer state, or not.
    pub fn with_sharding(&self, on: bool) -> Result<Problem<'a>, PlanError> {
        let mut q = self.on_network(self.network)?;
        q.shard_optimizer = on;
        Ok(q)
    }

    /// Plans and predicts with AdaTopK compressing the links that would otherwise be slower
    /// than the slowest stage.
    pub fn with_compression(mut self, policy: AdaTopKPolicy) -> Self {
        self.compression = Some(policy);
        self
    }

    /// Seconds on a link of `bytes_per_s` for `bytes` of f32 tensors per micro-batch, compressed
    /// by AdaTopK (when on) to fit `target_s`.
    pub fn wire_seconds(&self, bytes: f64, bytes_per_s: f64, target_s: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        bytes / bytes_per_s / self.compression_ratio(bytes, bytes_per_s, target_s)
    }

    /// Dense bytes over the bytes AdaTopK sends (1 without compression or when the link fits).
    pub fn compression_ratio(&self, bytes: f64, bytes_per_s: f64, target_s: f64) -> f64 {
        match &self.compression {
            Some(pol) if bytes > 0.0 && bytes_per_s.is_finite() => {
                let n = (bytes / 4.0).round() as usize;
                match pol.choose(n, bytes_per_s, target_s) {
                    fusion_compress::Codec::None => 1.0,
                    c => (bytes / pol.bytes(n, c)).max(1.0),
                }
            }
            _ => 1.0,
        }
    }

    /// The link from device `a` to device `b` (bandwidth, latency), infinitely fast within a
    /// device.
    fn link(&self, a: usize, b: usize) -> (f64, f64) {
        if a == b {
            (f64::INFINITY, 0.0)
        } else {
            (self.network.bandwidth[a][b], self.network.latency[a][b])
        }
    }

    pub fn ops(&self) -> usize {
        self.workload.len()
    }

    pub fn devices(&self) -> usize {
        self.network.len()
    }

    /// Forward plus backward seconds of operators `a..b` on device `d`.
    pub fn compute(&self, d: usize, a: usize, b: usize) -> f64 {
        self.prefix[d][b] - self.prefix[d][a]
    }

    /// Seconds to move `bytes` from device `a` to device `b`, without latency.
    pub fn transfer(&self, a: usize, b: usize, bytes: f64) -> f64 {
        if a == b || bytes <= 0.0 {
            0.0
        } else {
            bytes / self.network.bandwidth[a][b]
        }
    }

    /// Micro-batches a stage holds activations for at once.
    pub fn in_flight(&self, stage: usize, stages: usize) -> usize {
        match self.schedule {
            Schedule::GPipe => self.micro_batches,
            Schedule::OneFOneB => self.micro_batches.min(stages - stage),
        }
    }

    /// Bytes of weights, gradients and optimizer state of operators `a..b` on each of
    /// `replicas` replicas (sharded: 1/R of the optimizer's).
    pub fn state_bytes(&self, a: usize, b: usize, replicas: usize) -> f64 {
        let state = self.state_prefix[b] - self.state_prefix[a];
        let r = replicas.max(1) as f64;
        match self.shard_optimizer {
            true => state - (self.optimizer_prefix[b] - self.optimizer_prefix[a]) * (1.0 - 1.0 / r),
            false => state,
        }
    }

    /// Share of device `d`'s memory that operators `a..b` need with `in_flight` micro-batches,
    /// as one of `replicas` replicas.
    pub fn memory_use(
        &self,
        d: usize,
        (a, b): (usize, usize),
        in_flight: usize,
        replicas: usize,
    ) -> f64 {
        let state = self.state_bytes(a, b, replicas);
        let act = self.activation_prefix[b] - self.activation_prefix[a];
        (state + act * in_flight as f64) / self.network.devices[d].memory_capacity_bytes
    }

    /// Share of device `d`'s memory that operators `a..b` need when they recompute their
    /// activations: each micro-batch in flight keeps only what crosses into a segment, and one
    /// segment's activations are rebuilt at a time.
    pub fn memory_use_recomputed(
        &self,
        d: usize,
        (a, b): (usize, usize),
        in_flight: usize,
        replicas: usize,
    ) -> f64 {
        let state = self.state_bytes(a, b, replicas);
        let (kept, largest) = self.recompute_bytes(a, b);
        (state + kept * in_flight as f64 + largest) / self.network.devices[d].memory_capacity_bytes
    }

    /// Kept and rebuilt activation bytes of operators `a..b` when they recompute, memoised.
    fn recompute_bytes(&self, a: usize, b: usize) -> (f64, f64) {
        let compute = || {
            let k = fusion_exec::default_segments(b - a);
            self.workload.recompute_memory(a..b, k)
        };
        match self.recompute_memo.lock() {
            Ok(mut memo) => *memo.entry((a, b)).or_insert_with(compute),
            Err(_) => compute(),
        }
    }

    /// How operators `a..b` fit on every device of `devices`: `Some(false)` storing their
    /// activations, `Some(true)` only recomputing them (when allowed), `None` not at all.
    pub fn stage_fit(
        &self,
        devices: &[usize],
        a: usize,
        b: usize,
        in_flight: usize,
    ) -> Option<bool> {
        let all = |f: &dyn Fn(usize) -> f64| devices.iter().all(|&d| f(d) <= 1.0);
        let r = devices.len();
        if self.recompute_always {
            return all(&|d| self.memory_use_recomputed(d, (a, b), in_flight, r)).then_some(true);
        }
        if all(&|d| self.memory_use(d, (a, b), in_flight, r)) {
            Some(false)
        } else if self.recompute && all(&|d| self.memory_use_recomputed(d, (a, b), in_flight, r)) {
            Some(true)
        } else {
            None
        }
    }

    /// Whether stage `s` of `plan` recomputes its activations (the rule every cost here uses).
    pub fn recomputes(&self, plan: &Plan, s: usize) -> bool {
        let r = plan.range(s, self.ops());
        let flight = self.in_flight(s, plan.stages());
        self.stage_fit(&plan.devices[s], r.start, r.end, flight) == Some(true)
    }

    /// Forward plus backward seconds of operators `a..b` on device `d`, with the forward run a
    /// second time when the stage recomputes.
    pub fn stage_compute(&self, d: usize, a: usize, b: usize, recompute: bool) -> f64 {
        let again = if recompute {
            self.fwd_prefix[d][b] - self.fwd_prefix[d][a]
        } else {
            0.0
        };
        self.compute(d, a, b) + again
    }

    /// Checks that `plan` covers the graph in order with distinct devices and equal replicas.
    pub fn check(&self, plan: &Plan) -> Result<(), PlanError> {
        let n = self.ops();
        let bad = |m: String| Err(PlanError::Invalid(m));
        if plan.starts.first() != Some(&0) || plan.starts.len() != plan.devices.len() {
            return bad("a plan starts at operator 0 and names devices for every stage".into());
        }
        if plan.starts.windows(2).any(|w| w[0] >= w[1]) || plan.starts.last() >= Some(&n) {
            return bad(format!(
                "stage starts {:?} must ascend within {n} operators",
                plan.starts
            ));
        }
        let r = plan.replicas();
        let mut used = vec![false; self.devices()];
        for (s, ds) in plan.devices.iter().enumerate() {
            if ds.len() != r || r == 0 {
                return bad(format!(
                    "stage {s} has {} replicas, stage 0 has {r}",
                    ds.len()
                ));
            }
            for &d in ds {
                if d >= used.len() || std::mem::replace(&mut used[d], true) {
                    return bad(format!("device {d} is unknown or runs two stages"));
                }
            }
        }
        Ok(())
    }

    /// The cost model. A tensor read by several stages is sent to each; a replicated stage
    /// waits for its slowest replica and all-reduces its gradients over its slowest ring link.
    pub fn evaluate(&self, plan: &Plan) -> Result<Evaluation, PlanError> {
        self.check(plan)?;
        let n = self.ops();
        let stages = plan.stages();
        let r = plan.replicas();
        let mut stage_s = Vec::with_capacity(stages);
        let mut recompute = Vec::with_capacity(stages);
        let mut memory_use: f64 = 0.0;
        for (s, ds) in plan.devices.iter().enumerate() {
            let (a, b) = (plan.range(s, n).start, plan.range(s, n).end);
            let flight = self.in_flight(s, stages);
            let again = self.recomputes(plan, s);
            let mut worst: f64 = 0.0;
            for &d in ds {
                worst = worst.max(self.stage_compute(d, a, b, again));
                memory_use = memory_use.max(if again {
                    self.memory_use_recomputed(d, (a, b), flight, r)
                } else {
                    self.memory_use(d, (a, b), flight, r)
                });
            }
            stage_s.push(worst);
            recompute.push(again);
        }
        // AdaTopK compresses a link to fit the slowest stage's compute.
        let target = stage_s.iter().copied().fold(0.0, f64::max);
        let links: Vec<(usize, usize, f64, f64)> = self
            .workload
            .traffic(plan.cuts())
            .into_iter()
            .map(|(a, b, bytes)| {
                let secs = (0..r)
                    .map(|k| {
                        let (x, y) = (plan.devices[a][k], plan.devices[b][k]);
                        let there = self.wire_seconds(bytes, self.link(x, y).0, target);
                        let back = self.wire_seconds(bytes, self.link(y, x).0, target);
                        there.max(back)
                    })
                    .fold(0.0, f64::max);
                (a, b, bytes, secs)
            })
            .collect();
        let (mut bottleneck, mut bottleneck_s) = (Resource::Stage(0), -1.0);
        for (s, &t) in stage_s.iter().enumerate() {
            if t > bottleneck_s {
                (bottleneck, bottleneck_s) = (Resource::Stage(s), t);
            }
        }
        for &(a, b, _, t) in &links {
            if t > bottleneck_s {
                (bottleneck, bottleneck_s) = (Resource::Link { from: a, to: b }, t);
            }
        }
        let mut fill_s: f64 = stage_s.iter().sum();
        for s in 0..stages.saturating_sub(1) {
            let hop = (0..r)
                .map(|k| {
                    let (x, y) = (plan.devices[s][k], plan.devices[s + 1][k]);
                    self.network.latency[x][y].max(self.network.latency[y][x])
                })
                .fold(0.0, f64::max);
            let send = links
                .iter()
                .find(|l| l.0 == s && l.1 == s + 1)
                .map_or(0.0, |l| l.3);
            fill_s += 2.0 * (send + hop);
        }
        let (mut allreduce_s, mut allreduce_stage) = (0.0, 0);
        if r > 1 {
            let k = r as f64;
            for s in 0..stages {
                let ring = self.ring(&plan.devices[s]);
                let g = self.workload.grad_bytes(plan.range(s, n));
                let t =
                    2.0 * (k - 1.0) / k * g / ring.bytes_per_s + 2.0 * (k - 1.0) * ring.latency_s;
                if t > allreduce_s {
                    (allreduce_s, allreduce_stage) = (t, s);
                }
            }
        }
        let m = self.micro_batches as f64;
        if allreduce_s > m * bottleneck_s {
            bottleneck = Resource::AllReduce(allreduce_stage);
        }
        let exchange_s = self
            .exchanges(plan)
            .iter()
            .map(|x| {
                (x.bytes / x.a_to_b.bytes_per_s + x.a_to_b.latency_s)
                    .max(x.bytes / x.b_to_a.bytes_per_s + x.b_to_a.latency_s)
            })
            .fold(0.0, f64::max);
        let update_s = self.updates(plan).into_iter().fold(0.0, f64::max);
        let step_s = (m - 1.0) * bottleneck_s + fill_s + allreduce_s + exchange_s + update_s;
        let mut objective = step_s / r as f64;
        if memory_use > 1.0 {
            objective = f64::INFINITY;
        }
        Ok(Evaluation {
            step_s,
            objective,
            bottleneck_s,
            bottleneck,
            fill_s,
            allreduce_s,
            exchange_s,
            update_s,
            stage_s,
            links,
            memory_use,
            recompute,
        })
    }

    /// The slowest link of the ring through `devices` (in order, wrapping around).
    fn ring(&self, devices: &[usize]) -> Link {
        let mut bw = f64::INFINITY;
        let mut lat: f64 = 0.0;
        for (i, &a) in devices.iter().enumerate() {
            let b = devices[(i + 1) % devices.len()];
            if a != b {
                bw = bw.min(self.network.bandwidth[a][b]);
                lat = lat.max(self.network.latency[a][b]);
            }
        }
        Link {
            bytes_per_s: if bw.is_finite() { bw } else { 1e18 },
            latency_s: lat,
        }
    }

    /// The discrete-event simulator's input for `plan` (its slowest replica), with every edge
    /// compressed by `compression` (1: none).
    pub fn pipeline(&self, plan: &Plan, compression: f64) -> Result<Pipeline, PlanError> {
        self.check(plan)?;
        let n = self.ops();
        let r = plan.replicas();
        let stages: Vec<StageTime> = (0..plan.stages())
            .map(|s| {
                let range = plan.range(s, n);
                // A recomputing stage runs its forward again at the start of its backward.
                let again = self.recomputes(plan, s);
                let t: StageTime = plan.devices[s]
                    .iter()
                    .map(|&d| self.network.devices[d].range_time(self.workload, range.clone()))
                    .fold(
                        StageTime {
                            forward_s: 0.0,
                            backward_s: 0.0,
                        },
                        |acc, (f, b)| {
                            if f + b > acc.forward_s + acc.backward_s {
                                StageTime {
                                    forward_s: f,
                                    backward_s: b,
                                }
                            } else {
                                acc
                            }
                        },
                    );
                StageTime {
                    backward_s: t.backward_s + if again { t.forward_s } else { 0.0 },
                    ..t
                }
            })
            .collect();
        let target = stages
            .iter()
            .map(|s: &StageTime| s.forward_s + s.backward_s)
            .fold(0.0, f64::max);
        let edges = self
            .workload
            .traffic(plan.cuts())
            .into_iter()
            .map(|(a, b, bytes)| {
                let (there, back) = (self.slowest(plan, a, b), self.slowest(plan, b, a));
                let slow = there.bytes_per_s.min(back.bytes_per_s);
                let mut e = Edge::new(a, b, bytes, there, back);
                e.compression = compression * self.compression_ratio(bytes, slow, target);
                e
            })
            .collect();
        Ok(Pipeline {
            stages,
            edges,
            grad_bytes: (0..plan.stages())
                .map(|s| self.workload.grad_bytes(plan.range(s, n)))
                .collect(),
            micro_batches: self.micro_batches,
            schedule: self.schedule,
            replication: (r > 1).then(|| Replication {
                replicas: r,
                rings: plan.devices.iter().map(|ds| self.ring(ds)).collect(),
            }),
            exchanges: self.exchanges(plan),
            update_s: self.updates(plan),
        })
    }

    /// The slowest of the replicas' links from stage `a` to stage `b` (lowest bandwidth, highest
    /// latency).
    fn slowest(&self, plan: &Plan, a: usize, b: usize) -> Link {
        (0..plan.replicas())
            .map(|k| (plan.devices[a][k], plan.devices[b][k]))
            .map(|(x, y)| Link {
                bytes_per_s: if x == y {
                    f64::INFINITY
                } else {
                    self.network.bandwidth[x][y]
                },
                latency_s: if x == y {
                    0.0
                } else {
                    self.network.latency[x][y]
                },
            })
            .fold(
                Link {
                    bytes_per_s: f64::INFINITY,
                    latency_s: 0.0,
                },
                |acc, l| Link {
                    bytes_per_s: acc.bytes_per_s.min(l.bytes_per_s),
                    latency_s: acc.latency_s.max(l.latency_s),
                },
            )
    }

    /// The shared-parameter gradient exchanges between the stages of `plan`.
    fn exchanges(&self, plan: &Plan) -> Vec<Exchange> {
        self.workload
            .exchanges(plan.cuts())
            .into_iter()
            .map(|(a, b, bytes)| Exchange {
                a,
                b,
                bytes,
                a_to_b: self.slowest(plan, a, b),
                b_to_a: self.slowest(plan, b, a),
            })
            .collect()
    }

    /// Seconds of every stage's optimizer update on its slowest replica.
    fn updates(&self, plan: &Plan) -> Vec<f64> {
        let n = self.ops();
        plan.devices
            .iter()
            .enumerate()
            .map(|(s, ds)| {
                let mut params = self.workload.params_in(plan.range(s, n));
                if self.shard_optimizer {
                    params /= ds.len().max(1) as f64;
                }
                ds.iter()
                    .map(|&d| self.network.devices[d].update_time(params))
                    .fold(0.0, f64::max)
            })
            .collect()
    }

    /// Simulates one step of `plan`.
    pub fn simulate(&self, plan: &Plan, compression: f64) -> Result<Prediction, PlanError> {
        Ok(fusion_sim::simulate(&self.pipeline(plan, compression)?)?)
    }
}
