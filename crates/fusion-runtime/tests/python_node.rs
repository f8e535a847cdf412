//! Heterogeneous software: Python compute nodes (`python/`, NumPy kernels in float64 with their
//! own hand-written VJPs) train in one job with Rust nodes, speaking only what
//! `docs/PROTOCOL.md` and `proto/*.proto` define, and match single-process training. The Python
//! nodes are real processes; the broker and the Rust nodes run in the test.

mod common;

use common::python::{interpreter, package_dir, PyNode};
use common::*;
use fusion_backend::ReferenceBackend;
use fusion_data::{Dataset, SyntheticImages};
use fusion_models::ModelSpec;
use fusion_runtime::{
    run_broker, BrokerConfig, BrokerEvent, ClusterOutcome, JobSpec, NodeConfig, Schedule,
};
use fusion_train::TrainConfig;
use fusion_transport::Certificates;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Jobs of f64 nodes only (Rust reference and NumPy) end within this of one process (relative
/// parameter difference): the Python node computes what the Rust one does, in the same order.
const F64_PARAMS: f64 = 1e-9;

/// Serialises the cases: each runs four or five node processes on a two-core machine.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Which nodes a mixed job runs: a Rust reference node for every `false` and a Python (NumPy)
/// node for every `true` in `python` (named node0, node1, ... in order), then `spares` Python
/// nodes; with `state`, each node keeps its shards in `state/NAME`.
struct Layout<'a> {
    python: &'a [bool],
    spares: usize,
    state: Option<&'a Path>,
}

fn nodes(python: &[bool]) -> Layout<'_> {
    Layout {
        python,
        spares: 0,
        state: None,
    }
}

/// Runs `job` on the nodes of `layout`; `on_event` sees the broker's events with the Python
/// nodes at hand.
async fn mixed_cluster(
    py: &Path,
    pki: &Pki,
    job: JobSpec,
    broker: BrokerConfig,
    layout: Layout<'_>,
    on_event: impl Fn(&BrokerEvent, &[Arc<PyNode>]) + Send + Sync + 'static,
) -> (ClusterOutcome, Vec<Arc<PyNode>>) {
    let Layout {
        python,
        spares,
        state,
    } = layout;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://{}", listener.local_addr().expect("addr"));
    let total = python.len() + spares;
    let mut pys = Vec::new();
    let mut rust = Vec::new();
    for i in 0..total {
        let name = format!("node{i}");
        let id = pki.ca.issue(&name, &[]).expect("node cert");
        let dir = state.map(|s| s.join(&name));
        if python.get(i).copied().unwrap_or(true) {
            let dir = dir.as_ref().map(|d| d.to_str().expect("utf8").to_string());
            let args: Vec<&str> = match &dir {
                Some(d) => vec!["--state-dir", d.as_str()],
                None => vec![],
            };
            pys.push(Arc::new(PyNode::start(py, &name, &url, TOKEN, &id, &args)));
        } else {
            let mut cfg = NodeConfig::local(&name, &url, TOKEN, id);
            cfg.state_dir = dir;
            rust.push(spawn_node(Kind::Reference, cfg));
        }
    }
    let seen = pys.clone();
    let outcome = tokio::time::timeout(
        LIMIT,
        run_broker(job, broker, listener, move |e| on_event(&e, &seen)),
    )
    .await
    .expect("the job finishes in time")
    .expect("the job succeeds");
    for n in rust {
        tokio::time::timeout(LIMIT, n)
            .await
            .expect("nodes stop")
            .expect("node task")
            .expect("Rust nodes end cleanly");
    }
    (outcome, pys)
}

/// Every Python node that was not killed exited cleanly once the job ended.
fn assert_exited_cleanly(pys: &[Arc<PyNode>], killed: &[&str]) {
    for n in pys.iter().filter(|n| !killed.contains(&n.name.as_str())) {
        let (status, log) = n.wait(Duration::from_secs(60));
        assert!(
            status.is_some_and(|s| s.success()),
            "{} ended with {status:?}:\n{log}",
            n.name
        );
    }
}

