//! What the cluster tests share: certificates, a broker and nodes on loopback, single-process
//! references and their comparison.
#![allow(dead_code)]

pub mod python;

use fusion_backend::{Backend, CandleBackend, ReferenceBackend};
use fusion_data::{Dataset, MarkovCorpus};
use fusion_models::ModelSpec;
use fusion_runtime::{
    run_broker, run_node, BrokerConfig, ClusterOutcome, JobSpec, NodeConfig, Schedule,
};
use fusion_train::{ScheduleConfig, TrainConfig, Trainer};
use fusion_transport::{Certificates, NodeIdentity};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

pub const TOKEN: &str = "test-token";
pub const LIMIT: Duration = Duration::from_secs(600);

#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Reference,
    Candle,
    /// The candle CPU backend computing in 16 bits.
    Half(fusion_backend::Precision),
}

pub struct Pki {
    pub ca: Certificates,
    pub broker: NodeIdentity,
}

pub fn pki() -> Pki {
    let ca = Certificates::new_ca("test-ca").expect("ca");
    let broker = ca.issue("broker", &[]).expect("broker cert");
    Pki { ca, broker }
}

pub fn markov() -> Arc<dyn Dataset> {
    Arc::new(MarkovCorpus::new(32, 4, 0.5, 9).expect("corpus"))
}

pub fn lm_config(steps: u64) -> TrainConfig {
    TrainConfig {
        steps,
        batch_size: 2,
        seq_len: 8,
        micro_batches: 3,
        schedule: ScheduleConfig {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 2,
        },
        eval_every: 10,
        eval_batches: Some(2),
        ..TrainConfig::default()
    }
}

pub fn small_resnet() -> ModelSpec {
    let mut model = ModelSpec::preset("resnet-tiny").expect("preset");
    if let fusion_models::ModelKind::ResNet(c) = &mut model.kind {
        c.widths = vec![4, 4, 8];
    }
    model
}

pub fn spawn_node(
    kind: Kind,
    cfg: NodeConfig,
) -> tokio::task::JoinHandle<fusion_runtime::Result<()>> {
    match kind {
        Kind::Reference => tokio::spawn(run_node(ReferenceBackend, cfg)),
        Kind::Candle => tokio::spawn(run_node(CandleBackend::cpu(), cfg)),
        Kind::Half(p) => {
            let b = CandleBackend::cpu()
                .with_precision(p)
                .expect("16-bit backend");
            tokio::spawn(run_node(b, cfg))
        }
    }
}

/// Runs `job` on one node per entry of `kinds` and returns the broker's outcome.
pub async fn run_cluster(pki: &Pki, job: JobSpec, kinds: &[Kind]) -> ClusterOutcome {
    run_cluster_with(pki, job, kinds, |_, _| {}).await
}

/// `run_cluster`, with `adjust` applied to node i's configuration before it starts.
pub async fn run_cluster_with(
    pki: &Pki,
    job: JobSpec,
    kinds: &[Kind],
    adjust: impl Fn(usize, &mut NodeConfig),
) -> ClusterOutcome {
    let broker = BrokerConfig::new(TOKEN, pki.broker.clone());
    run_cluster_configured(pki, job, broker, kinds, adjust).await
}

/// `run_cluster_with` under the broker configuration `broker`.
pub async fn run_cluster_configured(
    pki: &Pki,
    job: JobSpec,
    broker: BrokerConfig,
    kinds: &[Kind],
    adjust: impl Fn(usize, &mut NodeConfig),
) -> ClusterOutcome {
    let (outcome, ends) = run_cluster_ends(pki, job, broker, kinds, adjust).await;
    for end in ends {
        end.expect("nodes end cleanly");
    }
    outcome
}

/// Starts a broker for `job` on loopback (with the test's tracing output): its URL and task.
pub async fn start_broker(
    job: JobSpec,
    broker: BrokerConfig,
) -> (
    String,
    tokio::task::JoinHandle<fusion_runtime::Result<ClusterOutcome>>,
) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://{}", listener.local_addr().expect("addr"));
    (url, tokio::spawn(run_broker(job, broker, listener, |_| {})))
}

