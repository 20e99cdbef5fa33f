"""What the watching tools compute from batches: rates, per-field statistics, image grids.

Pure functions over `dict[str, np.ndarray]` batches; `crossfeed mon/stat/show` feed them from a
broadcast subscription so they never take batches from the trainers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from crossfeed.errors import ConfigError


def batch_nbytes(batch: Mapping[str, Any]) -> int:
    """Payload bytes of a batch: array data, ragged items' data, bytes/str lengths."""
    total = 0
    for v in batch.values():
        if isinstance(v, np.ndarray) and v.dtype != object:
            total += v.nbytes
        else:
            total += sum(x.nbytes if isinstance(x, np.ndarray) else len(x) for x in np.asarray(v, dtype=object).reshape(-1))
    return total


def batch_size(batch: Mapping[str, Any]) -> int:
    for v in batch.values():
        return len(v) if np.ndim(v) else 1
    return 0


@dataclasses.dataclass
class Rates:
    """Counts since `start`; `per_second(now)` gives batches/s, samples/s, MB/s."""

    start: float
    batches: int = 0
    samples: int = 0
    nbytes: int = 0

    def add(self, batch: Mapping[str, Any]) -> None:
        self.batches += 1
        self.samples += batch_size(batch)
        self.nbytes += batch_nbytes(batch)

    def per_second(self, now: float) -> tuple[float, float, float]:
        dt = max(now - self.start, 1e-9)
        return self.batches / dt, self.samples / dt, self.nbytes / dt / 1e6


@dataclasses.dataclass
class FieldStats:
    """dtype and shape sets, min, max, mean, std of one field over the batches seen."""

    dtypes: set[str] = dataclasses.field(default_factory=set)
    shapes: set[tuple[int, ...]] = dataclasses.field(default_factory=set)
    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    min: float = math.inf
    max: float = -math.inf

    def add(self, value: Any) -> None:
        if isinstance(value, list):
            self.dtypes.add(f"list[{type(value[0]).__name__}]" if value else "list")
            self.shapes.add((len(value),))
            lengths = np.array([len(v) for v in value], dtype=np.float64)
            self._numbers(lengths)  # for text: statistics of the item lengths
            return
        arr = np.asarray(value)
        self.dtypes.add(str(arr.dtype))
        self.shapes.add(tuple(arr.shape))
        if arr.dtype == object:
            self._numbers(np.array([len(v) for v in arr.reshape(-1)], dtype=np.float64))
        elif arr.dtype.kind in "biuf" or arr.dtype.name == "bfloat16":
            self._numbers(arr.astype(np.float64, copy=False))

    def _numbers(self, a: np.ndarray) -> None:
        if a.size == 0:
            return
        self.count += a.size
        self.total += float(a.sum())
        self.total_sq += float(np.square(a).sum())
        self.min = min(self.min, float(a.min()))
        self.max = max(self.max, float(a.max()))

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    @property
    def std(self) -> float:
        if not self.count:
            return math.nan
        return math.sqrt(max(self.total_sq / self.count - self.mean**2, 0.0))

    def row(self, name: str) -> str:
        shapes = ",".join("x".join(map(str, s)) or "scalar" for s in sorted(self.shapes))
        return (f"{name:<16} {'/'.join(sorted(self.dtypes)):<12} {shapes:<20} "
                f"min={self.min:.6g} max={self.max:.6g} mean={self.mean:.6g} std={self.std:.6g}")


def field_stats(batches, stats: dict[str, FieldStats] | None = None) -> dict[str, FieldStats]:
    stats = {} if stats is None else stats
    for batch in batches:
        for name, value in batch.items():
            stats.setdefault(name, FieldStats()).add(value)
    return stats


def _is_image_batch(v: Any) -> bool:
    return isinstance(v, np.ndarray) and v.dtype.kind in "uf" and (
        v.ndim == 3 or (v.ndim == 4 and v.shape[-1] in (1, 3, 4))
    )


def pick_fields(batch: Mapping[str, Any], image: str | None, label: str | None) -> tuple[str, str | None]:
    if image is None:
        image = next((k for k, v in batch.items() if _is_image_batch(v)), None)
        if image is None:
            raise ConfigError(f"no image field in the batch (fields: {sorted(batch)}); pass --image")
    elif image not in batch or not _is_image_batch(batch[image]):
        raise ConfigError(f"field {image!r} is not a batch of images (N,H,W[,C])")
    n = len(batch[image])
    if label is None:
        label = next((k for k, v in batch.items() if k != image and np.ndim(v) == 1 and len(v) == n), None)
    elif label not in batch:
        raise ConfigError(f"no field {label!r} in the batch (fields: {sorted(batch)})")
    return image, label


def image_grid(batch: Mapping[str, Any], *, image: str | None = None, label: str | None = None,
               max_images: int = 64, columns: int = 8):
    """A PIL image: the batch's images in a grid, each with its label written below it."""
    from PIL import Image, ImageDraw  # optional: only the show command needs Pillow

    image, label = pick_fields(batch, image, label)
    imgs = np.asarray(batch[image])[:max_images]
    if imgs.dtype.kind == "f":
        lo, hi = float(imgs.min()), float(imgs.max())
        imgs = ((imgs - lo) / (hi - lo or 1.0) * 255).astype(np.uint8)
    imgs = imgs.astype(np.uint8, copy=False)
    if imgs.ndim == 4 and imgs.shape[-1] == 1:
        imgs = imgs[..., 0]
    n, h, w = imgs.shape[:3]
    cols = min(columns, n)
    rows = math.ceil(n / cols)
    pad = 14
    mode = "L" if imgs.ndim == 3 else ("RGBA" if imgs.shape[-1] == 4 else "RGB")
    grid = Image.new(mode, (cols * w, rows * (h + pad)))
    draw = ImageDraw.Draw(grid)
    labels = batch[label] if label else None
    for i in range(n):
        x, y = (i % cols) * w, (i // cols) * (h + pad)
        grid.paste(Image.fromarray(np.ascontiguousarray(imgs[i]), mode), (x, y))
        if labels is not None:
            text = labels[i]
            text = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
            draw.text((x + 2, y + h + 1), text[:24], fill=255 if mode == "L" else (255,) * len(mode))
    return grid
