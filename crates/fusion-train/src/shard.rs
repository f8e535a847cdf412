//! Sharded checkpoints: each node of a distributed run writes its own stage's parameters and
//! optimizer moments to a shard file on its own disk (tensors named as in a checkpoint), and the
//! broker writes a manifest naming the shards of a step, their checksums and where copies of
//! them are kept. [`merge`] turns a manifest and its shards into the single-file checkpoint the
//! single-process trainer, `export` and `sample` read.

use crate::checkpoint::{layout, CheckpointState, CHECKPOINT_FORMAT, CHECKPOINT_VERSION};
use crate::config::{OptimizerConfig, TrainConfig};
use crate::error::{io_err, Result, TrainError};
use crate::tensor_file::{sha256_file, TensorFile};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const MANIFEST_FORMAT: &str = "fusionllm.sharded-checkpoint";
pub const MANIFEST_VERSION: u32 = 1;
/// The manifest's file name in a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// Largest manifest read (a shard per stage and a few copies each).
const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// One shard of a sharded checkpoint: which parameters it holds and where copies are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// The shard's name (also its file's stem).
    pub id: String,
    /// The stage whose state it is, in the placement that wrote it.
    pub stage: u32,
    /// Names of the parameters it holds (value and moments of each).
    pub params: Vec<String>,
    pub bytes: u64,
    /// Hex SHA-256 of the file.
    pub sha256: String,
    /// Nodes holding a verified copy, with the path on each node's machine.
    pub copies: Vec<ShardCopy>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardCopy {
    pub node: String,
    pub path: String,
}

/// The manifest of a sharded checkpoint: everything a checkpoint's sidecar says, and the shards
/// that together hold every tensor of the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardManifest {
    pub format: String,
    pub version: u32,
    pub run_id: String,
    pub model: String,
    pub model_signature: String,
    pub model_spec: fusion_models::ModelSpec,
    pub step: u64,
    pub data_position: u64,
    pub optimizer: OptimizerConfig,
    pub optimizer_step: u64,
    pub config: TrainConfig,
    pub shards: Vec<ShardEntry>,
    /// An f16 run's loss scaler at the snapshot (absent in other precisions and in manifests
    /// written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<crate::LossScaler>,
}

impl ShardManifest {
    /// Reads and checks a manifest file (or the manifest of a checkpoint directory).
    pub fn read(path: &Path) -> Result<ShardManifest> {
        let file = if path.is_dir() {
            path.join(MANIFEST)
        } else {
            path.to_path_buf()
        };
        let bad = |message: String| TrainError::Checkpoint {
            path: file.display().to_string(),
            message,
        };
        let len = std::fs::metadata(&file).map_err(io_err(&file))?.len();
        if len > MAX_MANIFEST_BYTES {
            return Err(bad(format!("{len} bytes is too large for a manifest")));
        }
        let bytes = std::fs::read(&file).map_err(io_err(&file))?;
        let m: ShardManifest = serde_json::from_slice(&bytes)
            .map_err(|e| bad(format!("not a sharded-checkpoint manifest: {e}")))?;
        if m.format != MANIFEST_FORMAT || m.version != MANIFEST_VERSION {
            return Err(bad(format!(
                "format {} v{} is not {MANIFEST_FORMAT} v{MANIFEST_VERSION}",
                m.format, m.version
            )));
        }
        for s in &m.shards {
            if !valid_name(&s.id) {
                return Err(bad(format!("shard name {:?} is not a valid name", s.id)));
            }
        }
        Ok(m)
    }

    /// Writes the manifest as `dir/manifest.json`, atomically (a temporary file renamed).
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let path = dir.join(MANIFEST);
        let tmp = dir.join(format!(".{MANIFEST}.partial-{}", std::process::id()));
        let json = serde_json::to_vec_pretty(self).map_err(|e| TrainError::Checkpoint {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        crate::checkpoint::write_synced(&tmp, &json)?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
        Ok(path)
    }
}

/// Whether `name` may name a run or a shard (and so a file or directory): 1 to 128 characters of
/// `[A-Za-z0-9_-]`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The state of some of a model's parameters: the parameters themselves and the optimizer's
/// moments of each (empty where a parameter has none).
pub struct ShardState<'a> {
    pub params: &'a [fusion_graph::ParamSpec],
    pub values: &'a [Vec<f32>],
    pub first: &'a [Vec<f32>],
    pub second: &'a [Vec<f32>],
}

