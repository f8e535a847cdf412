//! A compute node: joins the broker over the control plane, receives its stage and parameters,
//! connects to its peers over the data plane, and runs the broker's commands until told to stop.
//! Heartbeats flow from a separate task, so a node busy computing is still seen alive; a node
//! that dies or freezes stops them.

use crate::dataplane::{DataPlane, Inbound, Outbox};
use crate::error::{Result, RuntimeError};
use crate::identity::client_tls;
use crate::mailbox::Mailbox;
use crate::plan::Plan;
use crate::probe::DEFAULT_PROBE_BYTES;
use crate::wire::{bytes_to_f32, param_messages, schedule_from_wire};
use crate::worker::StageWorker;
use fusion_backend::Backend;
use fusion_data::HostTensor;
use fusion_exec::Mode;
use fusion_exec::Schedule;
use fusion_graph::Graph;
use fusion_proto::{
    broker_client::BrokerClient, broker_message, node_message, Assignment, BrokerMessage,
    Capabilities, DType, Failure, Heartbeat, Join, LinkBytes, LinkMeasurement, LinkReport,
    NodeMessage, ParamPart, ParamsDone, PeerLink, ProbeLinks, Ready, RunMode, StepResult,
    PROTOCOL_VERSION,
};
use fusion_train::TrainConfig;
use fusion_transport::{NodeIdentity, PacedLink};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

/// Connection attempts to the broker before a node gives up (about 30 s in all).
const CONNECT_ATTEMPTS: u32 = 4;

/// Largest control-plane message either side accepts: a micro-batch's input tensor must fit
/// (parameters travel in 1 MiB pieces).
pub const MAX_CONTROL_MESSAGE: usize = 256 << 20;

#[derive(Clone)]
pub struct NodeConfig {
    pub node_id: String,
    /// `https://host:port` of the broker.
    pub broker_url: String,
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
}

impl NodeConfig {
    pub fn local(node_id: &str, broker_url: &str, token: &str, identity: NodeIdentity) -> Self {
        NodeConfig {
            node_id: node_id.into(),
            broker_url: broker_url.into(),
            broker_name: "broker".into(),
            token: token.into(),
            identity,
            data_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise_host: None,
            heartbeat: Duration::from_millis(500),
            peer_timeout: Duration::from_secs(120),
        }
    }
}

/// What the node knows of its device, announced when joining.
pub fn capabilities<B: Backend>(backend: &B) -> Capabilities {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let memory = std::fs::read_to_string("/proc/meminfo")
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
        .map_or(0, |kb| kb * 1024);
    let (measured_gflops, measured_memory_gbs, calibration) = profile(backend, memory);
    Capabilities {
        backend: backend.name(),
        software_version: env!("CARGO_PKG_VERSION").into(),
        device: format!("{} {} threads", std::env::consts::ARCH, threads),
        memory_bytes: memory,
        measured_gflops,
        measured_memory_gbs,
        calibration,
    }
}

