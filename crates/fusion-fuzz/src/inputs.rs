//! The inputs the targets start from: a small model, an honest assignment of it, and a seed
//! corpus per target made by the encoders the project ships (so every seed is a valid input).

use fusion_graph::Graph;
use fusion_models::{Gpt2Config, ModelKind, ModelSpec};
use fusion_proto::{Assignment, DType, Direction, TensorHeader};
use fusion_train::TrainConfig;
use fusion_transport::FrameWriter;
use std::sync::OnceLock;

/// Every fuzz target, by name (the names of `fuzz/fuzz_targets/*.rs` and of the corpus folders).
pub const TARGETS: &[&str] = &[
    "compressed_tensor",
    "tensor_stream",
    "graph_json",
    "assignment",
    "job_toml",
    "testbed_toml",
    "checkpoint",
    "model_file",
    "hf_model",
    "shard_manifest",
    "run_report",
    "rendezvous_preamble",
];

/// The byte that separates the parts of a target's input (never valid in UTF-8 text).
pub const SEPARATOR: u8 = 0xFF;

/// `data` cut at every [`SEPARATOR`].
pub fn split(data: &[u8]) -> Vec<&[u8]> {
    data.split(|&b| b == SEPARATOR).collect()
}

fn join(parts: &[&[u8]]) -> Vec<u8> {
    parts.join(&SEPARATOR)
}

/// A GPT-2 small enough to build thousands of times a second: 64 tokens, width 8, 2 layers.
pub fn small_spec() -> ModelSpec {
    ModelSpec {
        name: "gpt2-fuzz".into(),
        kind: ModelKind::Gpt2(Gpt2Config {
            vocab: 64,
            n_ctx: 8,
            n_embd: 8,
            n_layer: 2,
            n_head: 2,
        }),
        fixed_vocab: false,
    }
}

/// The training settings the small model's graph is built with (batch 1, 8 tokens).
pub fn small_config() -> TrainConfig {
    TrainConfig {
        batch_size: 1,
        seq_len: 8,
        ..TrainConfig::default()
    }
}

/// [`small_spec`]'s graph at [`small_config`]'s shape.
pub fn small_graph() -> &'static Graph {
    static GRAPH: OnceLock<Graph> = OnceLock::new();
    GRAPH.get_or_init(|| {
        let cfg = small_config();
        small_spec()
            .graph(cfg.batch_size, cfg.seq_len)
            .expect("the small model builds")
    })
}

/// Stage 0 of the small model cut in two, as the broker assigns it.
pub fn base_assignment() -> &'static Assignment {
    static ASSIGNMENT: OnceLock<Assignment> = OnceLock::new();
    ASSIGNMENT.get_or_init(|| {
        fusion_runtime::assignment::first_of_two(small_graph()).expect("the small model splits")
    })
}

/// The configuration JSON of a streaming islands job (3 fragments) and a fragment for each of
/// `a`'s stage's parameters, one byte each (`fragment_of` over the stage's tensors: the broker
/// cuts the whole model's, which any valid list stands for here).
fn streaming_island(a: &Assignment) -> (String, Vec<u8>) {
    let cfg = fusion_train::TrainConfig {
        outer: Some(fusion_train::OuterConfig {
            fragments: 3,
            ..fusion_train::OuterConfig::averaging(6)
        }),
        ..fusion_train::TrainConfig::default()
    };
    let graph = fusion_graph::Graph::from_json(&a.stage_graph_json).expect("the seed's graph");
    let sizes: Vec<usize> = graph.params.iter().map(|p| p.numel()).collect();
    let fragments = fusion_train::fragment_of(&sizes, 3);
    (
        serde_json::to_string(&cfg).expect("json"),
        fragments.into_iter().map(|f| f as u8).collect(),
    )
}

/// The seed inputs of `target`, named.
pub fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let named = |v: Vec<(&str, Vec<u8>)>| v.into_iter().map(|(n, d)| (n.to_string(), d)).collect();
    match target {
        "compressed_tensor" => named(compressed_seeds()),
        "tensor_stream" => named(stream_seeds()),
        "graph_json" => named(vec![("small-gpt2", small_graph().to_json().into_bytes())]),
        "assignment" => {
            let a = base_assignment();
            let parts = [
                a.plan_json.as_bytes(),
                a.stage_graph_json.as_bytes(),
                a.config_json.as_bytes(),
            ];
            let streaming = streaming_island(a);
            let with_fragments = [
                a.plan_json.as_bytes(),
                a.stage_graph_json.as_bytes(),
                streaming.0.as_bytes(),
                &streaming.1,
            ];
            named(vec![
                ("plan", a.plan_json.clone().into_bytes()),
                ("plan-graph-config", join(&parts)),
                ("streaming-island", join(&with_fragments)),
            ])
        }
        "job_toml" => named(vec![(
            "two-sites",
            include_bytes!("../../../jobs/two-sites.toml").to_vec(),
        )]),
        "run_report" => named(vec![("cluster", report_seed())]),
        "testbed_toml" => named(vec![
            (
                "default",
                include_bytes!("../../../testbeds/default.toml").to_vec(),
            ),
            (
                "slow-link",
                include_bytes!("../../../testbeds/slow-link.toml").to_vec(),
            ),
        ]),
        "checkpoint" => named(vec![("small-gpt2", checkpoint_seed())]),
        "model_file" => named(model_seeds()),
        "hf_model" => named(hf_seeds()),
        "shard_manifest" => named(vec![("small-gpt2", shard_manifest_seed())]),
        "rendezvous_preamble" => {
            use fusion_runtime::rendezvous::{session_key, Kind, Preamble};
            let p = |kind| Preamble {
                kind,
                key: session_key(7, "home-a", "lab0"),
            };
            named(vec![
                ("reverse", p(Kind::Reverse).encode()),
                ("relay-sender", p(Kind::RelaySender).encode()),
                ("relay-receiver", p(Kind::RelayReceiver).encode()),
            ])
        }
        _ => Vec::new(),
    }
}

