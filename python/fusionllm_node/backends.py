"""Kernel backends: NumPy (float64, hand-written VJPs) and PyTorch (float64 on CPU or CUDA, the
same operator semantics, each operator's VJP from torch.autograd). A backend uploads host values,
runs one operator forward or backward, adds gradients and downloads values as float64 NumPy."""

import numpy as np

from . import ops_numpy
from .errors import NodeError


class NumpyBackend:
    name = "numpy-f64"
    device = "cpu"

    def upload(self, host, shape):
        return np.asarray(host, dtype=np.float64).reshape(shape)

    def ids(self, host, shape):
        return np.asarray(host, dtype=np.int64).reshape(shape)

    def download(self, t):
        return np.ascontiguousarray(t, dtype=np.float64).reshape(-1)

    def add(self, a, b):
        return a + b

    def forward(self, op, inputs, params, train):
        return ops_numpy.forward(op, inputs, params, train)

    def backward(self, op, inputs, params, saved, dy, train):
        return ops_numpy.backward(op, inputs, params, saved, dy, train)


def make_backend(name, device=None):
    if name == "numpy":
        return NumpyBackend()
    if name == "torch":
        try:
            from .ops_torch import TorchBackend
        except ImportError as e:
            raise NodeError(f"the torch backend needs PyTorch (pip install 'fusionllm-node[torch]'): {e}") from None
        return TorchBackend(device or "cpu")
    raise NodeError(f"unknown backend '{name}' (numpy or torch)")
