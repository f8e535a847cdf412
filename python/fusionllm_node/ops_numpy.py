"""Every OP-DAG operator on NumPy arrays in float64: the forward and the hand-written
vector-Jacobian product, with the semantics of the Rust `fusion-ops` crate (the reference backend
computes in f64 too, so both agree to rounding).

`forward(op, inputs, params, mode)` returns `(output, saved, buffer_updates)`; `backward(op,
inputs, params, saved, dy, mode)` returns `(input_grads, param_grads)` with None where an input
(token ids, targets) or a parameter slot (a buffer) has no gradient.
"""

import ctypes
import ctypes.util
import functools

import numpy as np

from .errors import OpError

# GPT-2's tanh-approximated GELU: sqrt(2 / pi) and the cubic coefficient.
GELU_C = 0.7978845608028654
GELU_A = 0.044715


def f32(v):
    """A float as the Rust side has it: parsed into an f32, then widened to f64."""
    return float(np.float32(v))


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def _need(cond, msg):
    if not cond:
        raise OpError(msg)


# ---- element-wise ------------------------------------------------------------------------------


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + GELU_A * x * x * x)))


def gelu_grad(x):
    t = np.tanh(GELU_C * (x + GELU_A * x * x * x))
    du = GELU_C * (1.0 + (3.0 * GELU_A) * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du


def sigmoid(x):
    return 1.0 / (np.exp(-x) + 1.0)


# ---- normalisation -----------------------------------------------------------------------------


def _normalise(x, axes, eps):
    count = np.prod([x.shape[a] for a in axes])
    inv = 1.0 / count
    mean = x.sum(axis=axes, keepdims=True) * inv
    xc = x - mean
    var = (xc * xc).sum(axis=axes, keepdims=True) * inv
    rstd = 1.0 / np.sqrt(var + eps)
    return xc * rstd, mean, var, rstd


def _normalise_backward(g, xhat, rstd, axes):
    inv = 1.0 / np.prod([g.shape[a] for a in axes])
    mean_g = g.sum(axis=axes, keepdims=True) * inv
    mean_gx = (g * xhat).sum(axis=axes, keepdims=True) * inv
    return (g - mean_g - xhat * mean_gx) * rstd


def layer_norm_forward(x, gamma, beta, eps):
    x2 = _rows(x)
    xhat, _, _, rstd = _normalise(x2, (1,), eps)
    return (xhat * gamma + beta).reshape(x.shape), [xhat, rstd]


def layer_norm_backward(dy, gamma, xhat, rstd):
    dy2 = _rows(dy)
    dgamma = (dy2 * xhat).sum(axis=0)
    dbeta = dy2.sum(axis=0)
    dx = _normalise_backward(dy2 * gamma, xhat, rstd, (1,))
    return dx.reshape(dy.shape), dgamma, dbeta


def rms_norm_forward(x, gamma, eps):
    x2 = _rows(x)
    ms = (x2 * x2).sum(axis=1, keepdims=True) * (1.0 / x2.shape[1]) + eps
    rstd = 1.0 / np.sqrt(ms)
    xhat = x2 * rstd
    return (xhat * gamma).reshape(x.shape), [xhat, rstd]


def rms_norm_backward(dy, gamma, xhat, rstd):
    dy2 = _rows(dy)
    dgamma = (dy2 * xhat).sum(axis=0)
    g = dy2 * gamma
    mean_gx = (g * xhat).sum(axis=1, keepdims=True) * (1.0 / xhat.shape[1])
    return ((g - xhat * mean_gx) * rstd).reshape(dy.shape), dgamma


def batch_norm_forward(x, params, eps, momentum, train):
    _need(x.ndim == 4, f"batch norm needs [N, C, H, W], got {list(x.shape)}")
    gamma, beta, running_mean, running_var = params
    c = x.shape[1]
    per = (1, c, 1, 1)
    updates = []
    if train:
        xhat, mean, var, rstd = _normalise(x, (0, 2, 3), eps)
        count = x.shape[0] * x.shape[2] * x.shape[3]
        unbiased = count / (max(count, 2) - 1)
        new_mean = running_mean * (1.0 - momentum) + mean.reshape(c) * momentum
        new_var = running_var * (1.0 - momentum) + var.reshape(c) * (momentum * unbiased)
        updates = [(2, new_mean), (3, new_var)]
    else:
        rstd = (1.0 / np.sqrt(running_var + eps)).reshape(per)
        xhat = (x - running_mean.reshape(per)) * rstd
    y = xhat * gamma.reshape(per) + beta.reshape(per)
    return y, [xhat, rstd], updates


def batch_norm_backward(dy, gamma, xhat, rstd, train):
    c = dy.shape[1]
    dgamma = (dy * xhat).sum(axis=(0, 2, 3))
    dbeta = dy.sum(axis=(0, 2, 3))
    g = dy * gamma.reshape(1, c, 1, 1)
    dx = _normalise_backward(g, xhat, rstd, (0, 2, 3)) if train else g * rstd
    return dx, dgamma, dbeta


# ---- attention ---------------------------------------------------------------------------------


def _causal_softmax(scores):
    t = scores.shape[-1]
    mask = np.triu(np.ones((t, t), dtype=bool), k=1)
    s = np.where(mask, -np.inf, scores)
    z = s - s.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def attention_core(q, k, v):
    scale = 1.0 / np.sqrt(q.shape[-1])
    p = _causal_softmax((q @ k.transpose(0, 2, 1)) * scale)
    return p @ v, p


def attention_core_backward(q, k, v, p, dy):
    dp = dy @ v.transpose(0, 2, 1)
    dv = p.transpose(0, 2, 1) @ dy
    row = (dp * p).sum(axis=2, keepdims=True)
    ds = p * (dp - row) * (1.0 / np.sqrt(q.shape[-1]))
    return ds @ k, ds.transpose(0, 2, 1) @ q, dv


def _attn_dims(qkv, n_head):
    _need(qkv.ndim == 3 and qkv.shape[2] % 3 == 0 and n_head > 0 and (qkv.shape[2] // 3) % n_head == 0,
          f"attention with {n_head} heads cannot take qkv {list(qkv.shape)}")
    b, t, c3 = qkv.shape
    return b, t, n_head, c3 // 3 // n_head


def attention_forward(qkv, n_head):
    b, t, h, d = _attn_dims(qkv, n_head)
    split = qkv.reshape(b, t, 3, h, d).transpose(2, 0, 3, 1, 4)
    q, k, v = (np.ascontiguousarray(split[i]).reshape(b * h, t, d) for i in range(3))
    y, p = attention_core(q, k, v)
    return y.reshape(b, h, t, d).transpose(0, 2, 1, 3).reshape(b, t, h * d), [q, k, v, p]


def attention_backward(qkv, n_head, saved, dy):
    b, t, h, d = _attn_dims(qkv, n_head)
    q, k, v, p = saved
    dy = dy.reshape(b, t, h, d).transpose(0, 2, 1, 3).reshape(b * h, t, d)
    dq, dk, dv = attention_core_backward(q, k, v, p, dy)
    stacked = np.stack([g.reshape(b, h, t, d) for g in (dq, dk, dv)])
    return stacked.transpose(1, 3, 0, 2, 4).reshape(b, t, 3 * h * d)


def _libm():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        for f in (lib.cosf, lib.sinf):
            f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
        return lib
    except (OSError, AttributeError):
        return None


LIBM = _libm()


def _f32_cos_sin(angle):
    """cos and sin of f32 angles in f32 as the C library's cosf/sinf give them (what Rust's
    f32::cos calls), so that rotation tables match a Rust node's bit for bit on one libm; the
    correctly rounded f64 values where there is no libm to call."""
    if LIBM is None:
        a = angle.astype(np.float64)
        return np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)
    flat = angle.reshape(-1).tolist()
    cos = np.array([LIBM.cosf(v) for v in flat], np.float32).reshape(angle.shape)
    sin = np.array([LIBM.sinf(v) for v in flat], np.float32).reshape(angle.shape)
    return cos, sin


@functools.lru_cache(maxsize=16)
def _rope_tables(t, d, theta):
    half = d // 2
    inv = np.array([np.float32(float(np.float32(theta)) ** (-2.0 * i / d)) for i in range(half)],
                   dtype=np.float32)
    pos = np.arange(t, dtype=np.float32)[:, None]
    cos, sin = _f32_cos_sin((pos * inv[None, :]).astype(np.float32))  # [t, half]
    cos, sin = np.concatenate([cos, cos], axis=1), np.concatenate([sin, sin], axis=1)
    return (cos.astype(np.float64).reshape(1, 1, t, d), sin.astype(np.float64).reshape(1, 1, t, d))


def _rotate(x, cos, sin, transpose):
    half = x.shape[-1] // 2
    if transpose:
        xs = x * sin
        turned = np.concatenate([xs[..., half:], -xs[..., :half]], axis=-1)
    else:
        turned = np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin
    return x * cos + turned


def _gqa_dims(q, k, v, n_head, n_kv):
    bad = (f"attention with {n_head} query and {n_kv} key/value heads cannot take q {list(q.shape)}, "
           f"k {list(k.shape)}, v {list(v.shape)}")
    _need(q.ndim == 3 and k.ndim == 3 and n_head > 0 and n_kv > 0 and n_head % n_kv == 0
          and q.shape[2] % n_head == 0, bad)
    b, t, hd = q.shape
    d = hd // n_head
    _need(k.shape == (b, t, n_kv * d) and v.shape == k.shape and d % 2 == 0, bad)
    return b, t, n_head, n_kv, d


def _heads(x, b, t, n, d):
    return x.reshape(b, t, n, d).transpose(0, 2, 1, 3)


def _unheads(x, b, t, n, d):
    return x.transpose(0, 2, 1, 3).reshape(b, t, n * d)


def _repeat_kv(x, b, kv, g, t, d):
    return np.repeat(x.reshape(b, kv, 1, t, d), g, axis=2).reshape(b * kv * g, t, d)


def gqa_forward(q_in, k_in, v_in, n_head, n_kv, theta):
    b, t, h, kv, d = _gqa_dims(q_in, k_in, v_in, n_head, n_kv)
    cos, sin = _rope_tables(t, d, theta)
    q = _rotate(_heads(q_in, b, t, h, d), cos, sin, False).reshape(b * h, t, d)
    k = _repeat_kv(_rotate(_heads(k_in, b, t, kv, d), cos, sin, False), b, kv, h // kv, t, d)
    v = _repeat_kv(_heads(v_in, b, t, kv, d), b, kv, h // kv, t, d)
    y, p = attention_core(q, k, v)
    return _unheads(y.reshape(b, h, t, d), b, t, h, d), [q, k, v, p]


def gqa_backward(q_in, k_in, v_in, n_head, n_kv, theta, saved, dy):
    b, t, h, kv, d = _gqa_dims(q_in, k_in, v_in, n_head, n_kv)
    q, k, v, p = saved
    dq, dk, dv = attention_core_backward(q, k, v, p, _heads(dy, b, t, h, d).reshape(b * h, t, d))
    cos, sin = _rope_tables(t, d, theta)
    g = h // kv
    dq = _rotate(dq.reshape(b, h, t, d), cos, sin, True)
    dk = _rotate(dk.reshape(b, kv, g, t, d).sum(axis=2), cos, sin, True)
    dv = dv.reshape(b, kv, g, t, d).sum(axis=2)
    return _unheads(dq, b, t, h, d), _unheads(dk, b, t, kv, d), _unheads(dv, b, t, kv, d)


# ---- convolution and pooling -------------------------------------------------------------------


def _out_size(size, kernel, stride, padding):
    padded = size + 2 * padding
    _need(stride > 0 and kernel > 0 and padded >= kernel,
          f"a window of {kernel} (stride {stride}, padding {padding}) does not fit {size}")
    return (padded - kernel) // stride + 1


def _windows(x, kernel, stride, padding, fill=0.0):
    """[N, C, OH, OW, k, k] views of the (padded) input."""
    n, c, h, w = x.shape
    oh, ow = _out_size(h, kernel, stride, padding), _out_size(w, kernel, stride, padding)
    if padding:
        x = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)), constant_values=fill)
    win = np.lib.stride_tricks.sliding_window_view(x, (kernel, kernel), axis=(2, 3))
    return win[:, :, ::stride, ::stride][:, :, :oh, :ow]


