"""Finite-difference checks of every operator's hand-written VJP (NumPy backend, float64), and of
the PyTorch backend against the NumPy one when PyTorch is installed."""

import unittest

import numpy as np

from fusionllm_node import ops_numpy

RNG = np.random.default_rng(7)

# (op, float input shapes or ("ids", shape, limit), param shapes, train)
CASES = [
    ({"type": "linear", "bias": True}, [(2, 3, 4)], [(5, 4), (5,)], True),
    ({"type": "linear", "bias": False}, [(3, 4)], [(2, 4)], True),
    ({"type": "layer_norm", "eps": 1e-5}, [(2, 3, 6)], [(6,), (6,)], True),
    ({"type": "rms_norm", "eps": 1e-5}, [(2, 3, 6)], [(6,)], True),
    ({"type": "causal_self_attention", "n_head": 2}, [(2, 4, 12)], [], True),
    ({"type": "grouped_query_attention", "n_head": 4, "n_kv_head": 2, "rope_theta": 10000.0},
     [(2, 5, 16), (2, 5, 8), (2, 5, 8)], [], True),
    ({"type": "gelu"}, [(3, 5)], [], True),
    ({"type": "relu"}, [(3, 5)], [], True),
    ({"type": "silu"}, [(3, 5)], [], True),
    ({"type": "add"}, [(2, 3), (2, 3)], [], True),
    ({"type": "mul"}, [(2, 3), (2, 3)], [], True),
    ({"type": "conv2d", "kernel": 3, "stride": 2, "padding": 1, "bias": True}, [(2, 3, 5, 5)],
     [(4, 3, 3, 3), (4,)], True),
    ({"type": "conv2d", "kernel": 1, "stride": 1, "padding": 0, "bias": False}, [(1, 2, 3, 3)],
     [(3, 2, 1, 1)], True),
    ({"type": "batch_norm2d", "eps": 1e-5, "momentum": 0.1}, [(3, 2, 3, 3)],
     [(2,), (2,), ("buffer", 2), ("buffer_var", 2)], True),
    ({"type": "batch_norm2d", "eps": 1e-5, "momentum": 0.1}, [(3, 2, 3, 3)],
     [(2,), (2,), ("buffer", 2), ("buffer_var", 2)], False),
    ({"type": "max_pool2d", "kernel": 3, "stride": 2, "padding": 1}, [(2, 2, 5, 5)], [], True),
    ({"type": "avg_pool2d", "kernel": 2, "stride": 2}, [(2, 2, 4, 4)], [], True),
    ({"type": "global_avg_pool"}, [(2, 3, 2, 2)], [], True),
    ({"type": "flatten"}, [(2, 3, 2, 2)], [], True),
    ({"type": "embedding"}, [("ids", (2, 3), 7)], [(7, 4)], True),
    ({"type": "positional_embedding"}, [(2, 3, 4)], [(5, 4)], True),
    ({"type": "softmax_cross_entropy"}, [(2, 3, 5), ("ids", (2, 3), 5)], [], True),
]


def make(case):
    op, ins, ps, train = case
    inputs = []
    for s in ins:
        if s[0] == "ids":
            inputs.append(RNG.integers(0, s[2], s[1]))
        else:
            inputs.append(RNG.standard_normal(s))
    params = []
    for s in ps:
        if s[0] == "buffer":
            params.append(RNG.standard_normal(s[1]) * 0.1)
        elif s[0] == "buffer_var":
            params.append(RNG.uniform(0.5, 1.5, s[1]))
        else:
            params.append(RNG.standard_normal(s))
    return op, inputs, params, train


def loss_of(op, inputs, params, train, w):
    y, _, _ = ops_numpy.forward(op, inputs, params, train)
    return float((y * w).sum())


