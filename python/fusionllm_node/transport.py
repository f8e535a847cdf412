"""The data plane's transport (docs/PROTOCOL.md, "Data plane"): mutual TLS with the job's CA,
length-prefixed protobuf frames, the Hello handshake, and tensors as a header plus chunks."""

import hashlib
import hmac
import select
import socket
import ssl
import struct
import time

import numpy as np

from .errors import ProtocolError, Refused
from .wire import fusionllm_pb2 as pb

PROTOCOL_VERSION = 12
CHUNK_BYTES = 4 << 20
DEFAULT_MAX_FRAME = CHUNK_BYTES + 64 * 1024
HANDSHAKE_TIMEOUT = 10.0
FRAME_BODY_TIMEOUT = 120.0
DTYPE_SIZE = {pb.F32: 4, pb.F16: 2, pb.BF16: 2, pb.I32: 4, pb.F64: 8}


class Closed(ProtocolError):
    """The stream ended (mid-frame or between frames) or broke: a suspicion, never proof."""


class Stalled(Closed):
    """A frame's write, or its body's arrival, did not complete in time: a suspicion."""


class Identity:
    """A node's certificate, key and the job's CA, as files (`NAME.pem`, `NAME.key`, `ca.pem`)."""

    def __init__(self, cert, key, ca):
        self.cert, self.key, self.ca = cert, key, ca
        with open(cert, "rb") as f:
            pem = f.read()
        self.cert_der = ssl.PEM_cert_to_DER_cert(pem.decode("ascii"))

    def server_context(self):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        ctx.check_hostname = True
        return ctx


def fingerprint(der):
    return hashlib.sha256(der).digest()


def certificate_names(cert_dict):
    return {v.lower() for k, v in cert_dict.get("subjectAltName", ()) if k == "DNS"}


def admitted(tls, name, pin):
    """None when the peer's certificate is issued for `name` and hashes to `pin`, else why not
    (the words of the Rust nodes)."""
    der = tls.getpeercert(binary_form=True)
    if not der:
        return "no certificate was presented"
    if name.lower() not in certificate_names(tls.getpeercert() or {}):
        return f"the certificate presented is not issued for '{name}'"
    if not pin:
        return f"the broker admitted no certificate for '{name}'"
    if not hmac.compare_digest(fingerprint(der), bytes(pin)):
        return f"the certificate presented for '{name}' is not the one the broker admitted"
    return None


def _read_exact(sock, n, deadline=None):
    """n bytes; with a deadline (time.monotonic()), all of them by then (a peer trickling bytes
    cannot hold the reader), raising socket.timeout after it."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline")
            sock.settimeout(left)
        try:
            part = sock.recv(min(n - len(buf), 1 << 20))
        except (socket.timeout, TimeoutError):
            raise
        except (OSError, ssl.SSLError) as e:
            raise Closed(f"peer closed the connection ({e})") from None
        if not part:
            raise Closed("peer closed the connection")
        buf += part
    return bytes(buf)


class FrameStream:
    """Frames over one TLS socket: 4-byte big-endian length, then a protobuf Frame."""

    def __init__(self, sock, max_frame=DEFAULT_MAX_FRAME):
        self.sock = sock
        self.max_frame = max_frame

    def write(self, frame, timeout=None):
        data = frame.SerializeToString()
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(struct.pack(">I", len(data)) + data)
        except (socket.timeout, TimeoutError):
            raise Stalled(f"writing a frame of {len(data)} bytes did not complete within {timeout} s") from None
        except (OSError, ssl.SSLError) as e:
            raise Closed(f"the connection broke: {e}") from None

    def read(self, wait=None, body_timeout=FRAME_BODY_TIMEOUT, deadline=None):
        """The next frame: its length within `wait` seconds (None: no limit), then its body
        within `body_timeout` of the length; with `deadline` (time.monotonic()), the whole frame
        by then."""
        start = time.monotonic()
        head_by = deadline if deadline is not None else (None if wait is None else start + wait)
        self.sock.settimeout(None)
        try:
            head = _read_exact(self.sock, 4, head_by)
        except (socket.timeout, TimeoutError):
            raise Stalled(f"nothing arrived within {wait if wait is not None else deadline - start:.0f} s") from None
        (n,) = struct.unpack(">I", head)
        if n > self.max_frame:
            raise ProtocolError(f"peer sent a frame of {n} bytes, above the limit of {self.max_frame}")
        body_by = deadline if deadline is not None else time.monotonic() + body_timeout
        try:
            body = _read_exact(self.sock, n, body_by)
        except (socket.timeout, TimeoutError):
            raise Stalled(f"a frame of {n} bytes did not arrive within {int(body_timeout)} s") from None
        f = pb.Frame()
        try:
            f.ParseFromString(body)
        except Exception:  # protobuf raises DecodeError (a Message error) on malformed bytes
            raise ProtocolError("peer sent an undecodable frame") from None
        return f

    def readable(self):
        """Whether the other side wrote something or closed, without reading (a receiver never
        writes after its Hello: a Goodbye refuses the session, an end breaks it)."""
        try:
            p = select.poll()
            p.register(self.sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(p.poll(0)) or self.sock.pending() > 0
        except (OSError, ValueError):
            return True

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def hello(node_id, token, generation, backend, version, probe=False, fetch=False):
    return pb.Hello(protocol_version=PROTOCOL_VERSION, node_id=node_id, token=token,
                    backend=backend, software_version=version, generation=generation,
                    probe=probe, fetch=fetch)


def dial(identity, peer_id, address, pin, me, timeout=10.0):
    """Opens a session to `peer_id` at `address`: TLS for the peer's name, its certificate
    checked against `pin`, Hello both ways. Returns the FrameStream and the peer's Hello."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError) as e:
        raise Closed(f"{peer_id} at {address}: {e}") from None
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = identity.client_context().wrap_socket(raw, server_hostname=peer_id)
    except (OSError, ssl.SSLError, ssl.CertificateError) as e:
        raw.close()
        raise Closed(f"{peer_id} at {address}: TLS: {e}") from None
    why = admitted(tls, peer_id, pin)
    if why:
        tls.close()
        raise Refused(f"{peer_id} at {address}: {why}")
    fs = FrameStream(tls)
    fs.write(pb.Frame(hello=me), timeout=HANDSHAKE_TIMEOUT)
    f = fs.read(deadline=time.monotonic() + HANDSHAKE_TIMEOUT)
    if f.WhichOneof("body") == "goodbye":
        fs.close()
        raise Refused(f"{peer_id} refused the session: {f.goodbye.reason}")
    if f.WhichOneof("body") != "hello":
        fs.close()
        raise ProtocolError("the first frame of a session must be a hello")
    if f.hello.protocol_version != PROTOCOL_VERSION:
        fs.close()
        raise Refused(f"peer speaks protocol {f.hello.protocol_version}, this node {PROTOCOL_VERSION}")
    return fs, f.hello


