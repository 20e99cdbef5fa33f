"""The field layer of the wire format: one symmetric encode/decode pair per field kind.

`encode_field(name, value, limits)` picks a field's kind and returns `(kind, dtype code, header
dims, data frames)`; `decode_field(name, kind, code, dims, bufs, index, limits)` is its inverse
and returns `(value, index of the next field's first frame)`. `crossfeed.format.wire` writes the header
around them. A field's frames (all integers little-endian):

    kind ARRAY:            one frame, the C-ordered array data
    kind BYTES/STR (LIST, OBJECT):  two frames, u64 lengths[prod(dims)] and the
                           concatenated items
    kind RAGGED:           dims are (n, k): n items of ndim k, dtype from the code; two
                           frames, u64 shapes[n * k] (item i's shape at [i*k, i*k+k)) and
                           the items' C-ordered data, concatenated

Kinds and dtype codes are never renumbered; a decoder refuses a kind it does not know with
WireError (the RAGGED kind, 5, was added without a version bump: a decoder that predates it
refuses such a field as an unknown kind, never misreads it, and still reads batches without one).
Every declared size is checked against the limits and the frames before any array is made: each
dimension, the product of the nonzero dimensions (a zero-element shape such as `(0, 2**63)` is
refused, numpy could not make it) and the element count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from crossfeed.errors import WireError

_U64 = np.dtype("<u8")
_LITTLE = np.little_endian

# field kinds
ARRAY, BYTES_LIST, STR_LIST, BYTES_OBJECT, STR_OBJECT, RAGGED = 0, 1, 2, 3, 4, 5
_TEXT_KINDS = (BYTES_LIST, STR_LIST, BYTES_OBJECT, STR_OBJECT)

# dtype codes: fixed forever, never reuse a number
_DTYPE_CODES: dict[str, int] = {
    "bool": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "uint8": 6,
    "uint16": 7,
    "uint32": 8,
    "uint64": 9,
    "float16": 10,
    "float32": 11,
    "float64": 12,
    "complex64": 13,
    "complex128": 14,
    "bfloat16": 15,
}
_CODE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}

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


def _field_dtype(name: str, code: int) -> tuple[str, np.dtype]:
    dtype_name = _CODE_NAMES.get(code)
    if dtype_name is None:
        raise WireError(f"field {name!r} has unknown dtype code {code}")
    return dtype_name, _dtype_for_code(code, dtype_name)


# ---- the kind of a field, and its dispatch both ways ----
def encode_field(name: str, value: Any, limits) -> tuple[int, int, tuple[int, ...], list[Any]]:
    """`(kind, dtype code, header dims, data frames)` of one field."""
    if isinstance(value, np.ndarray) and value.dtype.kind not in "SUO":
        return _encode_array(value)  # the common case, decided without converting anything
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, np.ndarray) for v in value):
            return _encode_ragged(name, value, limits)
        if all(isinstance(v, (bytes, bytearray, memoryview)) for v in value):
            return _encode_text(BYTES_LIST, (len(value),), [bytes(v) for v in value])
        if all(isinstance(v, str) for v in value):
            return _encode_text(STR_LIST, (len(value),), [v.encode("utf-8") for v in value])
        raise WireError(f"field {name!r}: a list field must hold only bytes, only str or only numpy arrays")
    arr = np.asarray(value)
    if arr.dtype != object:
        return _encode_text_object(name, arr) if arr.dtype.kind in "SU" else _encode_array(arr)
    if arr.size:
        stacked = _stack_numeric(arr)
        if stacked.dtype != object:
            return _encode_array(stacked)
        flat = arr.reshape(-1).tolist()
        if arr.ndim == 1 and all(isinstance(v, (np.ndarray, np.generic)) for v in flat):
            return _encode_ragged(name, flat, limits)
    return _encode_text_object(name, arr)


def decode_field(name: str, kind: int, code: int, dims: Sequence[int], bufs: list[memoryview], index: int, limits):
    """`(value, next frame index)` of one field whose frames start at `bufs[index]`."""
    if kind == ARRAY:
        return _decode_array(name, code, dims, bufs, index, limits)
    if kind in _TEXT_KINDS:
        return _decode_text(name, kind, dims, bufs, index, limits)
    if kind == RAGGED:
        return _decode_ragged(name, code, dims, bufs, index, limits)
    raise WireError(f"field {name!r} has unknown kind {kind}")


def _frame(bufs: list[memoryview], index: int, name: str) -> memoryview:
    if index >= len(bufs):
        raise WireError(f"field {name!r}: message ends before its frame #{index}")
    return bufs[index]


def _product(dims: Sequence[int], limit: int, what: str) -> int:
    """The element count of `dims`. Each dimension is checked, not only the product: a shape
    with a zero in it holds no element whatever its other dims, but numpy cannot make an
    array of one whose nonzero dims multiply past its index range (`(0, 2**63)`), so the
    product of the nonzero dims is held to `limit` as well."""
    total = nonzero = 1
    for axis, d in enumerate(dims):
        if d > limit:
            raise WireError(f"{what}: dim {axis} of shape {tuple(dims)} is {d}, above the limit {limit}")
        total *= d
        nonzero *= d or 1
        if nonzero > limit:
            raise WireError(f"{what}: shape {tuple(dims)} spans {nonzero}+ elements, above the limit {limit}")
    return total


# ---- ARRAY ----
def _encode_array(arr: np.ndarray) -> tuple[int, int, tuple[int, ...], list[Any]]:
    code = _dtype_code(arr.dtype)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not _LITTLE):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return ARRAY, code, arr.shape, [np.ascontiguousarray(arr).reshape(-1).view(np.uint8)]


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


# ---- BYTES_LIST, STR_LIST, BYTES_OBJECT, STR_OBJECT ----
def _encode_text(kind: int, shape: tuple[int, ...], items: list[bytes]):
    return kind, 0, shape, [np.array([len(i) for i in items], dtype=_U64).view(np.uint8), b"".join(items)]


def _encode_text_object(name: str, arr: np.ndarray):
    flat = arr.reshape(-1).tolist()
    if all(isinstance(v, (bytes, bytearray)) for v in flat):
        return _encode_text(BYTES_OBJECT, arr.shape, [bytes(v) for v in flat])
    if all(isinstance(v, str) for v in flat):
        return _encode_text(STR_OBJECT, arr.shape, [v.encode("utf-8") for v in flat])
    raise WireError(
        f"field {name!r}: an object array field must hold only bytes, only str, numbers/arrays of "
        f"one shape and dtype, or (1-D only) numeric numpy arrays of one dtype and ndim (ragged)"
    )


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


# ---- RAGGED ----
def _encode_ragged(name: str, items: Sequence[Any], limits):
    """Per-item shapes and the items' data, concatenated into one frame."""
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
    if len(arrays) > limits.max_items or first.ndim > limits.max_ndim:
        raise WireError(f"field {name!r}: ragged field of {len(arrays)} items of {first.ndim} dims is over the limits")
    shapes = np.array([a.shape for a in arrays], dtype=_U64).reshape(-1)
    little = first.dtype.newbyteorder("<") if first.dtype.byteorder in "<>=" else first.dtype
    data = np.concatenate([a.reshape(-1) for a in arrays], dtype=little, casting="equiv")
    return RAGGED, code, (len(arrays), first.ndim), [shapes.view(np.uint8), data.view(np.uint8)]


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
    spans = np.ones(count, dtype=np.uint64)  # products of the nonzero dims (see `_product`)
    cap, span_cap = np.uint64(available + 1), np.uint64(max_dim + 1)
    for k in range(ndim):  # both saturated at their caps (never wrapped)
        col = shapes[:, k]
        wraps = (col != 0) & (sizes > _U64_MAX // np.maximum(col, np.uint64(1)))
        sizes = np.where(wraps, cap, np.minimum(sizes * col, cap))
        col = np.maximum(col, np.uint64(1))
        wraps = spans > _U64_MAX // col
        spans = np.where(wraps, span_cap, np.minimum(spans * col, span_cap))
    if count and int(sizes.max()) > available:
        raise WireError(f"ragged field {name!r}: an item needs more elements than its data frame has ({available})")
    if count and int(spans.max()) > max_dim:
        raise WireError(
            f"ragged field {name!r}: an item's shape spans more than {max_dim} elements (counting "
            f"its nonzero dims), above the limit"
        )
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
