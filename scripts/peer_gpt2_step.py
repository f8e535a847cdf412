#!/usr/bin/env python3
"""The peer measurement for `fusionllm bench`'s gpt2-small step: one training step of GPT-2 small
(forward, backward, AdamW) in PyTorch, eager or with torch.compile, on the CPU or a CUDA device.

The model is written out here (token and position embeddings, 12 pre-norm blocks of causal
self-attention and a GELU MLP, final layer norm, the output head tied to the token embedding),
so that it has the same parameters and operators as fusionllm's `gpt2-small` preset and needs
nothing beyond torch. The tokens are random, as in `fusionllm bench`.

    python3 scripts/peer_gpt2_step.py --device cpu --threads 2 [--compile] [--json out.json]
    python3 scripts/peer_gpt2_step.py --device cuda [--compile]

It prints one line of JSON: the median and best step seconds over the timed steps and the peak
memory (resident set on the CPU, the CUDA caching allocator's peak on a GPU).
"""

import argparse
import json
import math
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c)
        self.fc = nn.Linear(c, 4 * c)
        self.out = nn.Linear(4 * c, c)

    def forward(self, x, sdpa):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        if sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt2(nn.Module):
    def __init__(self, vocab=50257, ctx=1024, c=768, layers=12, heads=12, sdpa=True):
        super().__init__()
        self.sdpa = sdpa
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(ctx, c)
        self.blocks = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)

    def forward(self, ids, targets):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x, self.sdpa)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def peak_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--no-sdpa", action="store_true", help="attention as plain matrix products")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="timed steps after two warm-up steps")
    ap.add_argument("--tf32", action="store_true", help="TF32 tensor cores for f32 matmuls")
    ap.add_argument("--amp", choices=["bf16", "f16"],
                    help="mixed precision: autocast to this type, f32 weights and AdamW state "
                         "(f16 with a GradScaler)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.allow_tf32 = a.tf32
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = Gpt2(sdpa=not a.no_sdpa).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    fwd = torch.compile(model) if a.compile else model
    ids = torch.randint(0, 50257, (a.batch, a.seq + 1), device=dev)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    amp = {"bf16": torch.bfloat16, "f16": torch.float16}.get(a.amp)
    scaler = torch.amp.GradScaler(dev.type, enabled=a.amp == "f16")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
            loss = fwd(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return loss.item()

    for _ in range(2):
        step()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    out = {
        "framework": "pytorch " + torch.__version__,
        "mode": "torch.compile" if a.compile else "eager",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "batch": a.batch,
        "seq": a.seq,
        "sdpa": not a.no_sdpa,
        "tf32": a.tf32,
        "amp": a.amp or "f32",
        "step_s_median": statistics.median(times),
        "step_s_best": min(times),
        "peak_bytes": peak_bytes(dev),
    }
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
