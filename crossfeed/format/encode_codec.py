"""Per-feature encoders, compiled once per schema: `FeatureCodec` turns one feature's values into its
``tf.train.Example`` map entries — per value, or a whole column at a time with numpy — and
`reference_feature` is the plain path every fast path must match byte for byte (the oracle of
the tests, and the fallback for unusual values)."""

from __future__ import annotations

import numpy as np

from crossfeed.format import example as ex
from crossfeed.format.codecs import FLOAT_SCALARS, INT_SCALARS  # noqa: F401  (re-exported)
from crossfeed.format.schema import Feature, shape_fits


def reference_feature(f: Feature, v, out: dict) -> None:
    """Validate one value and add its ``(kind, list message)`` (and a ``/shape`` one) to ``out``."""
    if f.codec.listed and isinstance(v, (list, tuple)) and not v and f.shape in ((None,), (0,)):
        out[f.name] = (0, b"")  # empty list: no kind, so it matches whatever type later samples have
        return
    f.codec.encode_reference(f, v, out)


class FeatureCodec:
    """One feature compiled: ``one(value)`` gives its map entry (a tuple of entries for a tensor
    with a ``/shape`` companion); ``column(col, n)`` gives ``[(pieces, lengths)]`` per slot for a
    whole column, or None where the column is not one it vectorises (then ``one`` runs per value).
    Everything not on a fast path goes through `reference_feature`; the fast paths are the
    feature's codec's (`crossfeed.format.codecs.Codec.compile`)."""

    def __init__(self, f: Feature):
        self.f = f
        self.slots = f.codec.slots(f)
        self.one = self.generic
        self.column = None
        f.codec.compile(self)

    def generic(self, v):
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
    def rows(prefix: bytes, values: np.ndarray, n: int):
        """``prefix + values[i]`` for each row of an (n, w) uint8 matrix, as one piece list."""
        p = len(prefix)
        w = p + values.shape[1]
        m = np.empty((n, w), dtype=np.uint8)
        m[:, :p] = np.frombuffer(prefix, dtype=np.uint8)
        m[:, p:] = values
        return [([m.view(f"V{w}").ravel().tolist()], np.full(n, w, dtype=np.int64))]

    def numeric_column(self, col, n: int, kinds: str, scalars: dict):
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
