"""Shard files and the node's store: what is written reads back, corrupt or mismatched files are
refused by name, and only the steps the broker still needs are kept."""

import os
import tempfile
import unittest

import numpy as np

from fusionllm_node import shards
from fusionllm_node.errors import ProtocolError


class Store(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.store = shards.ShardStore(self.dir.name)

    def tearDown(self):
        self.dir.cleanup()

    def put(self, run, step, shard="s0"):
        p = self.store.prepare(run, step, shard)
        with open(p, "wb") as f:
            f.write(b"x")
        self.store.commit(p, f"sha{step}")

    def test_only_the_steps_to_keep_stay_and_never_a_newer_one_goes(self):
        for step in (3, 6, 9):
            self.put("run1", step)
        self.put("run0", 1)
        self.store.retain("run1", [6, 9])
        with self.assertRaises(shards.ShardError):
            self.store.find("run1", 3, "s0")
        self.assertEqual(self.store.find("run1", 9, "s0")[2], "sha9")
        self.assertFalse(os.path.exists(os.path.join(self.dir.name, "run0")))
        self.put("run1", 12)
        self.store.retain("run1", [6])  # a late answer to an abandoned snapshot: nothing goes
        self.store.find("run1", 9, "s0")
        self.store.retain("run1", [12])
        with self.assertRaises(shards.ShardError):
            self.store.find("run1", 6, "s0")
        self.store.find("run1", 12, "s0")

    def test_names_outside_the_alphabet_are_refused(self):
        for run, shard in (("../x", "s0"), ("run", "a/b"), ("", "s0"), ("r" * 129, "s0")):
            with self.assertRaises(ProtocolError):
                self.store.path(run, 1, shard)


class Files(unittest.TestCase):
    def test_a_stage_round_trips_and_a_corrupt_copy_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            store = shards.ShardStore(d)
            values = [np.arange(6, dtype=np.float32), np.ones(2, np.float32)]
            first = [np.full(6, 0.5, np.float32), np.zeros(0, np.float32)]
            second = [np.full(6, 0.25, np.float32), np.zeros(0, np.float32)]
            copy = (["w", "bn.mean"], [(2, 3), (2,)], [True, False], True, values, first, second)
            path, size, sha = shards.save_copy(store, copy, "run", 4, "stage-000")
            self.assertEqual(os.path.getsize(path), size)
            got = shards.read_safetensors(path, "stage-000")
            self.assertEqual(sorted(got), ["opt.first.w", "opt.second.w", "param.bn.mean", "param.w"])
            np.testing.assert_array_equal(got["param.w"], values[0])

            class W:  # the parts of a stage worker load_stage fills
                class graph:
                    params = [type("P", (), {"name": "w"}), type("P", (), {"name": "bn.mean"})]

                params = [np.zeros(6, np.float32), np.zeros(2, np.float32)]

                class opt:
                    first = [np.zeros(6, np.float32), np.zeros(0, np.float32)]
                    second = [np.zeros(6, np.float32), np.zeros(0, np.float32)]

            filled = shards.load_stage(store, W, "run", 4, ["stage-000"], [sha])
            self.assertEqual(filled, [[True, True, True], [True, False, False]])
            np.testing.assert_array_equal(W.opt.second[0], second[0])
            with open(path, "r+b") as f:
                f.seek(size - 1)
                f.write(b"\x7f")
            with self.assertRaises(shards.ShardError) as cm:
                shards.load_stage(store, W, "run", 4, ["stage-000"], [sha])
            self.assertIn("corrupt", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