/// Runs `job` under a default broker on Rust (`false`) and Python (`true`) nodes.
async fn run_mixed(py: &Path, job: JobSpec, python: &[bool]) -> (ClusterOutcome, Vec<Arc<PyNode>>) {
    let pki = pki();
    let broker = BrokerConfig::new(TOKEN, pki.broker.clone());
    mixed_cluster(py, &pki, job, broker, nodes(python), |_, _| {}).await
}

/// A broker that notices a lost node within 3 s and waits up to 20 s for a spare to take its
/// stage, snapshotting every `every` steps, with a short pause after each step so that a fault
/// lands mid-run however fast the machine is.
fn recovering_broker(pki: &Pki, every: u64) -> BrokerConfig {
    let mut broker = BrokerConfig::new(TOKEN, pki.broker.clone());
    broker.node_timeout = Duration::from_secs(3);
    broker.replace_grace = Duration::from_secs(20);
    broker.snapshots.every_steps = every;
    broker.test_step_delay = Duration::from_millis(150);
    broker
}

/// An event handler that, at the first step for which `when(step)` holds, does `act` to the
/// Python node node1 (once).
fn at_step_to_node1(
    when: impl Fn(u64) -> bool + Send + Sync + 'static,
    act: impl Fn(&PyNode) + Send + Sync + 'static,
) -> impl Fn(&BrokerEvent, &[Arc<PyNode>]) + Send + Sync + 'static {
    let fired = AtomicBool::new(false);
    move |e: &BrokerEvent, pys: &[Arc<PyNode>]| {
        if let BrokerEvent::Step(r, _) = e {
            if when(r.step) && !fired.swap(true, Ordering::SeqCst) {
                if let Some(n) = pys.iter().find(|n| n.name == "node1") {
                    act(n);
                }
            }
        }
    }
}