def conv2d_forward(x, w, kernel, stride, padding):
    _need(x.ndim == 4 and w.ndim == 4 and w.shape[1] == x.shape[1] and w.shape[2:] == (kernel, kernel),
          f"conv2d cannot take x {list(x.shape)} with weight {list(w.shape)}")
    win = _windows(x, kernel, stride, padding)  # N C OH OW k k
    return np.einsum("ncyxij,ocij->noyx", win, w, optimize=True)


def conv2d_backward(x, w, dy, kernel, stride, padding):
    win = _windows(x, kernel, stride, padding)
    dw = np.einsum("ncyxij,noyx->ocij", win, dy, optimize=True)
    n, c, h, wd = x.shape
    oh, ow = dy.shape[2], dy.shape[3]
    dxp = np.zeros((n, c, h + 2 * padding, wd + 2 * padding))
    for i in range(kernel):
        for j in range(kernel):
            contrib = np.einsum("noyx,oc->ncyx", dy, w[:, :, i, j], optimize=True)
            dxp[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride] += contrib
    dx = dxp[:, :, padding:padding + h, padding:padding + wd]
    return np.ascontiguousarray(dx), dw


def _max_positions(x, kernel, stride, padding):
    win = _windows(x, kernel, stride, padding, fill=-np.inf)
    n, c, oh, ow = win.shape[:4]
    flat = win.reshape(n, c, oh, ow, kernel * kernel)
    _need(np.isfinite(flat.max(axis=-1)).all(), "pooling window covers only padding")
    return flat, flat.argmax(axis=-1)  # the first maximal element, in window order


