"""The data plane against hostile and failing peers, over real TLS on loopback: every check of the
receiver table refuses what it must (with proof against the sender where the protocol says so),
admission refuses strangers, and a sender heals a broken session but never re-opens a refused
one. Certificates come from the Rust test that runs these (FUSIONLLM_TEST_CERTS: node0, node1,
node2 of one CA)."""

import os
import socket
import ssl
import struct
import threading
import time
import unittest
import warnings

import numpy as np

from fusionllm_node import codec
from fusionllm_node.dataplane import DataPlane, Inbound
from fusionllm_node.errors import PeerError, ProtocolError, Refused
from fusionllm_node.mailbox import Mailbox
from fusionllm_node.progress import Detached
from fusionllm_node.shards import ShardStore
from fusionllm_node.transport import FrameStream, Identity, dial, fingerprint, hello
from fusionllm_node.wire import fusionllm_control_pb2 as cpb
from fusionllm_node.wire import fusionllm_pb2 as pb

warnings.simplefilter("ignore", ResourceWarning)

TOKEN = "data-plane-test-token"
EDGE, SHAPE = 3, (2, 3)


def certs():
    # unittest resets the warning filters when it starts: sockets the tests leave to the
    # collector are not what they test.
    warnings.simplefilter("ignore", ResourceWarning)
    d = os.environ.get("FUSIONLLM_TEST_CERTS")
    if not d:
        if os.environ.get("CI") == "true":
            raise RuntimeError("FUSIONLLM_TEST_CERTS is not set (the Rust test sets it)")
        raise unittest.SkipTest("FUSIONLLM_TEST_CERTS is not set (run through cargo test)")
    return {n: Identity(os.path.join(d, f"{n}.pem"), os.path.join(d, f"{n}.key"), os.path.join(d, "ca.pem"))
            for n in ("node0", "node1", "node2")}


