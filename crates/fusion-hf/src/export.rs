//! Writes a model as a Hugging Face directory: `config.json` and one `model.safetensors` of
//! `f32` tensors under `transformers`' names and layouts, which `from_pretrained` loads as is.
//! Tensors are written one at a time; the files appear under their names only when complete.

use crate::config::config_json;
use crate::error::{io_err, HfError, Result};
use crate::import::family;
use crate::names::{hf_place, hf_shape, transpose, Layout};
use crate::reader::SINGLE;
use fusion_graph::Graph;
use fusion_models::ModelSpec;
use fusion_train::{TensorFile, WeightSource};
use std::collections::HashMap;
use std::path::Path;

/// Writes `spec` (whose graph is `graph`) with the weights of `source` into `dir`, creating it.
pub fn export_hf(
    dir: &Path,
    spec: &ModelSpec,
    graph: &Graph,
    source: &dyn WeightSource,
) -> Result<()> {
    let family = family(spec).ok_or_else(|| HfError::Export {
        model: spec.name.clone(),
        reason: "only GPT-2 and Llama-family models have a Hugging Face form".into(),
    })?;
    let config = config_json(spec)?;
    source.check(graph)?;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let places: Vec<_> = graph
        .params
        .iter()
        .map(|p| hf_place(family, &p.name))
        .collect();
    let specs: Vec<(String, Vec<usize>)> = graph
        .params
        .iter()
        .zip(&places)
        .map(|(p, place)| (place.name.clone(), hf_shape(&p.shape, place.layout)))
        .collect();
    let partial = dir.join(format!(".{SINGLE}.partial-{}", std::process::id()));
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let file = TensorFile::create_with_metadata(&partial, &specs, Some(metadata))?;
    for (p, place) in graph.params.iter().zip(&places) {
        let values = source.load(p)?;
        let values = match (place.layout, &p.shape[..]) {
            (Layout::Transposed, [rows, cols]) => transpose(&values, *rows, *cols),
            _ => values,
        };
        let t = file.find(&place.name).ok_or_else(|| HfError::Export {
            model: spec.name.clone(),
            reason: format!("two parameters map to '{}'", place.name),
        })?;
        file.write(t, 0, &values)?;
    }
    file.sync()?;
    drop(file);
    let target = dir.join(SINGLE);
    std::fs::rename(&partial, &target).map_err(io_err(&target))?;
    let json = serde_json::to_vec_pretty(&config).map_err(|e| HfError::Export {
        model: spec.name.clone(),
        reason: e.to_string(),
    })?;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, json).map_err(io_err(&config_path))?;
    Ok(())
}