def max_pool_forward(x, kernel, stride, padding):
    flat, arg = _max_positions(x, kernel, stride, padding)
    return np.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]


def max_pool_backward(x, dy, kernel, stride, padding):
    _, arg = _max_positions(x, kernel, stride, padding)
    n, c, h, w = x.shape
    oh, ow = arg.shape[2], arg.shape[3]
    ky, kx = arg // kernel, arg % kernel
    ys = np.arange(oh)[:, None] * stride + ky - padding
    xs = np.arange(ow)[None, :] * stride + kx - padding
    dx = np.zeros((n, c, h * w))
    np.add.at(dx, (np.arange(n)[:, None, None, None], np.arange(c)[None, :, None, None], ys * w + xs), dy)
    return dx.reshape(n, c, h, w)


def avg_pool_forward(x, kernel, stride):
    scale = f32(1.0 / (kernel * kernel))
    return _windows(x, kernel, stride, 0).sum(axis=(4, 5)) * scale


def avg_pool_backward(x, dy, kernel, stride):
    scale = f32(1.0 / (kernel * kernel))
    n, c, h, w = x.shape
    oh, ow = dy.shape[2], dy.shape[3]
    dx = np.zeros(x.shape)
    for i in range(kernel):
        for j in range(kernel):
            dx[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride] += dy * scale
    return dx


