//! A Hugging Face model directory as a model specification and the weights to start it from.

use crate::config::read_config;
use crate::error::{HfError, Result};
use crate::names::{hf_place, hf_shape, ignorable, transpose, Family, HfPlace, Layout};
use crate::reader::SafetensorsDir;
use fusion_graph::{Graph, ParamSpec};
use fusion_models::{ModelKind, ModelSpec};
use fusion_train::{TrainError, WeightSource};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Whether `dir` looks like a Hugging Face model directory (it has a `config.json`).
pub fn is_hf_dir(dir: &Path) -> bool {
    dir.join("config.json").is_file()
}

/// The naming family of a model.
pub fn family(spec: &ModelSpec) -> Option<Family> {
    match spec.kind {
        ModelKind::Gpt2(_) => Some(Family::Gpt2),
        ModelKind::Llama(_) => Some(Family::Llama),
        _ => None,
    }
}

/// Whether the output head is the token embedding.
pub(crate) fn tied(spec: &ModelSpec) -> bool {
    match &spec.kind {
        ModelKind::Llama(c) => c.tie_embeddings,
        _ => true,
    }
}

/// A published model: its architecture from `config.json` and its tensors.
pub struct HfModel {
    dir: PathBuf,
    spec: ModelSpec,
    family: Family,
    tensors: SafetensorsDir,
}

impl HfModel {
    /// Reads `dir`'s `config.json` and indexes its safetensors files (no tensor is read yet).
    pub fn open(dir: &Path) -> Result<HfModel> {
        let spec = read_config(dir)?;
        let family = family(&spec).ok_or_else(|| HfError::NotAModel {
            path: dir.display().to_string(),
            reason: "config.json describes neither a GPT-2 nor a Llama-family model".into(),
        })?;
        let tensors = SafetensorsDir::open(dir)?;
        Ok(HfModel {
            dir: dir.to_path_buf(),
            spec,
            family,
            tensors,
        })
    }

    /// The model `config.json` describes (its vocabulary fixed to the weights').
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The name under which `place` is stored in these files, if any.
    fn stored_name<'a>(&self, place: &'a HfPlace) -> Option<&'a str> {
        std::iter::once(&place.name)
            .chain(&place.aliases)
            .map(String::as_str)
            .find(|n| self.tensors.entry(n).is_some())
    }

    /// Checks that the files hold every parameter of `graph` in its shape, and nothing else but
    /// known buffers: missing and unexpected tensors are all named at once.
    pub fn check_graph(&self, graph: &Graph) -> Result<()> {
        let mut used = HashSet::new();
        let mut missing = Vec::new();
        for p in &graph.params {
            let place = hf_place(self.family, &p.name);
            let Some(name) = self.stored_name(&place) else {
                missing.push(place.name);
                continue;
            };
            used.insert(name.to_string());
            let expected = hf_shape(&p.shape, place.layout);
            let found = &self.tensors.entry(name).map(|e| e.shape.clone());
            if found.as_ref() != Some(&expected) {
                return Err(HfError::Shape {
                    name: name.into(),
                    found: found.clone().unwrap_or_default(),
                    expected,
                });
            }
        }
        let tied = tied(&self.spec);
        let unexpected: Vec<String> = self
            .tensors
            .names()
            .filter(|n| !used.contains(*n) && !ignorable(self.family, n, tied))
            .map(String::from)
            .collect();
        if missing.is_empty() && unexpected.is_empty() {
            Ok(())
        } else {
            Err(HfError::Tensors {
                missing,
                unexpected,
            })
        }
    }

    /// Parameter `p`'s values in fusionllm's layout.
    pub fn load_param(&self, p: &ParamSpec) -> Result<Vec<f32>> {
        let place = hf_place(self.family, &p.name);
        let name = self.stored_name(&place).ok_or_else(|| HfError::Tensors {
            missing: vec![place.name.clone()],
            unexpected: Vec::new(),
        })?;
        let values = self.tensors.read_f32(name)?;
        if values.len() != p.numel() {
            return Err(HfError::Shape {
                name: name.into(),
                found: self
                    .tensors
                    .entry(name)
                    .map(|e| e.shape.clone())
                    .unwrap_or_default(),
                expected: hf_shape(&p.shape, place.layout),
            });
        }
        Ok(match (place.layout, &p.shape[..]) {
            // Stored [cols, rows]: transposing gives fusionllm's [rows, cols].
            (Layout::Transposed, [rows, cols]) => transpose(&values, *cols, *rows),
            _ => values,
        })
    }
}

impl WeightSource for HfModel {
    fn describe(&self) -> String {
        self.dir.display().to_string()
    }

    fn check(&self, graph: &Graph) -> fusion_train::Result<()> {
        self.check_graph(graph).map_err(|e| self.train_error(e))
    }

    fn load(&self, param: &ParamSpec) -> fusion_train::Result<Vec<f32>> {
        self.load_param(param).map_err(|e| self.train_error(e))
    }
}

impl HfModel {
    fn train_error(&self, e: HfError) -> TrainError {
        TrainError::Weights {
            origin: self.describe(),
            message: e.to_string(),
        }
    }
}
