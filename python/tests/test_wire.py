"""What the node reads from outside (compressed tensors, stage graphs, plans, frames) is checked
before use; the optimizer computes what the Rust nodes compute."""

import json
import struct
import unittest

import numpy as np

from fusionllm_node import codec
from fusionllm_node.errors import ProtocolError
from fusionllm_node.graph import parse_graph
from fusionllm_node.optim import Optimizer, powi
from fusionllm_node.plan import Plan, passes


def header(kind, vt, n):
    return struct.pack("<BBBBQ", codec.MAGIC, codec.VERSION, kind, vt, n)


class CompressedTensors(unittest.TestCase):
    x = np.linspace(-3, 3, 50).astype(np.float32)

    def test_every_codec_round_trips_within_its_precision(self):
        for c, tol in [({"kind": "none"}, 0), ({"kind": "fp16"}, 2e-3), ({"kind": "bf16"}, 1e-2),
                       ({"kind": "int8", "block": 16}, 3.0 / 127), ({"kind": "top_k", "density": 1.0}, 0)]:
            msg = codec.Compressor(c, "f32", 0).compress(self.x)
            back = codec.decode(msg, self.x.size)
            self.assertLessEqual(np.abs(back - self.x).max(), tol + 1e-7, c)

    def test_top_k_keeps_the_largest_magnitudes(self):
        msg = codec.Compressor({"kind": "top_k", "density": 0.1}, "f32", 0).compress(self.x)
        back = codec.decode(msg, self.x.size)
        kept = np.flatnonzero(back)
        self.assertEqual(len(kept), 5)
        self.assertTrue(set(kept) <= set(np.argsort(-np.abs(self.x))[:6]))

    def test_malformed_messages_are_refused_with_the_reason(self):
        good = codec.encode_dense(self.x, codec.F32)
        cases = {
            "bad magic": b"\x00" + good[1:],
            "format version 9": good[:1] + b"\x09" + good[2:],
            "51 elements announced": header(0, 0, 51) + good[12:],
            "needs 200 bytes": good[:-4],
            "unknown message kind": header(7, 0, 50) + good[12:],
            "exceeds the 50": header(1, 0, 50) + struct.pack("<QBQ", 51, 0, 0),
            "strictly increase": header(1, 0, 50) + struct.pack("<QBQ", 2, 0, 8)
            + struct.pack("<II", 3, 3) + struct.pack("<ff", 1, 2),
            "not finite": header(0, 0, 1) + struct.pack("<f", float("inf")),
            "is negative": header(2, 3, 2) + struct.pack("<I", 256) + struct.pack("<f", -1.0) + b"\x01\x01",
            "overflows": header(2, 3, 2) + struct.pack("<I", 256) + struct.pack("<f", 3e37) + b"\x01\x01",
            "block size 0": header(2, 3, 2) + struct.pack("<I", 0) + struct.pack("<f", 1.0) + b"\x01\x01",
        }
        for why, msg in cases.items():
            n = 1 if why == "not finite" else (2 if msg[2] == 2 else 50)
            with self.assertRaises(codec.Malformed, msg=why) as cm:
                codec.decode(msg, n)
            self.assertIn(why, str(cm.exception))

    def test_random_corruptions_raise_malformed_and_nothing_else(self):
        rng = np.random.default_rng(3)
        seeds = [codec.Compressor(c, v, 0).compress(self.x) for c, v in [
            ({"kind": "fp16"}, "f32"), ({"kind": "int8", "block": 8}, "f32"),
            ({"kind": "top_k", "density": 0.1}, "f32"), ({"kind": "top_k", "density": 0.5}, "i8"),
            ({"kind": "top_k", "density": 0.02}, "bf16")]]
        for i in range(3000):
            msg = bytearray(seeds[i % len(seeds)])
            for _ in range(rng.integers(1, 4)):
                op = rng.integers(0, 3)
                if op == 0 and msg:
                    msg[rng.integers(0, len(msg))] = rng.integers(0, 256)
                elif op == 1 and msg:
                    del msg[rng.integers(0, len(msg)):]
                else:
                    msg += bytes(rng.integers(0, 256, rng.integers(1, 9)).tolist())
            try:
                v = codec.decode(bytes(msg), self.x.size)
                self.assertTrue(np.isfinite(v).all())
            except codec.Malformed:
                pass

    def test_error_feedback_carries_what_was_not_sent(self):
        link = codec.LinkCompression()
        link.set({"peers": [{"stage": 1, "forward": {"kind": "none"},
                             "backward": {"kind": "top_k", "density": 0.1}}],
                  "error_feedback": True, "warmup_steps": 0, "values": "f32", "selection": "exact"})
        self.assertIsNone(link.compress(1, "activation", 5, 0, self.x))
        total = np.zeros(self.x.size, np.float32)
        for _ in range(20):
            total += codec.decode(link.compress(1, "gradient", 5, 0, self.x), self.x.size)
        # Nothing is lost: what was sent plus what is held back is everything the steps gave.
        (residual,) = link.residuals.values()
        np.testing.assert_allclose(total + residual, 20 * self.x, atol=1e-4)
        # Without feedback only the same top 10% would ever arrive; with it, far more does.
        self.assertGreater(np.count_nonzero(total), 3 * 5)