def accept_hello(fs, me, token):
    """The accepting side's handshake: the peer's Hello checked (version, token), ours back; the
    whole Hello within 10 s."""
    f = fs.read(deadline=time.monotonic() + HANDSHAKE_TIMEOUT)
    kind = f.WhichOneof("body")
    if kind == "goodbye":
        raise Refused(f.goodbye.reason)
    if kind != "hello":
        raise ProtocolError("the first frame of a session must be a hello")
    peer = f.hello
    refusal = None
    if peer.protocol_version != PROTOCOL_VERSION:
        refusal = f"protocol version {peer.protocol_version} is not supported (this node speaks {PROTOCOL_VERSION})"
    elif not hmac.compare_digest(peer.token.encode(), token.encode()):
        refusal = "invalid join token"
    if refusal:
        goodbye(fs, refusal)
        raise Refused(f"refused '{peer.node_id}': {refusal}")
    fs.write(pb.Frame(hello=me), timeout=HANDSHAKE_TIMEOUT)
    return peer


def goodbye(fs, reason):
    try:
        fs.write(pb.Frame(goodbye=pb.Goodbye(reason=reason)), timeout=5.0)
    except ProtocolError:
        pass


def send_tensor(fs, header, data, stall, on_chunk=None):
    """Writes one tensor: its header, then chunks of at most 4 MiB in order."""
    header.total_bytes = len(data)
    fs.write(pb.Frame(header=header), timeout=stall)
    view = memoryview(data)
    for off in range(0, len(data), CHUNK_BYTES):
        fs.write(pb.Frame(chunk=pb.TensorChunk(offset=off, data=bytes(view[off:off + CHUNK_BYTES]))),
                 timeout=stall)
        if on_chunk:
            on_chunk()


def recv_tensor(fs, expected):
    """Reads one tensor with every check of the receiver table. `expected(edge, direction)`
    gives the graph's shape or None. Returns (header, bytes); a Goodbye raises Refused."""
    f = fs.read(wait=None)
    kind = f.WhichOneof("body")
    if kind == "goodbye":
        raise Refused(f.goodbye.reason)
    if kind != "header":
        raise ProtocolError("expected a tensor header, got a chunk" if kind == "chunk"
                            else f"expected a tensor header, got {kind}")
    h = f.header
    dname = pb.Direction.Name(h.direction) if h.direction in pb.Direction.values() else str(h.direction)
    shape = expected(h.edge, h.direction)
    if shape is None:
        raise ProtocolError(f"edge {h.edge}: not an edge this node receives ({_pretty(dname)})")
    if h.dtype not in (pb.F32, pb.F64, pb.COMPRESSED):
        tname = pb.DType.Name(h.dtype) if h.dtype in pb.DType.values() else str(h.dtype)
        raise ProtocolError(f"edge {h.edge}: got {tname} {_pretty(dname)}, expected F32 {_pretty(dname)}")
    if tuple(h.shape) != tuple(shape):
        raise ProtocolError(f"edge {h.edge}: shape {list(h.shape)} does not match the graph's {list(shape)}")
    n = int(np.prod(shape, dtype=np.uint64)) if shape else 1
    if h.dtype == pb.COMPRESSED:
        limit = 4 * n + n // 8 + 64
        if h.total_bytes > limit:
            raise ProtocolError(f"edge {h.edge}: a compressed message of {h.total_bytes} bytes for {n} elements")
    elif h.total_bytes != n * DTYPE_SIZE[h.dtype]:
        raise ProtocolError(f"edge {h.edge}: declares {h.total_bytes} bytes, its shape needs Some({n * DTYPE_SIZE[h.dtype]})")
    buf = bytearray()
    while len(buf) < h.total_bytes:
        f = fs.read(wait=None)
        if f.WhichOneof("body") != "chunk":
            raise ProtocolError(f"edge {h.edge}: expected a chunk, got {f.WhichOneof('body')}")
        c = f.chunk
        if c.offset != len(buf):
            raise ProtocolError(f"edge {h.edge}: chunk at offset {c.offset}, expected {len(buf)}")
        if not c.data or len(c.data) > h.total_bytes - len(buf):
            raise ProtocolError(f"edge {h.edge}: chunk of {len(c.data)} bytes with {h.total_bytes - len(buf)} bytes left")
        buf += c.data
    return h, bytes(buf)


def _pretty(direction_name):
    return direction_name.title().replace("_", "")

