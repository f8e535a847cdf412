"""The node's data plane: a TLS listener that admits only the senders the assignment names (with
the certificates they joined with) and delivers their tensors in stream order, per-peer senders
that heal broken sessions by re-sending the step's tensors, and link probes."""

import logging
import queue
import socket
import ssl
import struct
import threading
import time

import numpy as np

from . import codec
from .errors import NodeError, ProtocolError, Refused
from .transport import (Closed, FrameStream, Stalled, accept_hello, admitted, dial, goodbye, hello,
                        recv_tensor, send_tensor)
from .wire import fusionllm_pb2 as pb

log = logging.getLogger("fusionllm_node")

ASSIGNMENT_WAIT = 120.0
MAX_SESSIONS_PER_PEER = 16
OUTBOX_DEPTH = 32
MAX_HEALS = 8
HEAL_WINDOW = 20.0
PROBE_FRAMES = 1024
PROBE_REPLY_TIMEOUT = 20.0
MAX_CONNECTIONS = 1024
MAX_PER_ADDRESS = 64
DIRECTIONS = {pb.ACTIVATION: "activation", pb.GRADIENT: "gradient",
              pb.PARAM_GRADIENT: "param_gradient", pb.ALL_REDUCE: "all_reduce",
              pb.OUTER_EXCHANGE: "outer_exchange"}


class Inbound:
    """What one assignment receives: from whom (peer -> stage), their certificate pins, the
    shape of every (direction, edge), and each peer's stream position."""

    def __init__(self, generation, mailbox, senders, pins, expected, progress):
        self.generation = generation
        self.mailbox = mailbox
        self.senders = senders
        self.pins = pins
        self.expected = expected
        self.progress = progress
        values = sum(int(np.prod(s)) for s in expected.values())
        self.budget = (64 << 20) + 16 * values
        self.streams = {}  # peer -> [sessions, next_seq]
        self.lock = threading.Lock()

    def admit(self, peer):
        with self.lock:
            st = self.streams.setdefault(peer, [0, 0])
            if st[0] >= MAX_SESSIONS_PER_PEER:
                return f"'{peer}' opened {MAX_SESSIONS_PER_PEER} sessions in this generation already"
            st[0] += 1
            return None

    def deliver(self, peer, stage, header, data):
        n = int(np.prod(header.shape)) if header.shape else 1
        where = f"bad data from {peer} (stage {stage}), edge {header.edge}"
        if header.dtype == pb.COMPRESSED:
            try:
                values = codec.decode(data, n)
            except (ProtocolError, ValueError, struct.error) as e:
                self._fail(f"{where}: {e}", peer)
        elif header.dtype == pb.F64:
            values = np.frombuffer(data, "<f8").astype(np.float64)
        else:
            values = np.frombuffer(data, "<f4").astype(np.float32)
        if not np.isfinite(values).all():
            self._fail(f"bad data from {peer} (stage {stage}): edge {header.edge}: non-finite values", peer)
        key = (header.step, header.micro_batch, header.direction, header.edge, stage)
        with self.lock:
            st = self.streams[peer]
            if header.seq < st[1]:
                return
            if header.seq > st[1]:
                msg = f"{peer} sent tensor #{header.seq} where #{st[1]} was due"
                self.mailbox.poison(msg, peer, False)
                raise ProtocolError(msg)
            try:
                self.mailbox.put(key, values)
            except ProtocolError as e:
                self._fail(f"from {peer}: {e}", peer)
            st[1] += 1
        self.progress.received(peer)

    def _fail(self, msg, peer):
        self.mailbox.poison(msg, peer, True)
        raise ProtocolError(msg)