class Receiver(unittest.TestCase):
    """node1 receives activation EDGE [2, 3] from node0 (stage 0) in generation 1."""

    @classmethod
    def setUpClass(cls):
        cls.ids = certs()
        cls.store = ShardStore()
        cls.plane = DataPlane(cls.ids["node1"], "node1", TOKEN, "127.0.0.1:0", "numpy-f64", "test", cls.store)

    def setUp(self):
        self.mailbox = Mailbox()
        self.mailbox.begin_step(0)
        pins = {"node0": fingerprint(self.ids["node0"].cert_der)}
        self.plane.set_inbound(Inbound(1, self.mailbox, {"node0": 0}, pins, {(pb.ACTIVATION, EDGE): SHAPE},
                                       Detached()))

    def dial(self, who="node0", token=TOKEN, generation=1):
        me = hello(who, token, generation, "test", "test")
        pin = fingerprint(self.ids["node1"].cert_der)
        fs, _ = dial(self.ids[who], "node1", self.plane.address, pin, me)
        return fs

    def send(self, header, data):
        fs = self.dial()
        fs.write(pb.Frame(header=header))
        for off in range(0, len(data), 1 << 20):
            fs.write(pb.Frame(chunk=pb.TensorChunk(offset=off, data=data[off:off + (1 << 20)])))
        return fs

    def header(self, dtype=pb.F32, shape=SHAPE, total=None, seq=0, step=0):
        n = int(np.prod(shape))
        return pb.TensorHeader(step=step, micro_batch=0, edge=EDGE, direction=pb.ACTIVATION, dtype=dtype,
                               shape=list(shape), total_bytes=4 * n if total is None else total, seq=seq)

    def failure(self):
        """The mailbox's poison as (reason, peer, proven), waited for up to 10 s."""
        for _ in range(200):
            try:
                self.mailbox.check()
            except PeerError as e:
                return str(e), e.peer, e.proven
            time.sleep(0.05)
        self.fail("the mailbox was never poisoned")

    def assert_proof(self, words):
        reason, peer, proven = self.failure()
        self.assertEqual((peer, proven), ("node0", True), reason)
        self.assertIn(words, reason)

    def test_a_good_tensor_is_delivered(self):
        v = np.arange(6, dtype=np.float32)
        self.send(self.header(), v.tobytes())
        got = self.mailbox.take((0, 0, pb.ACTIVATION, EDGE, 0), 10, "tensor", "node0")
        np.testing.assert_array_equal(got, v)

    def test_a_shape_other_than_the_graphs_is_proof(self):
        self.send(self.header(shape=(3, 3)), bytes(36))
        self.assert_proof("does not match the graph's")

    def test_a_byte_count_other_than_the_shapes_is_proof(self):
        self.send(self.header(total=1 << 40), b"")
        self.assert_proof("declares 1099511627776 bytes")

    def test_non_finite_values_are_proof(self):
        self.send(self.header(), np.array([1, 2, np.inf, 4, 5, 6], np.float32).tobytes())
        self.assert_proof("non-finite")

    def test_an_int8_block_size_beyond_the_tensor_is_decoded_without_allocating_per_block(self):
        msg = struct.pack("<BBBBQ", codec.MAGIC, codec.VERSION, codec.INT8, codec.I8, 6)
        msg += struct.pack("<I", 0xFFFFFFFF) + struct.pack("<f", 1.0) + bytes(6)
        self.send(self.header(dtype=pb.COMPRESSED, total=len(msg)), msg)
        got = self.mailbox.take((0, 0, pb.ACTIVATION, EDGE, 0), 10, "tensor", "node0")
        np.testing.assert_array_equal(got, np.zeros(6, np.float32))  # a valid (if odd) message

    def test_a_malformed_compressed_message_is_proof(self):
        msg = b"\x00" * 20
        self.send(self.header(dtype=pb.COMPRESSED, total=len(msg)), msg)
        self.assert_proof("bad magic")

    def test_a_frame_above_the_limit_is_proof(self):
        fs = self.dial()
        fs.sock.sendall(struct.pack(">I", 64 << 20))
        self.assert_proof("above the limit")

    def test_a_tensor_two_steps_ahead_is_proof(self):
        self.send(self.header(step=2), bytes(24))
        self.assert_proof("only this step and the next")

    def test_a_gap_in_the_stream_is_a_suspicion(self):
        self.send(self.header(seq=5), bytes(24))
        reason, peer, proven = self.failure()
        self.assertEqual((peer, proven), ("node0", False))
        self.assertIn("tensor #5 where #0 was due", reason)

    def test_strangers_are_refused_with_the_reason(self):
        with self.assertRaises(Refused) as cm:
            fs = self.dial(token="not-the-token")
            fs.read(wait=5)
        self.assertIn("invalid join token", str(cm.exception))
        for who, generation, words in (("node2", 1, "'node2' does not send to this node"),
                                       ("node0", 0, "assignment generation 0 is not the current 1")):
            fs = self.dial(who=who, generation=generation)
            f = fs.read(wait=10)
            self.assertEqual(f.WhichOneof("body"), "goodbye")
            self.assertIn(words, f.goodbye.reason)


class FakeReceiver:
    """A TLS server as node1 that answers the Hello and then does what `behaviour` says."""

    def __init__(self, ident, behaviour):
        ctx = ident.server_context()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sessions = []
        self.behaviour = behaviour
        threading.Thread(target=self.run, args=(ctx,), daemon=True).start()

    def run(self, ctx):
        while True:
            try:
                raw, _ = self.listener.accept()
                tls = ctx.wrap_socket(raw, server_side=True)
            except (OSError, ssl.SSLError):
                return
            fs = FrameStream(tls)
            fs.read(wait=10)
            fs.write(pb.Frame(hello=hello("node1", "", 0, "fake", "fake")))
            self.sessions.append([])
            threading.Thread(target=self.behaviour, args=(self, fs), daemon=True).start()


