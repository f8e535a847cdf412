//! The broker: holds the job (model, data, optimizer state between checkpoints, schedule),
//! admits nodes, places stages on them, feeds every step's data to the stages that read it,
//! turns the nodes' gradient norms into a global clipping factor, collects losses and
//! evaluations, writes checkpoints, and recovers from a lost node by rolling every node back to
//! the last checkpoint once a replacement has joined.

use crate::error::{Result, RuntimeError};
use crate::node::MAX_CONTROL_MESSAGE;
use crate::plan::{assignment_from_cuts, Plan, Source};
use crate::service::{BrokerService, Event, ToNode};
use crate::wire::{f32_to_bytes, param_messages, schedule_to_wire, write_piece};
use fusion_compress::{Codec, CodecController, CompressionConfig, NodeCompression, PeerCodecs};
use fusion_data::{DataKind, Dataset, HostTensor, Split};
use fusion_estimate::{DeviceProfile, ProfileSource, Workload, ADAM_STATE_BYTES_PER_PARAM};
use fusion_exec::init_params;
use fusion_exec::Schedule;
use fusion_graph::Graph;
use fusion_models::ModelSpec;
pub use fusion_plan::Scheduler;
use fusion_plan::{explain, Network, PlanOptions, Problem};
use fusion_proto::{
    broker_message, broker_server::BrokerServer, node_message, ApplyUpdate, Assignment,
    BrokerMessage, Capabilities, DType, Feed, NodeMessage, ParamPart, PeerLink, ProbeLinks, Reset,
    RunMode, RunStep, SaveState, SetCompression, Stop,
};
use fusion_testbed::Testbed;
use fusion_train::{
    adapt_model, learning_rate, model_signature, peak_rss_bytes, CheckpointState, EvalRecord,
    OptimizerState, Report, StepRecord, TrainConfig, TrainError, CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
};
use fusion_transport::NodeIdentity;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::TcpListenerStream;

/// The job the broker runs.
pub struct JobSpec {
    pub model: ModelSpec,
    pub data: Arc<dyn Dataset>,
    pub train: TrainConfig,
    /// Nodes in all: stages times replicas.
    pub nodes: usize,
    /// Data-parallel replicas of every stage (1: a plain pipeline). Replicas of a stage are
    /// consecutive nodes in name order, so a testbed can keep them inside one fast site.
    pub replicas: usize,
    pub schedule: Schedule,
    /// First operator (in topological order) of every stage after the first; overrides the
    /// scheduler (stages then run on nodes in name order).
    pub cuts: Option<Vec<usize>>,
    /// Who places operators and stages when `cuts` is None: OP-Fence by default, with the
    /// nodes' measured speed and the testbed's links; `Even` is the naive split in name order.
    pub scheduler: Scheduler,
    /// Emulated links between the nodes (node i runs on device i, or the device of its name).
    pub testbed: Option<Testbed>,
    /// Whether nodes pace their sends to the testbed's links (false when the network itself is
    /// emulated, with namespaces and tc, or real; the testbed then only labels the report).
    pub pace_links: bool,
    /// Measuring the links between nodes: at (re)assignment and while training.
    pub probe: LinkProbe,
    /// Compression of activations and gradients on the links (AdaTopK picks each link's codec
    /// from its probed bandwidth and the stages' compute, re-adapted after every probe round).
    pub compression: CompressionConfig,
}

/// When and how much the nodes probe their links.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkProbe {
    /// Probe every pair of nodes not measured yet before planning a placement (at join).
    pub enabled: bool,
    /// Re-probe the links the placement uses every this many steps (0: never).
    pub every_steps: u64,
    /// Largest payload of one probe transfer.
    pub max_bytes: u64,
}

impl Default for LinkProbe {
    fn default() -> Self {
        LinkProbe {
            enabled: true,
            every_steps: 100,
            max_bytes: crate::probe::DEFAULT_PROBE_BYTES,
        }
    }
}

/// Weight of a new probe in a link's smoothed figures (exponential moving average).
const PROBE_SMOOTHING: f64 = 0.5;
/// A smoothed bandwidth that moves by more than this share is logged as a change.
const PROBE_CHANGE: f64 = 0.2;

/// One directed link as the nodes measured it, smoothed over probe rounds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MeasuredLink {
    pub from: String,
    pub to: String,
    pub bandwidth_mbps: f64,
    pub latency_ms: f64,
    /// Probe rounds that measured it.
    pub samples: u64,
    /// The latest round's raw figures.
    pub last_bandwidth_mbps: f64,
    pub last_latency_ms: f64,
}

pub struct BrokerConfig {
    pub token: String,
    pub identity: NodeIdentity,
    /// A node silent for this long (no heartbeat, no message) is declared lost.
    pub node_timeout: Duration,
    /// How long to wait for nodes to (re)join before giving up.
    pub join_timeout: Duration,
    /// Resume from this checkpoint (a run directory's `latest` or a `step-N` directory).
    pub resume: Option<PathBuf>,
    /// Give up after this many recoveries.
    pub max_recoveries: usize,
}

impl BrokerConfig {
    pub fn new(token: &str, identity: NodeIdentity) -> Self {
        BrokerConfig {
            token: token.into(),
            identity,
            node_timeout: Duration::from_secs(10),
            join_timeout: Duration::from_secs(600),
            resume: None,
            max_recoveries: 5,
        }
    }
}

/// Where each stage runs.
#[derive(Clone, Debug, Serialize)]
pub struct StagePlacement {
    pub stage: usize,
    /// Data-parallel replica (0 without replication).
    pub replica: usize,
    pub node: String,
    pub backend: String,
    pub device: String,
    pub operators: usize,
    pub params: usize,
    pub measured_gflops: f64,
    pub measured_memory_gbs: f64,
    pub calibration: f64,
}

/// Bytes one node sent to another over the data plane, and the emulated link between them.
#[derive(Clone, Debug, Serialize)]
pub struct LinkRecord {
    pub from: String,
    pub to: String,
    pub bytes: u64,
    pub tensors: u64,
    pub bandwidth_mbps: Option<f64>,
    pub latency_ms: Option<f64>,
}

/// Per-step timing of the slowest node, for comparing step time with compute and transfer.
#[derive(Clone, Debug, Serialize)]
pub struct StepTiming {
    pub step: u64,
    pub wall_s: f64,
    /// Compute seconds of each stage.
    pub compute_s: Vec<f64>,
    /// Seconds each stage waited for its peers.
    pub wait_s: Vec<f64>,
}