/// `run_cluster_configured`, returning how each node ended (a node may be evicted).
pub async fn run_cluster_ends(
    pki: &Pki,
    job: JobSpec,
    broker: BrokerConfig,
    kinds: &[Kind],
    adjust: impl Fn(usize, &mut NodeConfig),
) -> (ClusterOutcome, Vec<fusion_runtime::Result<()>>) {
    let (url, broker) = start_broker(job, broker).await;
    let nodes: Vec<_> = kinds
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            let name = format!("node{i}");
            let id = pki.ca.issue(&name, &[]).expect("node cert");
            let mut cfg = NodeConfig::local(&name, &url, TOKEN, id);
            adjust(i, &mut cfg);
            spawn_node(k, cfg)
        })
        .collect();
    let outcome = tokio::time::timeout(LIMIT, broker)
        .await
        .expect("the job finishes in time")
        .expect("broker task")
        .expect("the job succeeds");
    let mut ends = Vec::new();
    for n in nodes {
        ends.push(
            tokio::time::timeout(LIMIT, n)
                .await
                .expect("nodes stop")
                .expect("node task"),
        );
    }
    (outcome, ends)
}

pub fn single_process<B: Backend>(
    b: B,
    model: &ModelSpec,
    data: Arc<dyn Dataset>,
    cfg: &TrainConfig,
) -> (fusion_train::Report, Vec<Vec<f32>>) {
    let mut t = Trainer::new(b, model.clone(), data, cfg.clone()).expect("trainer");
    let report = t.run(|_, _| {}).expect("single-process run");
    (report, t.params().to_vec())
}

/// Losses, evaluations and final parameters agree within `tol` (relative).
pub fn assert_matches(
    single: &(fusion_train::Report, Vec<Vec<f32>>),
    dist: &ClusterOutcome,
    tol: f32,
) {
    assert_matches_within(single, dist, tol, tol as f64);
}

