//! A compute node: joins the broker over the control plane, receives its stage and parameters,
//! connects to its peers over the data plane, and runs the broker's commands until told to stop.
//! Heartbeats flow from a separate task, so a node busy computing is still seen alive; a node
//! that dies or freezes stops them.

use crate::assignment::{check_assignment, CheckedAssignment};
use crate::dataplane::{DataPlane, Fetcher, Inbound, Outbox, PeerAddr};
use crate::error::{Result, RuntimeError};
use crate::fetch::Wanted;
pub use crate::hostile::BadResult;
use crate::mailbox::Mailbox;
use crate::path::{routes, ReceiveRoute, SendRoute};
use crate::probe::{LinkEstimate, DEFAULT_PROBE_BYTES};
use crate::progress::Tracker;
use crate::session::{join, Session, SessionEnd};
use crate::shards::{ShardFile, ShardStore, StageCopy};
use crate::wire::{bytes_to_f32, param_messages};
use crate::worker::{StageWorker, StepOutcome};
use fusion_backend::Backend;
use fusion_data::HostTensor;
use fusion_exec::Mode;
use fusion_exec::Schedule;
use fusion_proto::{
    broker_message, node_message, Assignment, BrokerMessage, Capabilities, DType, Failure,
    FetchShard, LinkBytes, LinkMeasurement, LinkReport, LoadShards, ParamPart, ParamsDone,
    PeerLink, Phase, ProbeLinks, Ready, RunMode, SaveShard, SaveState, ShardCaptured, ShardSaved,
    StepResult,
};
use fusion_transport::{ConnectionLimits, NodeIdentity, PacedLink};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Largest message a node accepts from the broker: a micro-batch's input tensor must fit
/// (parameters travel in 1 MiB pieces).
pub const MAX_CONTROL_MESSAGE: usize = 256 << 20;

/// Largest message the broker accepts from a node, and only once the node's token was checked:
/// state travels in 1 MiB pieces; an evaluation's predictions are the largest result.
pub const MAX_NODE_MESSAGE: usize = 64 << 20;

#[derive(Clone)]
pub struct NodeConfig {
    pub node_id: String,
    /// `https://host:port` of the broker; with standby brokers (elected through etcd), every
    /// broker's: the node tries them in turn until one that leads accepts it.
    pub brokers: Vec<String>,
    /// The name in the broker's certificate.
    pub broker_name: String,
    pub token: String,
    pub identity: NodeIdentity,
    /// Where to accept peers' data-plane sessions.
    pub data_listen: SocketAddr,
    /// Host peers should connect to (default: the listening address).
    pub advertise_host: Option<String>,
    pub heartbeat: Duration,
    /// How long to wait for a peer's tensor before failing the step.
    pub peer_timeout: Duration,
    /// After losing the broker, how long to keep trying to rejoin it (zero: exit at once).
    pub reconnect_for: Duration,
    /// Set to true to leave the job gracefully (the broker releases the node at the next step
    /// boundary, without a rollback).
    pub leave: Option<tokio::sync::watch::Receiver<bool>>,
    /// Data-plane connections kept open at once, in all and per remote address.
    pub connection_limits: ConnectionLimits,
    /// Bytes of memory an assignment may ask for (its parameters and optimizer state); the
    /// machine's memory by default, 0 for no limit.
    pub memory_limit: u64,
    /// Where the node keeps its shards of sharded snapshots (and copies of its buddies'): a
    /// new temporary directory when none is given.
    pub state_dir: Option<std::path::PathBuf>,
    /// Emulation: this node stands for a device this many times slower than the machine it
    /// runs on (1: none). Its training steps' compute is stretched (the thread sleeps for the
    /// difference) and its reported speed divided, so the plan knows it as that device.
    pub emulated_slowdown: f64,
    /// A file that the nodes started together on one machine lock in turn while they profile
    /// (the local launcher gives its nodes one), so they do not measure each other's load.
    pub profile_lock: Option<std::path::PathBuf>,
    /// Emulation on a local cluster: the node stands for a device behind this NAT or firewall.
    /// Anything but `None` accepts no data-plane connections (its peers reach it reversed,
    /// punched or relayed); `Symmetric` also keeps its probes from telling which port they
    /// left from, as a NAT that picks a new port per connection would.
    pub emulated_nat: fusion_testbed::Nat,
    /// Faults a test injects (none in real runs).
    pub test_hooks: TestHooks,
}

/// Faults a chaos test injects into a node.
#[derive(Clone, Default)]
pub struct TestHooks {
    /// The compute thread wedges (sleeps an hour) at this training step, once per process;
    /// heartbeats go on.
    pub wedge_at_step: Option<u64>,
    /// The data plane stops reading its sessions once a tensor of this step (or a later one)
    /// arrives, in every assignment.
    pub stop_reading_at_step: Option<u64>,
    /// The node lies in its result of this training step, as a faulty or hostile node would.
    pub bad_result_at_step: Option<(u64, BadResult)>,
    /// The node claims a device this many times faster than it measured.
    pub claim_speedup: Option<f64>,
    /// From this training step on, the node computes this many times slower (a straggler).
    pub slowdown_from_step: Option<(u64, f64)>,
    /// The node process exits (as a crash would: no goodbye, the kernel closes its sockets)
    /// when the broker runs this training step.
    pub crash_at_step: Option<u64>,
    /// A shard is written only once the stage has begun the training step so many steps after
    /// the snapshot's (for at most two minutes): training must go on beside the write.
    pub shard_write_after_steps: Option<u64>,
    /// Sessions this node relays have this byte altered (a relay that tampers).
    pub tamper_relayed_byte: Option<u64>,
    fired: Arc<std::sync::atomic::AtomicBool>,
}

impl TestHooks {
    /// Applies [`TestHooks::bad_result_at_step`] to a training step's losses and squared
    /// gradient norm.
    fn tamper(&self, step: u64, train: bool, losses: &mut Vec<f32>, grad_square_sum: &mut f64) {
        if let Some((at, bad)) = self.bad_result_at_step {
            if at == step && train && !bad.on_data_plane() {
                tracing::warn!("test hook: lying in the result of step {step} ({bad:?})");
                bad.tamper_result(losses, grad_square_sum);
            }
        }
    }

    /// Whether the state sent after `step` lies (it names a parameter the stage does not hold).
    fn foreign_state_at(&self, step: u64) -> bool {
        self.bad_result_at_step == Some((step, BadResult::ForeignState))
    }
}

