//! A job file (`fusionllm broker --job job.toml`): the model, the data, the training settings,
//! how many nodes, the pipeline schedule, an optional plan and an optional testbed.
//!
//! ```toml
//! model = "gpt2-tiny"
//! # init_from = "gpt2-hf/"    # start from a Hugging Face model directory (gives the model)
//! data = "synthetic"          # synthetic | synthetic-images | a text file | an IDX directory
//! nodes = 4
//! precision = "f32"         # or bf16, f16: what every node computes in
//! replicas = 1              # data-parallel copies of every stage (nodes = stages x replicas)
//! schedule = "1f1b"           # or "gpipe"
//! testbed = "testbeds/default.toml"
//! # cuts = [40, 80, 120]      # first operator of stages 2..n (default: an even split)
//! [train]
//! steps = 200
//! micro_batches = 4
//! ```

use crate::error::{Result, RuntimeError};
use fusion_data::{Dataset, IdxImages, MarkovCorpus, SyntheticImages, TextCorpus, Tokenizer};
use fusion_exec::Schedule;
use fusion_testbed::Testbed;
use fusion_train::TrainConfig;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobFile {
    pub model: Option<String>,
    /// Initial weights: a Hugging Face model directory (which also gives the model) or a
    /// fusionllm checkpoint. Ignored when the broker resumes.
    pub init_from: Option<PathBuf>,
    #[serde(default = "synthetic")]
    pub data: String,
    #[serde(default = "gpt2")]
    pub tokenizer: String,
    pub nodes: usize,
    /// Data-parallel replicas of every stage (nodes = stages x replicas).
    #[serde(default = "one")]
    pub replicas: usize,
    #[serde(default = "one_f_one_b")]
    pub schedule: String,
    pub cuts: Option<Vec<usize>>,
    /// Who places stages when `cuts` is absent: opfence (default), even, compute or dtfm.
    #[serde(default = "opfence")]
    pub scheduler: String,
    pub testbed: Option<PathBuf>,
    /// Probe the links between nodes at join (and re-probe while training).
    #[serde(default = "yes")]
    pub probe_links: bool,
    /// Re-probe the links the placement uses every this many steps (0: only at join).
    #[serde(default = "hundred")]
    pub probe_every: u64,
    /// Compression of activations and gradients (`[compression]`: forward, backward, floor, ...).
    #[serde(default)]
    pub compression: fusion_compress::CompressionConfig,
    /// What every node computes in: f32 (default), bf16 or f16 (the nodes' `--precision`).
    #[serde(default = "f32_name")]
    pub precision: String,
    #[serde(default)]
    pub train: TrainConfig,
    /// Whether `[train.schedule]` set `lr` and `min_lr` (otherwise the default policy does).
    #[serde(skip)]
    lr_given: (bool, bool),
    /// Whether `[train]` set `batch_size` and `seq_len` (otherwise a graph file's apply).
    #[serde(skip)]
    shape_given: (bool, bool),
}

fn f32_name() -> String {
    "f32".into()
}

fn yes() -> bool {
    true
}

fn hundred() -> u64 {
    100
}

impl JobFile {
    /// The precision the job's nodes compute in.
    pub fn precision(&self) -> Result<fusion_backend::Precision> {
        self.precision
            .parse()
            .map_err(|e| RuntimeError::Config(format!("precision: {e}")))
    }

    /// The link-probing settings the job asks for.
    pub fn probe(&self) -> crate::LinkProbe {
        crate::LinkProbe {
            enabled: self.probe_links,
            every_steps: self.probe_every,
            ..Default::default()
        }
    }
}

fn opfence() -> String {
    "opfence".into()
}

/// The broker's scheduler by name; the exact search cannot place a fixed set of nodes.
pub fn parse_scheduler(s: &str) -> Result<fusion_plan::Scheduler> {
    let k = fusion_plan::Scheduler::parse(s).map_err(|e| RuntimeError::Config(e.to_string()))?;
    if k == fusion_plan::Scheduler::Optimal {
        return Err(RuntimeError::Config(
            "the optimal scheduler plans free stage counts offline (fusionllm plan); a job places a fixed set of nodes: use opfence, even, compute or dtfm".into(),
        ));
    }
    Ok(k)
}

