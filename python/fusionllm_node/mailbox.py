"""Where tensors from peers wait for the compute thread: keyed by (step, micro-batch, direction,
id, sending stage); only this step and the next are accepted, but for outer-exchange pieces,
which are kept from the last exchange begun on; poisoning wakes every waiter with the reason (and
the peer to blame, if any)."""

import threading
import time

from .errors import PeerError, ProtocolError, Superseded
from .wire import fusionllm_pb2 as pb


class Mailbox:
    def __init__(self):
        self._items = {}
        self._held = {}
        self._step = None
        self._outer_from = None
        self._poison = None  # (reason, peer or None, proven)
        self._cv = threading.Condition()

    def begin_step(self, step):
        with self._cv:
            self._step = step
            for k in [k for k in self._items if k[0] < step and k[2] != pb.OUTER_EXCHANGE]:
                self._release(k, self._items.pop(k))

    def begin_outer(self, step):
        with self._cv:
            self._outer_from = step
            for k in [k for k in self._items if k[0] < step and k[2] == pb.OUTER_EXCHANGE]:
                self._release(k, self._items.pop(k))

    def _release(self, key, value):
        self._held[key[4]] = self._held.get(key[4], 0) - value.nbytes

    def put(self, key, value):
        with self._cv:
            now, outer = self._step, key[2] == pb.OUTER_EXCHANGE
            if outer and self._outer_from is not None and key[0] < self._outer_from:
                return
            if now is not None and key[0] < now and not outer:
                return
            # Outer-exchange pieces outlive the steps trained beside their exchange, but no
            # piece is for a step beyond the next (islands move step by step together).
            if now is not None and key[0] > now + 1:
                raise ProtocolError(
                    f"a tensor for step {key[0]} arrived while this node is at step {now} "
                    "(only this step and the next are accepted)")
            if key in self._items:
                raise ProtocolError(f"tensor {key} delivered twice")
            self._items[key] = value
            self._held[key[4]] = self._held.get(key[4], 0) + value.nbytes
            self._cv.notify_all()

    def held_from(self, stage):
        with self._cv:
            return self._held.get(stage, 0)

    def take(self, key, timeout, what, peer):
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                self._raise_if_poisoned()
                if key in self._items:
                    v = self._items.pop(key)
                    self._release(key, v)
                    return v
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerError(peer, f"timed out: waiting for {what} ({peer})", False)
                self._cv.wait(min(left, 0.5))

    def poison(self, reason, peer=None, proven=False):
        with self._cv:
            if self._poison is None:
                self._poison = (reason, peer, proven)
            self._cv.notify_all()

    def poisoned(self):
        with self._cv:
            return self._poison is not None

    def check(self):
        with self._cv:
            self._raise_if_poisoned()

    def _raise_if_poisoned(self):
        if self._poison is None:
            return
        reason, peer, proven = self._poison
        if peer:
            raise PeerError(peer, reason, proven)
        raise Superseded(reason)