impl NodeConfig {
    /// A node of the broker at `brokers` (one URL, or several separated by commas).
    pub fn local(node_id: &str, brokers: &str, token: &str, identity: NodeIdentity) -> Self {
        NodeConfig {
            node_id: node_id.into(),
            brokers: brokers
                .split(',')
                .map(|u| u.trim().to_string())
                .filter(|u| !u.is_empty())
                .collect(),
            broker_name: "broker".into(),
            token: token.into(),
            identity,
            data_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise_host: None,
            heartbeat: Duration::from_millis(500),
            peer_timeout: Duration::from_secs(120),
            reconnect_for: Duration::from_secs(300),
            leave: None,
            connection_limits: ConnectionLimits::default(),
            memory_limit: memory_bytes(),
            state_dir: None,
            emulated_slowdown: 1.0,
            profile_lock: None,
            emulated_nat: fusion_testbed::Nat::None,
            test_hooks: TestHooks::default(),
        }
    }
}

/// What the node knows of its device, announced when joining.
pub fn capabilities<B: Backend>(backend: &B, lock: Option<&std::path::Path>) -> Capabilities {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let memory = memory_bytes();
    let (measured_gflops, measured_memory_gbs, calibration, op_overhead_us) =
        profile(backend, memory, lock);
    Capabilities {
        backend: backend.name(),
        software_version: env!("CARGO_PKG_VERSION").into(),
        device: format!("{} {} threads", std::env::consts::ARCH, threads),
        memory_bytes: memory,
        measured_gflops,
        measured_memory_gbs,
        calibration,
        op_overhead_us,
    }
}

/// The machine's memory in bytes (0 when unknown).
pub fn memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| {
                    l.split_whitespace()
                        .nth(1)
                        .and_then(|k| k.parse::<u64>().ok())
                })
        })
        .map_or(0, |kb| kb * 1024)
}

/// Profiles the backend on two small GPT-2 graphs (a few hundred milliseconds on a CPU): dense
/// and element-wise speed, the calibration of the planner's roofline and the per-operator
/// overhead (microseconds). Zeros if profiling fails; the broker then plans with conservative
/// defaults.
fn profile<B: Backend>(b: &B, memory: u64, lock: Option<&std::path::Path>) -> (f64, f64, f64, f64) {
    let _turn = lock.map(ProfileTurn::wait);
    let graphs = fusion_models::calibration_graphs(true);
    let run = graphs.map_err(|e| e.to_string()).and_then(|g| {
        fusion_estimate::profile_backend(b, "node", &g, memory.max(1) as f64, 2)
            .map_err(|e| e.to_string())
    });
    match run {
        Ok(r) => (
            r.profile.dense_flops_per_s / 1e9,
            r.profile.memory_bytes_per_s / 1e9,
            r.profile.calibration,
            r.profile.op_overhead_s * 1e6,
        ),
        Err(e) => {
            tracing::warn!("profiling the backend failed: {e}");
            (0.0, 0.0, 0.0, 0.0)
        }
    }
}

/// A node's turn to profile: an exclusive lock on the file its launcher named
/// ([`NodeConfig::profile_lock`]), so that nodes started together on one machine (a local
/// cluster, one node per GPU) profile one after another instead of measuring each other's load.
/// Released when dropped; when the file cannot be opened, or after waiting
/// [`ProfileTurn::WAIT`], the node profiles at once.
struct ProfileTurn(Option<std::fs::File>);

impl ProfileTurn {
    /// How long a node waits for the others before it profiles anyway (a profile takes about a
    /// second on a CPU; a node stuck holding the lock must not keep the rest from joining).
    const WAIT: Duration = Duration::from_secs(30);

    fn wait(path: &std::path::Path) -> Self {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .or_else(|_| std::fs::File::open(path));
        let file = match file {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("profiling without waiting for {}: {e}", path.display());
                return ProfileTurn(None);
            }
        };
        let deadline = std::time::Instant::now() + Self::WAIT;
        loop {
            match file.try_lock() {
                Ok(()) => return ProfileTurn(Some(file)),
                Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => {
                    tracing::warn!("profiling without waiting for {}: {e}", path.display());
                    return ProfileTurn(None);
                }
            }
        }
    }
}

impl Drop for ProfileTurn {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            let _ = f.unlock();
        }
    }
}

struct Active<B: Backend> {
    generation: u64,
    worker: Option<StageWorker<B>>,
    schedule: Schedule,
    mailbox: Arc<Mailbox>,
    outbox: Arc<Outbox>,
    feeds: HashMap<(usize, usize), HostTensor>,
    /// A step the broker superseded while it computed: its thread still holds the worker, which
    /// an assignment keeping the state takes back once the thread notices the poisoned mailbox.
    abandoned: Option<ComputeJob<B>>,
}

/// How long an assignment keeping the state waits for a superseded step's thread to give the
/// worker back (it stops before its next pass or wait on a peer; a wedged one makes the
/// assignment fail).
const KEEP_STATE_WAIT: Duration = Duration::from_secs(120);

/// A node between assignments, or running a stage.
enum NodeState<B: Backend> {
    Idle,
    Assigned(Box<Active<B>>),
}

impl<B: Backend> NodeState<B> {
    fn active(&mut self, what: &str) -> Result<&mut Active<B>> {
        match self {
            NodeState::Assigned(a) => Ok(a),
            NodeState::Idle => Err(no_assignment(what)),
        }
    }

    /// The worker of the stage held now, for an assignment that keeps its state: a superseded
    /// step's thread gives it back once it stops (at most [`KEEP_STATE_WAIT`]).
    async fn take_worker(&mut self) -> Result<StageWorker<B>> {
        let act = self.active("an assignment keeping the state")?;
        if let Some(w) = act.worker.take() {
            return Ok(w);
        }
        let job = act
            .abandoned
            .take()
            .ok_or_else(|| no_assignment("an assignment keeping the state"))?;
        match tokio::time::timeout(KEEP_STATE_WAIT, job).await {
            Ok(Ok((worker, _))) => Ok(worker),
            Ok(Err(e)) => Err(RuntimeError::Protocol(format!("compute thread: {e}"))),
            Err(_) => Err(RuntimeError::Timeout(format!(
                "the superseded step did not stop within {} s: the stage's state cannot be kept",
                KEEP_STATE_WAIT.as_secs()
            ))),
        }
    }

    /// Drops the stage (interrupting any wait on a peer with `reason`).
    fn reset(&mut self, data: &DataPlane, reason: &str) {
        if let NodeState::Assigned(old) = std::mem::replace(self, NodeState::Idle) {
            old.mailbox.poison(reason.into());
        }
        data.set_inbound(None);
    }
}

