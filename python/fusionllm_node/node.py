"""The compute node's control plane: join the broker over gRPC with mutual TLS and the token, take
assignments, run steps while still listening (a reset must interrupt a step waiting for a peer that
is gone), apply updates, send snapshots, heartbeat, and join again when the broker is lost. An
explicit state machine: IDLE (no assignment) or ASSIGNED (a stage), per control session."""

import json
import logging
import os
import queue
import resource
import threading
import time

import grpc
import numpy as np

from . import shards
from .dataplane import DataPlane, Inbound
from .errors import Evicted, NodeError, ProtocolError, Refused, Superseded
from .graph import parse_graph
from .mailbox import Mailbox
from .plan import Plan
from .transport import PROTOCOL_VERSION
from .wire import fusionllm_control_pb2 as cpb
from .wire import fusionllm_control_pb2_grpc as cgrpc
from .wire import fusionllm_pb2 as pb
from .worker import StageWorker, peer_blame

log = logging.getLogger("fusionllm_node")
VERSION = "0.1.0-python"
MAX_CONTROL_MESSAGE = 256 << 20
MAX_MICRO_BATCHES = 4096
PIECE_VALUES = (1 << 20) // 4
MAX_ASSIGNMENT_JSON = 64 << 20
# How long an assignment keeping the state waits for a superseded step to give the worker back.
KEEP_STATE_WAIT = 120


class BrokerLost(NodeError):
    pass


class Stopped(Exception):
    pass


class Active:
    """An assignment being served: its generation, stage worker, mailbox and outbox."""

    def __init__(self, generation, worker, schedule, mailbox, outbox):
        self.generation, self.worker, self.schedule = generation, worker, schedule
        self.mailbox, self.outbox = mailbox, outbox
        self.feeds = {}
        # A step the broker superseded while it computed (its thread still uses the worker).
        self.compute = None


class Session:
    """One control stream: outgoing messages through a queue, incoming ones read by a thread."""

    def __init__(self, cfg, join, joined_before):
        self.heard = False  # set once anything arrived from the broker
        self.joined_before = joined_before
        self.out = queue.Queue()
        self.inbox = queue.Queue()
        self.queued = []  # messages read during a step, handled after it
        opts = [("grpc.ssl_target_name_override", "broker"),
                ("grpc.max_receive_message_length", MAX_CONTROL_MESSAGE),
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 5000),
                ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(cfg.identity.ca), private_key=_read(cfg.identity.key),
            certificate_chain=_read(cfg.identity.cert))
        target = cfg.broker.split("://", 1)[-1].rstrip("/")
        self.channel = grpc.secure_channel(target, creds, options=opts)
        self.out.put(cpb.NodeMessage(join=join))
        stub = cgrpc.BrokerStub(self.channel)
        self.call = stub.Attach(self._requests(), metadata=[("x-fusionllm-token", cfg.token)])
        threading.Thread(target=self._read, daemon=True, name="control-in").start()

    def _requests(self):
        while True:
            m = self.out.get()
            if m is None:
                return
            yield m

    def _read(self):
        try:
            for m in self.call:
                self.heard = True
                self.inbox.put(m)
            self.inbox.put(BrokerLost("the broker closed the control stream"))
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION,
                        grpc.StatusCode.INVALID_ARGUMENT):
                self.inbox.put(Refused(e.details()))
            elif (code == grpc.StatusCode.UNAVAILABLE and not (self.joined_before or self.heard)
                  and _tls_refusal(e.details() or "")):
                self.inbox.put(Refused(f"the TLS handshake failed, the broker does not accept this "
                                       f"node's certificate or this node the broker's: {e.details()}"))
            else:
                self.inbox.put(BrokerLost(f"{code.name}: {e.details()}"))
        except Exception as e:  # the command loop must hear of any end, or it would wait forever
            self.inbox.put(BrokerLost(f"reading the control stream failed: {type(e).__name__}: {e}"))

    def send(self, **body):
        self.out.put(cpb.NodeMessage(**body))

    def next(self, timeout=None):
        if self.queued:
            return self.queued.pop(0)
        m = self.inbox.get(timeout=timeout)
        if isinstance(m, Exception):
            raise m
        return m

    def close(self):
        self.out.put(None)
        self.channel.close()


