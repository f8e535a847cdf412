//! `fusionllm broker`, `fusionllm node`, and the local launcher behind `fusionllm train`: a broker
//! in this process and one node process per testbed device on loopback, with emulated links.

use crate::supervisor::Supervisor;
use crate::train::{candle_backend, BackendChoice, PrecisionChoice, TrainArgs};
use crate::weights::{run_model, Init};
use anyhow::{bail, Context, Result};
use clap::Args;
use fusion_backend::ReferenceBackend;
use fusion_data::{DataKind, Dataset};
use fusion_models::ModelSpec;
use fusion_runtime::{
    load_identity, open_dataset, parse_schedule, parse_scheduler, run_broker, run_node,
    BrokerConfig, BrokerEvent, ClusterReport, JobFile, JobSpec, LinkProbe, NodeConfig, Schedule,
};
use fusion_testbed::Testbed;
use fusion_train::TrainConfig;
use fusion_transport::Certificates;
use indicatif::ProgressBar;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

/// `--islands auto`: one island per bandwidth cluster (OP-Fence's) of the testbed's first
/// `nodes` devices, which must hold as many devices each.
fn auto_islands(testbed: &Testbed, nodes: usize) -> Result<usize> {
    let used = Testbed {
        devices: testbed.devices[..nodes.min(testbed.devices.len())].to_vec(),
        ..testbed.clone()
    };
    let net =
        fusion_plan::Network::from_testbed(&used, &fusion_testbed::DeviceCatalog::builtin()?)?;
    let clusters = fusion_plan::cluster_by_bandwidth(&net).clusters;
    let sizes: Vec<usize> = clusters.iter().map(Vec::len).collect();
    if sizes.iter().any(|&k| k != sizes[0]) {
        anyhow::bail!(
            "--islands auto: testbed '{}' splits {nodes} nodes into clusters of {sizes:?} nodes; \
             islands need equal ones (give --islands N)",
            testbed.name
        );
    }
    if clusters.len() < 2 {
        eprintln!(
            "--islands auto: testbed '{}' is one bandwidth cluster: one synchronous job",
            testbed.name
        );
    } else {
        eprintln!(
            "--islands auto: {} islands, one per bandwidth cluster of testbed '{}'",
            clusters.len(),
            testbed.name
        );
    }
    Ok(clusters.len())
}

/// The default testbed, built in so `fusionllm train` works from any directory.
pub const DEFAULT_TESTBED: &str = include_str!("../../../testbeds/default.toml");

#[derive(Args)]
pub struct BrokerArgs {
    /// Job file (model, data, nodes, schedule, testbed, [train] settings).
    #[arg(long)]
    job: PathBuf,
    /// Address for the control plane.
    #[arg(long, default_value = "0.0.0.0:7070")]
    listen: SocketAddr,
    /// Directory with ca.pem and broker.pem / broker.key (from `fusionllm cert`).
    #[arg(long)]
    certs: PathBuf,
    /// The CA's revocation list (`fusionllm cert --revoke`): nodes whose certificates it names
    /// cannot join. Default: `crl.pem` in --certs when there is one.
    #[arg(long)]
    crl: Option<PathBuf>,
    #[command(flatten)]
    token: TokenArgs,
    /// Seconds of silence after which a node is declared lost.
    #[arg(long, default_value_t = 10)]
    node_timeout: u64,
    /// Resume from a checkpoint directory (its newest valid checkpoint, continuing that run).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Where the broker keeps its copy of the training state between snapshots: 12 bytes per
    /// parameter with AdamW, twice that while a snapshot is taken (default: `.broker-state` in
    /// the job's checkpoint directory, else the temporary directory, which may be RAM). On the
    /// checkpoints' file system a checkpoint links the snapshot's file instead of copying it.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Write the JSON report here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// After losing a node, seconds to wait for a replacement before going on with fewer.
    #[arg(long, default_value_t = 30)]
    replace_grace: u64,
    /// The fewest nodes the job may shrink to after losing nodes.
    #[arg(long, default_value_t = 1)]
    min_nodes: usize,
    /// Refresh the broker's snapshot of the state every this many steps (0: adaptive, so that
    /// snapshots take at most 5% of the training time).
    #[arg(long, default_value_t = 0)]
    snapshot_every: u64,
    /// Where snapshots are kept: `broker` (the broker's state directory) or `sharded` (each
    /// stage's node and a buddy node; the broker writes a manifest under `sharded/` in the
    /// checkpoint directory, which `fusionllm checkpoint merge` turns into a checkpoint).
    #[arg(long, value_enum, default_value = "broker")]
    snapshots: SnapshotMode,
    /// Seconds every node a step waits for may make no progress (and at least four recent
    /// steps' time) before the one they wait for is evicted (0: never).
    #[arg(long, default_value_t = 60)]
    stall_timeout: u64,
    /// Test hook: stall the coordinator this many milliseconds after its first snapshot.
    #[arg(long, default_value_t = 0, hide = true)]
    test_snapshot_stall_ms: u64,
    /// Test hook: pause this many milliseconds after every step.
    #[arg(long, default_value_t = 0, hide = true)]
    test_step_delay_ms: u64,
    #[command(flatten)]
    election: crate::standby::ElectionArgs,
    #[command(flatten)]
    dashboard: crate::dashboard::DashboardArgs,
}

