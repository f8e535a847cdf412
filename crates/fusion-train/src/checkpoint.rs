//! Checkpoints: a directory `step-NNNNNNNN/` holding `model.safetensors` (parameters and optimizer
//! moments) and `state.json` (step, data position, optimizer and model identity, and the
//! SHA-256 of the tensor file). A checkpoint is assembled in a temporary directory and renamed into
//! place, then `latest` is replaced atomically, so a crash never leaves a half-written checkpoint
//! where a reader would find it.

use crate::config::{OptimizerConfig, TrainConfig};
use crate::error::{io_err, Result, TrainError};
use crate::optim::OptimizerState;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const CHECKPOINT_FORMAT: &str = "fusionllm.checkpoint";
pub const CHECKPOINT_VERSION: u32 = 1;
const TENSORS: &str = "model.safetensors";
const STATE: &str = "state.json";
const LATEST: &str = "latest";

/// The JSON sidecar.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    pub format: String,
    pub version: u32,
    pub model: String,
    /// SHA-256 over parameter names and shapes: a checkpoint only loads into the same model.
    pub model_signature: String,
    pub step: u64,
    /// Training batches consumed so far (the data loader's position).
    pub data_position: u64,
    pub optimizer: OptimizerConfig,
    pub optimizer_step: u64,
    pub config: TrainConfig,
    pub tensors_sha256: String,
    /// The run that wrote it: a restarted broker continues only its own run's checkpoints.
    /// Absent in checkpoints of single-process runs and of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
}

/// Everything needed to continue a run.
pub struct Snapshot {
    pub state: CheckpointState,
    pub params: Vec<Vec<f32>>,
    pub optimizer: OptimizerState,
}

pub fn model_signature(graph: &fusion_graph::Graph) -> String {
    let mut h = Sha256::new();
    for p in &graph.params {
        h.update(p.name.as_bytes());
        h.update(format!("{:?}", p.shape).as_bytes());
    }
    hex::encode(h.finalize())
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

/// Writes a checkpoint of `graph`'s parameters and the optimizer state into `dir`; returns its path.
pub fn save(
    dir: &Path,
    graph: &fusion_graph::Graph,
    params: &[Vec<f32>],
    opt: &OptimizerState,
    mut state: CheckpointState,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    remove_stale_partials(dir);
    let name = format!("step-{:08}", state.step);
    let tmp = dir.join(format!(".{name}.partial-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;

    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (spec, v) in graph.params.iter().zip(params) {
        owned.push((
            format!("param.{}", spec.name),
            spec.shape.clone(),
            to_bytes(v),
        ));
    }
    for (i, spec) in graph.params.iter().enumerate() {
        for (prefix, buf) in [("opt.first", &opt.first), ("opt.second", &opt.second)] {
            if let Some(b) = buf.get(i).filter(|b| !b.is_empty()) {
                owned.push((
                    format!("{prefix}.{}", spec.name),
                    spec.shape.clone(),
                    to_bytes(b),
                ));
            }
        }
    }
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, s, b)| TensorView::new(Dtype::F32, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| TrainError::Checkpoint {
            path: tmp.display().to_string(),
            message: e.to_string(),
        })?;
    let bytes =
        safetensors::tensor::serialize(views, None).map_err(|e| TrainError::Checkpoint {
            path: tmp.display().to_string(),
            message: e.to_string(),
        })?;
    state.tensors_sha256 = hex::encode(Sha256::digest(&bytes));
    write_synced(&tmp.join(TENSORS), &bytes)?;
    let json = serde_json::to_vec_pretty(&state).map_err(|e| TrainError::Checkpoint {
        path: tmp.display().to_string(),
        message: e.to_string(),
    })?;
    write_synced(&tmp.join(STATE), &json)?;

    let final_dir = dir.join(&name);
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(io_err(&final_dir))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(io_err(&final_dir))?;
    let latest_tmp = dir.join(format!(".{LATEST}.partial-{}", std::process::id()));
    write_synced(&latest_tmp, name.as_bytes())?;
    std::fs::rename(&latest_tmp, dir.join(LATEST)).map_err(io_err(dir))?;
    Ok(final_dir)
}

/// Removes temporary directories and files left by a writer that crashed mid-checkpoint: they
/// were never made visible, so nothing refers to them.
fn remove_stale_partials(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with('.') && name.contains(".partial-") {
            let p = e.path();
            let _ = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
        }
    }
}

/// The checkpoint `latest` points at, if the directory has one.
pub fn latest_checkpoint(dir: &Path) -> Result<Option<PathBuf>> {
    let latest = dir.join(LATEST);
    if !latest.exists() {
        return Ok(None);
    }
    let name = std::fs::read_to_string(&latest).map_err(io_err(&latest))?;
    let name = name.trim();
    if name.is_empty() || name.contains('/') || name.contains("..") {
        return Err(TrainError::Checkpoint {
            path: latest.display().to_string(),
            message: format!("'latest' names an invalid checkpoint {name:?}"),
        });
    }
    Ok(Some(dir.join(name)))
}

/// Loads and verifies a checkpoint directory against `graph`.
pub fn load(
    path: &Path,
    graph: &fusion_graph::Graph,
    optimizer: &OptimizerConfig,
) -> Result<Snapshot> {
    let bad = |message: String| TrainError::Checkpoint {
        path: path.display().to_string(),
        message,
    };
    let state_path = path.join(STATE);
    let json = std::fs::read(&state_path).map_err(|e| bad(format!("cannot read {STATE}: {e}")))?;
    let state: CheckpointState = serde_json::from_slice(&json)
        .map_err(|e| bad(format!("{STATE} is not a valid checkpoint state: {e}")))?;
    if state.format != CHECKPOINT_FORMAT || state.version != CHECKPOINT_VERSION {
        return Err(bad(format!(
            "format {} v{} is not {CHECKPOINT_FORMAT} v{CHECKPOINT_VERSION}",
            state.format, state.version
        )));
    }
    if state.model_signature != model_signature(graph) {
        return Err(bad(format!(
            "it was written for model '{}' with other parameters than this run's '{}'",
            state.model, graph.name
        )));
    }
    if std::mem::discriminant(&state.optimizer) != std::mem::discriminant(optimizer) {
        return Err(bad("it was written with a different optimizer".into()));
    }
    let bytes = std::fs::read(path.join(TENSORS))
        .map_err(|e| bad(format!("cannot read {TENSORS}: {e}")))?;
    if hex::encode(Sha256::digest(&bytes)) != state.tensors_sha256 {
        return Err(bad(format!("{TENSORS} is corrupt (checksum mismatch)")));
    }
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("{TENSORS}: {e}")))?;
    let read = |name: &str, shape: &[usize]| -> Result<Option<Vec<f32>>> {
        let t = match st.tensor(name) {
            Ok(t) => t,
            Err(_) => return Ok(None),
        };
        if t.dtype() != Dtype::F32 || t.shape() != shape {
            return Err(bad(format!(
                "tensor '{name}' is {:?} {:?}, expected F32 {shape:?}",
                t.dtype(),
                t.shape()
            )));
        }
        Ok(Some(
            t.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ))
    };
    let mut params = Vec::new();
    let mut first = Vec::new();
    let mut second = Vec::new();
    for spec in &graph.params {
        let p = read(&format!("param.{}", spec.name), &spec.shape)?
            .ok_or_else(|| bad(format!("missing parameter '{}'", spec.name)))?;
        params.push(p);
        let m = read(&format!("opt.first.{}", spec.name), &spec.shape)?;
        let v = read(&format!("opt.second.{}", spec.name), &spec.shape)?;
        let needs_second = matches!(optimizer, OptimizerConfig::AdamW { .. });
        if spec.trainable && (m.is_none() || (needs_second && v.is_none())) {
            return Err(bad(format!("missing optimizer state for '{}'", spec.name)));
        }
        first.push(m.unwrap_or_default());
        second.push(v.unwrap_or_default());
    }
    Ok(Snapshot {
        optimizer: OptimizerState {
            step: state.optimizer_step,
            first,
            second,
        },
        params,
        state,
    })
}

