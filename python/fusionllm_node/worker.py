"""One node's stage: forward and backward over a step's micro-batches in the pipeline schedule's
order, activations and gradients taken from the mailbox and handed to the outbox, parameter
gradients summed over micro-batches, over the stages sharing a parameter (in stage order, in
float64) and over replicas (ring all-reduce), then the optimizer. It mirrors the Rust
`StageWorker` so that the same numbers come out."""

import threading
import time

import numpy as np

from . import codec
from .errors import OpError, PeerError, ProtocolError
from .executor import Executor
from .optim import Optimizer
from .plan import passes
from .wire import fusionllm_pb2 as pb

F = np.float32


def ring_chunks(n, parts):
    parts = max(parts, 1)
    return [(c * n // parts, (c + 1) * n // parts - c * n // parts) for c in range(parts)]


class StepOutcome:
    def __init__(self):
        self.losses, self.predictions = [], []
        self.grad_square_sum = 0.0
        self.compute_seconds = self.wait_seconds = 0.0


class StageWorker:
    def __init__(self, backend, stage, plan, graph, param_ids, train_cfg, timeout, progress):
        self.backend, self.stage, self.plan, self.graph = backend, stage, plan, graph
        self.routes = plan.stages[stage]
        if len(self.routes["inputs"]) != len(graph.inputs) or len(self.routes["outputs"]) != len(graph.outputs):
            raise ProtocolError(f"stage {stage}'s graph and routes disagree on its inputs or outputs")
        if len(param_ids) != len(graph.params):
            raise ProtocolError(f"stage {stage} has {len(graph.params)} parameters but {len(param_ids)} global ids")
        self.param_ids = param_ids
        self.exec = Executor(backend, graph)
        self.params = [np.zeros(p.numel, F) for p in graph.params]
        self.trainable = [p.trainable for p in graph.params]
        self.decay = [len(p.shape) >= 2 for p in graph.params]
        self.opt = Optimizer(train_cfg["optimizer"], [p.numel if p.trainable else None for p in graph.params])
        self.grads = [None] * len(graph.params)
        self.timeout = timeout
        self.progress = progress
        self.replica, self.replicas, self.ring_from = 0, 1, ""
        self.island = False  # one of the job's islands, also when the only one left in a round
        # The buffers (batch-norm statistics) as a training step found them, until its update: a
        # step abandoned before it must leave them so for an assignment that keeps the state.
        self.buffers_before = None
        self.outer_cfg = train_cfg.get("outer")
        self.anchor, self.momentum = None, None
        # Overlapped synchronisations: the exchange under way (thread, result) and, per tensor,
        # where this stage began the exchanged round (None: at the anchor).
        self.pending, self.round_start = None, None
        # Streaming islands: the fragment of each parameter (empty: the job does not stream).
        self.fragments = []

    # ---- islands: the outer optimizer's state -------------------------------------------------

    def islands(self):
        return bool(self.outer_cfg) and (self.replicas > 1 or self.island)

    def adopt_state(self, old):
        """Takes over the training state of `old`, this stage's worker before an assignment that
        keeps it (island-local recovery: only the ring changed)."""
        if old.param_ids != self.param_ids or any(
                a.size != b.size for a, b in zip(old.params, self.params)):
            raise ProtocolError(f"an assignment keeping the state of stage {self.stage} for a "
                                f"stage of other parameters (stage {old.stage} held here)")
        # An overlapped exchange under way belonged to the old placement (its ring held the
        # island taken out): it is dropped on every island left alike, ended or not, and with
        # every start back at the anchor the next synchronisation's delta carries its round. Its
        # thread ends on the old placement's mailbox.
        self.pending, self.round_start = None, None
        self.params, self.opt = old.params, old.opt
        for i, values in old.buffers_before or []:
            self.params[i] = values
        self.anchor, self.momentum = old.anchor, old.momentum

    def start_outer(self):
        """The parameters just assigned are the last synchronisation's: the anchor."""
        outer_codec = ((self.outer_cfg or {}).get("codec") or {}).get("kind", "none")
        # An exchange still under way belongs to the abandoned placement: its mailbox is
        # poisoned and its thread ends on its own.
        self.pending, self.round_start = None, None
        if self.islands() and outer_codec == "top_k":
            raise ProtocolError("islands with top-k pseudo-gradients (each parameter's message "
                                "passed around whole, with error feedback) are not built in the "
                                "Python node; use none, fp16, bf16 or int8")
        if self.outer_cfg:
            self.anchor = [p.copy() for p in self.params]
            self.momentum = [np.zeros(p.size, F) if t else np.zeros(0, F)
                             for p, t in zip(self.params, self.trainable)]

    def set_fragments(self, fragments):
        """The assignment's fragment of each parameter, checked as the Rust node checks it."""
        if not fragments:
            self.fragments = []
            return
        count = int((self.outer_cfg or {}).get("fragments", 1))
        if not self.island or count < 2:
            raise ProtocolError("stage fragments: sent for a stage that is not an island of a "
                                "streaming job")
        if len(fragments) != len(self.params):
            raise ProtocolError(f"stage fragments: {len(fragments)} for {len(self.params)} parameters")
        bad = [f for f in fragments if f >= count]
        if bad:
            raise ProtocolError(f"stage fragments: fragment {bad[0]} of a job of {count}")
        self.fragments = [int(f) for f in fragments]

    def sync_members(self, fragment):
        """Which tensors a synchronisation takes: fragment `fragment`'s, or (None) every one."""
        if fragment is None:
            return [True] * len(self.params)
        count = int((self.outer_cfg or {}).get("fragments", 1))
        if fragment >= count:
            raise ProtocolError(f"a synchronisation of fragment {fragment} in a job of {count}")
        if len(self.fragments) != len(self.params):
            raise ProtocolError(f"a synchronisation of fragment {fragment} for a stage assigned "
                                "no fragments")
        return [f == fragment for f in self.fragments]

    def member_rings(self, members):
        """outer_rings without the other tensors; rings left empty are dropped."""
        rings = ([i for i in ring if i < len(members) and members[i]] for ring in self.outer_rings())
        return [r for r in rings if r]

    def ring_sets(self):
        """(set, first edge) of each ring set: the whole model's, then fragment 0's, 1's, .."""
        count = int((self.outer_cfg or {}).get("fragments", 1)) if self.fragments else 0
        sets, base = [], 0
        for s in [None] + list(range(count)):
            sets.append((s, base))
            base += len(self.member_rings(self.sync_members(s))) * self.replicas
        return sets

    def all_outer_rings(self):
        """Every ring this stage may run in an outer synchronisation, with its first edge."""
        out = []
        for s, base in self.ring_sets():
            for j, ring in enumerate(self.member_rings(self.sync_members(s))):
                out.append((base + j * self.replicas, ring))
        return out

    def outer_rings(self):
        """Local parameter indices per ring: one per shared parameter (ascending global id),
        then one over every other parameter and buffer in stage-graph order."""
        shared = sorted({self.param_ids.index(sp["param"]) for sp in self.routes["shared"]
                         if sp["param"] in self.param_ids}, key=lambda i: self.param_ids[i])
        return [[i] for i in shared] + [[i for i in range(len(self.params)) if i not in shared]]

    def ring_len(self, ring):
        return sum(self.params[i].size for i in ring)

    # ---- what this stage receives ------------------------------------------------------------

    def expected_inbound(self):
        g, m = self.graph, {}
        for route, local in zip(self.routes["inputs"], g.inputs):
            if route["source"] is not None:
                m[(pb.ACTIVATION, route["tensor"])] = g.tensors[local].shape
        for route, local in zip(self.routes["outputs"], g.outputs):
            if route["consumers"]:
                m[(pb.GRADIENT, route["tensor"])] = g.tensors[local].shape
        for sp in self.routes["shared"]:
            if sp["param"] in self.param_ids:
                m[(pb.PARAM_GRADIENT, sp["param"])] = g.params[self.param_ids.index(sp["param"])].shape
        if self.islands():
            for base, ring in self.all_outer_rings():
                for c, (_, n) in enumerate(ring_chunks(self.ring_len(ring), self.replicas)):
                    m[(pb.OUTER_EXCHANGE, base + c)] = (n,)
        elif self.replicas > 1:
            for c, (_, n) in enumerate(ring_chunks(self.flat_len(), self.replicas)):
                m[(pb.ALL_REDUCE, c)] = (n,)
        return m

    def flat_len(self):
        return sum(p.numel for p in self.graph.params if p.trainable)

    def peer_of(self, direction, from_stage):
        if direction in (pb.ALL_REDUCE, pb.OUTER_EXCHANGE):
            return self.ring_from
        nodes = self.plan.stage_nodes
        return nodes[from_stage] if from_stage < len(nodes) else ""

    def take(self, mailbox, key, what):
        peer = self.peer_of(key[2], key[4])
        self.progress.enter("waiting", key[0], key[1], peer)
        try:
            return mailbox.take(key, self.timeout, what, peer)
        finally:
            self.progress.resume()

    # ---- a step --------------------------------------------------------------------------------

    def _inputs(self, step, mb, feeds, mailbox, waited):
        b, g, local = self.backend, self.graph, {}
        for route, lid in zip(self.routes["inputs"], g.inputs):
            info = g.tensors[lid]
            if route["source"] is None:
                feed = feeds.pop((mb, route["tensor"]), None)
                if feed is None:
                    raise ProtocolError(f"no feed for '{info.name}' of micro-batch {mb} in step {step}")
                dtype, data, shape = feed
                if tuple(shape) != tuple(info.shape) or (dtype == "i32") != (info.dtype == "i32"):
                    raise ProtocolError(f"feed '{info.name}' is {dtype} {list(shape)}, the graph wants {info.dtype} {list(info.shape)}")
                local[lid] = b.ids(data, shape) if dtype == "i32" else b.upload(data, shape)
            else:
                t0 = time.monotonic()
                v = self.take(mailbox, (step, mb, pb.ACTIVATION, route["tensor"], route["source"]),
                              f"activation '{info.name}' of micro-batch {mb} from stage {route['source']}")
                waited[0] += time.monotonic() - t0
                local[lid] = b.upload(v, info.shape)
        return local

    def _forward(self, step, mb, train, device, feeds, mailbox, outbox, out, waited):
        b, g = self.backend, self.graph
        fp = self.exec.forward(device, self._inputs(step, mb, feeds, mailbox, waited), train, train)
        for pid, t in fp.buffer_updates:
            self.params[pid] = b.download(t).astype(F)
            device[pid] = t
        for route, lid in zip(self.routes["outputs"], g.outputs):
            t = fp.outputs.get(lid)
            if t is None:
                continue
            if route["consumers"]:
                data = b.download(t)
                for c in route["consumers"]:
                    outbox.send(c, step, mb, pb.ACTIVATION, route["tensor"], g.tensors[lid].shape, data)
            if route["graph_output"] == 0:
                out.losses[mb] = float(b.download(t)[0])
            elif route["graph_output"] == 1 and not train:
                logits = b.download(t)
                classes = g.tensors[lid].shape[-1] if g.tensors[lid].shape else 1
                out.predictions[mb] = np.argmax(logits.astype(F).reshape(-1, classes), axis=1).tolist()
        return fp

    def _backward(self, step, mb, fp, device, seed, mailbox, outbox, sums, waited):
        b, g = self.backend, self.graph
        seeds = {}
        for route, lid in zip(self.routes["outputs"], g.outputs):
            info = g.tensors[lid]
            acc = seed if route["graph_output"] == 0 else None
            for c in route["consumers"]:
                t0 = time.monotonic()
                v = self.take(mailbox, (step, mb, pb.GRADIENT, route["tensor"], c),
                              f"gradient of '{info.name}' of micro-batch {mb} from stage {c}")
                waited[0] += time.monotonic() - t0
                v = b.upload(v, info.shape)
                acc = v if acc is None else b.add(acc, v)
            if acc is not None:
                seeds[lid] = acc
        pgrads, igrads = self.exec.backward(fp, device, seeds)
        for route, lid in zip(self.routes["inputs"], g.inputs):
            if route["source"] is not None:
                info = g.tensors[lid]
                data = b.download(igrads[lid]) if lid in igrads else np.zeros(info.numel, np.float32)
                outbox.send(route["source"], step, mb, pb.GRADIENT, route["tensor"], info.shape, data)
        for i, gp in enumerate(pgrads):
            if gp is not None:
                sums[i] = gp if sums[i] is None else b.add(sums[i], gp)

    def run_step(self, step, train, m, total, schedule, feeds, mailbox, outbox):
        if train and self.buffers_before is None:
            self.buffers_before = [(i, p.copy()) for i, (p, t) in enumerate(zip(self.params, self.trainable))
                                   if not t]
        b, g = self.backend, self.graph
        t_start, waited = time.monotonic(), [0.0]
        device = [b.upload(p, spec.shape) for p, spec in zip(self.params, g.params)]
        out = StepOutcome()
        out.losses, out.predictions = [float("nan")] * m, [[] for _ in range(m)]
        held, sums = {}, [None] * len(g.params)
        seed = b.upload([float(F(1.0 / max(total, m, 1)))], (1,))
        order = passes(schedule, self.stage, self.plan.num_stages, m) if train else [("f", i) for i in range(m)]
        self.progress.enter("computing", step)
        for kind, mb in order:
            mailbox.check()
            self.progress.enter("computing", step, mb)
            try:
                if kind == "f":
                    held[mb] = self._forward(step, mb, train, device, feeds, mailbox, outbox, out, waited)
                else:
                    fp = held.pop(mb)
                    self._backward(step, mb, fp, device, seed, mailbox, outbox, sums, waited)
            except OpError as e:
                raise ProtocolError(f"step {step}, micro-batch {mb}: {e}") from None
        if train:
            host = [b.download(s).astype(F) if s is not None and tr else None
                    for s, tr in zip(sums, self.trainable)]
            t0 = time.monotonic()
            self.sum_shared(step, sums, host, mailbox, outbox)
            if self.replicas > 1 and not self.islands():
                self.ring_all_reduce(step, host, mailbox, outbox)
            waited[0] += time.monotonic() - t0
            out.grad_square_sum = square_sum(h for i, h in enumerate(host)
                                             if h is not None and self.counts_in_norm(i))
            self.grads = host
        if not any(o["graph_output"] == 0 for o in self.routes["outputs"]):
            out.losses = []
        out.predictions = [p for ps in out.predictions for p in ps]
        self.progress.idle()
        out.wait_seconds = waited[0]
        out.compute_seconds = max(0.0, time.monotonic() - t_start - waited[0])
        return out

    def counts_in_norm(self, i):
        gid = self.param_ids[i]
        for sp in self.routes["shared"]:
            if sp["param"] == gid:
                return sp["stages"][:1] == [self.stage]
        return True

    def sum_shared(self, step, sums, host, mailbox, outbox):
        """Sums a shared parameter's gradient parts in stage order, in float64, so every holder
        ends with the same bits."""
        g = self.graph
        for sp in self.routes["shared"]:
            if sp["param"] not in self.param_ids:
                continue
            local = self.param_ids.index(sp["param"])
            spec = g.params[local]
            mine = self.backend.download(sums[local]) if sums[local] is not None else np.zeros(spec.numel, F)
            for s in sp["stages"]:
                if s != self.stage:
                    outbox.send(s, step, 0, pb.PARAM_GRADIENT, sp["param"], spec.shape, mine)
            total = np.zeros(spec.numel, np.float64)
            for s in sp["stages"]:
                part = mine if s == self.stage else self.take(
                    mailbox, (step, 0, pb.PARAM_GRADIENT, sp["param"], s),
                    f"gradient of shared parameter '{spec.name}' from stage {s}")
                total += part.astype(np.float64)
            host[local] = total.astype(F)

    def ring_all_reduce(self, step, host, mailbox, outbox):
        """Sums the trainable gradients of every replica of this stage, concatenated in
        stage-graph order, with a ring all-reduce."""
        specs = self.graph.params
        flat = np.concatenate([host[i] if host[i] is not None else np.zeros(p.numel, F)
                               for i, p in enumerate(specs) if p.trainable] or [np.zeros(0, F)])
        self.ring_sum(step, 0, flat, None, mailbox, outbox)
        off = 0
        for i, p in enumerate(specs):
            if p.trainable:
                host[i] = flat[off:off + p.numel].copy()
                off += p.numel

    def ring_sum(self, step, edge_base, flat, codec_cfg, mailbox, outbox, direction=pb.ALL_REDUCE,
                 quiet=False):
        """Sums `flat` (float32, in place) over the replicas: R-1 reduce-scatter steps adding
        the chunk the previous replica passes on, then R-1 all-gather steps. With a codec,
        reduce-scatter chunks travel encoded; before the all-gather each replica replaces the
        chunk it reduced by the fixed point of decoding its encoding, and all-gather chunks
        travel encoded only when decoding gives them back bit for bit, so every replica ends
        with the same bits."""
        r, n = self.replica, self.replicas
        chunks = ring_chunks(flat.size, n)
        for k in range(n - 1):
            send, recv = (r + n - k) % n, (r + 2 * n - k - 1) % n
            self._ring_send(outbox, step, k, edge_base + send, flat, chunks[send], codec_cfg, False,
                            direction, quiet)
            start, length = chunks[recv]
            got = self._ring_take(mailbox, step, k, edge_base + recv, length, direction, quiet)
            flat[start:start + length] += got
        if codec_cfg is not None:
            start, length = chunks[(r + 1) % n]
            flat[start:start + length] = _settle(codec_cfg, flat[start:start + length])
        for k in range(n - 1):
            send, recv = (r + 1 + n - k) % n, (r + n - k) % n
            self._ring_send(outbox, step, n - 1 + k, edge_base + send, flat, chunks[send], codec_cfg,
                            True, direction, quiet)
            start, length = chunks[recv]
            flat[start:start + length] = self._ring_take(mailbox, step, n - 1 + k, edge_base + recv,
                                                         length, direction, quiet)

    def _ring_send(self, outbox, step, k, edge, flat, chunk, codec_cfg, exact, direction,
                   quiet=False):
        start, length = chunk
        part = flat[start:start + length].copy()
        if codec_cfg is not None:
            msg = _encode(codec_cfg, part)
            if not exact or _same_bits(codec.decode(msg, length), part):
                outbox.send_encoded(self.stage, step, k, direction, edge, (length,), msg,
                                    not quiet)
                return
        outbox.send(self.stage, step, k, direction, edge, (length,), part, not quiet)

    def _ring_take(self, mailbox, step, k, edge, length, direction, quiet=False):
        key, what = (step, k, direction, edge, self.stage), \
            f"all-reduce chunk {edge} (ring step {k}) from the previous replica"
        if quiet:
            got = mailbox.take(key, self.timeout, what, self.peer_of(direction, self.stage))
        else:
            got = self.take(mailbox, key, what)
        if got.size != length:
            raise ProtocolError(f"all-reduce chunk {edge} has {got.size} values, expected {length}")
        return got.astype(F)

    def sync_weight(self, m, total):
        """This island's weight in a synchronisation: its share `m` of the round's `total`
        micro-batches, or 1 / R where the broker sends none (equal shares); float32 as the Rust
        nodes compute it, so both hold the same bits."""
        if m == 0 and total == 0:
            return F(1.0) / F(self.replicas)
        if 0 < m <= total:
            return F(m) / F(total)
        raise ProtocolError(f"an outer synchronisation weighing {m} of {total} micro-batches")

    def outer_sync(self, step, weight, overlap, fragment, mailbox, outbox):
        """Islands: averages each island's progress on the tensors of `fragment` (None: all)
        since their round began (`start - value`, `start` the anchor or where an overlapped
        exchange began; weighed by its share, `weight`) over the replicas ring by ring and
        moves the anchor with the outer optimizer (buffers take the averaged values). The
        previous overlapped exchange (if any) is applied first: the anchor takes its outer step
        and the stage moves onto it, keeping what it learnt since (as the Rust nodes do).
        Blocking: the stage then holds the new anchor on those tensors; with `overlap` the
        exchange runs on a thread of its own beside the next inner steps. The result's
        grad_square_sum is the anchor's sum of squares."""
        if not self.islands() or self.anchor is None:
            raise ProtocolError("an outer synchronisation for a stage that is not one of several islands")
        t0 = time.monotonic()
        self.progress.enter("updating", step)
        members = self.sync_members(fragment)
        starts = self.round_start or [None] * len(self.params)
        deltas = self.round_deltas(members)
        wait = 0.0
        if self.pending is not None:
            pending, self.pending = self.pending, None
            tj = time.monotonic()
            self.progress.enter("waiting", step, 0, self.ring_from)
            try:
                mean = _join(pending)
            finally:
                self.progress.resume()
            wait += time.monotonic() - tj
            self._apply_mean(mean)
            self.params = [p if s is None else p + (a - s)
                           for p, a, s in zip(self.params, self.anchor, starts)]
        self.round_start = None
        mailbox.begin_outer(step)
        base = dict(self.ring_sets()).get(fragment, 0)
        rings = self.member_rings(members)
        flats = [np.concatenate([deltas[i] * F(weight) for i in ring] or [np.zeros(0, F)])
                 for ring in rings]
        if overlap:
            self.pending = _spawn(f"outer-exchange-{step}", self._overlapped_exchange, step,
                                  (base, rings), flats, mailbox, outbox)
            self.round_start = [p.copy() if m else None for p, m in zip(self.params, members)]
        else:
            tj = time.monotonic()
            mean = self._exchange(step, (base, rings), flats, mailbox, outbox, False)
            wait += time.monotonic() - tj
            self._apply_mean(mean)
            self.params = [a.copy() if m else p
                           for p, a, m in zip(self.params, self.anchor, members)]
        self.progress.idle()
        out = StepOutcome()
        out.grad_square_sum = square_sum(self.anchor)
        out.wait_seconds = wait
        out.compute_seconds = max(0.0, time.monotonic() - t0 - wait)
        return out

    def round_deltas(self, members):
        """Each member tensor's progress over its round, `start - value`, where `start` is the
        anchor or where an overlapped exchange of it began; None for the other tensors."""
        starts = self.round_start or [None] * len(self.params)
        return [((self.anchor[i] if starts[i] is None else starts[i]) - self.params[i])
                if members[i] else None for i in range(len(self.params))]

    def _exchange(self, step, layout, flats, mailbox, outbox, quiet):
        """Sums the islands' weighted deltas (`flats`, one per ring of `layout`: the first edge
        and the rings) over the rings: the mean delta of every tensor they hold (None for the
        others). `quiet`: on a thread of its own, where the stage's progress is the compute
        thread's."""
        codec_cfg = self.outer_cfg.get("codec") or {"kind": "none"}
        codec_cfg = None if codec_cfg.get("kind", "none") == "none" else codec_cfg
        base, rings = layout
        mean = [None] * len(self.params)
        for j, (ring, flat) in enumerate(zip(rings, flats)):
            self.ring_sum(step, base + j * self.replicas, flat, codec_cfg, mailbox, outbox,
                          pb.OUTER_EXCHANGE, quiet)
            off = 0
            for i in ring:
                mean[i] = flat[off:off + self.params[i].size].copy()
                off += self.params[i].size
        return mean

    def _overlapped_exchange(self, step, layout, flats, mailbox, outbox):
        """The exchange on its own thread: one that fails because of a peer fails the step
        then under way at once, blaming that peer (the compute thread would otherwise learn of
        it only at the next synchronisation, where the error is raised again)."""
        try:
            return self._exchange(step, layout, flats, mailbox, outbox, True)
        except PeerError as e:
            mailbox.poison(f"the outer exchange of step {step}: {e}", e.peer, e.proven)
            raise

    def _apply_mean(self, mean):
        """The outer step along the averaged deltas: trainable parameters through outer SGD
        (optionally Nesterov), buffers to the anchor's minus theirs."""
        cfg = self.outer_cfg
        lr, mu, nesterov = F(cfg["lr"]), F(cfg["momentum"]), bool(cfg["nesterov"])
        for i, d in enumerate(mean):
            if d is None:
                continue
            if self.trainable[i]:
                m = self.momentum[i]
                m[:] = mu * m + d
                self.anchor[i] -= lr * ((d + mu * m) if nesterov else m)
            else:
                self.anchor[i] = self.anchor[i] - d

    def apply_update(self, step, lr, scale):
        self.progress.enter("updating", step)
        self.buffers_before = None
        scale = F(scale)
        if scale != F(1.0):
            self.grads = [g * scale if g is not None else None for g in self.grads]
        self.opt.update(self.params, self.grads, self.decay, lr)
        self.grads = [None] * len(self.params)
        self.progress.idle()


def _spawn(name, fn, *args):
    """Runs fn(*args) on a daemon thread; _join gives back its result or raises its error."""
    box = {}

    def run():
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # raised again by _join, on the stage's compute thread
            box["err"] = e

    t = threading.Thread(target=run, daemon=True, name=name)
    t.start()
    return t, box


def _join(pending):
    t, box = pending
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


# Elements per block of a sum of squares (fusion_train::square_sum's CHUNK).
_SQ_BLOCK = 1 << 14
_SQ_LANES = 8


def _block_square_sum(x):
    """One block as the Rust nodes sum it: eight lanes (element i in lane i mod 8), each added in
    order, the lanes added in order, then the tail beyond the last whole eight."""
    whole = x.size // _SQ_LANES * _SQ_LANES
    total = 0.0
    if whole:
        lanes = np.cumsum(np.square(x[:whole]).reshape(-1, _SQ_LANES), axis=0)[-1]
        for lane in lanes:
            total += float(lane)
    tail = 0.0
    for e in np.square(x[whole:]):
        tail += float(e)
    return total + tail


def square_sum(tensors):
    """Sum of squares in float64 with the Rust nodes' order (the broker compares islands' sums
    bit for bit): each tensor in blocks of 16384 elements summed in eight lanes, the blocks added
    in order, then the tensors in order."""
    total = 0.0
    for t in tensors:
        x = np.asarray(t, np.float64).ravel()
        tensor = 0.0
        for at in range(0, x.size, _SQ_BLOCK):
            tensor += _block_square_sum(x[at:at + _SQ_BLOCK])
        total += tensor
    return total


def _encode(codec_cfg, x):
    return codec.Compressor(codec_cfg, "f16", 0).compress(x)


def _same_bits(a, b):
    return a.size == b.size and np.array_equal(np.asarray(a, F).view(np.uint32), np.asarray(b, F).view(np.uint32))


def _settle(codec_cfg, x):
    """The fixed point of decoding x's encoding (at most 8 rounds)."""
    x = np.asarray(x, F).copy()
    for _ in range(8):
        try:
            y = codec.decode(_encode(codec_cfg, x), x.size)
        except ProtocolError:
            return x
        if _same_bits(y, x):
            return x
        x = y
    return x


def peer_blame(e):
    if isinstance(e, PeerError):
        return e.peer, e.proven
    return "", False
