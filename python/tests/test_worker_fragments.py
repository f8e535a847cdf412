"""Streaming islands in the Python node: the assignment's fragments are checked as the Rust node
checks them, a synchronisation takes one fragment's tensors, and every ring set a stage may run
has edges of its own, laid out as the Rust nodes lay them out (the whole model's rings first,
then fragment 0's, 1's, ..)."""

import unittest

import numpy as np

from fusionllm_node.errors import ProtocolError
from fusionllm_node.worker import StageWorker


def island(sizes, fragments=3):
    """A bare islands stage of tensors of `sizes` (island 0 of 2), without a graph: what the
    fragment bookkeeping reads."""
    w = StageWorker.__new__(StageWorker)
    w.params = [np.zeros(n, np.float32) for n in sizes]
    w.param_ids = list(range(len(sizes)))
    w.trainable = [True] * len(sizes)
    w.routes = {"shared": []}
    w.outer_cfg = {"fragments": fragments}
    w.island, w.replica, w.replicas = True, 0, 2
    w.fragments = []
    return w


class FragmentsTest(unittest.TestCase):
    def test_assigned_fragments_are_checked(self):
        w = island([10, 5, 5, 20])
        w.set_fragments([0, 1, 1, 2])
        self.assertEqual(w.fragments, [0, 1, 1, 2])
        for bad, why in (([0, 1, 2], "3 for 4 parameters"), ([0, 1, 3, 2], "fragment 3 of a job of 3")):
            with self.assertRaisesRegex(ProtocolError, why):
                island([10, 5, 5, 20]).set_fragments(bad)
        alone = island([10, 5, 5, 20])
        alone.island = False
        with self.assertRaisesRegex(ProtocolError, "not an island of a streaming job"):
            alone.set_fragments([0, 1, 1, 2])

    def test_a_synchronisation_takes_one_fragment(self):
        w = island([10, 5, 5, 20])
        w.set_fragments([0, 1, 1, 2])
        self.assertEqual(w.sync_members(1), [False, True, True, False])
        self.assertEqual(w.sync_members(None), [True] * 4)
        with self.assertRaisesRegex(ProtocolError, "fragment 3 in a job of 3"):
            w.sync_members(3)
        with self.assertRaisesRegex(ProtocolError, "assigned no fragments"):
            island([10, 5, 5, 20]).sync_members(0)

    def test_ring_sets_have_edges_of_their_own(self):
        w = island([10, 5, 5, 20])
        w.set_fragments([0, 1, 1, 2])
        # Whole model: one ring at edges 0-1; fragment 0 at 2-3, 1 at 4-5, 2 at 6-7.
        self.assertEqual(w.all_outer_rings(), [(0, [0, 1, 2, 3]), (2, [0]), (4, [1, 2]), (6, [3])])
        self.assertEqual(dict(w.ring_sets()), {None: 0, 0: 2, 1: 4, 2: 6})


if __name__ == "__main__":
    unittest.main()
