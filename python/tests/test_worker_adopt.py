"""Island-local recovery in the Python node: a worker kept through a reassignment takes over its
predecessor's training state but not the overlapped exchange that was under way (its ring held
the island taken out), so the next synchronisation measures the island's progress from the anchor
and carries the dropped round, as the Rust node does."""

import unittest

import numpy as np

from fusionllm_node.errors import ProtocolError
from fusionllm_node.worker import StageWorker


def stage(sizes, ids=None):
    """A bare islands stage of tensors of `sizes`: what adopt_state reads and writes."""
    w = StageWorker.__new__(StageWorker)
    w.stage = 0
    w.params = [np.zeros(n, np.float32) for n in sizes]
    w.param_ids = list(ids if ids is not None else range(len(sizes)))
    w.opt = None
    w.buffers_before = None
    w.anchor, w.momentum = None, None
    w.pending, w.round_start = None, None
    return w


class AdoptStateTest(unittest.TestCase):
    def test_the_kept_state_drops_the_exchange_under_way(self):
        old = stage([3, 2])
        old.params = [np.array([1, 2, 3], np.float32), np.array([4, 5], np.float32)]
        old.anchor = [np.zeros(3, np.float32), np.zeros(2, np.float32)]
        old.momentum = [np.ones(3, np.float32), np.ones(2, np.float32)]
        old.opt = object()
        # An overlapped exchange under way (its thread and result box) and the round it began.
        old.pending = (None, {"mean": [np.ones(3, np.float32), None]})
        old.round_start = [np.full(3, 0.5, np.float32), None]
        old.buffers_before = [(1, np.array([7, 7], np.float32))]
        new = stage([3, 2])
        # Whatever the new worker held is replaced, not kept beside the old state.
        new.pending, new.round_start = old.pending, old.round_start
        new.adopt_state(old)
        self.assertIsNone(new.pending, "the old placement's exchange is not applied later")
        self.assertIsNone(new.round_start, "every start is back at the anchor")
        self.assertIs(new.opt, old.opt)
        self.assertIs(new.anchor, old.anchor)
        self.assertIs(new.momentum, old.momentum)
        np.testing.assert_array_equal(new.params[0], [1, 2, 3])
        np.testing.assert_array_equal(new.params[1], [7, 7])
        # The next synchronisation's delta is measured from the anchor, so it holds the dropped
        # round's progress too (from the old start, 0.5, it would be -0.5, -1.5, -2.5).
        delta = new.round_deltas([True, False])
        np.testing.assert_array_equal(delta[0], [-1, -2, -3])
        self.assertIsNone(delta[1])

    def test_a_state_of_other_parameters_is_refused(self):
        old = stage([3, 2], ids=[4, 5])
        old.stage = 1
        with self.assertRaisesRegex(ProtocolError, r"stage 0 .*\(stage 1 held here\)"):
            stage([3, 2], ids=[0, 1]).adopt_state(old)
        with self.assertRaisesRegex(ProtocolError, "other parameters"):
            stage([3, 2]).adopt_state(stage([3, 4]))


if __name__ == "__main__":
    unittest.main()
