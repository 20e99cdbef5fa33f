"""The wire format of one batch: a header frame plus one ZeroMQ frame per buffer.

`encode(batch, meta)` turns a `dict[str, np.ndarray | list[bytes] | list[str]]` and its
`BatchMeta` into a list of buffers (frames); `decode(frames)` is its inverse and returns
`(meta, batch)` whose arrays view the received frames (zero copy, read-only). A ragged field
(the Loader's form of a feature whose shape varies within the batch: a 1-D object array of
numeric arrays of one dtype and ndim) arrives as a 1-D object array of read-only arrays that
view one data frame.

Layout (all integers little-endian):

    frame 0, the header:
        magic "CXFB" | u16 version | u16 flags (0) | i64 epoch | i64 seq | i64 num_ids
        | u16 len(server_id) | u16 num_fields | server_id (utf-8)
        then per field: u16 len(name) | name (utf-8) | u8 kind | u8 dtype code | u8 ndim
        | u64 dims[ndim]
    frame 1: the sample ids, int64[num_ids]
    then per field, in header order:
        kind ARRAY:            one frame, the C-ordered array data
        kind BYTES/STR (LIST, OBJECT):  two frames, u64 lengths[prod(dims)] and the
                               concatenated items
        kind RAGGED:           dims are (n, k): n items of ndim k, dtype from the code; two
                               frames, u64 shapes[n * k] (item i's shape at [i*k, i*k+k)) and
                               the items' C-ordered data, concatenated

Kinds are never renumbered; a decoder refuses a kind it does not know with WireError (the
RAGGED kind, 5, was added without a version bump: a decoder that predates it refuses such a
field as an unknown kind, never misreads it, and still reads batches without one).

Every declared size is checked against `WireLimits` and against the frames before any array
is made; every malformed input raises `WireError`. Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from crossfeed.errors import ConfigError, WireError

MAGIC = b"CXFB"
VERSION = 1

_PREFIX = struct.Struct("<4sHHqqqHH")
_NAME_LEN = struct.Struct("<H")
_FIELD = struct.Struct("<BBB")
_U64 = np.dtype("<u8")
_IDS = np.dtype("<i8")

# field kinds
ARRAY, BYTES_LIST, STR_LIST, BYTES_OBJECT, STR_OBJECT, RAGGED = 0, 1, 2, 3, 4, 5
_TEXT_KINDS = (BYTES_LIST, STR_LIST, BYTES_OBJECT, STR_OBJECT)

# dtype codes: fixed forever, never reuse a number
_DTYPE_CODES: dict[str, int] = {
    "bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5,
    "uint8": 6, "uint16": 7, "uint32": 8, "uint64": 9,
    "float16": 10, "float32": 11, "float64": 12,
    "complex64": 13, "complex128": 14, "bfloat16": 15,
}
_CODE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}


@dataclasses.dataclass(frozen=True)
class WireLimits:
    """Bounds a decoder enforces before it allocates anything."""

    max_message_bytes: int = 1 << 31
    max_fields: int = 256
    max_ndim: int = 16
    max_name_bytes: int = 256
    max_items: int = 1 << 24
    max_header_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
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


_DTYPE_BY_CODE: dict[int, np.dtype] = {}  # filled on first use; decode's hot path
_CODE_BY_DTYPE: dict[np.dtype, int] = {}  # likewise for encode (`dtype.name` is slow)


def _dtype_for_code(code: int, name: str) -> np.dtype:
    dtype = _DTYPE_BY_CODE.get(code)
    if dtype is None:
        dtype = _DTYPE_BY_CODE[code] = _dtype_by_name(name)
    return dtype


def _dtype_by_name(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes  # optional: only when a bfloat16 field is seen
        except ImportError as e:
            raise WireError("bfloat16 field received but ml_dtypes is not installed") from e
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name).newbyteorder("<")


def _dtype_code(dtype: np.dtype) -> int:
    code = _CODE_BY_DTYPE.get(dtype)
    if code is not None:
        return code
    code = _DTYPE_CODES.get(dtype.name)
    if code is None:
        raise WireError(f"dtype {dtype} cannot be sent; supported: {sorted(_DTYPE_CODES)}")
    if len(_CODE_BY_DTYPE) < 256:  # bounded, whatever dtypes come by
        _CODE_BY_DTYPE[dtype] = code
    return code


def _field_frames(name: str, value: Any) -> tuple[int, int, tuple[int, ...], list[Any]]:
    """`(kind, dtype code, header dims, data frames)` of one field."""
    if isinstance(value, np.ndarray) and value.dtype.kind not in "SUO":
        return _array_frames(value)  # the common case, decided without converting anything
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, np.ndarray) for v in value):
            return _ragged_frames(name, value)
        if all(isinstance(v, (bytes, bytearray, memoryview)) for v in value):
            return _text_frames(BYTES_LIST, (len(value),), [bytes(v) for v in value])
        if all(isinstance(v, str) for v in value):
            return _text_frames(STR_LIST, (len(value),), [v.encode("utf-8") for v in value])
        raise WireError(f"field {name!r}: a list field must hold only bytes, only str or only numpy arrays")
    arr = np.asarray(value)
    if arr.dtype != object:
        return _text_object_frames(name, arr) if arr.dtype.kind in "SU" else _array_frames(arr)
    if arr.size:
        stacked = _stack_numeric(arr)
        if stacked.dtype != object:
            return _array_frames(stacked)
        flat = arr.reshape(-1).tolist()
        if arr.ndim == 1 and all(isinstance(v, (np.ndarray, np.generic)) for v in flat):
            return _ragged_frames(name, flat)
    return _text_object_frames(name, arr)


def _array_frames(arr: np.ndarray) -> tuple[int, int, tuple[int, ...], list[Any]]:
    code = _dtype_code(arr.dtype)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not _LITTLE):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return ARRAY, code, arr.shape, [np.ascontiguousarray(arr).reshape(-1).view(np.uint8)]


def _text_frames(kind: int, shape: tuple[int, ...], items: list[bytes]):
    return kind, 0, shape, [np.array([len(i) for i in items], dtype=_U64).view(np.uint8), b"".join(items)]


def _text_object_frames(name: str, arr: np.ndarray):
    flat = arr.reshape(-1).tolist()
    if all(isinstance(v, (bytes, bytearray)) for v in flat):
        return _text_frames(BYTES_OBJECT, arr.shape, [bytes(v) for v in flat])
    if all(isinstance(v, str) for v in flat):
        return _text_frames(STR_OBJECT, arr.shape, [v.encode("utf-8") for v in flat])
    raise WireError(
        f"field {name!r}: an object array field must hold only bytes, only str, numbers/arrays of "
        f"one shape and dtype, or (1-D only) numeric numpy arrays of one dtype and ndim (ragged)"
    )


def _ragged_frames(name: str, items: Sequence[Any]):
    """RAGGED: per-item shapes and the items' data, concatenated into one frame."""
    arrays = [np.asarray(v) for v in items]
    first = arrays[0]
    try:
        code = _dtype_code(first.dtype)
    except WireError as e:
        raise WireError(f"field {name!r}: ragged item 0: {e}") from e
    for i, a in enumerate(arrays):
        if a.ndim != first.ndim or (a.dtype != first.dtype and _DTYPE_CODES.get(a.dtype.name) != code):
            raise WireError(
                f"field {name!r}: the arrays of a ragged field must share one dtype and ndim; item 0 is "
                f"{first.dtype} with {first.ndim} dims, item {i} is {a.dtype} with {a.ndim} dims "
                f"(cast them in the transform)"
            )
    if len(arrays) > DEFAULT_LIMITS.max_items or first.ndim > DEFAULT_LIMITS.max_ndim:
        raise WireError(f"field {name!r}: ragged field of {len(arrays)} items of {first.ndim} dims is over the limits")
    shapes = np.array([a.shape for a in arrays], dtype=_U64).reshape(-1)
    little = first.dtype.newbyteorder("<") if first.dtype.byteorder in "<>=" else first.dtype
    data = np.concatenate([a.reshape(-1) for a in arrays], dtype=little, casting="equiv")
    return RAGGED, code, (len(arrays), first.ndim), [shapes.view(np.uint8), data.view(np.uint8)]


