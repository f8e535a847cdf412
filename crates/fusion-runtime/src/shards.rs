//! A node's own disk for sharded snapshots: the shard files of its stage it wrote, and the
//! copies it keeps for its buddies, as `ROOT/RUN/step-NNNNNNNN/SHARD.safetensors` with the
//! file's SHA-256 beside it (`SHARD.sha256`). Names of runs and shards are checked before they
//! become paths.

use crate::error::{io_err, Result, RuntimeError};
use crate::worker::StageWorker;
use fusion_backend::Backend;
use fusion_train::{valid_shard_name, write_shard, ShardState, TensorFile};
use std::path::{Path, PathBuf};

/// The shard files on a node's disk.
pub struct ShardStore {
    root: PathBuf,
    /// A temporary root, removed with the store (a node given no state directory).
    _temp: Option<tempfile::TempDir>,
    /// The run and the newest step a prune was asked to keep: a prune from an older snapshot's
    /// task (one given up, finishing late) must not remove a newer snapshot's files.
    newest_kept: std::sync::Mutex<Option<(String, u64)>>,
}

/// A shard file on disk and what it is.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardFile {
    pub path: PathBuf,
    pub bytes: u64,
    pub sha256: String,
}

fn bad_name(what: &str, name: &str) -> RuntimeError {
    RuntimeError::Protocol(format!(
        "{what} name {:?} is not 1-128 characters of [A-Za-z0-9_-]",
        crate::service::printable(name, 40)
    ))
}

impl ShardStore {
    /// The store under `dir` (created), or under a new temporary directory.
    pub fn open(dir: Option<&Path>) -> Result<ShardStore> {
        let (root, temp) = match dir {
            Some(d) => (d.to_path_buf(), None),
            None => {
                let t = tempfile::Builder::new()
                    .prefix("fusionllm-node-state-")
                    .tempdir()
                    .map_err(io_err("creating a temporary node state directory"))?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        std::fs::create_dir_all(&root)
            .map_err(io_err(format!("node state directory {}", root.display())))?;
        Ok(ShardStore {
            root,
            _temp: temp,
            newest_kept: std::sync::Mutex::new(None),
        })
    }

    /// Where shard `shard` of step `step` of run `run` lives (whether or not it exists).
    pub fn path(&self, run: &str, step: u64, shard: &str) -> Result<PathBuf> {
        if !valid_shard_name(run) {
            return Err(bad_name("run", run));
        }
        if !valid_shard_name(shard) {
            return Err(bad_name("shard", shard));
        }
        Ok(self
            .root
            .join(run)
            .join(format!("step-{step:08}"))
            .join(format!("{shard}.safetensors")))
    }

    /// A shard the store holds, with its recorded size and checksum (not re-hashed).
    pub fn find(&self, run: &str, step: u64, shard: &str) -> Result<ShardFile> {
        let path = self.path(run, step, shard)?;
        let missing = || RuntimeError::Shard {
            shard: shard.to_string(),
            reason: format!("this node holds no shard of step {step} by that name"),
        };
        let bytes = std::fs::metadata(&path).map_err(|_| missing())?.len();
        let sha256 = std::fs::read_to_string(path.with_extension("sha256"))
            .map_err(|_| missing())?
            .trim()
            .to_string();
        Ok(ShardFile {
            path,
            bytes,
            sha256,
        })
    }

    /// Records a complete shard file (already in place at its path) with its checksum.
    pub fn commit(&self, path: &Path, sha256: &str) -> Result<ShardFile> {
        let side = path.with_extension("sha256");
        std::fs::write(&side, sha256).map_err(io_err(format!("writing {}", side.display())))?;
        let bytes = std::fs::metadata(path)
            .map_err(io_err(format!("reading {}", path.display())))?
            .len();
        Ok(ShardFile {
            path: path.to_path_buf(),
            bytes,
            sha256: sha256.to_string(),
        })
    }

    /// Makes the directory shard files of `run` at `step` go into.
    pub fn prepare(&self, run: &str, step: u64, shard: &str) -> Result<PathBuf> {
        let path = self.path(run, step, shard)?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        }
        Ok(path)
    }

    /// Removes the shards of `run` at every step not in `keep` (and every other run's: a node
    /// trains one run at a time), but never a step newer than the newest in `keep`, and nothing
    /// when an earlier prune of the run kept a newer step (this one is stale).
    pub fn retain(&self, run: &str, keep: &[u64]) {
        let newest = keep.iter().copied().max().unwrap_or(0);
        if let Ok(mut kept) = self.newest_kept.lock() {
            match kept.as_ref() {
                Some((r, n)) if r == run && *n > newest => return,
                _ => *kept = Some((run.to_string(), newest)),
            }
        }
        let Ok(runs) = std::fs::read_dir(&self.root) else {
            return;
        };
        for r in runs.flatten() {
            let path = r.path();
            if r.file_name().to_string_lossy() != run {
                if path.is_dir() {
                    let _ = std::fs::remove_dir_all(&path);
                }
                continue;
            }
            let Ok(steps) = std::fs::read_dir(&path) else {
                continue;
            };
            for s in steps.flatten() {
                let name = s.file_name().to_string_lossy().to_string();
                let step = name
                    .strip_prefix("step-")
                    .and_then(|n| n.parse::<u64>().ok());
                if step.is_none_or(|n| n < newest && !keep.contains(&n)) {
                    let _ = std::fs::remove_dir_all(s.path());
                }
            }
        }
    }
}

/// A stage's parameters and optimizer moments copied in memory at a step boundary, so that the
/// shard is written while training goes on.
pub struct StageCopy {
    params: Vec<fusion_graph::ParamSpec>,
    values: Vec<Vec<f32>>,
    first: Vec<Vec<f32>>,
    second: Vec<Vec<f32>>,
    optimizer: fusion_train::OptimizerConfig,
}

impl StageCopy {
    /// Copies the stage's state as it is now.
    pub fn capture<B: Backend>(w: &StageWorker<B>) -> StageCopy {
        StageCopy {
            params: w.graph().params.clone(),
            values: w.params.clone(),
            first: w.opt.first.clone(),
            second: w.opt.second.clone(),
            optimizer: w.optimizer().clone(),
        }
    }