# ---- losses and lookups ------------------------------------------------------------------------


def _check_ids(ids, limit, what):
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        raise OpError(f"{what} {int(ids.max())} is out of range for {limit}")


def cross_entropy_forward(logits, targets):
    x = _rows(logits)
    n = x.shape[0]
    _need(n == targets.size, f"{n} rows of logits but {targets.size} targets")
    _check_ids(targets, x.shape[1], "target")
    z = x - x.max(axis=1, keepdims=True)
    e = np.exp(z)
    s = e.sum(axis=1, keepdims=True)
    probs = e / s
    picked = z[np.arange(n), targets.reshape(-1)] - np.log(s[:, 0])
    return np.array([-(picked.sum() * (1.0 / n))]), [probs]


def cross_entropy_backward(logits, targets, probs, dy):
    n = probs.shape[0]
    g = probs.copy()
    g[np.arange(n), targets.reshape(-1)] -= 1.0
    return ((g * dy.reshape(1, 1)) * (1.0 / n)).reshape(logits.shape)


# ---- dispatch ----------------------------------------------------------------------------------


def _window(op):
    return op["kernel"], op["stride"], op.get("padding", 0)


def forward(op, inputs, params, train):
    kind = op["type"]
    x = inputs[0]
    if kind == "embedding":
        (table,) = params
        _check_ids(x, table.shape[0], "token id")
        return table[x.reshape(-1)].reshape(x.shape + (table.shape[1],)), [], []
    if kind == "positional_embedding":
        _need(x.ndim == 3, f"positional embedding needs [B, T, D], got {list(x.shape)}")
        return x + params[0][: x.shape[1]].reshape(1, x.shape[1], x.shape[2]), [], []
    if kind == "linear":
        y = _rows(x) @ params[0].T
        if len(params) > 1:
            y = y + params[1]
        return y.reshape(x.shape[:-1] + (params[0].shape[0],)), [], []
    if kind == "layer_norm":
        y, saved = layer_norm_forward(x, params[0], params[1], f32(op["eps"]))
        return y, saved, []
    if kind == "rms_norm":
        y, saved = rms_norm_forward(x, params[0], f32(op["eps"]))
        return y, saved, []
    if kind == "causal_self_attention":
        y, saved = attention_forward(x, op["n_head"])
        return y, saved, []
    if kind == "grouped_query_attention":
        y, saved = gqa_forward(*inputs, op["n_head"], op["n_kv_head"], op["rope_theta"])
        return y, saved, []
    if kind == "gelu":
        return gelu(x), [], []
    if kind == "relu":
        return np.maximum(x, 0.0), [], []
    if kind == "silu":
        return x * sigmoid(x), [], []
    if kind in ("add", "mul"):
        _need(x.shape == inputs[1].shape, f"{kind}: {list(x.shape)} vs {list(inputs[1].shape)}")
        return (x + inputs[1]) if kind == "add" else (x * inputs[1]), [], []
    if kind == "conv2d":
        y = conv2d_forward(x, params[0], *_window(op))
        if len(params) > 1:
            y = y + params[1].reshape(1, -1, 1, 1)
        return y, [], []
    if kind == "batch_norm2d":
        return batch_norm_forward(x, params, f32(op["eps"]), f32(op["momentum"]), train)
    if kind == "max_pool2d":
        return max_pool_forward(x, *_window(op)), [], []
    if kind == "avg_pool2d":
        return avg_pool_forward(x, op["kernel"], op["stride"]), [], []
    if kind == "global_avg_pool":
        _need(x.ndim == 4, f"global average pool needs [N, C, H, W], got {list(x.shape)}")
        return x.sum(axis=(2, 3)) * (1.0 / (x.shape[2] * x.shape[3])), [], []
    if kind == "flatten":
        return x.reshape(x.shape[0], -1), [], []
    if kind == "softmax_cross_entropy":
        y, saved = cross_entropy_forward(x, inputs[1])
        return y, saved, []
    raise OpError(f"operator {kind!r} is not implemented by the NumPy backend")


