"""What the stage is doing, for the heartbeats' `Progress` (docs/PROTOCOL.md, "Progress and
stalls"): the phase, the peer waited on, a counter that moves whenever anything happens, and the
tensors started, sent and received per peer in this generation."""

import threading

from .wire import fusionllm_control_pb2 as cpb

PHASES = {
    "idle": cpb.PHASE_IDLE,
    "computing": cpb.PHASE_COMPUTING,
    "waiting": cpb.PHASE_WAITING,
    "sending": cpb.PHASE_SENDING,
    "updating": cpb.PHASE_UPDATING,
    "saving": cpb.PHASE_SAVING,
}


class Progress:
    def __init__(self):
        self._lock = threading.Lock()
        self.active = False
        self.generation = 0
        self.step = 0
        self.phase = "idle"
        self.micro_batch = 0
        self.waiting_for = ""
        self.counter = 0
        self.peers = {}  # peer -> [sent, received, started]
        self._saved = None

    def start_generation(self, generation):
        """Starts reporting `generation`; returns the Handle its stage, senders and sessions
        report through (a handle of an older generation changes nothing)."""
        with self._lock:
            self.active = True
            self.generation = generation
            self.phase, self.waiting_for, self.micro_batch = "idle", "", 0
            self.peers = {}
            self.counter += 1
        return Handle(self, generation)

    def stop(self):
        with self._lock:
            self.active = False

    def _current(self, gen):
        """Whether an update of generation `gen` (None: the tracker's own) applies; under the lock."""
        return gen is None or (self.active and gen == self.generation)

    def enter(self, phase, step, micro_batch=0, peer="", gen=None):
        with self._lock:
            if not self._current(gen):
                return
            if phase in ("waiting", "sending"):
                self._saved = (self.phase, self.micro_batch)
            self.phase, self.step, self.micro_batch, self.waiting_for = phase, step, micro_batch, peer
            self.counter += 1

    def resume(self, gen=None):
        with self._lock:
            if not self._current(gen):
                return
            if self._saved:
                self.phase, self.micro_batch = self._saved
                self._saved = None
            self.waiting_for = ""
            self.counter += 1

    def idle(self, gen=None):
        with self._lock:
            if not self._current(gen):
                return
            self.phase, self.waiting_for = "idle", ""
            self.counter += 1

    def _bump(self, peer, i, gen=None):
        with self._lock:
            if not self._current(gen):
                return
            self.peers.setdefault(peer, [0, 0, 0])[i] += 1
            self.counter += 1

    def sent(self, peer, gen=None):
        self._bump(peer, 0, gen)

    def received(self, peer, gen=None):
        self._bump(peer, 1, gen)

    def started(self, peer, gen=None):
        self._bump(peer, 2, gen)

    def chunk(self, gen=None):
        with self._lock:
            if self._current(gen):
                self.counter += 1

    def message(self):
        """The `Progress` of a heartbeat, or None before the first assignment."""
        with self._lock:
            if not self.active:
                return None
            return cpb.Progress(
                generation=self.generation, step=self.step, phase=PHASES[self.phase],
                micro_batch=self.micro_batch, waiting_for=self.waiting_for, counter=self.counter,
                peers=[cpb.PeerTensors(peer=p, sent=s, received=r, started=st)
                       for p, (s, r, st) in sorted(self.peers.items())])


class Handle:
    """One generation's view of the Progress: updates from threads of an abandoned generation
    (a compute thread left to notice its poisoned mailbox, an old session) are dropped, so the
    broker's stall detection reads only the current assignment."""

    def __init__(self, tracker, generation):
        self.tracker, self.generation = tracker, generation

    def _call(self, name, *args):
        # The tracker checks the generation under its lock: an update racing a new assignment
        # cannot land in the new generation's counts.
        getattr(self.tracker, name)(*args, gen=self.generation)

    def enter(self, phase, step, micro_batch=0, peer=""):
        self._call("enter", phase, step, micro_batch, peer)

    def resume(self):
        self._call("resume")

    def idle(self):
        self._call("idle")

    def sent(self, peer):
        self._call("sent", peer)

    def received(self, peer):
        self._call("received", peer)

    def started(self, peer):
        self._call("started", peer)

    def chunk(self):
        self._call("chunk")


class Detached:
    """A handle that reports nowhere (profiling, tests)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None
