//! A decoder that reads one token at a time: each layer keeps the keys and values of every
//! position so far (the KV cache), so a new token costs one pass over the weights instead of a
//! pass over the whole sequence. The same arithmetic as the training graph (the tests compare
//! its logits with the graph's at every position).

use crate::error::{InferError, Result};
use crate::math::{add_into, attend, gelu, layer_norm, matvec, rms_norm, rope, silu};
use fusion_models::{Gpt2Config, LlamaConfig, ModelKind, ModelSpec};
use fusion_train::{load_all_weights, WeightSource};
use std::collections::HashMap;

enum Arch {
    Gpt2(Gpt2Config),
    Llama(LlamaConfig),
}

/// Keys and values of every position so far, one row (all key/value heads) per position.
#[derive(Default)]
struct LayerCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

/// Parameters by name.
struct Params(HashMap<String, Vec<f32>>);

impl Params {
    fn p(&self, name: &str) -> Result<&[f32]> {
        self.0
            .get(name)
            .map(Vec::as_slice)
            .ok_or_else(|| InferError::MissingParam(name.into()))
    }

    /// Row `index` of the `width`-wide table `name`.
    fn row(&self, name: &str, index: usize, width: usize) -> Result<Vec<f32>> {
        self.p(name)?
            .get(index * width..(index + 1) * width)
            .map(<[f32]>::to_vec)
            .ok_or_else(|| InferError::MissingParam(format!("{name}[{index}]")))
    }

    /// `name.weight · x (+ name.bias)`.
    fn linear(&self, name: &str, x: &[f32], bias: bool) -> Result<Vec<f32>> {
        let b = match bias {
            true => Some(self.p(&format!("{name}.bias"))?),
            false => None,
        };
        Ok(matvec(self.p(&format!("{name}.weight"))?, x, b))
    }
}

pub struct Decoder {
    name: String,
    arch: Arch,
    params: Params,
    cache: Vec<LayerCache>,
}