fn backends(out: &ClusterOutcome) -> Vec<&str> {
    out.report
        .placement
        .iter()
        .map(|p| p.backend.as_str())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_numpy_nodes_and_two_rust_nodes_train_gpt2_as_one_process_does() {
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    assert_cuts_residual_edges(&model.clone().with_vocab(32), 2, 8);
    let cfg = lm_config(20);
    let single = single_process(ReferenceBackend, &model, markov(), &cfg);
    let job = job(model, markov(), cfg, Schedule::OneFOneB);
    let (dist, pys) = run_mixed(&py, job, &[false, true, false, true]).await;
    assert_matches_within(&single, &dist, 1e-6, F64_PARAMS);
    let b = backends(&dist);
    assert_eq!(b.iter().filter(|b| **b == "numpy-f64").count(), 2, "{b:?}");
    assert_eq!(b.iter().filter(|b| **b == "reference").count(), 2, "{b:?}");
    assert_exited_cleanly(&pys, &[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn numpy_nodes_train_a_resnet_with_batch_norm_as_one_process_does() {
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let data = || -> Arc<dyn Dataset> { Arc::new(SyntheticImages::new(8, 3, 0.3, 2)) };
    assert_cuts_residual_edges(&small_resnet().with_images(3, 8, 3), 4, 1);
    let cfg = TrainConfig {
        steps: 20,
        batch_size: 4,
        micro_batches: 2,
        eval_every: 10,
        eval_batches: Some(2),
        ..TrainConfig::default()
    };
    let single = single_process(ReferenceBackend, &small_resnet(), data(), &cfg);
    let job = job(small_resnet(), data(), cfg, Schedule::GPipe);
    let (dist, pys) = run_mixed(&py, job, &[true, false, true, false]).await;
    assert_matches_within(&single, &dist, 1e-6, F64_PARAMS);
    assert!(backends(&dist).contains(&"numpy-f64"));
    assert_exited_cleanly(&pys, &[]);
}

/// A killed Python node is lost like a Rust one: the broker rolls back to its snapshot, a spare
/// Python node takes the stage, and the run ends where an uninterrupted one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_python_node_is_replaced_and_training_resumes_from_the_snapshot() {
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let cfg = lm_config(16);
    let single = single_process(ReferenceBackend, &model, markov(), &cfg);
    let pki = pki();
    let broker = recovering_broker(&pki, 3);
    let job = job(model, markov(), cfg, Schedule::OneFOneB);
    let kill_at_step_7 = at_step_to_node1(|s| s == 7, PyNode::kill);
    let (dist, pys) = mixed_cluster(
        &py,
        &pki,
        job,
        broker,
        Layout {
            python: &[false, true, false, true],
            spares: 1,
            state: None,
        },
        kill_at_step_7,
    )
    .await;
    let rec = &dist.report.recoveries;
    assert_eq!(rec.len(), 1, "{rec:?}");
    assert_eq!(rec[0].node, "node1", "{rec:?}");
    assert!(rec[0].steps_lost <= 3, "{rec:?}");
    let placed: Vec<&str> = dist
        .report
        .placement
        .iter()
        .map(|p| p.node.as_str())
        .collect();
    assert!(
        placed.contains(&"node4") && !placed.contains(&"node1"),
        "{placed:?}"
    );
    assert_matches_within(&single, &dist, 1e-6, F64_PARAMS);
    assert_exited_cleanly(&pys, &["node1"]);
}

/// A broker for the refusal cases: it waits for nodes that never come.
async fn lone_broker() -> (String, Pki, tokio::task::JoinHandle<()>) {
    let pki = pki();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://{}", listener.local_addr().expect("addr"));
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let job = job(model, markov(), lm_config(2), Schedule::GPipe);
    let cfg = BrokerConfig::new(TOKEN, pki.broker.clone());
    let task = tokio::spawn(async move {
        let _ = run_broker(job, cfg, listener, |_| {}).await;
    });
    (url, pki, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_node_with_a_wrong_token_or_certificate_is_refused() {
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let (url, pki, broker) = lone_broker().await;
    // The token: the broker refuses the call before reading a message; the node gives up at once.
    let id = pki.ca.issue("node0", &[]).expect("cert");
    let wrong = PyNode::start(&py, "node0", &url, "not-the-job-token-0000", &id, &[]);
    let (status, log) = wrong.wait(Duration::from_secs(60));
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{log}");
    assert!(log.contains("invalid join token"), "{log}");
    // A certificate from another CA: the broker's TLS refuses the handshake.
    let other = Certificates::new_ca("another-ca").expect("ca");
    let mut foreign = other.issue("node1", &[]).expect("cert");
    foreign.ca_pem = pki.ca.ca_pem.clone();
    let stranger = PyNode::start(&py, "node1", &url, TOKEN, &foreign, &[]);
    let (status, log) = stranger.wait(Duration::from_secs(60));
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{log}");
    assert!(log.contains("the TLS handshake failed"), "{log}");
    broker.abort();
}

/// Llama-family operators on Python nodes (RMS norm, grouped-query attention with rotary
/// positions, SiLU gating) train as one process does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn numpy_nodes_train_llama_as_one_process_does() {
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let model = ModelSpec::preset("llama-tiny").expect("preset");
    let cfg = lm_config(12);
    let single = single_process(ReferenceBackend, &model, markov(), &cfg);
    let job = job(model, markov(), cfg, Schedule::OneFOneB);
    let (dist, pys) = run_mixed(&py, job, &[true, false, true, false]).await;
    assert_matches_within(&single, &dist, 1e-6, F64_PARAMS);
    assert_exited_cleanly(&pys, &[]);
}

/// The Python package's own tests: a finite-difference check of every operator's VJP, the
/// compressed tensor format against its specification, the optimizer against hand-computed
/// values.
#[test]
fn the_python_packages_unit_tests_pass() {
    let Some(py) = interpreter() else { return };
    // Certificates for the data-plane tests (hostile peers and receivers): three nodes of one CA.
    let ca = Certificates::new_ca("python-tests").expect("ca");
    let certs = tempfile::tempdir().expect("tempdir");
    for name in ["node0", "node1", "node2"] {
        let id = ca.issue(name, &[]).expect("cert");
        let dir = common::python::write_identity(name, &id);
        for f in [
            format!("{name}.pem"),
            format!("{name}.key"),
            "ca.pem".into(),
        ] {
            std::fs::copy(dir.path().join(&f), certs.path().join(&f)).expect("copy");
        }
    }
    let out = std::process::Command::new(py)
        .args(["-m", "unittest", "discover", "-s", "tests", "-t", "."])
        .env("FUSIONLLM_TEST_CERTS", certs.path())
        .current_dir(package_dir())
        .output()
        .expect("run the Python tests");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("OK"), "{text}");
}

/// The compressed tensor format is the same on both sides: for every codec the Python node
/// encodes a tensor into the very bytes `fusion-compress` does (dense f16 and bf16 rounding,
/// int8 blocks, top-k with each value type and each index encoding), and decodes the Rust
/// messages to the same values, bit for bit.
#[test]
fn python_and_rust_encode_and_decode_compressed_tensors_identically() {
    use fusion_compress::{compressor, Codec, Selection, ValueType};
    let Some(py) = interpreter() else { return };
    let n = 3000;
    // Distinct magnitudes (no top-k ties), values beyond f16's range, tiny ones and zeros.
    let x: Vec<f32> = (0..n)
        .map(|i| {
            let v = ((i * 7919) % 3001) as f32 - 1500.0;
            match i % 11 {
                0 => 0.0,
                1 => v * 97.0,
                2 => v * 1e-6,
                _ => v / 37.0 + (i as f32) * 1e-4,
            }
        })
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(dir.path().join("x.bin"), bytes).expect("x");
    let cases = [
        ("fp16", Codec::Fp16, ValueType::F32),
        ("bf16", Codec::Bf16, ValueType::F32),
        ("int8", Codec::Int8 { block: 256 }, ValueType::F32),
        ("int8_7", Codec::Int8 { block: 7 }, ValueType::F32),
        ("topk_abs", Codec::TopK { density: 0.001 }, ValueType::F32),
        ("topk_varint", Codec::TopK { density: 0.05 }, ValueType::F16),
        ("topk_bitmap", Codec::TopK { density: 0.5 }, ValueType::Bf16),
        ("topk_i8", Codec::TopK { density: 0.2 }, ValueType::I8),
    ];
    let mut manifest = Vec::new();
    for (name, codec, values) in cases {
        let msg = compressor(codec, values, Selection::Exact, 0).compress(&x);
        std::fs::write(dir.path().join(format!("{name}.rust.bin")), &msg).expect("msg");
        manifest.push(serde_json::json!({
            "name": name,
            "codec": serde_json::to_value(codec).expect("codec"),
            "values": serde_json::to_value(values).expect("values"),
        }));
    }
    let cases_json = serde_json::to_string(&manifest).expect("json");
    std::fs::write(dir.path().join("cases.json"), cases_json).expect("cases");
    let out = std::process::Command::new(py)
        .arg(package_dir().join("tests/cross_codec.py"))
        .arg(dir.path())
        .output()
        .expect("run the codec script");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (name, codec, values) in cases {
        let rust = std::fs::read(dir.path().join(format!("{name}.rust.bin"))).expect("rust");
        let python = std::fs::read(dir.path().join(format!("{name}.py.bin"))).expect("python");
        assert!(
            rust == python,
            "{name} ({codec}, {values:?}): the encodings differ ({} vs {} bytes)",
            rust.len(),
            python.len()
        );
        let ours = fusion_compress::decode(&rust, n).expect("decode");
        let theirs = std::fs::read(dir.path().join(format!("{name}.decoded.bin"))).expect("dec");
        let theirs: Vec<u32> = theirs
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let ours: Vec<u32> = ours.iter().map(|v| v.to_bits()).collect();
        assert!(ours == theirs, "{name}: the decoded values differ");
    }
}

/// Compressed links into and out of Python nodes: top-k at full density travels compressed and
/// changes nothing; int8 activations and 10% top-k gradients with error feedback shrink what
/// the Python nodes send, and the job still learns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_nodes_send_and_take_compressed_tensors() {
    use fusion_compress::{Codec, CompressionConfig, Selection, ValueType};
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let cfg = lm_config(8);
    let single = single_process(ReferenceBackend, &model, markov(), &cfg);
    let kinds = [true, false, true, false];
    let run = |compression: CompressionConfig| {
        let pki = pki();
        let broker = BrokerConfig::new(TOKEN, pki.broker.clone());
        let job = JobSpec {
            precision: Default::default(),
            compression,
            ..job(model.clone(), markov(), cfg.clone(), Schedule::OneFOneB)
        };
        let py = py.clone();
        async move {
            let (out, pys) = mixed_cluster(&py, &pki, job, broker, nodes(&kinds), |_, _| {}).await;
            assert_exited_cleanly(&pys, &[]);
            out
        }
    };
    let exact = run(CompressionConfig {
        forward: Codec::TopK { density: 1.0 },
        backward: Codec::TopK { density: 1.0 },
        values: ValueType::F32,
        ..Default::default()
    })
    .await;
    assert_matches(&single, &exact, 1e-5);
    let lossy = run(CompressionConfig {
        forward: Codec::Int8 { block: 256 },
        backward: Codec::TopK { density: 0.1 },
        selection: Selection::Exact,
        error_feedback: true,
        ..Default::default()
    })
    .await;
    // Python nodes are node0 and node2.
    let sent_by_python = |o: &ClusterOutcome| {
        o.report
            .links
            .iter()
            .filter(|l| l.from == "node0" || l.from == "node2")
            .map(|l| l.bytes)
            .sum::<u64>()
    };
    assert!(
        (sent_by_python(&lossy) as f64) < 0.4 * sent_by_python(&exact) as f64,
        "{} vs {} bytes",
        sent_by_python(&lossy),
        sent_by_python(&exact)
    );
    let steps = &lossy.report.report.steps;
    let (first, last) = (steps[0].loss, steps[steps.len() - 1].loss);
    assert!(last.is_finite() && last < first, "loss {first} -> {last}");
}

/// Every stage's replicas run on one Rust and one Python node (so every ring mixes the two).
fn assert_rings_mix_implementations(out: &ClusterOutcome) {
    for stage in 0..2 {
        let mut b: Vec<&str> = out
            .report
            .placement
            .iter()
            .filter(|p| p.stage == stage)
            .map(|p| p.backend.as_str())
            .collect();
        b.sort_unstable();
        assert_eq!(b, ["numpy-f64", "reference"], "stage {stage}");
    }
}

/// Data parallelism across implementations: 2 stages × 2 replicas, each stage's ring all-reduce
/// between a Rust and a Python node, equals one process over both replicas' micro-batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ring_all_reduce_between_rust_and_python_replicas_matches_one_process() {
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let cfg = sgd_config(12);
    let single_cfg = TrainConfig {
        micro_batches: 2 * cfg.micro_batches,
        ..cfg.clone()
    };
    let single = single_process(ReferenceBackend, &model, markov(), &single_cfg);
    let job = JobSpec {
        precision: Default::default(),
        replicas: 2,
        ..job(model, markov(), cfg, Schedule::OneFOneB)
    };
    let (dist, pys) = run_mixed(&py, job, &[false, true, false, true]).await;
    assert_rings_mix_implementations(&dist);
    assert_matches(&single, &dist, 1e-5);
    assert_exited_cleanly(&pys, &[]);
}

/// Islands across implementations: int8 pseudo-gradients, DiLoCo's outer Nesterov momentum and
/// unequal batch shares (4 and 2 micro-batches, weighed by them), each stage's ring between a
/// Rust and a Python node; the broker finds the islands holding the same bits after every
/// synchronisation, and they learn.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rust_and_python_islands_synchronise_to_the_same_bits() {
    use fusion_compress::Codec;
    use fusion_train::OuterConfig;
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let cfg = TrainConfig {
        outer: Some(OuterConfig {
            codec: Codec::Int8 { block: 256 },
            shares: fusion_train::Shares::Fixed(vec![4, 2]),
            ..OuterConfig::diloco(4)
        }),
        eval_every: 4,
        ..lm_config(10)
    };
    let job = two_islands(cfg);
    let (dist, pys) = run_mixed(&py, job, &[false, true, true, false]).await;
    assert_rings_mix_implementations(&dist);
    let r = &dist.report.report;
    let outer = r.outer.clone().expect("an islands report");
    assert_eq!((outer.syncs, outer.shares.as_slice()), (3, &[4, 2][..]));
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    assert!(
        dist.report.failures.is_empty(),
        "{:?}",
        dist.report.failures
    );
    let (first, last) = (r.steps[0].loss, r.evals.last().expect("eval").loss);
    assert!(last < first, "{first} -> {last}");
    assert_exited_cleanly(&pys, &[]);
}

