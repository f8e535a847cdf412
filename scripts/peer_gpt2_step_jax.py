#!/usr/bin/env python3
"""The JAX peer of `fusionllm bench`'s gpt2-small step: one training step of GPT-2 small (forward,
backward, gradient clipping to norm 1, AdamW) under `jax.jit`, on the CPU.

The model is the one of scripts/peer_gpt2_step.py written in JAX: token and position embeddings,
12 pre-norm blocks of causal self-attention and a tanh-GELU MLP, a final layer norm, the output
head tied to the token embedding, f32 throughout; AdamW (lr 6e-4, betas 0.9/0.95, weight decay
0.1 on every parameter, as the PyTorch script's torch.optim.AdamW) is written out here so that it
needs nothing beyond jax. Parameters and optimizer state are donated to the step (updated in
place). The tokens are random, as in `fusionllm bench`.

    python3 -m venv env && env/bin/pip install "jax[cpu]"
    env/bin/python scripts/peer_gpt2_step_jax.py [--json out.json]

XLA uses every core of the machine (two on the benchmark machine). It prints one line of JSON:
the median and best step seconds over the timed steps and the peak resident set.
"""

import argparse
import json
import resource
import statistics
import time

import jax
import jax.numpy as jnp

VOCAB, CTX, C, LAYERS, HEADS = 50257, 1024, 768, 12, 12
# jax.nn.dot_product_attention, or attention as plain products (--no-sdpa).
SDPA = True


def init(key):
    keys = iter(jax.random.split(key, 4 + 4 * LAYERS))

    def normal(shape, std=0.02):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    def dense(n_in, n_out):
        return {"w": normal((n_in, n_out)), "b": jnp.zeros((n_out,), jnp.float32)}

    def norm():
        return {"g": jnp.ones((C,), jnp.float32), "b": jnp.zeros((C,), jnp.float32)}

    blocks = [
        {"ln1": norm(), "qkv": dense(C, 3 * C), "proj": dense(C, C),
         "ln2": norm(), "fc": dense(C, 4 * C), "out": dense(4 * C, C)}
        for _ in range(LAYERS)
    ]
    return {"wte": normal((VOCAB, C)), "wpe": normal((CTX, C)), "blocks": blocks, "ln_f": norm()}


def layer_norm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]


def block(p, x):
    b, t, c = x.shape
    qkv = layer_norm(p["ln1"], x) @ p["qkv"]["w"] + p["qkv"]["b"]
    q, k, v = (z.reshape(b, t, HEADS, c // HEADS) for z in jnp.split(qkv, 3, axis=-1))
    if SDPA:
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    else:
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(c // HEADS))
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v)
    y = y.reshape(b, t, c)
    x = x + y @ p["proj"]["w"] + p["proj"]["b"]
    h = jax.nn.gelu(layer_norm(p["ln2"], x) @ p["fc"]["w"] + p["fc"]["b"], approximate=True)
    return x + h @ p["out"]["w"] + p["out"]["b"]


def loss_fn(params, ids, targets):
    x = params["wte"][ids] + params["wpe"][: ids.shape[1]]
    for p in params["blocks"]:
        x = block(p, x)
    logits = layer_norm(params["ln_f"], x) @ params["wte"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def adamw(params, grads, m, v, step, lr=6e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
    clip = jnp.minimum(1.0, 1.0 / (norm + 1e-6))
    grads = jax.tree_util.tree_map(lambda g: g * clip, grads)
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step

    def update(p, m, v):
        return p * (1 - lr * wd) - lr * (m / c1) / (jnp.sqrt(v / c2) + eps)

    return jax.tree_util.tree_map(update, params, m, v), m, v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="timed steps after two warm-up steps")
    ap.add_argument("--no-sdpa", action="store_true", help="attention as plain products")
    ap.add_argument("--json")
    a = ap.parse_args()
    global SDPA
    SDPA = not a.no_sdpa
    params = init(jax.random.PRNGKey(0))
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    ids = jax.random.randint(jax.random.PRNGKey(1), (a.batch, a.seq + 1), 0, VOCAB)
    x, y = ids[:, :-1], ids[:, 1:]

    def train_step(params, m, v, step, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params, m, v = adamw(params, grads, m, v, step)
        return params, m, v, loss

    train_step = jax.jit(train_step, donate_argnums=(0, 1, 2))
    step = 0

    def run():
        nonlocal params, m, v, step
        step += 1
        params, m, v, loss = train_step(params, m, v, jnp.float32(step), x, y)
        return float(loss.block_until_ready())

    for _ in range(2):
        run()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    out = {
        "framework": "jax " + jax.__version__,
        "mode": "jit",
        "sdpa": SDPA,
        "device": "cpu",
        "batch": a.batch,
        "seq": a.seq,
        "step_s_median": statistics.median(times),
        "step_s_best": min(times),
        "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    line = json.dumps(out)
    print(line)
    if a.json:
        with open(a.json, "w") as f:
            f.write(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
