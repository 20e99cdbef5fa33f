"""Per-feature statistics that merge: count, min/max/mean of numbers, a histogram of shapes and,
for a variable-length feature whose lengths a dataset keeps (the tokens of a tokenized corpus),
`LengthStats`: total, min/mean/max length and a power-of-two histogram of lengths.
Built per shard (or per Beam bundle) and merged, so they cost one pass over the data."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

SHAPES_KEPT = 20  # the commonest shapes a manifest keeps per feature


@dataclass
class FeatureStats:
    count: int = 0
    total: float = 0.0
    n_values: int = 0
    min: float | None = None
    max: float | None = None
    shapes: dict[str, int] = field(default_factory=dict)
    lengths: LengthStats | None = None  # per-record lengths (a feature in the manifest's ``lengths``)

    def add(self, value) -> None:
        self.count += 1
        if isinstance(value, (bytes, str)):
            return
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], (bytes, str)):
            self._shape((len(value),))
            return
        arr = np.asarray(value)
        if arr.ndim:
            self._shape(arr.shape)
        if arr.size and arr.dtype.kind in "biuf":
            lo, hi = arr.min(), arr.max()
            self.min = float(lo) if self.min is None else min(self.min, float(lo))
            self.max = float(hi) if self.max is None else max(self.max, float(hi))
            self.total += float(arr.sum(dtype=np.float64))
            self.n_values += int(arr.size)

    def add_arrays(self, col: list) -> bool:
        """`add` of each array of ``col`` (numpy arrays of one integer dtype and one number of
        dimensions: a chunk's token arrays) with a few numpy operations over the whole column and
        exactly `add`'s result — each array's sum is exact (its values' magnitudes total under
        2**53) and the running total is summed left to right. False, adding nothing, where that
        cannot be promised (other values: then `add` each)."""
        if not col or not isinstance(col[0], np.ndarray):
            return False
        dt, ndim = col[0].dtype, col[0].ndim
        if (
            dt.kind not in "iu"
            or not ndim
            or not all(isinstance(v, np.ndarray) and v.dtype == dt and v.ndim == ndim for v in col)
        ):
            return False
        sizes = np.fromiter((v.size for v in col), dtype=np.int64, count=len(col))
        flat = np.concatenate(col if ndim == 1 else [v.reshape(-1) for v in col])
        if flat.size:
            lo, hi = int(flat.min()), int(flat.max())
            if max(abs(lo), abs(hi)) * flat.size >= 1 << 53:
                return False
            bound = max(abs(lo), abs(hi)) * flat.size
            if float(self.total).is_integer() and abs(self.total) + bound < 1 << 53:  # every partial sum exact
                self.total = float(int(self.total) + int(flat.sum(dtype=np.int64)))
            else:
                sums = np.zeros(len(col), dtype=np.float64)
                full = sizes > 0  # reduceat gives an empty segment the next value, not 0: leave those out
                sums[full] = np.add.reduceat(flat, (np.cumsum(sizes) - sizes)[full], dtype=np.int64)
                self.total = float(np.add.accumulate(np.concatenate(([self.total], sums)))[-1])
            self.min = float(lo) if self.min is None else min(self.min, float(lo))
            self.max = float(hi) if self.max is None else max(self.max, float(hi))
            self.n_values += int(flat.size)
        self.count += len(col)
        for shape, k in Counter(v.shape for v in col).items():  # first seen first, as `add` counts them
            key = "x".join(map(str, shape))
            self.shapes[key] = self.shapes.get(key, 0) + k
        return True

    def add_shape(self, shape) -> None:
        """Count a shape without the values (images: the decoded height, width, channels)."""
        self._shape(shape)

    def _shape(self, shape) -> None:
        key = "x".join(str(d) for d in shape)
        self.shapes[key] = self.shapes.get(key, 0) + 1

    def merge(self, other: FeatureStats) -> FeatureStats:
        out = FeatureStats(self.count + other.count, self.total + other.total, self.n_values + other.n_values)
        lows = [v for v in (self.min, other.min) if v is not None]
        highs = [v for v in (self.max, other.max) if v is not None]
        out.min = min(lows) if lows else None
        out.max = max(highs) if highs else None
        out.shapes = dict(self.shapes)
        for k, v in other.shapes.items():
            out.shapes[k] = out.shapes.get(k, 0) + v
        if self.lengths is not None or other.lengths is not None:
            out.lengths = (self.lengths or LengthStats()).merge(other.lengths or LengthStats())
        return out

    def to_json(self) -> dict:
        d: dict = {"count": self.count}
        if self.n_values:
            d.update(min=self.min, max=self.max, mean=self.total / self.n_values)
        if self.shapes:
            d["shapes"] = dict(sorted(self.shapes.items(), key=lambda kv: -kv[1])[:SHAPES_KEPT])
            if len(self.shapes) > SHAPES_KEPT:  # the commonest are kept; how many there were, and
                d["distinct_shapes"] = len(self.shapes)  # the records the dropped ones had, too
                d["other_shapes_count"] = sum(self.shapes.values()) - sum(d["shapes"].values())
        if self.lengths is not None:
            d["lengths"] = self.lengths.to_json()
        return d


@dataclass
class LengthStats:
    """Records' lengths (a feature's number of values): how many records, their total, min, max
    and a histogram by powers of two (``bins[b]`` counts lengths in ``[2**(b-1), 2**b)``;
    ``bins[0]`` the zeros), which merges exactly and stays small (at most 33 bins)."""

    count: int = 0
    total: int = 0
    min: int | None = None
    max: int | None = None
    bins: dict[int, int] = field(default_factory=dict)

    def add(self, lengths) -> None:
        arr = np.asarray(lengths, dtype=np.int64).ravel()
        if not arr.size:
            return
        self.count += int(arr.size)
        self.total += int(arr.sum())
        lo, hi = int(arr.min()), int(arr.max())
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)
        for b, n in zip(*np.unique(length_bins(arr), return_counts=True)):
            self.bins[int(b)] = self.bins.get(int(b), 0) + int(n)

    def merge(self, other: LengthStats) -> LengthStats:
        lows = [v for v in (self.min, other.min) if v is not None]
        highs = [v for v in (self.max, other.max) if v is not None]
        bins = dict(self.bins)
        for b, n in other.bins.items():
            bins[b] = bins.get(b, 0) + n
        return LengthStats(
            self.count + other.count,
            self.total + other.total,
            min(lows) if lows else None,
            max(highs) if highs else None,
            bins,
        )

    def to_json(self) -> dict:
        """``{"count", "total", "min", "max", "mean", "histogram": {"0": n, "1": n, "2-3": n, "4-7": n, …}}``."""
        d: dict = {"count": self.count, "total": self.total}
        if self.count:
            d.update(min=self.min, max=self.max, mean=self.total / self.count)
        d["histogram"] = {bin_label(b): n for b, n in sorted(self.bins.items())}
        return d


def length_bins(lengths: np.ndarray) -> np.ndarray:
    """Each length's power-of-two bin: 0 for 0, else ``floor(log2(n)) + 1`` (exact, integer)."""
    arr = np.asarray(lengths, dtype=np.uint64)
    bins = np.zeros(arr.shape, dtype=np.int64)
    v = arr.copy()
    while np.any(v):
        nz = v > 0
        bins[nz] += 1
        v >>= np.uint64(1)
    return bins


def bin_label(b: int) -> str:
    """``"0"``, ``"1"``, ``"2-3"``, ``"4-7"``, … for bin ``b`` of `length_bins`."""
    if b <= 1:
        return str(b)
    return f"{1 << (b - 1)}-{(1 << b) - 1}"


def merge_all(parts: list[dict[str, FeatureStats]]) -> dict[str, FeatureStats]:
    out: dict[str, FeatureStats] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out[k].merge(v) if k in out else v
    return out