/// Overlapped synchronisation across implementations: 2 islands × 2 stages synchronising every
/// 2 steps, each stage's ring between a Rust and a Python node, the exchanges of steps 2 and 6
/// running on threads of their own beside the next round (on both implementations) and applied
/// one round late; the cluster computes what the one-process island trainer computes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rust_and_python_islands_overlap_their_synchronisations_as_one_process_does() {
    use fusion_train::{OuterConfig, Shares};
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let cfg = TrainConfig {
        clip_norm: None,
        eval_every: 4,
        outer: Some(OuterConfig {
            shares: Shares::Equal,
            overlap: true,
            ..OuterConfig::averaging(2)
        }),
        ..sgd_config(8)
    };
    let single = one_process_islands(&cfg, 2);
    let pki = pki();
    let mut broker = BrokerConfig::new(TOKEN, pki.broker.clone());
    // Snapshots with the evaluations, as the one-process trainer blocks for them only.
    broker.snapshots.every_steps = 4;
    let layout = nodes(&[false, true, true, false]);
    let (dist, pys) = mixed_cluster(&py, &pki, two_islands(cfg), broker, layout, |_, _| {}).await;
    assert_rings_mix_implementations(&dist);
    assert!(
        dist.report.failures.is_empty(),
        "{:?}",
        dist.report.failures
    );
    let outer = dist.report.report.outer.clone().expect("an islands report");
    assert_eq!((outer.syncs, outer.overlapped), (4, 2));
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    assert_matches(&single, &dist, 1e-5);
    assert_exited_cleanly(&pys, &[]);
}

