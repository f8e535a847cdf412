//! Parameter counts equal the published ones.

use fusion_models::ModelSpec;

fn count(name: &str) -> usize {
    let spec = ModelSpec::preset(name).unwrap();
    spec.graph(1, 8).unwrap().num_trainable()
}

#[test]
fn gpt2_counts_match_published() {
    assert_eq!(count("gpt2-small"), 124_439_808);
    assert_eq!(count("gpt2-medium"), 354_823_168);
    assert_eq!(count("gpt2-large"), 774_030_080);
    assert_eq!(count("gpt2-xl"), 1_557_611_200);
}

#[test]
fn llama_family_counts_match_published() {
    // SmolLM-135M (tied embedding) and TinyLlama-1.1B (untied), as Hugging Face counts them.
    assert_eq!(count("smollm-135m"), 134_515_008);
    assert_eq!(count("tinyllama-1.1b"), 1_100_048_384);
    let g = ModelSpec::preset("llama-tiny")
        .unwrap()
        .graph(2, 16)
        .unwrap();
    // Names as Hugging Face's LlamaForCausalLM has them.
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.post_attention_layernorm.gamma",
        "model.norm.gamma",
    ] {
        assert!(g.param_by_name(name).is_some(), "{name}");
    }
    // Grouped-query attention: keys and values have n_kv_head heads of n_embd / n_head.
    let k = g
        .param_by_name("model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!(g.param(k).shape, vec![32, 64]);
}

#[test]
fn resnet_counts_match_torchvision() {
    assert_eq!(count("resnet18"), 11_689_512);
    assert_eq!(count("resnet34"), 21_797_672);
    assert_eq!(count("resnet50"), 25_557_032);
    assert_eq!(count("resnet101"), 44_549_160);
    assert_eq!(count("resnet152"), 60_192_808);
}

#[test]
fn small_image_variants_build_for_28x28() {
    for name in ["resnet18-small", "resnet50-small", "resnet-tiny"] {
        let g = ModelSpec::preset(name).unwrap().graph(2, 0).unwrap();
        let out = g.tensor(g.outputs[1]);
        assert_eq!(out.shape, vec![2, 10], "{name}");
    }
}

#[test]
fn graphs_serialize_and_validate() {
    let g = ModelSpec::preset("gpt2-tiny")
        .unwrap()
        .graph(2, 16)
        .unwrap();
    let back = fusion_graph::Graph::from_json(&g.to_json()).unwrap();
    assert_eq!(g, back);
    assert!(ModelSpec::preset("resnet7").is_err());
    assert!(ModelSpec::preset("gpt2-tiny")
        .unwrap()
        .graph(1, 100_000)
        .is_err());
}