/// Progress the broker reports while it runs.
pub enum BrokerEvent<'a> {
    Joined {
        node: &'a str,
        capabilities: &'a Capabilities,
    },
    Placement(&'a [StagePlacement]),
    /// The scheduler's explanation of the placement (fences, bottleneck, predicted step).
    Plan(&'a [String]),
    /// The codecs on the links changed (AdaTopK adapting, or the first settings).
    Compression(&'a [LinkCodec]),
    /// A probe round measured these links (smoothed figures); `changed` lists those whose
    /// bandwidth moved noticeably (or were measured for the first time).
    Links {
        round: u64,
        changed: &'a [MeasuredLink],
    },
    Step(&'a StepRecord, Option<&'a EvalRecord>),
    /// The job starts from a checkpoint.
    Resumed {
        path: &'a std::path::Path,
        step: u64,
    },
    NodeLost {
        node: &'a str,
        reason: &'a str,
    },
    Recovered {
        step: u64,
    },
}

#[derive(Clone, Debug, Serialize)]
pub struct ClusterReport {
    #[serde(flatten)]
    pub report: Report,
    pub schedule: String,
    pub placement: Vec<StagePlacement>,
    pub links: Vec<LinkRecord>,
    pub timings: Vec<StepTiming>,
    pub failures: Vec<String>,
    /// The scheduler's explanation of the latest placement.
    pub plan: Vec<String>,
    /// Links as the nodes probed them (smoothed), which the scheduler planned with.
    pub measured_links: Vec<MeasuredLink>,
    /// The codec of every compressed link direction at the end of the run.
    pub compression: Vec<LinkCodec>,
}

/// What one node sends to one peer in one direction, and how.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkCodec {
    pub from: String,
    pub to: String,
    /// `activations` or `gradients`.
    pub direction: String,
    pub codec: Codec,
    /// Bytes per micro-batch before compression.
    pub dense_bytes: usize,
}

/// What the run ends with: its report and the final parameters (in graph order).
pub struct ClusterOutcome {
    pub report: ClusterReport,
    pub params: Vec<Vec<f32>>,
}

/// Training state the broker holds between checkpoints (the nodes hold the live one).
#[derive(Clone)]
struct Master {
    params: Vec<Vec<f32>>,
    opt: OptimizerState,
    step: u64,
    data_position: u64,
}

struct Member {
    serial: u64,
    id: String,
    caps: Capabilities,
    data_address: String,
    tx: ToNode,
    last_seen: Instant,
    /// Why its stream ended; gone members are dropped between runs (never during one, so
    /// member indices stay valid while a plan uses them).
    gone: Option<String>,
}

/// Which member runs each stage of each pipeline replica: `replicas[r][s]`.
struct Layout {
    replicas: Vec<Vec<usize>>,
}

impl Layout {
    fn all(&self) -> Vec<usize> {
        self.replicas.concat()
    }
}

/// Why a run of the pipeline stopped before the end.
enum Interrupt {
    /// A node is gone (its stream closed or it fell silent): remove it and wait for a replacement.
    Lost {
        serial: u64,
        node: String,
        reason: String,
    },
    /// A node reported a failure (often the echo of a peer's loss): roll back and retry.
    Failed { node: String, reason: String },
    /// Not recoverable.
    Fatal(RuntimeError),
}

impl From<RuntimeError> for Interrupt {
    fn from(e: RuntimeError) -> Self {
        Interrupt::Fatal(e)
    }
}

impl From<TrainError> for Interrupt {
    fn from(e: TrainError) -> Self {
        Interrupt::Fatal(e.into())
    }
}

type Flow<T> = std::result::Result<T, Interrupt>;

struct Coordinator<'f> {
    job: JobSpec,
    cfg: BrokerConfig,
    graph: Arc<Graph>,
    events: mpsc::UnboundedReceiver<(u64, Event)>,
    members: Vec<Member>,
    master: Master,
    generation: u64,
    on_event: Box<dyn FnMut(BrokerEvent) + Send + Sync + 'f>,
    /// (bytes, tensors) sent from one node to another.
    links: BTreeMap<(String, String), (u64, u64)>,
    failures: Vec<String>,
    placement: Vec<StagePlacement>,
    plan_explanation: Vec<String>,
    /// Probed links by (from, to) node id.
    measured: BTreeMap<(String, String), MeasuredLink>,
    probe_round: u64,
    /// AdaTopK's codec per link direction, with its hysteresis.
    codecs: Vec<LinkCodec>,
    adaptive_codecs: CodecController,
}

/// Bytes per micro-batch that stage `from` sends stage `to` (activations downstream, their
/// gradients upstream).
fn stage_traffic(graph: &Graph, plan: &Plan, from: usize, to: usize) -> usize {
    let (producer, consumer) = if from < to { (from, to) } else { (to, from) };
    plan.stages[consumer]
        .inputs
        .iter()
        .filter(|r| r.source == Source::Stage(producer))
        .map(|r| graph.tensor(fusion_graph::TensorId(r.tensor)).bytes())
        .sum()
}

/// The directed links a placement sends tensors over (both directions of every pair of peers,
/// all-reduce rings included), as positions in `active`.
fn used_links(plan: &Plan, layout: &Layout, active: &[usize]) -> Vec<(usize, usize)> {
    let pos = |m: usize| active.iter().position(|&a| a == m);
    let mut pairs = std::collections::BTreeSet::new();
    let mut add = |a: usize, b: usize| {
        if let (Some(x), Some(y)) = (pos(a), pos(b)) {
            if x != y {
                pairs.insert((x, y));
                pairs.insert((y, x));
            }
        }
    };
    let stages = layout.replicas.first().map_or(0, Vec::len);
    for nodes in &layout.replicas {
        for s in 0..stages {
            for p in plan.peers_of(s) {
                add(nodes[s], nodes[p]);
            }
        }
    }
    for s in 0..stages {
        let ring: Vec<usize> = layout.replicas.iter().map(|n| n[s]).collect();
        for (i, &m) in ring.iter().enumerate() {
            add(m, ring[(i + 1) % ring.len()]);
        }
    }
    pairs.into_iter().collect()
}

