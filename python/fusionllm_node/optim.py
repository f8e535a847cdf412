"""The optimizers of `fusion-train`, over float32 host parameters, computed in float32 as the Rust
nodes compute them (so a parameter a Python node updates matches one a Rust node updates)."""

import numpy as np

from .errors import ProtocolError

F = np.float32


def powi(a, n):
    """`a.powi(n)` for an f32 `a` as compiled Rust evaluates it: binary exponentiation in f32."""
    a, r = F(a), F(1.0)
    while True:
        if n & 1:
            r = F(r * a)
        n >>= 1
        if n == 0:
            return r
        a = F(a * a)


class Optimizer:
    """AdamW (decoupled weight decay) or SGD with heavy-ball momentum and L2 decay, from the
    `optimizer` section of the training configuration."""

    def __init__(self, cfg, sizes):
        kind = cfg.get("kind")
        if kind not in ("adam_w", "sgd"):
            raise ProtocolError(f"training configuration: unknown optimizer {kind!r}")
        self.kind = kind
        self.cfg = {k: F(v) for k, v in cfg.items() if k != "kind"}
        self.step = 0
        # Moments exist for trainable parameters only (empty for buffers), as on a Rust node.
        self.first = [np.zeros(n, F) if n is not None else np.zeros(0, F) for n in sizes]
        if kind == "adam_w":
            self.second = [np.zeros(n, F) if n is not None else np.zeros(0, F) for n in sizes]
        else:
            self.second = [np.zeros(0, F) for _ in sizes]

    def update(self, params, grads, decay, lr):
        self.step += 1
        lr = F(lr)
        c = self.cfg
        for i, g in enumerate(grads):
            if g is None or self.first[i].size != params[i].size:
                continue
            p, m = params[i], self.first[i]
            wd = c["weight_decay"] if decay[i] else F(0.0)
            if self.kind == "adam_w":
                b1, b2, eps = c["beta1"], c["beta2"], c["eps"]
                c1, c2 = F(1.0) - powi(b1, self.step), F(1.0) - powi(b2, self.step)
                v = self.second[i]
                m[:] = b1 * m + (F(1.0) - b1) * g
                v[:] = b2 * v + (F(1.0) - b2) * g * g
                update = (m / c1) / (np.sqrt(v / c2) + eps)
                p -= lr * (update + wd * p)
            else:
                m[:] = c["momentum"] * m + g + wd * p
                p -= lr * m