def _stack_numeric(arr: np.ndarray) -> np.ndarray:
    """An object array of numpy scalars/arrays of one shape and dtype as one numeric array."""
    flat = arr.reshape(-1).tolist() if arr.ndim else [arr.item()]
    first = flat[0]
    if not isinstance(first, (np.ndarray, np.generic, int, float, bool)) or isinstance(first, (bytes, str)):
        return arr
    items = [np.asarray(v) for v in flat]
    if any(i.dtype != items[0].dtype or i.shape != items[0].shape or i.dtype == object for i in items):
        return arr
    return np.stack(items).reshape(arr.shape + items[0].shape)


def encode(batch: Mapping[str, Any], meta: BatchMeta = BatchMeta()) -> list[Any]:
    """Frames of one batch; large arrays are passed through without copying (ragged fields are
    copied once, into their one data frame)."""
    if len(batch) > DEFAULT_LIMITS.max_fields:
        raise WireError(f"{len(batch)} fields, at most {DEFAULT_LIMITS.max_fields}")
    server_id = meta.server_id.encode("utf-8")
    ids = np.ascontiguousarray(
        np.zeros(0, _IDS) if meta.sample_ids is None else meta.sample_ids, dtype=_IDS
    ).reshape(-1)
    header = [
        _PREFIX.pack(MAGIC, VERSION, 0, meta.epoch, meta.seq, len(ids), len(server_id), len(batch)),
        server_id,
    ]
    frames: list[Any] = [None, ids.view(np.uint8)]
    for name, value in batch.items():
        raw_name = str(name).encode("utf-8")
        if len(raw_name) > DEFAULT_LIMITS.max_name_bytes:
            raise WireError(f"field name {name!r} longer than {DEFAULT_LIMITS.max_name_bytes} bytes")
        kind, code, shape, data = _field_frames(name, value)
        if len(shape) > DEFAULT_LIMITS.max_ndim:
            raise WireError(f"field {name!r} has {len(shape)} dims, at most {DEFAULT_LIMITS.max_ndim}")
        frames.extend(data)
        header.append(_NAME_LEN.pack(len(raw_name)) + raw_name + _FIELD.pack(kind, code, len(shape)))
        header.append(np.asarray(shape, dtype=_U64).tobytes())
    frames[0] = b"".join(header)
    return frames