/// Profiles the backend on a small GPT-2 graph (a few hundred milliseconds on a CPU): dense and
/// element-wise speed and the calibration of the planner's roofline. Zeros if profiling fails;
/// the broker then plans with conservative defaults.
fn profile<B: Backend>(b: &B, memory: u64) -> (f64, f64, f64) {
    let graph = fusion_models::ModelSpec::preset("gpt2-tiny").and_then(|m| m.graph(2, 32));
    let run = graph.map_err(|e| e.to_string()).and_then(|g| {
        fusion_estimate::profile_backend(b, "node", &g, memory.max(1) as f64, 2)
            .map_err(|e| e.to_string())
    });
    match run {
        Ok(r) => (
            r.profile.dense_flops_per_s / 1e9,
            r.profile.memory_bytes_per_s / 1e9,
            r.profile.calibration,
        ),
        Err(e) => {
            tracing::warn!("profiling the backend failed: {e}");
            (0.0, 0.0, 0.0)
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
}

/// Runs a node until the broker stops the job (Ok) or something fails (Err with the reason).
pub async fn run_node<B: Backend>(backend: B, cfg: NodeConfig) -> Result<()> {
    let data = DataPlane::start(
        cfg.data_listen,
        cfg.identity.clone(),
        cfg.node_id.clone(),
        cfg.token.clone(),
    )
    .await?;
    let host = cfg
        .advertise_host
        .clone()
        .unwrap_or_else(|| data.address.ip().to_string());
    let data_address = format!("{host}:{}", data.address.port());
    let endpoint = Channel::from_shared(cfg.broker_url.clone())
        .map_err(|e| RuntimeError::Config(format!("broker URL '{}': {e}", cfg.broker_url)))?
        .tls_config(client_tls(&cfg.identity, &cfg.broker_name))?
        .connect_timeout(Duration::from_secs(5));
    // A broker that is starting, or a first packet lost, is worth a few more tries; a refused
    // certificate is not.
    let mut attempt = 0;
    let channel = loop {
        attempt += 1;
        match endpoint.connect().await {
            Ok(c) => break c,
            Err(e) => {
                let msg = crate::error::error_chain(&e);
                if attempt >= CONNECT_ATTEMPTS || msg.contains("certificate") {
                    return Err(RuntimeError::GrpcTransport(format!(
                        "connecting to the broker at {} ({attempt} attempts): {msg}",
                        cfg.broker_url
                    )));
                }
                tracing::warn!("{}: connecting to the broker: {msg}; retrying", cfg.node_id);
                tokio::time::sleep(Duration::from_secs(1 << attempt.min(3))).await;
            }
        }
    };
    let mut client = BrokerClient::new(channel)
        .max_decoding_message_size(MAX_CONTROL_MESSAGE)
        .max_encoding_message_size(MAX_CONTROL_MESSAGE);
    let (tx, rx) = mpsc::channel::<NodeMessage>(64);
    let send = |tx: &mpsc::Sender<NodeMessage>, body: node_message::Body| {
        let tx = tx.clone();
        async move {
            tx.send(NodeMessage { body: Some(body) })
                .await
                .map_err(|_| {
                    RuntimeError::Protocol("the control stream to the broker is closed".into())
                })
        }
    };
    send(
        &tx,
        node_message::Body::Join(Join {
            protocol_version: PROTOCOL_VERSION,
            node_id: cfg.node_id.clone(),
            token: cfg.token.clone(),
            capabilities: Some(capabilities(&backend)),
            data_address,
        }),
    )
    .await?;
    let mut inbound = client.attach(ReceiverStream::new(rx)).await?.into_inner();
    let hb_tx = tx.clone();
    let interval = cfg.heartbeat;
    let heartbeat = tokio::spawn(async move {
        loop {
            tokio::time::sleep(interval).await;
            let ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let msg = NodeMessage {
                body: Some(node_message::Body::Heartbeat(Heartbeat {
                    sent_unix_ms: ms,
                })),
            };
            if hb_tx.send(msg).await.is_err() {
                return;
            }
        }
    });
    let _stop_heartbeat = AbortOnDrop(heartbeat);
    tracing::info!("{} joined {}", cfg.node_id, cfg.broker_url);

    let mut active: Option<Active<B>> = None;
    let mut queued: VecDeque<BrokerMessage> = VecDeque::new();
    loop {
        let msg = match queued.pop_front() {
            Some(m) => m,
            None => match inbound.message().await {
                Ok(Some(m)) => m,
                Ok(None) => {
                    return Err(RuntimeError::Protocol(
                        "the broker closed the control stream".into(),
                    ))
                }
                Err(status) => return Err(RuntimeError::Rejected(status.message().to_string())),
            },
        };
        let Some(body) = msg.body else {
            return Err(RuntimeError::Protocol(
                "empty message from the broker".into(),
            ));
        };
        match body {
            broker_message::Body::Assignment(a) => {
                if let Some(old) = active.take() {
                    old.mailbox.poison("reassigned".into());
                }
                data.set_inbound(None);
                match setup(&backend, &cfg, &data, a, &mut inbound).await {
                    Ok(act) => {
                        let generation = act.generation;
                        active = Some(act);
                        send(&tx, node_message::Body::Ready(Ready { generation })).await?;
                    }
                    Err(e) => {
                        send(
                            &tx,
                            node_message::Body::Failure(Failure {
                                message: e.to_string(),
                            }),
                        )
                        .await?;
                    }
                }
            }
            broker_message::Body::Feed(f) => {
                let act = active.as_mut().ok_or_else(|| no_assignment("a feed"))?;
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
                    other => {
                        return Err(RuntimeError::Protocol(format!("feed of dtype {other:?}")))
                    }
                };
                act.feeds
                    .insert((f.micro_batch as usize, f.tensor as usize), t);
            }
            broker_message::Body::Run(r) => {
                let act = active.as_mut().ok_or_else(|| no_assignment("a step"))?;
                let mut worker = act.worker.take().ok_or_else(|| no_assignment("a step"))?;
                let mode = if r.mode() == RunMode::Eval {
                    Mode::Eval
                } else {
                    Mode::Train
                };
                let (schedule, mailbox, outbox) =
                    (act.schedule, act.mailbox.clone(), act.outbox.clone());
                let mut feeds = std::mem::take(&mut act.feeds);
                let m = r.micro_batches as usize;
                let total = (r.total_micro_batches as usize).max(m);
                let mut job = tokio::task::spawn_blocking(move || {
                    let res = worker.run_step(
                        r.step, mode, m, total, schedule, &mut feeds, &mailbox, &outbox,
                    );
                    (worker, res)
                });
                // Keep listening while computing: a reset must interrupt a step that waits for a
                // peer that is gone.
                let (worker, res) = loop {
                    tokio::select! {
                        done = &mut job => break done.map_err(|e| RuntimeError::Protocol(format!("compute thread: {e}")))?,
                        m = inbound.message() => match m {
                            Ok(Some(m)) => {
                                if matches!(m.body, Some(broker_message::Body::Reset(_)) | Some(broker_message::Body::Stop(_))) {
                                    act.mailbox.poison("the broker reset the job".into());
                                }
                                queued.push_back(m);
                            }
                            _ => {
                                act.mailbox.poison("the broker is gone".into());
                                return Err(RuntimeError::Protocol("the broker closed the control stream".into()));
                            }
                        }
                    }
                };
                act.worker = Some(worker);
                match res {
                    Ok(o) => {
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
                        send(
                            &tx,
                            node_message::Body::Result(StepResult {
                                step: r.step,
                                losses: o.losses,
                                predictions: o.predictions,
                                grad_square_sum: o.grad_square_sum,
                                sent,
                                compute_seconds: o.compute_seconds,
                                wait_seconds: o.wait_seconds,
                            }),
                        )
                        .await?;
                    }
                    Err(e) => {
                        tracing::warn!("{}: step {} failed: {e}", cfg.node_id, r.step);
                        send(
                            &tx,
                            node_message::Body::Failure(Failure {
                                message: e.to_string(),
                            }),
                        )
                        .await?;
                    }
                }
            }
            broker_message::Body::Update(u) => {
                let act = active.as_mut().ok_or_else(|| no_assignment("an update"))?;
                let mut worker = act
                    .worker
                    .take()
                    .ok_or_else(|| no_assignment("an update"))?;
                let worker = tokio::task::spawn_blocking(move || {
                    worker.apply_update(u.lr, u.grad_scale);
                    worker
                })
                .await
                .map_err(|e| RuntimeError::Protocol(format!("optimizer thread: {e}")))?;
                act.worker = Some(worker);
            }
            broker_message::Body::Compression(c) => {
                let act = active
                    .as_ref()
                    .ok_or_else(|| no_assignment("compression settings"))?;
                let settings: fusion_compress::NodeCompression =
                    serde_json::from_str(&c.settings_json).map_err(|e| {
                        RuntimeError::Protocol(format!("bad compression settings: {e}"))
                    })?;
                act.outbox.set_compression(settings);
            }
            broker_message::Body::Probe(round) => {
                let report = probe_round(&data, &cfg.node_id, round).await;
                send(&tx, node_message::Body::Links(report)).await?;
            }
            broker_message::Body::Save(s) => {
                let act = active.as_ref().ok_or_else(|| no_assignment("a save"))?;
                let worker = act.worker.as_ref().ok_or_else(|| no_assignment("a save"))?;
                for (local, &gid) in worker.param_ids.iter().enumerate() {
                    let parts = [
                        (ParamPart::Value, &worker.params[local]),
                        (ParamPart::FirstMoment, &worker.opt.first[local]),
                        (ParamPart::SecondMoment, &worker.opt.second[local]),
                    ];
                    for (part, values) in parts {
                        for p in param_messages(gid, part, values) {
                            send(&tx, node_message::Body::Param(p)).await?;
                        }
                    }
                }
                send(
                    &tx,
                    node_message::Body::ParamsDone(ParamsDone { step: s.step }),
                )
                .await?;
            }
            broker_message::Body::Reset(r) => {
                tracing::warn!("{}: reset by the broker: {}", cfg.node_id, r.reason);
                if let Some(old) = active.take() {
                    old.mailbox.poison(r.reason);
                }
                data.set_inbound(None);
            }
            broker_message::Body::Stop(s) => {
                tracing::info!("{}: stopped: {}", cfg.node_id, s.reason);
                data.set_inbound(None);
                return Ok(());
            }
            broker_message::Body::Param(_) | broker_message::Body::ParamsDone(_) => {
                return Err(RuntimeError::Protocol(
                    "parameters outside an assignment".into(),
                ));
            }
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
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
    inbound: &mut tonic::Streaming<BrokerMessage>,
) -> Result<Active<B>> {
    let graph: Graph = serde_json::from_str(&a.stage_graph_json)
        .map_err(|e| RuntimeError::Protocol(format!("stage graph: {e}")))?;
    let plan: Plan = serde_json::from_str(&a.plan_json)
        .map_err(|e| RuntimeError::Protocol(format!("plan: {e}")))?;
    let train: TrainConfig = serde_json::from_str(&a.config_json)
        .map_err(|e| RuntimeError::Protocol(format!("training configuration: {e}")))?;
    let stage = a.stage as usize;
    let param_ids = fusion_params_of(&plan, stage, &graph)?;
    let plan = Arc::new(plan);
    let schedule = schedule_from_wire(a.schedule())?;
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
    let replicas = (a.replicas as usize).max(1);
    let replica = a.replica as usize;
    if replica >= replicas || (replicas > 1 && a.ring.len() != replicas) {
        return Err(RuntimeError::Protocol(format!(
            "replica {replica} of {replicas} with a ring of {} nodes",
            a.ring.len()
        )));
    }
    worker.set_replica(replica, replicas);
    // Parameters and optimizer moments follow the assignment.
    let mut filled = vec![[false; 3]; worker.params.len()];
    loop {
        let m = inbound
            .message()
            .await
            .map_err(|s| RuntimeError::Protocol(s.message().to_string()))?
            .ok_or_else(|| {
                RuntimeError::Protocol("the broker closed the stream during an assignment".into())
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
                    ParamPart::FirstMoment => (&mut worker.opt.first[local], 1),
                    ParamPart::SecondMoment => (&mut worker.opt.second[local], 2),
                    ParamPart::Unspecified => {
                        return Err(RuntimeError::Protocol("parameter part unspecified".into()))
                    }
                };
                crate::wire::write_piece(target, &p)?;
                if p.offset as usize * 4 + p.data.len() == target.len() * 4 {
                    filled[local][idx] = true;
                }
            }
            Some(broker_message::Body::ParamsDone(_)) => break,
            _ => {
                return Err(RuntimeError::Protocol(
                    "expected parameters after the assignment".into(),
                ))
            }
        }
    }
    if let Some(i) = filled.iter().position(|f| !f[0]) {
        return Err(RuntimeError::Protocol(format!(
            "the broker sent no values for parameter '{}'",
            worker.graph().params[i].name
        )));
    }
    let mailbox = Arc::new(Mailbox::new());
    let mut senders: HashMap<String, usize> = plan
        .senders_to(stage)
        .into_iter()
        .map(|s| (plan.stage_nodes[s].clone(), s))
        .collect();
    if replicas > 1 {
        // The previous replica in the ring passes all-reduce chunks on.
        senders.insert(a.ring[(replica + replicas - 1) % replicas].clone(), stage);
    }
    data.set_inbound(Some(Arc::new(Inbound::new(
        a.generation,
        mailbox.clone(),
        senders,
        worker.expected_inbound(),
    ))));
    let peers = a
        .peers
        .iter()
        .map(|p| {
            (
                p.node_id.clone(),
                p.address.clone(),
                p.stage as usize,
                paced_link(p),
            )
        })
        .collect();
    let outbox = data.connect(a.generation, peers, mailbox.clone()).await?;
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
    })
}