/// Streaming synchronisation across implementations: the same islands with the model cut into
/// 2 fragments, one synchronised after every step in turn and overlapping the next step, each
/// stage's ring between a Rust and a Python node running only its part of the fragment's
/// rings; the synchronisations of steps 4 and 8 take every fragment and block. The cluster
/// computes what the one-process island trainer computes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rust_and_python_islands_stream_fragments_as_one_process_does() {
    use fusion_train::{OuterConfig, Shares};
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let cfg = TrainConfig {
        clip_norm: None,
        eval_every: 4,
        outer: Some(OuterConfig {
            shares: Shares::Equal,
            overlap: true,
            fragments: 2,
            ..OuterConfig::averaging(2)
        }),
        ..sgd_config(8)
    };
    let single = one_process_islands(&cfg, 2);
    let pki = pki();
    let mut broker = BrokerConfig::new(TOKEN, pki.broker.clone());
    broker.snapshots.every_steps = 4;
    let layout = nodes(&[false, true, true, false]);
    let (dist, pys) = mixed_cluster(&py, &pki, two_islands(cfg), broker, layout, |_, _| {}).await;
    assert_rings_mix_implementations(&dist);
    assert!(
        dist.report.failures.is_empty(),
        "{:?}",
        dist.report.failures
    );
    let outer = dist.report.report.outer.clone().expect("an islands report");
    assert_eq!((outer.syncs, outer.partial, outer.overlapped), (8, 6, 6));
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    assert_matches(&single, &dist, 1e-5);
    assert_exited_cleanly(&pys, &[]);
}

