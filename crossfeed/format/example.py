"""``tf.train.Example`` encode/decode without TensorFlow or protobuf.

No protobuf descriptors are registered, so this works in the same process as TensorFlow (the
``tfrecord`` package cannot: "duplicate symbol tensorflow.BytesList"). The wire layout::

    Example  { Features features = 1; }
    Features { map<string, Feature> feature = 1; }   # entries: key = 1, value = 2
    Feature  { oneof { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    *List    { repeated value = 1; }                 # floats and ints packed (unpacked also read)

`decode` yields ``{name: (kind, values_region)}`` without copying; `kind_values` turns a region
into Python/numpy values.
"""

from __future__ import annotations

import numpy as np

from crossfeed.errors import ExampleError

BYTES, FLOAT, INT64 = 1, 2, 3
KIND_NAMES = {BYTES: "bytes_list", FLOAT: "float_list", INT64: "int64_list"}


# ---- encode -----------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + _varint(len(payload)) + payload


def encode_bytes_list(values) -> bytes:
    return b"".join(_field(0x0A, bytes(v)) for v in values)


def encode_float_list(values) -> bytes:
    arr = np.asarray(values, dtype="<f4").ravel()
    return _field(0x0A, arr.tobytes()) if arr.size else b""


def encode_int64_list(values) -> bytes:
    arr = np.asarray(values).ravel()
    if not arr.size:
        return b""
    return _field(0x0A, b"".join(_varint(int(v)) for v in arr.tolist()))


# Pieces for compiled encoders (`crossfeed.format.encode.Encoder`): the same bytes as `encode`, built from
# constant per-feature prefixes so a record costs a few concatenations.

_SMALL = 1 << 14
VARINTS: tuple[bytes, ...] = tuple(_varint(i) for i in range(_SMALL))  # varint of 0 … 16383
_HEADERS: list[bytes] | None = None


def varint(n: int) -> bytes:
    """`_varint` with a table for small values."""
    return VARINTS[n] if 0 <= n < _SMALL else _varint(n)


def header(total: int) -> bytes:
    """The Example header (field 1 and the length of what follows) of a ``total``-byte record."""
    return b"\x0a" + (VARINTS[total] if total < _SMALL else _varint(total))


def headers(totals) -> list[bytes]:
    """The Example header (field 1, length) for each record length in ``totals`` (ints)."""
    global _HEADERS
    if _HEADERS is None:
        _HEADERS = [b"\x0a" + v for v in VARINTS]
    table = _HEADERS
    return [table[t] if t < _SMALL else b"\x0a" + _varint(t) for t in totals]


def entry(name: str, kind: int, body: bytes) -> bytes:
    """One ``feature`` map entry exactly as `encode` writes it (kind 0: an empty Feature)."""
    feature = _field((kind << 3) | 2, body) if kind else b""
    return _field(0x0A, _field(0x0A, name.encode()) + _field(0x12, feature))


def entry_prefix(name: str, kind: int, body_len: int) -> bytes:
    """The bytes of `entry` before a ``body_len``-byte list body (``kind`` != 0)."""
    key = _field(0x0A, name.encode())
    feat_len = 1 + len(_varint(body_len)) + body_len
    inner_len = len(key) + 1 + len(_varint(feat_len)) + feat_len
    return (
        b"\x0a" + _varint(inner_len) + key + b"\x12" + _varint(feat_len) + bytes(((kind << 3) | 2,)) + _varint(body_len)
    )