class Sender(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ids = certs()
        cls.plane = DataPlane(cls.ids["node0"], "node0", TOKEN, "127.0.0.1:0", "numpy-f64", "test", ShardStore())

    def outbox(self, fake):
        mailbox = Mailbox()
        link = cpb.PeerLink(node_id="node1", address=fake.address, stage=1,
                            certificate_sha256=fingerprint(self.ids["node1"].cert_der))
        return mailbox, self.plane.connect(1, [link], mailbox, 30.0, Detached())

    def test_a_refusal_after_the_hello_is_not_reopened(self):
        def refuse(fake, fs):
            fs.write(pb.Frame(goodbye=pb.Goodbye(reason="'node0' opened 16 sessions in this generation already")))

        fake = FakeReceiver(self.ids["node1"], refuse)
        mailbox, out = self.outbox(fake)
        reason = None
        for _ in range(100):
            try:
                mailbox.check()
            except PeerError as e:
                reason = str(e)
                break
            time.sleep(0.05)
        self.assertIsNotNone(reason, "the refusal was never noticed")
        self.assertIn("16 sessions", reason)
        time.sleep(0.5)
        self.assertEqual(len(fake.sessions), 1, "a refused session was opened again")
        out.close()

    def test_a_broken_session_is_reopened_and_the_steps_tensors_sent_again(self):
        def first_breaks(fake, fs):
            n = len(fake.sessions)
            while True:
                try:
                    f = fs.read(wait=10)
                except Exception:
                    return
                if f.WhichOneof("body") == "header":
                    fake.sessions[n - 1].append(f.header.seq)
                    if n == 1:
                        fs.close()  # the first session breaks after one tensor's header
                        return

        fake = FakeReceiver(self.ids["node1"], first_breaks)
        mailbox, out = self.outbox(fake)
        v = np.ones(6, np.float32)
        out.send(1, 0, 0, pb.ACTIVATION, EDGE, SHAPE, v)
        # An idle sender notices the end at once and re-opens, before it has anything to send.
        for _ in range(100):
            if len(fake.sessions) >= 2 and fake.sessions[1]:
                break
            time.sleep(0.05)
        self.assertGreaterEqual(len(fake.sessions), 2, "an idle sender did not notice the break")
        self.assertEqual(fake.sessions[1][:1], [0], "the step's tensor was not sent again")
        out.send(1, 0, 1, pb.ACTIVATION, EDGE, SHAPE, v)
        for _ in range(100):
            if len(fake.sessions) >= 2 and len(fake.sessions[1]) >= 2:
                break
            time.sleep(0.05)
        self.assertGreaterEqual(len(fake.sessions), 2, "the session was never re-opened")
        self.assertEqual(fake.sessions[1][:2], [0, 1], "the step's tensors were not sent again in order")
        mailbox.check()  # healing is no failure
        out.close()


if __name__ == "__main__":
    unittest.main()


class Limits(unittest.TestCase):
    """Connection caps, stalled writes, partial connects and generation scoping."""

    @classmethod
    def setUpClass(cls):
        cls.ids = certs()

    def test_connections_beyond_the_per_address_cap_are_shed_and_the_listener_goes_on(self):
        from fusionllm_node import dataplane

        plane = DataPlane(self.ids["node1"], "node1", TOKEN, "127.0.0.1:0", "numpy-f64", "test", ShardStore())
        host, port = plane.address.rsplit(":", 1)
        held = [socket.create_connection((host, int(port))) for _ in range(dataplane.MAX_PER_ADDRESS)]
        time.sleep(0.3)
        extra = socket.create_connection((host, int(port)))
        extra.settimeout(5)
        self.assertEqual(extra.recv(1), b"", "a connection beyond the cap was kept")
        for s in held:
            s.close()
        extra.close()
        time.sleep(0.5)
        # The listener still admits a real session.
        inbound = Inbound(1, Mailbox(), {"node0": 0}, {"node0": fingerprint(self.ids["node0"].cert_der)},
                          {(pb.ACTIVATION, EDGE): SHAPE}, Detached())
        plane.set_inbound(inbound)
        fs, _ = dial(self.ids["node0"], "node1", plane.address, fingerprint(self.ids["node1"].cert_der),
                     hello("node0", TOKEN, 1, "test", "test"))
        fs.close()

    def test_a_stalled_write_fails_the_step_without_healing(self):
        def never_reads(fake, fs):
            time.sleep(30)

        fake = FakeReceiver(self.ids["node1"], never_reads)
        plane = DataPlane(self.ids["node0"], "node0", TOKEN, "127.0.0.1:0", "numpy-f64", "test", ShardStore())
        mailbox = Mailbox()
        link = cpb.PeerLink(node_id="node1", address=fake.address, stage=1,
                            certificate_sha256=fingerprint(self.ids["node1"].cert_der))
        out = plane.connect(1, [link], mailbox, 1.0, Detached())
        big = np.ones(8 << 20, np.float32)  # 32 MB: more than the socket buffers hold
        out.send(1, 0, 0, pb.ACTIVATION, EDGE, (big.size,), big)
        reason = None
        for _ in range(200):
            try:
                mailbox.check()
            except PeerError as e:
                reason, proven = str(e), e.proven
                break
            time.sleep(0.05)
        self.assertIsNotNone(reason, "a stalled write never failed the step")
        self.assertIn("did not complete", reason)
        self.assertFalse(proven, "a stall is a suspicion, not proof")
        self.assertEqual(len(fake.sessions), 1, "a stalled session was re-opened")

    def test_a_partial_connect_closes_the_sessions_it_opened(self):
        ended = threading.Event()

        def wait_for_end(fake, fs):
            try:
                fs.read(wait=20)
            except Exception:
                pass
            ended.set()

        fake = FakeReceiver(self.ids["node1"], wait_for_end)
        plane = DataPlane(self.ids["node0"], "node0", TOKEN, "127.0.0.1:0", "numpy-f64", "test", ShardStore())
        good = cpb.PeerLink(node_id="node1", address=fake.address, stage=1,
                            certificate_sha256=fingerprint(self.ids["node1"].cert_der))
        dead = socket.create_server(("127.0.0.1", 0))
        gone = f"127.0.0.1:{dead.getsockname()[1]}"
        dead.close()
        bad = cpb.PeerLink(node_id="node2", address=gone, stage=2,
                           certificate_sha256=fingerprint(self.ids["node2"].cert_der))
        with self.assertRaises(Exception):
            plane.connect(1, [good, bad], Mailbox(), 5.0, Detached())
        self.assertTrue(ended.wait(10), "the session to the reachable peer was left open")

    def test_updates_from_an_older_generation_change_nothing(self):
        from fusionllm_node.progress import Progress

        p = Progress()
        old = p.start_generation(1)
        new = p.start_generation(2)
        new.enter("computing", 7, 1)
        before = p.message()
        old.enter("waiting", 3, 0, "node9")
        old.received("node9")
        old.idle()
        after = p.message()
        self.assertEqual((after.generation, after.step, after.phase, after.counter),
                         (before.generation, before.step, before.phase, before.counter))
        self.assertEqual(list(after.peers), [])


class OuterExchangeMailbox(unittest.TestCase):
    """Outer-exchange pieces outlive the steps trained beside their exchange, as in the Rust
    node's mailbox; older exchanges' pieces are dropped, pieces beyond the next step refused."""

    def test_outer_pieces_outlive_steps_and_far_ones_are_refused(self):
        m = Mailbox()
        piece = lambda step, k: (step, k, pb.OUTER_EXCHANGE, 0, 0)  # noqa: E731
        v = np.zeros(4, np.float32)
        m.begin_step(25)
        m.begin_outer(24)
        m.put(piece(24, 0), v)
        m.begin_step(48)
        m.put(piece(49, 0), v)  # a peer island that began the next exchange
        self.assertEqual(m.held_from(0), 32, "steps do not drop outer pieces")
        m.take(piece(24, 0), 1.0, "x", "node1")
        m.put(piece(24, 1), v)
        m.begin_step(49)
        m.begin_outer(49)
        self.assertEqual(m.held_from(0), 16, "the old exchange's piece was dropped")
        m.put(piece(24, 2), v)  # dropped, not refused
        self.assertEqual(m.held_from(0), 16)
        with self.assertRaises(ProtocolError):
            m.put(piece(74, 0), v)
        with self.assertRaises(ProtocolError):
            m.put((60, 0, pb.ACTIVATION, 1, 1), v)
        self.assertEqual(m.held_from(0), 16)
