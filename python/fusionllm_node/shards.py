"""Sharded snapshots on the node's disk (docs/PROTOCOL.md, "Sharded snapshots"): a stage's state as
a safetensors file (`param.NAME`, `opt.first.NAME`, `opt.second.NAME`, f32) under
`STATE_DIR/RUN/step-NNNNNNNN/SHARD.safetensors` with its hex SHA-256 beside it, copies fetched
from and served to the peers the broker names, and the stage filled from shards by tensor name."""

import hashlib
import json
import os
import re
import shutil
import socket
import struct
import tempfile
import threading
import time

import numpy as np

from .errors import NodeError, ProtocolError
from .transport import CHUNK_BYTES, dial, goodbye, hello
from .wire import fusionllm_pb2 as pb

NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
FRAME_WAIT = 120.0


class ShardError(NodeError):
    def __init__(self, shard, reason):
        super().__init__(f"shard '{shard}': {reason}")


def deadline(size):
    """Seconds a shard copy may take: 60 plus 1 per MB."""
    return 60 + size // 1_000_000


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class ShardStore:
    def __init__(self, root=None):
        self._temp = None
        if root is None:
            self._temp = tempfile.TemporaryDirectory(prefix="fusionllm-node-state-")
            root = self._temp.name
        os.makedirs(root, exist_ok=True)
        self.root = root
        self.newest_kept = None
        self.lock = threading.Lock()

    def path(self, run, step, shard):
        for what, name in (("run", run), ("shard", shard)):
            if not NAME.match(name):
                raise ProtocolError(f"{what} name {name[:40]!r} is not 1-128 characters of [A-Za-z0-9_-]")
        return os.path.join(self.root, run, f"step-{step:08d}", f"{shard}.safetensors")

    def find(self, run, step, shard):
        """(path, bytes, sha256) of a shard this node holds."""
        path = self.path(run, step, shard)
        try:
            size = os.path.getsize(path)
            with open(path[: -len(".safetensors")] + ".sha256") as f:
                sha = f.read().strip()
        except OSError:
            raise ShardError(shard, f"this node holds no shard of step {step} by that name") from None
        return path, size, sha

    def prepare(self, run, step, shard):
        path = self.path(run, step, shard)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def commit(self, path, sha):
        with open(path[: -len(".safetensors")] + ".sha256", "w") as f:
            f.write(sha)
        return path, os.path.getsize(path), sha

    def retain(self, run, keep):
        """Keeps only the steps of `run` in `keep` (never one newer than the newest kept) and no
        other run; nothing at all when an earlier call kept a newer step."""
        newest = max(keep, default=0)
        with self.lock:
            if self.newest_kept and self.newest_kept[0] == run and self.newest_kept[1] > newest:
                return
            self.newest_kept = (run, newest)
        for r in os.listdir(self.root):
            p = os.path.join(self.root, r)
            if r != run:
                if os.path.isdir(p):
                    shutil.rmtree(p, ignore_errors=True)
                continue
            for s in os.listdir(p):
                m = re.match(r"^step-(\d+)$", s)
                n = int(m.group(1)) if m else None
                if n is None or (n < newest and n not in keep):
                    shutil.rmtree(os.path.join(p, s), ignore_errors=True)


def layout(names, shapes, trainable, adam):
    out = []
    for name, shape, tr in zip(names, shapes, trainable):
        out.append((f"param.{name}", shape))
        if tr and int(np.prod(shape)) > 0:
            out.append((f"opt.first.{name}", shape))
            if adam:
                out.append((f"opt.second.{name}", shape))
    return out