GRAPH = {
    "format": "fusionllm.opdag", "version": 1, "name": "g",
    "tensors": [{"name": "x", "shape": [2, 3], "dtype": "f32"}, {"name": "a", "shape": [2, 3], "dtype": "f32"},
                {"name": "b", "shape": [2, 3], "dtype": "f32"}, {"name": "c", "shape": [2, 3], "dtype": "f32"}],
    "params": [],
    "nodes": [{"name": "r", "op": {"type": "relu"}, "inputs": [0], "outputs": [1], "params": []},
              {"name": "g", "op": {"type": "gelu"}, "inputs": [0], "outputs": [2], "params": []},
              {"name": "s", "op": {"type": "add"}, "inputs": [1, 2], "outputs": [3], "params": []}],
    "inputs": [0], "outputs": [3],
}


class Graphs(unittest.TestCase):
    def test_a_valid_graph_parses_in_kahn_order(self):
        self.assertEqual(parse_graph(json.dumps(GRAPH)).order, [0, 1, 2])

    def test_malformed_graphs_are_refused_with_the_reason(self):
        def bad(change, why):
            g = json.loads(json.dumps(GRAPH))
            change(g)
            with self.assertRaises(ProtocolError) as cm:
                parse_graph(json.dumps(g))
            self.assertIn(why, str(cm.exception))

        bad(lambda g: g.update(format="onnx"), "format")
        bad(lambda g: g["nodes"][0].update(op={"type": "warp"}), "unknown operator")
        bad(lambda g: g["nodes"][2].update(inputs=[1, 9]), "tensor #9")
        bad(lambda g: g["nodes"][2].update(inputs=[1]), "has 1 inputs")
        bad(lambda g: g["nodes"][0].update(inputs=[3]), "cycle")
        bad(lambda g: g["nodes"][1].update(outputs=[1]), "two producers")
        bad(lambda g: g.update(tensors="x"), "malformed")
        with self.assertRaises(ProtocolError):
            parse_graph("{not json")


class Plans(unittest.TestCase):
    PLAN = {"assignment": [0, 1], "stage_nodes": ["a", "b"], "stage_params": [[], []],
            "stages": [{"inputs": [{"tensor": 0, "source": "data"}],
                        "outputs": [{"tensor": 1, "consumers": [1], "graph_output": None}], "shared": []},
                       {"inputs": [{"tensor": 1, "source": {"stage": 0}}],
                        "outputs": [{"tensor": 2, "consumers": [], "graph_output": 0}], "shared": []}]}

    def test_routes_and_senders(self):
        p = Plan(json.dumps(self.PLAN), 1)
        self.assertEqual(p.senders_to(1), [0])
        self.assertEqual(p.senders_to(0), [1])

    def test_out_of_range_stages_are_refused(self):
        bad = json.loads(json.dumps(self.PLAN))
        bad["stages"][1]["inputs"][0]["source"] = {"stage": 7}
        with self.assertRaises(ProtocolError):
            Plan(json.dumps(bad), 1)
        with self.assertRaises(ProtocolError):
            Plan(json.dumps(self.PLAN), 2)

    def test_schedules_run_every_pass_once_forward_first(self):
        self.assertEqual(passes("1f1b", 0, 4, 6)[:5], [("f", 0), ("f", 1), ("f", 2), ("f", 3), ("b", 0)])
        self.assertEqual(passes("1f1b", 3, 4, 2), [("f", 0), ("b", 0), ("f", 1), ("b", 1)])
        self.assertEqual(passes("gpipe", 1, 2, 2), [("f", 0), ("f", 1), ("b", 0), ("b", 1)])


class Optimizers(unittest.TestCase):
    def test_adamw_first_step_moves_by_lr(self):
        opt = Optimizer({"kind": "adam_w", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}, [2])
        p = [np.array([1.0, -1.0], np.float32)]
        opt.update(p, [np.array([0.5, -2.0], np.float32)], [True], 0.1)
        np.testing.assert_allclose(p[0], [0.9, -0.9], atol=1e-6)

    def test_adamw_decay_applies_to_matrices_only(self):
        opt = Optimizer({"kind": "adam_w", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.5}, [1, 1])
        p = [np.array([2.0], np.float32), np.array([2.0], np.float32)]
        opt.update(p, [np.zeros(1, np.float32)] * 2, [True, False], 0.1)
        np.testing.assert_allclose(p[0], [2.0 - 0.1 * 0.5 * 2.0], rtol=1e-6)
        np.testing.assert_allclose(p[1], [2.0])

    def test_sgd_momentum_accumulates(self):
        opt = Optimizer({"kind": "sgd", "momentum": 0.5, "weight_decay": 0.0}, [1])
        p = [np.zeros(1, np.float32)]
        for _ in range(2):
            opt.update(p, [np.ones(1, np.float32)], [True], 1.0)
        np.testing.assert_allclose(p[0], [-2.5])

    def test_powi_is_binary_exponentiation_in_f32(self):
        self.assertEqual(powi(0.9, 1), np.float32(0.9))
        a = np.float32(0.95)
        self.assertEqual(powi(a, 5), np.float32(np.float32(a * a) * np.float32(a * a)) * a)

    def test_unknown_optimizers_are_refused(self):
        with self.assertRaises(ProtocolError):
            Optimizer({"kind": "lion"}, [1])


if __name__ == "__main__":
    unittest.main()
