//! The property of each fuzz target.

use crate::inputs::{base_assignment, small_graph, split};
use fusion_graph::Graph;
use fusion_proto::{DType, Direction};
use fusion_transport::{ExpectedTensor, FrameReader, TensorReceiver, DEFAULT_MAX_FRAME};
use sha2::{Digest, Sha256};
use std::path::Path;

/// Most bytes a node lets a stage it is assigned hold while fuzzing (the node's own limit).
const MEMORY_LIMIT: u64 = 64 << 20;

/// The compressed-tensor decoder: the first two bytes give the element count the receiver
/// expects, the rest is the message. Ok means exactly that many finite values, and both
/// entry points agree.
pub fn compressed_tensor(data: &[u8]) -> bool {
    let Some((head, msg)) = data.split_first_chunk::<2>() else {
        return false;
    };
    let n = u16::from_le_bytes(*head) as usize;
    let plain = fusion_compress::decode(msg, n);
    let with_info = fusion_compress::decode_with_info(msg, n);
    match (&plain, &with_info) {
        (Ok(v), Ok((w, _))) => {
            assert_eq!(
                v.len(),
                n,
                "decoded {} values where {n} were expected",
                v.len()
            );
            assert!(
                v.iter().all(|x| x.is_finite()),
                "a decoded value is not finite"
            );
            assert_eq!(v, w, "the two decoders disagree");
            true
        }
        (Err(_), Err(_)) => false,
        _ => panic!("one decoder accepted what the other refused"),
    }
}