def _tls_refusal(details):
    """Whether the first connection failed in its TLS handshake (a certificate the broker does
    not accept, or a broker this node does not): final before the node ever joined; afterwards
    every failure is retried (a broker restarting can reset a handshake too)."""
    d = details.lower()
    return any(m in d for m in ("handshake", "certificate", "tsi_", "alert", "ssl"))


def _read(path):
    with open(path, "rb") as f:
        return f.read()


class Node:
    def __init__(self, cfg, backend):
        self.cfg, self.backend = cfg, backend
        from .progress import Progress

        self.progress = Progress()
        self.store = shards.ShardStore(cfg.state_dir)
        self.plane = DataPlane(cfg.identity, cfg.name, cfg.token, cfg.data_listen,
                               backend.name, VERSION, self.store)
        self.active = None
        self.session = None
        # Shard writes and copies run beside the commands; a reset gives them up (`cancel`).
        self.cancel = threading.Event()
        self.writing = 0
        self.writing_lock = threading.Lock()
        # Set by SIGTERM (a plain flag: signal handlers must not take locks); the command loop
        # asks to leave, and an idle node leaves at once.
        self.leave_requested = False
        self.leave_sent = False

    # ---- sessions ---------------------------------------------------------------------------

    def run(self):
        """Serves the broker until it stops this node; joins again after a lost broker for up to
        `reconnect_for` seconds."""
        lost_since, pause = None, 0.5
        self.joined_before = False
        while True:
            try:
                self._serve_session()
                return
            except BrokerLost as e:
                self._drop("the broker is gone")
                if self.session is not None and self.session.heard:
                    # A session that carried traffic: the window starts again from this loss.
                    self.joined_before = True
                    lost_since, pause = None, 0.5
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > self.cfg.reconnect_for:
                    raise NodeError(f"the broker is gone: {e}") from None
                log.warning("%s: lost the broker (%s); joining again", self.cfg.name, e)
                time.sleep(pause)
                pause = min(pause * 2, 5.0)

    def _join_message(self):
        caps = cpb.Capabilities(backend=self.backend.name, software_version=VERSION,
                                device=f"{self.backend.device} {os.cpu_count()} threads",
                                memory_bytes=_memory_bytes(), **_profile(self.backend))
        return cpb.Join(protocol_version=PROTOCOL_VERSION, node_id=self.cfg.name, token=self.cfg.token,
                        capabilities=caps, data_address=self.cfg.advertise or self.plane.address)

    def _serve_session(self):
        self.session = Session(self.cfg, self._join_message(), self.joined_before)
        beat = threading.Event()
        threading.Thread(target=self._heartbeats, args=(self.session, beat), daemon=True).start()
        log.info("%s: joining %s, data plane on %s", self.cfg.name, self.cfg.broker, self.plane.address)
        self.leave_sent = False
        try:
            while True:
                try:
                    m = self.session.next(timeout=0.2)
                except queue.Empty:
                    self._maybe_leave()
                    continue
                self._handle(m)
                self._maybe_leave()
        except Stopped:
            return
        finally:
            beat.set()
            self.session.close()

    def _maybe_leave(self):
        """After SIGTERM: asks the broker to let this node go (it keeps serving until the broker
        stops it at a step boundary); an idle node leaves at once."""
        if not self.leave_requested or self.leave_sent:
            return
        self.leave_sent = True
        log.info("%s: leaving the job", self.cfg.name)
        self.session.send(leave=cpb.Leave(reason="the node was asked to stop (SIGTERM)"))
        if self.active is None:
            raise Stopped()

    def _heartbeats(self, session, stop):
        while not stop.wait(self.cfg.heartbeat_s):
            session.send(heartbeat=cpb.Heartbeat(sent_unix_ms=int(time.time() * 1000),
                                                 progress=self.progress.message()))

    # ---- commands ---------------------------------------------------------------------------

    def _handle(self, m):
        kind = m.WhichOneof("body")
        s = self.session
        if kind == "assignment":
            old = self.active
            self._drop("reassigned")
            try:
                kept = self._kept_worker(old) if m.assignment.keep_state else None
                self.active = self._setup(m.assignment, kept)
                s.send(ready=cpb.Ready(generation=m.assignment.generation))
            except Superseded:
                pass
            except (BrokerLost, Refused, Evicted):
                raise  # the session is over: the node rejoins (or stops), it reports nothing
            except (NodeError, OSError) as e:
                log.warning("%s: assignment failed: %s", self.cfg.name, e)
                s.send(failure=_failure(e, m.assignment.generation))
        elif kind == "feed":
            self._store_feed(self._need("a feed"), m.feed)
        elif kind == "run":
            self._run_step(self._need("a step"), m.run)
        elif kind == "update":
            u = m.update
            self._need("an update").worker.apply_update(u.step, u.lr, u.grad_scale)
        elif kind == "compression":
            try:
                settings = json.loads(m.compression.settings_json)
            except ValueError as e:
                raise ProtocolError(f"bad compression settings: {e}") from None
            self._need("compression settings").outbox.compression.set(settings)
        elif kind == "probe":
            s.send(links=self._probe_round(m.probe))
        elif kind == "save":
            act = self._need("a save")
            act.progress.enter("saving", m.save.step)
            self._send_state(act, m.save.step, m.save.outer, m.save.moments_only)
            act.progress.idle()
        elif kind == "save_shard":
            self._save_shard(self._need("a shard save"), m.save_shard)
        elif kind == "fetch_shard":
            self._beside(self._fetch_shard, m.fetch_shard)
        elif kind == "allow_fetch":
            self.plane.allow_fetchers({p.node_id: bytes(p.certificate_sha256) for p in m.allow_fetch.peers})
        elif kind == "reset":
            log.warning("%s: reset by the broker: %s", self.cfg.name, m.reset.reason)
            self.cancel.set()
            self.cancel = threading.Event()
            self._drop(m.reset.reason)
        elif kind == "stop":
            self._drop("stopped")
            if m.stop.evicted:
                raise Evicted(m.stop.reason)
            log.info("%s: stopped: %s", self.cfg.name, m.stop.reason)
            raise Stopped()
        elif kind in ("param", "params_done", "load_shards"):
            raise ProtocolError(f"{kind} outside an assignment")
        else:
            raise ProtocolError("empty message from the broker")

    def _need(self, what):
        if self.active is None:
            raise ProtocolError(f"{what} without an assignment")
        return self.active

    def _drop(self, reason):
        if self.active is not None:
            self.active.mailbox.poison(reason)
            self.active.outbox.close()
            self.active = None
        self.plane.set_inbound(None)

    # ---- assignment -------------------------------------------------------------------------

    def _kept_worker(self, old):
        """The worker of the stage held until now, for an assignment that keeps its state: a
        superseded step's thread stops at its next pass or wait on a peer. When it cannot be
        kept, the assignment's remaining messages are read before the error is reported, so the
        node stays in step with the broker."""
        why = None
        if old is None:
            why = ProtocolError("an assignment keeping the state without a stage")
        elif old.compute is not None:
            old.compute.join(KEEP_STATE_WAIT)
            if old.compute.is_alive():
                why = NodeError(f"the superseded step did not stop within {KEEP_STATE_WAIT} s: "
                                "the stage's state cannot be kept")
        if why is not None:
            while True:
                m = self.session.next()
                kind = m.WhichOneof("body")
                if kind in ("stop", "reset", "assignment"):
                    self.session.queued.insert(0, m)
                    break
                if kind == "params_done":
                    break
            raise why
        return old.worker

    def _setup(self, a, kept=None):
        """Checks an assignment and builds its stage; anything malformed in it is a
        ProtocolError naming the problem (reported as the assignment's Failure)."""
        try:
            return self._build(a, kept)
        except (NodeError, OSError):
            raise
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError,
                MemoryError, OverflowError) as e:
            raise ProtocolError(f"the assignment: {type(e).__name__}: {e}") from None

    def _build(self, a, kept=None):
        for what, text in (("stage graph", a.stage_graph_json), ("plan", a.plan_json),
                           ("training configuration", a.config_json)):
            if len(text) > MAX_ASSIGNMENT_JSON:
                raise ProtocolError(f"the {what} is {len(text)} bytes (at most {MAX_ASSIGNMENT_JSON})")
        graph = parse_graph(a.stage_graph_json)
        plan = Plan(a.plan_json, a.stage)
        train = check_config(a.config_json)
        check_fits(graph, _memory_bytes())
        replicas = max(1, a.replicas)
        if a.replica >= replicas or (replicas > 1 and len(a.ring) != replicas):
            raise ProtocolError(f"replica {a.replica} of {replicas} with a ring of {len(a.ring)} nodes")
        if replicas > 1 and not a.islands and train.get("shard_optimizer") is True:
            raise ProtocolError("sharded optimizer state across replicas (--shard-optimizer) is not "
                                "supported by the Python node: run its stage's replicas unsharded")
        if a.schedule not in (cpb.GPIPE, cpb.ONE_F_ONE_B):
            raise ProtocolError("pipeline schedule unspecified")
        param_ids = plan.stage_params[a.stage]
        progress = self.progress.start_generation(a.generation)
        worker = StageWorker(self.backend, a.stage, plan, graph, param_ids, train,
                             self.cfg.peer_timeout, progress)
        worker.opt.step = a.optimizer_step
        worker.island = a.islands
        worker.set_fragments(list(a.fragments))
        if replicas > 1:
            worker.replica, worker.replicas = a.replica, replicas
            worker.ring_from = a.ring[(a.replica + replicas - 1) % replicas]
        outer = self._receive_state(worker, a.stage, kept is not None)
        if kept is not None:
            worker.adopt_state(kept)
        else:
            worker.start_outer()
            if outer is not None:
                worker.momentum = outer
        mailbox = Mailbox()
        senders = {plan.stage_nodes[s]: s for s in plan.senders_to(a.stage)}
        if replicas > 1:
            senders[worker.ring_from] = a.stage
        pins = {k: bytes(v) for k, v in a.sender_certificates.items()}
        self.plane.set_inbound(Inbound(a.generation, mailbox, senders, pins,
                                       worker.expected_inbound(), progress))
        outbox = self.plane.connect(a.generation, list(a.peers), mailbox, self.cfg.peer_timeout, progress)
        schedule = "gpipe" if a.schedule == cpb.GPIPE else "1f1b"
        log.info("%s: stage %d of generation %d ready", self.cfg.name, a.stage, a.generation)
        act = Active(a.generation, worker, schedule, mailbox, outbox)
        act.progress = progress
        return act

    def _receive_state(self, worker, stage, keep=False):
        """Fills the stage's parameters and optimizer moments from the ParamData pieces that
        follow an assignment, until ParamsDone (none are needed when it keeps the state). An
        island starting from a snapshot may also receive its outer momentum: returned (None when
        none came)."""
        filled = [False] * len(worker.params)
        fresh_island = worker.islands() and not keep
        outer = ([np.zeros(p.size, np.float32) if t else np.zeros(0, np.float32)
                  for p, t in zip(worker.params, worker.trainable)] if fresh_island else None)
        outer_filled = [False] * len(worker.params)
        load_failed = None
        while True:
            m = self.session.next()
            kind = m.WhichOneof("body")
            if kind == "params_done":
                break
            if kind in ("stop", "reset", "assignment"):
                self.session.queued.insert(0, m)
                raise Superseded("the assignment was superseded")
            if kind == "load_shards":
                load_failed = load_failed or self._load_shards(worker, m.load_shards, filled)
                continue
            if kind != "param":
                raise ProtocolError("expected parameters after the assignment")
            p = m.param
            if p.param not in worker.param_ids:
                raise ProtocolError(f"parameter #{p.param} is not part of stage {stage}")
            local = worker.param_ids.index(p.param)
            targets = {cpb.VALUE: worker.params, cpb.FIRST_MOMENT: worker.opt.first,
                       cpb.SECOND_MOMENT: worker.opt.second}
            if fresh_island:
                targets[cpb.OUTER_MOMENTUM] = outer
            elif p.part == cpb.OUTER_MOMENTUM:
                raise ProtocolError("outer momentum for a stage that is not an island starting "
                                    "from a snapshot")
            if p.part not in targets:
                raise ProtocolError("parameter part unspecified")
            target = targets[p.part][local]
            n = len(p.data) // 4
            if p.total_elements != target.size or len(p.data) % 4 or p.offset + n > target.size:
                raise ProtocolError(
                    f"piece of parameter #{p.param} ({len(p.data)} bytes at element {p.offset}, total "
                    f"{p.total_elements}) does not fit its {target.size} elements")
            target[p.offset:p.offset + n] = np.frombuffer(p.data, "<f4")
            if p.part == cpb.VALUE and p.offset + n == target.size:
                filled[local] = True
            if p.part == cpb.OUTER_MOMENTUM and p.offset + n == target.size:
                outer_filled[local] = True
        if load_failed:
            raise load_failed
        if not keep and not all(filled):
            missing = worker.graph.params[filled.index(False)].name
            raise ProtocolError(f"the broker sent no values for parameter '{missing}'")
        if not any(outer_filled):
            return None
        for i, t in enumerate(worker.trainable):
            if t and worker.params[i].size and not outer_filled[i]:
                raise ProtocolError("the broker sent the outer momentum of some parameters but "
                                    f"not of '{worker.graph.params[i].name}'")
        return outer

    def _load_shards(self, worker, ls, filled):
        """Fills the stage from shards on this node's disk; the error (reported once the
        assignment's messages are read) or None."""
        if len(ls.shards) != len(ls.sha256):
            raise ProtocolError(f"{len(ls.shards)} shards to load with {len(ls.sha256)} checksums")
        try:
            got = shards.load_stage(self.store, worker, ls.run_id, ls.step, list(ls.shards), list(ls.sha256))
        except NodeError as e:
            return e
        except (OSError, ValueError, TypeError, KeyError, MemoryError) as e:
            return shards.ShardError(",".join(ls.shards), f"{type(e).__name__}: {e}")
        for i, g in enumerate(got):
            filled[i] = filled[i] or g[0]
        return None

    # ---- sharded snapshots, beside the commands ---------------------------------------------

    def _beside(self, job, *args):
        cancel, session = self.cancel, self.session

        def run():
            body = job(cancel, *args)
            if body is not None and not cancel.is_set():
                session.send(shard_saved=body)

        threading.Thread(target=run, daemon=True, name=job.__name__).start()

    def _save_shard(self, act, ss):
        """Copies the stage's state, says so at once, and writes the shard beside the commands
        that follow; one copy at a time."""
        with self.writing_lock:
            busy = self.writing > 0
            if not busy:
                self.writing += 1
        if busy:
            self.session.send(shard_captured=cpb.ShardCaptured(
                step=ss.step, shard=ss.shard,
                error=f"shard '{ss.shard}': the shard of an earlier snapshot is still being written"))
            return
        w = act.worker
        act.progress.enter("saving", ss.step)
        copy = ([p.name for p in w.graph.params], [p.shape for p in w.graph.params], list(w.trainable),
                w.opt.kind == "adam_w", [v.copy() for v in w.params], [v.copy() for v in w.opt.first],
                [v.copy() for v in w.opt.second])
        act.progress.idle()
        self.session.send(shard_captured=cpb.ShardCaptured(step=ss.step, shard=ss.shard))
        self._beside(self._write_shard, copy, ss)

    def _write_shard(self, cancel, copy, ss):
        try:
            if cancel.is_set():
                return None
            path, size, sha = shards.save_copy(self.store, copy, ss.run_id, ss.step, ss.shard)
            if not cancel.is_set():
                self.store.retain(ss.run_id, list(ss.keep_steps))
            return cpb.ShardSaved(step=ss.step, shard=ss.shard, bytes=size, sha256=sha, path=path)
        except (NodeError, OSError) as e:
            return cpb.ShardSaved(step=ss.step, shard=ss.shard, error=str(e))
        finally:
            with self.writing_lock:
                self.writing -= 1

    def _fetch_shard(self, cancel, fs):
        if not fs.HasField("from"):
            return cpb.ShardSaved(step=fs.step, shard=fs.shard, error="a shard to fetch from nobody")
        try:
            path, size, sha = shards.fetch(self.plane, self.store, getattr(fs, "from"), fs.run_id, fs.step,
                                           fs.shard, fs.bytes, fs.sha256, cancel)
            if not cancel.is_set():
                self.store.retain(fs.run_id, list(fs.keep_steps))
            return cpb.ShardSaved(step=fs.step, shard=fs.shard, bytes=size, sha256=sha, path=path)
        except (NodeError, OSError) as e:
            return cpb.ShardSaved(step=fs.step, shard=fs.shard, error=str(e))

    def _store_feed(self, act, f):
        shape = tuple(f.shape)
        if 4 * int(np.prod(shape, dtype=np.uint64)) != len(f.data):
            raise ProtocolError(f"feed of tensor {f.tensor} has {len(f.data)} bytes for shape {list(shape)}")
        if f.dtype == pb.F32:
            data = np.frombuffer(f.data, "<f4").astype(np.float32)
            if not np.isfinite(data).all():
                raise ProtocolError(f"feed of tensor {f.tensor} has non-finite values")
            act.feeds[(f.micro_batch, f.tensor)] = ("f32", data, shape)
        elif f.dtype == pb.I32:
            act.feeds[(f.micro_batch, f.tensor)] = ("i32", np.frombuffer(f.data, "<u4").astype(np.int64), shape)
        else:
            raise ProtocolError(f"feed of dtype {pb.DType.Name(f.dtype)}")

    # ---- steps ------------------------------------------------------------------------------

    def _run_step(self, act, r):
        sync = r.mode == cpb.OUTER_SYNC
        if (r.micro_batches == 0 and not sync) or r.micro_batches > MAX_MICRO_BATCHES:
            raise ProtocolError(f"a step of {r.micro_batches} micro-batches (at most {MAX_MICRO_BATCHES})")
        train = r.mode != cpb.EVAL
        m, total = r.micro_batches, max(r.total_micro_batches, r.micro_batches)
        weight = act.worker.sync_weight(r.micro_batches, r.total_micro_batches) if sync else 1.0
        act.mailbox.begin_step(r.step)
        feeds, act.feeds = act.feeds, {}
        done = {}

        def compute():
            try:
                if sync:
                    fragment = r.fragment if r.HasField("fragment") else None
                    done["out"] = act.worker.outer_sync(r.step, weight, r.overlap, fragment,
                                                        act.mailbox, act.outbox)
                else:
                    done["out"] = act.worker.run_step(r.step, train, m, total, act.schedule, feeds,
                                                      act.mailbox, act.outbox)
            except Exception as e:  # reported to the broker below, whatever it was
                done["err"] = e

        t = threading.Thread(target=compute, daemon=True, name="compute")
        t.start()
        while t.is_alive():
            try:
                msg = self.session.inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(msg, Exception):
                act.mailbox.poison("the broker is gone")
                raise msg
            self.session.queued.append(msg)
            if msg.WhichOneof("body") in ("reset", "stop", "assignment"):
                act.mailbox.poison("the broker reset the job")
                act.compute = t
                return
        if "err" in done:
            e = done["err"]
            log.warning("%s: step %d failed: %s", self.cfg.name, r.step, e)
            if not isinstance(e, NodeError):
                e = ProtocolError(f"{type(e).__name__}: {e}")
            self.session.send(failure=_failure(e, act.generation))
            return
        o = done["out"]
        sent = [cpb.LinkBytes(peer=p, bytes=b, tensors=n) for p, b, n in act.outbox.take_sent()]
        self.session.send(result=cpb.StepResult(
            step=r.step, losses=o.losses, predictions=o.predictions, grad_square_sum=o.grad_square_sum,
            sent=sent, compute_seconds=o.compute_seconds, wait_seconds=o.wait_seconds,
            peak_memory_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))

    def _send_state(self, act, step, outer=False, moments_only=False):
        """The stage's parameters and moments (and, with `outer`, an island's outer momentum;
        with `moments_only`, an island past the first, the moments alone)."""
        w = act.worker
        if outer and getattr(w, "momentum", None) is None:
            raise ProtocolError("a save with the outer momentum of a stage that is not an island")
        for local, gid in enumerate(w.param_ids):
            parts = [(cpb.FIRST_MOMENT, w.opt.first[local]), (cpb.SECOND_MOMENT, w.opt.second[local])]
            if not moments_only:
                parts.insert(0, (cpb.VALUE, w.params[local]))
            if outer:
                parts.append((cpb.OUTER_MOMENTUM, w.momentum[local]))
            for part, values in parts:
                for off in range(0, values.size, PIECE_VALUES):
                    piece = values[off:off + PIECE_VALUES]
                    self.session.send(param=cpb.ParamData(
                        param=gid, part=part, offset=off, total_elements=values.size,
                        data=piece.astype("<f4").tobytes()))
        self.session.send(params_done=cpb.ParamsDone(step=step))

    def _probe_round(self, round_):
        self.plane.allow_probers({p.node_id: bytes(p.certificate_sha256) for p in round_.peers})
        max_bytes = min(round_.max_bytes or (8 << 20), 64 << 20)
        links = []
        for p in round_.peers:
            try:
                bps, latency, size = self.plane.probe(p.node_id, p.address, bytes(p.certificate_sha256), max_bytes)
                links.append(cpb.LinkMeasurement(peer=p.node_id, bandwidth_mbps=bps * 8 / 1e6,
                                                 latency_ms=latency * 1e3, probe_bytes=size))
            except (NodeError, OSError) as e:
                links.append(cpb.LinkMeasurement(peer=p.node_id, error=str(e)))
        return cpb.LinkReport(round=round_.round, links=links)


