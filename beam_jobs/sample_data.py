"""A small synthetic image-classification folder, generated on the spot (``make demo``).

``make_image_folder(path, n_per_class=20)`` writes ``path/<class>/<nnnn>.jpg|png``: each class is
one shape (circle, square, triangle, cross, ring, …) drawn in a random colour, size and position on
a random plain background, so a tiny model can learn to tell them apart. Deterministic for a seed.
"""

from __future__ import annotations

import os

import numpy as np

from crossfeed.errors import ConfigError

CLASSES = ("circle", "square", "triangle", "cross", "ring", "diamond")


def make_image_folder(
    path,
    *,
    n_per_class: int = 20,
    classes: tuple[str, ...] | int = 3,
    size: int = 64,
    seed: int = 0,
    formats: tuple[str, ...] = ("jpeg", "png"),
) -> list[str]:
    """Write the folder and return the written files (relative to ``path``), sorted.

    ``classes`` is a tuple of names from `CLASSES` or a count (the first ``n`` of them); files
    alternate between ``formats``.
    """
    from PIL import Image, ImageDraw

    names = CLASSES[:classes] if isinstance(classes, int) else tuple(classes)
    unknown = [c for c in names if c not in CLASSES]
    if unknown or not names:
        raise ConfigError(f"classes must be names from {CLASSES} (or a count up to {len(CLASSES)}), got {classes!r}")
    if n_per_class < 1 or size < 16:
        raise ConfigError(f"n_per_class must be >= 1 and size >= 16, got {n_per_class} and {size}")
    rng = np.random.default_rng(seed)
    written = []
    for c in names:
        os.makedirs(os.path.join(path, c), exist_ok=True)
        for i in range(n_per_class):
            bg = tuple(int(v) for v in rng.integers(0, 96, 3))
            fg = tuple(int(v) for v in rng.integers(128, 256, 3))
            im = Image.new("RGB", (size, size), bg)
            r = int(rng.integers(size // 6, size // 3))
            cx, cy = (int(v) for v in rng.integers(r, size - r, 2))
            _draw(ImageDraw.Draw(im), c, cx, cy, r, fg, bg)
            fmt = formats[i % len(formats)]
            rel = f"{c}/{i:04d}.{'jpg' if fmt == 'jpeg' else fmt}"
            im.save(os.path.join(path, rel), format=fmt.upper(), **({"quality": 90} if fmt == "jpeg" else {}))
            written.append(rel)
    return sorted(written)


def _draw(d, shape: str, cx: int, cy: int, r: int, fg, bg) -> None:
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        d.ellipse(box, fill=fg)
    elif shape == "square":
        d.rectangle(box, fill=fg)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    elif shape == "cross":
        w = max(2, r // 3)
        d.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fg)
        d.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fg)
    elif shape == "ring":
        d.ellipse(box, fill=fg)
        d.ellipse((cx - r // 2, cy - r // 2, cx + r // 2, cy + r // 2), fill=bg)
    else:  # diamond
        d.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fg)