#[derive(Args)]
pub struct NodeArgs {
    /// The broker's control-plane URL, e.g. https://10.0.0.1:7070; with standby brokers, every
    /// broker's, separated by commas (the node tries them in turn).
    #[arg(long)]
    broker: String,
    #[command(flatten)]
    token: TokenArgs,
    /// This node's name (its certificate's name).
    #[arg(long)]
    name: String,
    /// Directory with ca.pem and <name>.pem / <name>.key.
    #[arg(long)]
    certs: PathBuf,
    #[arg(long, value_enum, default_value = "candle")]
    backend: BackendChoice,
    /// Compute precision of the candle backend (the job's `--precision`).
    #[arg(long, value_enum, default_value = "f32")]
    precision: PrecisionChoice,
    /// Where to accept peers' tensor streams.
    #[arg(long, default_value = "0.0.0.0:0")]
    data_listen: SocketAddr,
    /// Host name or address peers use to reach this node (default: the listening address).
    #[arg(long)]
    advertise: Option<String>,
    /// The name in the broker's certificate.
    #[arg(long, default_value = "broker")]
    broker_name: String,
    #[arg(long, default_value_t = 500)]
    heartbeat_ms: u64,
    /// Seconds to wait for a peer's tensor before failing the step.
    #[arg(long, default_value_t = 120)]
    peer_timeout: u64,
    /// After losing the broker, seconds to keep trying to rejoin it (0: exit at once).
    #[arg(long, default_value_t = 300)]
    reconnect_for: u64,
    /// Data-plane connections this node keeps open from one IP address (peers behind one NAT,
    /// or a local cluster, share one).
    #[arg(long, default_value_t = 64)]
    max_connections_per_address: usize,
    /// Where this node keeps shards of sharded snapshots, its own stage's and copies of its
    /// buddies' (default: a new temporary directory, removed when the node exits).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Emulation: this node stands for a device this many times slower than this machine
    /// (its training steps are stretched and its reported speed divided); set per device by a
    /// testbed's `slowdown` on a local cluster.
    #[arg(long, default_value_t = 1.0)]
    emulate_slowdown: f64,
    /// Profile only while holding an exclusive lock on this file: nodes started together on one
    /// machine that share it profile one after another (the local launcher gives its nodes one).
    #[arg(long)]
    profile_lock: Option<PathBuf>,
    /// Test hook: the compute thread wedges at this training step (heartbeats go on).
    #[arg(long, hide = true)]
    test_wedge_at_step: Option<u64>,
    /// Test hook: the data plane stops reading its sessions at this step.
    #[arg(long, hide = true)]
    test_stop_reading_at_step: Option<u64>,
    /// Test hook: the process exits, as a crash would, when the broker runs this training step.
    #[arg(long, hide = true)]
    test_crash_at_step: Option<u64>,
    /// Test hook: a shard of a sharded snapshot is written only once this node has begun the
    /// training step so many steps later (it would never be, were training to wait for it).
    #[arg(long, hide = true)]
    test_shard_write_after_steps: Option<u64>,
    /// Test hook: the sessions this node relays have this byte altered (a tampering relay).
    #[arg(long, hide = true)]
    test_tamper_relayed_byte: Option<u64>,
    /// Emulation: this node stands for a device behind a NAT or a firewall (port-restricted,
    /// symmetric, firewall): it accepts no data-plane connections, so its peers reach it
    /// reversed, punched or relayed; set per device by a testbed's `nat` on a local cluster.
    #[arg(long, value_parser = parse_nat, default_value = "none")]
    emulate_nat: fusion_testbed::Nat,
}