/// Runs a node until the broker stops the job (Ok) or something fails (Err with the reason).
/// When the broker is lost the node keeps its data plane and rejoins, with backoff, for up to
/// `reconnect_for`; a node asked to leave (`cfg.leave`) tells the broker and is released at the
/// next step boundary.
pub async fn run_node<B: Backend>(backend: B, cfg: NodeConfig) -> Result<()> {
    let data = DataPlane::start(
        cfg.data_listen,
        cfg.identity.clone(),
        cfg.node_id.clone(),
        cfg.token.clone(),
        cfg.connection_limits,
        Arc::new(ShardStore::open(cfg.state_dir.as_deref())?),
        cfg.emulated_nat.accepts_connections(),
    )
    .await?;
    data.tamper_relayed(cfg.test_hooks.tamper_relayed_byte);
    let host = cfg
        .advertise_host
        .clone()
        .unwrap_or_else(|| data.address.ip().to_string());
    let data_address = format!("{host}:{}", data.address.port());
    // Profiling computes for a while (and may wait for this machine's other nodes to finish
    // theirs): off the async workers, so the data plane already listening stays served.
    let profiled = backend.clone();
    let lock = cfg.profile_lock.clone();
    let mut caps = tokio::task::spawn_blocking(move || capabilities(&profiled, lock.as_deref()))
        .await
        .map_err(|e| RuntimeError::Config(format!("profiling the backend stopped: {e}")))?;
    let slow = cfg.emulated_slowdown;
    if slow.is_finite() && slow > 1.0 {
        tracing::info!("emulating a device {slow} times slower than this machine");
        caps.measured_gflops /= slow;
        caps.measured_memory_gbs /= slow;
        caps.op_overhead_us *= slow;
    }
    // The planner plans with the memory this node accepts an assignment in.
    if cfg.memory_limit > 0 {
        caps.memory_bytes = cfg.memory_limit;
    }
    if let Some(x) = cfg.test_hooks.claim_speedup {
        tracing::warn!("test hook: claiming a device {x} times faster than measured");
        caps.measured_gflops *= x;
        caps.measured_memory_gbs *= x;
        caps.op_overhead_us /= x;
    }
    let mut lost_since: Option<std::time::Instant> = None;
    loop {
        let budget = match lost_since {
            None => Duration::ZERO,
            Some(t) => cfg.reconnect_for.saturating_sub(t.elapsed()),
        };
        let progress = data.progress.clone();
        let mut session = join(&cfg, &caps, &data_address, budget, &progress).await?;
        let mut state = NodeState::Idle;
        let served = serve(&backend, &cfg, &data, &mut session, &mut state).await;
        state.reset(&data, "the session with the broker ended");
        let why = match served {
            Err(RuntimeError::BrokerGone(why)) | Ok(SessionEnd::BrokerLost(why)) => why,
            Ok(SessionEnd::Stopped) => {
                session.close().await;
                return Ok(());
            }
            Err(e) => {
                session.close().await;
                return Err(e);
            }
        };
        if cfg.reconnect_for.is_zero() || leaving(&cfg) {
            return Err(RuntimeError::BrokerGone(why));
        }
        if session.heard || lost_since.is_none() {
            // A session that carried traffic gives the next loss the whole window again.
            lost_since = Some(std::time::Instant::now());
        } else {
            // Refused before anything arrived (the broker still holds this name's old
            // connection): back off within the same window.
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        if lost_since.is_some_and(|t| t.elapsed() >= cfg.reconnect_for) {
            return Err(RuntimeError::BrokerGone(why));
        }
        tracing::warn!("{}: {why}; rejoining", cfg.node_id);
    }
}

fn leaving(cfg: &NodeConfig) -> bool {
    cfg.leave.as_ref().is_some_and(|l| *l.borrow())
}

/// Waits for the next command, telling the broker once if this node has been asked to leave (an
/// idle node then stops at once).
async fn next_command<B: Backend>(
    cfg: &NodeConfig,
    session: &mut Session,
    state: &NodeState<B>,
) -> Result<std::result::Result<BrokerMessage, SessionEnd>> {
    let mut leave = cfg.leave.clone();
    loop {
        if !session.leave_sent && leaving(cfg) {
            session.leave_sent = true;
            tracing::info!("{}: leaving the job", cfg.node_id);
            let reason = "asked to leave (SIGTERM)".to_string();
            session
                .send(node_message::Body::Leave(fusion_proto::Leave { reason }))
                .await?;
            if matches!(state, NodeState::Idle) {
                return Ok(Err(SessionEnd::Stopped));
            }
        }
        let sent = session.leave_sent;
        let changed = async {
            match leave.as_mut() {
                Some(l) if !sent => l.changed().await.is_ok(),
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            m = session.next() => return Ok(m),
            ok = changed => if !ok { leave = None },
        }
    }
}

/// Serves one session's commands until it ends.
async fn serve<B: Backend>(
    backend: &B,
    cfg: &NodeConfig,
    data: &DataPlane,
    session: &mut Session,
    state: &mut NodeState<B>,
) -> Result<SessionEnd> {
    loop {
        let msg = match next_command(cfg, session, state).await? {
            Ok(m) => m,
            Err(end) => return Ok(end),
        };
        let Some(body) = msg.body else {
            return Err(RuntimeError::Protocol(
                "empty message from the broker".into(),
            ));
        };
        match body {
            broker_message::Body::Assignment(a) => {
                let kept = match a.keep_state {
                    true => Some(state.take_worker().await),
                    false => None,
                };
                state.reset(data, "reassigned");
                let generation = a.generation;
                match setup(backend, cfg, data, a, session, kept).await {
                    Ok(act) => {
                        let generation = act.generation;
                        *state = NodeState::Assigned(Box::new(act));
                        session
                            .send(node_message::Body::Ready(Ready { generation }))
                            .await?;
                    }
                    Err(e) => session.send(failure(&e, generation)).await?,
                }
            }
            broker_message::Body::Feed(f) => store_feed(state.active("a feed")?, f)?,
            broker_message::Body::Run(r) => {
                if let Some(end) = run_step(cfg, session, state.active("a step")?, r).await? {
                    return Ok(end);
                }
            }
            broker_message::Body::Update(u) => {
                if let Some(end) = apply_update(cfg, session, state.active("an update")?, u).await?
                {
                    return Ok(end);
                }
            }
            broker_message::Body::Compression(c) => {
                let act = state.active("compression settings")?;
                let settings: fusion_compress::NodeCompression =
                    serde_json::from_str(&c.settings_json).map_err(|e| {
                        RuntimeError::Protocol(format!("bad compression settings: {e}"))
                    })?;
                act.outbox.set_compression(settings);
            }
            broker_message::Body::Probe(round) => {
                let mut report = probe_round(data, &cfg.node_id, round).await;
                if cfg.emulated_nat == fusion_testbed::Nat::Symmetric {
                    // Behind an emulated symmetric NAT the port a probe left from says nothing.
                    report
                        .links
                        .iter_mut()
                        .for_each(|l| l.local_address.clear());
                }
                session.send(node_message::Body::Links(report)).await?;
            }
            broker_message::Body::Save(s) => {
                data.progress.enter(Phase::Saving, s.step);
                let lie = cfg.test_hooks.foreign_state_at(s.step);
                send_state(session, state.active("a save")?, &s, lie).await?;
                data.progress.idle();
            }
            broker_message::Body::SaveShard(s) => {
                save_shard_beside(cfg, data, session, state.active("a shard save")?, s).await?;
            }
            broker_message::Body::FetchShard(f) => {
                let cancel = session.cancel.clone();
                session.spawn_beside(fetch_shard(data.fetcher(), f, cancel));
            }
            broker_message::Body::AllowFetch(a) => {
                data.allow_fetchers(
                    a.peers
                        .iter()
                        .map(|p| (p.node_id.clone(), peer_addr(p)))
                        .collect(),
                );
            }
            broker_message::Body::LoadShards(_) => {
                return Err(RuntimeError::Protocol(
                    "shards to load outside an assignment".into(),
                ));
            }
            broker_message::Body::Reset(r) => {
                tracing::warn!("{}: reset by the broker: {}", cfg.node_id, r.reason);
                session.cancel_background();
                state.reset(data, &r.reason);
            }
            broker_message::Body::Stop(s) if s.evicted => {
                tracing::error!("{}: evicted: {}", cfg.node_id, s.reason);
                return Err(RuntimeError::Evicted(s.reason));
            }
            broker_message::Body::Stop(s) => {
                tracing::info!("{}: stopped: {}", cfg.node_id, s.reason);
                return Ok(SessionEnd::Stopped);
            }
            broker_message::Body::Param(_) | broker_message::Body::ParamsDone(_) => {
                return Err(RuntimeError::Protocol(
                    "parameters outside an assignment".into(),
                ));
            }
        }
    }
}

/// The failure report of `e` in `generation`, blaming the peer it is attributed to.
fn failure(e: &RuntimeError, generation: u64) -> node_message::Body {
    let (blame, proven) = match e {
        RuntimeError::Peer { peer, proven, .. } => (peer.clone(), *proven),
        RuntimeError::PathFailed { peer, .. } => (peer.clone(), false),
        _ => (String::new(), false),
    };
    node_message::Body::Failure(Failure {
        message: e.to_string(),
        blame,
        generation,
        proven,
        path_failed: matches!(e, RuntimeError::PathFailed { .. }),
    })
}

/// Checks a feed against its declared shape and keeps it for the step.
fn store_feed<B: Backend>(act: &mut Active<B>, f: fusion_proto::Feed) -> Result<()> {
    let shape: Vec<usize> = f.shape.iter().map(|&d| d as usize).collect();
    let numel = shape.iter().try_fold(4usize, |a, &d| a.checked_mul(d));
    if numel != Some(f.data.len()) {
        return Err(RuntimeError::Protocol(format!(
            "feed of tensor {} has {} bytes for shape {shape:?}",
            f.tensor,
            f.data.len()
        )));
    }
    let t = match f.dtype() {
        DType::F32 => HostTensor::Float {
            data: bytes_to_f32(&f.data),
            shape,
        },
        DType::I32 => HostTensor::Ids {
            data: f
                .data
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            shape,
        },
        other => return Err(RuntimeError::Protocol(format!("feed of dtype {other:?}"))),
    };
    act.feeds
        .insert((f.micro_batch as usize, f.tensor as usize), t);
    Ok(())
}

/// Runs one step on the compute thread while still listening to the broker (a reset must
/// interrupt a step that waits for a peer that is gone), then reports its result or failure.
async fn run_step<B: Backend>(
    cfg: &NodeConfig,
    session: &mut Session,
    act: &mut Active<B>,
    r: fusion_proto::RunStep,
) -> Result<Option<SessionEnd>> {
    if r.mode() == RunMode::Train && cfg.test_hooks.crash_at_step == Some(r.step) {
        tracing::error!("test hook: the node process dies at step {}", r.step);
        std::process::exit(137);
    }
    let sync = r.mode() == RunMode::OuterSync;
    if (r.micro_batches == 0 && !sync) || r.micro_batches > MAX_MICRO_BATCHES {
        return Err(RuntimeError::Protocol(format!(
            "a step of {} micro-batches (at most {MAX_MICRO_BATCHES})",
            r.micro_batches
        )));
    }
    let weight = match act.worker.as_ref() {
        Some(w) if sync => w.sync_weight(r.micro_batches, r.total_micro_batches)?,
        _ => 1.0,
    };
    let mut worker = act.worker.take().ok_or_else(|| no_assignment("a step"))?;
    let scale = if r.mode() == RunMode::Train {
        r.loss_scale
    } else {
        0.0
    };
    if let Err(e) = worker.set_loss_scale(scale) {
        act.worker = Some(worker);
        return Err(e);
    }
    let mode = if r.mode() == RunMode::Eval {
        Mode::Eval
    } else {
        Mode::Train
    };
    act.mailbox.begin_step(r.step);
    let (schedule, mailbox, outbox) = (act.schedule, act.mailbox.clone(), act.outbox.clone());
    let mut feeds = std::mem::take(&mut act.feeds);
    let m = r.micro_batches as usize;
    let total = (r.total_micro_batches as usize).max(m);
    let fragment = r.fragment;
    let job = tokio::task::spawn_blocking(move || {
        let res = if sync {
            worker.outer_sync(r.step, weight, r.overlap, fragment, &mailbox, &outbox)
        } else {
            worker.run_step(
                r.step, mode, m, total, schedule, &mut feeds, &mailbox, &outbox,
            )
        };
        (worker, res)
    });
    let (worker, res) = match watch_compute(session, act, job).await? {
        Watched::Done(worker, res) => (*worker, res),
        Watched::Left(end) => return Ok(end),
    };
    act.worker = Some(worker);
    match res {
        Ok(mut o) => {
            let train = r.mode() == RunMode::Train;
            let hooks = &cfg.test_hooks;
            hooks.tamper(r.step, train, &mut o.losses, &mut o.grad_square_sum);
            let sent = act
                .outbox
                .take_sent()
                .into_iter()
                .map(|(peer, bytes, tensors)| LinkBytes {
                    peer,
                    bytes,
                    tensors,
                })
                .collect();
            session
                .send(node_message::Body::Result(StepResult {
                    step: r.step,
                    losses: o.losses,
                    predictions: o.predictions,
                    grad_square_sum: o.grad_square_sum,
                    sent,
                    compute_seconds: o.compute_seconds,
                    wait_seconds: o.wait_seconds,
                    peak_memory_bytes: fusion_train::peak_rss_bytes().unwrap_or(0),
                }))
                .await?;
        }
        Err(e) => {
            tracing::warn!("{}: step {} failed: {e}", cfg.node_id, r.step);
            session.send(failure(&e, act.generation)).await?;
        }
    }
    Ok(None)
}

/// A compute job of the stage's worker (a step, an update): the worker and its outcome.
type ComputeJob<B> = tokio::task::JoinHandle<(StageWorker<B>, Result<StepOutcome>)>;

/// How a compute job watched beside the session ended.
enum Watched<B: Backend> {
    Done(Box<StageWorker<B>>, Result<StepOutcome>),
    /// The broker superseded it (its message is queued for the session) or is gone.
    Left(Option<SessionEnd>),
}

/// Waits for `job` while reading the broker's messages (queued for later). A reset (or a new
/// assignment, or a stop) during the job makes its outcome moot: neither the result nor the
/// failure it causes is reported, so the broker never takes it for a new fault, and the compute
/// thread is left to notice the poisoned mailbox by itself (a wedged one must not hold the node).
async fn watch_compute<B: Backend>(
    session: &mut Session,
    act: &mut Active<B>,
    mut job: ComputeJob<B>,
) -> Result<Watched<B>> {
    loop {
        tokio::select! {
            done = &mut job => {
                let (worker, res) = done.map_err(|e| RuntimeError::Protocol(format!("compute thread: {e}")))?;
                return Ok(Watched::Done(Box::new(worker), res));
            }
            m = session.receive() => match m {
                Ok(m) => {
                    let supersedes = matches!(m.body, Some(broker_message::Body::Reset(_)) | Some(broker_message::Body::Stop(_)) | Some(broker_message::Body::Assignment(_)));
                    session.queued.push_back(m);
                    if supersedes {
                        act.mailbox.poison("the broker reset the job".into());
                        act.abandoned = Some(job);
                        return Ok(Watched::Left(None));
                    }
                }
                _ => {
                    act.mailbox.poison("the broker is gone".into());
                    let why = "the broker closed the control stream during a step".into();
                    return Ok(Watched::Left(Some(SessionEnd::BrokerLost(why))));
                }
            }
        }
    }
}

/// Applies (or skips) the step's update on the compute thread; replicas sharding their
/// optimizer state then all-gather the parameters, so the update waits on peers like a step
/// (and a failure is reported like a step's).
async fn apply_update<B: Backend>(
    cfg: &NodeConfig,
    session: &mut Session,
    act: &mut Active<B>,
    u: fusion_proto::ApplyUpdate,
) -> Result<Option<SessionEnd>> {
    let mut worker = act
        .worker
        .take()
        .ok_or_else(|| no_assignment("an update"))?;
    let (mailbox, outbox) = (act.mailbox.clone(), act.outbox.clone());
    let job = tokio::task::spawn_blocking(move || {
        match u.skip {
            true => worker.skip_update(u.step),
            false => worker.apply_update(u.step, u.lr, u.grad_scale),
        }
        let res = worker.gather_parameters(u.step, &mailbox, &outbox);
        (worker, res.map(|()| StepOutcome::default()))
    });
    match watch_compute(session, act, job).await? {
        Watched::Done(worker, res) => {
            act.worker = Some(*worker);
            if let Err(e) = res {
                tracing::warn!("{}: the update of step {} failed: {e}", cfg.node_id, u.step);
                session.send(failure(&e, act.generation)).await?;
            }
            Ok(None)
        }
        Watched::Left(None) => {
            // Superseded: the poisoned mailbox ends a gather at once and the update itself is
            // bounded work, so the worker comes back for the commands queued before the reset
            // (the broker sends a snapshot's `SaveState` right after the update).
            if let Some(job) = act.abandoned.take() {
                if let Ok(Ok((worker, _))) = tokio::time::timeout(KEEP_STATE_WAIT, job).await {
                    act.worker = Some(worker);
                }
            }
            Ok(None)
        }
        Watched::Left(end) => Ok(end),
    }
}

/// Sends the stage's parameters and optimizer moments to the broker, then `ParamsDone`; with
/// `lie` (a test hook) the first piece names a parameter the stage does not hold.
async fn send_state<B: Backend>(
    session: &Session,
    act: &Active<B>,
    s: &SaveState,
    lie: bool,
) -> Result<()> {
    let worker = act.worker.as_ref().ok_or_else(|| no_assignment("a save"))?;
    let outer = match s.outer {
        true => Some(worker.outer_momentum().ok_or_else(|| {
            RuntimeError::Protocol(
                "a save with the outer momentum of a stage that is not an island".into(),
            )
        })?),
        false => None,
    };
    if lie {
        let held = &worker.param_ids;
        let first = held.first().zip(worker.params.first());
        if let Some(p) = first.and_then(|(&g, v)| param_messages(g, ParamPart::Value, v).next()) {
            tracing::warn!("test hook: sending the state of a parameter this stage does not hold");
            let p = crate::hostile::foreign_piece(held, p);
            session.send(node_message::Body::Param(p)).await?;
        }
    }
    for (local, &gid) in worker.param_ids.iter().enumerate() {
        let value = (!s.moments_only).then_some((ParamPart::Value, &worker.params[local][..]));
        let moments = [
            (ParamPart::FirstMoment, &worker.opt.first[local][..]),
            (ParamPart::SecondMoment, &worker.opt.second[local][..]),
        ];
        if let Some((start, len)) = worker.saved_window(local) {
            // A sharded replica: its piece of the values and the moments it holds (of that piece).
            let total = worker.params[local].len();
            let value = value.map(|(part, v)| (part, &v[start..start + len]));
            let moments = moments
                .into_iter()
                .filter(|(_, m)| m.len() == len && len > 0);
            for (part, values) in value.into_iter().chain(moments) {
                for p in crate::wire::window_messages(gid, part, values, start, total) {
                    session.send(node_message::Body::Param(p)).await?;
                }
            }
            continue;
        }
        let outer = outer.map(|o| (ParamPart::OuterMomentum, &o[local][..]));
        for (part, values) in value.into_iter().chain(moments).chain(outer) {
            for p in param_messages(gid, part, values) {
                session.send(node_message::Body::Param(p)).await?;
            }
        }
    }
    session
        .send(node_message::Body::ParamsDone(ParamsDone { step: s.step }))
        .await
}

/// What the node tells the broker of a shard it holds now, or why it holds none.
fn shard_saved(step: u64, shard: String, r: Result<ShardFile>) -> node_message::Body {
    node_message::Body::ShardSaved(match r {
        Ok(f) => ShardSaved {
            step,
            shard,
            bytes: f.bytes,
            sha256: f.sha256,
            path: f.path.display().to_string(),
            error: String::new(),
        },
        Err(e) => ShardSaved {
            step,
            shard,
            error: e.to_string(),
            ..Default::default()
        },
    })
}

/// Copies the stage's state in memory (on a blocking thread) for a shard written later.
async fn capture_shard<B: Backend>(act: &mut Active<B>) -> Result<StageCopy> {
    let worker = act
        .worker
        .take()
        .ok_or_else(|| no_assignment("a shard save"))?;
    let (worker, copy) = tokio::task::spawn_blocking(move || {
        let copy = StageCopy::capture(&worker);
        (worker, copy)
    })
    .await
    .map_err(|e| RuntimeError::Protocol(format!("shard copy thread: {e}")))?;
    act.worker = Some(worker);
    Ok(copy)
}

/// Test hook ([`TestHooks::shard_write_after_steps`]): waits until the stage has begun the
/// training step `after` steps after `step`, for at most two minutes.
async fn hold_write(progress: Arc<Tracker>, step: u64, after: Option<u64>) {
    let Some(after) = after else { return };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while tokio::time::Instant::now() < deadline {
        if progress.report().is_some_and(|p| p.step >= step + after) {
            tracing::warn!("test hook: writing the shard of step {step} after {after} steps");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tracing::warn!("test hook: training did not go on beside the shard of step {step}");
}

/// Answers `SaveShard`: copies the stage's state in memory, says so, and writes the shard beside
/// the commands that follow. A node still writing an earlier shard refuses: one copy of the
/// state at a time.
async fn save_shard_beside<B: Backend>(
    cfg: &NodeConfig,
    data: &DataPlane,
    session: &mut Session,
    act: &mut Active<B>,
    s: SaveShard,
) -> Result<()> {
    let (step, shard) = (s.step, s.shard.clone());
    let copy = if session.writing.load(Ordering::SeqCst) > 0 {
        Err(RuntimeError::Shard {
            shard: shard.clone(),
            reason: "the shard of an earlier snapshot is still being written".into(),
        })
    } else {
        data.progress.enter(Phase::Saving, step);
        let copy = capture_shard(act).await;
        data.progress.idle();
        copy
    };
    let error = copy
        .as_ref()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    let captured = ShardCaptured { step, shard, error };
    session
        .send(node_message::Body::ShardCaptured(captured))
        .await?;
    if let Ok(copy) = copy {
        let hold = hold_write(
            data.progress.clone(),
            step,
            cfg.test_hooks.shard_write_after_steps,
        );
        let job = ShardJob {
            store: data.store_handle(),
            cancel: session.cancel.clone(),
            _writing: WriteGuard::new(&session.writing),
        };
        session.spawn_beside(async move {
            hold.await;
            write_shard(job, copy, s).await
        });
    }
    Ok(())
}

/// Counts a shard write under way until dropped (with its job, on the thread that writes).
struct WriteGuard(Arc<AtomicUsize>);

impl WriteGuard {
    fn new(count: &Arc<AtomicUsize>) -> WriteGuard {
        count.fetch_add(1, Ordering::SeqCst);
        WriteGuard(count.clone())
    }
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a shard write beside the commands needs.
struct ShardJob {
    store: Arc<ShardStore>,
    cancel: Arc<AtomicBool>,
    _writing: WriteGuard,
}

/// Writes a captured stage as a shard on this node's disk, on a blocking thread, then keeps
/// only the steps the broker still needs; a reset meanwhile stops it before each.
async fn write_shard(job: ShardJob, copy: StageCopy, s: SaveShard) -> node_message::Body {
    let (run, step, shard) = (s.run_id.clone(), s.step, s.shard.clone());
    let result = tokio::task::spawn_blocking(move || {
        let given_up = || RuntimeError::Shard {
            shard: shard.clone(),
            reason: "given up by a reset".into(),
        };
        if job.cancel.load(Ordering::SeqCst) {
            return Err(given_up());
        }
        let r = copy.save(&job.store, &run, step, &shard);
        drop(copy);
        if r.is_ok() && !job.cancel.load(Ordering::SeqCst) {
            job.store.retain(&run, &s.keep_steps);
        }
        r
    })
    .await
    .unwrap_or_else(|e| Err(RuntimeError::Protocol(format!("shard writer thread: {e}"))));
    shard_saved(step, s.shard, result)
}

/// Fills `worker`'s parameters and moments from shards on this node's disk, on a blocking
/// thread; returns the worker, and which parts of which parameters were filled.
async fn load_shards<B: Backend>(
    data: &DataPlane,
    mut worker: StageWorker<B>,
    l: LoadShards,
) -> Result<(StageWorker<B>, Result<Vec<[bool; 3]>>)> {
    if l.shards.len() != l.sha256.len() {
        return Err(RuntimeError::Protocol(format!(
            "{} shards to load with {} checksums",
            l.shards.len(),
            l.sha256.len()
        )));
    }
    let store = data.store_handle();
    let shards: Vec<(String, String)> = l.shards.into_iter().zip(l.sha256).collect();
    tokio::task::spawn_blocking(move || {
        let r = crate::shards::load_stage(&store, &mut worker, &l.run_id, l.step, &shards);
        (worker, r)
    })
    .await
    .map_err(|e| RuntimeError::Protocol(format!("shard reader thread: {e}")))
}

/// Copies a shard from the peer the broker named, then keeps only the steps the broker still
/// needs (on a blocking thread).
async fn fetch_shard(
    fetcher: Fetcher,
    f: FetchShard,
    cancel: Arc<AtomicBool>,
) -> node_message::Body {
    let Some(from) = f.from.as_ref() else {
        let e = RuntimeError::Protocol("a shard to fetch from nobody".into());
        return shard_saved(f.step, f.shard, Err(e));
    };
    let want = Wanted {
        run_id: &f.run_id,
        step: f.step,
        shard: &f.shard,
        bytes: f.bytes,
        sha256: &f.sha256,
    };
    let result = fetcher.fetch(&peer_addr(from), &want).await;
    if result.is_ok() {
        let (run, keep) = (f.run_id.clone(), f.keep_steps.clone());
        let _ = tokio::task::spawn_blocking(move || {
            if !cancel.load(Ordering::SeqCst) {
                fetcher.store().retain(&run, &keep)
            }
        })
        .await;
    }
    shard_saved(f.step, f.shard.clone(), result)
}

fn no_assignment(what: &str) -> RuntimeError {
    RuntimeError::Protocol(format!("{what} before any assignment"))
}

/// Builds the stage from an assignment, reads its parameters and connects to its peers.
async fn setup<B: Backend>(
    backend: &B,
    cfg: &NodeConfig,
    data: &DataPlane,
    a: Assignment,
    session: &mut Session,
    kept: Option<Result<StageWorker<B>>>,
) -> Result<Active<B>> {
    let CheckedAssignment {
        stage,
        graph,
        plan,
        train,
        param_ids,
        schedule,
        replica,
        replicas,
        fragments,
    } = check_assignment(&a, cfg.memory_limit)?;
    let plan = Arc::new(plan);
    let mut worker = StageWorker::new(
        backend.clone(),
        stage,
        plan.clone(),
        graph,
        param_ids,
        train,
        cfg.peer_timeout,
    )?;
    worker.opt.step = a.optimizer_step;
    let ring_from = if replicas > 1 {
        a.ring[(replica + replicas - 1) % replicas].clone()
    } else {
        String::new()
    };
    worker.set_replica(replica, replicas, a.islands, &ring_from);
    worker.fragments = fragments;
    worker.shard_optimizer();
    let progress = data.progress.start_generation(a.generation);
    worker.set_progress(progress.clone());
    if let Some(step) = cfg.test_hooks.wedge_at_step {
        worker.set_wedge(step, cfg.test_hooks.fired.clone());
    }
    if let Some((step, factor)) = cfg.test_hooks.slowdown_from_step {
        worker.set_slowdown(step, factor);
    } else if cfg.emulated_slowdown.is_finite() && cfg.emulated_slowdown > 1.0 {
        worker.set_slowdown(0, cfg.emulated_slowdown);
    }
    // Parameters and optimizer moments follow the assignment.
    let mut filled = vec![[false; 4]; worker.params.len()];
    // Islands restarting from a snapshot: the outer optimizer's momentum, when it was kept
    // (allocated with its first piece).
    let mut outer_momentum: Option<Vec<Vec<f32>>> = None;
    let fresh_island = worker.islands() && kept.is_none();
    let mut load_failed: Option<RuntimeError> = None;
    loop {
        let m = session.next().await.map_err(|end| match end {
            SessionEnd::BrokerLost(why) => RuntimeError::BrokerGone(why),
            SessionEnd::Stopped => RuntimeError::Protocol("stopped during an assignment".into()),
        })?;
        match m.body {
            Some(broker_message::Body::Param(p)) => {
                let local = worker
                    .param_ids
                    .iter()
                    .position(|&g| g as u64 == p.param)
                    .ok_or_else(|| {
                        RuntimeError::Protocol(format!(
                            "parameter #{} is not part of stage {stage}",
                            p.param
                        ))
                    })?;
                let (target, idx) = match p.part() {
                    ParamPart::Value => (&mut worker.params[local], 0),
                    part @ (ParamPart::FirstMoment | ParamPart::SecondMoment) => {
                        // A sharded replica keeps only its piece of the moments.
                        let first = part == ParamPart::FirstMoment;
                        if worker.write_moment_piece(local, first, &p)? {
                            filled[local][if first { 1 } else { 2 }] = true;
                        }
                        continue;
                    }
                    ParamPart::OuterMomentum if fresh_island => {
                        let momentum =
                            outer_momentum.get_or_insert_with(|| worker.outer_momentum_buffers());
                        (&mut momentum[local], 3)
                    }
                    ParamPart::OuterMomentum => {
                        return Err(RuntimeError::Protocol(
                            "outer momentum for a stage that is not an island starting from a \
                             snapshot"
                                .into(),
                        ))
                    }
                    ParamPart::Unspecified => {
                        return Err(RuntimeError::Protocol("parameter part unspecified".into()))
                    }
                };
                crate::wire::write_piece(target, &p)?;
                if p.offset as usize * 4 + p.data.len() == target.len() * 4 {
                    filled[local][idx] = true;
                }
            }
            Some(broker_message::Body::LoadShards(l)) => {
                let (w, loaded) = load_shards(data, worker, l).await?;
                worker = w;
                match loaded {
                    Ok(loaded) => {
                        for (f, g) in filled.iter_mut().zip(loaded) {
                            for k in 0..3 {
                                f[k] |= g[k];
                            }
                        }
                    }
                    // Reported once the assignment's messages are read, so that the node stays
                    // in step with the broker (and keeps its disk) instead of exiting.
                    Err(e) => load_failed = load_failed.or(Some(e)),
                }
            }
            Some(broker_message::Body::ParamsDone(_)) => break,
            Some(
                body @ (broker_message::Body::Stop(_)
                | broker_message::Body::Reset(_)
                | broker_message::Body::Assignment(_)),
            ) => {
                // The broker moved on (an eviction, a reset): the session handles it next.
                session.queued.push_back(BrokerMessage { body: Some(body) });
                return Err(RuntimeError::Reset("the assignment was superseded".into()));
            }
            _ => {
                return Err(RuntimeError::Protocol(
                    "expected parameters after the assignment".into(),
                ))
            }
        }
    }
    if let Some(e) = load_failed {
        return Err(e);
    }
    match kept {
        // Island-local recovery: the stage goes on with what it holds, anchor included.
        Some(old) => worker.adopt_state(old?)?,
        None => {
            if let Some(i) = filled.iter().position(|f| !f[0]) {
                return Err(RuntimeError::Protocol(format!(
                    "the broker sent no values for parameter '{}'",
                    worker.graph().params[i].name
                )));
            }
            // Islands: the parameters just received are the last synchronisation's.
            worker.start_outer();
            if let Some(momentum) = outer_momentum {
                let complete: Vec<bool> = filled.iter().map(|f| f[3]).collect();
                worker.restore_outer_momentum(momentum, &complete)?;
            }
        }
    }
    let mailbox = Arc::new(Mailbox::new());
    let mut senders: HashMap<String, usize> = plan
        .senders_to(stage)
        .into_iter()
        .map(|s| (plan.stage_nodes[s].clone(), s))
        .collect();
    if replicas > 1 {
        // The previous replica in the ring passes all-reduce chunks on.
        senders.insert(ring_from, stage);
    }
    let inbound = Inbound::new(
        a.generation,
        mailbox.clone(),
        senders,
        worker.expected_inbound(),
    )
    .with_pins(
        a.sender_certificates
            .iter()
            .map(|(k, v)| (k.clone(), v.to_vec()))
            .collect(),
    )
    .with_progress(progress.clone())
    .with_stop_reading_at(cfg.test_hooks.stop_reading_at_step)
    .with_relays(a.relay_pairs.iter().filter_map(|p| {
        p.split_once('/')
            .map(|(s, r)| (s.to_string(), r.to_string()))
    }));
    data.set_inbound(Some(Arc::new(inbound)));
    data.dial_senders(a.generation, a.dial_senders.iter().map(peer_addr).collect());
    let peers = a.peers.iter().map(peer_addr).collect();
    let outbox = data
        .connect(
            a.generation,
            peers,
            mailbox.clone(),
            progress,
            cfg.peer_timeout,
        )
        .await?
        .with_lie(cfg.test_hooks.bad_result_at_step);
    tracing::info!(
        "{}: stage {stage} of generation {} ready",
        cfg.node_id,
        a.generation
    );
    Ok(Active {
        generation: a.generation,
        worker: Some(worker),
        schedule,
        mailbox,
        outbox: Arc::new(outbox),
        feeds: HashMap::new(),
        abandoned: None,
    })
}

/// Where a peer entry says the peer listens, with its link and certificate.
fn peer_addr(p: &PeerLink) -> PeerAddr {
    let (punch, relay) = (
        Some(p.punch_peer_ip.as_str()),
        Some(p.relay_address.as_str()),
    );
    let (send, receive) = routes(!p.self_unreachable, !p.peer_unreachable, punch, relay);
    PeerAddr {
        id: p.node_id.clone(),
        address: p.address.clone(),
        stage: p.stage as usize,
        link: paced_link(p),
        pin: p.certificate_sha256.to_vec(),
        send,
        receive,
        relay_node: p.relay_node.clone(),
    }
}

/// The emulated link a peer entry asks for (none when its bandwidth is 0 or not a number; a
/// latency that is not a number counts as none).
fn paced_link(p: &PeerLink) -> Option<PacedLink> {
    let ok = p.bandwidth_mbps.is_finite() && p.bandwidth_mbps > 0.0;
    let latency_ms = if p.latency_ms.is_finite() {
        p.latency_ms.clamp(0.0, 60_000.0)
    } else {
        0.0
    };
    ok.then(|| PacedLink {
        bytes_per_sec: p.bandwidth_mbps * 1e6 / 8.0,
        latency: Duration::from_secs_f64(latency_ms / 1e3),
    })
}

/// Most micro-batches a step may ask for (an evaluation may cover many batches).
const MAX_MICRO_BATCHES: u32 = 1 << 20;

/// How long a probe over a path (reversed, punched, relayed) may take to open.
const PROBE_OPEN_WAIT: Duration = Duration::from_secs(30);

/// How long this node keeps opening its side of the probes to it that it must open itself,
/// per peer of the round (the peers probe one after another: each probe may take this long to
/// open and then to run).
const PROBE_HALF_WAIT: Duration = Duration::from_secs(90);

/// Lets the round's peers probe this node, then probes each of them in turn (one at a time, so
/// the probes do not share this node's uplink). A failed probe is reported with its reason.
/// In a round over the links' paths, this node also opens its side of the probes to it that
/// it must open itself, and relays the probes the broker names.
async fn probe_round(data: &DataPlane, me: &str, round: ProbeLinks) -> LinkReport {
    let peers: Vec<PeerAddr> = round.peers.iter().map(peer_addr).collect();
    data.allow_probers(peers.iter().map(|p| (p.id.clone(), p.clone())).collect());
    let relays = round.relay_pairs.iter().filter_map(|k| {
        let (a, b) = k.split_once('/')?;
        Some((a.to_string(), b.to_string()))
    });
    data.start_probe_round(round.round, relays);
    let window = PROBE_HALF_WAIT * (peers.len() as u32 + 1);
    for p in peers.iter().filter(|p| p.receive != ReceiveRoute::Accept) {
        let key = crate::rendezvous::probe_key(round.round, &p.id, me);
        data.open_probe_half(round.round, key, p.clone(), window);
    }
    let max_bytes = match round.max_bytes {
        0 => DEFAULT_PROBE_BYTES,
        n => n.min(64 << 20),
    };
    let mut links = Vec::with_capacity(peers.len());
    for p in &peers {
        let measured = if p.send == SendRoute::Dial {
            data.probe(p, max_bytes).await
        } else {
            let key = crate::rendezvous::probe_key(round.round, me, &p.id);
            data.probe_over(p, key, max_bytes, PROBE_OPEN_WAIT)
                .await
                .map(|e| (e, String::new()))
        };
        links.push(measurement(me, &p.id, measured));
    }
    LinkReport {
        round: round.round,
        links,
    }
}

/// What a probe of `peer` reports.
fn measurement(me: &str, peer: &str, measured: Result<(LinkEstimate, String)>) -> LinkMeasurement {
    match measured {
        Ok((e, local)) => LinkMeasurement {
            peer: peer.to_string(),
            bandwidth_mbps: e.bytes_per_s * 8.0 / 1e6,
            latency_ms: e.latency_s * 1e3,
            probe_bytes: e.probe_bytes,
            error: String::new(),
            unreachable: false,
            observed_address: e.observed,
            local_address: local,
        },
        Err(e) => {
            tracing::warn!("{me}: probing {peer} failed: {e}");
            LinkMeasurement {
                peer: peer.to_string(),
                unreachable: matches!(e, RuntimeError::Unreachable { .. }),
                error: e.to_string(),
                ..Default::default()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ProfileTurn;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};

    #[test]
    fn nodes_on_one_machine_profile_one_after_another() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("profile.lock");
        let released = Arc::new(AtomicBool::new(false));
        let (held, is_held) = mpsc::channel();
        let first = {
            let released = released.clone();
            let path = path.clone();
            std::thread::spawn(move || {
                let turn = ProfileTurn::wait(&path);
                assert!(turn.0.is_some(), "the first node got no turn");
                held.send(()).expect("signal");
                std::thread::sleep(std::time::Duration::from_millis(300));
                released.store(true, Ordering::SeqCst);
                drop(turn);
            })
        };
        is_held.recv().expect("the first node holds its turn");
        let second = ProfileTurn::wait(&path);
        assert!(second.0.is_some(), "the second node got no turn");
        assert!(
            released.load(Ordering::SeqCst),
            "the second node profiled while the first one held its turn"
        );
        first.join().expect("first node");
    }
}