class DataPlane:
    def __init__(self, identity, node_id, token, listen, backend_name, version, store):
        self.identity, self.node_id, self.token = identity, node_id, token
        self.backend_name, self.version = backend_name, version
        self.open_total, self.open_by_address = 0, {}
        host, _, port = listen.rpartition(":")
        self.listener = socket.create_server((host.strip("[]") or "0.0.0.0", int(port)), backlog=64)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.server_ctx = identity.server_context()
        self.current = None
        self.probers = {}  # peer -> pin, from the current ProbeLinks round
        self.fetchers = {}  # peer -> pin, from the latest AllowFetch
        self.store = store
        self.lock = threading.Lock()
        threading.Thread(target=self._accept_loop, daemon=True, name="accept").start()

    def set_inbound(self, inbound):
        with self.lock:
            old, self.current = self.current, inbound
        if old is not None:
            old.mailbox.poison("the assignment changed")

    def allow_probers(self, peers):
        with self.lock:
            self.probers = dict(peers)

    def allow_fetchers(self, peers):
        with self.lock:
            self.fetchers = dict(peers)

    def _accept_loop(self):
        while True:
            try:
                sock, addr = self.listener.accept()
            except OSError as e:
                log.warning("accepting a data-plane connection failed: %s", e)
                time.sleep(0.1)
                continue
            if not self._admit_connection(addr[0]):
                log.warning("refused a connection from %s: too many open", addr[0])
                sock.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(sock, addr[0]), daemon=True,
                                 name="session").start()
            except RuntimeError as e:  # no thread to spare: refuse this one, keep accepting
                log.warning("refused a connection from %s: %s", addr[0], e)
                self._release_connection(addr[0])
                sock.close()

    def _admit_connection(self, address):
        """At most MAX_CONNECTIONS open at once, MAX_PER_ADDRESS from one address (before any
        TLS work)."""
        with self.lock:
            if self.open_total >= MAX_CONNECTIONS or self.open_by_address.get(address, 0) >= MAX_PER_ADDRESS:
                return False
            self.open_total += 1
            self.open_by_address[address] = self.open_by_address.get(address, 0) + 1
            return True

    def _release_connection(self, address):
        with self.lock:
            self.open_total -= 1
            left = self.open_by_address.get(address, 1) - 1
            if left:
                self.open_by_address[address] = left
            else:
                self.open_by_address.pop(address, None)

    def _serve(self, sock, address):
        try:
            sock.settimeout(10.0)
            tls = self.server_ctx.wrap_socket(sock, server_side=True)
            fs = FrameStream(tls)
            me = hello(self.node_id, "", 0, self.backend_name, self.version)
            peer = accept_hello(fs, me, self.token)
            if peer.probe:
                self._serve_probe(fs, tls, peer.node_id)
            elif peer.fetch:
                self._serve_fetch(fs, tls, peer.node_id)
            else:
                self._serve_tensors(fs, tls, peer)
        except (NodeError, OSError, ssl.SSLError, ValueError) as e:
            log.debug("a data-plane session ended: %s", e)
        except Exception:  # a bug here must not take the listener down: say so and go on
            log.exception("a data-plane session failed")
        finally:
            self._release_connection(address)
            try:
                sock.close()
            except OSError:
                pass

    def _inbound_for(self, generation):
        deadline = time.monotonic() + ASSIGNMENT_WAIT
        while True:
            with self.lock:
                ib = self.current
            if ib is not None and ib.generation >= generation or time.monotonic() > deadline:
                return ib
            time.sleep(0.1)

    def _serve_tensors(self, fs, tls, peer_hello):
        peer = peer_hello.node_id
        ib = self._inbound_for(peer_hello.generation)
        if ib is None:
            refusal = "this node has no assignment"
        elif ib.generation != peer_hello.generation:
            refusal = f"assignment generation {peer_hello.generation} is not the current {ib.generation}"
        elif peer not in ib.senders:
            refusal = f"'{peer}' does not send to this node"
        else:
            refusal = admitted(tls, peer, ib.pins.get(peer)) or ib.admit(peer)
        if refusal:
            goodbye(fs, refusal)
            log.warning("refused %s: %s", peer, refusal)
            return
        stage = ib.senders[peer]

        def expected(edge, direction):
            return ib.expected.get((direction, edge))

        while True:
            while ib.mailbox.held_from(stage) > ib.budget:
                if ib.mailbox.poisoned():
                    return
                time.sleep(0.01)
            try:
                header, data = recv_tensor(fs, expected)
            except Refused:
                return
            except Closed as e:
                log.debug("the session from %s (stage %d) broke: %s", peer, stage, e)
                return
            except ProtocolError as e:
                ib.mailbox.poison(f"bad data from {peer} (stage {stage}): {e}", peer, True)
                return
            try:
                ib.deliver(peer, stage, header, data)
            except ProtocolError:
                return

    def _serve_fetch(self, fs, tls, peer):
        """A peer the latest AllowFetch names (waited for up to 10 s), with its pinned
        certificate, fetches one shard."""
        from . import shards

        for _ in range(100):
            with self.lock:
                pin = self.fetchers.get(peer)
            refusal = admitted(tls, peer, pin) if pin is not None else f"'{peer}' may not fetch from this node"
            if refusal is None:
                break
            time.sleep(0.1)
        if refusal:
            goodbye(fs, refusal)
            return
        try:
            shards.serve(fs, peer, self.store)
        except NodeError as e:
            log.warning("serving a shard to %s failed: %s", peer, e)

    def _serve_probe(self, fs, tls, peer):
        deadline = time.monotonic() + 10.0
        while True:
            with self.lock:
                pin = self.probers.get(peer)
            refusal = admitted(tls, peer, pin) if pin is not None else f"'{peer}' is not in this node's probe round"
            if refusal is None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if refusal:
            goodbye(fs, refusal)
            return
        for _ in range(PROBE_FRAMES):
            f = fs.read(wait=PROBE_REPLY_TIMEOUT)
            kind = f.WhichOneof("body")
            if kind == "goodbye":
                return
            if kind != "probe":
                goodbye(fs, f"a probe session carries probes only, got {kind}")
                return
            fs.write(pb.Frame(probe_reply=pb.ProbeReply(seq=f.probe.seq, received=len(f.probe.payload))),
                     timeout=PROBE_REPLY_TIMEOUT)

    def probe(self, peer_id, address, pin, max_bytes):
        """(bytes per second, one-way latency in seconds, payload bytes) of the link to a peer:
        three empty probes time the round trip, then payloads from 64 KB, four times larger each
        time up to `max_bytes`, until one takes 60 ms beyond the round trip."""
        me = hello(self.node_id, self.token, 0, self.backend_name, self.version, probe=True)
        fs, _ = dial(self.identity, peer_id, address, pin, me)
        try:
            seq, rtt = 0, float("inf")
            for _ in range(3):
                t0 = time.monotonic()
                seq = self._probe_payload(fs, seq, 0)
                self._probe_reply(fs, peer_id, seq)
                rtt = min(rtt, time.monotonic() - t0)
            cap = max(1, max_bytes)
            size = min(64 * 1024, cap)
            while True:
                t0, first = time.monotonic(), seq + 1
                seq = self._probe_payload(fs, seq, size)
                got = sum(self._probe_reply(fs, peer_id, s) for s in range(first, seq + 1))
                if got != size:
                    raise ProtocolError(f"{peer_id} acknowledged {got} of {size} probe bytes")
                transfer = max(time.monotonic() - t0 - rtt, 1e-6)
                if transfer >= 0.06 or size >= cap:
                    goodbye(fs, "probe done")
                    return size / transfer, rtt / 2, size
                size = min(size * 4, cap)
        finally:
            fs.close()

    @staticmethod
    def _probe_payload(fs, seq, size):
        left = size
        while True:
            n = min(left, 4 << 20)
            seq += 1
            fs.write(pb.Frame(probe=pb.Probe(seq=seq, payload=bytes(n))), timeout=PROBE_REPLY_TIMEOUT)
            left -= n
            if left == 0:
                return seq

    @staticmethod
    def _probe_reply(fs, peer, seq):
        f = fs.read(wait=PROBE_REPLY_TIMEOUT)
        if f.WhichOneof("body") == "probe_reply" and f.probe_reply.seq == seq:
            return f.probe_reply.received
        if f.WhichOneof("body") == "goodbye":
            raise Refused(f"{peer} refused the probe: {f.goodbye.reason}")
        raise ProtocolError(f"{peer} answered probe {seq} with something else")

    def connect(self, generation, peers, mailbox, stall, progress):
        """An Outbox with one session per peer (PeerLink) of this generation; if a peer cannot
        be reached, the sessions already open are closed."""
        senders = {}
        try:
            for p in peers:
                s = PeerSender(self, generation, p, mailbox, stall, progress)
                s.open()
                senders[p.stage] = s
        except BaseException:
            for s in senders.values():
                s.close()
            raise
        return Outbox(senders, mailbox, progress)


