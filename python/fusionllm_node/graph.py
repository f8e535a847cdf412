"""The OP-DAG IR's JSON form (`format: "fusionllm.opdag"`, `version: 1`), parsed and checked.

A stage graph arrives from the broker, which the node does not trust: every index is checked
before anything is indexed with it, and the operators are put in the same topological order the
Rust executor uses (Kahn's algorithm, ties broken by stored order), so both run a stage's
operators in one order.
"""

import json
from dataclasses import dataclass, field
from math import prod

from .errors import ProtocolError

FORMAT_NAME = "fusionllm.opdag"
FORMAT_VERSION = 1

# Operator type -> (number of inputs, parameter roles).
OPS = {
    "embedding": (1, ("table",)),
    "positional_embedding": (1, ("table",)),
    "linear": (1, None),  # weight, then bias when `bias`
    "layer_norm": (1, ("gamma", "beta")),
    "causal_self_attention": (1, ()),
    "gelu": (1, ()),
    "relu": (1, ()),
    "add": (2, ()),
    "conv2d": (1, None),  # weight, then bias when `bias`
    "batch_norm2d": (1, ("gamma", "beta", "running_mean", "running_var")),
    "max_pool2d": (1, ()),
    "avg_pool2d": (1, ()),
    "global_avg_pool": (1, ()),
    "flatten": (1, ()),
    "softmax_cross_entropy": (2, ()),
    "rms_norm": (1, ("gamma",)),
    "silu": (1, ()),
    "mul": (2, ()),
    "grouped_query_attention": (3, ()),
}


@dataclass
class Tensor:
    name: str
    shape: tuple
    dtype: str  # "f32" or "i32" (the wire dtypes of graph tensors)

    @property
    def numel(self):
        return prod(self.shape)


@dataclass
class Param:
    name: str
    shape: tuple
    trainable: bool

    @property
    def numel(self):
        return prod(self.shape)


@dataclass
class Node:
    name: str
    op: dict
    inputs: list
    outputs: list
    params: list

    @property
    def kind(self):
        return self.op["type"]


@dataclass
class Graph:
    name: str
    tensors: list
    params: list
    nodes: list
    inputs: list
    outputs: list
    order: list = field(default_factory=list)


def _ints(v, what):
    if not isinstance(v, list) or not all(isinstance(i, int) and i >= 0 for i in v):
        raise ProtocolError(f"stage graph: {what} must be a list of non-negative integers")
    return v


def _shape(v, what):
    return tuple(_ints(v, f"the shape of {what}"))


def parse_graph(text):
    """Parses and checks a stage graph; raises ProtocolError naming what is wrong."""
    try:
        g = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"stage graph: not JSON ({e})") from None
    if not isinstance(g, dict):
        raise ProtocolError("stage graph: not a JSON object")
    if g.get("format") != FORMAT_NAME or g.get("version") != FORMAT_VERSION:
        raise ProtocolError(
            f"stage graph: format {g.get('format')!r} version {g.get('version')!r} "
            f"(this node reads {FORMAT_NAME} version {FORMAT_VERSION})"
        )
    try:
        tensors = [Tensor(t["name"], _shape(t["shape"], t["name"]), t["dtype"]) for t in g["tensors"]]
        params = [Param(p["name"], _shape(p["shape"], p["name"]), bool(p["trainable"])) for p in g["params"]]
        nodes = [
            Node(n["name"], n["op"], _ints(n["inputs"], "inputs"), _ints(n["outputs"], "outputs"),
                 _ints(n["params"], "params"))
            for n in g["nodes"]
        ]
        graph = Graph(str(g.get("name", "")), tensors, params, nodes,
                      _ints(g["inputs"], "inputs"), _ints(g["outputs"], "outputs"))
    except (KeyError, TypeError) as e:
        raise ProtocolError(f"stage graph: missing or malformed field {e}") from None
    _check(graph)
    graph.order = topo_order(graph)
    return graph


def _check(g):
    for t in g.tensors:
        if t.dtype not in ("f32", "i32"):
            raise ProtocolError(f"stage graph: tensor '{t.name}' has dtype {t.dtype!r}")
    nt, np_ = len(g.tensors), len(g.params)
    for i in g.inputs + g.outputs:
        if i >= nt:
            raise ProtocolError(f"stage graph: tensor #{i} does not exist ({nt} tensors)")
    for n in g.nodes:
        if not isinstance(n.op, dict) or n.op.get("type") not in OPS:
            raise ProtocolError(f"stage graph: node '{n.name}' has an unknown operator {n.op!r}")
        arity, _ = OPS[n.kind]
        if len(n.inputs) != arity or len(n.outputs) != 1:
            raise ProtocolError(
                f"stage graph: node '{n.name}' ({n.kind}) has {len(n.inputs)} inputs and "
                f"{len(n.outputs)} outputs (expected {arity} and 1)"
            )
        for i in n.inputs + n.outputs:
            if i >= nt:
                raise ProtocolError(f"stage graph: node '{n.name}' names tensor #{i} of {nt}")
        for p in n.params:
            if p >= np_:
                raise ProtocolError(f"stage graph: node '{n.name}' names parameter #{p} of {np_}")


def topo_order(g):
    """Node indices in Kahn's order with a FIFO queue seeded in stored order (as the Rust executor)."""
    producer = {}
    for i, n in enumerate(g.nodes):
        for o in n.outputs:
            if o in producer:
                raise ProtocolError(f"stage graph: tensor #{o} has two producers")
            producer[o] = i
    consumers = [[] for _ in g.nodes]
    indeg = [0] * len(g.nodes)
    for i, n in enumerate(g.nodes):
        for t in n.inputs:
            p = producer.get(t)
            if p is not None:
                consumers[p].append(i)
                indeg[i] += 1
            elif t not in g.inputs:
                raise ProtocolError(f"stage graph: node '{n.name}' reads tensor #{t}, which nothing produces")
    from collections import deque

    queue = deque(i for i, d in enumerate(indeg) if d == 0)
    order = []
    while queue:
        i = queue.popleft()
        order.append(i)
        for c in consumers[i]:
            indeg[c] -= 1
            if indeg[c] == 0:
                queue.append(c)
    if len(order) != len(g.nodes):
        raise ProtocolError("stage graph: the operators form a cycle")
    return order