class FiniteDifferences(unittest.TestCase):
    def check(self, case):
        op, inputs, params, train = make(case)
        y, saved, _ = ops_numpy.forward(op, inputs, params, train)
        w = RNG.standard_normal(y.shape)
        gin, gpar = ops_numpy.backward(op, inputs, params, saved, w, train)
        eps = 1e-6
        targets = [(inputs, i, gin[i]) for i in range(len(inputs)) if inputs[i].dtype == np.float64]
        targets += [(params, i, gpar[i]) for i in range(len(params)) if gpar[i] is not None]
        self.assertTrue(targets or op["type"] == "softmax_cross_entropy")
        for arrays, i, analytic in targets:
            self.assertEqual(analytic.shape, arrays[i].shape, f"{op}: gradient shape")
            numeric = np.zeros(arrays[i].size)
            flat = arrays[i].reshape(-1)
            for j in range(flat.size):
                keep = flat[j]
                flat[j] = keep + eps
                up = loss_of(op, inputs, params, train, w)
                flat[j] = keep - eps
                down = loss_of(op, inputs, params, train, w)
                flat[j] = keep
                numeric[j] = (up - down) / (2 * eps)
            err = np.abs(numeric - analytic.reshape(-1)).max() / max(1.0, np.abs(numeric).max())
            self.assertLess(err, 1e-6, f"{op} argument {i}: finite differences disagree by {err:e}")

    def test_every_operator(self):
        kinds = set()
        for case in CASES:
            with self.subTest(op=case[0]):
                self.check(case)
            kinds.add(case[0]["type"])
        from fusionllm_node.graph import OPS

        self.assertEqual(kinds, set(OPS), "every operator of the IR has a gradient check")

    def test_batch_norm_updates_running_statistics_with_the_unbiased_variance(self):
        x = RNG.standard_normal((4, 2, 3, 3))
        params = [np.ones(2), np.zeros(2), np.zeros(2), np.ones(2)]
        _, _, upd = ops_numpy.forward({"type": "batch_norm2d", "eps": 1e-5, "momentum": 0.1},
                                      [x], params, True)
        m = ops_numpy.f32(0.1)
        mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3), ddof=1)
        np.testing.assert_allclose(dict(upd)[2], m * mean, rtol=1e-12)
        np.testing.assert_allclose(dict(upd)[3], (1 - m) + m * var, rtol=1e-12)

    def test_out_of_range_ids_are_refused(self):
        from fusionllm_node.errors import OpError

        with self.assertRaises(OpError):
            ops_numpy.forward({"type": "embedding"}, [np.array([[0, 9]])], [np.zeros((4, 2))], True)


class TorchAgrees(unittest.TestCase):
    def test_torch_backend_matches_numpy(self):
        try:
            import torch  # noqa: F401
        except ImportError:
            self.skipTest("PyTorch is not installed (the torch backend is optional)")
        from fusionllm_node.ops_torch import TorchBackend

        tb = TorchBackend("cpu")
        for case in CASES:
            op, inputs, params, train = make(case)
            y, saved, upd = ops_numpy.forward(op, inputs, params, train)
            w = RNG.standard_normal(y.shape)
            gin, gpar = ops_numpy.backward(op, inputs, params, saved, w, train)
            t_in = [tb.ids(x, x.shape) if x.dtype != np.float64 else tb.upload(x, x.shape) for x in inputs]
            t_par = [tb.upload(p, p.shape) for p in params]
            ty, tsaved, tupd = tb.forward(op, t_in, t_par, train)
            np.testing.assert_allclose(tb.download(ty), y.reshape(-1), rtol=1e-9, atol=1e-12, err_msg=str(op))
            for (s, a), (ts, b) in zip(upd, tupd):
                self.assertEqual(s, ts)
                np.testing.assert_allclose(tb.download(b), a.reshape(-1), rtol=1e-9, atol=1e-12)
            tgin, tgpar = tb.backward(op, t_in, t_par, tsaved, tb.upload(w, w.shape), train)
            for a, b in list(zip(gin, tgin)) + list(zip(gpar, tgpar)):
                self.assertEqual(a is None, b is None, str(op))
                if a is not None:
                    np.testing.assert_allclose(tb.download(b), a.reshape(-1), rtol=1e-8, atol=1e-10,
                                               err_msg=str(op))


if __name__ == "__main__":
    unittest.main()
