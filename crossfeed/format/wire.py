"""The message layer of the wire format: one batch as a header frame plus one ZeroMQ frame per buffer.

`encode(batch, meta)` turns a `dict[str, np.ndarray | list[bytes] | list[str]]` and its
`BatchMeta` into a list of buffers (frames); `decode(frames)` is its inverse and returns
`(meta, batch)` whose arrays view the received frames (zero copy, read-only). A ragged field
(the Loader's form of a feature whose shape varies within the batch: a 1-D object array of
numeric arrays of one dtype and ndim) arrives as a 1-D object array of read-only arrays that
view one data frame. This module holds the header (magic, version, provenance, field
descriptors), `BatchMeta` and `WireLimits`; `crossfeed.format.wire_fields` holds the encode/decode
pair of each field kind, whose constants (ARRAY ... RAGGED) are importable from here too.

Layout (all integers little-endian):

    frame 0, the header:
        magic "CXFB" | u16 version | u16 flags (0) | i64 epoch | i64 seq | i64 num_ids
        | u16 len(server_id) | u16 num_fields | server_id (utf-8)
        then per field: u16 len(name) | name (utf-8) | u8 kind | u8 dtype code | u8 ndim
        | u64 dims[ndim]
    frame 1: the sample ids, int64[num_ids]
    then per field, in header order, the frames of its kind (see `crossfeed.format.wire_fields`)

Every declared size is checked against `WireLimits` and against the frames before any array
is made; every malformed input raises `WireError`. Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from crossfeed.config import parse_size
from crossfeed.errors import ConfigError, WireError

# the field kinds are part of this module's public surface (wire.RAGGED, ...)
from crossfeed.format.wire_fields import (  # noqa: F401
    ARRAY,
    BYTES_LIST,
    BYTES_OBJECT,
    RAGGED,
    STR_LIST,
    STR_OBJECT,
    decode_field,
    encode_field,
)

MAGIC = b"CXFB"
VERSION = 1

_PREFIX = struct.Struct("<4sHHqqqHH")
_NAME_LEN = struct.Struct("<H")
_FIELD = struct.Struct("<BBB")
_U64 = np.dtype("<u8")
_IDS = np.dtype("<i8")


@dataclasses.dataclass(frozen=True)
class WireLimits:
    """Bounds a decoder enforces before it allocates anything (the ``*_bytes`` ones: byte
    counts or sizes such as ``"64MB"``)."""

    max_message_bytes: int = 1 << 31  # each *_bytes given as bytes or a size; kept as bytes
    max_fields: int = 256
    max_ndim: int = 16
    max_name_bytes: int = 256
    max_items: int = 1 << 24
    max_header_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_bytes"):  # sizes: a byte count or "64MB", as every size option
                object.__setattr__(self, f.name, parse_size(value, f"WireLimits.{f.name}"))
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"WireLimits.{f.name} must be a positive int, got {value!r}")

    @property
    def max_frames(self) -> int:
        """The most frames a well-formed batch message can have."""
        return 2 + 2 * self.max_fields


DEFAULT_LIMITS = WireLimits()


@dataclasses.dataclass(frozen=True)
class BatchMeta:
    """Provenance of a batch: which server made it, in which epoch, in which order."""

    epoch: int = 0
    seq: int = 0
    server_id: str = ""
    sample_ids: np.ndarray | None = None  # int64 global sample indices

    @property
    def num_samples(self) -> int:
        return 0 if self.sample_ids is None else int(len(self.sample_ids))


def encode(batch: Mapping[str, Any], meta: BatchMeta = BatchMeta()) -> list[Any]:
    """Frames of one batch; large arrays are passed through without copying (ragged fields are
    copied once, into their one data frame)."""
    if len(batch) > DEFAULT_LIMITS.max_fields:
        raise WireError(f"{len(batch)} fields, at most {DEFAULT_LIMITS.max_fields}")
    server_id = meta.server_id.encode("utf-8")
    ids = np.ascontiguousarray(np.zeros(0, _IDS) if meta.sample_ids is None else meta.sample_ids, dtype=_IDS).reshape(
        -1
    )
    header = [
        _PREFIX.pack(MAGIC, VERSION, 0, meta.epoch, meta.seq, len(ids), len(server_id), len(batch)),
        server_id,
    ]
    frames: list[Any] = [None, ids.view(np.uint8)]
    for name, value in batch.items():
        raw_name = str(name).encode("utf-8")
        if len(raw_name) > DEFAULT_LIMITS.max_name_bytes:
            raise WireError(f"field name {name!r} longer than {DEFAULT_LIMITS.max_name_bytes} bytes")
        kind, code, shape, data = encode_field(name, value, DEFAULT_LIMITS)
        if len(shape) > DEFAULT_LIMITS.max_ndim:
            raise WireError(f"field {name!r} has {len(shape)} dims, at most {DEFAULT_LIMITS.max_ndim}")
        frames.extend(data)
        header.append(_NAME_LEN.pack(len(raw_name)) + raw_name + _FIELD.pack(kind, code, len(shape)))
        header.append(np.asarray(shape, dtype=_U64).tobytes())
    frames[0] = b"".join(header)
    return frames


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    try:
        view = memoryview(buf)
    except TypeError as e:
        raise WireError(f"frame of type {type(frame).__name__} is not a buffer") from e
    if view.ndim == 1 and view.format == "B":
        return view
    if view.nbytes == 0:
        return memoryview(b"")
    try:
        return view.cast("B")
    except TypeError as e:
        raise WireError(f"frame buffer is not contiguous: {e}") from e


class _Reader:
    """Bounds-checked cursor over the header frame."""

    def __init__(self, data: memoryview):
        self.data, self.pos = data, 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise WireError(
                f"header truncated reading {what}: need {n} bytes at offset {self.pos}, header has {len(self.data)}"
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def text(self, n: int, what: str) -> str:
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise WireError(f"{what} is not valid utf-8") from e


def decode(frames: Sequence[Any], limits: WireLimits = DEFAULT_LIMITS) -> tuple[BatchMeta, dict[str, Any]]:
    """`(meta, batch)` from frames made by `encode`; arrays are read-only views of the frames."""
    if not 2 <= len(frames) <= limits.max_frames:
        raise WireError(f"a batch has 2..{limits.max_frames} frames, got {len(frames)}")
    bufs = [_buffer(f) for f in frames]
    total = sum(len(b) for b in bufs)
    if total > limits.max_message_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit {limits.max_message_bytes}")
    if len(bufs[0]) > limits.max_header_bytes:
        raise WireError(f"header of {len(bufs[0])} bytes exceeds {limits.max_header_bytes}")
    r = _Reader(bufs[0])
    magic, version, _flags, epoch, seq, num_ids, sid_len, nfields = _PREFIX.unpack(r.take(_PREFIX.size, "prefix"))
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"wire version {version} not supported (this side speaks {VERSION})")
    if nfields > limits.max_fields:
        raise WireError(f"{nfields} fields declared, at most {limits.max_fields}")
    if not 0 <= num_ids <= limits.max_items:
        raise WireError(f"{num_ids} sample ids declared, limit {limits.max_items}")
    if len(bufs[1]) != num_ids * _IDS.itemsize:
        raise WireError(f"sample-id frame has {len(bufs[1])} bytes, expected {num_ids * 8}")
    server_id, fields = _described(bufs[0], sid_len, nfields, limits)
    ids = np.frombuffer(bufs[1], dtype=_IDS) if num_ids else np.zeros(0, _IDS)
    ids.flags.writeable = False
    batch: dict[str, Any] = {}
    index = 2
    for name, kind, code, dims in fields:
        batch[name], index = decode_field(name, kind, code, dims, bufs, index, limits)
    if index != len(bufs):
        raise WireError(f"header describes {index} frames, message has {len(bufs)}")
    return BatchMeta(epoch=epoch, seq=seq, server_id=server_id, sample_ids=ids), batch


Fields = tuple[tuple[str, int, int, tuple[int, ...]], ...]  # (name, kind, dtype code, dims) of each field
_DESCRIBED: dict[tuple[bytes, int, int, WireLimits], tuple[str, Fields]] = {}
_DESCRIBED_MAX, _DESCRIBED_BYTES = 256, 4096  # parses kept; the longest header tail kept


def _described(header: memoryview, sid_len: int, nfields: int, limits: WireLimits) -> tuple[str, Fields]:
    """The server id and the field descriptors of a header (after its prefix), checked in full.
    A stream's batches repeat them byte for byte (only the prefix's epoch, seq and id count
    change): a tail parsed before, under the same limits, is not parsed again."""
    tail = bytes(header[_PREFIX.size :])
    key = (tail, sid_len, nfields, limits)
    known = _DESCRIBED.get(key)
    if known is not None:
        return known
    r = _Reader(memoryview(tail))
    server_id = r.text(sid_len, "server id")
    fields = []
    names: set[str] = set()
    for _ in range(nfields):
        (name_len,) = _NAME_LEN.unpack(r.take(_NAME_LEN.size, "field name length"))
        if name_len > limits.max_name_bytes:
            raise WireError(f"field name of {name_len} bytes, at most {limits.max_name_bytes}")
        name = r.text(name_len, "field name")
        if name in names:
            raise WireError(f"field {name!r} appears twice")
        names.add(name)
        kind, code, ndim = _FIELD.unpack(r.take(_FIELD.size, f"field {name!r} descriptor"))
        if ndim > limits.max_ndim:
            raise WireError(f"field {name!r} declares {ndim} dims, at most {limits.max_ndim}")
        fields.append((name, kind, code, _dims(ndim).unpack(r.take(8 * ndim, f"field {name!r} shape"))))
    if r.pos != len(tail):
        raise WireError(f"{len(tail) - r.pos} trailing bytes after the last field in the header")
    described = (server_id, tuple(fields))
    if len(tail) <= _DESCRIBED_BYTES:
        if len(_DESCRIBED) >= _DESCRIBED_MAX:
            _DESCRIBED.clear()
        _DESCRIBED[key] = described
    return described


_DIMS = [struct.Struct(f"<{n}Q") for n in range(17)]


def _dims(ndim: int) -> struct.Struct:
    return _DIMS[ndim] if ndim < len(_DIMS) else struct.Struct(f"<{ndim}Q")
