//! The broker: holds the job (model, data, optimizer state between checkpoints, schedule),
//! admits nodes, places stages on them, feeds every step's data to the stages that read it,
//! turns the nodes' gradient norms into a global clipping factor, collects losses and
//! evaluations, writes checkpoints, and recovers from a lost node by rolling every node back to
//! the last checkpoint once a replacement has joined.

use crate::error::{Result, RuntimeError};
use crate::node::{MAX_CONTROL_MESSAGE, MAX_NODE_MESSAGE};
use crate::plan::{assignment_from_cuts, Plan, Source};
use crate::service::{BrokerService, Event, Liveness, ToNode};
use crate::wire::{f32_to_bytes, schedule_to_wire};
use fusion_compress::{Codec, CodecController, CompressionConfig, NodeCompression, PeerCodecs};
use fusion_data::{DataKind, Dataset, HostTensor, Split};
use fusion_estimate::{DeviceProfile, ProfileSource, Workload, ADAM_STATE_BYTES_PER_PARAM};
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
    Report, StepRecord, TrainConfig, TrainError, Verdict, CHECKPOINT_FORMAT, CHECKPOINT_VERSION,
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
use tonic::service::interceptor::InterceptedService;

pub(crate) mod claims;
mod compression;
mod island_loss;
mod islands;
mod links;
mod membership;
mod placement;
mod reach;
mod relay_share;
mod report;
mod run;
mod shard_snapshot;
mod sharded;
mod shares;
mod snapshot;
mod stall;
mod steps;
mod store;
mod straggler;

use sharded::ShardedSnap;
use snapshot::Snapshots;
pub use snapshot::{SnapshotPolicy, SnapshotStats};
use store::{StateDir, Stored};

use links::used_links;

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
    /// What every node computes in: a node whose backend computes in another precision is
    /// refused at join. An f16 job's broker keeps one dynamic loss scale for every node.
    pub precision: fusion_backend::Precision,
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
    /// The path the probes took (direct, or the path the link takes when it is not).
    pub path: crate::path::LinkPath,
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
    /// The run this broker serves, decided outside (a broker elected through etcd): a fresh
    /// start takes this id, and a resume takes the newest checkpoint of this run only, or
    /// starts the run from the beginning when it has none yet. None: a new id, or the run of
    /// the resume directory's `latest`.
    pub run_id: Option<String>,
    /// A fresh run starts from these weights instead of the seed's (ignored when resuming: the
    /// checkpoint has the state).
    pub init: Option<Arc<dyn fusion_train::WeightSource>>,
    /// Where the broker keeps its copy of the training state (one file per snapshot, the size
    /// of a checkpoint's tensors); None: `.broker-state` in the checkpoint directory, else a
    /// temporary directory removed at the end.
    pub state_dir: Option<PathBuf>,
    /// Give up after this many recoveries.
    pub max_recoveries: usize,
    /// After losing a node, how long to wait for a replacement before going on with fewer.
    pub replace_grace: Duration,
    /// The fewest nodes the job may shrink to (rounded up to whole replicas; fixed cuts never
    /// shrink).
    pub min_nodes: usize,
    /// When the broker refreshes its copy of the state (what a lost node rolls back to).
    pub snapshots: SnapshotPolicy,
    /// When every node a step waits for has made no progress for this long (and at least four
    /// recent steps' time), the one the others wait for is evicted (zero: never).
    pub stall_timeout: Duration,
    /// How long the broker keeps trying to write the final snapshot (a full disk) while the
    /// nodes hold the trained state, before the job fails.
    pub final_snapshot_patience: Duration,
    /// Control-plane connections kept open at once, in all and per remote address.
    pub connection_limits: fusion_transport::ConnectionLimits,
    /// The CA's revocation list: a node whose certificate it names cannot join.
    pub revocation: Option<Arc<fusion_transport::RevocationCheck>>,
    /// Test hook: the coordinator stalls this long after its first snapshot, as a slow
    /// serialisation would (zero in real runs).
    pub test_snapshot_stall: Duration,
    /// Test hook: the broker pauses this long after every step, so that faults injected by a
    /// test land mid-run however fast the machine is (zero in real runs).
    pub test_step_delay: Duration,
}