/// Writes `state` as a shard file at `path` (through a temporary file renamed into place, flushed
/// to disk); returns its size and hex SHA-256.
pub fn write_shard(
    path: &Path,
    state: &ShardState<'_>,
    optimizer: &OptimizerConfig,
) -> Result<(u64, String)> {
    let specs = crate::checkpoint::layout_of(state.params, optimizer);
    let tmp = path.with_extension("partial");
    let file = TensorFile::create(&tmp, &specs)?;
    for (i, p) in state.params.iter().enumerate() {
        let parts = [
            ("param", state.values.get(i)),
            ("opt.first", state.first.get(i)),
            ("opt.second", state.second.get(i)),
        ];
        for (prefix, values) in parts {
            let Some(t) = file.find(&format!("{prefix}.{}", p.name)) else {
                continue;
            };
            let v = values.map_or(&[][..], |v| &v[..]);
            if v.len() != file.entries()[t].numel {
                return Err(TrainError::Checkpoint {
                    path: path.display().to_string(),
                    message: format!(
                        "{prefix} of '{}' has {} elements where its shape holds {}",
                        p.name,
                        v.len(),
                        file.entries()[t].numel
                    ),
                });
            }
            file.write(t, 0, v)?;
        }
    }
    file.sync()?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    let bytes = std::fs::metadata(path).map_err(io_err(path))?.len();
    Ok((bytes, sha256_file(path)?))
}

/// Where a copy of `shard` can be read: beside the manifest (copied there by hand), else the
/// first recorded copy on this machine whose checksum matches.
fn locate(manifest_dir: &Path, shard: &ShardEntry) -> Result<PathBuf> {
    let beside = manifest_dir.join(format!("{}.safetensors", shard.id));
    let mut tried = Vec::new();
    let candidates =
        std::iter::once(beside).chain(shard.copies.iter().map(|c| c.path.clone().into()));
    for path in candidates {
        if !path.is_file() {
            tried.push(format!("{} (absent)", path.display()));
            continue;
        }
        match sha256_file(&path) {
            Ok(sha) if sha == shard.sha256 => return Ok(path),
            Ok(_) => tried.push(format!("{} (checksum mismatch)", path.display())),
            Err(e) => tried.push(format!("{} ({e})", path.display())),
        }
    }
    Err(TrainError::Checkpoint {
        path: manifest_dir.display().to_string(),
        message: format!(
            "no intact copy of shard '{}' on this machine: tried {}; copy the shard file beside \
             the manifest",
            shard.id,
            tried.join(", ")
        ),
    })
}

/// Writes the single-file checkpoint of the sharded checkpoint at `manifest` (a manifest file or
/// the directory holding one) into the run directory `out`; returns the new checkpoint's path.
/// Every shard is checked against its checksum, and the result against the model.
pub fn merge(manifest: &Path, out: &Path) -> Result<PathBuf> {
    let m = ShardManifest::read(manifest)?;
    let manifest_dir = if manifest.is_dir() {
        manifest.to_path_buf()
    } else {
        manifest
            .parent()
            .map_or_else(PathBuf::new, Path::to_path_buf)
    };
    let graph = m.model_spec.graph(m.config.batch_size, m.config.seq_len)?;
    if crate::checkpoint::model_signature(&graph) != m.model_signature {
        return Err(TrainError::Checkpoint {
            path: manifest.display().to_string(),
            message: "its model does not match its model signature".into(),
        });
    }
    let specs = layout(&graph, &m.optimizer);
    // Every shard found and checked before the model-sized output file is made.
    let paths = m
        .shards
        .iter()
        .map(|s| locate(&manifest_dir, s))
        .collect::<Result<Vec<PathBuf>>>()?;
    std::fs::create_dir_all(out).map_err(io_err(out))?;
    // Not named like a checkpoint's partial directory, which the checkpoint writer removes.
    let tmp = out.join(format!(".merging-{}.safetensors", std::process::id()));
    let target = TensorFile::create(&tmp, &specs)?;
    let result = fill_from_shards(&target, &specs, &paths, &manifest_dir);
    drop(target);
    let state = CheckpointState {
        format: CHECKPOINT_FORMAT.into(),
        version: CHECKPOINT_VERSION,
        model: m.model.clone(),
        model_signature: m.model_signature.clone(),
        step: m.step,
        data_position: m.data_position,
        optimizer: m.optimizer.clone(),
        optimizer_step: m.optimizer_step,
        config: m.config.clone(),
        tensors_sha256: String::new(),
        run_id: Some(m.run_id.clone()),
        model_spec: Some(m.model_spec.clone()),
        loss_scale: m.loss_scale.clone(),
    };
    let saved = result.and_then(|()| crate::checkpoint::save_from_file(out, &tmp, state));
    let _ = std::fs::remove_file(&tmp);
    let saved = saved?;
    crate::checkpoint::verify(&saved, &graph, &m.optimizer)?;
    Ok(saved)
}

