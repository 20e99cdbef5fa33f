"""Per-feature encoders, compiled once per schema: `FeatureCodec` turns one feature's values into its
``tf.train.Example`` map entries — per value, or a whole column at a time with numpy — and
`reference_feature` is the plain path every fast path must match byte for byte (the oracle of
the tests, and the fallback for unusual values)."""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from crossfeed.errors import SchemaError
from crossfeed.format import example as ex
from crossfeed.format.schema import INT_TYPES, SHAPE_SUFFIX, Encoding, Feature, shape_fits


def reference_feature(f: Feature, v, out: dict) -> None:
    """Validate one value and add its ``(kind, list message)`` (and a ``/shape`` one) to ``out``."""
    if (
        f.encoding not in (Encoding.TENSOR, Encoding.IMAGE)
        and isinstance(v, (list, tuple))
        and not v
        and f.shape in ((None,), (0,))
    ):
        out[f.name] = (0, b"")  # empty list: no kind, so it matches whatever type later samples have
        return
    if f.encoding is Encoding.TENSOR:
        arr = np.asarray(v)
        if arr.dtype.newbyteorder("=") != np.dtype(f.dtype) or not shape_fits(arr.shape, f.shape):  # any byte order
            raise SchemaError(
                f"feature {f.name!r}: got {arr.dtype}{list(arr.shape)}, the schema says {f.dtype}{list(f.shape)}"
            )
        out[f.name] = (
            ex.BYTES,
            ex.encode_bytes_list([np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")).tobytes()]),
        )
        if not f.fixed:
            out[f.name + SHAPE_SUFFIX] = (ex.INT64, ex.encode_int64_list(arr.shape))
    elif f.encoding is Encoding.IMAGE:
        out[f.name] = (ex.BYTES, ex.encode_bytes_list([bytes(v)]))
    elif f.encoding is Encoding.BYTES:
        vals = [v] if not f.shape else list(v)
        out[f.name] = (ex.BYTES, ex.encode_bytes_list([x.encode() if isinstance(x, str) else bytes(x) for x in vals]))
    else:
        arr = np.asarray(v)
        if not shape_fits(arr.shape, f.shape):
            raise SchemaError(f"feature {f.name!r}: got shape {list(arr.shape)}, the schema says {list(f.shape)}")
        if f.encoding is Encoding.INT64:
            out[f.name] = (ex.INT64, ex.encode_int64_list(arr))
        else:
            out[f.name] = (ex.FLOAT, ex.encode_float_list(arr))


_LITTLE = sys.byteorder == "little"
_NP_INTS = frozenset(INT_TYPES)
FLOAT_SCALARS = {float: np.float64, np.float64: np.float64, np.float32: np.float32}
INT_SCALARS = {int: np.int64, **{t: t for t in _NP_INTS}}
_pack_f32 = struct.Struct("<f").pack


def _prefix_cache(make, limit: int = 4096):
    """``get(n)``: ``make(n)`` remembered for up to ``limit`` distinct ``n``."""
    cache: dict[int, bytes] = {}

    def get(n: int) -> bytes:
        p = cache.get(n)
        if p is None:
            p = make(n)
            if len(cache) < limit:
                cache[n] = p
        return p

    return get


class FeatureCodec:
    """One feature compiled: ``one(value)`` gives its map entry (a tuple of entries for a tensor
    with a ``/shape`` companion); ``column(col, n)`` gives ``[(pieces, lengths)]`` per slot for a
    whole column, or None where the column is not one it vectorises (then ``one`` runs per value).
    Everything not on a fast path goes through `reference_feature`."""

    def __init__(self, f: Feature):
        self.f = f
        self.slots = (f.name, f.name + SHAPE_SUFFIX) if f.encoding is Encoding.TENSOR and not f.fixed else (f.name,)
        self.one = self._generic
        self.column: Callable[[Any, int], Any] | None = None
        getattr(self, "_compile_" + f.encoding.value)()

    def _generic(self, v):
        out: dict[str, tuple[int, bytes]] = {}
        reference_feature(self.f, v, out)
        if len(self.slots) == 1:
            return ex.entry(self.f.name, *out[self.f.name])
        return tuple(ex.entry(s, *out[s]) for s in self.slots)

    def _per_value(self, col, n: int):
        one = self.one
        entries = [one(v) for v in col]
        if len(self.slots) == 1:
            return [([entries], np.fromiter(map(len, entries), np.int64, n))]
        cols = [list(c) for c in zip(*entries)] if entries else [[] for _ in self.slots]
        return [([c], np.fromiter(map(len, c), np.int64, n)) for c in cols]

    def encode_column(self, col, n: int):
        res = self.column(col, n) if self.column is not None else None
        return res if res is not None else self._per_value(col, n)

    # -- fixed-width rows: a constant prefix and the same number of value bytes per record --------
    @staticmethod
    def _rows(prefix: bytes, values: np.ndarray, n: int):
        """``prefix + values[i]`` for each row of an (n, w) uint8 matrix, as one piece list."""
        p = len(prefix)
        w = p + values.shape[1]
        m = np.empty((n, w), dtype=np.uint8)
        m[:, :p] = np.frombuffer(prefix, dtype=np.uint8)
        m[:, p:] = values
        return [([m.view(f"V{w}").ravel().tolist()], np.full(n, w, dtype=np.int64))]

    def _numeric_column(self, col, n: int, kinds: str, scalars: dict):
        """A column as an (n, k) array of the per-record values, or None."""
        f = self.f
        if isinstance(col, np.ndarray):
            if col.dtype.kind not in kinds or col.ndim != 1 + len(f.shape) or not shape_fits(col.shape[1:], f.shape):
                return None
            arr = col
        elif f.shape == () and isinstance(col, list) and n:
            types = set(map(type, col))
            if len(types) != 1:
                return None
            dt = scalars.get(types.pop())
            if dt is None:
                return None
            try:
                arr = np.array(col, dtype=dt)
            except (OverflowError, ValueError, TypeError):
                return None
        else:
            return None
        k = int(np.prod(arr.shape[1:], dtype=np.int64))
        return arr.reshape(n, k) if k else None

    # -- encodings --------------------------------------------------------------------------------
    def _compile_float(self):
        f, generic = self.f, self._generic
        if f.shape == ():
            pre = ex.entry_prefix(f.name, ex.FLOAT, 6) + b"\x0a\x04"

            def one(v):
                t = type(v)
                if t is float or t is np.float64:
                    try:
                        return pre + _pack_f32(v)
                    except OverflowError:  # numpy stores inf; let it
                        pass
                elif t is np.float32 and _LITTLE:
                    return pre + v.tobytes()
                return generic(v)

            self.one = one

        def column(col, n):
            arr = self._numeric_column(col, n, "fiub", FLOAT_SCALARS)
            if arr is None:
                return None
            k = arr.shape[1]
            pre = ex.entry_prefix(f.name, ex.FLOAT, 1 + len(ex.varint(4 * k)) + 4 * k) + b"\x0a" + ex.varint(4 * k)
            return self._rows(pre, np.ascontiguousarray(arr, dtype="<f4").view(np.uint8), n)

        self.column = column

    def _compile_int64(self):
        f, generic = self.f, self._generic
        # entry of a one-value list whose varint has L bytes: prefix[L] + varint
        prefix = [b""] + [ex.entry_prefix(f.name, ex.INT64, 2 + n) + b"\x0a" + bytes((n,)) for n in range(1, 11)]
        if f.shape == () or f.shape in ((1,), (None,)):
            small = [prefix[len(v)] + v for v in ex.VARINTS[:1024]]
        if f.shape == ():
            lo, hi = -(1 << 63), 1 << 64

            def one(v):
                t = type(v)
                if t is int or t in _NP_INTS:
                    x = int(v)
                    if 0 <= x < 1024:
                        return small[x]
                    if lo <= x < hi:
                        vb = ex.varint(x)
                        return prefix[len(vb)] + vb
                return generic(v)

            self.one = one

        def column(col, n):
            arr = self._numeric_column(col, n, "iub", INT_SCALARS)
            if arr is None or arr.shape[1] != 1:
                return None
            arr = arr[:, 0]
            u = arr.astype(np.uint64) if arr.dtype.kind == "u" else arr.astype(np.int64).view(np.uint64)
            lens, vb = ex.varint_matrix(u)
            lengths = np.unique(lens)
            groups = []
            for L in lengths.tolist():
                idx = np.flatnonzero(lens == L) if len(lengths) > 1 else None
                rows = vb[:, :L] if idx is None else vb[idx, :L]
                ((pieces, _),) = self._rows(prefix[L], rows, len(rows))
                groups.append((idx, pieces[0]))
            if len(groups) == 1:
                entries = groups[0][1]
            else:
                obj = np.empty(n, dtype=object)
                for idx, vals in groups:
                    part = np.empty(len(vals), dtype=object)
                    part[:] = vals
                    obj[idx] = part
                entries = obj.tolist()
            return [([entries], lens + np.array([len(p) for p in prefix], dtype=np.int64)[lens])]

        self.column = column

    def _compile_bytes(self):
        f, generic = self.f, self._generic
        if f.shape != ():
            return
        pfx = _prefix_cache(
            lambda n: ex.entry_prefix(f.name, ex.BYTES, 1 + len(ex.varint(n)) + n) + b"\x0a" + ex.varint(n)
        )

        def one(v):
            t = type(v)
            if t is str:
                b = v.encode()
            elif t is bytes:
                b = v
            else:
                return generic(v)
            return pfx(len(b)) + b

        self.one = one

        def column(col, n):
            if not isinstance(col, list) or not n:
                return None
            types = set(map(type, col))
            if types == {str}:
                data = [s.encode() for s in col]
            elif types == {bytes}:
                data = col
            else:
                return None
            lens = np.fromiter(map(len, data), np.int64, n)
            prefixes = list(map(pfx, lens.tolist()))
            plens = np.fromiter(map(len, prefixes), np.int64, n)
            return [([prefixes, data], lens + plens)]

        self.column = column

    def _compile_image(self):
        f, generic = self.f, self._generic
        pfx = _prefix_cache(
            lambda n: ex.entry_prefix(f.name, ex.BYTES, 1 + len(ex.varint(n)) + n) + b"\x0a" + ex.varint(n), 64
        )

        def one(v):
            if type(v) is bytes:
                return pfx(len(v)) + v
            return generic(v)

        self.one = one

    def _compile_tensor(self):
        f, generic = self.f, self._generic
        if not f.fixed or not _LITTLE:
            return
        dt = np.dtype(f.dtype)
        nbytes = dt.itemsize * int(np.prod(f.fixed_shape, dtype=np.int64))
        pre = ex.entry_prefix(f.name, ex.BYTES, 1 + len(ex.varint(nbytes)) + nbytes) + b"\x0a" + ex.varint(nbytes)
        shape = f.shape

        def one(v):
            if type(v) is np.ndarray and v.dtype == dt and v.dtype.byteorder in "=|" and v.shape == shape:
                return pre + v.tobytes()
            return generic(v)

        self.one = one

        def column(col, n):
            if (
                not isinstance(col, np.ndarray)
                or col.dtype != dt
                or col.dtype.byteorder not in "=|"
                or col.shape[1:] != shape
                or not nbytes
            ):
                return None
            return self._rows(pre, np.ascontiguousarray(col).reshape(n, -1).view(np.uint8), n)

        self.column = column