/// The newest step of a sharded snapshot whose manifest the broker wrote under `ckpt`.
fn newest_sharded_snapshot(ckpt: &Path) -> Option<u64> {
    std::fs::read_dir(ckpt.join("sharded"))
        .ok()?
        .flatten()
        .filter(|e| e.path().join("manifest.json").is_file())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            name.strip_prefix("step-")?.parse().ok()
        })
        .max()
}

/// Sharded snapshots with Python nodes: every node writes its stage's shard and copies a buddy's;
/// a Python node SIGKILLed after a sharded snapshot is restored from its buddy's copy (fetched by
/// the spare that takes its stage) and the run ends where one process does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_python_node_is_restored_from_its_buddys_copy_of_a_sharded_snapshot() {
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let ckpt = tempfile::tempdir().expect("tempdir");
    let state = tempfile::tempdir().expect("tempdir");
    let cfg = TrainConfig {
        checkpoint_dir: Some(ckpt.path().to_path_buf()),
        ..lm_config(16)
    };
    let single = single_process(ReferenceBackend, &model, markov(), &lm_config(16));
    let pki = pki();
    let mut broker = recovering_broker(&pki, 2);
    broker.snapshots.sharded = true;
    let job = job(model, markov(), cfg, Schedule::OneFOneB);
    let dir = ckpt.path().to_path_buf();
    // Once a sharded snapshot of step 4 or later is complete (its manifest written), at the
    // next step boundary.
    let kill_after_a_sharded_snapshot = at_step_to_node1(
        move |step| newest_sharded_snapshot(&dir).is_some_and(|s| s >= 4) || step >= 12,
        PyNode::kill,
    );
    let (dist, pys) = mixed_cluster(
        &py,
        &pki,
        job,
        broker,
        Layout {
            python: &[false, true, false, true],
            spares: 1,
            state: Some(state.path()),
        },
        kill_after_a_sharded_snapshot,
    )
    .await;
    let rec = &dist.report.recoveries;
    assert_eq!(rec.len(), 1, "{rec:?}");
    assert!(rec[0].from_shards, "{rec:?}");
    assert!(
        rec[0].resumed_from_step >= 4,
        "{rec:?} {:?} {:?}",
        dist.report.snapshots,
        dist.report.failures
    );
    let snaps = &dist.report.snapshots;
    assert!(snaps.sharded >= 3, "{snaps:?}");
    // Before the kill every sharded snapshot was taken; after it, the lost node's may not be.
    assert!(
        snaps
            .snapshot_failures
            .iter()
            .all(|f| !f.contains("node0") && !f.contains("node2")),
        "{snaps:?}"
    );
    assert_matches_within(&single, &dist, 1e-6, F64_PARAMS);
    assert_exited_cleanly(&pys, &["node1"]);
    // The newest manifest names shards the Python nodes wrote too; the Rust reader merges them
    // into a checkpoint.
    let newest = newest_sharded_snapshot(ckpt.path()).expect("a sharded snapshot");
    let manifest = ckpt
        .path()
        .join("sharded")
        .join(format!("step-{newest:08}"))
        .join("manifest.json");
    let out = tempfile::tempdir().expect("tempdir");
    fusion_train::merge_shards(&manifest, out.path()).expect("the shards merge into a checkpoint");
}