    /// Writes the copy as shard `shard` of `step` of `run`.
    pub fn save(&self, store: &ShardStore, run: &str, step: u64, shard: &str) -> Result<ShardFile> {
        let path = store.prepare(run, step, shard)?;
        let state = ShardState {
            params: &self.params,
            values: &self.values,
            first: &self.first,
            second: &self.second,
        };
        let (_, sha256) = write_shard(&path, &state, &self.optimizer)?;
        store.commit(&path, &sha256)
    }
}

/// Fills the stage's parameters and moments from `shards` (name and checksum) of `step` of
/// `run`, by tensor name; returns, per local parameter, which of value, first and second moment
/// were filled.
pub fn load_stage<B: Backend>(
    store: &ShardStore,
    w: &mut StageWorker<B>,
    run: &str,
    step: u64,
    shards: &[(String, String)],
) -> Result<Vec<[bool; 3]>> {
    let mut files = Vec::with_capacity(shards.len());
    for (shard, sha256) in shards {
        let file = store.find(run, step, shard)?;
        files.push((shard.as_str(), open_verified(shard, &file, sha256)?));
    }
    let names: Vec<String> = w.graph().params.iter().map(|p| p.name.clone()).collect();
    let mut filled = vec![[false; 3]; names.len()];
    for (i, name) in names.iter().enumerate() {
        let targets = [
            ("param", &mut w.params[i]),
            ("opt.first", &mut w.opt.first[i]),
            ("opt.second", &mut w.opt.second[i]),
        ];
        for (k, (prefix, target)) in targets.into_iter().enumerate() {
            let tensor = format!("{prefix}.{name}");
            let Some((shard, file, t)) = files
                .iter()
                .find_map(|(s, f)| f.find(&tensor).map(|t| (*s, f, t)))
            else {
                continue;
            };
            let numel = file.entries()[t].numel;
            if numel != target.len() {
                return Err(RuntimeError::Shard {
                    shard: shard.to_string(),
                    reason: format!(
                        "tensor '{tensor}' has {numel} elements where the stage holds {}",
                        target.len()
                    ),
                });
            }
            *target = file.read(t)?;
            if let Some(j) = target.iter().position(|x| !x.is_finite()) {
                return Err(RuntimeError::Shard {
                    shard: shard.to_string(),
                    reason: format!("tensor '{tensor}' holds {} at element {j}", target[j]),
                });
            }
            filled[i][k] = true;
        }
    }
    Ok(filled)
}

/// Checks a shard file against its checksum and opens it.
pub fn open_verified(shard: &str, file: &ShardFile, sha256: &str) -> Result<TensorFile> {
    let actual = fusion_train::sha256_file(&file.path)?;
    if actual != sha256 {
        return Err(RuntimeError::Shard {
            shard: shard.to_string(),
            reason: format!(
                "{} is corrupt: its checksum is {actual}, the snapshot's {sha256}",
                file.path.display()
            ),
        });
    }
    Ok(TensorFile::open(&file.path)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_keeps_only_the_steps_it_is_told_to_keep() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = ShardStore::open(Some(dir.path())).expect("store");
        for step in [3, 6, 9] {
            let p = store.prepare("run1", step, "s0").expect("prepare");
            std::fs::write(&p, b"x").expect("write");
            store.commit(&p, "abc").expect("commit");
        }
        let other = store.prepare("run0", 1, "s0").expect("prepare");
        std::fs::write(other, b"x").expect("write");
        store.retain("run1", &[6, 9]);
        assert!(store.find("run1", 3, "s0").is_err());
        assert_eq!(store.find("run1", 9, "s0").expect("kept").sha256, "abc");
        assert!(!dir.path().join("run0").exists());
        // A late prune of an older snapshot (keeping 3 and 6) removes nothing, and no prune
        // removes a step newer than those it keeps.
        let p = store.prepare("run1", 12, "s0").expect("prepare");
        std::fs::write(&p, b"x").expect("write");
        store.commit(&p, "def").expect("commit");
        store.retain("run1", &[6]);
        assert!(store.find("run1", 9, "s0").is_ok());
        store.retain("run1", &[12]);
        assert!(store.find("run1", 6, "s0").is_err());
        assert!(store.find("run1", 12, "s0").is_ok());
        assert!(store.path("../x", 1, "s0").is_err());
        assert!(store.path("run1", 1, "a/b").is_err());
    }
}