class PeerSender:
    """One peer's sending side: a bounded queue and the one thread that owns the session (it
    writes the tensors in order, and between them watches the session: a Goodbye from the
    receiver refuses it for good, an end breaks it and it is re-opened at once, with the current
    step's tensors sent again)."""

    def __init__(self, plane, generation, link, mailbox, stall, progress):
        self.plane, self.generation, self.link = plane, generation, link
        self.peer = link.node_id
        self.mailbox, self.stall, self.progress = mailbox, stall, progress
        self.queue = queue.Queue(OUTBOX_DEPTH)
        self.bytes = 0
        self.tensors = 0
        self.fs = None
        self.replay = []  # (step, header, data) of the current step
        self.next_seq = 0
        self.heals = 0
        self.closing = False

    def _dial(self):
        me = hello(self.plane.node_id, self.plane.token, self.generation,
                   self.plane.backend_name, self.plane.version)
        self.fs, _ = dial(self.plane.identity, self.peer, self.link.address,
                          self.link.certificate_sha256, me)

    def open(self):
        self._dial()
        try:
            threading.Thread(target=self._loop, daemon=True, name=f"send-{self.peer}").start()
        except RuntimeError:
            self.fs.close()
            raise

    def _loop(self):
        try:
            while self._next():
                pass
        except Exception as e:  # a dead sender must fail the step, not leave it waiting on its queue
            log.exception("the sender to %s failed", self.peer)
            self._fail(f"{type(e).__name__}: {e}")
        finally:
            if self.fs:
                self.fs.close()

    def _next(self):
        """Handles one tensor, or one look at the idle session; False when the sender is done."""
        try:
            item = self.queue.get(timeout=0.2)
        except queue.Empty:
            # Closing: the queued None ends the thread (after a Goodbye), not an idle moment.
            return self.closing or self._watch()
        if item is None:
            goodbye(self.fs, "the assignment ended")
            return False
        step, header, data = item
        self.progress.started(self.peer)
        if self.replay and self.replay[0][0] != step:
            self.replay = []
        header.seq = self.next_seq
        self.next_seq += 1
        self.replay.append((step, header, data))
        try:
            self._check_session()
            send_tensor(self.fs, header, data, self.stall, self.progress.chunk)
        except (Closed, ProtocolError, Refused) as e:
            if not self._heal(e):
                return False
        self.progress.sent(self.peer)
        return True

    def _watch(self):
        try:
            self._check_session()
            return True
        except (Closed, ProtocolError, Refused) as e:
            return self._heal(e)

    def _check_session(self):
        """Raises Refused for a receiver's Goodbye, Closed for an ended session (or anything else
        it wrote: a receiver writes nothing after its Hello, so that is a broken session too)."""
        if not self.fs.readable():
            return
        try:
            f = self.fs.read(wait=1.0)
        except ProtocolError as e:
            raise Closed(f"the session broke: {e}") from None
        if f.WhichOneof("body") == "goodbye":
            raise Refused(f"{self.peer} refused the session: {f.goodbye.reason}")
        raise Closed(f"{self.peer} wrote {f.WhichOneof('body')} into a session it receives on")

    def _fail(self, why):
        if not self.mailbox.poisoned():
            self.mailbox.poison(f"sending to {self.peer} failed: {why}", self.peer, False)
        return False

    def _heal(self, cause):
        """Re-opens a broken session and sends the step's tensors again, for up to 20 s; a
        refusal, a stalled write or the ninth break fails the step instead (suspecting the
        peer)."""
        why = str(cause)
        if self.mailbox.poisoned():
            return False
        if isinstance(cause, (Refused, Stalled)) or not isinstance(cause, Closed) or self.heals >= MAX_HEALS:
            return self._fail(why)
        self.heals += 1
        log.warning("the session to %s broke (%s); re-opening it", self.peer, why)
        until, pause = time.monotonic() + HEAL_WINDOW, 0.1
        while time.monotonic() < until and not self.mailbox.poisoned():
            try:
                self.fs.close()
                self._dial()
            except (Closed, ProtocolError, Refused) as e:  # any failure to open is retried
                why = str(e)
                time.sleep(pause)
                pause = min(pause * 2, 2.0)
                continue
            try:
                for _, h, d in self.replay:
                    send_tensor(self.fs, h, d, self.stall, self.progress.chunk)
                return True
            except Stalled as e:
                return self._fail(str(e))
            except (Closed, ProtocolError) as e:
                why = str(e)
        return self._fail(why)

    def close(self):
        """Ends the sender from another thread: a Goodbye after what is queued, or, when the
        queue is full (a stuck receiver), the socket shut down under the sending thread (which
        alone closes it)."""
        self.closing = True
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            fs = self.fs
            if fs is not None:
                try:
                    socket.socket.shutdown(fs.sock, socket.SHUT_RDWR)
                except OSError:
                    pass