def backward(op, inputs, params, saved, dy, train):
    kind = op["type"]
    x = inputs[0]
    if kind == "embedding":
        (table,) = params
        dt = np.zeros(table.shape)
        np.add.at(dt, x.reshape(-1), dy.reshape(-1, table.shape[1]))
        return [None], [dt]
    if kind == "positional_embedding":
        t = dy.shape[1]
        dt = np.zeros(params[0].shape)
        dt[:t] = dy.sum(axis=0)
        return [dy], [dt]
    if kind == "linear":
        dy2 = _rows(dy)
        grads = [dy2.T @ _rows(x)]
        if len(params) > 1:
            grads.append(dy2.sum(axis=0))
        return [(dy2 @ params[0]).reshape(x.shape)], grads
    if kind == "layer_norm":
        dx, dg, db = layer_norm_backward(dy, params[0], *saved)
        return [dx], [dg, db]
    if kind == "rms_norm":
        dx, dg = rms_norm_backward(dy, params[0], *saved)
        return [dx], [dg]
    if kind == "causal_self_attention":
        return [attention_backward(x, op["n_head"], saved, dy)], []
    if kind == "grouped_query_attention":
        return list(gqa_backward(*inputs, op["n_head"], op["n_kv_head"], op["rope_theta"], saved, dy)), []
    if kind == "gelu":
        return [dy * gelu_grad(x)], []
    if kind == "relu":
        return [dy * (x > 0.0)], []
    if kind == "silu":
        s = sigmoid(x)
        return [dy * (s * (x * (1.0 - s) + 1.0))], []
    if kind == "add":
        return [dy, dy], []
    if kind == "mul":
        return [dy * inputs[1], dy * x], []
    if kind == "conv2d":
        dx, dw = conv2d_backward(x, params[0], dy, *_window(op))
        grads = [dw] + ([dy.sum(axis=(0, 2, 3))] if len(params) > 1 else [])
        return [dx], grads
    if kind == "batch_norm2d":
        dx, dg, db = batch_norm_backward(dy, params[0], saved[0], saved[1], train)
        return [dx], [dg, db, None, None]
    if kind == "max_pool2d":
        return [max_pool_backward(x, dy, *_window(op))], []
    if kind == "avg_pool2d":
        return [avg_pool_backward(x, dy, op["kernel"], op["stride"])], []
    if kind == "global_avg_pool":
        n, c, h, w = x.shape
        return [np.broadcast_to(dy.reshape(n, c, 1, 1) * (1.0 / (h * w)), x.shape).copy()], []
    if kind == "flatten":
        return [dy.reshape(x.shape)], []
    if kind == "softmax_cross_entropy":
        return [cross_entropy_backward(x, inputs[1], saved[0], dy), None], []
    raise OpError(f"operator {kind!r} is not implemented by the NumPy backend")
