"""The Python node's sum of squares adds in the Rust nodes' order: the broker compares islands'
sums bit for bit, so a mixed job needs the same bits (fusion_train::square_sum's test sums the
same values and asserts the same bits)."""

import struct
import unittest

import numpy as np

from fusionllm_node.worker import square_sum

CHUNK = 1 << 14


def values():
    i = np.arange(CHUNK * 2 + 13, dtype=np.int64)
    x = ((i * 7919) % 2003).astype(np.float32) / np.float32(1001.5) - np.float32(1.0)
    return x + np.float32(1e-3) * (i % 7).astype(np.float32)


class SquareSumTest(unittest.TestCase):
    def test_same_bits_as_the_rust_nodes(self):
        bits = struct.unpack("<Q", struct.pack("<d", square_sum([values()])))[0]
        self.assertEqual(bits, 0x40C557E8E9199605, hex(bits))

    def test_tensors_add_in_order(self):
        a, b = values(), values()[:100]
        self.assertEqual(square_sum([a, b]), square_sum([a]) + square_sum([b]))
        self.assertEqual(square_sum([]), 0.0)
        self.assertEqual(square_sum([np.zeros(0, np.float32)]), 0.0)


if __name__ == "__main__":
    unittest.main()