def varint_matrix(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Varints of a uint64 vector: ``(lengths, bytes)``, bytes an (n, 10) uint8 matrix whose row
    ``i`` starts with the ``lengths[i]`` bytes of value ``i`` (negative int64 viewed as uint64,
    as `_varint` does)."""
    u = np.ascontiguousarray(u, dtype=np.uint64)
    lens = np.ones(len(u), dtype=np.int64)
    for k in range(1, 10):
        lens += u >= np.uint64(1 << (7 * k))
    out = np.empty((len(u), 10), dtype=np.uint8)
    for k in range(10):
        out[:, k] = ((u >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8) | (
            (lens > k + 1).astype(np.uint8) << 7
        )
    return lens, out


def encode(features: dict[str, tuple[int, bytes]]) -> bytes:
    """Serialise ``{name: (kind, encoded_list_message)}`` as a ``tf.train.Example``.
    Keys are written sorted, so equal samples give equal bytes."""
    entries = []
    for name in sorted(features):
        kind, body = features[name]
        # kind 0: an empty Feature (no list set), which TensorFlow reads as an empty list of any type
        feature = _field((kind << 3) | 2, body) if kind else b""
        entries.append(_field(0x0A, _field(0x0A, name.encode()) + _field(0x12, feature)))
    return _field(0x0A, b"".join(entries))


# ---- decode -----------------------------------------------------------------------------------


def read_varint(buf, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise ExampleError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ExampleError("varint longer than 10 bytes")


def _skip(buf, wire: int, pos: int, end: int) -> int:
    if wire == 0:
        return read_varint(buf, pos, end)[1]
    if wire == 1:
        pos += 8
    elif wire == 2:
        n, pos = read_varint(buf, pos, end)
        pos += n
    elif wire == 5:
        pos += 4
    else:
        raise ExampleError(f"unsupported protobuf wire type {wire}")
    if pos > end:
        raise ExampleError("field runs past the end of its message")
    return pos


def _fields(buf, pos: int, end: int):
    """Yields ``(field_number, wire_type, start, stop)``; for wire type 0 ``start`` is the value."""
    while pos < end:
        key, pos = read_varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 2:
            n, pos = read_varint(buf, pos, end)
            if pos + n > end:
                raise ExampleError(f"field {number} runs past the end of its message")
            yield number, wire, pos, pos + n
            pos += n
        elif wire == 0:
            value, pos = read_varint(buf, pos, end)
            yield number, wire, value, pos
        else:
            start = pos
            pos = _skip(buf, wire, pos, end)
            yield number, wire, start, pos


def spans(payload) -> dict[str, tuple[int, int, int]]:
    """``{name: (kind, start, stop)}``: where each feature's list message lies in ``payload``."""
    buf = memoryview(payload)
    out: dict[str, tuple[int, int, int]] = {}
    for num, wire, s, e in _fields(buf, 0, len(buf)):
        if num != 1 or wire != 2:
            continue
        for num2, wire2, s2, e2 in _fields(buf, s, e):
            if num2 != 1 or wire2 != 2:
                continue
            name, span = None, (0, s2, s2)
            for num3, wire3, s3, e3 in _fields(buf, s2, e2):
                if num3 == 1 and wire3 == 2:
                    name = bytes(buf[s3:e3]).decode("utf-8", errors="replace")
                elif num3 == 2 and wire3 == 2:
                    span = (0, e3, e3)
                    for num4, wire4, s4, e4 in _fields(buf, s3, e3):
                        if wire4 == 2 and num4 in KIND_NAMES:
                            span = (num4, s4, e4)
            if name is None:
                raise ExampleError("a feature map entry has no key")
            out[name] = span
    return out


def decode(payload) -> dict[str, tuple[int, memoryview]]:
    """Parse a serialised Example into ``{name: (kind, list_message_region)}`` (zero-copy views).
    ``kind`` is 0 for a feature with no list set (an empty list of any type)."""
    buf = memoryview(payload)
    return {name: (kind, buf[s:e]) for name, (kind, s, e) in spans(buf).items()}


def bytes_values(region) -> list[memoryview]:
    return [region[s:e] for num, wire, s, e in _fields(region, 0, len(region)) if num == 1 and wire == 2]


def float_values(region) -> np.ndarray:
    parts = []
    for num, wire, s, e in _fields(region, 0, len(region)):
        if num != 1:
            continue
        if wire == 2:
            if (e - s) % 4:
                raise ExampleError("packed float list length is not a multiple of 4")
            parts.append(np.frombuffer(region, dtype="<f4", count=(e - s) // 4, offset=s))
        elif wire == 5:
            parts.append(np.frombuffer(region, dtype="<f4", count=1, offset=s))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def int64_values(region) -> np.ndarray:
    values = []
    for num, wire, s, e in _fields(region, 0, len(region)):
        if num != 1:
            continue
        if wire == 2:
            pos = s
            while pos < e:
                v, pos = read_varint(region, pos, e)
                values.append(_signed(v))
        elif wire == 0:
            values.append(_signed(s))
    return np.array(values, dtype=np.int64)


_KIND_DECODERS = {BYTES: bytes_values, FLOAT: float_values, INT64: int64_values}


def scalar_value(kind: int, region):
    """The one value of an int64 or float list region as a numpy scalar, or None when the
    region holds another count or form (the general parsers then decide). The common case of a
    scalar feature — a label — without building a list."""
    n = len(region)
    if n < 2:
        return None
    tag = region[0]
    if kind == INT64:
        if tag == 0x0A:  # packed
            size, pos = read_varint(region, 1, n)
            if size == 0 or pos + size != n:
                return None
            v, pos = read_varint(region, pos, n)
        elif tag == 0x08:
            v, pos = read_varint(region, 1, n)
        else:
            return None
        return np.int64(_signed(v)) if pos == n else None
    if kind == FLOAT:
        if tag == 0x0A and n == 6 and region[1] == 4:
            return np.frombuffer(region, dtype="<f4", count=1, offset=2)[0]
        if tag == 0x0D and n == 5:
            return np.frombuffer(region, dtype="<f4", count=1, offset=1)[0]
    return None


def kind_values(kind: int, region):
    """Values of one feature's list message; an empty feature (``kind == 0``) gives ``[]``."""
    if kind == 0:
        return []
    return _KIND_DECODERS[kind](region)


def to_python(payload) -> dict[str, list]:
    """A plain ``{name: list}`` view of an Example (for tests and ``crossfeed head``)."""
    out = {}
    for name, (kind, region) in decode(payload).items():
        vals = kind_values(kind, region)
        out[name] = [bytes(v) for v in vals] if kind == BYTES else list(np.asarray(vals).tolist())
    return out