fn synthetic() -> String {
    "synthetic".into()
}
fn gpt2() -> String {
    "gpt2".into()
}
fn one() -> usize {
    1
}
fn one_f_one_b() -> String {
    "1f1b".into()
}

pub fn parse_schedule(s: &str) -> Result<Schedule> {
    match s.to_ascii_lowercase().as_str() {
        "gpipe" => Ok(Schedule::GPipe),
        "1f1b" | "one-f-one-b" => Ok(Schedule::OneFOneB),
        other => Err(RuntimeError::Config(format!(
            "unknown pipeline schedule '{other}' (use gpipe or 1f1b)"
        ))),
    }
}

/// Opens a dataset by name: the Markov corpus, synthetic images, a text file or an IDX directory.
pub fn open_dataset(spec: &str, tokenizer: &str, seed: u64) -> Result<Arc<dyn Dataset>> {
    Ok(match spec {
        "synthetic" => Arc::new(MarkovCorpus::default_corpus(seed)?),
        "synthetic-images" => Arc::new(SyntheticImages::new(28, 10, 0.8, seed)),
        path => {
            let p = PathBuf::from(path);
            if p.is_dir() {
                Arc::new(IdxImages::from_dir(&p, seed)?)
            } else if p.is_file() {
                Arc::new(TextCorpus::from_file(
                    &p,
                    Tokenizer::parse(tokenizer)?,
                    seed,
                )?)
            } else {
                return Err(RuntimeError::Config(format!(
                    "data '{path}': no such file or directory (use 'synthetic', 'synthetic-images', a text file or an IDX directory)"
                )));
            }
        }
    })
}

