"""Runs a stage graph forward with a tape and differentiates it in reverse, operator by operator
with each operator's VJP, in the order the Rust executor uses (so gradients that meet at a tensor
are summed in the same order)."""

from .errors import OpError


class ForwardPass:
    def __init__(self, outputs, buffer_updates, tape, train):
        self.outputs = outputs  # tensor id -> value
        self.buffer_updates = buffer_updates  # [(param id, value)]
        self.tape = tape  # node index -> (inputs, saved), when recorded
        self.train = train


class Executor:
    """Executes `graph` on `backend` (ops_numpy or the PyTorch kernels)."""

    def __init__(self, backend, graph):
        self.backend = backend
        self.graph = graph
        self.last_use = [-1] * len(graph.tensors)
        for pos, nid in enumerate(graph.order):
            for t in graph.nodes[nid].inputs:
                self.last_use[t] = pos
        for t in graph.outputs:
            self.last_use[t] = len(graph.order) + 1

    def forward(self, params, feeds, train, record):
        """`params`: backend values by local parameter index; `feeds`: values of every graph
        input. Returns a ForwardPass whose tape the backward pass consumes."""
        g = self.graph
        for t in g.inputs:
            if t not in feeds:
                raise OpError(f"no value for input '{g.tensors[t].name}'")
        values = dict(feeds)
        tape = {}
        updates = []
        for pos, nid in enumerate(g.order):
            node = g.nodes[nid]
            ins = [values[t] for t in node.inputs]
            ps = [params[p] for p in node.params]
            try:
                out, saved, upd = self.backend.forward(node.op, ins, ps, train)
            except OpError as e:
                raise OpError(f"operator '{node.name}': {e}") from None
            for slot, v in upd:
                updates.append((node.params[slot], v))
            values[node.outputs[0]] = out
            if record:
                tape[nid] = (ins, saved)
            for t in node.inputs:
                if self.last_use[t] == pos and t not in g.outputs:
                    values.pop(t, None)
        outputs = {t: values[t] for t in g.outputs if t in values}
        return ForwardPass(outputs, updates, tape, train)

    def backward(self, fp, params, seeds):
        """Gradients of the stage's parameters (by local index, None where none flows) and of
        its inputs (by tensor id), from `seeds` (tensor id -> gradient of an output)."""
        g, b = self.graph, self.backend
        grads = dict(seeds)
        pgrads = [None] * len(g.params)
        for nid in reversed(g.order):
            node = g.nodes[nid]
            if nid not in fp.tape:
                continue
            dy = grads.pop(node.outputs[0], None)
            if dy is None:
                continue
            ins, saved = fp.tape.pop(nid)
            ps = [params[p] for p in node.params]
            try:
                gin, gpar = b.backward(node.op, ins, ps, saved, dy, fp.train)
            except OpError as e:
                raise OpError(f"operator '{node.name}' (backward): {e}") from None
            for t, gi in zip(node.inputs, gin):
                if gi is not None:
                    prev = grads.get(t)
                    grads[t] = gi if prev is None else b.add(prev, gi)
            for p, gp in zip(node.params, gpar):
                if gp is not None:
                    pgrads[p] = gp if pgrads[p] is None else b.add(pgrads[p], gp)
        inputs = {t: v for t, v in grads.items() if t in g.inputs}
        return pgrads, inputs