/// Global parameter ids of the stage's parameters, checked against its graph.
fn fusion_params_of(plan: &Plan, stage: usize, graph: &Graph) -> Result<Vec<usize>> {
    let ids = plan.stage_params.get(stage).cloned().ok_or_else(|| {
        RuntimeError::Protocol(format!("the plan has no parameters for stage {stage}"))
    })?;
    if ids.len() != graph.params.len() {
        return Err(RuntimeError::Protocol(format!(
            "stage {stage}: {} parameter ids for {} parameters",
            ids.len(),
            graph.params.len()
        )));
    }
    Ok(ids)
}

/// The emulated link a peer entry asks for (none when its bandwidth is 0 or not a number).
fn paced_link(p: &PeerLink) -> Option<PacedLink> {
    let ok = p.bandwidth_mbps.is_finite() && p.bandwidth_mbps > 0.0;
    ok.then(|| PacedLink {
        bytes_per_sec: p.bandwidth_mbps * 1e6 / 8.0,
        latency: Duration::from_secs_f64(p.latency_ms.clamp(0.0, 60_000.0) / 1e3),
    })
}

/// Lets the round's peers probe this node, then probes each of them in turn (one at a time, so
/// the probes do not share this node's uplink). A failed probe is reported with its reason.
async fn probe_round(data: &DataPlane, me: &str, round: ProbeLinks) -> LinkReport {
    data.allow_probers(
        round
            .peers
            .iter()
            .map(|p| (p.node_id.clone(), paced_link(p)))
            .collect(),
    );
    let max_bytes = match round.max_bytes {
        0 => DEFAULT_PROBE_BYTES,
        n => n.min(64 << 20),
    };
    let mut links = Vec::with_capacity(round.peers.len());
    for p in &round.peers {
        let m = match data
            .probe(&p.node_id, &p.address, paced_link(p), max_bytes)
            .await
        {
            Ok(e) => LinkMeasurement {
                peer: p.node_id.clone(),
                bandwidth_mbps: e.bytes_per_s * 8.0 / 1e6,
                latency_ms: e.latency_s * 1e3,
                probe_bytes: e.probe_bytes,
                error: String::new(),
            },
            Err(e) => {
                tracing::warn!("{me}: probing {} failed: {e}", p.node_id);
                LinkMeasurement {
                    peer: p.node_id.clone(),
                    error: e.to_string(),
                    ..Default::default()
                }
            }
        };
        links.push(m);
    }
    LinkReport {
        round: round.round,
        links,
    }
}
