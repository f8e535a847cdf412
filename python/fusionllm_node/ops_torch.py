"""The PyTorch backend: every OP-DAG operator on torch tensors in float64, on the CPU or a CUDA
device, with the semantics of `fusion-ops` (the same formulas as ops_numpy). Each operator's VJP
comes from torch.autograd: the forward records the operator's own small graph, the backward asks
autograd for the gradients of its float inputs and parameters given the output's gradient."""

import numpy as np
import torch
import torch.nn.functional as tf

from .errors import OpError
from .ops_numpy import GELU_A, GELU_C, _rope_tables, f32

DT = torch.float64


def _need(cond, msg):
    if not cond:
        raise OpError(msg)


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def _normalise(x, dims, eps):
    count = 1
    for d in dims:
        count *= x.shape[d]
    mean = x.sum(dim=dims, keepdim=True) * (1.0 / count)
    xc = x - mean
    var = (xc * xc).sum(dim=dims, keepdim=True) * (1.0 / count)
    return xc * (1.0 / torch.sqrt(var + eps)), mean, var


def _causal_attention(q, k, v):
    t = q.shape[1]
    scores = (q @ k.transpose(1, 2)) * (1.0 / np.sqrt(q.shape[-1]))
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    s = scores.masked_fill(mask, float("-inf"))
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    return (e / e.sum(dim=-1, keepdim=True)) @ v


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _gqa(q, k, v, n_head, n_kv, theta):
    _need(q.dim() == 3 and k.dim() == 3 and n_head > 0 and n_kv > 0 and n_head % n_kv == 0
          and q.shape[2] % n_head == 0, f"attention with {n_head} query and {n_kv} key/value heads")
    b, t, hd = q.shape
    d = hd // n_head
    _need(tuple(k.shape) == (b, t, n_kv * d) and v.shape == k.shape and d % 2 == 0,
          f"attention cannot take q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    cos, sin = (torch.from_numpy(a).to(q.device) for a in _rope_tables(t, d, theta))
    heads = lambda x, n: x.reshape(b, t, n, d).permute(0, 2, 1, 3)  # noqa: E731
    g = n_head // n_kv
    qh = _rotate(heads(q, n_head), cos, sin).reshape(b * n_head, t, d)
    kh = _rotate(heads(k, n_kv), cos, sin).unsqueeze(2).expand(b, n_kv, g, t, d).reshape(b * n_head, t, d)
    vh = heads(v, n_kv).unsqueeze(2).expand(b, n_kv, g, t, d).reshape(b * n_head, t, d)
    y = _causal_attention(qh, kh, vh)
    return y.reshape(b, n_head, t, d).permute(0, 2, 1, 3).reshape(b, t, hd)


def _check_ids(ids, limit, what):
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise OpError(f"{what} {int(ids.max())} is out of range for {limit}")


def _op(op, x, ins, ps, train):
    """(output, buffer updates) of one operator; differentiable in its float arguments."""
    kind = op["type"]
    if kind == "embedding":
        _check_ids(x, ps[0].shape[0], "token id")
        return ps[0][x], []
    if kind == "positional_embedding":
        _need(x.dim() == 3, f"positional embedding needs [B, T, D], got {list(x.shape)}")
        return x + ps[0][: x.shape[1]].unsqueeze(0), []
    if kind == "linear":
        y = _rows(x) @ ps[0].T
        if len(ps) > 1:
            y = y + ps[1]
        return y.reshape(*x.shape[:-1], ps[0].shape[0]), []
    if kind == "layer_norm":
        xhat, _, _ = _normalise(_rows(x), (1,), f32(op["eps"]))
        return (xhat * ps[0] + ps[1]).reshape(x.shape), []
    if kind == "rms_norm":
        x2 = _rows(x)
        ms = (x2 * x2).sum(dim=1, keepdim=True) * (1.0 / x2.shape[1]) + f32(op["eps"])
        return (x2 * (1.0 / torch.sqrt(ms)) * ps[0]).reshape(x.shape), []
    if kind == "causal_self_attention":
        h = op["n_head"]
        _need(x.dim() == 3 and x.shape[2] % 3 == 0 and h > 0 and (x.shape[2] // 3) % h == 0,
              f"attention with {h} heads cannot take qkv {list(x.shape)}")
        b, t, c3 = x.shape
        d = c3 // 3 // h
        s = x.reshape(b, t, 3, h, d).permute(2, 0, 3, 1, 4)
        q, k, v = (s[i].reshape(b * h, t, d) for i in range(3))
        y = _causal_attention(q, k, v)
        return y.reshape(b, h, t, d).permute(0, 2, 1, 3).reshape(b, t, h * d), []
    if kind == "grouped_query_attention":
        return _gqa(ins[0], ins[1], ins[2], op["n_head"], op["n_kv_head"], op["rope_theta"]), []
    if kind == "gelu":
        return 0.5 * x * (1.0 + torch.tanh(GELU_C * (x + GELU_A * x * x * x))), []
    if kind == "relu":
        return torch.relu(x), []
    if kind == "silu":
        return x * (1.0 / (torch.exp(-x) + 1.0)), []
    if kind in ("add", "mul"):
        _need(x.shape == ins[1].shape, f"{kind}: {list(x.shape)} vs {list(ins[1].shape)}")
        return (x + ins[1]) if kind == "add" else (x * ins[1]), []
    if kind == "conv2d":
        _need(x.dim() == 4 and ps[0].dim() == 4 and ps[0].shape[1] == x.shape[1],
              f"conv2d cannot take x {list(x.shape)} with weight {list(ps[0].shape)}")
        bias = ps[1] if len(ps) > 1 else None
        return tf.conv2d(x, ps[0], bias, stride=op["stride"], padding=op["padding"]), []
    if kind == "batch_norm2d":
        return _batch_norm(x, ps, op, train)
    if kind == "max_pool2d":
        return tf.max_pool2d(x, op["kernel"], op["stride"], op["padding"]), []
    if kind == "avg_pool2d":
        k = op["kernel"]
        s = tf.avg_pool2d(x, k, op["stride"], divisor_override=1)
        return s * f32(1.0 / (k * k)), []
    if kind == "global_avg_pool":
        _need(x.dim() == 4, f"global average pool needs [N, C, H, W], got {list(x.shape)}")
        return x.sum(dim=(2, 3)) * (1.0 / (x.shape[2] * x.shape[3])), []
    if kind == "flatten":
        return x.reshape(x.shape[0], -1), []
    if kind == "softmax_cross_entropy":
        rows, tg = _rows(x), ins[1].reshape(-1)
        _need(rows.shape[0] == tg.numel(), f"{rows.shape[0]} rows of logits but {tg.numel()} targets")
        _check_ids(tg, rows.shape[1], "target")
        z = rows - rows.max(dim=1, keepdim=True).values
        s = torch.exp(z).sum(dim=1)
        picked = z[torch.arange(rows.shape[0], device=x.device), tg] - torch.log(s)
        return (-(picked.sum() * (1.0 / rows.shape[0]))).reshape(1), []
    raise OpError(f"operator {kind!r} is not implemented by the torch backend")


def _batch_norm(x, ps, op, train):
    _need(x.dim() == 4, f"batch norm needs [N, C, H, W], got {list(x.shape)}")
    gamma, beta, rmean, rvar = ps
    c, eps, m = x.shape[1], f32(op["eps"]), f32(op["momentum"])
    if train:
        xhat, mean, var = _normalise(x, (0, 2, 3), eps)
        count = x.shape[0] * x.shape[2] * x.shape[3]
        unbiased = count / (max(count, 2) - 1)
        with torch.no_grad():
            upd = [(2, rmean * (1.0 - m) + mean.reshape(c) * m),
                   (3, rvar * (1.0 - m) + var.reshape(c) * (m * unbiased))]
    else:
        rstd = (1.0 / torch.sqrt(rvar + eps)).reshape(1, c, 1, 1)
        xhat, upd = (x - rmean.reshape(1, c, 1, 1)) * rstd, []
    return xhat * gamma.reshape(1, c, 1, 1) + beta.reshape(1, c, 1, 1), upd


class TorchBackend:
    def __init__(self, device="cpu"):
        try:
            self.dev = torch.device(device)
            torch.zeros(1, dtype=DT, device=self.dev)
        except (RuntimeError, AssertionError) as e:
            from .errors import NodeError

            raise NodeError(f"torch device '{device}' is not usable: {e}") from None
        self.device = str(self.dev)
        self.name = f"torch-f64-{self.dev.type}"

    def upload(self, host, shape):
        return torch.as_tensor(np.asarray(host, dtype=np.float64).reshape(shape), device=self.dev)

    def ids(self, host, shape):
        return torch.as_tensor(np.asarray(host, dtype=np.int64).reshape(shape), device=self.dev)

    def download(self, t):
        return t.detach().to("cpu", DT).numpy().reshape(-1).copy()

    def add(self, a, b):
        return a + b

    def forward(self, op, inputs, params, train):
        floats = [t.detach().requires_grad_(True) if t.is_floating_point() else t for t in inputs]
        leaves = [p.detach().requires_grad_(True) for p in params]
        with torch.enable_grad():
            y, upd = _op(op, floats[0], floats, leaves, train)
        return y.detach(), (y, floats, leaves), [(s, u.detach()) for s, u in upd]

    def backward(self, op, inputs, params, saved, dy, train):
        y, floats, leaves = saved
        wrt = [t for t in floats if t.is_floating_point()] + leaves
        if not y.requires_grad:
            grads = [None] * len(wrt)
        else:
            grads = torch.autograd.grad(y, wrt, dy, allow_unused=True)
        grads = list(grads)
        gin = [grads.pop(0) if t.is_floating_point() else None for t in floats]
        gpar = grads
        if op["type"] == "batch_norm2d":
            gpar = gpar[:2] + [None, None]
        elif op["type"] == "embedding":
            gin = [None]
        gin = [torch.zeros_like(t) if g is None and t.is_floating_point() else g for g, t in zip(gin, floats)]
        gpar = [torch.zeros_like(p) if g is None and i < len(gpar) and not (op["type"] == "batch_norm2d" and i >= 2)
                else g for i, (g, p) in enumerate(zip(gpar, leaves))]
        return gin, gpar
