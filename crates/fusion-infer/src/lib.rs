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

/// Reads `prompt`, then samples up to `n` tokens, handing each to `on_token` as it comes; stops
/// early at the model's context length. Returns the sampled tokens.
pub fn generate(
    decoder: &mut Decoder,
    prompt: &[u32],
    n: usize,
    sampler: &mut Sampler,
    mut on_token: impl FnMut(u32),
) -> Result<Vec<u32>> {
    let (last, head) = prompt.split_last().ok_or(InferError::EmptyPrompt)?;
    if prompt.len() > decoder.context() {
        return Err(InferError::ContextFull {
            n_ctx: decoder.context(),
        });
    }
    for &t in head {
        decoder.step(t)?;
    }
    let mut logits = decoder.step(*last)?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let t = sampler.pick(&logits);
        out.push(t);
        on_token(t);
        if i + 1 == n || decoder.position() >= decoder.context() {
            break;
        }
        logits = decoder.step(t)?;
    }
    Ok(out)
}
