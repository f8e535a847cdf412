#!/usr/bin/env python3
"""The peer measurement for `fusionllm bench`'s fused attention row: PyTorch's
scaled_dot_product_attention (causal), forward and backward, on q, k, v of [batch, heads, T, D]
(gpt2-small at batch 4 x 256 tokens by default), best of --reps after a warm-up.

    python3 scripts/peer_attention.py --threads 2 [--json out.json]
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--shape", default="4,12,256,64")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    b, h, t, d = (int(x) for x in a.shape.split(","))
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
    dy = torch.randn(b, h, t, d)

    def once():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(dy)

    once()
    best = float("inf")
    for _ in range(a.reps):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    flops = 6 * 2 * b * h * t * t * d
    out = {
        "framework": "pytorch " + torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": [b, h, t, d],
        "ms": best * 1e3,
        "gflops_full_tt": flops / best / 1e9,
    }
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