OPTIMIZER_FIELDS = {"adam_w": ("beta1", "beta2", "eps", "weight_decay"), "sgd": ("momentum", "weight_decay")}
OPTIMIZER_DEFAULT = {"kind": "adam_w", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
OUTER_DEFAULT = {"every": 50, "lr": 1.0, "momentum": 0.0, "nesterov": True, "codec": {"kind": "none"}}


def _number(v, what):
    """A configuration number as the Rust side holds it (an f32), finite."""
    try:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError
        with np.errstate(over="ignore"):
            f = float(np.float32(v))
    except (TypeError, OverflowError, ValueError):
        raise ProtocolError(f"training configuration: {what} must be a number, got {v!r}") from None
    if not np.isfinite(f):
        raise ProtocolError(f"training configuration: {what} is not finite as an f32 ({v!r})")
    return f


def check_config(text):
    """The training configuration a node uses (the optimizer and islands' outer section), with
    the Rust side's defaults for absent fields and its bounds."""
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"training configuration: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ProtocolError("training configuration: not a JSON object")
    opt = cfg.get("optimizer", OPTIMIZER_DEFAULT)
    if not isinstance(opt, dict) or opt.get("kind") not in OPTIMIZER_FIELDS:
        raise ProtocolError(f"training configuration: unknown optimizer {opt!r}")
    opt = {"kind": opt["kind"], **{k: _number(opt.get(k), k) for k in OPTIMIZER_FIELDS[opt["kind"]]}}
    if opt["kind"] == "adam_w" and not (0 <= opt["beta1"] < 1 and 0 <= opt["beta2"] < 1 and opt["eps"] > 0
                                        and opt["weight_decay"] >= 0):
        raise ProtocolError("training configuration: AdamW needs 0 <= beta < 1, eps > 0, weight decay >= 0")
    if opt["kind"] == "sgd" and not (0 <= opt["momentum"] < 1 and opt["weight_decay"] >= 0):
        raise ProtocolError("training configuration: SGD needs 0 <= momentum < 1 and weight decay >= 0")
    cfg["optimizer"] = opt
    outer = cfg.get("outer")
    if outer is not None:
        if not isinstance(outer, dict):
            raise ProtocolError("training configuration: the outer section is not an object")
        outer = {**OUTER_DEFAULT, **outer}
        for k in ("lr", "momentum"):
            outer[k] = _number(outer[k], f"outer {k}")
        every = outer["every"]
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ProtocolError(f"training configuration: outer every must be a step count of at least 1, got {every!r}")
        if not (outer["lr"] > 0 and 0 <= outer["momentum"] < 1 and isinstance(outer["nesterov"], bool)):
            raise ProtocolError("training configuration: the outer optimizer needs lr > 0, 0 <= momentum < 1 "
                                "and nesterov true or false")
        if not isinstance(outer["codec"], dict) or outer["codec"].get("kind") not in ("none", "fp16", "bf16", "int8"):
            raise ProtocolError(f"training configuration: outer codec {outer['codec']!r} (none, fp16, bf16 or int8)")
        cfg["outer"] = outer
    return cfg


def check_fits(graph, memory):
    """Refuses a stage whose parameters (f32 masters, two moments, a float64 copy) alone exceed
    this machine's memory, before anything is allocated for it."""
    need = sum(p.numel for p in graph.params) * (3 * 4 + 8)
    if memory and need > memory:
        raise ProtocolError(f"the stage's parameters need {need} bytes, this node has {memory}")


def _failure(e, generation):
    peer, proven = peer_blame(e)
    return cpb.Failure(message=str(e), blame=peer, generation=generation, proven=proven)


def _memory_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _best_of(n, fn):
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _profile(backend):
    """Dense and memory speed of this backend and the calibration of the broker's roofline: a
    matrix product and a copy give the two speeds; one forward and backward of an MLP block
    (linear, gelu, linear, layer norm) through this node's own executor, against the roofline's
    prediction for it, gives the calibration. The block is large enough that per-operator
    overhead hardly counts, so this node fits no `op_overhead_us` (the Rust nodes fit one through
    two graphs): it sends 0, and the broker scales the roofline alone."""
    try:
        rng = np.random.default_rng(0)
        a = backend.upload(rng.standard_normal(512 * 512), (512, 512))
        linear = {"type": "linear", "bias": False}
        dense = _best_of(3, lambda: backend.download(backend.forward(linear, [a], [a], False)[0]))
        gflops = 2 * 512 ** 3 / dense / 1e9
        x = np.ones(1 << 22)
        mem = 2 * x.nbytes / max(_best_of(3, x.copy), 1e-9) / 1e9
        n, d, h = 256, 128, 512
        xs = backend.upload(rng.standard_normal(n * d), (n, d))
        w1 = backend.upload(rng.standard_normal(h * d) * 0.05, (h, d))
        w2 = backend.upload(rng.standard_normal(d * h) * 0.05, (d, h))
        g, b = backend.upload(np.ones(d), (d,)), backend.upload(np.zeros(d), (d,))
        ops = [(linear, [w1]), ({"type": "gelu"}, []), (linear, [w2]),
               ({"type": "layer_norm", "eps": 1e-5}, [g, b])]

        def block():
            y, tape = xs, []
            for op, ps in ops:
                out, saved, _ = backend.forward(op, [y], ps, True)
                tape.append((op, y, ps, saved))
                y = out
            dy = y
            for op, y_in, ps, saved in reversed(tape):
                dy = backend.backward(op, [y_in], ps, saved, dy, True)[0][0]
            backend.download(dy)

        measured = _best_of(3, block)
        flops = 3 * (2 * n * d * h) * 2  # two products, forward (1x) and backward (2x)
        values = 3 * (2 * n * h) + 3 * (2 * n * d)  # gelu and layer norm, read + written, f/b
        predicted = flops / (gflops * 1e9) + 4 * values / (mem * 1e9)
        calibration = min(max(measured / predicted, 0.01), 100.0)
        return {"measured_gflops": gflops, "measured_memory_gbs": mem, "calibration": calibration}
    except (NodeError, ValueError, RuntimeError, ArithmeticError) as e:
        log.warning("profiling the backend failed: %s", e)
        return {}

