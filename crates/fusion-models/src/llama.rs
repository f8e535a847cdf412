//! Llama-family decoders: RMSNorm before each sub-layer, grouped-query attention with rotary
//! positions, a SwiGLU MLP, no biases, and an output head tied to the token embedding or not.
//! Parameter names follow Hugging Face's `LlamaForCausalLM` (`model.layers.N.self_attn.q_proj`
//! ...; a norm's gain is `gamma` where Hugging Face says `weight`).

use fusion_graph::{DType, Graph, GraphBuilder, GraphError, Init, Op, TensorId};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub vocab: usize,
    /// Longest sequence the model is meant for (rotary positions have no table to outgrow).
    pub n_ctx: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// Key/value heads (each serves `n_head / n_kv_head` query heads).
    pub n_kv_head: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate: usize,
    pub rope_theta: f32,
    pub norm_eps: f32,
    /// Whether the output head reuses the token embedding.
    pub tie_embeddings: bool,
}

impl LlamaConfig {
    /// A two-layer model for tests and the default job's size class.
    pub const fn tiny() -> Self {
        LlamaConfig {
            vocab: 50257,
            n_ctx: 128,
            n_embd: 64,
            n_layer: 2,
            n_head: 4,
            n_kv_head: 2,
            intermediate: 160,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            tie_embeddings: true,
        }
    }

    /// Shaped as Hugging Face's SmolLM-135M: 134,515,008 parameters.
    pub const fn smollm_135m() -> Self {
        LlamaConfig {
            vocab: 49152,
            n_ctx: 2048,
            n_embd: 576,
            n_layer: 30,
            n_head: 9,
            n_kv_head: 3,
            intermediate: 1536,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            tie_embeddings: true,
        }
    }

    /// Shaped as TinyLlama-1.1B: 1,100,048,384 parameters.
    pub const fn tinyllama_1b() -> Self {
        LlamaConfig {
            vocab: 32000,
            n_ctx: 2048,
            n_embd: 2048,
            n_layer: 22,
            n_head: 32,
            n_kv_head: 4,
            intermediate: 5632,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            tie_embeddings: false,
        }
    }

    fn head_dim(&self) -> usize {
        self.n_embd / self.n_head.max(1)
    }

    fn check(&self, seq: usize) -> Result<(), GraphError> {
        let bad = |message: String| {
            Err(GraphError::Shape {
                node: "model".into(),
                op: "llama".into(),
                message,
            })
        };
        if seq == 0 {
            return bad("the sequence length must be at least 1".into());
        }
        let (h, kv) = (self.n_head, self.n_kv_head);
        if h == 0
            || kv == 0
            || !h.is_multiple_of(kv)
            || !self.n_embd.is_multiple_of(h)
            || !self.head_dim().is_multiple_of(2)
        {
            return bad(format!(
                "{h} query heads in groups over {kv} key/value heads, each an even part of {}",
                self.n_embd
            ));
        }
        Ok(())
    }

    fn block(&self, g: &mut GraphBuilder, x: TensorId) -> Result<TensorId, GraphError> {
        let (c, d) = (self.n_embd, self.head_dim());
        let norm = Op::RmsNorm { eps: self.norm_eps };
        let h = g.op("input_layernorm", norm.clone(), &[x], None)?;
        let q = g.linear("self_attn.q_proj", h, self.n_head * d, false)?;
        let k = g.linear("self_attn.k_proj", h, self.n_kv_head * d, false)?;
        let v = g.linear("self_attn.v_proj", h, self.n_kv_head * d, false)?;
        let attention = Op::GroupedQueryAttention {
            n_head: self.n_head,
            n_kv_head: self.n_kv_head,
            rope_theta: self.rope_theta,
        };
        let a = g.op("self_attn.core", attention, &[q, k, v], None)?;
        let a = g.linear("self_attn.o_proj", a, c, false)?;
        let x = g.op("residual_attn", Op::Add, &[x, a], None)?;
        let h = g.op("post_attention_layernorm", norm, &[x], None)?;
        let gate = g.linear("mlp.gate_proj", h, self.intermediate, false)?;
        let up = g.linear("mlp.up_proj", h, self.intermediate, false)?;
        let gate = g.op("mlp.act", Op::Silu, &[gate], None)?;
        let h = g.op("mlp.gated", Op::Mul, &[gate, up], None)?;
        let h = g.linear("mlp.down_proj", h, c, false)?;
        g.op("residual_mlp", Op::Add, &[x, h], None)
    }

    /// The training graph for micro-batches of `batch` sequences of `seq` tokens.
    pub fn graph(&self, name: &str, batch: usize, seq: usize) -> Result<Graph, GraphError> {
        self.check(seq)?;
        let mut g = GraphBuilder::new(name);
        let tokens = g.input("tokens", vec![batch, seq], DType::I32);
        let targets = g.input("targets", vec![batch, seq], DType::I32);
        let embed = g.param(
            "model.embed_tokens.weight",
            vec![self.vocab, self.n_embd],
            Init::Normal { std: 0.02 },
        );
        let mut x =
            g.op_with_params("model.embed_tokens", Op::Embedding, &[tokens], vec![embed])?;
        for i in 0..self.n_layer {
            x = g.scoped(&format!("model.layers.{i}"), |g| self.block(g, x))?;
        }
        let x = g.op("model.norm", Op::RmsNorm { eps: self.norm_eps }, &[x], None)?;
        let logits = if self.tie_embeddings {
            g.op_with_params("lm_head", Op::Linear { bias: false }, &[x], vec![embed])?
        } else {
            g.linear("lm_head", x, self.vocab, false)?
        };
        let loss = g.op("loss", Op::SoftmaxCrossEntropy, &[logits, targets], None)?;
        g.output(loss);
        g.output(logits);
        g.finish()
    }
}
