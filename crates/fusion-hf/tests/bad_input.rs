//! Bad model directories: each is refused before training with an error naming the tensor or
//! the field, never a panic or a silently half-loaded model.

use fusion_hf::{HfError, HfModel};
use safetensors::tensor::{Dtype, TensorView};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A copy of fixture `name` in a temporary directory.
fn copy(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for e in std::fs::read_dir(fixture(name)).expect("fixture").flatten() {
        std::fs::copy(e.path(), dir.path().join(e.file_name())).expect("copy");
    }
    dir
}

/// Rewrites `dir/model.safetensors` through `edit`, which gets every tensor as (name, dtype,
/// shape, bytes).
fn rewrite(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid fixture");
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, &path).expect("write");
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec(&v).expect("json")).expect("write");
}

/// Opens `dir` and checks it against its own model's graph.
fn open_and_check(dir: &Path) -> Result<(), HfError> {
    let model = HfModel::open(dir)?;
    let graph = model.spec().graph(1, 4)?;
    model.check_graph(&graph)
}

#[test]
fn a_checkpoint_of_another_architecture_names_what_is_missing_and_unexpected() {
    let dir = copy("llama");
    std::fs::copy(
        fixture("gpt2").join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .expect("copy");
    match open_and_check(dir.path()) {
        Err(HfError::Tensors {
            missing,
            unexpected,
        }) => {
            assert!(missing.contains(&"model.embed_tokens.weight".to_string()));
            assert!(unexpected.contains(&"transformer.wte.weight".to_string()));
            assert_eq!(missing.len(), 21, "{missing:?}");
            assert_eq!(unexpected.len(), 28, "{unexpected:?}");
        }
        other => panic!("expected missing and unexpected tensors, got {other:?}"),
    }
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = copy("llama");
    let gone = "model.layers.1.mlp.up_proj.weight";
    rewrite(dir.path(), |t| t.retain(|(n, ..)| n != gone));
    match open_and_check(dir.path()) {
        Err(HfError::Tensors {
            missing,
            unexpected,
        }) => {
            assert_eq!(missing, vec![gone.to_string()]);
            assert!(unexpected.is_empty());
        }
        other => panic!("expected a missing tensor, got {other:?}"),
    }
}

#[test]
fn a_mis_shaped_tensor_is_named_with_both_shapes() {
    let dir = copy("llama");
    let name = "model.layers.0.self_attn.k_proj.weight";
    rewrite(dir.path(), |t| {
        let k = t.iter_mut().find(|(n, ..)| n == name).expect("k_proj");
        k.2 = vec![32, 32];
        k.3 = vec![0; 32 * 32 * 4];
    });
    match open_and_check(dir.path()) {
        Err(HfError::Shape {
            name: n,
            found,
            expected,
        }) => {
            assert_eq!(n, name);
            assert_eq!(found, vec![32, 32]);
            assert_eq!(expected, vec![16, 32]);
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
}

#[test]
fn a_truncated_file_names_the_tensor_cut_off() {
    let dir = copy("gpt2");
    let path = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&path).expect("len").len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    f.set_len(len - 100).expect("truncate");
    let err = HfModel::open(dir.path()).err().expect("refused");
    let text = err.to_string();
    assert!(matches!(err, HfError::File { .. }), "{err:?}");
    // The data section is sorted by name: the last tensor is the token embedding.
    assert!(
        text.contains("'transformer.wte.weight'") && text.contains("truncated"),
        "{text}"
    );
    f.set_len(5).expect("truncate");
    let err = HfModel::open(dir.path()).err().expect("refused");
    assert!(err.to_string().contains("too short"), "{err}");
}

#[test]
fn a_non_finite_weight_is_named_when_read() {
    let dir = copy("llama");
    let name = "model.norm.weight";
    rewrite(dir.path(), |t| {
        let w = t.iter_mut().find(|(n, ..)| n == name).expect("norm");
        w.3[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    let model = HfModel::open(dir.path()).expect("header is fine");
    let graph = model.spec().graph(1, 4).expect("graph");
    let err = fusion_train::load_all_weights(&model, &graph).expect_err("refused");
    let text = err.to_string();
    assert!(
        text.contains("'model.norm.weight'") && text.contains("index 2"),
        "{text}"
    );
}

type ConfigEdit = Box<dyn Fn(&mut serde_json::Value)>;

#[test]
fn malformed_configs_name_the_field() {
    let cases: Vec<(&str, ConfigEdit)> = vec![
        (
            "num_attention_heads",
            Box::new(|v| v["num_attention_heads"] = "four".into()),
        ),
        ("hidden_size", Box::new(|v| v["hidden_size"] = (-3).into())),
        (
            "rope_parameters",
            Box::new(|v| v["rope_parameters"] = serde_json::json!({"rope_type": "llama3"})),
        ),
        ("mlp_bias", Box::new(|v| v["mlp_bias"] = true.into())),
        (
            "head_dim",
            Box::new(|v| v["num_attention_heads"] = 8.into()),
        ),
        (
            "(architecture)",
            Box::new(|v| v["num_key_value_heads"] = 3.into()),
        ),
        (
            "vocab_size",
            Box::new(|v| {
                if let Some(m) = v.as_object_mut() {
                    m.remove("vocab_size");
                }
            }),
        ),
    ];
    for (field, edit) in cases {
        let dir = copy("llama");
        edit_config(dir.path(), edit);
        match HfModel::open(dir.path()) {
            Err(HfError::Config { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: expected a config error, got {:?}", other.err()),
        }
    }
    let dir = copy("gpt2");
    std::fs::write(
        dir.path().join("config.json"),
        b"{\"model_type\": \"gpt2\",",
    )
    .expect("write");
    let err = HfModel::open(dir.path()).err().expect("refused");
    assert!(
        matches!(&err, HfError::Config { field, .. } if field == "(file)"),
        "{err:?}"
    );
    let dir = copy("gpt2");
    edit_config(dir.path(), |v| v["model_type"] = "bert".into());
    assert!(matches!(
        HfModel::open(dir.path()),
        Err(HfError::Unsupported { model_type, .. }) if model_type == "bert"
    ));
}

#[test]
fn a_directory_without_safetensors_or_with_a_bad_shard_index_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(
        fixture("gpt2").join("config.json"),
        dir.path().join("config.json"),
    )
    .expect("copy");
    std::fs::write(dir.path().join("pytorch_model.bin"), b"pickle").expect("write");
    let err = HfModel::open(dir.path()).err().expect("refused");
    assert!(
        matches!(err, HfError::NotAModel { .. }) && err.to_string().contains("safetensors"),
        "{err}"
    );
    let dir = copy("llama-tied-bf16-sharded");
    let index = dir.path().join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).expect("index");
    std::fs::write(
        &index,
        text.replace("model-00002-of-00002.safetensors", "../outside.safetensors"),
    )
    .expect("write");
    let err = HfModel::open(dir.path()).err().expect("refused");
    assert!(err.to_string().contains("../outside.safetensors"), "{err}");
    std::fs::write(&index, text.replace("00002-of", "00003-of")).expect("write");
    let err = HfModel::open(dir.path()).err().expect("refused");
    assert!(
        matches!(&err, HfError::Io { path, .. } if path.ends_with("model-00003-of-00002.safetensors")),
        "{err:?}"
    );
}

#[test]
fn sizes_that_overflow_and_values_that_are_not_32_bit_numbers_are_refused_by_field() {
    let dir = copy("gpt2");
    edit_config(dir.path(), |v| {
        v["n_embd"] = u64::MAX.into();
        v["n_inner"] = 5.into();
    });
    match HfModel::open(dir.path()) {
        Err(HfError::Config { field, .. }) => assert_eq!(field, "n_inner"),
        other => panic!("expected n_inner refused, got {:?}", other.err()),
    }
    let cases: Vec<(&str, ConfigEdit)> = vec![
        (
            "rope_theta",
            Box::new(|v| {
                v["rope_parameters"] = serde_json::Value::Null;
                v["rope_theta"] = 0.into();
            }),
        ),
        (
            "rope_theta",
            Box::new(|v| v["rope_parameters"]["rope_theta"] = 1e39.into()),
        ),
        (
            "rms_norm_eps",
            Box::new(|v| v["rms_norm_eps"] = 1e-50.into()),
        ),
    ];
    for (field, edit) in cases {
        let dir = copy("llama");
        edit_config(dir.path(), edit);
        match HfModel::open(dir.path()) {
            Err(HfError::Config { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: expected a config error, got {:?}", other.err()),
        }
    }
}
