//! IDX files (MNIST, Fashion-MNIST), gzipped or not.

use crate::seed::rng_for;
use crate::{Batch, DataError, DataKind, Dataset, Result, Split};
use rand::seq::SliceRandom;
use std::io::Read;
use std::path::Path;
use std::sync::Mutex;

fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let p = path.display().to_string();
    let raw = std::fs::read(path).map_err(|source| DataError::Io {
        path: p.clone(),
        source,
    })?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| DataError::Format {
                path: p,
                message: format!("bad gzip data: {e}"),
            })?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Parses an IDX file of unsigned bytes: returns (dims, data).
fn parse_idx(path: &Path, expected_rank: usize) -> Result<(Vec<usize>, Vec<u8>)> {
    let p = path.display().to_string();
    let bytes = read_maybe_gz(path)?;
    let bad = |message: String| DataError::Format {
        path: p.clone(),
        message,
    };
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err(bad("not an IDX file (bad magic number)".into()));
    }
    if bytes[2] != 0x08 {
        return Err(bad(format!(
            "IDX element type 0x{:02x} is not unsigned byte",
            bytes[2]
        )));
    }
    let rank = bytes[3] as usize;
    if rank != expected_rank {
        return Err(bad(format!(
            "IDX file has {rank} dimensions, expected {expected_rank}"
        )));
    }
    let header = 4 + 4 * rank;
    if bytes.len() < header {
        return Err(bad("truncated IDX header".into()));
    }
    let dims: Vec<usize> = (0..rank)
        .map(|i| {
            u32::from_be_bytes([
                bytes[4 + 4 * i],
                bytes[5 + 4 * i],
                bytes[6 + 4 * i],
                bytes[7 + 4 * i],
            ]) as usize
        })
        .collect();
    let n: usize = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad("IDX dimensions overflow".into()))?;
    if bytes.len() - header != n {
        return Err(bad(format!(
            "IDX payload has {} bytes, dimensions {dims:?} need {n}",
            bytes.len() - header
        )));
    }
    Ok((dims, bytes[header..].to_vec()))
}

struct ImageSet {
    pixels: Vec<u8>,
    labels: Vec<u8>,
}

fn load_set(images: &Path, labels: &Path) -> Result<(ImageSet, usize)> {
    let (idims, pixels) = parse_idx(images, 3)?;
    let (ldims, labels_data) = parse_idx(labels, 1)?;
    if idims[0] != ldims[0] {
        return Err(DataError::Format {
            path: labels.display().to_string(),
            message: format!("{} labels for {} images", ldims[0], idims[0]),
        });
    }
    if idims[1] != idims[2] {
        return Err(DataError::Format {
            path: images.display().to_string(),
            message: format!("images are {}x{}, expected square", idims[1], idims[2]),
        });
    }
    Ok((
        ImageSet {
            pixels,
            labels: labels_data,
        },
        idims[1],
    ))
}

/// An IDX image classification dataset with a train and a test set.
pub struct IdxImages {
    name: String,
    train: ImageSet,
    test: ImageSet,
    size: usize,
    classes: usize,
    seed: u64,
    mean: f32,
    std: f32,
    /// The shuffled order of the current training epoch: (epoch, permutation).
    order: Mutex<Option<(u64, Vec<u32>)>>,
}

impl IdxImages {
    /// Loads `{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]` from `dir`.
    pub fn from_dir(dir: &Path, seed: u64) -> Result<Self> {
        let find = |stem: &str| -> Result<std::path::PathBuf> {
            for name in [format!("{stem}.gz"), stem.to_string()] {
                let p = dir.join(&name);
                if p.exists() {
                    return Ok(p);
                }
            }
            Err(DataError::Invalid(format!(
                "{}: no {stem}[.gz] (expected an MNIST-style IDX directory)",
                dir.display()
            )))
        };
        let (train, size) = load_set(
            &find("train-images-idx3-ubyte")?,
            &find("train-labels-idx1-ubyte")?,
        )?;
        let (test, tsize) = load_set(
            &find("t10k-images-idx3-ubyte")?,
            &find("t10k-labels-idx1-ubyte")?,
        )?;
        if size != tsize {
            return Err(DataError::Invalid(format!(
                "train images are {size}px, test images {tsize}px"
            )));
        }
        let classes = train
            .labels
            .iter()
            .chain(&test.labels)
            .copied()
            .max()
            .map(|m| m as usize + 1)
            .unwrap_or(0);
        if train.labels.is_empty() || test.labels.is_empty() || classes < 2 {
            return Err(DataError::Invalid(format!(
                "{}: needs non-empty train and test sets with 2+ classes",
                dir.display()
            )));
        }
        let n = train.pixels.len() as f64;
        let mean = train.pixels.iter().map(|&p| p as f64).sum::<f64>() / n / 255.0;
        let var = train
            .pixels
            .iter()
            .map(|&p| (p as f64 / 255.0 - mean).powi(2))
            .sum::<f64>()
            / n;
        Ok(IdxImages {
            name: dir.display().to_string(),
            train,
            test,
            size,
            classes,
            seed,
            mean: mean as f32,
            std: var.sqrt().max(1e-6) as f32,
            order: Mutex::new(None),
        })
    }

    fn train_index(&self, k: u64) -> usize {
        let n = self.train.labels.len() as u64;
        let epoch = k / n;
        let mut guard = self.order.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().map(|(e, _)| *e) != Some(epoch) {
            let mut perm: Vec<u32> = (0..n as u32).collect();
            perm.shuffle(&mut rng_for(self.seed, 3, epoch));
            *guard = Some((epoch, perm));
        }
        guard
            .as_ref()
            .map(|(_, p)| p[(k % n) as usize] as usize)
            .unwrap_or(0)
    }
}

impl Dataset for IdxImages {
    fn describe(&self) -> String {
        format!(
            "{} ({} train / {} test images, {}x{}, {} classes)",
            self.name,
            self.train.labels.len(),
            self.test.labels.len(),
            self.size,
            self.size,
            self.classes
        )
    }

    fn kind(&self) -> DataKind {
        DataKind::Images {
            channels: 1,
            size: self.size,
            classes: self.classes,
        }
    }

    fn batch(&self, split: Split, index: u64, batch: usize, _seq: usize) -> Result<Batch> {
        let px = self.size * self.size;
        let mut pixels = Vec::with_capacity(batch * px);
        let mut labels = Vec::with_capacity(batch);
        for i in 0..batch as u64 {
            let k = index * batch as u64 + i;
            let (set, j) = match split {
                Split::Train => (&self.train, self.train_index(k)),
                Split::Eval => (&self.test, (k % self.test.labels.len() as u64) as usize),
            };
            pixels.extend(
                set.pixels[j * px..(j + 1) * px]
                    .iter()
                    .map(|&p| (p as f32 / 255.0 - self.mean) / self.std),
            );
            labels.push(set.labels[j] as u32);
        }
        Ok(Batch::Images {
            pixels,
            labels,
            batch,
            channels: 1,
            size: self.size,
        })
    }

    fn eval_batches(&self, batch: usize) -> usize {
        self.test.labels.len() / batch.max(1)
    }
}