/// Serves the control plane on `listener` and runs the job to the end.
pub async fn run_broker<'f>(
    job: JobSpec,
    cfg: BrokerConfig,
    listener: TcpListener,
    on_event: impl FnMut(BrokerEvent) + Send + Sync + 'f,
) -> Result<ClusterOutcome> {
    job.train.validate()?;
    if job.nodes == 0 || job.replicas == 0 || !job.nodes.is_multiple_of(job.replicas) {
        return Err(RuntimeError::Config(format!(
            "{} nodes cannot run {} replicas of equal pipelines",
            job.nodes, job.replicas
        )));
    }
    let model = adapt_model(job.model.clone(), job.data.kind())?;
    let graph = Arc::new(model.graph(job.train.batch_size, job.train.seq_len)?);
    if let Some(tb) = &job.testbed {
        if tb.devices.len() < job.nodes {
            return Err(RuntimeError::Config(format!(
                "testbed '{}' has {} devices for {} nodes",
                tb.name,
                tb.devices.len(),
                job.nodes
            )));
        }
    }
    let (master, resumed_from) = initial_state(&graph, &job.train, cfg.resume.as_ref())?;
    let (ev_tx, ev_rx) = mpsc::unbounded_channel();
    let service = BrokerService {
        token: cfg.token.clone(),
        events: ev_tx,
        serial: AtomicU64::new(0),
    };
    let server = tonic::transport::Server::builder()
        .tls_config(crate::identity::server_tls(&cfg.identity))?
        .http2_keepalive_interval(Some(Duration::from_secs(5)))
        .add_service(
            BrokerServer::new(service)
                .max_decoding_message_size(MAX_CONTROL_MESSAGE)
                .max_encoding_message_size(MAX_CONTROL_MESSAGE),
        );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serve = tokio::spawn(server.serve_with_incoming_shutdown(
        TcpListenerStream::new(listener),
        async {
            let _ = stop_rx.await;
        },
    ));
    job.compression
        .validate()
        .map_err(|e| RuntimeError::Config(format!("compression: {e}")))?;
    let compression_policy = job.compression.policy();
    let job_model = model;
    let mut c = Coordinator {
        job: JobSpec {
            model: job_model,
            ..job
        },
        cfg,
        graph,
        events: ev_rx,
        members: Vec::new(),
        master,
        generation: 0,
        on_event: Box::new(on_event),
        links: BTreeMap::new(),
        failures: Vec::new(),
        placement: Vec::new(),
        plan_explanation: Vec::new(),
        measured: BTreeMap::new(),
        probe_round: 0,
        codecs: Vec::new(),
        adaptive_codecs: CodecController::new(compression_policy),
    };
    if let Some(path) = &resumed_from {
        let step = c.master.step;
        (c.on_event)(BrokerEvent::Resumed { path, step });
    }
    let result = c.run().await;
    let reason = match &result {
        Ok(_) => "training finished".to_string(),
        Err(e) => format!("the job failed: {e}"),
    };
    for m in &c.members {
        let _ =
            m.tx.send(Ok(msg(broker_message::Body::Stop(Stop {
                reason: reason.clone(),
            }))))
            .await;
    }
    // Give the nodes a moment to read their stop before the server goes away.
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(c);
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), serve).await;
    result
}

fn msg(body: broker_message::Body) -> BrokerMessage {
    BrokerMessage { body: Some(body) }
}

/// The state training starts from: a checkpoint (and its path) or fresh parameters.
fn initial_state(
    graph: &Graph,
    cfg: &TrainConfig,
    resume: Option<&PathBuf>,
) -> Result<(Master, Option<PathBuf>)> {
    if let Some(path) = resume {
        let path = fusion_train::latest_checkpoint(path)?.unwrap_or_else(|| path.clone());
        let snap = fusion_train::load_checkpoint(&path, graph, &cfg.optimizer)?;
        let master = Master {
            params: snap.params,
            opt: snap.optimizer,
            step: snap.state.step,
            data_position: snap.state.data_position,
        };
        return Ok((master, Some(path)));
    }
    let sizes: Vec<Option<usize>> = graph
        .params
        .iter()
        .map(|p| p.trainable.then(|| p.numel()))
        .collect();
    let master = Master {
        params: init_params(graph, cfg.seed),
        opt: OptimizerState::new(&cfg.optimizer, &sizes),
        step: 0,
        data_position: 0,
    };
    Ok((master, None))
}