class Outbox:
    """Hands tensors to the per-peer senders (compressed where the broker says), blocking the
    compute thread while a peer's queue is full, until the step is abandoned."""

    def __init__(self, senders, mailbox, progress):
        self.senders = senders
        self.mailbox = mailbox
        self.progress = progress
        self.compression = codec.LinkCompression()

    def send(self, to, step, micro_batch, direction, edge, shape, values, report=True):
        s = self.senders.get(to)
        if s is None:
            raise ProtocolError(f"no data-plane session to stage {to}")
        msg = self.compression.compress(to, DIRECTIONS[direction], edge, step, values)
        if msg is not None:
            dtype, data = pb.COMPRESSED, msg
        elif values.dtype == np.float64:
            dtype, data = pb.F64, values.astype("<f8").tobytes()
        else:
            dtype, data = pb.F32, values.astype("<f4").tobytes()
        header = pb.TensorHeader(step=step, micro_batch=micro_batch, edge=edge, direction=direction,
                                 dtype=dtype, shape=list(shape))
        self._queue(s, step, micro_batch, header, data, report)

    def _queue(self, s, step, micro_batch, header, data, report=True):
        """Queues a tensor, waiting while the peer's queue is full; with `report` the wait shows
        in the node's progress (not from an overlapped outer exchange's thread)."""
        s.bytes += len(data)
        s.tensors += 1
        blocked = False
        while True:
            try:
                s.queue.put((step, header, data), timeout=0.01)
                break
            except queue.Full:
                if not blocked and report:
                    self.progress.enter("sending", step, micro_batch, s.peer)
                blocked = True
                self.mailbox.check()
        if blocked and report:
            self.progress.resume()

    def send_encoded(self, to, step, micro_batch, direction, edge, shape, message, report=True):
        """Queues a message this node encoded itself as a compressed tensor of `shape`."""
        s = self.senders.get(to)
        if s is None:
            raise ProtocolError(f"no data-plane session to stage {to}")
        header = pb.TensorHeader(step=step, micro_batch=micro_batch, edge=edge, direction=direction,
                                 dtype=pb.COMPRESSED, shape=list(shape))
        self._queue(s, step, micro_batch, header, message, report)

    def take_sent(self):
        out = []
        for s in self.senders.values():
            out.append((s.peer, s.bytes, s.tensors))
            s.bytes = s.tensors = 0
        return sorted(out)

    def close(self):
        for s in self.senders.values():
            s.close()
