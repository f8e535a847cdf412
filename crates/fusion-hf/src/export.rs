//! Writes a model as a Hugging Face directory: `config.json` and one `model.safetensors` of
//! `f32` tensors under `transformers`' names and layouts, which `from_pretrained` loads as is.
//! Tensors are written one at a time; the files appear under their names only when complete.

use crate::config::{config_json, NO_HF_FORM};
use crate::error::{io_err, HfError, Result};
use crate::import::family;
use crate::names::{hf_place, hf_shape, transpose, Family, Layout};
use crate::reader::SINGLE;
use fusion_graph::Graph;
use fusion_models::ModelSpec;
use fusion_train::{TensorFile, WeightSource};
use std::collections::HashMap;
use std::path::Path;

/// Writes `spec` (whose graph is `graph`) with the weights of `source` into `dir`, creating it:
/// `config.json`, then the tensors under a temporary name, renamed into place when complete (a
/// failed export leaves no partial file behind).
pub fn export_hf(
    dir: &Path,
    spec: &ModelSpec,
    graph: &Graph,
    source: &dyn WeightSource,
) -> Result<()> {
    let family = family(spec).ok_or_else(|| HfError::Export {
        model: spec.name.clone(),
        reason: NO_HF_FORM.into(),
    })?;
    let json = serde_json::to_vec_pretty(&config_json(spec)?).map_err(|e| HfError::Export {
        model: spec.name.clone(),
        reason: e.to_string(),
    })?;
    source.check(graph)?;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, json).map_err(io_err(&config_path))?;
    let partial = dir.join(format!(".{SINGLE}.partial-{}", std::process::id()));
    if let Err(e) = write_tensors(&partial, family, graph, source) {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    let target = dir.join(SINGLE);
    std::fs::rename(&partial, &target).map_err(io_err(&target))
}

/// Every parameter of `graph` under its Hugging Face name and layout, into a new file `path`.
fn write_tensors(
    path: &Path,
    family: Family,
    graph: &Graph,
    source: &dyn WeightSource,
) -> Result<()> {
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
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let file = TensorFile::create_with_metadata(path, &specs, Some(metadata))?;
    for (p, place) in graph.params.iter().zip(&places) {
        let values = fusion_train::load_weight(source, p)?;
        let values = match (place.layout, &p.shape[..]) {
            (Layout::Transposed, [rows, cols]) => transpose(&values, *rows, *cols),
            _ => values,
        };
        // Every name was in `specs`: the file has a place for each.
        if let Some(t) = file.find(&place.name) {
            file.write(t, 0, &values)?;
        }
    }
    file.sync()?;
    Ok(())
}