impl BrokerConfig {
    pub fn new(token: &str, identity: NodeIdentity) -> Self {
        BrokerConfig {
            token: token.into(),
            identity,
            node_timeout: Duration::from_secs(10),
            join_timeout: Duration::from_secs(600),
            resume: None,
            run_id: None,
            init: None,
            state_dir: None,
            max_recoveries: 5,
            replace_grace: Duration::from_secs(30),
            min_nodes: 1,
            snapshots: SnapshotPolicy::default(),
            stall_timeout: Duration::from_secs(60),
            final_snapshot_patience: Duration::from_secs(600),
            connection_limits: Default::default(),
            revocation: None,
            test_snapshot_stall: Duration::ZERO,
            test_step_delay: Duration::ZERO,
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
    /// The node's site in the testbed (empty without one, or when the testbed does not name
    /// the node).
    pub site: String,
    pub backend: String,
    pub device: String,
    pub operators: usize,
    pub params: usize,
    /// Activation recomputation segments (0: the stage stores its activations).
    pub recompute_segments: usize,
    pub measured_gflops: f64,
    pub measured_memory_gbs: f64,
    pub calibration: f64,
    /// Microseconds each operator pass adds beyond the calibrated roofline (0: unknown).
    pub op_overhead_us: f64,
    /// Whether the node accepts data-plane connections (the probe rounds found it reachable).
    pub reachable: bool,
    /// The paths of the node's links that are not direct ("to home-b: relayed via lab0").
    pub paths: Vec<String>,
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
    /// How its sessions were opened in the last placement: "direct", "reversed" (the receiver
    /// accepts no connections and dialled the sender), "punched" (neither accepts any; TCP
    /// simultaneous open through both NATs) or "relayed via NODE".
    pub path: String,
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
    /// Micro-batches each stage ran (islands' shares may differ).
    pub micro_batches: Vec<usize>,
    /// Micro-batches the step read, every replica's (fewer while islands are taken out).
    pub read: usize,
}

impl StepTiming {
    /// Each stage's compute as if it had run `m` micro-batches (islands of unequal shares
    /// compared on one scale; unchanged where it ran `m`).
    pub fn compute_at(&self, m: usize) -> Vec<f64> {
        self.compute_s
            .iter()
            .enumerate()
            .map(|(i, &c)| match self.micro_batches.get(i) {
                Some(&k) if k > 0 && k != m => c * m as f64 / k as f64,
                _ => c,
            })
            .collect()
    }
}

/// What one node did in one step, for live monitoring.
#[derive(Clone, Debug, Serialize)]
pub struct NodeStep {
    pub node: String,
    pub stage: usize,
    pub replica: usize,
    pub compute_s: f64,
    pub wait_s: f64,
    /// The node process's peak resident memory (0: not reported).
    pub peak_memory_bytes: u64,
    /// Seconds since the broker last heard from the node, when the step ended.
    pub heartbeat_age_s: f64,
}

/// Data-plane bytes one node sent to another during one step.
#[derive(Clone, Debug, Serialize)]
pub struct LinkStep {
    pub from: String,
    pub to: String,
    pub bytes: u64,
}

/// Everything the broker knows about one finished step beyond its loss.
#[derive(Clone, Debug, Serialize)]
pub struct StepDetail {
    pub step: u64,
    pub wall_s: f64,
    pub nodes: Vec<NodeStep>,
    pub links: Vec<LinkStep>,
    /// The step of the newest snapshot a loss would roll back to.
    pub snapshot_step: u64,
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
    /// Per-node timings, memory and heartbeats and per-link bytes of the step just reported.
    StepDetail(&'a StepDetail),
    /// The job starts from a checkpoint.
    Resumed {
        path: &'a std::path::Path,
        step: u64,
    },
    /// A node left the run: its stream closed, it fell silent, or it was evicted.
    NodeLost {
        node: &'a str,
        reason: &'a str,
    },
    /// A node reported that a step failed (often the echo of a peer's loss): the run rolls
    /// back; the node stays a member.
    StepFailed {
        node: &'a str,
        reason: &'a str,
    },
    /// Island `island` was taken out at step `step` (one of its nodes was lost): the
    /// `islands_left` others go on from there, keeping their state, and the islands are
    /// re-formed at the next synchronisation.
    IslandOut {
        island: usize,
        step: u64,
        islands_left: usize,
    },
    /// Training goes on from the snapshot at `step`, `lost` steps after where it was.
    Recovered {
        step: u64,
        lost: u64,
    },
    /// The run changes shape at a step boundary without a rollback.
    Reshaped {
        step: u64,
        why: &'a str,
    },
    /// Checkpoints in the resume directory that could not be used, and why.
    SkippedCheckpoint {
        path: &'a std::path::Path,
        reason: &'a str,
    },
    /// Writing a checkpoint, or a snapshot to the state directory, failed; training goes on
    /// from the last snapshot the broker has.
    CheckpointFailed {
        reason: &'a str,
    },
}

/// One recovery from a lost or failed node.
#[derive(Clone, Debug, Serialize)]
pub struct RecoveryRecord {
    pub node: String,
    pub reason: String,
    /// Steps finished when the run was interrupted.
    pub interrupted_at_step: u64,
    /// The snapshot training went on from.
    pub resumed_from_step: u64,
    /// That snapshot was a sharded one, restored from the nodes' shards (else the broker's).
    pub from_shards: bool,
    pub steps_lost: u64,
    /// Nodes in the run before and after.
    pub nodes_before: usize,
    pub nodes_after: usize,
    /// From the interruption until every node of the new placement was ready.
    pub seconds: f64,
    /// The node was evicted (blamed for a stall or a fault), not lost.
    pub evicted: bool,
    /// Island-local recovery: the island taken out of the round (its node's); the other islands
    /// went on from the interrupted step, keeping their state (nothing rolled back).
    pub island_out: Option<usize>,
}

/// A change of the run's shape at a step boundary, without a rollback.
#[derive(Clone, Debug, Serialize)]
pub struct ReshapeRecord {
    pub step: u64,
    pub why: String,
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub seconds: f64,
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
    /// The run's identity, written into its checkpoints.
    pub run_id: String,
    pub recoveries: Vec<RecoveryRecord>,
    pub reshapes: Vec<ReshapeRecord>,
    pub snapshots: SnapshotStats,
    /// Nodes that computed far slower than their reported capabilities predicted (their
    /// figures were derated for later plans).
    pub overclaims: Vec<String>,
    /// Nodes persistently slower than their plan, and what was done about each.
    pub stragglers: Vec<String>,
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

/// What the run ends with: its report and the final state (on the broker's disk until the
/// outcome is dropped).
pub struct ClusterOutcome {
    pub report: ClusterReport,
    state: Arc<Stored>,
    _dir: StateDir,
}

impl ClusterOutcome {
    /// The final parameters in graph order, read into memory.
    pub fn params(&self) -> Result<Vec<Vec<f32>>> {
        self.state.params()
    }
}

/// A member's connection, by the serial number the control plane gave it when it joined: a node
/// that rejoins under the same name is a new member.
type MemberId = u64;

struct Member {
    serial: MemberId,
    id: String,
    caps: Capabilities,
    data_address: String,
    /// SHA-256 of the certificate it joined with; its peers accept no other on the data plane.
    certificate: [u8; 32],
    tx: ToNode,
    /// When it was last heard from (kept by its stream task).
    live: Arc<Liveness>,
    /// Why its stream ended; gone members are dropped between runs (never during one, so
    /// member indices stay valid while a plan uses them).
    gone: Option<String>,
    /// Why it asked to leave; it serves until the next step boundary, then is released.
    leaving: Option<String>,
    /// How many times slower than its claims it computed (1: as claimed); scales its profile.
    derate: f64,
    /// Why it stands by instead of training (a straggler the job runs faster without); it is
    /// used again only when the job cannot go on otherwise.
    benched: Option<String>,
}

impl Member {
    /// Joined, connected, not leaving and not benched.
    fn can_serve(&self) -> bool {
        self.gone.is_none() && self.leaving.is_none() && self.benched.is_none()
    }
}

/// The current placement as it was planned: each node's predicted compute per micro-batch (in
/// `Layout::all` order) and, when a scheduler made it, the scheduler's plan.
#[derive(Default)]
struct Placed {
    predicted_s: Vec<f64>,
    /// Each node's derating factor then (`Layout::all` order).
    derates: Vec<f64>,
    /// The members the scheduler planned over, in its device order, and its plan.
    active: Vec<usize>,
    scheduled: Option<fusion_plan::Plan>,
    /// Per stage of the scheduled plan: whether it recomputes its activations to fit.
    recompute: Vec<bool>,
    /// A straggler was dealt with in this placement already.
    handled: bool,
    /// The re-plan it called for, until a step boundary with a snapshot makes it.
    replan: Option<String>,
    /// Islands: micro-batches each island runs per step (`shares.rs`), and each island's
    /// measured micro-batches per second in the steps since they were set.
    shares: Vec<usize>,
    island_rates: Vec<Vec<f64>>,
}

/// Which member runs each stage of each pipeline replica: `replicas[r][s]`.
#[derive(Clone)]
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
        serial: MemberId,
        node: String,
        reason: String,
    },
    /// A node reported a failure (often the echo of a peer's loss): roll back and retry.
    Failed { node: String, reason: String },
    /// A node is blamed for a stall or a fault (a peer's report, or its own progress): it is
    /// told to stop and the run goes on without it, as after a loss.
    Evicted {
        serial: MemberId,
        node: String,
        reason: String,
    },
    /// The membership changed at a step boundary (a node leaves, or spares can grow the job);
    /// the state was snapshotted just before, so the run goes on without a rollback.
    Reshape(String),
    /// Not recoverable.
    Fatal(Box<RuntimeError>),
}

impl From<RuntimeError> for Interrupt {
    fn from(e: RuntimeError) -> Self {
        Interrupt::Fatal(Box::new(e))
    }
}

impl From<TrainError> for Interrupt {
    fn from(e: TrainError) -> Self {
        Interrupt::Fatal(Box::new(e.into()))
    }
}

type Flow<T> = std::result::Result<T, Interrupt>;

/// Whether a gather watches the members' progress for stalls (during steps), or only their
/// liveness (set-up, snapshots and probes, whose progress the heartbeats do not show).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Watch {
    Liveness,
    Progress,
}

struct Coordinator<'f> {
    job: JobSpec,
    cfg: BrokerConfig,
    graph: Arc<Graph>,
    events: mpsc::Receiver<(MemberId, Event)>,
    members: Vec<Member>,
    /// The broker's own last snapshot, on disk: what a recovery rolls back to when there is no
    /// newer sharded snapshot with a surviving copy of every shard.
    saved: Arc<Stored>,
    /// The newest snapshot the nodes hold (newer than `saved`), when snapshots are sharded.
    sharded: Option<ShardedSnap>,
    state_dir: StateDir,
    run_id: String,
    generation: u64,
    history: History,
    snapshots: Snapshots,
    recoveries: Vec<RecoveryRecord>,
    reshapes: Vec<ReshapeRecord>,
    on_event: Box<dyn FnMut(BrokerEvent) + Send + Sync + 'f>,
    /// (bytes, tensors) sent from one node to another.
    links: BTreeMap<(String, String), (u64, u64)>,
    failures: Vec<String>,
    overclaims: Vec<String>,
    stragglers: Vec<String>,
    /// What the current placement was planned with, for the straggler check.
    placed: Placed,
    /// The step of the last lone non-finite report, retried without its reporter (another at
    /// the same step means the run diverged, not the node).
    diverged_at: Option<u64>,
    /// Islands that overlap their synchronisations: the steps after whose update the
    /// synchronisation overlapped the next round (the islands then hold different parameters).
    overlapped: std::collections::BTreeSet<u64>,
    /// Streaming islands (`fragments` > 1): the steps after whose update only one fragment of
    /// the parameters was synchronised (the islands then hold different parameters).
    partial: std::collections::BTreeSet<u64>,
    /// Seconds the last blocking synchronisation of overlapping islands took: what a snapshot
    /// costs them beyond its gather (a snapshot needs every island on the same parameters).
    blocking_sync_s: Option<f64>,
    placement: Vec<StagePlacement>,
    plan_explanation: Vec<String>,
    /// The job's sharding policy; `job.train.shard_optimizer` is what the current placement
    /// resolved it to (on or off), which is what its nodes are told.
    sharding_policy: fusion_train::ShardOptimizer,
    /// Members no prober could open a connection to (NAT, firewall), by id.
    unreachable: std::collections::BTreeSet<String>,
    /// The public IP address of members whose probes left through a NAT that kept their port
    /// (hole punching can reach them), by id; None when a probe came out on another port.
    public_ip: BTreeMap<String, Option<String>>,
    /// Pairs (by id, in order) a hole punch failed between: relayed from then on.
    punch_failed: std::sync::Mutex<std::collections::BTreeSet<(String, String)>>,
    /// Relays a pair's sessions failed through (an altered record), by pair: not chosen again.
    relay_avoid: std::sync::Mutex<BTreeMap<(String, String), std::collections::BTreeSet<String>>>,
    /// The relay each relayed pair (ids in order) of the current placement was assigned: the
    /// sessions keep it until the next placement, whatever later probes say of the legs.
    pinned_relays: BTreeMap<(String, String), String>,
    /// The members being placed (the relays for unreachable pairs are chosen among them).
    placed_nodes: Vec<usize>,
    /// Probed links by (from, to) node id.
    measured: BTreeMap<(String, String), MeasuredLink>,
    probe_round: u64,
    /// AdaTopK's codec per link direction, with its hysteresis.
    codecs: Vec<LinkCodec>,
    adaptive_codecs: CodecController,
    /// Islands: outer synchronisations run, and the bytes they sent and would have sent dense.
    outer: fusion_train::OuterReport,
    /// The placement training runs on (for an island-local recovery).
    current: Option<island_loss::Current>,
    /// Where the islands could resume from now, if one of them were taken out: set while a
    /// training step runs before its updates are sent, and between steps.
    resumable: Option<island_loss::Resumable>,
    /// Where training resumes after an island-local recovery (else at the last snapshot).
    resume_at: Option<island_loss::Resumable>,
    /// Since when islands are out of the current placement, and how many nodes it had before.
    islands_out: Option<(Instant, usize)>,
    /// f16 jobs: the one dynamic loss scale every node's backward starts from.
    scaler: Option<fusion_train::LossScaler>,
    /// f16 jobs: the scaler as the broker's (gathered) snapshot left it, which a rollback to
    /// that snapshot restores (a sharded snapshot keeps its own).
    saved_scaler: Option<fusion_train::LossScaler>,
    /// f16 jobs: the steps (0-based) whose update every node skipped for overflow, so applied no
    /// optimizer step (a step run again after a rollback is judged again).
    skipped_updates: std::collections::BTreeSet<u64>,
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
    if let Some(o) = job.train.outer.as_ref().filter(|_| job.replicas > 1) {
        if matches!(o.codec, Codec::RandomK { .. } | Codec::AdaTopK) {
            return Err(RuntimeError::Config(format!(
                "islands on a cluster send pseudo-gradients as none, fp16, bf16, int8 or topk:D, \
                 not {}",
                o.codec
            )));
        }
        o.shares.initial(job.replicas, job.train.micro_batches)?;
    }
    let model = adapt_model(job.model.clone(), job.data.kind())?;
    let graph = Arc::new(model.graph(job.train.batch_size, job.train.seq_len)?);
    if let Some(o) = job.train.outer.as_ref().filter(|_| job.replicas > 1) {
        if o.fragments as usize > graph.params.len() {
            return Err(RuntimeError::Config(format!(
                "{} fragments for a model of {} parameter tensors (a fragment is a band of \
                 whole tensors)",
                o.fragments,
                graph.params.len()
            )));
        }
    }
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
    // Beside the checkpoints by default, so a checkpoint links the snapshot's file.
    let state_dir = cfg.state_dir.clone().or_else(|| {
        job.train
            .checkpoint_dir
            .as_ref()
            .map(|d| d.join(".broker-state"))
    });
    if state_dir.is_some() && state_dir == job.train.checkpoint_dir {
        return Err(RuntimeError::Config(
            "the state directory must not be the checkpoint directory itself (a subdirectory \
             of it will do)"
                .into(),
        ));
    }
    let mut state_dir = StateDir::open(state_dir.as_deref())?;
    let start = initial_state(&graph, &job.train, &cfg, &mut state_dir)?;
    let (ev_tx, ev_rx) = mpsc::channel(crate::service::EVENT_QUEUE);
    let service = BrokerService {
        token: cfg.token.clone(),
        revocation: cfg.revocation.clone(),
        precision: job.precision,
        events: ev_tx,
        serial: AtomicU64::new(0),
    };
    let server = tonic::transport::Server::builder()
        .tls_config(crate::identity::server_tls(&cfg.identity))?
        .http2_keepalive_interval(Some(Duration::from_secs(5)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        // A node needs one call (its control stream); a few allow for a reconnect.
        .max_concurrent_streams(Some(4))
        .add_service(InterceptedService::new(
            BrokerServer::new(service)
                .max_decoding_message_size(MAX_NODE_MESSAGE)
                .max_encoding_message_size(MAX_CONTROL_MESSAGE),
            crate::listen::require_token(cfg.token.clone()),
        ));
    let (incoming, _gate) = crate::listen::gated_incoming(listener, cfg.connection_limits);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serve = tokio::spawn(server.serve_with_incoming_shutdown(incoming, async {
        let _ = stop_rx.await;
    }));
    job.compression
        .validate()
        .map_err(|e| RuntimeError::Config(format!("compression: {e}")))?;
    let compression_policy = job.compression.policy();
    let job_model = model;
    let resumed_shards = match &cfg.resume {
        // A sharded snapshot's shards hold whole moments: replicas sharding their optimizer
        // state resume from the checkpoint.
        Some(dir)
            if job.train.shard_optimizer.is_on()
                && !dir.join("state.json").is_file()
                && dir.join("sharded").is_dir() =>
        {
            tracing::warn!(
                "--shard-optimizer resumes from the checkpoint in {}, not from newer sharded \
                 snapshots",
                dir.display()
            );
            (None, Vec::new())
        }
        Some(dir) if !dir.join("state.json").is_file() => sharded::newest_manifest(
            &dir.join("sharded"),
            &start.run_id,
            start.saved.step,
            &graph,
        ),
        _ => (None, Vec::new()),
    };
    let newest = resumed_shards
        .0
        .as_ref()
        .map_or(start.saved.step, |(_, s)| s.step);
    let first_generation = newest << 20;
    // A resumed f16 run scales as it would have (from the newer of the checkpoint and the
    // sharded snapshot); a rollback to the checkpoint goes back to the checkpoint's scale.
    let resumed_scale = match &resumed_shards.0 {
        Some((_, s)) => s.loss_scale.clone(),
        None => start.loss_scale.clone(),
    };
    let f16 = job.precision == fusion_backend::Precision::F16;
    let scaler = f16.then(|| resumed_scale.unwrap_or_default());
    let saved_scaler = f16.then(|| start.loss_scale.clone().unwrap_or_default());
    let (outer_islands, outer_config) = (job.replicas, job.train.outer.clone().unwrap_or_default());
    let sharding_policy = job.train.shard_optimizer;
    let mut job = job;
    if sharding_policy == fusion_train::ShardOptimizer::Auto {
        // Resolved by each placement that plans (`plan_resolving_sharding`).
        job.train.shard_optimizer = fusion_train::ShardOptimizer::Off;
    }
    let mut c = Coordinator {
        job: JobSpec {
            model: job_model,
            ..job
        },
        sharding_policy,
        cfg,
        graph,
        events: ev_rx,
        members: Vec::new(),
        saved: Arc::new(start.saved),
        sharded: None,
        state_dir,
        run_id: start.run_id,
        // A broker resuming a run starts its generations above any the previous broker of the
        // run can have used (fewer than 2^20 re-plans), so no node mistakes a session of the old
        // placement for one of the new.
        generation: first_generation,
        history: History::new(),
        snapshots: Snapshots::default(),
        recoveries: Vec::new(),
        reshapes: Vec::new(),
        on_event: Box::new(on_event),
        links: BTreeMap::new(),
        failures: Vec::new(),
        overclaims: Vec::new(),
        stragglers: Vec::new(),
        placed: Placed::default(),
        diverged_at: None,
        overlapped: Default::default(),
        partial: Default::default(),
        blocking_sync_s: None,
        placement: Vec::new(),
        plan_explanation: Vec::new(),
        unreachable: std::collections::BTreeSet::new(),
        public_ip: BTreeMap::new(),
        punch_failed: Default::default(),
        relay_avoid: Default::default(),
        pinned_relays: BTreeMap::new(),
        placed_nodes: Vec::new(),
        measured: BTreeMap::new(),
        probe_round: 0,
        codecs: Vec::new(),
        adaptive_codecs: CodecController::new(compression_policy),
        outer: fusion_train::OuterReport {
            islands: outer_islands,
            config: outer_config,
            syncs: 0,
            overlapped: 0,
            partial: 0,
            sent_bytes: 0,
            dense_bytes: 0,
            shares: Vec::new(),
            rebalances: Vec::new(),
            disagreements: Vec::new(),
        },
        current: None,
        resumable: None,
        resume_at: None,
        islands_out: None,
        saved_scaler,
        scaler,
        skipped_updates: Default::default(),
    };
    c.snapshots.policy = c.cfg.snapshots;
    if c.snapshots.policy.sharded && c.islands() {
        tracing::warn!(
            "islands take gathered snapshots, which keep every island's optimizer moments and \
             the outer momentum (shards do not): --snapshots sharded applies to runs without \
             islands"
        );
        c.snapshots.policy.sharded = false;
    }
    if c.snapshots.policy.sharded && c.job.train.shard_optimizer.is_on() {
        tracing::warn!(
            "replicas that shard their optimizer state take gathered snapshots (each replica \
             sends its piece): --snapshots sharded does not apply"
        );
        c.snapshots.policy.sharded = false;
    }
    let (shards, skipped_shards) = resumed_shards;
    for (path, reason) in start.skipped.iter().chain(&skipped_shards) {
        (c.on_event)(BrokerEvent::SkippedCheckpoint { path, reason });
    }
    match (shards, &start.resumed_from) {
        // Newer than the checkpoint: the nodes' shards, which a recovery falls back from.
        (Some((path, snap)), _) => {
            let step = snap.step;
            c.sharded = Some(snap);
            (c.on_event)(BrokerEvent::Resumed { path: &path, step });
        }
        (None, Some(path)) => {
            let step = c.saved.step;
            (c.on_event)(BrokerEvent::Resumed { path, step });
        }
        (None, None) => {}
    }
    let resumed = start.resumed_from.is_some() || c.sharded.is_some();
    if c.islands() && resumed && (c.sharded.is_some() || !c.saved.has_outer_momentum()) {
        tracing::warn!(
            "the islands' outer momentum restarts at zero: the state this run resumes from holds \
             none (written by a run without islands, or before islands snapshots kept it)"
        );
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
                evicted: false,
            }))))
            .await;
    }
    // Give the nodes a moment to read their stop before the server goes away.
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Close the nodes' streams now; the final state outlives the coordinator.
    let Coordinator {
        saved,
        state_dir,
        members,
        events,
        ..
    } = c;
    drop((members, events));
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), serve).await;
    result.map(|report| ClusterOutcome {
        report,
        state: saved,
        _dir: state_dir,
    })
}

