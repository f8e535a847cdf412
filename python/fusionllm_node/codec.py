"""The compressed tensor format of docs/PROTOCOL.md ("Compressed tensors"): a self-describing
message (dense f32/f16/bf16 values, sparse values with absolute, delta-varint or bitmap indices,
or int8 blocks), decoded with every check a receiver makes, and encoded for the codecs the broker
chooses per link (`SetCompression`), with error feedback on gradients."""

import struct

import numpy as np

from .errors import ProtocolError

MAGIC = 0xC5
VERSION = 1
DENSE, SPARSE, INT8 = 0, 1, 2
F32, F16, BF16, I8 = 0, 1, 2, 3
I8_RUN = 256
HEADER = 12
F32_MAX = float(np.finfo(np.float32).max)


class Malformed(ProtocolError):
    pass


def value_bytes(t, count):
    if t == F32:
        return 4 * count
    if t in (F16, BF16):
        return 2 * count
    if t == I8:
        return 4 * -(-count // I8_RUN) + count
    raise Malformed(f"unknown value type {t}")


# ---- decoding ----------------------------------------------------------------------------------


def _finite(v, what="value"):
    bad = ~np.isfinite(v)
    if bad.any():
        raise Malformed(f"{what} {int(np.argmax(bad))} is not finite")
    return v


def _read_int8(b, count, run):
    runs = -(-count // run)
    if len(b) != 4 * runs + count:
        raise Malformed(f"int8: {runs} scales and {count} values need {4 * runs + count} bytes, have {len(b)}")
    scales = _finite(np.frombuffer(b, "<f4", runs), "int8 scale")
    neg = scales < 0
    if neg.any():
        raise Malformed(f"int8 scale {int(np.argmax(neg))} is negative")
    big = np.abs(scales) > F32_MAX / 128.0
    if big.any():
        i = int(np.argmax(big))
        raise Malformed(f"int8 scale {i} ({scales[i]}) overflows when dequantised")
    q = np.frombuffer(b, np.int8, count, 4 * runs).astype(np.float32)
    # One scale per value by index (never `run` values per scale: a hostile block size could
    # ask for gigabytes).
    return q * scales[np.arange(count) // run]


def _read_values(b, t, count):
    if t == F32:
        v = np.frombuffer(b, "<f4", count).astype(np.float32)
    elif t == F16:
        v = np.frombuffer(b, "<f2", count).astype(np.float32)
    elif t == BF16:
        v = (np.frombuffer(b, "<u2", count).astype(np.uint32) << 16).view(np.float32)
    else:
        v = _read_int8(b, count, I8_RUN)
    return _finite(v)


def _read_indices(enc, b, k, n):
    if enc == 0:
        if len(b) != 4 * k:
            raise Malformed(f"{len(b)} bytes of absolute indices for k = {k}")
        idx = np.frombuffer(b, "<u4", k).astype(np.int64)
    elif enc == 1:
        out, prev, at = [], None, 0
        while at < len(b):
            g, shift = 0, 0
            while True:
                if at >= len(b):
                    raise Malformed("a delta-varint index runs past its bytes")
                byte = b[at]
                at += 1
                if shift >= 35:
                    raise Malformed("a delta-varint index is longer than 5 bytes")
                g |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            i = g if prev is None else prev + g + 1
            if i >= n:
                raise Malformed(f"index {i} is out of range for {n} elements")
            if len(out) == k:
                raise Malformed(f"more than k = {k} delta-varint indices")
            out.append(i)
            prev = i
        idx = np.array(out, np.int64)
    elif enc == 2:
        if len(b) != -(-n // 8):
            raise Malformed(f"a bitmap of {len(b)} bytes for {n} elements")
        bits = np.unpackbits(np.frombuffer(b, np.uint8), bitorder="little")
        idx = np.flatnonzero(bits).astype(np.int64)
        if idx.size and idx[-1] >= n:
            raise Malformed(f"bitmap bit {int(idx[idx >= n][0])} is beyond {n} elements")
        if idx.size > k:
            raise Malformed(f"the bitmap has more than k = {k} bits set")
    else:
        raise Malformed(f"unknown index encoding {enc}")
    if idx.size != k:
        raise Malformed(f"{idx.size} indices for k = {k}")
    if k > 1 and (np.diff(idx) <= 0).any():
        j = int(np.argmax(np.diff(idx) <= 0))
        raise Malformed(f"indices must strictly increase (duplicate or out of order: {idx[j]} then {idx[j + 1]})")
    if k and idx[-1] >= n:
        raise Malformed(f"index {idx[-1]} is out of range for {n} elements")
    return idx


def decode(msg, expected):
    """The dense float32 values of a message for a tensor of `expected` elements."""
    msg = bytes(msg)
    if len(msg) < HEADER:
        raise Malformed(f"the header needs {HEADER} bytes, the message has {len(msg)}")
    magic, version, kind, vt = msg[0], msg[1], msg[2], msg[3]
    if magic != MAGIC:
        raise Malformed(f"bad magic byte {magic:#04x} (expected {MAGIC:#04x})")
    if version != VERSION:
        raise Malformed(f"format version {version} is not supported (this node reads {VERSION})")
    (n,) = struct.unpack_from("<Q", msg, 4)
    if n != expected:
        raise Malformed(f"{n} elements announced, the receiver expects {expected}")
    rest = msg[HEADER:]
    if kind == DENSE:
        if len(rest) != value_bytes(vt, n):
            raise Malformed(f"a dense message of {n} values needs {value_bytes(vt, n)} bytes, has {len(rest)}")
        return _read_values(rest, vt, n)
    if kind == SPARSE:
        value_bytes(vt, 0)
        if len(rest) < 17:
            raise Malformed("a sparse message is shorter than its fields")
        k, enc, ilen = struct.unpack_from("<QBQ", rest, 0)
        if k > n:
            raise Malformed(f"k = {k} exceeds the {n} elements")
        rest = rest[17:]
        if ilen > len(rest):
            raise Malformed(f"{ilen} index bytes announced, {len(rest)} bytes left")
        idx = _read_indices(enc, rest[:ilen], k, n)
        rest = rest[ilen:]
        if len(rest) != value_bytes(vt, k):
            raise Malformed(f"{k} values need {value_bytes(vt, k)} bytes, the message has {len(rest)} left")
        dense = np.zeros(n, np.float32)
        dense[idx] = _read_values(rest, vt, k)
        return dense
    if kind == INT8:
        if vt != I8:
            raise Malformed(f"an int8 message with value type {vt}")
        if len(rest) < 4:
            raise Malformed("the block size needs 4 bytes")
        (block,) = struct.unpack_from("<I", rest, 0)
        if block == 0:
            raise Malformed("int8 block size 0")
        return _finite(_read_int8(rest[4:], n, block))
    raise Malformed(f"unknown message kind {kind}")


# ---- encoding ----------------------------------------------------------------------------------


def _header(kind, vt, n):
    return struct.pack("<BBBBQ", MAGIC, VERSION, kind, vt, n)


def _int8_body(x, run):
    x = np.asarray(x, np.float32)
    if x.size == 0:
        return b""
    starts = np.arange(0, x.size, run)
    scales = (np.maximum.reduceat(np.abs(x), starts) / np.float32(127.0)).astype(np.float32)
    inv = np.where(scales > 0, np.float32(1.0) / np.where(scales > 0, scales, 1), 0).astype(np.float32)
    q = np.rint(np.clip(x * inv[np.arange(x.size) // run], -127, 127)).astype(np.int8)
    return scales.astype("<f4").tobytes() + q.tobytes()


def _values(x, vt):
    x = np.asarray(x, np.float32)
    if vt == F32:
        return x.astype("<f4").tobytes()
    if vt == F16:
        return np.clip(x, -65504.0, 65504.0).astype("<f2").tobytes()
    if vt == BF16:
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        top = np.float32(3.3895313892515355e38)  # bf16::MAX
        big = np.abs(x) > top
        out = rounded.astype(np.uint16)
        out[big] = (np.sign(x[big]) < 0) * 0x8000 | 0x7F7F
        return out.astype("<u2").tobytes()
    return _int8_body(x, I8_RUN)


def encode_dense(x, vt):
    return _header(DENSE, vt, x.size) + _values(x, vt)


def encode_int8(x, block):
    return _header(INT8, I8, x.size) + struct.pack("<I", block) + _int8_body(x, block)


def _varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def encode_sparse(n, idx, vals, vt):
    """Sparse message of `vals` at strictly increasing `idx`, with the smallest index encoding."""
    idx = np.asarray(idx, np.int64)
    gaps = np.diff(idx, prepend=-1) - 1 if idx.size else idx
    varint = b"".join(_varint(int(g)) for g in gaps)
    options = [(4 * idx.size, 0), (len(varint), 1), (-(-n // 8), 2)]
    size, enc = min(options)
    if enc == 0:
        ib = idx.astype("<u4").tobytes()
    elif enc == 1:
        ib = varint
    else:
        bits = np.zeros(-(-n // 8) * 8, np.uint8)
        bits[idx] = 1
        ib = np.packbits(bits, bitorder="little").tobytes()
    return (_header(SPARSE, vt, n) + struct.pack("<QBQ", idx.size, enc, size) + ib
            + _values(np.asarray(vals, np.float32), vt))


VALUE_TYPES = {"f32": F32, "f16": F16, "bf16": BF16, "i8": I8}


class Compressor:
    """One link direction's codec (`{"kind": "none" | "fp16" | "bf16" | "int8" | "top_k" |
    "random_k" | "ada_top_k", ...}`) with the settings' value type."""

    def __init__(self, codec, values, seed):
        self.kind = codec.get("kind", "none")
        self.codec = codec
        self.values = VALUE_TYPES.get(values, F32)
        self.rng = np.random.default_rng(seed)

    def compress(self, x):
        x = np.asarray(x, np.float32).reshape(-1)
        k = self.kind
        if k == "none":
            return encode_dense(x, F32)
        if k == "fp16":
            return encode_dense(x, F16)
        if k == "bf16":
            return encode_dense(x, BF16)
        if k == "int8":
            return encode_int8(x, max(1, int(self.codec.get("block", 256))))
        density = 1.0 if k == "ada_top_k" else float(self.codec.get("density", 1.0))
        n = x.size
        keep = min(n, max(min(1, n), int(np.ceil(density * n))))
        if keep >= n:
            return encode_dense(x, self.values)
        if k == "random_k":
            idx = np.sort(self.rng.choice(n, keep, replace=False))
            vals = x[idx] * np.float32(n / keep)
        else:
            idx = np.sort(np.argpartition(-np.abs(x), keep - 1)[:keep])
            vals = x[idx]
        msg = encode_sparse(n, idx, vals, self.values)
        return msg if len(msg) < HEADER + value_bytes(self.values, n) else encode_dense(x, self.values)


class LinkCompression:
    """The codecs in force per (receiving stage, direction) and the error-feedback residuals."""

    def __init__(self):
        self.settings = {"peers": [], "error_feedback": False, "warmup_steps": 0}
        self.compressors = {}
        self.residuals = {}

    def set(self, settings):
        if not isinstance(settings, dict) or not isinstance(settings.get("peers", []), list):
            raise ProtocolError("bad compression settings: not a NodeCompression object")
        self.settings = settings

    def codec(self, to, direction):
        for p in self.settings.get("peers", []):
            if p.get("stage") == to:
                c = p.get("forward") if direction == "activation" else p.get("backward")
                if direction in ("activation", "gradient") and isinstance(c, dict):
                    return c
        return {"kind": "none"}

    def compress(self, to, direction, edge, step, x):
        """The message for `x` sent to stage `to`, or None to send it dense."""
        codec = self.codec(to, direction)
        if codec.get("kind", "none") == "none" or step < int(self.settings.get("warmup_steps", 0)):
            return None
        key = (to, direction)
        held = self.compressors.get(key)
        if held is None or held[0] != codec:
            seed = (edge ^ (to << 32)) & 0xFFFFFFFFFFFFFFFF
            held = (codec, Compressor(codec, self.settings.get("values", "f32"), seed))
            self.compressors[key] = held
        c = held[1]
        x = np.asarray(x, np.float32).reshape(-1)
        if direction != "gradient" or not self.settings.get("error_feedback", False):
            return c.compress(x)
        rkey = edge ^ (to << 48)
        r = self.residuals.get(rkey)
        if r is None or r.size != x.size:
            r = np.zeros(x.size, np.float32)
        corrected = x + r
        msg = c.compress(corrected)
        self.residuals[rkey] = corrected - decode(msg, x.size)
        return msg