/// Where a cluster keeps its snapshots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SnapshotMode {
    /// The broker's state directory (the whole state streams to the broker).
    Broker,
    /// Each stage's node and a buddy node; the broker writes a manifest.
    Sharded,
}

/// The revocation list the broker applies: `--crl`, else `crl.pem` in the certificate directory
/// when there is one.
fn revocation(
    a: &BrokerArgs,
    ca_pem: &str,
) -> Result<Option<std::sync::Arc<fusion_transport::RevocationCheck>>> {
    let default = a.certs.join("crl.pem");
    let path = match &a.crl {
        Some(p) => p.clone(),
        None if default.exists() => default,
        None => return Ok(None),
    };
    let pem = std::fs::read_to_string(&path)
        .with_context(|| format!("reading the revocation list {}", path.display()))?;
    let check = fusion_transport::RevocationCheck::new(ca_pem, &pem)
        .with_context(|| format!("the revocation list {}", path.display()))?;
    tracing::info!(
        "nodes are checked against the revocation list {}",
        path.display()
    );
    Ok(Some(std::sync::Arc::new(check)))
}

/// The job's join token: from a file or the environment, which other users cannot read (a
/// command-line argument shows in every process list). The file wins over the variable.
#[derive(Args)]
pub struct TokenArgs {
    /// File holding the job's join token (its first line; the file should be private).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// The job's join token, better given as FUSIONLLM_TOKEN or with --token-file.
    #[arg(long, env = "FUSIONLLM_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

impl TokenArgs {
    pub fn token(&self) -> Result<String> {
        let token = match (&self.token_file, &self.token) {
            (Some(path), _) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading the token file {}", path.display()))?;
                warn_if_shared(path);
                text.lines().next().unwrap_or("").trim().to_string()
            }
            (None, Some(t)) => t.clone(),
            (None, None) => anyhow::bail!("no join token: give --token-file or FUSIONLLM_TOKEN"),
        };
        if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
            anyhow::bail!(
                "the join token must be at least 16 printable characters without spaces \
                 (e.g. `openssl rand -hex 16`)"
            );
        }
        Ok(token)
    }
}

/// Warns when a secret file can be read by other users.
fn warn_if_shared(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(
                "{} can be read by other users (chmod 600 it)",
                path.display()
            );
        }
    }
}