fn msg(body: broker_message::Body) -> BrokerMessage {
    BrokerMessage { body: Some(body) }
}

/// Where a run starts: a checkpoint of an earlier run of the same job, or fresh parameters.
struct Start {
    saved: Stored,
    run_id: String,
    resumed_from: Option<PathBuf>,
    /// Newer checkpoints that could not be used, and why.
    skipped: Vec<(PathBuf, String)>,
    /// The resumed checkpoint's loss scaler (f16 runs).
    loss_scale: Option<fusion_train::LossScaler>,
}

/// The state training starts from: the newest valid checkpoint in `resume` (a run directory, or
/// one `step-N` directory) continuing that checkpoint's run, or fresh parameters and a new run.
/// Either is put in `dir` without loading the state into memory.
fn initial_state(
    graph: &Graph,
    cfg: &TrainConfig,
    broker: &BrokerConfig,
    dir: &mut StateDir,
) -> Result<Start> {
    let fresh = |dir: &mut StateDir, run_id: String, skipped| {
        Ok(Start {
            saved: Stored::fresh(dir, graph, cfg, broker.init.as_deref())?,
            run_id,
            resumed_from: None,
            skipped,
            loss_scale: None,
        })
    };
    let Some(path) = broker.resume.as_ref() else {
        return fresh(
            dir,
            broker.run_id.clone().unwrap_or_else(new_run_id),
            Vec::new(),
        );
    };
    let (found, skipped) = if path.join("state.json").is_file() {
        let state = fusion_train::verify_checkpoint(path, graph, &cfg.optimizer)?;
        (Some((path.clone(), state)), Vec::new())
    } else if broker.run_id.is_some() && !path.is_dir() {
        // A run taken over before anything was written.
        (None, Vec::new())
    } else {
        // Continue the run `latest` belongs to (or the one named), even past its corrupt
        // newest checkpoint.
        let run = broker
            .run_id
            .clone()
            .or_else(|| fusion_train::latest_run_id(path));
        fusion_train::newest_valid_checkpoint(path, graph, &cfg.optimizer, run.as_deref())?
    };
    let Some((path, state)) = found else {
        if let Some(run) = &broker.run_id {
            // Checkpoints there that could not be used (not another run's): starting the run
            // again from step 0 would throw its progress away without a word.
            let unusable: Vec<String> = skipped
                .iter()
                .filter(|(_, r)| !r.starts_with("written by run"))
                .map(|(p, r)| format!("{}: {r}", p.display()))
                .collect();
            if !unusable.is_empty() {
                return Err(RuntimeError::Config(format!(
                    "run {run} has checkpoints in {} but none can be used ({}); not starting it \
                     again from the beginning",
                    path.display(),
                    unusable.join("; ")
                )));
            }
            tracing::warn!(
                "no checkpoint of run {run} in {}: the run starts again from the beginning",
                path.display()
            );
            return fresh(dir, run.clone(), skipped);
        }
        let why: Vec<String> = skipped
            .iter()
            .map(|(p, r)| format!("{}: {r}", p.display()))
            .collect();
        return Err(RuntimeError::Config(format!(
            "no usable checkpoint in {}{}",
            path.display(),
            if why.is_empty() {
                String::new()
            } else {
                format!(" ({})", why.join("; "))
            }
        )));
    };
    Ok(Start {
        saved: Stored::from_checkpoint(dir, graph, &path, &state)?,
        run_id: state.run_id.clone().unwrap_or_else(new_run_id),
        resumed_from: Some(path),
        skipped,
        loss_scale: state.loss_scale.clone(),
    })
}

/// A fresh run id: 16 random hex digits.
pub fn new_run_id() -> String {
    use rand::RngCore;
    format!("{:016x}", rand::rng().next_u64())
}

/// What the broker keeps of a run's progress; records past a rollback are dropped.
struct History {
    start: Instant,
    start_step: u64,
    steps: Vec<StepRecord>,
    evals: Vec<EvalRecord>,
    timings: Vec<StepTiming>,
}

impl History {
    fn new() -> Self {
        History {
            start: Instant::now(),
            start_step: 0,
            steps: Vec::new(),
            evals: Vec::new(),
            timings: Vec::new(),
        }
    }

    /// Forgets every step after `step` (they are trained again).
    fn truncate(&mut self, step: u64) {
        self.steps.retain(|s| s.step <= step);
        self.evals.retain(|e| e.step <= step);
        self.timings.retain(|t| t.step <= step);
    }

    /// Mean wall time of the last few steps.
    fn mean_step_s(&self) -> Option<f64> {
        let recent: Vec<f64> = self
            .timings
            .iter()
            .rev()
            .take(10)
            .map(|t| t.wall_s)
            .collect();
        (!recent.is_empty()).then(|| recent.iter().sum::<f64>() / recent.len() as f64)
    }
}