/// Copies every tensor of `specs` into `target` from the shard file (at `paths`) that holds it.
fn fill_from_shards(
    target: &TensorFile,
    specs: &[(String, Vec<usize>)],
    paths: &[PathBuf],
    manifest_dir: &Path,
) -> Result<()> {
    let mut filled = vec![false; specs.len()];
    for path in paths {
        let source = TensorFile::open(path)?;
        for (k, (name, shape)) in specs.iter().enumerate() {
            let (Some(s), Some(t)) = (source.find(name), target.find(name)) else {
                continue;
            };
            if source.entries()[s].shape != *shape {
                return Err(TrainError::Checkpoint {
                    path: path.display().to_string(),
                    message: format!(
                        "tensor '{name}' is {:?}, expected {shape:?}",
                        source.entries()[s].shape
                    ),
                });
            }
            target.write(t, 0, &source.read(s)?)?;
            filled[k] = true;
        }
    }
    match filled.iter().position(|f| !f) {
        None => target.sync(),
        Some(k) => Err(TrainError::Checkpoint {
            path: manifest_dir.display().to_string(),
            message: format!("no shard holds tensor '{}'", specs[k].0),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::checkpoint::{load, save};
    use crate::optim::OptimizerState;

    /// A checkpoint of gpt2-tiny with distinct values everywhere, split into two shards by
    /// parameter, merges back into the same tensors bit for bit; a damaged shard is refused.
    #[test]
    fn shards_of_a_checkpoint_merge_back_into_it() {
        let spec = fusion_models::ModelSpec::preset("gpt2-tiny").expect("preset");
        let cfg = TrainConfig {
            batch_size: 1,
            seq_len: 16,
            ..TrainConfig::default()
        };
        let graph = spec.graph(cfg.batch_size, cfg.seq_len).expect("graph");
        let fill = |k: f32| -> Vec<Vec<f32>> {
            graph
                .params
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    (0..p.numel())
                        .map(|j| k + i as f32 + j as f32 * 1e-3)
                        .collect()
                })
                .collect()
        };
        let (values, first, second) = (fill(0.0), fill(100.0), fill(200.0));
        let dir = tempfile::tempdir().expect("tempdir");
        let node_disk = dir.path().join("node");
        std::fs::create_dir_all(&node_disk).expect("mkdir");
        let half = graph.params.len() / 2;
        let mut shards = Vec::new();
        for (k, range) in [0..half, half..graph.params.len()].into_iter().enumerate() {
            let path = node_disk.join(format!("s{k}.safetensors"));
            let state = ShardState {
                params: &graph.params[range.clone()],
                values: &values[range.clone()],
                first: &first[range.clone()],
                second: &second[range.clone()],
            };
            let (bytes, sha256) = write_shard(&path, &state, &cfg.optimizer).expect("shard");
            shards.push(ShardEntry {
                id: format!("s{k}"),
                stage: k as u32,
                params: graph.params[range].iter().map(|p| p.name.clone()).collect(),
                bytes,
                sha256,
                copies: vec![ShardCopy {
                    node: format!("node{k}"),
                    path: path.display().to_string(),
                }],
            });
        }
        let manifest = ShardManifest {
            format: MANIFEST_FORMAT.into(),
            version: MANIFEST_VERSION,
            run_id: "0123456789abcdef".into(),
            model: spec.name.clone(),
            model_signature: crate::checkpoint::model_signature(&graph),
            model_spec: spec.clone(),
            step: 7,
            data_position: 21,
            optimizer: cfg.optimizer.clone(),
            optimizer_step: 7,
            config: cfg.clone(),
            shards,
            loss_scale: Some(crate::LossScaler {
                scale: 512.0,
                ..crate::LossScaler::default()
            }),
        };
        let mdir = dir.path().join("step-00000007");
        manifest.write(&mdir).expect("manifest");
        let merged = merge(&mdir, &dir.path().join("merged")).expect("merge");
        let back = load(&merged, &graph, &cfg.optimizer).expect("load");
        assert_eq!((back.state.step, back.state.data_position), (7, 21));
        assert_eq!(
            back.state.loss_scale, manifest.loss_scale,
            "an f16 run's scale"
        );
        assert_eq!(back.params, values);
        assert_eq!(back.optimizer.first, first);
        assert_eq!(back.optimizer.second, second);
        // The same bytes as a checkpoint written in one piece.
        let whole = save(
            &dir.path().join("whole"),
            &graph,
            &values,
            &OptimizerState {
                step: 7,
                first: first.clone(),
                second: second.clone(),
            },
            back.state.clone(),
        )
        .expect("save");
        let read = |p: &Path| std::fs::read(p.join(crate::checkpoint::TENSORS)).expect("read");
        assert_eq!(read(&whole), read(&merged));
        // One flipped byte in a shard: no intact copy, named.
        let victim = node_disk.join("s1.safetensors");
        let mut bytes = std::fs::read(&victim).expect("read");
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&victim, bytes).expect("write");
        let err = merge(&mdir, &dir.path().join("again")).expect_err("corrupt shard");
        let msg = err.to_string();
        assert!(
            msg.contains("shard 's1'") && msg.contains("checksum mismatch"),
            "{msg}"
        );
    }

    #[test]
    fn names_of_runs_and_shards_cannot_leave_their_directory() {
        assert!(valid_name("0123abcd"));
        assert!(valid_name("s002-g1048577"));
        for bad in ["", "..", "a/b", "a.b", "a b", &"x".repeat(129)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