/// A Python node asked to stop (SIGTERM) leaves at a step boundary: the broker re-plans without
/// it and without a rollback, the node exits cleanly, and training is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_python_node_leaving_on_sigterm_hands_over_its_stage_without_a_rollback() {
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let cfg = lm_config(14);
    let single = single_process(ReferenceBackend, &model, markov(), &cfg);
    let pki = pki();
    let broker = recovering_broker(&pki, 3);
    let job = job(model, markov(), cfg, Schedule::OneFOneB);
    let term_at_step_5 = at_step_to_node1(|s| s == 5, |n| n.signal("TERM"));
    let (dist, pys) = mixed_cluster(
        &py,
        &pki,
        job,
        broker,
        nodes(&[false, true, false, true]),
        term_at_step_5,
    )
    .await;
    assert!(
        dist.report.recoveries.is_empty(),
        "{:?}",
        dist.report.recoveries
    );
    assert!(
        dist.report.failures.is_empty(),
        "{:?}",
        dist.report.failures
    );
    assert_eq!(dist.report.reshapes.len(), 1, "{:?}", dist.report.reshapes);
    assert!(!dist.report.placement.iter().any(|p| p.node == "node1"));
    assert_matches_within(&single, &dist, 1e-6, F64_PARAMS);
    assert_exited_cleanly(&pys, &[]);
}

