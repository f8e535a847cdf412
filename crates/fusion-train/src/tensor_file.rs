//! A safetensors file of `f32` tensors read and written in pieces at known offsets, so training
//! state larger than memory streams through it: a checkpoint is written tensor by tensor, hashed
//! in fixed-size blocks, and a broker keeps its copy of the state on disk instead of in memory.
//!
//! The layout is the one `safetensors::serialize` produces for the same tensors (sorted by name,
//! contiguous, the header padded with spaces to 8 bytes), so a file written here is byte-identical
//! to one serialised in memory and any safetensors reader opens it.

use crate::error::{io_err, Result, TrainError};
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Largest header accepted when opening a file (the safetensors crate's own limit).
const MAX_HEADER: u64 = 100_000_000;
/// Bytes read at a time when hashing or copying.
const BLOCK: usize = 8 << 20;

/// Reads the header of the safetensors file `file` (at `path`): where the data section starts,
/// the file's length, and the header itself. The header must fit the file and the size limit;
/// the tensors' offsets are for the caller to check.
pub fn read_header(file: &File, path: &Path) -> Result<(u64, u64, Metadata)> {
    let bad = |message: String| TrainError::Checkpoint {
        path: path.display().to_string(),
        message,
    };
    let len = file.metadata().map_err(io_err(path))?.len();
    let mut n = [0u8; 8];
    file.read_exact_at(&mut n, 0)
        .map_err(|_| bad(format!("{len} bytes is too short for a safetensors header")))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > len {
        return Err(bad(format!(
            "a header of {n} bytes does not fit the file of {len} (truncated or not safetensors)"
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact_at(&mut header, 8).map_err(io_err(path))?;
    let meta: Metadata = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("invalid safetensors header: {e}")))?;
    Ok((8 + n, len, meta))
}

/// One tensor's place in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorEntry {
    pub name: String,
    pub shape: Vec<usize>,
    /// Byte offset from the start of the data section.
    start: u64,
    pub numel: usize,
}

/// An open tensor file.
#[derive(Debug)]
pub struct TensorFile {
    file: File,
    path: PathBuf,
    data_start: u64,
    entries: Vec<TensorEntry>,
    index: HashMap<String, usize>,
}

impl TensorFile {
    /// Creates `path` (a new file in place of any old one) for the tensors `specs` (name and shape), every element 0.
    pub fn create(path: &Path, specs: &[(String, Vec<usize>)]) -> Result<TensorFile> {
        Self::create_with_metadata(path, specs, None)
    }

    /// [`TensorFile::create`] with the header's free-form `__metadata__` (other frameworks read
    /// it: `transformers` wants `format: pt`).
    pub fn create_with_metadata(
        path: &Path,
        specs: &[(String, Vec<usize>)],
        metadata: Option<HashMap<String, String>>,
    ) -> Result<TensorFile> {
        let bad = |message: String| TrainError::Checkpoint {
            path: path.display().to_string(),
            message,
        };
        let mut sorted: Vec<&(String, Vec<usize>)> = specs.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        let mut infos = Vec::with_capacity(sorted.len());
        let mut entries = Vec::with_capacity(sorted.len());
        let mut offset = 0usize;
        for (name, shape) in sorted {
            let numel = shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad(format!("tensor '{name}' has too many elements")))?;
            let info = TensorInfo {
                dtype: Dtype::F32,
                shape: shape.clone(),
                data_offsets: (offset, offset + numel * 4),
            };
            entries.push(TensorEntry {
                name: name.clone(),
                shape: shape.clone(),
                start: offset as u64,
                numel,
            });
            infos.push((name.clone(), info));
            offset += numel * 4;
        }
        let meta = Metadata::new(metadata, infos).map_err(|e| bad(e.to_string()))?;
        let mut header = serde_json::to_vec(&meta).map_err(|e| bad(e.to_string()))?;
        header.resize(header.len().next_multiple_of(8), b' ');
        // A new inode, never a truncated one: an old file at `path` may share its bytes with a
        // checkpoint through a hard link.
        let _ = std::fs::remove_file(path);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(io_err(path))?;
        let data_start = 8 + header.len() as u64;
        file.write_all_at(&(header.len() as u64).to_le_bytes(), 0)
            .and_then(|()| file.write_all_at(&header, 8))
            .and_then(|()| file.set_len(data_start + offset as u64))
            .map_err(io_err(path))?;
        Ok(Self::from_parts(file, path, data_start, entries))
    }

    /// Opens an existing file, checking its header: every tensor `f32`, laid out contiguously,
    /// and the file exactly as long as the header says.
    pub fn open(path: &Path) -> Result<TensorFile> {
        let bad = |message: String| TrainError::Checkpoint {
            path: path.display().to_string(),
            message,
        };
        let file = File::open(path).map_err(io_err(path))?;
        let (data_start, len, meta) = read_header(&file, path)?;
        let mut entries = Vec::new();
        for name in meta.offset_keys() {
            let Some(info) = meta.info(&name) else {
                continue;
            };
            if info.dtype != Dtype::F32 {
                return Err(bad(format!("tensor '{name}' is {:?}, not F32", info.dtype)));
            }
            let (s, e) = info.data_offsets;
            entries.push(TensorEntry {
                name,
                shape: info.shape.clone(),
                start: s as u64,
                numel: (e - s) / 4,
            });
        }
        if data_start + meta.data_len() as u64 != len {
            return Err(bad(format!(
                "the header describes {} bytes of tensors but the file holds {}",
                meta.data_len(),
                len - data_start
            )));
        }
        Ok(Self::from_parts(file, path, data_start, entries))
    }

    fn from_parts(file: File, path: &Path, data_start: u64, entries: Vec<TensorEntry>) -> Self {
        let index = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        TensorFile {
            file,
            path: path.to_path_buf(),
            data_start,
            entries,
            index,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn entries(&self) -> &[TensorEntry] {
        &self.entries
    }

    /// The index of tensor `name`.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// Where `n_bytes` bytes at element `offset` of tensor `t` lie in the file; an error when
    /// they do not fit the tensor.
    fn span(&self, t: usize, offset: usize, n_bytes: usize) -> Result<u64> {
        let e = self.entries.get(t).ok_or_else(|| TrainError::Checkpoint {
            path: self.path.display().to_string(),
            message: format!("no tensor #{t}"),
        })?;
        let fits = n_bytes.is_multiple_of(4)
            && offset
                .checked_add(n_bytes / 4)
                .is_some_and(|end| end <= e.numel);
        if !fits {
            return Err(TrainError::Checkpoint {
                path: self.path.display().to_string(),
                message: format!(
                    "{n_bytes} bytes at element {offset} do not fit tensor '{}' of {} elements",
                    e.name, e.numel
                ),
            });
        }
        Ok(self.data_start + e.start + offset as u64 * 4)
    }

    /// Writes little-endian `f32` bytes at element `offset` of tensor `t`.
    pub fn write_bytes(&self, t: usize, offset: usize, bytes: &[u8]) -> Result<()> {
        let at = self.span(t, offset, bytes.len())?;
        self.file
            .write_all_at(bytes, at)
            .map_err(io_err(&self.path))
    }

    /// Writes `values` at element `offset` of tensor `t`, converted a block at a time (no byte
    /// copy of a whole large tensor).
    pub fn write(&self, t: usize, offset: usize, values: &[f32]) -> Result<()> {
        self.span(t, offset, values.len() * 4)?;
        let per = BLOCK / 4;
        let mut bytes = Vec::with_capacity(BLOCK.min(values.len() * 4));
        for (i, block) in values.chunks(per).enumerate() {
            bytes.clear();
            bytes.extend(block.iter().flat_map(|v| v.to_le_bytes()));
            self.write_bytes(t, offset + i * per, &bytes)?;
        }
        Ok(())
    }

    /// Reads `n` elements at element `offset` of tensor `t` as little-endian bytes.
    pub fn read_bytes(&self, t: usize, offset: usize, n: usize) -> Result<Vec<u8>> {
        let at = self.span(t, offset, n * 4)?;
        let mut buf = vec![0u8; n * 4];
        self.file
            .read_exact_at(&mut buf, at)
            .map_err(io_err(&self.path))?;
        Ok(buf)
    }

    /// Reads the whole of tensor `t`.
    pub fn read(&self, t: usize) -> Result<Vec<f32>> {
        let n = self.entries.get(t).map_or(0, |e| e.numel);
        let bytes = self.read_bytes(t, 0, n)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Flushes the file to stable storage.
    pub fn sync(&self) -> Result<()> {
        self.file.sync_all().map_err(io_err(&self.path))
    }

    /// SHA-256 of the whole file, read in blocks.
    pub fn sha256(&self) -> Result<String> {
        sha256_file(&self.path)
    }
}

/// SHA-256 of a file, read in blocks (memory stays bounded whatever the file's size).
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; BLOCK];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// Makes `to` a hard link to `from`, or a copy where a link cannot be made (another file system).
/// The source must never be written again: a link shares its bytes.
pub fn link_or_copy(from: &Path, to: &Path) -> Result<()> {
    const EXDEV: i32 = 18;
    match std::fs::hard_link(from, to) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(EXDEV) => {
            std::fs::copy(from, to).map_err(io_err(to))?;
            Ok(())
        }
        Err(e) => Err(io_err(to)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn specs() -> Vec<(String, Vec<usize>)> {
        vec![
            ("b.weight".into(), vec![3, 2]),
            ("a.bias".into(), vec![4]),
            ("c".into(), vec![1]),
        ]
    }

    #[test]
    fn a_file_written_in_pieces_is_what_safetensors_serialises_in_memory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.safetensors");
        let f = TensorFile::create(&path, &specs()).expect("create");
        let values: Vec<Vec<f32>> = vec![
            (0..6).map(|i| i as f32).collect(),
            vec![-1.0, 2.5, 3.0, 4.0],
            vec![7.0],
        ];
        for ((name, _), v) in specs().iter().zip(&values) {
            let t = f.find(name).expect("tensor");
            // In two pieces, the second first.
            let k = v.len() / 2;
            f.write(t, k, &v[k..]).expect("tail");
            f.write(t, 0, &v[..k]).expect("head");
        }
        let bytes: Vec<Vec<u8>> = values
            .iter()
            .map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views = specs()
            .iter()
            .zip(&bytes)
            .map(|((n, s), b)| {
                (
                    n.clone(),
                    TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
                )
            })
            .collect::<Vec<_>>();
        let expected = safetensors::tensor::serialize(views, None).expect("serialize");
        assert_eq!(std::fs::read(&path).expect("read"), expected);
        let back = TensorFile::open(&path).expect("open");
        let t = back.find("a.bias").expect("a.bias");
        assert_eq!(back.read(t).expect("read"), values[1]);
        assert_eq!(back.entries()[t].shape, vec![4]);
        // A piece that overruns its tensor, or is not whole f32s, is refused.
        let misfit = |r: Result<()>| r.is_err_and(|e| e.to_string().contains("do not fit"));
        assert!(misfit(f.write(t, 3, &[1.0, 2.0])));
        assert!(misfit(f.write_bytes(t, 0, &[0u8; 5])));
        assert!(back.read_bytes(t, usize::MAX, 1).is_err());
    }

    #[test]
    fn truncated_or_garbage_files_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.safetensors");
        TensorFile::create(&path, &specs()).expect("create");
        let full = std::fs::read(&path).expect("read");
        std::fs::write(&path, &full[..full.len() - 4]).expect("truncate");
        let e = TensorFile::open(&path).expect_err("truncated").to_string();
        assert!(e.contains("the file holds"), "{e}");
        std::fs::write(&path, u64::MAX.to_le_bytes()).expect("garbage");
        let e = TensorFile::open(&path)
            .expect_err("huge header")
            .to_string();
        assert!(e.contains("does not fit the file"), "{e}");
        let mut junk = 6u64.to_le_bytes().to_vec();
        junk.extend_from_slice(b"{nope}");
        std::fs::write(&path, junk).expect("junk");
        let e = TensorFile::open(&path).expect_err("bad json").to_string();
        assert!(e.contains("invalid safetensors header"), "{e}");
    }
}