/// The first SIGTERM (or SIGINT) asks the node to leave the job gracefully: the broker moves its
/// stage to the remaining nodes at the next step boundary and releases it. A second one ends the
/// process at once.
fn leave_on_sigterm(name: &str) -> Result<tokio::sync::watch::Receiver<bool>> {
    use tokio::signal::unix::{signal, SignalKind};
    let (tx, rx) = tokio::sync::watch::channel(false);
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let name = name.to_string();
    tokio::spawn(async move {
        for n in 0.. {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            if n > 0 {
                eprintln!("{name}: second signal; exiting now");
                std::process::exit(130);
            }
            eprintln!("{name}: leaving the job after the current step (signal again to exit now)");
            let _ = tx.send(true);
        }
    });
    Ok(rx)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub fn run_node_cmd(a: NodeArgs) -> Result<()> {
    let identity = load_identity(&a.certs, &a.name)?;
    let mut cfg = NodeConfig::local(&a.name, &a.broker, &a.token.token()?, identity);
    cfg.data_listen = a.data_listen;
    cfg.advertise_host = a.advertise.clone();
    cfg.broker_name = a.broker_name.clone();
    cfg.heartbeat = Duration::from_millis(a.heartbeat_ms.max(10));
    cfg.peer_timeout = Duration::from_secs(a.peer_timeout.max(1));
    cfg.reconnect_for = Duration::from_secs(a.reconnect_for);
    cfg.connection_limits.per_address = a.max_connections_per_address.max(1);
    if cfg.advertise_host.is_none() && a.data_listen.ip().is_unspecified() {
        cfg.advertise_host = Some("127.0.0.1".into());
        eprintln!(
            "{}: no --advertise given; peers will reach this node at 127.0.0.1",
            a.name
        );
    }
    cfg.state_dir = a.state_dir.clone();
    if !(a.emulate_slowdown.is_finite() && (1.0..=1000.0).contains(&a.emulate_slowdown)) {
        bail!(
            "--emulate-slowdown must be between 1 and 1000, got {}",
            a.emulate_slowdown
        );
    }
    cfg.emulated_slowdown = a.emulate_slowdown;
    cfg.profile_lock = a.profile_lock.clone();
    cfg.test_hooks.wedge_at_step = a.test_wedge_at_step;
    cfg.test_hooks.stop_reading_at_step = a.test_stop_reading_at_step;
    cfg.test_hooks.crash_at_step = a.test_crash_at_step;
    cfg.test_hooks.shard_write_after_steps = a.test_shard_write_after_steps;
    cfg.test_hooks.tamper_relayed_byte = a.test_tamper_relayed_byte;
    cfg.emulated_nat = a.emulate_nat;
    let rt = runtime()?;
    let result = rt.block_on(async move {
        cfg.leave = Some(leave_on_sigterm(&cfg.node_id)?);
        anyhow::Ok(match a.backend {
            BackendChoice::Candle => run_node(candle_backend(false, a.precision)?, cfg).await,
            BackendChoice::CandleCuda => run_node(candle_backend(true, a.precision)?, cfg).await,
            BackendChoice::Reference if a.precision.precision().is_half() => {
                bail!("--precision: the reference backend computes in f64")
            }
            BackendChoice::Reference => run_node(ReferenceBackend, cfg).await,
        }?)
    });
    // A compute thread left behind (wedged, or abandoned by a reset) must not keep the process.
    rt.shutdown_timeout(Duration::from_secs(1));
    result.with_context(|| format!("node {}", a.name))?;
    eprintln!("{}: the job is over", a.name);
    Ok(())
}

/// Shows the broker's progress: placement, a progress bar (or log lines without a terminal),
/// losses, evaluations and lost nodes.
fn display(steps: u64, unit: &'static str) -> (ProgressBar, impl FnMut(BrokerEvent) + Send + Sync) {
    let bar = crate::train::progress_bar(steps);
    let b = bar.clone();
    let every = (steps / 20).max(1);
    let say = move |b: &ProgressBar, line: String| {
        if b.is_hidden() {
            eprintln!("{line}");
        } else {
            b.println(line);
        }
    };
    let handler = move |ev: BrokerEvent| {
        match ev {
        BrokerEvent::Joined { node, capabilities } => say(
            &b,
            format!(
                "{node} joined: {} on {}, {:.0} GFLOP/s dense and {:.1} GB/s element-wise measured, calibration {:.2}",
                capabilities.backend,
                capabilities.device,
                capabilities.measured_gflops,
                capabilities.measured_memory_gbs,
                capabilities.calibration
            ),
        ),
        BrokerEvent::Compression(links) => {
            say(&b, "link compression:".into());
            for l in links {
                say(
                    &b,
                    format!(
                        "  {:<8} -> {:<8} {:<11} {:>9} bytes dense  {}",
                        l.from, l.to, l.direction, l.dense_bytes, l.codec
                    ),
                );
            }
        }
        BrokerEvent::Links { round, changed } => {
            say(&b, format!("links measured (probe round {round}):"));
            for l in changed {
                say(
                    &b,
                    format!(
                        "  {:<8} -> {:<8} {:>9.1} Mbit/s {:>7.2} ms{}",
                        l.from,
                        l.to,
                        l.bandwidth_mbps,
                        l.latency_ms,
                        match &l.path {
                            fusion_runtime::path::LinkPath::Direct => String::new(),
                            p => format!("  ({})", p.name()),
                        }
                    ),
                );
            }
        }
        BrokerEvent::Plan(lines) => {
            say(&b, "plan:".into());
            for l in lines {
                say(&b, format!("  {l}"));
            }
        }
        BrokerEvent::Placement(p) => {
            say(&b, "stage placement:".into());
            for s in p {
                let recompute = match s.recompute_segments {
                    0 => String::new(),
                    k => format!(", recomputes activations in {k} segments"),
                };
                say(
                    &b,
                    format!(
                        "  stage {} replica {} -> {:<8} {:>4} operators {:>10} parameters  ({}{recompute})",
                        s.stage, s.replica, s.node, s.operators, s.params, s.backend
                    ),
                );
                if !s.reachable {
                    say(&b, "      accepts no connections (NAT or firewall)".into());
                }
                for path in &s.paths {
                    say(&b, format!("      {path}"));
                }
            }
        }
        BrokerEvent::Step(s, eval) => {
            b.set_position(s.step);
            let status = format!(
                "loss {:.4} lr {:.2e} |g| {:.2} {:.0} {unit}",
                s.loss, s.lr, s.grad_norm, s.throughput
            );
            if b.is_hidden() && (s.step.is_multiple_of(every) || eval.is_some()) {
                eprintln!("step {:>6}/{steps}: {status}", s.step);
            }
            b.set_message(status);
            if let Some(e) = eval {
                say(
                    &b,
                    format!(
                        "step {:>6}: eval loss {:.4}, accuracy {:.2}%",
                        e.step,
                        e.loss,
                        100.0 * e.accuracy
                    ),
                );
            }
        }
        BrokerEvent::Resumed { path, step } => {
            b.set_position(step);
            say(
                &b,
                format!("resumed from {} at step {step}", path.display()),
            )
        }
        BrokerEvent::NodeLost { node, reason } => say(&b, format!("node lost: {node}: {reason}")),
        BrokerEvent::StepFailed { node, reason } => {
            say(&b, format!("step failed on {node}: {reason}"))
        }
        BrokerEvent::Recovered { step, lost } => {
            b.set_position(step);
            say(
                &b,
                format!("waiting for the nodes, then resuming from the snapshot at step {step} ({lost} steps lost)"),
            )
        }
        BrokerEvent::IslandOut {
            island,
            step,
            islands_left,
        } => say(
            &b,
            format!(
                "step {step}: island {island} is out; the other islands ({islands_left}) go on \
                 without a rollback, and the islands are re-formed at the next synchronisation"
            ),
        ),
        BrokerEvent::Reshaped { step, why } => {
            say(&b, format!("step {step}: re-planned without a rollback: {why}"))
        }
        BrokerEvent::SkippedCheckpoint { path, reason } => {
            say(&b, format!("skipping checkpoint {}: {reason}", path.display()))
        }
        BrokerEvent::CheckpointFailed { reason } => {
            say(&b, format!("warning: {reason}; training goes on with the snapshot it has"))
        }
        BrokerEvent::StepDetail(_) => {}
    }
    };
    (bar, handler)
}

fn unit_of(data: &dyn Dataset) -> &'static str {
    match data.kind() {
        DataKind::Text { .. } => "tok/s",
        DataKind::Images { .. } => "img/s",
    }
}

