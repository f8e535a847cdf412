//! Text generation from GPT-2 and Llama-family weights (a fusionllm checkpoint or a Hugging Face
//! directory, through [`fusion_train::WeightSource`]): a decoder with a key/value cache reads
//! the prompt and then one sampled token at a time.

mod decoder;
mod error;
mod math;
mod sample;

pub use decoder::Decoder;
pub use error::{InferError, Result};
pub use sample::Sampler;

/// Reads `prompt` from a fresh cache, then samples `n` tokens, handing each to `on_token` as it
/// comes. When the
/// model's context fills, the cache is dropped and the latest half-context of tokens is read
/// again (positions restart), so any length can be generated. Returns the sampled tokens.
pub fn generate(
    decoder: &mut Decoder,
    prompt: &[u32],
    n: usize,
    sampler: &mut Sampler,
    mut on_token: impl FnMut(u32),
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(InferError::EmptyPrompt);
    }
    decoder.reset();
    let window = (decoder.context() / 2).max(1);
    let start = prompt.len().saturating_sub(decoder.context());
    let mut history = prompt[start..].to_vec();
    let mut logits = read(decoder, &history)?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let t = sampler.pick(&logits);
        out.push(t);
        on_token(t);
        history.push(t);
        if i + 1 == n {
            break;
        }
        logits = if decoder.position() < decoder.context() {
            decoder.step(t)?
        } else {
            decoder.reset();
            read(decoder, &history[history.len() - window..])?
        };
    }
    Ok(out)
}

/// Reads `tokens` at the next positions; the logits after the last.
fn read(decoder: &mut Decoder, tokens: &[u32]) -> Result<Vec<f32>> {
    let mut logits = Vec::new();
    for &t in tokens {
        logits = decoder.step(t)?;
    }
    Ok(logits)
}
