//! The safetensors files of a model directory, one (`model.safetensors`) or sharded
//! (`model.safetensors.index.json` naming a file per tensor), read one tensor at a time at its
//! offset and converted to `f32` from F32, F16, BF16 or F64. Headers are checked before any
//! tensor is read: a tensor that does not fit its file (a truncated download) is named.

use crate::error::{io_err, HfError, Result};
use safetensors::tensor::Dtype;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Largest shard index accepted.
const MAX_INDEX: u64 = 64 << 20;

pub const SINGLE: &str = "model.safetensors";
pub const INDEX: &str = "model.safetensors.index.json";

/// One tensor's place.
#[derive(Clone, Debug)]
pub struct Entry {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    shard: usize,
    /// Absolute byte range in its shard.
    start: u64,
    end: u64,
}

struct Shard {
    path: PathBuf,
    file: File,
}

/// The tensors of a model directory.
pub struct SafetensorsDir {
    shards: Vec<Shard>,
    entries: BTreeMap<String, Entry>,
}

#[derive(serde::Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl SafetensorsDir {
    /// Opens `dir`'s safetensors files and indexes every tensor.
    pub fn open(dir: &Path) -> Result<SafetensorsDir> {
        let single = dir.join(SINGLE);
        let index = dir.join(INDEX);
        let files: Vec<PathBuf> = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            shard_files(dir, &index)?
        } else {
            let other = ["pytorch_model.bin", "model.pt", "tf_model.h5"]
                .iter()
                .find(|f| dir.join(f).exists());
            return Err(HfError::NotAModel {
                path: dir.display().to_string(),
                reason: match other {
                    Some(f) => format!(
                        "it has {f} but no {SINGLE}: fusionllm reads safetensors only (convert \
                         with transformers: model.save_pretrained(dir, safe_serialization=True))"
                    ),
                    None => format!("neither {SINGLE} nor {INDEX}"),
                },
            });
        };
        let mut out = SafetensorsDir {
            shards: Vec::new(),
            entries: BTreeMap::new(),
        };
        for path in files {
            out.add_shard(path)?;
        }
        Ok(out)
    }

    fn add_shard(&mut self, path: PathBuf) -> Result<()> {
        let file = File::open(&path).map_err(io_err(&path))?;
        let shard = self.shards.len();
        for (name, entry) in read_header(&file, &path, shard)? {
            if self.entries.contains_key(&name) {
                return Err(HfError::File {
                    path: path.display().to_string(),
                    message: format!("tensor '{name}' is also in another shard"),
                });
            }
            self.entries.insert(name, entry);
        }
        self.shards.push(Shard { path, file });
        Ok(())
    }

    /// Every tensor's name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn entry(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name)
    }

    /// The file holding tensor `name`.
    pub fn path_of(&self, name: &str) -> Option<&Path> {
        let e = self.entries.get(name)?;
        self.shards.get(e.shard).map(|s| s.path.as_path())
    }

    /// Tensor `name` as `f32` values, checked finite.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let e = self.entries.get(name).ok_or_else(|| HfError::Tensors {
            missing: vec![name.into()],
            unexpected: Vec::new(),
        })?;
        let shard = &self.shards[e.shard];
        let mut bytes = vec![0u8; (e.end - e.start) as usize];
        shard
            .file
            .read_exact_at(&mut bytes, e.start)
            .map_err(io_err(&shard.path))?;
        let values = decode(&bytes, e.dtype).ok_or_else(|| HfError::Dtype {
            name: name.into(),
            path: shard.path.display().to_string(),
            dtype: format!("{:?}", e.dtype),
        })?;
        if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(HfError::NotFinite {
                name: name.into(),
                path: shard.path.display().to_string(),
                index,
                value,
            });
        }
        Ok(values)
    }
}

/// The shard files an index names, each once, sorted.
fn shard_files(dir: &Path, index: &Path) -> Result<Vec<PathBuf>> {
    let bad = |message: String| HfError::File {
        path: index.display().to_string(),
        message,
    };
    let len = std::fs::metadata(index).map_err(io_err(index))?.len();
    if len > MAX_INDEX {
        return Err(bad(format!("{len} bytes is too large for a shard index")));
    }
    let text = std::fs::read(index).map_err(io_err(index))?;
    let parsed: ShardIndex = serde_json::from_slice(&text)
        .map_err(|e| bad(format!("not a safetensors shard index: {e}")))?;
    let mut names: Vec<&String> = parsed.weight_map.values().collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .map(|f| {
            let plain = Path::new(f)
                .file_name()
                .is_some_and(|n| n == std::ffi::OsStr::new(f));
            if plain && !f.starts_with('.') {
                Ok(dir.join(f))
            } else {
                Err(bad(format!(
                    "shard '{f}' is not a file name in the directory"
                )))
            }
        })
        .collect()
}

/// Parses and checks a safetensors header: every tensor's bytes inside the file and as many as
/// its shape and type need.
fn read_header(file: &File, path: &Path, shard: usize) -> Result<Vec<(String, Entry)>> {
    let bad = |message: String| HfError::File {
        path: path.display().to_string(),
        message,
    };
    let (data_start, len, meta) =
        fusion_train::read_safetensors_header(file, path).map_err(|e| match e {
            fusion_train::TrainError::Checkpoint { message, .. } => bad(message),
            fusion_train::TrainError::Io { path, source } => HfError::Io { path, source },
            other => HfError::Train(other),
        })?;
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        let (s, e) = info.data_offsets;
        let need = info
            .shape
            .iter()
            .try_fold(info.dtype.bitsize(), |a, &d| a.checked_mul(d))
            .map(|bits| bits.div_ceil(8));
        if e < s || need != Some(e - s) {
            return Err(bad(format!(
                "tensor '{name}' of {:?} {:?} spans bytes {s}..{e}, not its size",
                info.dtype, info.shape
            )));
        }
        let Some(end) = data_start.checked_add(e as u64).filter(|&end| end <= len) else {
            return Err(bad(format!(
                "tensor '{name}' ends at byte {} but the file has {len} (truncated)",
                data_start.saturating_add(e as u64)
            )));
        };
        let entry = Entry {
            dtype: info.dtype,
            shape: info.shape.clone(),
            shard,
            start: end - (e - s) as u64,
            end,
        };
        out.push((name, entry));
    }
    Ok(out)
}

/// Little-endian tensor bytes of a floating-point type as `f32`; None for other types.
fn decode(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    let two = |f: fn([u8; 2]) -> f32| bytes.chunks_exact(2).map(|c| f([c[0], c[1]])).collect();
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => two(|b| half::f16::from_le_bytes(b).to_f32()),
        Dtype::BF16 => two(|b| half::bf16::from_le_bytes(b).to_f32()),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                f64::from_le_bytes(a) as f32
            })
            .collect(),
        _ => return None,
    })
}