/// Frame and tensor reception over an arbitrary byte stream: the first two bytes give the shape
/// the receiver expects on edge 1; every tensor received has exactly the bytes its header and
/// that shape allow, and finite values. Reading never allocates beyond a frame's limit.
pub fn tensor_stream(data: &[u8]) -> bool {
    let Some((head, stream)) = data.split_first_chunk::<2>() else {
        return false;
    };
    let shape = vec![1 + head[0] as usize % 4, 1 + head[1] as usize % 64];
    let n: usize = shape.iter().product();
    let expected = ExpectedTensor {
        dtypes: vec![DType::F32, DType::F64, DType::Compressed],
        shape: shape.clone(),
        direction: Direction::Activation,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime");
    runtime.block_on(async move {
        let reader = FrameReader::new(stream, DEFAULT_MAX_FRAME);
        let mut rx = TensorReceiver::new(reader, move |edge, dir| {
            (edge == 1 && dir == Direction::Activation).then(|| expected.clone())
        });
        rx.require_finite = true;
        let mut received = 0;
        for _ in 0..64 {
            let Ok(t) = rx.recv().await else {
                break;
            };
            received += 1;
            assert_eq!(t.header.edge, 1);
            assert_eq!(t.data.len() as u64, t.header.total_bytes);
            match t.header.dtype() {
                DType::F32 => assert_eq!(t.data.len(), 4 * n),
                DType::F64 => assert_eq!(t.data.len(), 8 * n),
                DType::Compressed => assert!(t.data.len() <= 4 * n + n / 8 + 64),
                other => panic!("accepted a tensor of type {other:?}"),
            }
            if t.header.dtype() != DType::Compressed {
                let v = t.to_f64().expect("a received tensor converts");
                assert!(
                    v.iter().all(|x| x.is_finite()),
                    "accepted a non-finite value"
                );
            }
        }
        received > 0
    })
}

/// OP-DAG JSON with validation and shape inference: a graph that validates writes back to JSON
/// that reads as the same graph, and has an order of evaluation.
pub fn graph_json(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let Ok(g) = Graph::from_json(text) else {
        return false;
    };
    let again = Graph::from_json(&g.to_json()).expect("a valid graph's JSON reads back");
    assert_eq!(again, g, "a graph changed through its JSON");
    let order = g
        .topo_order()
        .expect("a valid graph has an order of evaluation");
    assert_eq!(order.len(), g.nodes.len());
    true
}

/// An assignment from the broker, built into a stage worker as a node would: the input is the
/// plan JSON, then optionally (after a 0xFF byte) the stage graph JSON and the training
/// configuration JSON, replacing those of an honest assignment of a small model, and the
/// stage's fragments (one byte each; the stage is then a streaming island).
pub fn assignment(data: &[u8]) -> bool {
    let mut a = base_assignment().clone();
    let mut parts = split(data).into_iter();
    let mut text = |into: &mut String| match parts.next().map(std::str::from_utf8) {
        Some(Ok(t)) => {
            *into = t.to_string();
            true
        }
        Some(Err(_)) => false,
        None => true,
    };
    if !(text(&mut a.plan_json) && text(&mut a.stage_graph_json) && text(&mut a.config_json)) {
        return false;
    }
    // A fourth part makes the stage an island (alone in its round) of a streaming job, with
    // one fragment per byte.
    if let Some(fragments) = parts.next() {
        a.islands = true;
        a.fragments = fragments.iter().map(|&b| u32::from(b)).collect();
    }
    let backend = fusion_backend::ReferenceBackend;
    // The property is that nothing panics, overflows or allocates past the limit on the way.
    let Ok(built) = fusion_runtime::assignment::build_stage(&backend, &a, MEMORY_LIMIT) else {
        return false;
    };
    let graph = fusion_graph::Graph::from_json(&a.stage_graph_json).expect("it was built");
    assert_eq!(built.params, graph.params.len(), "a parameter went missing");
    true
}

/// A job file: one that parses is a consistent job.
pub fn job_toml(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let Ok(job) = fusion_runtime::JobFile::parse(text, Path::new("/nonexistent")) else {
        return false;
    };
    assert!(job.nodes > 0 && job.nodes.is_multiple_of(job.replicas));
    job.train
        .validate()
        .expect("a parsed job's training configuration is valid");
    true
}

/// A testbed file: one that parses validates, and reads back from its own TOML.
pub fn testbed_toml(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let Ok(t) = fusion_testbed::Testbed::from_toml(text) else {
        return false;
    };
    t.validate().expect("a parsed testbed validates");
    true
}

/// Checkpoint loading: the input is `state.json`, a 0xFF byte, then `model.safetensors`. When the
/// sidecar parses, its checksum is recomputed over the (mutated) tensor bytes so that mutations
/// reach the tensor file's parser instead of stopping at the checksum. A checkpoint that loads has
/// every parameter and moment of the model in full.
pub fn checkpoint(data: &[u8]) -> bool {
    let parts = split(data);
    let (Some(json), Some(tensors)) = (parts.first(), parts.get(1)) else {
        return false;
    };
    let sha = format!("{:x}", Sha256::digest(tensors));
    let json = match serde_json::from_slice::<fusion_train::CheckpointState>(json) {
        Ok(mut state) => {
            state.tensors_sha256 = sha;
            serde_json::to_vec(&state).expect("a state serialises")
        }
        Err(_) => json.to_vec(),
    };
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(dir.path().join("state.json"), &json).expect("write state.json");
    let path = dir.path().join(fusion_train::CHECKPOINT_TENSORS);
    std::fs::write(&path, tensors).expect("write the tensors");
    let graph = small_graph();
    let optimizer = fusion_train::TrainConfig::default().optimizer;
    let Ok(snap) = fusion_train::load_checkpoint(dir.path(), graph, &optimizer) else {
        return false;
    };
    for (i, p) in graph.params.iter().enumerate() {
        assert_eq!(snap.params[i].len(), p.numel(), "parameter '{}'", p.name);
    }
    true
}

/// A sharded snapshot merged into a checkpoint: the input is `manifest.json`, a 0xFF byte, then
/// the one shard file it names (written beside it). When the manifest parses and names shards,
/// the first shard's size and checksum are set to the (mutated) file's so that mutations reach
/// the shard's parser. A merge that succeeds wrote a checkpoint that loads, with every parameter
/// and moment of the model in full, at the manifest's step.
pub fn shard_manifest(data: &[u8]) -> bool {
    let parts = split(data);
    let (Some(json), Some(shard)) = (parts.first(), parts.get(1)) else {
        return false;
    };
    let mut name = "stage-000".to_string();
    let json = match serde_json::from_slice::<fusion_train::ShardManifest>(json) {
        Ok(mut m) => {
            if let Some(first) = m.shards.first_mut() {
                first.sha256 = format!("{:x}", Sha256::digest(shard));
                first.bytes = shard.len() as u64;
                first.copies.clear();
                name = first.id.clone();
            }
            serde_json::to_vec(&m).expect("a manifest serialises")
        }
        Err(_) => json.to_vec(),
    };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let snap = dir.path().join("snap");
    std::fs::create_dir_all(&snap).expect("mkdir");
    std::fs::write(snap.join(fusion_train::SHARD_MANIFEST), &json).expect("write the manifest");
    if fusion_train::valid_shard_name(&name) {
        std::fs::write(snap.join(format!("{name}.safetensors")), shard).expect("write the shard");
    }
    let Ok(merged) = fusion_train::merge_shards(&snap, &dir.path().join("out")) else {
        return false;
    };
    let m = fusion_train::ShardManifest::read(&snap).expect("a merged manifest reads");
    let graph = m
        .model_spec
        .graph(m.config.batch_size, m.config.seq_len)
        .expect("a merged model builds");
    let back = fusion_train::load_checkpoint(&merged, &graph, &m.optimizer)
        .expect("a merged checkpoint loads");
    assert_eq!(back.state.step, m.step);
    for (i, p) in graph.params.iter().enumerate() {
        assert_eq!(back.params[i].len(), p.numel(), "parameter '{}'", p.name);
    }
    true
}

/// A model file: the first byte chooses TOML (even) or JSON (odd), the rest is the text. One
/// that parses builds at its own shape (a graph file's, or a tiny one for an architecture),
/// counts the parameters its graph has, and answers the data checks without panicking.
pub fn model_file(data: &[u8]) -> bool {
    let Some((&kind, rest)) = data.split_first() else {
        return false;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return false;
    };
    let Ok(spec) = fusion_models::ModelSpec::parse(text, kind % 2 == 0) else {
        return false;
    };
    let (batch, seq) = spec
        .fixed_shape()
        .unwrap_or((1, spec.context().clamp(1, 8)));
    let graph = spec
        .graph(batch, seq)
        .expect("a parsed model builds at its own shape");
    assert_eq!(spec.parameters(), graph.num_trainable());
    let _ = fusion_graph::GraphCost::of(&graph);
    let _ = (spec.fits_text(8), spec.fits_images(1, 28, 10));
    true
}

/// A Hugging Face model directory: `config.json`, a 0xFF byte, then `model.safetensors` (to the
/// end). A
/// directory that opens and whose tensors fit its model loads every parameter in full and
/// finite, and exporting it and opening the export gives back exactly those values.
pub fn hf_model(data: &[u8]) -> bool {
    // Only the first separator counts: tensor bytes may hold 0xFF, JSON text never does.
    let Some(at) = data.iter().position(|&b| b == crate::inputs::SEPARATOR) else {
        return false;
    };
    let (config, tensors) = (&data[..at], &data[at + 1..]);
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(dir.path().join("config.json"), config).expect("write config.json");
    std::fs::write(dir.path().join(fusion_hf::SINGLE), tensors).expect("write the tensors");
    let Ok(model) = fusion_hf::HfModel::open(dir.path()) else {
        return false;
    };
    let Ok(graph) = model.spec().graph(1, 1) else {
        return false;
    };
    if model.check_graph(&graph).is_err() {
        return false;
    }
    let Ok(values) = fusion_train::load_all_weights(&model, &graph) else {
        return false;
    };
    for (v, p) in values.iter().zip(&graph.params) {
        assert_eq!(v.len(), p.numel(), "parameter '{}'", p.name);
        assert!(v.iter().all(|x| x.is_finite()), "'{}' not finite", p.name);
    }
    let out = dir.path().join("export");
    fusion_hf::export_hf(&out, model.spec(), &graph, &model).expect("a loaded model exports");
    let again = fusion_hf::HfModel::open(&out).expect("an export opens");
    for (v, p) in values.iter().zip(&graph.params) {
        assert_eq!(
            &again.load_param(p).expect("read back"),
            v,
            "'{}' changed",
            p.name
        );
    }
    true
}

/// A run report (`fusionllm report RUN.json --html`): a report that reads becomes a page whose
/// embedded view cannot close its `<script>` element and reads back as the same view, with its
/// curves bounded.
pub fn run_report(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let Ok(view) = fusion_monitor::view_from_report(text) else {
        return false;
    };
    assert!(view.steps.len() <= fusion_monitor::MAX_POINTS);
    let html = fusion_monitor::page("fuzz", Some(&view));
    let open = "<script id=\"run-data\" type=\"application/json\">";
    let start = html.find(open).expect("the data element") + open.len();
    let len = html[start..].find("</script>").expect("its end");
    let back: fusion_monitor::RunView =
        serde_json::from_str(&html[start..start + len]).expect("the embedded view reads back");
    assert_eq!(back.steps.len(), view.steps.len());
    assert_eq!(back.plan, view.plan);
    // serde_json reads floats to within an ulp or so (browsers read them exactly): times
    // compare to a relative 1e-12, everything else exactly.
    let key =
        |e: &fusion_monitor::RunEvent| (e.step, e.kind.clone(), e.node.clone(), e.text.clone());
    assert_eq!(back.events.len(), view.events.len());
    for (a, b) in back.events.iter().zip(&view.events) {
        assert_eq!(key(a), key(b));
        assert!(
            (a.t - b.t).abs() <= 1e-12 * a.t.abs().max(1.0),
            "{} vs {}",
            a.t,
            b.t
        );
    }
    true
}

/// The rendezvous preamble a data-plane connection may open with (before TLS): whatever the
/// bytes, decoding either refuses them or yields a preamble that encodes back to exactly the
/// bytes it took, with a key within the limit; the streaming reader agrees with it.
pub fn rendezvous_preamble(data: &[u8]) -> bool {
    use fusion_runtime::rendezvous::{Preamble, MAX_KEY};
    let decoded = Preamble::decode(data);
    let streamed = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .ok()
        .map(|rt| rt.block_on(Preamble::read(&mut &data[..])));
    match decoded {
        Ok((p, used)) => {
            assert!(
                !p.key.is_empty() && p.key.len() <= MAX_KEY,
                "key of {} bytes",
                p.key.len()
            );
            assert_eq!(p.encode(), data[..used], "re-encoding changed the preamble");
            if let Some(s) = streamed {
                assert_eq!(s.ok().as_ref(), Some(&p), "the streaming reader disagrees");
            }
            true
        }
        Err(_) => {
            if let Some(s) = streamed {
                assert!(
                    s.is_err(),
                    "the streaming reader accepted what decode refused"
                );
            }
            false
        }
    }
}