/// Losses and evaluations agree within `tol` and final parameters within `param_tol` (both
/// relative): f32 losses can differ by an ulp (6e-8) where f64 parameters agree to 1e-12.
pub fn assert_matches_within(
    single: &(fusion_train::Report, Vec<Vec<f32>>),
    dist: &ClusterOutcome,
    tol: f32,
    param_tol: f64,
) {
    let (report, params) = single;
    assert_eq!(report.steps.len(), dist.report.report.steps.len());
    for (a, b) in report.steps.iter().zip(&dist.report.report.steps) {
        assert!(
            ((a.loss - b.loss) / a.loss).abs() <= tol,
            "step {}: loss {} (single) vs {} (distributed)",
            a.step,
            a.loss,
            b.loss
        );
    }
    assert_eq!(report.evals.len(), dist.report.report.evals.len());
    for (a, b) in report.evals.iter().zip(&dist.report.report.evals) {
        assert!(
            ((a.loss - b.loss) / a.loss).abs() <= tol,
            "eval at {}: {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
        assert!(
            (a.accuracy - b.accuracy).abs() <= 0.02,
            "eval accuracy {} vs {}",
            a.accuracy,
            b.accuracy
        );
    }
    let dist_params = dist.params().expect("final state");
    assert_eq!(params.len(), dist_params.len());
    // Per tensor: the norm of the difference relative to the norm of the single-process values.
    let mut worst = (0f64, 0);
    for (i, (a, b)) in params.iter().zip(&dist_params).enumerate() {
        let norm = a
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum::<f64>()
            .sqrt()
            .max(1e-12);
        let diff = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        if diff / norm > worst.0 {
            worst = (diff / norm, i);
        }
    }
    let (worst, at) = worst;
    assert!(
        worst <= param_tol,
        "final parameters differ by {worst:e} (relative, parameter #{at}), tolerance {param_tol}"
    );
    eprintln!("largest relative parameter difference: {worst:e}");
}

/// Like [`assert_matches_within`] for losses and evaluations, but the final parameters are
/// compared as one vector (the norm of the whole difference relative to the whole model's):
/// for runs whose roundings differ (a 16-bit cluster rounds the residual stream at its cuts,
/// one process does not), where a tensor whose true gradient is zero (the key part of the
/// attention's bias) moves by AdamW's normalised rounding noise and so differs per tensor.
#[allow(dead_code)]
pub fn assert_trains_like(
    single: &(fusion_train::Report, Vec<Vec<f32>>),
    dist: &ClusterOutcome,
    tol: f32,
) {
    assert_matches_within(single, dist, tol, f64::INFINITY);
    let dist_params = dist.params().expect("final state");
    let (mut diff, mut norm) = (0f64, 0f64);
    for (a, b) in single.1.iter().zip(&dist_params) {
        for (&x, &y) in a.iter().zip(b) {
            diff += (x as f64 - y as f64).powi(2);
            norm += (x as f64).powi(2);
        }
    }
    let rel = (diff / norm.max(1e-24)).sqrt();
    eprintln!("relative difference of the whole model: {rel:e}");
    assert!(
        rel <= tol as f64,
        "final models differ by {rel:e} (relative), tolerance {tol}"
    );
}

pub fn job(
    model: ModelSpec,
    data: Arc<dyn Dataset>,
    train: TrainConfig,
    schedule: Schedule,
) -> JobSpec {
    JobSpec {
        precision: Default::default(),
        model,
        data,
        train,
        nodes: 4,
        replicas: 1,
        schedule,
        cuts: None,
        scheduler: fusion_runtime::Scheduler::Even,
        testbed: None,
        pace_links: true,
        probe: Default::default(),
        compression: Default::default(),
    }
}

/// gpt2-tiny under 1F1B on four nodes as two islands (pipeline replicas synchronised by
/// `train`'s outer section).
pub fn two_islands(train: TrainConfig) -> JobSpec {
    JobSpec {
        precision: Default::default(),
        replicas: 2,
        ..job(
            ModelSpec::preset("gpt2-tiny").expect("preset"),
            markov(),
            train,
            Schedule::OneFOneB,
        )
    }
}

/// `count` gpt2-tiny islands of `cfg` (which has an outer configuration) trained in one process
/// over the Markov corpus: the island trainer a cluster of islands is held to, as its report
/// and anchor.
pub fn one_process_islands(
    cfg: &TrainConfig,
    count: usize,
) -> (fusion_train::Report, Vec<Vec<f32>>) {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let inner = Trainer::new(ReferenceBackend, model, markov(), cfg.clone()).expect("trainer");
    let outer = cfg.outer.clone().expect("an outer configuration");
    let mut islands = fusion_train::IslandTrainer::new(inner, count, outer).expect("islands");
    let report = islands.run(|_, _| {}).expect("islands run");
    (report, islands.anchor().to_vec())
}

/// The candle comparisons train with SGD: Adam divides each gradient by its running RMS, so an
/// element whose exact gradient is zero (the key bias of attention: softmax ignores a constant
/// added to every score) moves by the learning rate in the direction of its f32 rounding noise,
/// and any two f32 computations that sum in different orders drift apart there. That is a
/// property of Adam in f32, not of distribution; the reference-backend tests use AdamW.
pub fn sgd_config(steps: u64) -> TrainConfig {
    TrainConfig {
        optimizer: fusion_train::OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.01,
        },
        schedule: ScheduleConfig {
            lr: 0.05,
            min_lr: 0.005,
            warmup_steps: 2,
        },
        ..lm_config(steps)
    }
}

/// The even 4-way split the broker uses (`Scheduler::Even`) of `model` at `batch` x `seq` has a
/// stage reading two activations: a cut through a residual (or shortcut) edge, so the
/// equivalence tests that use it cover such cuts.
pub fn assert_cuts_residual_edges(model: &ModelSpec, batch: usize, seq: usize) {
    let g = model.graph(batch, seq).expect("graph");
    let a = g.even_assignment(4).expect("split");
    let names = (0..4).map(|i| format!("n{i}")).collect();
    let (plan, _) = fusion_runtime::Plan::new(&g, a, names).expect("plan");
    let crossing = plan.stages.iter().any(|s| {
        s.inputs
            .iter()
            .filter(|i| matches!(i.source, fusion_runtime::Source::Stage(_)))
            .count()
            >= 2
    });
    assert!(crossing, "{}: no stage reads two activations", model.name);
}

/// A run's training losses, step by step, as bits (for bit-for-bit comparisons).
pub fn loss_bits(o: &ClusterOutcome) -> Vec<u32> {
    o.report
        .report
        .steps
        .iter()
        .map(|s| s.loss.to_bits())
        .collect()
}