/// One message of each kind and value type, for 300 values.
fn compressed_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use fusion_compress::{compressor, Codec, Selection, ValueType};
    let x: Vec<f32> = (0..300)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    let mut out = Vec::new();
    for (name, codec, values) in [
        ("dense-f32", Codec::None, ValueType::F32),
        ("dense-bf16", Codec::None, ValueType::Bf16),
        ("int8", Codec::Int8 { block: 64 }, ValueType::F32),
        ("topk-f16", Codec::TopK { density: 0.1 }, ValueType::F16),
        ("topk-i8", Codec::TopK { density: 0.3 }, ValueType::I8),
        (
            "randomk-bf16",
            Codec::RandomK { density: 0.2 },
            ValueType::Bf16,
        ),
    ] {
        let mut c = compressor(codec, values, Selection::Exact, 7);
        let mut m = (x.len() as u16).to_le_bytes().to_vec();
        m.extend(c.compress(&x));
        out.push((name, m));
    }
    out
}

/// Streams of one tensor of shape [2, 8] on edge 1: f32, f64 and compressed.
fn stream_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let x: Vec<f32> = (0..16).map(|i| i as f32 / 4.0).collect();
    let f32s: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let f64s: Vec<u8> = x.iter().flat_map(|&v| f64::from(v).to_le_bytes()).collect();
    let int8 = {
        use fusion_compress::{compressor, Codec, Selection, ValueType};
        compressor(
            Codec::Int8 { block: 4 },
            ValueType::F32,
            Selection::Exact,
            1,
        )
        .compress(&x)
    };
    let mut out = Vec::new();
    for (name, dtype, data) in [
        ("f32", DType::F32, f32s),
        ("f64", DType::F64, f64s),
        ("int8", DType::Compressed, int8),
    ] {
        let header = TensorHeader {
            edge: 1,
            direction: Direction::Activation as i32,
            dtype: dtype as i32,
            shape: vec![2, 8],
            ..Default::default()
        };
        let mut bytes = vec![1u8, 7u8];
        runtime.block_on(async {
            let mut w = FrameWriter::new(&mut bytes);
            fusion_transport::send_tensor(&mut w, header, &data)
                .await
                .expect("written to memory");
        });
        out.push((name, bytes));
    }
    out
}

/// A real checkpoint of the small model: `state.json`, the separator, `model.safetensors`.
fn checkpoint_seed() -> Vec<u8> {
    let graph = small_graph();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = TrainConfig::default();
    let params: Vec<Vec<f32>> = graph.params.iter().map(|p| vec![0.5; p.numel()]).collect();
    let opt = fusion_train::OptimizerState {
        step: 3,
        first: params.clone(),
        second: params.clone(),
    };
    let state = fusion_train::CheckpointState {
        format: fusion_train::CHECKPOINT_FORMAT.into(),
        version: fusion_train::CHECKPOINT_VERSION,
        model: graph.name.clone(),
        model_signature: fusion_train::model_signature(graph),
        step: 3,
        data_position: 3,
        optimizer: cfg.optimizer.clone(),
        optimizer_step: 3,
        config: cfg,
        tensors_sha256: String::new(),
        run_id: None,
        model_spec: None,
        loss_scale: None,
    };
    let path = fusion_train::save_checkpoint(dir.path(), graph, &params, &opt, state)
        .expect("a checkpoint of the small model");
    let json = std::fs::read(path.join("state.json")).expect("state.json");
    let tensors = std::fs::read(path.join(fusion_train::CHECKPOINT_TENSORS)).expect("tensors");
    join(&[&json, &tensors])
}

