//! GPT-2: learned positional embeddings, pre-LN transformer blocks, tied input/output embedding.

use fusion_graph::{DType, Graph, GraphBuilder, GraphError, Init, Op, TensorId};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpt2Config {
    pub vocab: usize,
    pub n_ctx: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
}

impl Gpt2Config {
    const fn published(n_embd: usize, n_layer: usize, n_head: usize) -> Self {
        Gpt2Config {
            vocab: 50257,
            n_ctx: 1024,
            n_embd,
            n_layer,
            n_head,
        }
    }
    /// A two-layer model for tests and the default local run.
    pub const fn tiny() -> Self {
        Gpt2Config {
            vocab: 50257,
            n_ctx: 128,
            n_embd: 64,
            n_layer: 2,
            n_head: 2,
        }
    }
    pub const fn small() -> Self {
        Self::published(768, 12, 12)
    }
    pub const fn medium() -> Self {
        Self::published(1024, 24, 16)
    }
    pub const fn large() -> Self {
        Self::published(1280, 36, 20)
    }
    pub const fn xl() -> Self {
        Self::published(1600, 48, 25)
    }

    fn block(&self, g: &mut GraphBuilder, x: TensorId) -> Result<TensorId, GraphError> {
        let d = self.n_embd;
        // Residual projections start smaller so the residual stream's variance does not grow
        // with depth (GPT-2's 1/sqrt(2 * n_layer) scaling).
        let proj_init = Init::Normal {
            std: 0.02 / (2.0 * self.n_layer as f32).sqrt(),
        };
        let h = g.op("ln_1", Op::LayerNorm { eps: 1e-5 }, &[x], None)?;
        let qkv = g.linear("attn.c_attn", h, 3 * d, true)?;
        let a = g.op(
            "attn.core",
            Op::CausalSelfAttention {
                n_head: self.n_head,
            },
            &[qkv],
            None,
        )?;
        let a = g.linear("attn.c_proj", a, d, true)?;
        g.set_init(g.last_params()[0], proj_init.clone());
        let x = g.op("residual_attn", Op::Add, &[x, a], None)?;
        let h = g.op("ln_2", Op::LayerNorm { eps: 1e-5 }, &[x], None)?;
        let h = g.linear("mlp.c_fc", h, 4 * d, true)?;
        let h = g.op("mlp.gelu", Op::Gelu, &[h], None)?;
        let h = g.linear("mlp.c_proj", h, d, true)?;
        g.set_init(g.last_params()[0], proj_init);
        g.op("residual_mlp", Op::Add, &[x, h], None)
    }

    /// The training graph for micro-batches of `batch` sequences of `seq` tokens.
    pub fn graph(&self, name: &str, batch: usize, seq: usize) -> Result<Graph, GraphError> {
        if seq == 0 || seq > self.n_ctx {
            return Err(GraphError::Shape {
                node: "tokens".into(),
                op: "input".into(),
                message: format!("sequence length {seq} must be in 1..={}", self.n_ctx),
            });
        }
        let mut g = GraphBuilder::new(name);
        let tokens = g.input("tokens", vec![batch, seq], DType::I32);
        let targets = g.input("targets", vec![batch, seq], DType::I32);
        let wte = g.param(
            "wte",
            vec![self.vocab, self.n_embd],
            Init::Normal { std: 0.02 },
        );
        let wpe = g.param(
            "wpe",
            vec![self.n_ctx, self.n_embd],
            Init::Normal { std: 0.01 },
        );
        let x = g.op_with_params("wte", Op::Embedding, &[tokens], vec![wte])?;
        let mut x = g.op_with_params("wpe", Op::PositionalEmbedding, &[x], vec![wpe])?;
        for i in 0..self.n_layer {
            x = g.scoped(&format!("h.{i}"), |g| self.block(g, x))?;
        }
        let x = g.op("ln_f", Op::LayerNorm { eps: 1e-5 }, &[x], None)?;
        // The output head reuses the token embedding (tied weights).
        let logits = g.op_with_params("lm_head", Op::Linear { bias: false }, &[x], vec![wte])?;
        let loss = g.op("loss", Op::SoftmaxCrossEntropy, &[logits, targets], None)?;
        g.output(loss);
        g.output(logits);
        g.finish()
    }
}
