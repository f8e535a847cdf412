//! Synthetic image classification: each class is a random prototype image; samples are the
//! prototype plus Gaussian noise. Needs no files, and a small CNN learns it quickly.

use crate::seed::{rng_for, split_stream};
use crate::{Batch, DataKind, Dataset, Result, Split};
use rand::Rng;
use rand_distr::{Distribution, Normal};

pub struct SyntheticImages {
    size: usize,
    classes: usize,
    prototypes: Vec<Vec<f32>>,
    noise: f32,
    seed: u64,
}

impl SyntheticImages {
    pub fn new(size: usize, classes: usize, noise: f32, seed: u64) -> Self {
        let mut rng = rng_for(seed, 0, 0);
        let prototypes = (0..classes)
            .map(|_| {
                (0..size * size)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect()
            })
            .collect();
        SyntheticImages {
            size,
            classes,
            prototypes,
            noise,
            seed,
        }
    }
}

impl Dataset for SyntheticImages {
    fn describe(&self) -> String {
        format!(
            "synthetic images ({} classes, {}x{}, noise {})",
            self.classes, self.size, self.size, self.noise
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
        let mut rng = rng_for(self.seed, split_stream(split), index);
        let normal = Normal::new(0.0f32, self.noise.max(0.0))
            .map_err(|e| crate::DataError::Invalid(e.to_string()))?;
        let mut pixels = Vec::with_capacity(batch * self.size * self.size);
        let mut labels = Vec::with_capacity(batch);
        for _ in 0..batch {
            let c = rng.random_range(0..self.classes);
            pixels.extend(
                self.prototypes[c]
                    .iter()
                    .map(|p| p + normal.sample(&mut rng)),
            );
            labels.push(c as u32);
        }
        Ok(Batch::Images {
            pixels,
            labels,
            batch,
            channels: 1,
            size: self.size,
        })
    }

    fn eval_batches(&self, _batch: usize) -> usize {
        4
    }
}