/// The run id of the checkpoint `latest` names, read from its sidecar alone (so it is known even
/// when that checkpoint's tensors are corrupt). None when there is none or it cannot be read.
pub fn latest_run_id(dir: &Path) -> Option<String> {
    let path = latest_checkpoint(dir).ok()??;
    let json = std::fs::read(path.join(STATE)).ok()?;
    serde_json::from_slice::<CheckpointState>(&json)
        .ok()?
        .run_id
}

/// Checkpoints passed over, each with the reason.
pub type Skipped = Vec<(PathBuf, String)>;

/// The newest checkpoint in `dir` that loads and verifies against `graph` (and belongs to run
/// `run_id` when given): the one `latest` names first, then every `step-N` directory from the
/// highest step down. Each checkpoint passed over is returned with the reason, so a caller can
/// say why it fell back to an older one. None when no checkpoint qualifies.
pub fn newest_valid(
    dir: &Path,
    graph: &fusion_graph::Graph,
    optimizer: &OptimizerConfig,
    run_id: Option<&str>,
) -> Result<(Option<(PathBuf, Snapshot)>, Skipped)> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    let mut skipped = Vec::new();
    match latest_checkpoint(dir) {
        Ok(Some(p)) => candidates.push(p),
        Ok(None) => {}
        Err(e) => skipped.push((dir.join(LATEST), e.to_string())),
    }
    let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            Some((step, e.path()))
        })
        .collect();
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    candidates.extend(steps.into_iter().map(|(_, p)| p));
    let mut tried = std::collections::HashSet::new();
    for path in candidates {
        if !tried.insert(path.clone()) {
            continue;
        }
        match load(&path, graph, optimizer) {
            Ok(snap) => match (run_id, &snap.state.run_id) {
                (Some(want), got) if got.as_deref() != Some(want) => skipped.push((
                    path,
                    format!(
                        "written by run {} (this is run {want})",
                        got.as_deref().unwrap_or("unknown")
                    ),
                )),
                _ => return Ok((Some((path, snap)), skipped)),
            },
            Err(e) => skipped.push((path, e.to_string())),
        }
    }
    Ok((None, skipped))
}
