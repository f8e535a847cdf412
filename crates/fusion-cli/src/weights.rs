//! Weights from outside a run: `--init-from` (a Hugging Face model directory, or a fusionllm
//! checkpoint whose parameters start a new run) and `fusionllm export` (a checkpoint, or a
//! Hugging Face directory read back, written as a directory `transformers` loads).

use anyhow::{bail, Context, Result};
use clap::Args;
use fusion_data::Dataset;
use fusion_hf::{is_hf_dir, HfModel};
use fusion_models::ModelSpec;
use fusion_train::{CheckpointWeights, WeightSource};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where initial weights come from, opened (headers read, no tensor yet).
#[derive(Clone)]
pub enum Init {
    Hf(Arc<HfModel>),
    Checkpoint(Arc<CheckpointWeights>),
}

impl Init {
    /// Opens `path`: a directory with `config.json` is a Hugging Face model, anything else a
    /// fusionllm checkpoint (a `step-N` directory or a run directory's `latest`).
    pub fn open(path: &Path) -> Result<Init> {
        if is_hf_dir(path) {
            let m = HfModel::open(path)
                .with_context(|| format!("reading the model in {}", path.display()))?;
            return Ok(Init::Hf(Arc::new(m)));
        }
        let c = CheckpointWeights::open(path).with_context(|| {
            format!(
                "{} is neither a Hugging Face model directory (no config.json) nor a readable \
                 fusionllm checkpoint",
                path.display()
            )
        })?;
        Ok(Init::Checkpoint(Arc::new(c)))
    }

    /// The model the weights belong to, when they say (a Hugging Face config, or a checkpoint
    /// that recorded its model).
    pub fn model(&self) -> Option<ModelSpec> {
        match self {
            Init::Hf(m) => Some(m.spec().clone()),
            Init::Checkpoint(c) => c.model(),
        }
    }

    pub fn source(&self) -> Arc<dyn WeightSource> {
        match self {
            Init::Hf(m) => m.clone(),
            Init::Checkpoint(c) => c.clone(),
        }
    }
}

/// The model a run trains: `--model` when given, else the initial weights' own, else the
/// default for the data. Both `--model` and weights that name their model must agree.
pub fn run_model(
    model: Option<&str>,
    init: Option<&Init>,
    data: &dyn Dataset,
    base: Option<&Path>,
) -> Result<ModelSpec> {
    let own = init.and_then(Init::model);
    match (model, own) {
        (Some(name), Some(own)) => {
            if ModelSpec::resolve(name, base)?.kind != own.kind {
                bail!(
                    "--model {name} is not the model of the initial weights ({}); leave --model \
                     out to train theirs",
                    own.name
                );
            }
            Ok(own)
        }
        (None, Some(own)) => Ok(own),
        (Some(name), None) => Ok(ModelSpec::resolve(name, base)?),
        (None, None) => Ok(ModelSpec::resolve(
            &crate::cluster::default_model(data),
            None,
        )?),
    }
}

#[derive(Args)]
pub struct ExportArgs {
    /// Checkpoint to export: a run directory (its `latest`) or a `step-N` directory.
    #[arg(
        long,
        conflicts_with = "init_from",
        required_unless_present = "init_from"
    )]
    checkpoint: Option<PathBuf>,
    /// A Hugging Face model directory to read and write back (a round trip through fusionllm).
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// The checkpoint's model, for checkpoints that did not record it.
    #[arg(long)]
    model: Option<String>,
    /// Output directory: `config.json` and `model.safetensors` for transformers'
    /// `from_pretrained`.
    #[arg(long)]
    hf: PathBuf,
}

/// `fusionllm export`.
pub fn run_export(a: ExportArgs) -> Result<()> {
    let path = a.checkpoint.as_ref().or(a.init_from.as_ref());
    let Some(path) = path else {
        bail!("name what to export with --checkpoint or --init-from");
    };
    let init = Init::open(path)?;
    let spec = match (init.model(), &a.model) {
        (Some(own), _) => own,
        (None, Some(name)) => ModelSpec::resolve(name, None)?,
        (None, None) => bail!(
            "{} does not record its model (an older checkpoint): name it with --model",
            path.display()
        ),
    };
    let graph = spec.graph(1, 1)?;
    fusion_hf::export_hf(&a.hf, &spec, &graph, init.source().as_ref())
        .with_context(|| format!("exporting {} to {}", path.display(), a.hf.display()))?;
    println!(
        "wrote {} ({}, {} parameters) to {}",
        spec.name,
        match spec.kind {
            fusion_models::ModelKind::Gpt2(_) => "GPT2LMHeadModel",
            _ => "LlamaForCausalLM",
        },
        graph.num_trainable(),
        a.hf.display()
    );
    Ok(())
}