impl JobFile {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            RuntimeError::Config(format!("cannot read job file {}: {e}", path.display()))
        })?;
        // Relative paths in a job file are relative to the file.
        let base = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, base)
            .map_err(|e| RuntimeError::Config(format!("job file {}: {e}", path.display())))
    }

    /// Parses and checks a job file's text; relative paths in it are taken from `base`.
    pub fn parse(text: &str, base: &Path) -> Result<Self> {
        let mut job: JobFile =
            toml::from_str(text).map_err(|e| RuntimeError::Config(e.to_string()))?;
        for path in [&mut job.testbed, &mut job.init_from].into_iter().flatten() {
            if path.is_relative() {
                *path = base.join(&*path);
            }
        }
        // A model file named relative to the job file.
        if let Some(m) = &job.model {
            if fusion_models::is_model_file(m) && Path::new(m).is_relative() {
                job.model = Some(base.join(m).display().to_string());
            }
        }
        if job.nodes == 0 || job.replicas == 0 || !job.nodes.is_multiple_of(job.replicas) {
            return Err(RuntimeError::Config(format!(
                "nodes = {} must be a positive multiple of replicas = {}",
                job.nodes, job.replicas
            )));
        }
        parse_schedule(&job.schedule)?;
        job.train.validate()?;
        let raw: toml::Table =
            toml::from_str(text).map_err(|e| RuntimeError::Config(e.to_string()))?;
        let given = |key: &str| {
            raw.get("train")
                .and_then(|t| t.get("schedule"))
                .and_then(|s| s.get(key))
                .is_some()
        };
        job.lr_given = (given("lr"), given("min_lr"));
        let train_has = |key: &str| raw.get("train").and_then(|t| t.get(key)).is_some();
        job.shape_given = (train_has("batch_size"), train_has("seq_len"));
        Ok(job)
    }

    /// The training settings for `model`: the file's, with the learning rates it leaves out
    /// taken from the same policy as `fusionllm train` (peak by model size, final a tenth of it).
    pub fn train_for(&self, model: &fusion_models::ModelSpec) -> TrainConfig {
        let mut t = self.train.clone();
        if !self.lr_given.0 {
            t.schedule.lr = fusion_train::default_peak_lr(model.parameters());
        }
        if !self.lr_given.1 {
            t.schedule.min_lr = t.schedule.lr / 10.0;
        }
        // A graph file trains at the micro-batch and sequence length it was built for.
        if let Some((batch, seq)) = model.fixed_shape() {
            if !self.shape_given.0 {
                t.batch_size = batch;
            }
            if !self.shape_given.1 {
                t.seq_len = seq;
            }
        }
        t
    }

    pub fn testbed(&self) -> Result<Option<Testbed>> {
        self.testbed
            .as_ref()
            .map(|p| Testbed::from_file(p).map_err(|e| RuntimeError::Config(e.to_string())))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_job_file_parses_with_its_testbed() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../jobs/two-sites.toml");
        let job = JobFile::from_file(&p).expect("parses");
        assert_eq!(
            (job.nodes, job.replicas, job.train.micro_batches),
            (4, 1, 4)
        );
        let tb = job.testbed().expect("testbed").expect("present");
        assert_eq!(tb.devices.len(), 4);
    }

    #[test]
    fn the_shipped_islands_job_file_parses() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../jobs/two-sites-islands.toml");
        let job = JobFile::from_file(&p).expect("parses");
        assert_eq!((job.nodes, job.replicas), (4, 2));
        let outer = job.train.outer.clone().expect("an outer section");
        assert_eq!(
            (outer.every, outer.lr, outer.momentum, outer.codec),
            (25, 1.0, 0.0, fusion_compress::Codec::Int8 { block: 256 })
        );
        job.train.validate().expect("valid");
    }

    #[test]
    fn job_files_parse_and_bad_ones_say_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("job.toml");
        std::fs::write(
            &p,
            "model = \"gpt2-tiny\"\nnodes = 2\nschedule = \"gpipe\"\n[train]\nsteps = 5\n",
        )
        .expect("write");
        let job = JobFile::from_file(&p).expect("parses");
        assert_eq!(
            (job.nodes, job.train.steps, job.train.batch_size),
            (2, 5, 16)
        );
        // Learning rates left out follow `fusionllm train`'s policy; given ones are kept.
        let tiny = fusion_models::ModelSpec::preset("gpt2-tiny").expect("preset");
        let small = fusion_models::ModelSpec::preset("gpt2-small").expect("preset");
        let t = job.train_for(&tiny);
        assert_eq!((t.schedule.lr, t.schedule.min_lr), (1e-2, 1e-2 / 10.0));
        assert_eq!(job.train_for(&small).schedule.lr, 6e-4);
        std::fs::write(
            &p,
            "nodes = 2\n[train]\nsteps = 5\n[train.schedule]\nlr = 3e-4\n",
        )
        .expect("write");
        let t = JobFile::from_file(&p).expect("parses").train_for(&tiny);
        assert_eq!((t.schedule.lr, t.schedule.min_lr), (3e-4, 3e-4 / 10.0));
        std::fs::write(&p, "nodes = 2\nschedule = \"zigzag\"\n").expect("write");
        let err = JobFile::from_file(&p).expect_err("bad schedule");
        assert!(err.to_string().contains("zigzag"), "{err}");
        std::fs::write(&p, "nodes = 2\nbogus = 1\n").expect("write");
        let err = JobFile::from_file(&p).expect_err("unknown key");
        assert!(err.to_string().contains("bogus"), "{err}");
    }

    #[test]
    fn a_model_file_is_found_beside_the_job_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let job = JobFile::parse("model = \"models/arch.toml\"\nnodes = 2\n", dir.path())
            .expect("parses");
        assert_eq!(
            job.model.as_deref(),
            Some(dir.path().join("models/arch.toml").to_str().expect("path"))
        );
        let job = JobFile::parse("model = \"gpt2-tiny\"\nnodes = 2\n", dir.path()).expect("parses");
        assert_eq!(job.model.as_deref(), Some("gpt2-tiny"));
        // A graph file's micro-batch and sequence length are the job's unless [train] says.
        let graph = fusion_models::ModelSpec::preset("gpt2-tiny")
            .and_then(|m| m.graph(3, 24))
            .and_then(fusion_models::ModelSpec::from_graph)
            .expect("graph model");
        let t = JobFile::parse("nodes = 2\n", dir.path())
            .expect("parses")
            .train_for(&graph);
        assert_eq!((t.batch_size, t.seq_len), (3, 24));
        let t = JobFile::parse("nodes = 2\n[train]\nbatch_size = 5\n", dir.path())
            .expect("parses")
            .train_for(&graph);
        assert_eq!((t.batch_size, t.seq_len), (5, 24));
    }
}