impl Coordinator<'_> {
    async fn run(&mut self) -> Result<ClusterOutcome> {
        let start = Instant::now();
        let start_step = self.master.step;
        let mut steps: Vec<StepRecord> = Vec::new();
        let mut evals: Vec<EvalRecord> = Vec::new();
        let mut timings: Vec<StepTiming> = Vec::new();
        let mut recoveries = 0;
        loop {
            self.wait_for_members().await?;
            // Stages go to nodes in the order of their names, so placement is reproducible.
            self.members.sort_by(|a, b| a.id.cmp(&b.id));
            let active: Vec<usize> = (0..self.job.nodes).collect();
            let outcome = match self.assign(&active).await {
                Ok((plan, layout)) => match self.set_compression(&plan, &layout, None).await {
                    Ok(()) => {
                        self.train(&plan, &layout, start, &mut steps, &mut evals, &mut timings)
                            .await
                    }
                    Err(i) => Err(i),
                },
                Err(i) => Err(i),
            };
            let (node, reason) = match outcome {
                Ok(params) => {
                    let report = self.report(start, start_step, steps, evals, timings);
                    return Ok(ClusterOutcome { report, params });
                }
                Err(Interrupt::Fatal(e)) => return Err(e),
                Err(Interrupt::Lost {
                    serial,
                    node,
                    reason,
                }) => {
                    self.members.retain(|m| m.serial != serial);
                    (node, reason)
                }
                Err(Interrupt::Failed { node, reason }) => (node, reason),
            };
            let line = format!("{node}: {reason}");
            tracing::warn!("interrupted at step {}: {line}", self.master.step);
            (self.on_event)(BrokerEvent::NodeLost {
                node: &node,
                reason: &reason,
            });
            self.failures.push(line);
            recoveries += 1;
            if recoveries > self.cfg.max_recoveries {
                return Err(RuntimeError::Config(format!(
                    "giving up after {} recoveries; last: {}",
                    self.cfg.max_recoveries,
                    self.failures.last().cloned().unwrap_or_default()
                )));
            }
            for m in &self.members {
                let _ =
                    m.tx.send(Ok(msg(broker_message::Body::Reset(Reset {
                        reason: reason.clone(),
                    }))))
                    .await;
            }
            // Let the other consequences of the failure (closed streams) arrive before planning
            // again, then roll back to the last checkpoint.
            self.settle(Duration::from_millis(500)).await;
            self.master = self.restore()?;
            steps.retain(|s| s.step <= self.master.step);
            evals.retain(|e| e.step <= self.master.step);
            timings.retain(|t| t.step <= self.master.step);
            (self.on_event)(BrokerEvent::Recovered {
                step: self.master.step,
            });
        }
    }

    /// The last checkpoint: from disk when checkpoints are written, else the broker's copy.
    fn restore(&self) -> Result<Master> {
        if let Some(dir) = &self.job.train.checkpoint_dir {
            if let Some(path) = fusion_train::latest_checkpoint(dir)? {
                let snap =
                    fusion_train::load_checkpoint(&path, &self.graph, &self.job.train.optimizer)?;
                return Ok(Master {
                    params: snap.params,
                    opt: snap.optimizer,
                    step: snap.state.step,
                    data_position: snap.state.data_position,
                });
            }
        }
        Ok(self.master.clone())
    }

    fn handle_membership(&mut self, serial: u64, ev: Event) -> Option<(u64, NodeMessage)> {
        match ev {
            Event::Joined(join, tx) => {
                if self.members.iter().any(|m| m.id == join.node_id) {
                    let _ = tx.try_send(Err(tonic::Status::already_exists(format!(
                        "a node named '{}' is already in the job",
                        join.node_id
                    ))));
                    return None;
                }
                let caps = join.capabilities.unwrap_or_default();
                (self.on_event)(BrokerEvent::Joined {
                    node: &join.node_id,
                    capabilities: &caps,
                });
                tracing::info!(
                    "{} joined ({}, {})",
                    join.node_id,
                    caps.backend,
                    caps.device
                );
                self.members.push(Member {
                    serial,
                    id: join.node_id,
                    caps,
                    data_address: join.data_address,
                    tx,
                    last_seen: Instant::now(),
                    gone: None,
                });
                None
            }
            Event::Closed(reason) => {
                if let Some(m) = self.members.iter_mut().find(|m| m.serial == serial) {
                    tracing::info!("{} left: {reason}", m.id);
                    m.gone = Some(reason);
                }
                None
            }
            Event::Message(m) => {
                if let Some(mem) = self.members.iter_mut().find(|m| m.serial == serial) {
                    mem.last_seen = Instant::now();
                }
                Some((serial, m))
            }
        }
    }

    async fn settle(&mut self, d: Duration) {
        let deadline = tokio::time::Instant::now() + d;
        while let Ok(Some((serial, ev))) =
            tokio::time::timeout_at(deadline, self.events.recv()).await
        {
            self.handle_membership(serial, ev);
        }
    }

    async fn wait_for_members(&mut self) -> Result<()> {
        let deadline = tokio::time::Instant::now() + self.cfg.join_timeout;
        loop {
            self.members.retain(|m| m.gone.is_none());
            if self.members.len() >= self.job.nodes {
                break;
            }
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some((serial, ev))) => {
                    self.handle_membership(serial, ev);
                }
                Ok(None) => return Err(RuntimeError::Protocol("the control plane stopped".into())),
                Err(_) => {
                    return Err(RuntimeError::Timeout(format!(
                        "{} of {} nodes joined within {} s",
                        self.members.len(),
                        self.job.nodes,
                        self.cfg.join_timeout.as_secs()
                    )))
                }
            }
        }
        Ok(())
    }

    /// The next message from an active node, checking heartbeats meanwhile.
    async fn next_message(&mut self, active: &[usize], what: &str) -> Flow<(usize, NodeMessage)> {
        loop {
            let ids: Vec<u64> = active.iter().map(|&i| self.members[i].serial).collect();
            for &i in active {
                let m = &self.members[i];
                if let Some(reason) = &m.gone {
                    return Err(Interrupt::Lost {
                        serial: m.serial,
                        node: m.id.clone(),
                        reason: reason.clone(),
                    });
                }
                if m.last_seen.elapsed() > self.cfg.node_timeout {
                    return Err(Interrupt::Lost {
                        serial: m.serial,
                        node: m.id.clone(),
                        reason: format!(
                            "no heartbeat for {:.1} s (timeout {} s) while waiting for {what}",
                            m.last_seen.elapsed().as_secs_f64(),
                            self.cfg.node_timeout.as_secs_f64()
                        ),
                    });
                }
            }
            let got = tokio::time::timeout(Duration::from_millis(200), self.events.recv()).await;
            let Ok(got) = got else { continue };
            let Some((serial, ev)) = got else {
                return Err(Interrupt::Fatal(RuntimeError::Protocol(
                    "the control plane stopped".into(),
                )));
            };
            if let Event::Closed(reason) = &ev {
                if let Some(pos) = ids.iter().position(|&s| s == serial) {
                    let node = self.members[active[pos]].id.clone();
                    let reason = reason.clone();
                    self.handle_membership(serial, ev);
                    return Err(Interrupt::Lost {
                        serial,
                        node,
                        reason,
                    });
                }
            }
            // Joins during training are spares for a later recovery.
            let Some((serial, m)) = self.handle_membership(serial, ev) else {
                continue;
            };
            let Some(pos) = ids.iter().position(|&s| s == serial) else {
                continue;
            };
            match &m.body {
                Some(node_message::Body::Heartbeat(_)) => continue,
                Some(node_message::Body::Failure(f)) => {
                    return Err(Interrupt::Failed {
                        node: self.members[active[pos]].id.clone(),
                        reason: f.message.clone(),
                    })
                }
                Some(node_message::Body::Leave(l)) => {
                    return Err(Interrupt::Lost {
                        serial,
                        node: self.members[active[pos]].id.clone(),
                        reason: format!("left: {}", l.reason),
                    })
                }
                _ => return Ok((pos, m)),
            }
        }
    }

    async fn send(&self, member: usize, body: broker_message::Body) -> Flow<()> {
        let m = &self.members[member];
        m.tx.send(Ok(msg(body))).await.map_err(|_| Interrupt::Lost {
            serial: m.serial,
            node: m.id.clone(),
            reason: "its control stream is closed".into(),
        })
    }

    fn link_between(&self, a: usize, b: usize) -> Option<(f64, f64)> {
        let tb = self.job.testbed.as_ref()?;
        let device = |i: usize| {
            let id = &self.members[i].id;
            tb.device(id)
                .map_or_else(|| tb.devices[i].name.clone(), |d| d.name.clone())
        };
        tb.link(&device(a), &device(b))
            .map(|l| (l.bandwidth_mbps, l.latency_ms))
    }

    /// Each stage's compute per micro-batch as the estimator predicts it on its node's profile.
    fn predicted_stage_compute(&self, plan: &Plan, nodes: &[usize]) -> Vec<f64> {
        let mut t = vec![0.0; nodes.len()];
        let Ok(w) = Workload::of(&self.graph, ADAM_STATE_BYTES_PER_PARAM) else {
            return t;
        };
        let profiles: Vec<DeviceProfile> = nodes.iter().map(|&m| self.profile(m)).collect();
        for (pos, op) in w.ops.iter().enumerate() {
            let s = plan.assignment[w.node_of_position[pos]];
            if let Some(p) = profiles.get(s) {
                let (f, b) = p.op_time(op);
                t[s] += f + b;
            }
        }
        t
    }

    /// The scheduler's view of member `m`'s device, from what it measured at join.
    fn profile(&self, m: usize) -> DeviceProfile {
        let c = &self.members[m].caps;
        let or = |v: f64, default: f64| if v.is_finite() && v > 0.0 { v } else { default };
        DeviceProfile {
            name: self.members[m].id.clone(),
            class: c.backend.clone(),
            dense_flops_per_s: or(c.measured_gflops, 1.0) * 1e9,
            memory_bytes_per_s: or(c.measured_memory_gbs, 1.0) * 1e9,
            memory_capacity_bytes: or(c.memory_bytes as f64, 8e9),
            calibration: or(c.calibration, 1.0),
            source: ProfileSource::Measured,
        }
    }

    /// Decides every link direction's codec (AdaTopK: the least lossy codec that makes the link
    /// fit the slowest stage's compute, `measured_compute_s` per micro-batch when known, else the
    /// estimate) and tells each node what it applies. Only changes are announced.
    async fn set_compression(
        &mut self,
        plan: &Plan,
        layout: &Layout,
        measured_compute_s: Option<f64>,
    ) -> Flow<()> {
        let cfg = self.job.compression.clone();
        if !cfg.is_on() {
            return Ok(());
        }
        let target = match measured_compute_s {
            Some(t) if t > 0.0 => t,
            _ => self
                .predicted_stage_compute(plan, &layout.replicas[0])
                .into_iter()
                .fold(0.0, f64::max),
        };
        let mut codecs = Vec::new();
        let mut per_node: BTreeMap<usize, Vec<PeerCodecs>> = BTreeMap::new();
        for nodes in &layout.replicas {
            for (s, &me) in nodes.iter().enumerate() {
                for p in plan.peers_of(s) {
                    let bytes = stage_traffic(&self.graph, plan, s, p);
                    if bytes == 0 {
                        continue;
                    }
                    let forward = p > s;
                    let wanted = if forward { cfg.forward } else { cfg.backward };
                    let (from, to) = (
                        self.members[me].id.clone(),
                        self.members[nodes[p]].id.clone(),
                    );
                    let codec = match wanted {
                        Codec::AdaTopK => {
                            let bw = self
                                .measured_between(me, nodes[p])
                                .or_else(|| self.link_between(me, nodes[p]))
                                .map_or(1000.0, |l| l.0)
                                * 1e6
                                / 8.0;
                            let label = format!(
                                "{to} {}",
                                if forward { "activations" } else { "gradients" }
                            );
                            // The change itself is logged below, with every other link's,
                            // by comparing the new codecs with those in force.
                            self.adaptive_codecs
                                .update(&from, &label, bytes / 4, bw, target);
                            self.adaptive_codecs.get(&from, &label)
                        }
                        c => c,
                    };
                    let entry = per_node.entry(me).or_default();
                    match entry.iter_mut().find(|e| e.stage == p) {
                        Some(e) if forward => e.forward = codec,
                        Some(e) => e.backward = codec,
                        None => entry.push(PeerCodecs {
                            stage: p,
                            forward: if forward { codec } else { Codec::None },
                            backward: if forward { Codec::None } else { codec },
                        }),
                    }
                    codecs.push(LinkCodec {
                        from,
                        to,
                        direction: if forward { "activations" } else { "gradients" }.into(),
                        codec,
                        dense_bytes: bytes,
                    });
                }
            }
        }
        if codecs == self.codecs {
            return Ok(());
        }
        for (&m, peers) in &per_node {
            let settings = NodeCompression {
                peers: peers.clone(),
                error_feedback: cfg.error_feedback,
                warmup_steps: cfg.warmup_steps,
                values: cfg.values,
                selection: cfg.selection,
            };
            let json = serde_json::to_string(&settings)
                .map_err(|e| RuntimeError::Protocol(e.to_string()))?;
            self.send(
                m,
                broker_message::Body::Compression(SetCompression {
                    settings_json: json,
                }),
            )
            .await?;
        }
        for c in codecs.iter().filter(|c| !self.codecs.contains(c)) {
            tracing::info!("{} -> {} {}: {}", c.from, c.to, c.direction, c.codec);
        }
        self.codecs = codecs;
        let shown = self.codecs.clone();
        (self.on_event)(BrokerEvent::Compression(&shown));
        Ok(())
    }

    /// The smoothed probed figures of the link from member `a` to member `b`.
    fn measured_between(&self, a: usize, b: usize) -> Option<(f64, f64)> {
        let key = (self.members[a].id.clone(), self.members[b].id.clone());
        self.measured
            .get(&key)
            .map(|l| (l.bandwidth_mbps, l.latency_ms))
    }

    /// Has every member in `pairs` (directed, by member index) probe its peers, one probe round,
    /// and folds the results into the smoothed link figures. Rounds are symmetric: the pairs
    /// must list both directions.
    async fn probe_links(&mut self, active: &[usize], pairs: &[(usize, usize)]) -> Flow<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        self.probe_round += 1;
        let round = self.probe_round;
        let mut lists: BTreeMap<usize, Vec<PeerLink>> = BTreeMap::new();
        for &(a, b) in pairs {
            let (bw, lat) = if self.job.pace_links {
                self.link_between(active[a], active[b])
                    .unwrap_or((0.0, 0.0))
            } else {
                (0.0, 0.0)
            };
            let m = &self.members[active[b]];
            lists.entry(a).or_default().push(PeerLink {
                node_id: m.id.clone(),
                address: m.data_address.clone(),
                stage: 0,
                bandwidth_mbps: bw,
                latency_ms: lat,
            });
        }
        let asked: Vec<usize> = lists.keys().map(|&a| active[a]).collect();
        for (&a, peers) in &lists {
            self.send(
                active[a],
                broker_message::Body::Probe(ProbeLinks {
                    round,
                    peers: peers.clone(),
                    max_bytes: self.job.probe.max_bytes,
                }),
            )
            .await?;
        }
        let mut done = vec![false; asked.len()];
        let mut changed = Vec::new();
        while done.iter().any(|d| !d) {
            let (pos, m) = self.next_message(&asked, "link probes").await?;
            let Some(node_message::Body::Links(report)) = m.body else {
                continue;
            };
            if report.round != round || done[pos] {
                continue;
            }
            done[pos] = true;
            let from = self.members[asked[pos]].id.clone();
            for l in report.links {
                let sane = l.bandwidth_mbps.is_finite()
                    && l.bandwidth_mbps > 0.0
                    && l.latency_ms.is_finite()
                    && l.latency_ms >= 0.0;
                if !l.error.is_empty() || !sane {
                    tracing::warn!(
                        "probe {from} -> {}: {}",
                        l.peer,
                        if l.error.is_empty() {
                            "nonsensical figures"
                        } else {
                            &l.error
                        }
                    );
                    continue;
                }
                let entry = self
                    .measured
                    .entry((from.clone(), l.peer.clone()))
                    .or_insert_with(|| MeasuredLink {
                        from: from.clone(),
                        to: l.peer.clone(),
                        bandwidth_mbps: l.bandwidth_mbps,
                        latency_ms: l.latency_ms,
                        samples: 0,
                        last_bandwidth_mbps: 0.0,
                        last_latency_ms: 0.0,
                    });
                let before = entry.bandwidth_mbps;
                if entry.samples > 0 {
                    let k = PROBE_SMOOTHING;
                    entry.bandwidth_mbps = (1.0 - k) * entry.bandwidth_mbps + k * l.bandwidth_mbps;
                    entry.latency_ms = (1.0 - k) * entry.latency_ms + k * l.latency_ms;
                }
                entry.samples += 1;
                entry.last_bandwidth_mbps = l.bandwidth_mbps;
                entry.last_latency_ms = l.latency_ms;
                if entry.samples == 1
                    || (entry.bandwidth_mbps - before).abs() > PROBE_CHANGE * before
                {
                    tracing::info!(
                        "link {} -> {}: {:.1} Mbit/s, {:.1} ms (probe round {round})",
                        entry.from,
                        entry.to,
                        entry.bandwidth_mbps,
                        entry.latency_ms
                    );
                    changed.push(entry.clone());
                }
            }
        }
        if !changed.is_empty() {
            (self.on_event)(BrokerEvent::Links {
                round,
                changed: &changed,
            });
        }
        Ok(())
    }

    /// The operator assignment and the member running each (stage, replica) slot, in slot order
    /// `s * R + r`: fixed cuts in name order, the even split in name order, or the scheduler's
    /// plan over the members' measured speed and the testbed's links.
    fn placement_plan(
        &mut self,
        active: &[usize],
        stages: usize,
    ) -> Result<(Vec<usize>, Vec<usize>)> {
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
        let config = |e: String| RuntimeError::Config(format!("planning the placement: {e}"));
        let workload = Workload::of(&self.graph, ADAM_STATE_BYTES_PER_PARAM)
            .map_err(|e| config(e.to_string()))?;
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
                        .or_else(|| self.link_between(active[i], active[j]))
                        .unwrap_or((1000.0, 0.1));
                    bandwidth[i][j] = mbps * 1e6 / 8.0;
                    latency[i][j] = ms / 1e3;
                }
            }
        }
        let network = Network {
            devices,
            bandwidth,
            latency,
        };
        let mut problem = Problem::new(
            &workload,
            &network,
            self.job.train.micro_batches,
            self.job.schedule,
        )
        .map_err(|e| config(e.to_string()))?;
        if self.job.compression.adaptive() {
            // Fences may sit on a slow link when AdaTopK will shrink what crosses it.
            problem = problem.with_compression(self.job.compression.policy());
        }
        let options = PlanOptions {
            stages: Some(stages),
            replicas: Some(self.job.replicas),
            ..Default::default()
        };
        let planned = fusion_plan::plan(&problem, self.job.scheduler, &options)
            .map_err(|e| config(e.to_string()))?;
        self.plan_explanation = explain(&problem, &planned.plan, &planned.evaluation);
        let order = planned
            .plan
            .devices
            .iter()
            .flat_map(|replicas| replicas.iter().map(|&d| active[d]))
            .collect();
        Ok((workload.assignment(&planned.plan.starts), order))
    }

    /// Cuts the graph into stages, places stage `s` of replica `r` on its planned node, and
    /// sends every node its assignment, parameters and optimizer state; waits until all are ready.
    async fn assign(&mut self, active: &[usize]) -> Flow<(Plan, Layout)> {
        self.generation += 1;
        let r_count = self.job.replicas;
        let stages = self.job.nodes / r_count;
        if self.job.probe.enabled {
            // Measure every pair not measured yet (the nodes that just joined).
            let n = active.len();
            let fresh: Vec<(usize, usize)> = (0..n)
                .flat_map(|a| (0..n).map(move |b| (a, b)))
                .filter(|&(a, b)| a != b)
                .filter(|&(a, b)| {
                    self.measured_between(active[a], active[b]).is_none()
                        || self.measured_between(active[b], active[a]).is_none()
                })
                .collect();
            self.probe_links(active, &fresh).await?;
        }
        let (assignment, order) = self.placement_plan(active, stages)?;
        let layout = Layout {
            replicas: (0..r_count)
                .map(|r| (0..stages).map(|s| order[s * r_count + r]).collect())
                .collect(),
        };
        let ids = |nodes: &[usize]| -> Vec<String> {
            nodes.iter().map(|&i| self.members[i].id.clone()).collect()
        };
        let (plan, stage_graphs) = Plan::new(&self.graph, assignment, ids(&layout.replicas[0]))?;
        let config_json = serde_json::to_string(&self.job.train)
            .map_err(|e| RuntimeError::Protocol(e.to_string()))?;
        self.placement = layout
            .replicas
            .iter()
            .enumerate()
            .flat_map(|(r, nodes)| nodes.iter().enumerate().map(move |(s, &m)| (r, s, m)))
            .map(|(r, s, m)| {
                let mem = &self.members[m];
                let st = &stage_graphs[s];
                StagePlacement {
                    stage: s,
                    replica: r,
                    node: mem.id.clone(),
                    backend: mem.caps.backend.clone(),
                    device: mem.caps.device.clone(),
                    operators: st.graph.nodes.len(),
                    params: st.graph.num_trainable(),
                    measured_gflops: mem.caps.measured_gflops,
                    measured_memory_gbs: mem.caps.measured_memory_gbs,
                    calibration: mem.caps.calibration,
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
        for (r, nodes) in layout.replicas.iter().enumerate() {
            let replica_plan = Plan {
                stage_nodes: ids(nodes),
                ..plan.clone()
            };
            let plan_json = serde_json::to_string(&replica_plan)
                .map_err(|e| RuntimeError::Protocol(e.to_string()))?;
            for (s, stage) in stage_graphs.iter().enumerate() {
                let me = nodes[s];
                let ring: Vec<usize> = layout.replicas.iter().map(|n| n[s]).collect();
                let mut targets: Vec<(usize, usize)> = plan
                    .peers_of(s)
                    .into_iter()
                    .map(|p| (p, nodes[p]))
                    .collect();
                if r_count > 1 {
                    targets.push((s, ring[(r + 1) % r_count]));
                }
                let peers = targets
                    .into_iter()
                    .map(|(p, m)| {
                        let (bw, lat) = if self.job.pace_links {
                            self.link_between(me, m).unwrap_or((0.0, 0.0))
                        } else {
                            (0.0, 0.0)
                        };
                        PeerLink {
                            node_id: self.members[m].id.clone(),
                            address: self.members[m].data_address.clone(),
                            stage: p as u32,
                            bandwidth_mbps: bw,
                            latency_ms: lat,
                        }
                    })
                    .collect();
                let a = Assignment {
                    generation: self.generation,
                    stage: s as u32,
                    stage_graph_json: serde_json::to_string(&stage.graph)
                        .map_err(|e| RuntimeError::Protocol(e.to_string()))?,
                    plan_json: plan_json.clone(),
                    config_json: config_json.clone(),
                    schedule: schedule_to_wire(self.job.schedule) as i32,
                    peers,
                    optimizer_step: self.master.opt.step,
                    replica: r as u32,
                    replicas: r_count as u32,
                    ring: if r_count > 1 { ids(&ring) } else { Vec::new() },
                };
                self.send(me, broker_message::Body::Assignment(a)).await?;
                for p in &stage.params {
                    let parts = [
                        (ParamPart::Value, &self.master.params[p.0]),
                        (ParamPart::FirstMoment, &self.master.opt.first[p.0]),
                        (ParamPart::SecondMoment, &self.master.opt.second[p.0]),
                    ];
                    for (part, values) in parts {
                        for piece in param_messages(p.0, part, values) {
                            self.send(me, broker_message::Body::Param(piece)).await?;
                        }
                    }
                }
                self.send(
                    me,
                    broker_message::Body::ParamsDone(fusion_proto::ParamsDone {
                        step: self.master.step,
                    }),
                )
                .await?;
            }
        }
        let all = layout.all();
        let mut ready = vec![false; all.len()];
        while ready.iter().any(|r| !r) {
            let (pos, m) = self
                .next_message(&all, "nodes to set up their stages")
                .await?;
            match m.body {
                Some(node_message::Body::Ready(r)) if r.generation == self.generation => {
                    ready[pos] = true
                }
                _ => {}
            }
        }
        Ok((plan, layout))
    }

    /// Sends one batch's graph inputs of micro-batch `mb` to the stages that read them.
    async fn feed(
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

    /// Runs a step on every node and returns each node's result.
    async fn run_step(
        &mut self,
        active: &[usize],
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
        let mut results: Vec<Option<fusion_proto::StepResult>> = vec![None; active.len()];
        while results.iter().any(|r| r.is_none()) {
            let (pos, msg) = self.next_message(active, "step results").await?;
            if let Some(node_message::Body::Result(r)) = msg.body {
                if r.step == step {
                    for l in &r.sent {
                        let e = self
                            .links
                            .entry((self.members[active[pos]].id.clone(), l.peer.clone()))
                            .or_default();
                        e.0 += l.bytes;
                        e.1 += l.tensors;
                    }
                    results[pos] = Some(r);
                }
            }
        }
        Ok(results.into_iter().flatten().collect())
    }

    async fn train(
        &mut self,
        plan: &Plan,
        layout: &Layout,
        start: Instant,
        steps: &mut Vec<StepRecord>,
        evals: &mut Vec<EvalRecord>,
        timings: &mut Vec<StepTiming>,
    ) -> Flow<Vec<Vec<f32>>> {
        let active = layout.all();
        let first = &layout.replicas[0];
        let cfg = self.job.train.clone();
        // Every replica runs `micro_batches`; a step covers all of them.
        let m = cfg.micro_batches;
        let total = m * layout.replicas.len();
        let per_step = match self.job.data.kind() {
            DataKind::Text { .. } => cfg.batch_size * cfg.seq_len * total,
            DataKind::Images { .. } => cfg.batch_size * total,
        } as f64;
        let mut step = self.master.step;
        let first_step = step;
        let mut position = self.master.data_position;
        let every = self.job.probe.every_steps;
        while step < cfg.steps {
            if self.job.probe.enabled
                && every > 0
                && step > first_step
                && step.is_multiple_of(every)
            {
                let pairs = used_links(plan, layout, &active);
                self.probe_links(&active, &pairs).await?;
                // Re-adapt to the new figures and the compute the nodes actually measured.
                let measured = timings.last().map(|t| {
                    t.compute_s
                        .iter()
                        .map(|c| c / cfg.micro_batches.max(1) as f64)
                        .fold(0.0, f64::max)
                });
                self.set_compression(plan, layout, measured).await?;
            }
            let t0 = Instant::now();
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
            let results = self
                .run_step(&active, step, RunMode::Train, m, total)
                .await?;
            let losses: Vec<f32> = results
                .iter()
                .flat_map(|r| r.losses.iter().copied())
                .collect();
            if losses.len() != total {
                return Err(Interrupt::Fatal(RuntimeError::Protocol(format!(
                    "{} losses for {total} micro-batches",
                    losses.len()
                ))));
            }
            let loss = losses.iter().sum::<f32>() / total as f32;
            if !loss.is_finite() {
                return Err(Interrupt::Fatal(
                    TrainError::Diverged { step, value: loss }.into(),
                ));
            }
            // Replicas hold identical all-reduced gradients: count the first one's.
            let sq: f64 = results[..first.len()]
                .iter()
                .map(|r| r.grad_square_sum)
                .sum();
            let norm = sq.sqrt() as f32;
            let scale = match cfg.clip_norm {
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
                        grad_scale: scale,
                    }),
                )
                .await?;
            }
            step += 1;
            position += total as u64;
            let last = step == cfg.steps;
            let eval = if last || (cfg.eval_every > 0 && step.is_multiple_of(cfg.eval_every)) {
                Some(self.evaluate(plan, first, step).await?)
            } else {
                None
            };
            let wall = t0.elapsed().as_secs_f64();
            timings.push(StepTiming {
                step,
                wall_s: wall,
                compute_s: results.iter().map(|r| r.compute_seconds).collect(),
                wait_s: results.iter().map(|r| r.wait_seconds).collect(),
            });
            let rec = StepRecord {
                step,
                loss,
                lr,
                grad_norm: norm,
                elapsed_s: start.elapsed().as_secs_f64(),
                throughput: per_step / wall.max(1e-9),
            };
            let save = cfg.checkpoint_dir.is_some()
                && (last
                    || (cfg.checkpoint_every > 0 && step.is_multiple_of(cfg.checkpoint_every)));
            if save || last {
                let state = self.collect_state(first, step, position).await?;
                if let Some(dir) = &cfg.checkpoint_dir {
                    let ck = CheckpointState {
                        format: CHECKPOINT_FORMAT.into(),
                        version: CHECKPOINT_VERSION,
                        model: self.job.model.name.clone(),
                        model_signature: model_signature(&self.graph),
                        step,
                        data_position: position,
                        optimizer: cfg.optimizer.clone(),
                        optimizer_step: state.opt.step,
                        config: cfg.clone(),
                        tensors_sha256: String::new(),
                    };
                    if save {
                        fusion_train::save_checkpoint(
                            dir,
                            &self.graph,
                            &state.params,
                            &state.opt,
                            ck,
                        )?;
                    }
                }
                if save || cfg.checkpoint_dir.is_none() {
                    self.master = state;
                }
                if last {
                    (self.on_event)(BrokerEvent::Step(&rec, eval.as_ref()));
                    steps.push(rec);
                    evals.extend(eval);
                    return Ok(self.master.params.clone());
                }
            }
            (self.on_event)(BrokerEvent::Step(&rec, eval.as_ref()));
            steps.push(rec);
            evals.extend(eval);
        }
        // Already at the end (resumed from the final checkpoint).
        Ok(self.master.params.clone())
    }

    async fn evaluate(&mut self, plan: &Plan, active: &[usize], step: u64) -> Flow<EvalRecord> {
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
        let results = self.run_step(active, step, RunMode::Eval, n, n).await?;
        let losses: Vec<f32> = results
            .iter()
            .flat_map(|r| r.losses.iter().copied())
            .collect();
        let predictions: Vec<u32> = results
            .iter()
            .flat_map(|r| r.predictions.iter().copied())
            .collect();
        if losses.len() != n || predictions.len() != targets.len() {
            return Err(Interrupt::Fatal(RuntimeError::Protocol(format!(
                "evaluation returned {} losses and {} predictions for {n} batches and {} targets",
                losses.len(),
                predictions.len(),
                targets.len()
            ))));
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

    /// Every parameter, buffer and optimizer moment, gathered from the nodes that hold them.
    async fn collect_state(&mut self, active: &[usize], step: u64, position: u64) -> Flow<Master> {
        for &i in active {
            self.send(i, broker_message::Body::Save(SaveState { step }))
                .await?;
        }
        let mut st = self.master.clone();
        let mut done = vec![false; active.len()];
        let mut filled = vec![false; st.params.len()];
        while done.iter().any(|d| !d) {
            let (pos, m) = self.next_message(active, "checkpoint state").await?;
            match m.body {
                Some(node_message::Body::Param(p)) => {
                    let i = p.param as usize;
                    let target = match (p.part(), st.params.get_mut(i)) {
                        (ParamPart::Value, Some(t)) => t,
                        (ParamPart::FirstMoment, Some(_)) => &mut st.opt.first[i],
                        (ParamPart::SecondMoment, Some(_)) => &mut st.opt.second[i],
                        _ => {
                            return Err(Interrupt::Failed {
                                node: self.members[active[pos]].id.clone(),
                                reason: format!("sent state for unknown parameter #{}", p.param),
                            })
                        }
                    };
                    write_piece(target, &p).map_err(|e| Interrupt::Failed {
                        node: self.members[active[pos]].id.clone(),
                        reason: e.to_string(),
                    })?;
                    if p.part() == ParamPart::Value {
                        filled[i] = true;
                    }
                }
                Some(node_message::Body::ParamsDone(_)) => done[pos] = true,
                _ => {}
            }
        }
        if let Some(i) = filled.iter().position(|f| !f) {
            return Err(Interrupt::Fatal(RuntimeError::Protocol(format!(
                "no node sent parameter '{}'",
                self.graph.params[i].name
            ))));
        }
        // Every step since the broker's copy applied exactly one optimizer update on every node.
        st.opt.step = self.master.opt.step + (step - self.master.step);
        st.step = step;
        st.data_position = position;
        Ok(st)
    }

    fn report(
        &self,
        start: Instant,
        start_step: u64,
        steps: Vec<StepRecord>,
        evals: Vec<EvalRecord>,
        timings: Vec<StepTiming>,
    ) -> ClusterReport {
        let cfg = &self.job.train;
        let per_step = match self.job.data.kind() {
            DataKind::Text { .. } => cfg.batch_size * cfg.seq_len * cfg.micro_batches,
            DataKind::Images { .. } => cfg.batch_size * cfg.micro_batches,
        } as f64;
        let wall = start.elapsed().as_secs_f64();
        let mut backends: Vec<String> = self.placement.iter().map(|p| p.backend.clone()).collect();
        backends.dedup();
        let ids: HashMap<&str, usize> = self
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| (m.id.as_str(), i))
            .collect();
        let links = self
            .links
            .iter()
            .map(|((from, to), (bytes, tensors))| {
                let link = match (ids.get(from.as_str()), ids.get(to.as_str())) {
                    (Some(&a), Some(&b)) => self.link_between(a, b),
                    _ => None,
                };
                LinkRecord {
                    from: from.clone(),
                    to: to.clone(),
                    bytes: *bytes,
                    tensors: *tensors,
                    bandwidth_mbps: link.map(|l| l.0),
                    latency_ms: link.map(|l| l.1),
                }
            })
            .collect();
        ClusterReport {
            report: Report {
                model: self.job.model.name.clone(),
                backend: format!("{} nodes: {}", self.job.nodes, backends.join(" + ")),
                data: self.job.data.describe(),
                params: self.graph.num_trainable(),
                config: cfg.clone(),
                start_step,
                throughput: per_step * steps.len() as f64 / wall.max(1e-9),
                steps,
                evals,
                throughput_unit: match self.job.data.kind() {
                    DataKind::Text { .. } => "tokens/s",
                    DataKind::Images { .. } => "samples/s",
                },
                wall_s: wall,
                peak_rss_bytes: peak_rss_bytes(),
                entropy_floor: self.job.data.entropy_floor(),
                unigram_entropy: self.job.data.unigram_entropy(),
            },
            schedule: format!("{:?}", self.job.schedule),
            placement: self.placement.clone(),
            links,
            timings,
            failures: self.failures.clone(),
            plan: self.plan_explanation.clone(),
            measured_links: self.measured.values().cloned().collect(),
            compression: self.codecs.clone(),
        }
    }
}