/// A sharded snapshot of the small model in one shard: `manifest.json`, the separator, the
/// shard file.
fn shard_manifest_seed() -> Vec<u8> {
    let spec = small_spec();
    let cfg = small_config();
    let graph = small_graph();
    let values: Vec<Vec<f32>> = graph.params.iter().map(|p| vec![0.25; p.numel()]).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("stage-000.safetensors");
    let state = fusion_train::ShardState {
        params: &graph.params,
        values: &values,
        first: &values,
        second: &values,
    };
    let (bytes, sha256) =
        fusion_train::write_shard(&path, &state, &cfg.optimizer).expect("a shard");
    let manifest = fusion_train::ShardManifest {
        format: fusion_train::SHARD_MANIFEST_FORMAT.into(),
        version: fusion_train::SHARD_MANIFEST_VERSION,
        run_id: "0123456789abcdef".into(),
        model: spec.name.clone(),
        model_signature: fusion_train::model_signature(graph),
        model_spec: spec,
        step: 3,
        data_position: 6,
        optimizer: cfg.optimizer.clone(),
        optimizer_step: 3,
        config: cfg,
        loss_scale: None,
        shards: vec![fusion_train::ShardEntry {
            id: "stage-000".into(),
            stage: 0,
            params: graph.params.iter().map(|p| p.name.clone()).collect(),
            bytes,
            sha256,
            copies: Vec::new(),
        }],
    };
    let json = serde_json::to_vec(&manifest).expect("a manifest serialises");
    let shard = std::fs::read(&path).expect("the shard");
    join(&[&json, &shard])
}

/// An architecture of each family in TOML (first byte 0) and JSON (1), and a graph file (1).
fn model_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use fusion_models::ModelSpec;
    let tagged = |kind: u8, text: String| [vec![kind], text.into_bytes()].concat();
    let mut out = Vec::new();
    for (name, preset) in [
        ("gpt2-toml", "gpt2-tiny"),
        ("llama-toml", "llama-tiny"),
        ("resnet-toml", "resnet-tiny"),
    ] {
        if let Ok(text) = ModelSpec::preset(preset).and_then(|m| m.architecture_toml()) {
            out.push((name, tagged(0, text)));
        }
    }
    if let Ok(Ok(text)) = ModelSpec::preset("llama-tiny").map(|m| serde_json::to_string(&m)) {
        out.push(("llama-json", tagged(1, text)));
    }
    out.push(("graph-json", tagged(1, small_graph().to_json())));
    out
}

/// The GPT-2 and Llama directories `transformers` saved (fusion-hf's fixtures).
fn hf_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let fixture = |config: &[u8], tensors: &[u8]| join(&[config, tensors]);
    vec![
        (
            "gpt2",
            fixture(
                include_bytes!("../../fusion-hf/tests/fixtures/gpt2/config.json"),
                include_bytes!("../../fusion-hf/tests/fixtures/gpt2/model.safetensors"),
            ),
        ),
        (
            "llama",
            fixture(
                include_bytes!("../../fusion-hf/tests/fixtures/llama/config.json"),
                include_bytes!("../../fusion-hf/tests/fixtures/llama/model.safetensors"),
            ),
        ),
    ]
}

/// A cluster run's report as `fusionllm train --report` writes it (the fields the page reads,
/// with a recovery, a reshape and a compressed link).
fn report_seed() -> Vec<u8> {
    let steps: Vec<serde_json::Value> = (1..=6)
        .map(|s| {
            serde_json::json!({"step": s, "loss": 5.0 - 0.1 * s as f64, "lr": 1e-3,
                "grad_norm": 0.9, "elapsed_s": 0.3 * s as f64, "throughput": 3400.0})
        })
        .collect();
    serde_json::to_vec_pretty(&serde_json::json!({
        "model": "gpt2-tiny", "backend": "candle-cpu-f32", "data": "synthetic", "params": 1000,
        "config": {"steps": 6}, "start_step": 0, "steps": steps,
        "evals": [{"step": 6, "loss": 4.5, "accuracy": 0.2}],
        "throughput": 3400.0, "throughput_unit": "tok/s", "wall_s": 2.0,
        "placement": [
            {"stage": 0, "replica": 0, "node": "node0", "backend": "candle-cpu-f32",
             "device": "cpu", "operators": 7, "params": 600, "measured_gflops": 50.0},
            {"stage": 1, "replica": 0, "node": "node1", "backend": "reference-f64",
             "device": "cpu", "operators": 18, "params": 400, "measured_gflops": 2.0}
        ],
        "links": [{"from": "node0", "to": "node1", "bytes": 786432, "tensors": 24,
                   "bandwidth_mbps": 50.0, "latency_ms": 40.0}],
        "timings": [{"step": 6, "wall_s": 0.3, "compute_s": [0.05, 0.2], "wait_s": [0.2, 0.05]}],
        "plan": ["stage 0: node0", "bottleneck: compute of stage 1 on node1"],
        "measured_links": [{"from": "node0", "to": "node1", "bandwidth_mbps": 49.8,
                            "latency_ms": 40.9, "samples": 2}],
        "compression": [{"from": "node1", "to": "node0", "direction": "gradients",
                         "codec": {"kind": "top_k", "density": 0.05}, "dense_bytes": 65536}],
        "recoveries": [{"node": "node1", "reason": "its connection broke", "interrupted_at_step": 4,
                        "resumed_from_step": 3, "steps_lost": 1}],
        "reshapes": [{"step": 5, "why": "node2 joined"}]
    }))
    .expect("a report serialises")
}
