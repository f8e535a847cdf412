//! `config.json`: read into a model specification (GPT-2 or Llama family), and written from one
//! in the form `transformers` reads. Every field fusionllm cannot honour is refused by name
//! rather than ignored, so an imported model computes what the published one does.

use crate::error::{HfError, Result};
use fusion_models::{Gpt2Config, LlamaConfig, ModelKind, ModelSpec};
use serde_json::{json, Map, Value};
use std::path::Path;

/// A parsed `config.json` object with the file's path for errors.
struct Fields<'a> {
    path: String,
    map: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn err(&self, field: &str, message: impl Into<String>) -> HfError {
        HfError::Config {
            path: self.path.clone(),
            field: field.into(),
            message: message.into(),
        }
    }

    /// A field that is absent or null.
    fn absent(&self, field: &str) -> bool {
        self.map.get(field).is_none_or(Value::is_null)
    }

    fn usize(&self, field: &str, default: Option<usize>) -> Result<usize> {
        match self.map.get(field) {
            None | Some(Value::Null) => default.ok_or_else(|| self.err(field, "missing")),
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| self.err(field, format!("{v} is not a positive integer"))),
        }
    }

    fn float(&self, field: &str, default: f64) -> Result<f64> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| self.err(field, format!("{v} is not a non-negative number"))),
        }
    }

    fn bool(&self, field: &str, default: bool) -> Result<bool> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(field, format!("{v} is not true or false"))),
        }
    }

    fn str(&self, field: &str) -> Result<Option<&str>> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(field, format!("{v} is not a string"))),
        }
    }

    /// Refuses a field whose value changes the computation in a way fusionllm does not model.
    fn require(&self, field: &str, ok: bool, why: &str) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(self.err(field, why))
        }
    }
}

/// Reads `dir/config.json` into a model specification named after the directory.
pub fn read_config(dir: &Path) -> Result<ModelSpec> {
    let path = dir.join("config.json");
    let text = std::fs::read(&path).map_err(|e| HfError::NotAModel {
        path: dir.display().to_string(),
        reason: format!("cannot read config.json: {e}"),
    })?;
    let value: Value = serde_json::from_slice(&text).map_err(|e| HfError::Config {
        path: path.display().to_string(),
        field: "(file)".into(),
        message: format!("not valid JSON: {e}"),
    })?;
    let Value::Object(map) = &value else {
        return Err(HfError::Config {
            path: path.display().to_string(),
            field: "(file)".into(),
            message: "not a JSON object".into(),
        });
    };
    let f = Fields {
        path: path.display().to_string(),
        map,
    };
    let kind = match f.str("model_type")? {
        Some("gpt2") => ModelKind::Gpt2(gpt2(&f)?),
        Some("llama") => ModelKind::Llama(llama(&f)?),
        Some(other) => {
            return Err(HfError::Unsupported {
                path: f.path.clone(),
                model_type: other.into(),
            })
        }
        None => return Err(f.err("model_type", "missing")),
    };
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "hf-model".into());
    let spec = ModelSpec {
        name,
        kind,
        fixed_vocab: true,
    };
    spec.check()
        .map_err(|e| f.err("(architecture)", e.to_string()))?;
    Ok(spec)
}

fn gpt2(f: &Fields) -> Result<Gpt2Config> {
    let n_embd = f.usize("n_embd", Some(768))?;
    let c = Gpt2Config {
        vocab: f.usize("vocab_size", Some(50257))?,
        n_ctx: f.usize("n_positions", Some(1024))?,
        n_embd,
        n_layer: f.usize("n_layer", Some(12))?,
        n_head: f.usize("n_head", Some(12))?,
    };
    f.require(
        "n_inner",
        f.absent("n_inner") || Some(f.usize("n_inner", None)?) == n_embd.checked_mul(4),
        "fusionllm's GPT-2 has an MLP four times n_embd wide",
    )?;
    let act = f.str("activation_function")?.unwrap_or("gelu_new");
    f.require(
        "activation_function",
        matches!(act, "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast"),
        "fusionllm's GPT-2 uses the tanh approximation of GELU (gelu_new)",
    )?;
    let eps = f.float("layer_norm_epsilon", 1e-5)?;
    f.require(
        "layer_norm_epsilon",
        (eps - 1e-5).abs() < 1e-9,
        "fusionllm's GPT-2 normalises with epsilon 1e-5",
    )?;
    f.require(
        "tie_word_embeddings",
        f.bool("tie_word_embeddings", true)?,
        "fusionllm's GPT-2 ties its output head to the token embedding",
    )?;
    f.require(
        "scale_attn_weights",
        f.bool("scale_attn_weights", true)?,
        "attention scores are always scaled by 1/sqrt(head size)",
    )?;
    f.require(
        "scale_attn_by_inverse_layer_idx",
        !f.bool("scale_attn_by_inverse_layer_idx", false)?,
        "not supported",
    )?;
    f.require(
        "add_cross_attention",
        !f.bool("add_cross_attention", false)?,
        "not supported",
    )?;
    Ok(c)
}

