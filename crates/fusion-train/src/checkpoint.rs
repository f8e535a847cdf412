//! Checkpoints: a directory `step-NNNNNNNN/` holding `model.safetensors` (parameters and optimizer
//! moments) and `state.json` (step, data position, optimizer and model identity, and the
//! SHA-256 of the tensor file). A checkpoint is assembled in a temporary directory and renamed into
//! place, then `latest` is replaced atomically, so a crash never leaves a half-written checkpoint
//! where a reader would find it.

use crate::config::{OptimizerConfig, TrainConfig};
use crate::error::{io_err, Result, TrainError};
use crate::optim::OptimizerState;
use crate::tensor_file::{link_or_copy, sha256_file, TensorFile};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const CHECKPOINT_FORMAT: &str = "fusionllm.checkpoint";
pub const CHECKPOINT_VERSION: u32 = 1;
pub const TENSORS: &str = "model.safetensors";
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
    /// The model as trained (matched to its data), so the checkpoint can be exported or sampled
    /// without naming the model again. Absent in checkpoints of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_spec: Option<fusion_models::ModelSpec>,
    /// The dynamic loss scale of a run computing in f16. Absent otherwise and in checkpoints of
    /// older versions (a resumed f16 run then starts from the initial scale).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<crate::LossScaler>,
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

pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

/// The tensors of a checkpoint of `graph` trained with `optimizer`, by name and shape: every
/// parameter's value, and the optimizer's moments of every trainable parameter (the first for
/// both optimizers, the second for AdamW).
pub fn layout(
    graph: &fusion_graph::Graph,
    optimizer: &OptimizerConfig,
) -> Vec<(String, Vec<usize>)> {
    layout_of(&graph.params, optimizer)
}

/// [`layout`] of some of a model's parameters (a stage's, in a shard).
pub fn layout_of(
    params: &[fusion_graph::ParamSpec],
    optimizer: &OptimizerConfig,
) -> Vec<(String, Vec<usize>)> {
    let adam = matches!(optimizer, OptimizerConfig::AdamW { .. });
    let mut out = Vec::new();
    for p in params {
        out.push((format!("param.{}", p.name), p.shape.clone()));
        if p.trainable && p.numel() > 0 {
            out.push((format!("opt.first.{}", p.name), p.shape.clone()));
            if adam {
                out.push((format!("opt.second.{}", p.name), p.shape.clone()));
            }
        }
    }
    out
}

/// The name prefix of the islands' outer momentum in a checkpoint (`outer.momentum.NAME`).
pub const OUTER_MOMENTUM_PREFIX: &str = "outer.momentum";

/// The tensors an islands run's checkpoint adds to [`layout_of`]: the outer optimizer's
/// momentum of every trainable parameter (the same on every island right after a
/// synchronisation, when islands are snapshotted). A checkpoint without them restarts the
/// outer momentum at zero.
pub fn outer_layout(params: &[fusion_graph::ParamSpec]) -> Vec<(String, Vec<usize>)> {
    params
        .iter()
        .filter(|p| p.trainable && p.numel() > 0)
        .map(|p| {
            (
                format!("{OUTER_MOMENTUM_PREFIX}.{}", p.name),
                p.shape.clone(),
            )
        })
        .collect()
}

/// The name prefix of island `island`'s optimizer moment `part` (`opt.first` or `opt.second`)
/// in an islands run's checkpoint; island 0's are the plain `opt.first.NAME` and `opt.second.NAME`.
pub fn island_moment_prefix(island: usize, part: &str) -> String {
    match island {
        0 => part.to_string(),
        r => format!("island{r}.{part}"),
    }
}

/// The tensors an islands run's checkpoint adds to [`layout_of`] for islands 1 to `islands - 1`:
/// each island's own optimizer moments (`island{r}.opt.first.NAME`, and the second moment with
/// AdamW). A checkpoint without an island's gives it island 0's.
pub fn island_layout(
    params: &[fusion_graph::ParamSpec],
    optimizer: &OptimizerConfig,
    islands: usize,
) -> Vec<(String, Vec<usize>)> {
    let parts: &[&str] = match optimizer {
        OptimizerConfig::AdamW { .. } => &["opt.first", "opt.second"],
        _ => &["opt.first"],
    };
    let mut out = Vec::new();
    for r in 1..islands {
        for p in params.iter().filter(|p| p.trainable && p.numel() > 0) {
            for part in parts {
                let name = format!("{}.{}", island_moment_prefix(r, part), p.name);
                out.push((name, p.shape.clone()));
            }
        }
    }
    out
}

