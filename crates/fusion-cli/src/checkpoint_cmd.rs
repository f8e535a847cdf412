//! `fusionllm checkpoint`: work on checkpoints without training.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum CheckpointAction {
    /// Write the single-file checkpoint of a sharded snapshot (a `sharded/step-N` directory
    /// holding `manifest.json`, or the manifest itself). Each shard is read from beside the
    /// manifest, else from the first recorded copy on this machine whose SHA-256 matches; the
    /// result resumes with `--resume`, exports with `fusionllm export` and samples with
    /// `fusionllm generate`.
    Merge(MergeArgs),
}

#[derive(Args)]
pub struct MergeArgs {
    /// The manifest, or the directory holding it.
    manifest: PathBuf,
    /// The run directory to write the checkpoint into (its `step-N`, `latest` pointing at it).
    #[arg(long)]
    out: PathBuf,
}

pub fn run(action: CheckpointAction) -> Result<()> {
    match action {
        CheckpointAction::Merge(a) => merge(a),
    }
}

fn merge(a: MergeArgs) -> Result<()> {
    let path = fusion_train::merge_shards(&a.manifest, &a.out)
        .with_context(|| format!("merging the shards of {}", a.manifest.display()))?;
    println!("checkpoint written: {}", path.display());
    Ok(())
}
