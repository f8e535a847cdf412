//! Where each fusionllm parameter lives in a Hugging Face checkpoint: its name there and its
//! layout. Pure functions of the names, tested without files.
//!
//! GPT-2 (`GPT2LMHeadModel`): `transformer.` before every name (the original hub files have
//! none; both are read), norms' `weight`/`bias` for fusionllm's `gamma`/`beta`, and the
//! projections stored as `Conv1D`, `[in, out]`, where fusionllm's linear weights are
//! `[out, in]`. Llama (`LlamaForCausalLM`): the same names (fusionllm's follow them) but the
//! norms' `weight`; every linear weight is already `[out, in]`.

/// How a tensor is laid out in the Hugging Face file relative to fusionllm's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Same,
    /// A matrix stored transposed.
    Transposed,
}

/// The family of a model, which fixes its naming.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Gpt2,
    Llama,
}

/// A parameter's place in a Hugging Face checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfPlace {
    /// The canonical name (what `save_pretrained` writes).
    pub name: String,
    /// Other names it is found under in published files.
    pub aliases: Vec<String>,
    pub layout: Layout,
}

fn norm_suffix(name: &str) -> String {
    if let Some(base) = name.strip_suffix(".gamma") {
        format!("{base}.weight")
    } else if let Some(base) = name.strip_suffix(".beta") {
        format!("{base}.bias")
    } else {
        name.to_string()
    }
}

/// Where fusionllm's parameter `ours` of a `family` model lives.
pub fn hf_place(family: Family, ours: &str) -> HfPlace {
    match family {
        Family::Gpt2 => {
            let bare = match ours {
                "wte" | "wpe" => format!("{ours}.weight"),
                _ => norm_suffix(ours),
            };
            let conv1d = [".c_attn.weight", ".c_proj.weight", ".c_fc.weight"]
                .iter()
                .any(|s| bare.ends_with(s));
            HfPlace {
                name: format!("transformer.{bare}"),
                aliases: vec![bare],
                layout: if conv1d {
                    Layout::Transposed
                } else {
                    Layout::Same
                },
            }
        }
        Family::Llama => HfPlace {
            name: norm_suffix(ours),
            aliases: Vec::new(),
            layout: Layout::Same,
        },
    }
}

/// Tensors a published checkpoint may hold that are not parameters: GPT-2's causal-mask
/// buffers, Llama's rotary frequency tables, and the output head of a tied model (a copy of the
/// token embedding).
pub fn ignorable(family: Family, hf_name: &str, tied: bool) -> bool {
    let head = tied && hf_name == "lm_head.weight";
    head || match family {
        Family::Gpt2 => hf_name.ends_with(".attn.bias") || hf_name.ends_with(".attn.masked_bias"),
        Family::Llama => hf_name.ends_with(".rotary_emb.inv_freq"),
    }
}

/// The shape a tensor of fusionllm shape `shape` has in the file.
pub fn hf_shape(shape: &[usize], layout: Layout) -> Vec<usize> {
    match (layout, shape) {
        (Layout::Transposed, [r, c]) => vec![*c, *r],
        _ => shape.to_vec(),
    }
}

/// Transposes a row-major `rows x cols` matrix.
pub fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_names_gain_the_transformer_prefix_and_conv1d_weights_are_transposed() {
        let p = hf_place(Family::Gpt2, "h.3.attn.c_attn.weight");
        assert_eq!(p.name, "transformer.h.3.attn.c_attn.weight");
        assert_eq!(p.aliases, vec!["h.3.attn.c_attn.weight".to_string()]);
        assert_eq!(p.layout, Layout::Transposed);
        let b = hf_place(Family::Gpt2, "h.3.attn.c_attn.bias");
        assert_eq!(b.layout, Layout::Same);
        assert_eq!(hf_place(Family::Gpt2, "wte").name, "transformer.wte.weight");
        assert_eq!(
            hf_place(Family::Gpt2, "ln_f.gamma").name,
            "transformer.ln_f.weight"
        );
        assert_eq!(
            hf_place(Family::Gpt2, "h.0.ln_2.beta").name,
            "transformer.h.0.ln_2.bias"
        );
        assert_eq!(
            hf_place(Family::Gpt2, "h.0.mlp.c_proj.weight").layout,
            Layout::Transposed
        );
    }

    #[test]
    fn llama_names_are_kept_but_for_the_norm_gains() {
        let p = hf_place(
            Family::Llama,
            "model.layers.7.post_attention_layernorm.gamma",
        );
        assert_eq!(p.name, "model.layers.7.post_attention_layernorm.weight");
        assert_eq!(p.layout, Layout::Same);
        let q = hf_place(Family::Llama, "model.layers.0.self_attn.q_proj.weight");
        assert_eq!(q.name, "model.layers.0.self_attn.q_proj.weight");
        assert_eq!(q.layout, Layout::Same);
    }

    #[test]
    fn buffers_and_a_tied_head_are_ignorable_and_nothing_else() {
        assert!(ignorable(Family::Gpt2, "h.0.attn.bias", true));
        assert!(ignorable(
            Family::Gpt2,
            "transformer.h.0.attn.masked_bias",
            true
        ));
        assert!(!ignorable(
            Family::Gpt2,
            "transformer.h.0.attn.c_attn.bias",
            true
        ));
        assert!(ignorable(Family::Llama, "lm_head.weight", true));
        assert!(!ignorable(Family::Llama, "lm_head.weight", false));
        assert!(ignorable(
            Family::Llama,
            "model.layers.0.self_attn.rotary_emb.inv_freq",
            false
        ));
    }

    #[test]
    fn transposing_twice_gives_back_the_matrix() {
        let m: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let t = transpose(&m, 2, 3);
        assert_eq!(t, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_eq!(transpose(&t, 3, 2), m);
        assert_eq!(hf_shape(&[2, 3], Layout::Transposed), vec![3, 2]);
        assert_eq!(hf_shape(&[5], Layout::Transposed), vec![5]);
    }
}
