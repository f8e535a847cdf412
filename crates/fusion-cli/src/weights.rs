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
    pub fn model(&self) -> Result<Option<ModelSpec>> {
        Ok(match self {
            Init::Hf(m) => Some(m.spec().clone()),
            Init::Checkpoint(c) => c.model()?,
        })
    }

    /// The model of these weights: their own (a `--model` given too must be the same
    /// architecture), or `--model` for a checkpoint that did not record its model.
    pub fn model_or(&self, model: Option<&str>, base: Option<&Path>) -> Result<ModelSpec> {
        match (self.model()?, model) {
            (Some(own), Some(name)) => {
                let given = ModelSpec::resolve(name, base)?;
                let given = match own.vocab() {
                    Some(v) => given.with_vocab(v),
                    None => given,
                };
                if given.kind != own.kind {
                    bail!(
                        "--model {name} is not the model of the weights ({}); leave --model out",
                        own.name
                    );
                }
                Ok(own)
            }
            (Some(own), None) => Ok(own),
            (None, Some(name)) => Ok(ModelSpec::resolve(name, base)?),
            (None, None) => bail!(
                "these weights do not record their model (a checkpoint of an older version): \
                 name it with --model"
            ),
        }
    }

    pub fn source(&self) -> Arc<dyn WeightSource> {
        match self {
            Init::Hf(m) => m.clone(),
            Init::Checkpoint(c) => c.clone(),
        }
    }
}

/// The model a run trains: the initial weights' (see [`Init::model_or`]), else `--model`, else
/// the default for the data.
pub fn run_model(
    model: Option<&str>,
    init: Option<&Init>,
    data: &dyn Dataset,
    base: Option<&Path>,
) -> Result<ModelSpec> {
    match (init, model) {
        (Some(init), _) => init.model_or(model, base),
        (None, Some(name)) => Ok(ModelSpec::resolve(name, base)?),
        (None, None) => Ok(ModelSpec::resolve(
            &crate::cluster::default_model(data),
            None,
        )?),
    }
}

/// Weights named on the command line of `export` and `generate`.
#[derive(Args)]
pub struct WeightsArgs {
    /// A checkpoint: a run directory (its `latest`) or a `step-N` directory.
    #[arg(
        long,
        conflicts_with = "init_from",
        required_unless_present = "init_from"
    )]
    checkpoint: Option<PathBuf>,
    /// A Hugging Face model directory.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// The checkpoint's model, for checkpoints that did not record it.
    #[arg(long)]
    model: Option<String>,
}

impl WeightsArgs {
    /// The weights, their model and where they are.
    fn open(&self) -> Result<(Init, ModelSpec, &Path)> {
        let Some(path) = self.checkpoint.as_ref().or(self.init_from.as_ref()) else {
            bail!("name the weights with --checkpoint or --init-from");
        };
        let init = Init::open(path)?;
        let spec = init.model_or(self.model.as_deref(), None)?;
        Ok((init, spec, path))
    }
}

#[derive(Args)]
pub struct ExportArgs {
    #[command(flatten)]
    weights: WeightsArgs,
    /// Output directory: `config.json` and `model.safetensors` for transformers'
    /// `from_pretrained`.
    #[arg(long)]
    hf: PathBuf,
}

/// `fusionllm export`.
pub fn run_export(a: ExportArgs) -> Result<()> {
    let (init, spec, path) = a.weights.open()?;
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

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    weights: WeightsArgs,
    #[arg(long)]
    prompt: String,
    /// Tokens to sample after the prompt.
    #[arg(long, default_value_t = 100)]
    tokens: usize,
    /// Softmax temperature (0: always the most likely token).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// gpt2 (BPE) or bytes (default: bytes for a 256-token vocabulary, gpt2 for GPT-2's
    /// 50,257 or one padded up to 50,304).
    #[arg(long)]
    tokenizer: Option<String>,
}

/// The tokenizer for a model's vocabulary.
fn tokenizer_for(name: Option<&str>, vocab: usize) -> Result<fusion_data::Tokenizer> {
    use fusion_data::Tokenizer;
    let t = match name {
        Some(n) => Tokenizer::parse(n)?,
        None if vocab == 256 => Tokenizer::Bytes,
        None if (50257..=50304).contains(&vocab) => Tokenizer::Gpt2,
        None => bail!(
            "no tokenizer is known for a {vocab}-token vocabulary (fusionllm reads GPT-2's BPE \
             and bytes): choose one with --tokenizer"
        ),
    };
    if t.vocab() > vocab {
        bail!(
            "the model scores {vocab} tokens but the {t:?} tokenizer has {} (fusionllm reads \
             GPT-2's BPE and bytes, not this model's own tokenizer)",
            t.vocab()
        );
    }
    Ok(t)
}

/// `fusionllm generate`.
pub fn run_generate(a: GenerateArgs) -> Result<()> {
    use std::io::Write;
    let (init, spec, _) = a.weights.open()?;
    let mut decoder = fusion_infer::Decoder::new(&spec, init.source().as_ref())?;
    let tokenizer = tokenizer_for(a.tokenizer.as_deref(), decoder.vocab())?;
    let prompt = tokenizer.encode(&a.prompt)?;
    // Only tokens the tokenizer can write are drawn (a vocabulary may be padded past it).
    let mut sampler =
        fusion_infer::Sampler::new(a.temperature, a.top_k, a.seed).limited_to(tokenizer.vocab());
    let mut out = std::io::stdout().lock();
    let mut pending: Vec<u8> = Vec::new();
    write!(out, "{}", a.prompt)?;
    let started = std::time::Instant::now();
    let mut failed = None;
    let tokens = fusion_infer::generate(&mut decoder, &prompt, a.tokens, &mut sampler, |t| {
        match tokenizer.decode_bytes(&[t]) {
            Ok(bytes) => pending.extend(bytes),
            Err(e) => failed = Some(e),
        }
        let _ = out
            .write_all(complete_text(&mut pending).as_bytes())
            .and_then(|()| out.flush());
    })?;
    if let Some(e) = failed {
        return Err(e.into());
    }
    writeln!(out, "{}", String::from_utf8_lossy(&pending))?;
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "{} prompt and {} sampled tokens in {secs:.2}s ({:.1} tokens/s) from {}",
        prompt.len(),
        tokens.len(),
        (prompt.len() + tokens.len()) as f64 / secs.max(1e-9),
        decoder.name()
    );
    Ok(())
}

/// Takes the whole characters off the front of `pending` (a character may span tokens; bytes that
/// can begin no character become U+FFFD), leaving an unfinished character for the next token.
fn complete_text(pending: &mut Vec<u8>) -> String {
    let mut text = String::new();
    loop {
        match std::str::from_utf8(pending) {
            Ok(s) => {
                text.push_str(s);
                pending.clear();
                return text;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                text.push_str(&String::from_utf8_lossy(&pending[..valid]));
                let Some(bad) = e.error_len() else {
                    pending.drain(..valid);
                    return text;
                };
                text.push(char::REPLACEMENT_CHARACTER);
                pending.drain(..valid + bad);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::complete_text;

    #[test]
    fn text_is_printed_by_whole_characters_and_invalid_bytes_are_replaced() {
        let mut p = b"caf\xc3".to_vec();
        assert_eq!(complete_text(&mut p), "caf");
        p.push(0xa9);
        assert_eq!(complete_text(&mut p), "\u{e9}");
        let mut p = vec![0xff, b'a', 0xe2, 0x82];
        assert_eq!(complete_text(&mut p), "\u{fffd}a");
        assert_eq!(p, vec![0xe2, 0x82]);
    }
}
