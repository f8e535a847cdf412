#!/usr/bin/env python3
"""Checks fusionllm's Hugging Face interoperability against `transformers` itself.

1. Builds small random GPT-2 and Llama models with `transformers` and saves them (f32; and a
   tied Llama in bf16, sharded) as the test fixtures under crates/fusion-hf/tests/fixtures/, with
   the logits `transformers` computes on fixed tokens and the losses of a few AdamW fine-tuning
   steps in PyTorch. `cargo test -p fusion-hf` then checks fusionllm against these without Python.
2. Runs that cargo test, which prints fusionllm's largest logit and loss differences.
3. Exports each fixture with `fusionllm export --init-from DIR --hf OUT`, loads OUT with
   `from_pretrained` and compares its logits with the original's.

Figures go to docs/results/hf-interop.json. With `--make-shaped DIR` it only writes two models
in published shapes with transformers' random initialisation, for runs at real size:
DIR/gpt2-small-hf (GPT2LMHeadModel, 124,439,808 parameters, f32) and DIR/smollm-hf
(LlamaForCausalLM in SmolLM-135M's shape, 134,515,008 parameters, bf16 in 100 MB shards). Run it through scripts/hf_interop.sh, which makes
the virtual environment (transformers, torch CPU, safetensors); it is not part of the tests.
"""
import json
import pathlib
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
import transformers
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM)

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "crates" / "fusion-hf" / "tests" / "fixtures"
RESULTS = ROOT / "docs" / "results" / "hf-interop.json"
VOCAB = 256
LOGIT_BATCH, LOGIT_SEQ = 2, 8
TUNE_BATCH, TUNE_SEQ, TUNE_STEPS = 2, 16, 5
LR, WEIGHT_DECAY, BETAS, EPS = 1e-3, 0.1, (0.9, 0.95), 1e-8
TEXT = (
    "A decentralized trainer spreads one model over machines at several sites. Each stage "
    "holds a slice of the layers, sends activations forward and gradients back, and the "
    "optimizer keeps its moments beside the weights. Links are slow and machines come and go, "
    "so the broker checkpoints often and plans around stragglers. "
).encode()


def gpt2():
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1,
        bos_token_id=0, eos_token_id=0))


def llama(tied):
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied,
        initializer_range=0.1))


def perturb_norms(model):
    """transformers starts norms at gain 1 and bias 0: move them, so a mix-up shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.add_(0.2 * torch.randn_like(p))


def logits_of(model, tokens):
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def batches(gen):
    data = torch.tensor(list(TEXT), dtype=torch.long)
    out = []
    for _ in range(TUNE_STEPS):
        starts = torch.randint(0, len(data) - TUNE_SEQ - 1, (TUNE_BATCH,), generator=gen)
        x = torch.stack([data[s:s + TUNE_SEQ] for s in starts])
        y = torch.stack([data[s + 1:s + TUNE_SEQ + 1] for s in starts])
        out.append((x, y))
    return out


def finetune(model, steps):
    """AdamW as fusionllm runs it: decay on matrices only, constant rate, no clipping."""
    model.train()
    params = list(model.named_parameters())
    groups = [
        {"params": [p for _, p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    losses = []
    for x, y in steps:
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def make_fixture(name, model, gen, dtype=None, shard=None):
    path = FIXTURES / name
    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():
        old.unlink()
    perturb_norms(model)
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    # The expected figures come from the saved files, read back as f32.
    saved = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens = torch.randint(0, VOCAB, (LOGIT_BATCH, LOGIT_SEQ), generator=gen)
    reference = logits_of(saved, tokens)
    expected = {
        "tokens": tokens.tolist(),
        "logits": reference.reshape(-1).tolist(),
    }
    if dtype is None:
        steps = batches(gen)
        expected["finetune"] = {
            "lr": LR, "weight_decay": WEIGHT_DECAY, "betas": list(BETAS), "eps": EPS,
            "batches": [{"inputs": x.tolist(), "targets": y.tolist()} for x, y in steps],
            "losses": finetune(saved, steps),
        }
    (path / "expected.json").write_text(json.dumps(expected))
    return path, tokens, reference


def make_shaped(out):
    out = pathlib.Path(out)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(out / "gpt2-small-hf")
    smollm = LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=True))
    smollm.to(torch.bfloat16).save_pretrained(out / "smollm-hf", max_shard_size="100MB")
    print(f"wrote {out / 'gpt2-small-hf'} and {out / 'smollm-hf'}")


def run(cmd):
    print("$", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout


def main():
    if "--make-shaped" in sys.argv:
        return make_shaped(sys.argv[sys.argv.index("--make-shaped") + 1])
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    fixtures = [
        make_fixture("gpt2", gpt2(), gen),
        make_fixture("llama", llama(tied=False), gen),
        make_fixture("llama-tied-bf16-sharded", llama(tied=True), gen,
                     dtype=torch.bfloat16, shard="40KB"),
    ]
    if "--fixtures-only" in sys.argv:
        return
    out = run(["cargo", "test", "--profile", "test", "-p", "fusion-hf", "--test",
               "transformers", "--", "--nocapture", "--test-threads", "1"])
    # With --nocapture a test's first line can follow the harness's "test NAME ... ".
    rust = [json.loads(line.split("HF-INTEROP ", 1)[1]) for line in out.splitlines()
            if "HF-INTEROP " in line]
    run(["cargo", "build", "--profile", "test", "-p", "fusion-cli"])
    exported = []
    with tempfile.TemporaryDirectory() as tmp:
        for path, tokens, logits in fixtures:
            out_dir = pathlib.Path(tmp) / path.name
            run([ROOT / "target" / "debug" / "fusionllm", "export", "--init-from", path,
                 "--hf", out_dir])
            again = logits_of(
                AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32), tokens)
            diff = (again - logits).abs().max().item()
            exported.append({"fixture": path.name, "max_abs_logit_diff": diff})
            print(f"{path.name}: exported by fusionllm, loaded by transformers: "
                  f"max |logit difference| {diff:.3g}")
    report = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "fusionllm_vs_transformers": rust,
        "fusionllm_export_loaded_by_transformers": exported,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    for r in rust:
        print("fusionllm vs transformers:", r)
    bad = [e for e in exported if e["max_abs_logit_diff"] > 1e-4]
    bad += [r for r in rust if r.get("max_abs_logit_diff", 0.0) > 1e-4
            or r.get("max_abs_loss_diff", 0.0) > 1e-3]
    if bad:
        sys.exit(f"outside tolerance: {bad}")


if __name__ == "__main__":
    main()
