"""Per-feature statistics that merge: count, min/max/mean of numbers, a histogram of shapes.
Built per shard (or per Beam bundle) and merged, so they cost one pass over the data."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class FeatureStats:
    count: int = 0
    total: float = 0.0
    n_values: int = 0
    min: float | None = None
    max: float | None = None
    shapes: dict[str, int] = field(default_factory=dict)

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
        return out

    def to_json(self) -> dict:
        d: dict = {"count": self.count}
        if self.n_values:
            d.update(min=self.min, max=self.max, mean=self.total / self.n_values)
        if self.shapes:
            d["shapes"] = dict(sorted(self.shapes.items(), key=lambda kv: -kv[1])[:20])
        return d


def merge_all(parts: list[dict[str, FeatureStats]]) -> dict[str, FeatureStats]:
    out: dict[str, FeatureStats] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out[k].merge(v) if k in out else v
    return out