fn llama(f: &Fields) -> Result<LlamaConfig> {
    let n_embd = f.usize("hidden_size", None)?;
    let n_head = f.usize("num_attention_heads", None)?;
    let c = LlamaConfig {
        vocab: f.usize("vocab_size", None)?,
        n_ctx: f.usize("max_position_embeddings", Some(2048))?,
        n_embd,
        n_layer: f.usize("num_hidden_layers", None)?,
        n_head,
        n_kv_head: f.usize("num_key_value_heads", Some(n_head))?,
        intermediate: f.usize("intermediate_size", None)?,
        rope_theta: as_f32(f, "rope_theta", rope_theta(f)?, false)?,
        norm_eps: as_f32(f, "rms_norm_eps", f.float("rms_norm_eps", 1e-6)?, true)?,
        tie_embeddings: f.bool("tie_word_embeddings", false)?,
    };
    f.require(
        "head_dim",
        f.absent("head_dim") || f.usize("head_dim", None)?.checked_mul(n_head) == Some(n_embd),
        "fusionllm's heads are hidden_size / num_attention_heads wide",
    )?;
    f.require(
        "hidden_act",
        matches!(f.str("hidden_act")?.unwrap_or("silu"), "silu" | "swish"),
        "fusionllm's Llama MLP is SwiGLU (silu)",
    )?;

    for field in ["attention_bias", "mlp_bias"] {
        f.require(
            field,
            !f.bool(field, false)?,
            "fusionllm's Llama projections have no biases",
        )?;
    }
    Ok(c)
}

/// `x` as the `f32` the model computes with: finite, and positive (or, when `zero_ok`, zero).
fn as_f32(f: &Fields, field: &str, x: f64, zero_ok: bool) -> Result<f32> {
    let y = x as f32;
    if y.is_finite() && (y > 0.0 || (zero_ok && y == 0.0)) && (x == 0.0) == (y == 0.0) {
        Ok(y)
    } else {
        Err(f.err(field, format!("{x} is not a usable 32-bit value")))
    }
}

/// The rotary base: `rope_parameters.rope_theta` (transformers 5) or `rope_theta` (4), default
/// 10000. Scaled variants (linear, dynamic, YaRN, Llama 3's) are refused.
fn rope_theta(f: &Fields) -> Result<f64> {
    for field in ["rope_parameters", "rope_scaling"] {
        let Some(v) = f.map.get(field).filter(|v| !v.is_null()) else {
            continue;
        };
        let Value::Object(m) = v else {
            return Err(f.err(field, format!("{v} is not an object")));
        };
        let kind = m.get("rope_type").or_else(|| m.get("type"));
        if kind.is_some_and(|k| k.as_str() != Some("default")) {
            return Err(f.err(
                field,
                "only the default (unscaled) rotary positions are supported",
            ));
        }
        if let Some(theta) = m.get("rope_theta") {
            return theta
                .as_f64()
                .filter(|t| t.is_finite() && *t > 0.0)
                .ok_or_else(|| {
                    f.err(
                        field,
                        format!("rope_theta {theta} is not a positive number"),
                    )
                });
        }
    }
    f.float("rope_theta", 10000.0)
}

/// Why a model is not exported.
pub(crate) const NO_HF_FORM: &str = "only GPT-2 and Llama-family models have a Hugging Face form";

/// The `config.json` `transformers` reads for `spec` (a GPT-2 or Llama-family model).
pub fn config_json(spec: &ModelSpec) -> Result<Value> {
    let mut v = match &spec.kind {
        ModelKind::Gpt2(c) => json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": c.vocab,
            "n_positions": c.n_ctx,
            "n_embd": c.n_embd,
            "n_layer": c.n_layer,
            "n_head": c.n_head,
            "n_inner": null,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "tie_word_embeddings": true,
            // fusionllm trains without dropout; so does a fine-tune of the export by default.
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        }),
        ModelKind::Llama(c) => json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": c.vocab,
            "max_position_embeddings": c.n_ctx,
            "hidden_size": c.n_embd,
            "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head,
            "num_key_value_heads": c.n_kv_head,
            "head_dim": c.n_embd / c.n_head.max(1),
            "intermediate_size": c.intermediate,
            "hidden_act": "silu",
            "rms_norm_eps": shortest(c.norm_eps),
            // transformers 5 reads the first, 4 the second.
            "rope_parameters": {"rope_type": "default", "rope_theta": shortest(c.rope_theta)},
            "rope_theta": shortest(c.rope_theta),
            "attention_bias": false,
            "mlp_bias": false,
            "tie_word_embeddings": c.tie_embeddings,
        }),
        _ => {
            return Err(HfError::Export {
                model: spec.name.clone(),
                reason: NO_HF_FORM.into(),
            })
        }
    };
    if let Value::Object(m) = &mut v {
        // `dtype` for transformers 5, `torch_dtype` for 4.
        m.insert("dtype".into(), json!("float32"));
        m.insert("torch_dtype".into(), json!("float32"));
        if spec.vocab() == Some(50257) {
            // GPT-2's BPE: <|endoftext|> begins and ends documents.
            m.insert("bos_token_id".into(), json!(50256));
            m.insert("eos_token_id".into(), json!(50256));
        }
    }
    Ok(v)
}

/// An `f32` as the decimal number it was written as (1e-5, not 9.999999747378752e-6).
fn shortest(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .map_or(Value::Null, |v| json!(v))
}