_LITTLE = np.little_endian


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
                f"header truncated reading {what}: need {n} bytes at offset {self.pos}, "
                f"header has {len(self.data)}"
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def text(self, n: int, what: str) -> str:
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise WireError(f"{what} is not valid utf-8") from e


def _product(dims: Sequence[int], limit: int, what: str) -> int:
    total = 1
    for d in dims:
        total *= d
        if total > limit:
            raise WireError(f"{what} declares {total}+ elements, above the limit {limit}")
    return total


def decode(
    frames: Sequence[Any], limits: WireLimits = DEFAULT_LIMITS
) -> tuple[BatchMeta, dict[str, Any]]:
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
    magic, version, _flags, epoch, seq, num_ids, sid_len, nfields = _PREFIX.unpack(
        r.take(_PREFIX.size, "prefix")
    )
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"wire version {version} not supported (this side speaks {VERSION})")
    if nfields > limits.max_fields:
        raise WireError(f"{nfields} fields declared, at most {limits.max_fields}")
    if not 0 <= num_ids <= limits.max_items:
        raise WireError(f"{num_ids} sample ids declared, limit {limits.max_items}")
    server_id = r.text(sid_len, "server id")
    if len(bufs[1]) != num_ids * _IDS.itemsize:
        raise WireError(f"sample-id frame has {len(bufs[1])} bytes, expected {num_ids * 8}")
    ids = np.frombuffer(bufs[1], dtype=_IDS) if num_ids else np.zeros(0, _IDS)
    ids.flags.writeable = False
    batch: dict[str, Any] = {}
    index = 2
    for _ in range(nfields):
        (name_len,) = _NAME_LEN.unpack(r.take(_NAME_LEN.size, "field name length"))
        if name_len > limits.max_name_bytes:
            raise WireError(f"field name of {name_len} bytes, at most {limits.max_name_bytes}")
        name = r.text(name_len, "field name")
        if name in batch:
            raise WireError(f"field {name!r} appears twice")
        kind, code, ndim = _FIELD.unpack(r.take(_FIELD.size, f"field {name!r} descriptor"))
        if ndim > limits.max_ndim:
            raise WireError(f"field {name!r} declares {ndim} dims, at most {limits.max_ndim}")
        dims = list(_dims(ndim).unpack(r.take(8 * ndim, f"field {name!r} shape")))
        if kind == ARRAY:
            batch[name], index = _decode_array(name, code, dims, bufs, index, limits)
        elif kind in _TEXT_KINDS:
            batch[name], index = _decode_text(name, kind, dims, bufs, index, limits)
        elif kind == RAGGED:
            batch[name], index = _decode_ragged(name, code, dims, bufs, index, limits)
        else:
            raise WireError(f"field {name!r} has unknown kind {kind}")
    if r.pos != len(bufs[0]):
        raise WireError(f"{len(bufs[0]) - r.pos} trailing bytes after the last field in the header")
    if index != len(bufs):
        raise WireError(f"header describes {index} frames, message has {len(bufs)}")
    return BatchMeta(epoch=epoch, seq=seq, server_id=server_id, sample_ids=ids), batch