def write_safetensors(path, tensors):
    """`tensors`: name -> (shape, float32 array). Written sorted by name, through a temporary
    file renamed into place and flushed to disk."""
    header, offset = {}, 0
    for name in sorted(tensors):
        shape, values = tensors[name]
        n = int(np.prod(shape)) if shape else 1
        if values.size != n:
            raise NodeError(f"{name} has {values.size} elements where its shape holds {n}")
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + 4 * n]}
        offset += 4 * n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path[: -len(".safetensors")] + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in sorted(tensors):
            f.write(np.asarray(tensors[name][1], "<f4").tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_safetensors(path, shard):
    """name -> float32 array, every entry checked against the file's size."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ShardError(shard, f"{path} is not a safetensors file")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > len(data) - 8:
        raise ShardError(shard, f"{path}: its header runs past the file")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise ShardError(shard, f"{path}: a malformed header ({e})") from None
    body, out = data[8 + n:], {}
    if not isinstance(header, dict):
        raise ShardError(shard, f"{path}: the header is not a JSON object")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(v) for v in info["data_offsets"])
            count = int(np.prod([int(d) for d in info["shape"]])) if info["shape"] else 1
        except (KeyError, TypeError, ValueError):
            raise ShardError(shard, f"{path}: tensor '{name}' has a malformed entry") from None
        if info["dtype"] != "F32" or end - start != 4 * count or not 0 <= start <= end <= len(body):
            raise ShardError(shard, f"{path}: tensor '{name}' is not {count} f32 values inside the file")
        out[name] = np.frombuffer(body, "<f4", count, start).astype(np.float32)
    return out


def save_copy(store, copy, run, step, shard):
    """Writes a captured stage (names, shapes, trainable, adam, values, first, second)."""
    path = store.prepare(run, step, shard)
    names, shapes, trainable, adam, values, first, second = copy
    tensors = {}
    for name, shape in layout(names, shapes, trainable, adam):
        i = names.index(name.split(".", 2)[-1] if name.startswith("opt.") else name[len("param."):])
        src = values if name.startswith("param.") else first if name.startswith("opt.first.") else second
        tensors[name] = (shape, src[i])
    write_safetensors(path, tensors)
    return store.commit(path, sha256_file(path))


def load_stage(store, worker, run, step, shards, sums):
    """Fills `worker`'s values and moments from the named shards, checked by SHA-256; returns
    which of (value, first, second) each parameter got."""
    files = []
    for shard, sha in zip(shards, sums):
        path, _, _ = store.find(run, step, shard)
        actual = sha256_file(path)
        if actual != sha:
            raise ShardError(shard, f"{path} is corrupt: its checksum is {actual}, the snapshot's {sha}")
        files.append((shard, read_safetensors(path, shard)))
    filled = []
    for i, p in enumerate(worker.graph.params):
        got = [False, False, False]
        for k, (prefix, target) in enumerate((("param", worker.params), ("opt.first", worker.opt.first),
                                              ("opt.second", worker.opt.second))):
            name = f"{prefix}.{p.name}"
            hit = next(((s, f[name]) for s, f in files if name in f), None)
            if hit is None:
                continue
            shard, values = hit
            if values.size != target[i].size:
                raise ShardError(shard, f"tensor '{name}' has {values.size} elements where the stage holds {target[i].size}")
            if not np.isfinite(values).all():
                raise ShardError(shard, f"tensor '{name}' holds a non-finite value")
            target[i] = values.copy()
            got[k] = True
        filled.append(got)
    return filled


def fetch(plane, store, link, run, step, shard, size, sha, cancel=None):
    """Copies a shard from the peer the broker named; checked size, chunks and checksum."""
    me = hello(plane.node_id, plane.token, 0, plane.backend_name, plane.version, fetch=True)
    fs, _ = dial(plane.identity, link.node_id, link.address, bytes(link.certificate_sha256), me)
    peer = link.node_id
    done = threading.Event()
    if cancel is not None:
        threading.Thread(target=_stop_on_cancel, args=(fs, cancel, done), daemon=True).start()
    try:
        fs.write(pb.Frame(shard_request=pb.ShardRequest(run_id=run, step=step, shard=shard)), timeout=FRAME_WAIT)
        f = fs.read(wait=FRAME_WAIT)
        kind = f.WhichOneof("body")
        if kind == "goodbye":
            raise ShardError(shard, f"{peer} refused to send it: {f.goodbye.reason}")
        if kind != "shard_file":
            raise ShardError(shard, f"{peer} answered out of turn")
        if f.shard_file.total_bytes != size or f.shard_file.sha256 != sha:
            raise ShardError(shard, f"{peer} offers {f.shard_file.total_bytes} bytes with checksum "
                                    f"{f.shard_file.sha256}, the snapshot recorded {size} bytes with {sha}")
        path = store.prepare(run, step, shard)
        # A file of this fetch's own: an abandoned fetch of the same shard cannot touch it.
        fd, partial = tempfile.mkstemp(prefix=f"{shard}.", suffix=".partial", dir=os.path.dirname(path))
        until, got, h = time.monotonic() + deadline(size), 0, hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out:
                while got < size:
                    if cancel is not None and cancel.is_set():
                        raise ShardError(shard, "given up by a reset")
                    if time.monotonic() > until:
                        raise ShardError(shard, f"{peer} did not send its {size} bytes within {deadline(size)} s")
                    f = fs.read(wait=FRAME_WAIT)
                    if f.WhichOneof("body") == "goodbye":
                        raise ShardError(shard, f"{peer} stopped after {got} bytes: {f.goodbye.reason}")
                    if f.WhichOneof("body") != "chunk":
                        raise ShardError(shard, f"{peer} sent a stray frame")
                    c = f.chunk
                    if c.offset != got or not c.data or got + len(c.data) > size:
                        raise ShardError(shard, f"{peer} sent {len(c.data)} bytes at offset {c.offset} "
                                                f"where offset {got} of {size} was due")
                    h.update(c.data)
                    out.write(c.data)
                    got += len(c.data)
                out.flush()
                os.fsync(out.fileno())
            if h.hexdigest() != sha:
                raise ShardError(shard, f"{peer} sent bytes whose checksum is {h.hexdigest()}, not {sha}")
        except BaseException:
            try:
                os.remove(partial)
            except OSError:
                pass
            raise
        if cancel is not None and cancel.is_set():
            os.remove(partial)
            raise ShardError(shard, "given up by a reset")
        os.replace(partial, path)
        return store.commit(path, sha)
    finally:
        done.set()
        fs.close()


def _stop_on_cancel(fs, cancel, done):
    """Shuts the fetch's socket down when a reset gives the fetch up (a read blocked on a slow
    holder returns at once); ends with the fetch."""
    while not done.is_set():
        if cancel.wait(0.2):
            try:
                socket.socket.shutdown(fs.sock, socket.SHUT_RDWR)
            except OSError:
                pass
            return


def serve(fs, peer, store):
    """Answers one fetch session: a ShardRequest, then the file as chunks (or a Goodbye)."""
    f = fs.read(wait=FRAME_WAIT)
    if f.WhichOneof("body") != "shard_request":
        raise ProtocolError(f"{peer} sent no shard request")
    q = f.shard_request
    try:
        path, size, sha = store.find(q.run_id, q.step, q.shard)
    except (ShardError, ProtocolError) as e:
        goodbye(fs, str(e))
        return
    until = time.monotonic() + deadline(size)
    fs.write(pb.Frame(shard_file=pb.ShardFile(total_bytes=size, sha256=sha)), timeout=FRAME_WAIT)
    with open(path, "rb") as src:
        off = 0
        while off < size:
            if time.monotonic() > until:
                raise ShardError(q.shard, f"{peer} did not take the file within {deadline(size)} s")
            block = src.read(min(1 << 20, CHUNK_BYTES, size - off))
            if not block:
                raise ShardError(q.shard, f"{path} shrank while being sent")
            fs.write(pb.Frame(chunk=pb.TensorChunk(offset=off, data=block)), timeout=FRAME_WAIT)
            off += len(block)