/// Writes a checkpoint of `graph`'s parameters and the optimizer state into `dir`; returns its
/// path. The tensors are written one at a time (no serialised copy of the state in memory).
pub fn save(
    dir: &Path,
    graph: &fusion_graph::Graph,
    params: &[Vec<f32>],
    opt: &OptimizerState,
    state: CheckpointState,
) -> Result<PathBuf> {
    let tmp = begin(dir, state.step)?;
    let specs = layout(graph, &state.optimizer);
    let file = TensorFile::create(&tmp.join(TENSORS), &specs)?;
    for (i, spec) in graph.params.iter().enumerate() {
        let parts = [
            ("param", params.get(i)),
            ("opt.first", opt.first.get(i)),
            ("opt.second", opt.second.get(i)),
        ];
        for (prefix, values) in parts {
            let Some(t) = file.find(&format!("{prefix}.{}", spec.name)) else {
                continue;
            };
            let v = values.map_or(&[][..], |v| &v[..]);
            let numel = file.entries()[t].numel;
            if v.len() != numel {
                return Err(TrainError::Checkpoint {
                    path: tmp.display().to_string(),
                    message: format!(
                        "{prefix} of '{}' has {} elements where its shape holds {numel}",
                        spec.name,
                        v.len()
                    ),
                });
            }
            file.write(t, 0, v)?;
        }
    }
    file.sync()?;
    publish(dir, &tmp, state)
}

/// Writes a checkpoint whose tensors are the file `tensors` (a complete checkpoint tensor file
/// that is never written again: it is linked where the file system allows, else copied).
pub fn save_from_file(dir: &Path, tensors: &Path, state: CheckpointState) -> Result<PathBuf> {
    let tmp = begin(dir, state.step)?;
    let target = tmp.join(TENSORS);
    link_or_copy(tensors, &target)?;
    TensorFile::open(&target)?.sync()?;
    publish(dir, &tmp, state)
}

/// Prepares the temporary directory a checkpoint of `step` is assembled in.
fn begin(dir: &Path, step: u64) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    remove_stale_partials(dir);
    let tmp = dir.join(format!(".step-{step:08}.partial-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
    Ok(tmp)
}

/// Hashes the tensor file assembled in `tmp`, writes the sidecar, renames the directory into
/// place and points `latest` at it.
fn publish(dir: &Path, tmp: &Path, mut state: CheckpointState) -> Result<PathBuf> {
    state.tensors_sha256 = sha256_file(&tmp.join(TENSORS))?;
    let json = serde_json::to_vec_pretty(&state).map_err(|e| TrainError::Checkpoint {
        path: tmp.display().to_string(),
        message: e.to_string(),
    })?;
    write_synced(&tmp.join(STATE), &json)?;
    let name = format!("step-{:08}", state.step);
    let final_dir = dir.join(&name);
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(io_err(&final_dir))?;
    }
    std::fs::rename(tmp, &final_dir).map_err(io_err(&final_dir))?;
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

/// Checks a checkpoint directory against `graph` and `optimizer` without loading its tensors:
/// the sidecar's format, model and optimizer, the tensor file's checksum (hashed in blocks) and
/// its layout (every tensor the model needs, with its shape). Returns the sidecar.
pub fn verify(
    path: &Path,
    graph: &fusion_graph::Graph,
    optimizer: &OptimizerConfig,
) -> Result<CheckpointState> {
    let bad = |message: String| TrainError::Checkpoint {
        path: path.display().to_string(),
        message,
    };
    let state = read_state(path)?;
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
    let tensors = path.join(TENSORS);
    let sha = sha256_file(&tensors).map_err(|e| bad(format!("cannot read {TENSORS}: {e}")))?;
    if sha != state.tensors_sha256 {
        return Err(bad(format!("{TENSORS} is corrupt (checksum mismatch)")));
    }
    let file = TensorFile::open(&tensors)?;
    for (name, shape) in layout(graph, optimizer) {
        match file.find(&name).map(|t| &file.entries()[t]) {
            Some(e) if e.shape == shape => {}
            Some(e) => {
                return Err(bad(format!(
                    "tensor '{name}' is {:?}, expected {shape:?}",
                    e.shape
                )))
            }
            None if name.starts_with("param.") => {
                return Err(bad(format!("missing parameter '{}'", &name[6..])))
            }
            None => return Err(bad(format!("missing optimizer state '{name}'"))),
        }
    }
    Ok(state)
}

/// The sidecar of the checkpoint directory `path` (not checked against any model).
pub fn read_state(path: &Path) -> Result<CheckpointState> {
    let bad = |message: String| TrainError::Checkpoint {
        path: path.display().to_string(),
        message,
    };
    let json =
        std::fs::read(path.join(STATE)).map_err(|e| bad(format!("cannot read {STATE}: {e}")))?;
    serde_json::from_slice(&json)
        .map_err(|e| bad(format!("{STATE} is not a valid checkpoint state: {e}")))
}

/// A checkpoint directory itself, or the one a run directory's `latest` names.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    Ok(match latest_checkpoint(path)? {
        Some(p) if !path.join(STATE).is_file() => p,
        _ => path.to_path_buf(),
    })
}