/// Island-local recovery across implementations: two islands of two stages, the second of a
/// Python and a Rust node. The Python node1 of the first island is SIGKILLed mid-round (at a
/// step boundary: the Python node2 may or may not have begun the next step when the loss is
/// found): only its island is taken out; the other keeps its state (the Python node2 adopts its
/// worker) and goes on without a rollback; at the next synchronisation the islands are re-formed
/// with the spare, and they hold the same bits after every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_python_islands_node_takes_only_its_island_out() {
    use fusion_compress::Codec;
    use fusion_train::{OuterConfig, Shares};
    let Some(py) = interpreter() else { return };
    let _serial = SERIAL.lock().await;
    let cfg = TrainConfig {
        outer: Some(OuterConfig {
            codec: Codec::Int8 { block: 256 },
            shares: Shares::Equal,
            ..OuterConfig::diloco(5)
        }),
        eval_every: 5,
        ..lm_config(15)
    };
    let job = two_islands(cfg);
    let pki = pki();
    let broker = recovering_broker(&pki, 5);
    let kill_at_step_7 = at_step_to_node1(|s| s == 7, PyNode::kill);
    let layout = Layout {
        python: &[false, true, true, false],
        spares: 1,
        state: None,
    };
    let (dist, pys) = mixed_cluster(&py, &pki, job, broker, layout, kill_at_step_7).await;
    let r = &dist.report;
    assert_eq!(r.recoveries.len(), 1, "{:?}", r.recoveries);
    let rec = &r.recoveries[0];
    assert_eq!(rec.node, "node1", "{rec:?}");
    assert_eq!(rec.island_out, Some(0), "{rec:?}");
    assert_eq!(rec.steps_lost, 0, "{rec:?}");
    let steps: Vec<u64> = r.report.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, (1..=15).collect::<Vec<u64>>());
    assert!(
        r.reshapes
            .iter()
            .any(|x| x.why.starts_with("re-forming 2 islands")),
        "{:?}",
        r.reshapes
    );
    let outer = r.report.outer.clone().expect("an islands report");
    assert_eq!(outer.syncs, 3);
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    assert!(backends(&dist).contains(&"numpy-f64"));
    assert_exited_cleanly(&pys, &["node1"]);
}