_DIMS = [struct.Struct(f"<{n}Q") for n in range(17)]


def _dims(ndim: int) -> struct.Struct:
    return _DIMS[ndim] if ndim < len(_DIMS) else struct.Struct(f"<{ndim}Q")


def _frame(bufs: list[memoryview], index: int, name: str) -> memoryview:
    if index >= len(bufs):
        raise WireError(f"field {name!r}: message ends before its frame #{index}")
    return bufs[index]


def _field_dtype(name: str, code: int) -> tuple[str, np.dtype]:
    dtype_name = _CODE_NAMES.get(code)
    if dtype_name is None:
        raise WireError(f"field {name!r} has unknown dtype code {code}")
    return dtype_name, _dtype_for_code(code, dtype_name)


def _decode_array(name, code, dims, bufs, index, limits):
    dtype_name, dtype = _field_dtype(name, code)
    count = _product(dims, limits.max_message_bytes // dtype.itemsize, f"field {name!r}")
    buf = _frame(bufs, index, name)
    if len(buf) != count * dtype.itemsize:
        raise WireError(
            f"field {name!r}: shape {tuple(dims)} of {dtype_name} needs "
            f"{count * dtype.itemsize} bytes, frame has {len(buf)}"
        )
    arr = np.frombuffer(buf, dtype=dtype, count=count).reshape(dims)
    arr.flags.writeable = False  # the frame may be shared (inproc); copy to modify
    if dtype_name == "bool" and count and int(arr.view(np.uint8).max()) > 1:
        raise WireError(f"field {name!r}: bool data holds values other than 0 and 1")
    return arr, index + 1


def _decode_text(name, kind, dims, bufs, index, limits):
    if kind in (BYTES_LIST, STR_LIST) and len(dims) != 1:
        raise WireError(f"list field {name!r} must have one dim, has {len(dims)}")
    count = _product(dims, limits.max_items, f"field {name!r}")
    lengths_buf, blob = _frame(bufs, index, name), _frame(bufs, index + 1, name)
    if len(lengths_buf) != 8 * count:
        raise WireError(f"field {name!r}: {count} items need {8 * count} length bytes, got {len(lengths_buf)}")
    lengths = np.frombuffer(lengths_buf, dtype=_U64)
    ends = np.cumsum(lengths, dtype=np.uint64) if count else lengths
    if count and (int(lengths.max()) > len(blob) or int(ends[-1]) != len(blob)):
        raise WireError(f"field {name!r}: item lengths do not add up to the {len(blob)}-byte data frame")
    if not count and len(blob):
        raise WireError(f"field {name!r}: zero items but {len(blob)} data bytes")
    raw = bytes(blob)
    items: list[Any] = []
    start = 0
    for end in ends.tolist():
        items.append(raw[start:end])
        start = end
    if kind in (STR_LIST, STR_OBJECT):
        try:
            items = [i.decode("utf-8") for i in items]
        except UnicodeDecodeError as e:
            raise WireError(f"field {name!r}: item is not valid utf-8") from e
    if kind in (BYTES_LIST, STR_LIST):
        return items, index + 2
    out = np.empty(count, dtype=object)
    out[:] = items
    return out.reshape(dims), index + 2


_U64_MAX = np.uint64(2**64 - 1)


def _decode_ragged(name, code, dims, bufs, index, limits):
    """A 1-D object array of read-only arrays, each a view of the field's data frame."""
    if len(dims) != 2:
        raise WireError(f"ragged field {name!r} must declare 2 dims (items, item ndim), has {len(dims)}")
    count, ndim = dims
    if count > limits.max_items:
        raise WireError(f"ragged field {name!r} declares {count} items, above the limit {limits.max_items}")
    if ndim > limits.max_ndim:
        raise WireError(f"ragged field {name!r}: items of {ndim} dims, at most {limits.max_ndim}")
    dtype_name, dtype = _field_dtype(name, code)
    shapes_buf, blob = _frame(bufs, index, name), _frame(bufs, index + 1, name)
    if len(shapes_buf) != 8 * count * ndim:
        raise WireError(
            f"ragged field {name!r}: {count} items of {ndim} dims need {8 * count * ndim} shape bytes, "
            f"frame has {len(shapes_buf)}"
        )
    if len(blob) % dtype.itemsize:
        raise WireError(f"ragged field {name!r}: data frame of {len(blob)} bytes is no whole number of {dtype_name}")
    available = len(blob) // dtype.itemsize
    shapes = np.frombuffer(shapes_buf, dtype=_U64).reshape(count, ndim)
    max_dim = limits.max_message_bytes // dtype.itemsize
    if count * ndim and int(shapes.max()) > max_dim:
        raise WireError(f"ragged field {name!r}: an item dim of {int(shapes.max())} is above the limit {max_dim}")
    sizes = np.ones(count, dtype=np.uint64)
    cap = np.uint64(available + 1)
    for k in range(ndim):  # element counts, saturated at `cap` (never wrapped)
        col = shapes[:, k]
        wraps = (col != 0) & (sizes > _U64_MAX // np.maximum(col, np.uint64(1)))
        sizes = np.where(wraps, cap, np.minimum(sizes * col, cap))
    if count and int(sizes.max()) > available:
        raise WireError(f"ragged field {name!r}: an item needs more elements than its data frame has ({available})")
    if count * available >= 2**63:
        raise WireError(f"ragged field {name!r}: {count} items over {available} elements is too large to index")
    ends = np.cumsum(sizes, dtype=np.uint64) if count else sizes
    if (int(ends[-1]) if count else 0) != available:
        raise WireError(
            f"ragged field {name!r}: item shapes need {int(ends[-1]) if count else 0} {dtype_name} elements, "
            f"data frame holds {available}"
        )
    flat = np.frombuffer(blob, dtype=dtype, count=available)
    flat.flags.writeable = False  # the frame may be shared (inproc); copy to modify
    if dtype_name == "bool" and available and int(flat.view(np.uint8).max()) > 1:
        raise WireError(f"ragged field {name!r}: bool data holds values other than 0 and 1")
    out = np.empty(count, dtype=object)
    start = 0
    for i, (end, shape) in enumerate(zip(ends.tolist(), shapes.tolist())):
        out[i] = flat[start:end].reshape(shape)
        start = end
    return out, index + 2