/// The parameters of a verified checkpoint, read one at a time (the optimizer state is left on
/// disk): weights to export, sample from, or start another run from.
pub struct CheckpointWeights {
    path: PathBuf,
    file: TensorFile,
    pub state: CheckpointState,
}

impl CheckpointWeights {
    /// Opens the checkpoint at `path` (a `step-N` directory, or a run directory's `latest`);
    /// [`crate::WeightSource::check`] verifies it against a model.
    pub fn open(path: &Path) -> Result<CheckpointWeights> {
        let path = resolve(path)?;
        let state = read_state(&path)?;
        let file = TensorFile::open(&path.join(TENSORS))?;
        Ok(CheckpointWeights { path, file, state })
    }

    /// The model the checkpoint holds, when it recorded one (checked to build within the
    /// model-file limits), with its vocabulary fixed.
    pub fn model(&self) -> Result<Option<fusion_models::ModelSpec>> {
        let Some(mut m) = self.state.model_spec.clone() else {
            return Ok(None);
        };
        m.check().map_err(|e| TrainError::Checkpoint {
            path: self.describe(),
            message: format!("its recorded model does not build: {e}"),
        })?;
        m.fixed_vocab = true;
        Ok(Some(m))
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

impl crate::WeightSource for CheckpointWeights {
    fn describe(&self) -> String {
        CheckpointWeights::describe(self)
    }

    /// The checkpoint's model, checksum and layout, checked against `graph`.
    fn check(&self, graph: &fusion_graph::Graph) -> Result<()> {
        verify(&self.path, graph, &self.state.optimizer).map(|_| ())
    }

    fn load(&self, param: &fusion_graph::ParamSpec) -> Result<Vec<f32>> {
        let t = self
            .file
            .find(&format!("param.{}", param.name))
            .ok_or_else(|| TrainError::Checkpoint {
                path: self.describe(),
                message: format!("missing parameter '{}'", param.name),
            })?;
        self.file.read(t)
    }
}

/// Loads and verifies a checkpoint directory against `graph`.
pub fn load(
    path: &Path,
    graph: &fusion_graph::Graph,
    optimizer: &OptimizerConfig,
) -> Result<Snapshot> {
    let state = verify(path, graph, optimizer)?;
    let file = TensorFile::open(&path.join(TENSORS))?;
    let read = |name: String| -> Result<Vec<f32>> {
        file.find(&name).map_or(Ok(Vec::new()), |t| file.read(t))
    };
    let mut params = Vec::new();
    let mut first = Vec::new();
    let mut second = Vec::new();
    for spec in &graph.params {
        params.push(read(format!("param.{}", spec.name))?);
        first.push(read(format!("opt.first.{}", spec.name))?);
        second.push(read(format!("opt.second.{}", spec.name))?);
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

/// The `step-N` entries of `dir` with their steps, newest first.
pub fn step_dirs(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
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
    Ok(steps)
}

/// The newest checkpoint in `dir` that verifies against `graph` (and belongs to run `run_id`
/// when given), with its sidecar: the one `latest` names first, then every `step-N` directory from the
/// highest step down. Each checkpoint passed over is returned with the reason, so a caller can
/// say why it fell back to an older one. None when no checkpoint qualifies.
pub fn newest_valid(
    dir: &Path,
    graph: &fusion_graph::Graph,
    optimizer: &OptimizerConfig,
    run_id: Option<&str>,
) -> Result<(Option<(PathBuf, CheckpointState)>, Skipped)> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    let mut skipped = Vec::new();
    match latest_checkpoint(dir) {
        Ok(Some(p)) => candidates.push(p),
        Ok(None) => {}
        Err(e) => skipped.push((dir.join(LATEST), e.to_string())),
    }
    candidates.extend(step_dirs(dir)?.into_iter().map(|(_, p)| p));
    let mut tried = std::collections::HashSet::new();
    for path in candidates {
        if !tried.insert(path.clone()) {
            continue;
        }
        match verify(&path, graph, optimizer) {
            Ok(state) => match (run_id, &state.run_id) {
                (Some(want), got) if got.as_deref() != Some(want) => skipped.push((
                    path,
                    format!(
                        "written by run {} (this is run {want})",
                        got.as_deref().unwrap_or("unknown")
                    ),
                )),
                _ => return Ok((Some((path, state)), skipped)),
            },
            Err(e) => skipped.push((path, e.to_string())),
        }
    }
    Ok((None, skipped))
}
