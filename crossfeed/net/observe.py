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
            total += sum(
                x.nbytes if isinstance(x, np.ndarray) else len(x) for x in np.asarray(v, dtype=object).reshape(-1)
            )
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


def _items(value: Any) -> list[np.ndarray] | None:
    """The items of a ragged batch (a list or object array of arrays), else None."""
    if isinstance(value, list) or (isinstance(value, np.ndarray) and value.dtype == object):
        items = list(value) if isinstance(value, list) else list(value.reshape(-1))
        if items and all(isinstance(x, np.ndarray) for x in items):
            return items
    return None


@dataclasses.dataclass
class FieldStats:
    """One field over the batches seen: dtypes, the shapes of its items (a sample's value, without
    the batch axis; they vary for ragged fields such as photos), and statistics of its values
    (pixels for images, never their sizes); for text and bytes, of their lengths."""

    dtypes: set[str] = dataclasses.field(default_factory=set)
    item_shapes: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)
    of_lengths: bool = False
    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    min: float = math.inf
    max: float = -math.inf

    @property
    def shapes(self) -> set[tuple[int, ...]]:
        return set(self.item_shapes)

    def _shape(self, shape: tuple[int, ...], n: int = 1) -> None:
        self.item_shapes[shape] = self.item_shapes.get(shape, 0) + n

    def add(self, value: Any) -> None:
        items = _items(value)
        if items is not None:  # ragged: every item has its own shape
            for x in items:
                self.dtypes.add(str(x.dtype))
                self._shape(tuple(x.shape))
                if x.dtype.kind in "biuf":
                    self._numbers(x.astype(np.float64, copy=False))
            return
        if isinstance(value, list):  # strings or bytes
            self.dtypes.add(f"list[{type(value[0]).__name__}]" if value else "list")
            self._shape((), len(value))
            self.of_lengths = True
            self._numbers(np.array([len(v) for v in value], dtype=np.float64))
            return
        arr = np.asarray(value)
        self.dtypes.add(str(arr.dtype))
        if arr.ndim:
            self._shape(tuple(arr.shape[1:]), len(arr))
        if arr.dtype == object:
            self.of_lengths = True
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

    def shape_text(self) -> str:
        """``32x32x1``, ``scalar``, or for shapes that vary ``varies: 27..59 x 27..59 x 3 (12 shapes)``."""
        shapes = list(self.item_shapes)
        if len(shapes) == 1:
            return "x".join(map(str, shapes[0])) or "scalar"
        ranks = {len(sh) for sh in shapes}
        if len(ranks) != 1:
            return f"varies: {len(shapes)} shapes of ranks {sorted(ranks)}"
        dims = []
        for d in zip(*shapes):
            lo, hi = min(d), max(d)
            dims.append(str(lo) if lo == hi else f"{lo}..{hi}")
        return f"varies: {' x '.join(dims)} ({len(shapes)} shapes)"

    def row(self, name: str) -> str:
        what = "lengths" if self.of_lengths else "values"
        return (
            f"{name:<16} {'/'.join(sorted(self.dtypes)):<12} shape {self.shape_text():<28} {what} "
            f"min={self.min:.6g} max={self.max:.6g} mean={self.mean:.6g} std={self.std:.6g}"
        )


def field_stats(batches, stats: dict[str, FieldStats] | None = None) -> dict[str, FieldStats]:
    stats = {} if stats is None else stats
    for batch in batches:
        for name, value in batch.items():
            stats.setdefault(name, FieldStats()).add(value)
    return stats


def _is_image(x: Any) -> bool:
    return (
        isinstance(x, np.ndarray)
        and x.dtype.kind in "uf"
        and (x.ndim == 2 or (x.ndim == 3 and x.shape[-1] in (1, 3, 4)))
    )


def _is_image_batch(v: Any) -> bool:
    items = _items(v)
    if items is not None:
        return all(_is_image(x) for x in items)
    return (
        isinstance(v, np.ndarray)
        and v.dtype.kind in "uf"
        and (v.ndim == 3 or (v.ndim == 4 and v.shape[-1] in (1, 3, 4)))
    )


def pick_fields(batch: Mapping[str, Any], image: str | None, label: str | None) -> tuple[str, str | None]:
    if image is None:
        image = next((k for k, v in batch.items() if _is_image_batch(v)), None)
        if image is None:
            raise ConfigError(f"no image field in the batch (fields: {sorted(batch)}); pass --image")
    elif image not in batch or not _is_image_batch(batch[image]):
        raise ConfigError(f"field {image!r} is not a batch of images (N,H,W[,C], or a list of H,W[,C] arrays)")
    n = len(batch[image])
    if label is None:  # "label" if there is one, else the first 1-D numeric or text field
        candidates = [
            k for k, v in batch.items() if k != image and np.ndim(v) == 1 and len(v) == n and _items(v) is None
        ]
        label = "label" if "label" in candidates else next(iter(candidates), None)
    elif label not in batch:
        raise ConfigError(f"no field {label!r} in the batch (fields: {sorted(batch)})")
    return image, label


def _to_uint8_rgb(x: np.ndarray) -> np.ndarray:
    """One image as H×W×3 uint8 (floats scaled from their own min/max)."""
    if x.dtype.kind == "f":
        lo, hi = float(x.min()), float(x.max())
        x = (x - lo) / (hi - lo or 1.0) * 255
    x = np.clip(x, 0, 255).astype(np.uint8)
    if x.ndim == 2:
        x = x[..., None]
    if x.shape[-1] == 1:
        x = np.repeat(x, 3, axis=-1)
    return np.ascontiguousarray(x[..., :3])


def _label_text(value: Any, class_names: list[str] | None) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if class_names is not None and np.ndim(value) == 0 and np.asarray(value).dtype.kind in "iu":
        i = int(value)
        return class_names[i] if 0 <= i < len(class_names) else f"{i}?"
    return str(value)


def image_grid(
    batch: Mapping[str, Any],
    *,
    image: str | None = None,
    label: str | None = None,
    max_images: int = 64,
    columns: int = 8,
    class_names: list[str] | None = None,
    tile: int = 96,
):
    """A PIL RGB image: the batch's images in a grid of ``tile``-pixel cells (each image resized to
    fit, keeping its aspect; images of different sizes are fine), each with its label below it —
    the class name when ``class_names`` is given and the label is an index."""
    from PIL import Image, ImageDraw  # optional: only the show command needs Pillow

    image, label = pick_fields(batch, image, label)
    value = batch[image]
    items = _items(value)
    imgs = (items if items is not None else list(np.asarray(value)))[:max_images]
    n = len(imgs)
    cols = max(1, min(columns, n))
    rows = math.ceil(n / cols)
    pad = 14
    grid = Image.new("RGB", (cols * tile, rows * (tile + pad)))
    draw = ImageDraw.Draw(grid)
    labels = batch[label] if label else None
    for i, x in enumerate(imgs):
        im = Image.fromarray(_to_uint8_rgb(x), "RGB")
        scale = tile / max(im.size)
        im = im.resize(
            (max(1, round(im.size[0] * scale)), max(1, round(im.size[1] * scale))),
            Image.Resampling.NEAREST if scale >= 1 else Image.Resampling.BILINEAR,
        )
        x0, y0 = (i % cols) * tile, (i // cols) * (tile + pad)
        grid.paste(im, (x0 + (tile - im.size[0]) // 2, y0 + (tile - im.size[1]) // 2))
        if labels is not None:
            draw.text((x0 + 2, y0 + tile + 1), _label_text(labels[i], class_names)[:24], fill=(255, 255, 255))
    return grid