impl Decoder {
    /// A decoder for `spec` (GPT-2 or Llama family) with `source`'s weights.
    pub fn new(spec: &ModelSpec, source: &dyn WeightSource) -> Result<Decoder> {
        let (arch, layers) = match &spec.kind {
            ModelKind::Gpt2(c) => (Arch::Gpt2(c.clone()), c.n_layer),
            ModelKind::Llama(c) => (Arch::Llama(c.clone()), c.n_layer),
            _ => {
                return Err(InferError::Unsupported {
                    model: spec.name.clone(),
                    reason: "only GPT-2 and Llama-family language models generate text".into(),
                })
            }
        };
        let graph = spec.graph(1, 1)?;
        let values = load_all_weights(source, &graph)?;
        let names = graph.params.iter().map(|p| p.name.clone());
        Ok(Decoder {
            name: spec.name.clone(),
            arch,
            params: Params(names.zip(values).collect()),
            cache: (0..layers).map(|_| LayerCache::default()).collect(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn vocab(&self) -> usize {
        match &self.arch {
            Arch::Gpt2(c) => c.vocab,
            Arch::Llama(c) => c.vocab,
        }
    }

    /// The most positions the model reads.
    pub fn context(&self) -> usize {
        match &self.arch {
            Arch::Gpt2(c) => c.n_ctx,
            Arch::Llama(c) => c.n_ctx,
        }
    }

    /// Positions read so far.
    pub fn position(&self) -> usize {
        self.cache.first().map_or(0, |c| c.keys.len())
    }

    /// Forgets every position read.
    pub fn reset(&mut self) {
        self.cache
            .iter_mut()
            .for_each(|c| *c = LayerCache::default());
    }

    /// Reads `token` at the next position; returns the logits predicting the token after it.
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        let vocab = self.vocab();
        if token as usize >= vocab {
            return Err(InferError::TokenOutOfRange { token, vocab });
        }
        let pos = self.position();
        if pos >= self.context() {
            return Err(InferError::ContextFull {
                n_ctx: self.context(),
            });
        }
        let (w, t) = (&self.params, token as usize);
        match &self.arch {
            Arch::Gpt2(c) => gpt2_step(w, &mut self.cache, c, t, pos),
            Arch::Llama(c) => llama_step(w, &mut self.cache, c, t, pos),
        }
    }
}

fn gpt2_step(
    w: &Params,
    cache: &mut [LayerCache],
    c: &Gpt2Config,
    token: usize,
    pos: usize,
) -> Result<Vec<f32>> {
    let mut x = w.row("wte", token, c.n_embd)?;
    add_into(&mut x, &w.row("wpe", pos, c.n_embd)?);
    for (l, cache) in cache.iter_mut().enumerate() {
        x = gpt2_block(w, cache, c, &format!("h.{l}"), x)?;
    }
    let x = layer_norm(&x, w.p("ln_f.gamma")?, w.p("ln_f.beta")?, 1e-5);
    Ok(matvec(w.p("wte")?, &x, None))
}

fn gpt2_block(
    w: &Params,
    cache: &mut LayerCache,
    c: &Gpt2Config,
    at: &str,
    mut x: Vec<f32>,
) -> Result<Vec<f32>> {
    let d = c.n_embd;
    let norm = |x: &[f32], ln: &str| -> Result<Vec<f32>> {
        let (g, b) = (
            w.p(&format!("{at}.{ln}.gamma"))?,
            w.p(&format!("{at}.{ln}.beta"))?,
        );
        Ok(layer_norm(x, g, b, 1e-5))
    };
    let qkv = w.linear(&format!("{at}.attn.c_attn"), &norm(&x, "ln_1")?, true)?;
    cache.keys.push(qkv[d..2 * d].to_vec());
    cache.values.push(qkv[2 * d..].to_vec());
    let a = attention(cache, &qkv[..d], c.n_head, c.n_head);
    add_into(&mut x, &w.linear(&format!("{at}.attn.c_proj"), &a, true)?);
    let h = w.linear(&format!("{at}.mlp.c_fc"), &norm(&x, "ln_2")?, true)?;
    let h: Vec<f32> = h.into_iter().map(gelu).collect();
    add_into(&mut x, &w.linear(&format!("{at}.mlp.c_proj"), &h, true)?);
    Ok(x)
}

/// Every query head of `q` attending over the layer's cache; query head `h` reads key/value
/// head `h / (n_head / n_kv_head)`.
fn attention(cache: &LayerCache, q: &[f32], n_head: usize, n_kv_head: usize) -> Vec<f32> {
    let d = q.len() / n_head;
    let group = n_head / n_kv_head;
    let mut out = Vec::with_capacity(q.len());
    for h in 0..n_head {
        let kv = h / group;
        let keys: Vec<&[f32]> = cache.keys.iter().map(|k| &k[kv * d..][..d]).collect();
        let values: Vec<&[f32]> = cache.values.iter().map(|v| &v[kv * d..][..d]).collect();
        out.extend(attend(&q[h * d..][..d], &keys, &values));
    }
    out
}

fn llama_step(
    w: &Params,
    cache: &mut [LayerCache],
    c: &LlamaConfig,
    token: usize,
    pos: usize,
) -> Result<Vec<f32>> {
    let mut x = w.row("model.embed_tokens.weight", token, c.n_embd)?;
    for (l, cache) in cache.iter_mut().enumerate() {
        x = llama_block(w, cache, c, (&format!("model.layers.{l}"), pos), x)?;
    }
    let x = rms_norm(&x, w.p("model.norm.gamma")?, c.norm_eps);
    let head = match c.tie_embeddings {
        true => "model.embed_tokens.weight",
        false => "lm_head.weight",
    };
    Ok(matvec(w.p(head)?, &x, None))
}

fn llama_block(
    w: &Params,
    cache: &mut LayerCache,
    c: &LlamaConfig,
    (at, pos): (&str, usize),
    mut x: Vec<f32>,
) -> Result<Vec<f32>> {
    let d = c.n_embd / c.n_head;
    let lin = |s: &str, v: &[f32]| w.linear(&format!("{at}.{s}"), v, false);
    let norm = |x: &[f32], s: &str| -> Result<Vec<f32>> {
        Ok(rms_norm(x, w.p(&format!("{at}.{s}.gamma"))?, c.norm_eps))
    };
    let h = norm(&x, "input_layernorm")?;
    let (mut q, mut k) = (lin("self_attn.q_proj", &h)?, lin("self_attn.k_proj", &h)?);
    rope(&mut q, d, pos, c.rope_theta);
    rope(&mut k, d, pos, c.rope_theta);
    cache.keys.push(k);
    cache.values.push(lin("self_attn.v_proj", &h)?);
    let a = attention(cache, &q, c.n_head, c.n_kv_head);
    add_into(&mut x, &lin("self_attn.o_proj", &a)?);
    let h = norm(&x, "post_attention_layernorm")?;
    let (gate, up) = (lin("mlp.gate_proj", &h)?, lin("mlp.up_proj", &h)?);
    let gated: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
    add_into(&mut x, &lin("mlp.down_proj", &gated)?);
    Ok(x)
}