/// Prints the end-of-run summary and writes the report.
pub fn finish(report: &ClusterReport, path: Option<&Path>) -> Result<()> {
    let r = &report.report;
    println!(
        "done: {} steps in {:.1}s, {:.0} {} ({} schedule, {})",
        r.steps.len(),
        r.wall_s,
        r.throughput,
        r.throughput_unit,
        report.schedule,
        r.backend
    );
    if !report.links.is_empty() {
        println!("data-plane bytes per link:");
        for l in &report.links {
            let link = match (l.bandwidth_mbps, l.latency_ms) {
                (Some(b), Some(ms)) => format!("{b} Mbit/s, {ms} ms, {}", l.path),
                _ => format!("unpaced, {}", l.path),
            };
            println!(
                "  {:<8} -> {:<8} {:>10.2} MB  ({link})",
                l.from,
                l.to,
                l.bytes as f64 / 1e6
            );
        }
    }
    for f in &report.failures {
        println!("recovered from: {f}");
    }
    crate::train::print_final_eval(r);
    if let Some(path) = path {
        std::fs::write(path, serde_json::to_string_pretty(report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("report written to {}", path.display());
    }
    Ok(())
}

pub fn run_broker_cmd(a: BrokerArgs) -> Result<()> {
    let job = JobFile::from_file(&a.job)?;
    let data = open_dataset(&job.data, &job.tokenizer, job.train.seed)?;
    let init = job.init_from.as_deref().map(Init::open).transpose()?;
    let model = run_model(job.model.as_deref(), init.as_ref(), data.as_ref(), None)?;
    let spec = JobSpec {
        precision: job.precision()?,
        train: job.train_for(&model),
        model,
        data: data.clone(),
        nodes: job.nodes,
        replicas: job.replicas,
        schedule: parse_schedule(&job.schedule)?,
        cuts: job.cuts.clone(),
        scheduler: parse_scheduler(&job.scheduler)?,
        testbed: job.testbed()?,
        pace_links: true,
        probe: job.probe(),
        compression: job.compression.clone(),
    };
    let mut cfg = BrokerConfig::new(&a.token.token()?, load_identity(&a.certs, "broker")?);
    cfg.revocation = revocation(&a, &cfg.identity.ca_pem)?;
    cfg.node_timeout = Duration::from_secs(a.node_timeout.max(1));
    cfg.resume = a.resume.clone();
    cfg.init = init.as_ref().map(Init::source);
    cfg.state_dir = a.state_dir.clone();
    cfg.replace_grace = Duration::from_secs(a.replace_grace);
    cfg.min_nodes = a.min_nodes.max(1);
    cfg.snapshots.every_steps = a.snapshot_every;
    cfg.snapshots.sharded = a.snapshots == SnapshotMode::Sharded;
    cfg.stall_timeout = Duration::from_secs(a.stall_timeout);
    cfg.test_snapshot_stall = Duration::from_millis(a.test_snapshot_stall_ms);
    cfg.test_step_delay = Duration::from_millis(a.test_step_delay_ms);
    let rt = runtime()?;
    let checkpoints = spec.train.checkpoint_dir.clone();
    let report = rt.block_on(async move {
        let elected = match &a.election.etcd {
            None => None,
            Some(endpoint) => {
                let found = crate::standby::stand_by(
                    &a.election,
                    endpoint,
                    &a.job,
                    checkpoints.as_deref(),
                    a.listen,
                    &mut cfg,
                )
                .await?;
                match found {
                    Some(elected) => Some(elected),
                    None => return anyhow::Ok(None),
                }
            }
        };
        let listener = tokio::net::TcpListener::bind(a.listen)
            .await
            .with_context(|| format!("listening on {}", a.listen))?;
        eprintln!(
            "broker listening on {}; waiting for {} nodes",
            listener.local_addr()?,
            spec.nodes
        );
        let unit = unit_of(spec.data.as_ref());
        let (bar, handler) = display(spec.train.steps, unit);
        let info = crate::dashboard::run_info(
            &spec.model.name,
            &job.data,
            spec.train.steps,
            unit,
            spec.testbed.as_ref(),
        );
        let live = crate::dashboard::Live::start(&a.dashboard, info).await?;
        let handler = crate::dashboard::observed(live.as_ref().map(|l| l.monitor.clone()), handler);
        let run = async { anyhow::Ok(run_broker(spec, cfg, listener, handler).await?) };
        let report = match elected {
            None => run.await,
            Some(elected) => elected.serve(run).await,
        };
        crate::dashboard::finished(live.as_ref(), &report).await;
        let report = report?;
        bar.finish();
        anyhow::Ok(Some(report))
    });
    // A checkpoint write left behind by a lost leadership must not keep the process.
    rt.shutdown_timeout(Duration::from_secs(1));
    match report? {
        Some(report) => finish(&report.report, a.report.as_deref()),
        None => Ok(()),
    }
}

pub fn default_model(data: &dyn Dataset) -> String {
    match data.kind() {
        DataKind::Text { .. } => "gpt2-tiny".into(),
        DataKind::Images { .. } => "resnet-tiny".into(),
    }
}

/// Removes the emulated network of a prefix when dropped.
struct TearDown(String);

impl Drop for TearDown {
    fn drop(&mut self) {
        if let Err(e) = fusion_netem::down(&self.0) {
            eprintln!("warning: removing the emulated network '{}': {e}", self.0);
        }
    }
}

/// Connections one address may hold when `nodes` nodes run on this machine (each node's peers
/// and probes all connect from 127.0.0.1).
fn local_connections(nodes: usize) -> usize {
    fusion_transport::ConnectionLimits::default()
        .per_address
        .max(2 * nodes + 16)
}

pub(crate) fn random_token() -> String {
    use rand::RngCore;
    let mut b = [0u8; 16];
    rand::rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Trains on a local emulated cluster: certificates in a temporary directory, a broker in this
/// process, one node process per testbed device (paced links between them).
pub fn launch_local(
    a: &TrainArgs,
    cfg: TrainConfig,
    model: ModelSpec,
    data: Arc<dyn Dataset>,
    init: Option<Init>,
) -> Result<()> {
    let testbed = match &a.testbed {
        Some(p) => Testbed::from_file(p)?,
        None => Testbed::from_toml(DEFAULT_TESTBED)?,
    };
    let nodes = a.nodes;
    if testbed.devices.len() < nodes {
        bail!(
            "testbed '{}' has {} devices; --nodes {nodes} needs as many",
            testbed.name,
            testbed.devices.len()
        );
    }
    let schedule: Schedule = parse_schedule(&a.schedule)?;
    let backends: Vec<BackendChoice> = match &a.node_backends {
        None => vec![a.backend; nodes],
        Some(list) => {
            let v = list
                .split(',')
                .map(|s| {
                    <BackendChoice as clap::ValueEnum>::from_str(s.trim(), true)
                        .map_err(|e| anyhow::anyhow!("--node-backends: {e}"))
                })
                .collect::<Result<Vec<_>>>()?;
            if v.len() != nodes {
                bail!(
                    "--node-backends lists {} backends for {nodes} nodes",
                    v.len()
                );
            }
            v
        }
    };
    let work = tempfile::Builder::new()
        .prefix("fusionllm-cluster-")
        .tempdir()?;
    let logs = a.logs.clone().unwrap_or_else(|| work.path().join("logs"));
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let certs = work.path().join("certs");
    std::fs::create_dir_all(&certs)?;
    // Each node's shards of sharded snapshots, removed with the rest at the end.
    let node_state = work.path().join("nodes");
    std::fs::create_dir_all(&node_state)?;
    let ca = Certificates::new_ca("fusionllm-local")?;
    let names: Vec<String> = testbed
        .devices
        .iter()
        .take(nodes)
        .map(|d| d.name.clone())
        .collect();
    for name in &names {
        fusion_runtime::canonical_node_id(name)
            .map_err(|why| anyhow::anyhow!("testbed device names are node ids: {why}"))?;
    }
    std::fs::write(certs.join("ca.pem"), &ca.ca_pem)?;
    for name in names.iter().map(String::as_str).chain(["broker"]) {
        fusion_runtime::save_identity(&certs, name, &ca.issue(name, &[])?)?;
    }
    let token = random_token();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_node = (threads / nodes).max(1);
    let spec = JobSpec {
        precision: a.precision.precision(),
        model,
        data: data.clone(),
        train: cfg.clone(),
        nodes,
        // Islands are replicas that synchronise through the outer optimizer.
        replicas: match a.islands {
            crate::train::Islands::Count(1) => a.replicas,
            crate::train::Islands::Count(n) => n,
            crate::train::Islands::Auto => auto_islands(&testbed, nodes)?,
        },
        schedule,
        cuts: a.cuts.clone(),
        scheduler: parse_scheduler(&a.scheduler)?,
        testbed: Some(testbed.clone()),
        // With --faithful the kernel shapes the links; nodes must not pace on top.
        pace_links: !a.faithful,
        probe: LinkProbe {
            enabled: !a.no_link_probe,
            every_steps: a.probe_every,
            ..Default::default()
        },
        compression: crate::train::compression(a)?,
    };
    let mut bcfg = BrokerConfig::new(&token, load_identity(&certs, "broker")?);
    bcfg.resume = a.resume.clone();
    bcfg.init = init.as_ref().map(Init::source);
    bcfg.join_timeout = Duration::from_secs(60);
    bcfg.snapshots.sharded = a.snapshots == SnapshotMode::Sharded;
    bcfg.snapshots.every_steps = a.snapshot_every;
    // Every local node connects from 127.0.0.1.
    let per_address = local_connections(nodes);
    bcfg.connection_limits.per_address = per_address;
    eprintln!(
        "local cluster: {nodes} node processes on testbed '{}' ({}), {schedule:?} schedule, {} micro-batches of {}",
        testbed.name, testbed.description, cfg.micro_batches, cfg.batch_size
    );
    eprintln!("node logs: {}", logs.display());
    let exe = std::env::current_exe().context("locating the fusionllm binary")?;
    // Faithful mode: namespaces, tc and delay bridges, removed again however the run ends.
    let emulation = if a.faithful {
        let prefix = format!("fl{:04x}", std::process::id() & 0xffff);
        let em = fusion_netem::up(
            &testbed,
            nodes,
            &prefix,
            &crate::testbed_cmd::relay_command()?,
        )?;
        eprintln!("faithful emulation: namespaces {prefix}-*, links shaped by tc tbf and delayed by a bridge");
        Some((TearDown(prefix), em))
    } else {
        None
    };
    let rt = runtime()?;
    let unit = unit_of(data.as_ref());
    let (bar, handler) = display(cfg.steps, unit);
    let info =
        crate::dashboard::run_info(&spec.model.name, &a.data, cfg.steps, unit, Some(&testbed));
    let result = rt.block_on(async {
        let live = crate::dashboard::Live::start(&a.dashboard, info).await?;
        let handler = crate::dashboard::observed(live.as_ref().map(|l| l.monitor.clone()), handler);
        let bind = if emulation.is_some() {
            "0.0.0.0:0"
        } else {
            "127.0.0.1:0"
        };
        let listener = tokio::net::TcpListener::bind(bind).await?;
        let port = listener.local_addr()?.port();
        let mut nodes = Supervisor::new(3);
        for (i, (name, backend)) in names.iter().zip(&backends).enumerate() {
            let log = logs.join(format!("{name}.log"));
            let slowdown = testbed.devices[i].slowdown;
            // Paced mode: a device behind a NAT refuses its peers' connections; faithful mode
            // puts it behind an emulated router instead.
            let nat = if emulation.is_none() {
                testbed.devices[i].nat
            } else {
                fusion_testbed::Nat::None
            };
            let (exe, certs, token, name_, backend) = (exe.clone(), certs.clone(), token.clone(), name.clone(), *backend);
            let state_root = node_state.clone();
            let precision = a.precision.precision().as_str();
            let place = match &emulation {
                Some((_, em)) => {
                    let d = &em.devices[i];
                    Some((d.namespace.clone(), d.broker_gateway.clone(), d.address.clone()))
                }
                None => None,
            };
            nodes.start(name, log, move || {
                let mut c = match &place {
                    Some((namespace, gateway, address)) => {
                        let mut c = Command::new("ip");
                        c.args(["netns", "exec", namespace]).arg(&exe);
                        c.args(["node", "--broker", &format!("https://{gateway}:{port}")]);
                        c.args(["--data-listen", &format!("{address}:0"), "--advertise", address]);
                        c
                    }
                    None => {
                        let mut c = Command::new(&exe);
                        c.args(["node", "--broker", &format!("https://127.0.0.1:{port}")]);
                        c.args(["--data-listen", "127.0.0.1:0"]);
                        c
                    }
                };
                c.args(["--name", &name_])
                    .arg("--certs")
                    .arg(&certs)
                    .arg("--state-dir")
                    .arg(state_root.join(&name_))
                    .args(["--backend", backend_arg(backend)])
                    .args(["--precision", precision])
                    .args(["--emulate-slowdown", &slowdown.to_string()])
                    .args(["--emulate-nat", nat.name()])
                    .arg("--profile-lock")
                    .arg(state_root.join("profile.lock"))
                    // The broker lives in this process: a node outliving it has nothing to rejoin.
                    .args(["--reconnect-for", "10"])
                    .args(["--max-connections-per-address", &per_address.to_string()])
                    .env("FUSIONLLM_TOKEN", &token)
                    .env("RAYON_NUM_THREADS", per_node.to_string())
                    .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()));
                Ok(c)
            })?;
        }
        let shown = bar.clone();
        let res = tokio::select! {
            res = run_broker(spec, bcfg, listener, handler) => res,
            () = nodes.watch(|line| if shown.is_hidden() { eprintln!("{line}") } else { shown.println(line) }) => unreachable!("the supervisor watches until dropped"),
        };
        crate::dashboard::finished(live.as_ref(), &res).await;
        // Nodes exit after the broker's stop; wait a bounded time for them.
        nodes.wait_all(Duration::from_secs(5)).await;
        if res.is_err() {
            nodes.print_log_tails();
        }
        drop(nodes);
        anyhow::Ok(res?)
    });
    bar.finish();
    let outcome = match result {
        Ok(o) => o,
        Err(e) => {
            // Keep the node logs of a failed run for a post-mortem.
            let kept = work.keep();
            eprintln!("node logs kept in {}", kept.join("logs").display());
            return Err(e);
        }
    };
    // Keep nothing behind but the report (and --logs when given).
    drop(work);
    finish(&outcome.report, a.report.as_deref())
}

fn backend_arg(b: BackendChoice) -> &'static str {
    match b {
        BackendChoice::Candle => "candle",
        BackendChoice::CandleCuda => "candle-cuda",
        BackendChoice::Reference => "reference",
    }
}

/// A `--emulate-nat` value: none, firewall, port-restricted or symmetric.
fn parse_nat(s: &str) -> std::result::Result<fusion_testbed::Nat, String> {
    fusion_testbed::Nat::parse(s)
}
