"""Data shaped like an outside tester's first hour: a folder of digit-like PNGs of one size, JPEG
"photos" of different sizes, a wine-like CSV with a bad cell, empty cells and string labels, and
Parquet parts. Plus `crossfeed(...)`: the real command in a fresh process (a traceback fails)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def crossfeed(*args, cwd=None, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """``crossfeed ARGS`` as a user runs it (``python -m crossfeed.cli.main``), never with a traceback."""
    full_env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})
    )
    proc = subprocess.run(
        [sys.executable, "-m", "crossfeed.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=full_env,
    )
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def digits_folder(path, *, classes: int = 3, per_class: int = 7, size: int = 32, seed: int = 0) -> Path:
    """``path/<digit>/<i>.png``: grayscale (L) PNGs, all ``size``×``size``, a bright stroke per class."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    path = Path(path)
    for c in range(classes):
        (path / str(c)).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = rng.integers(0, 40, (size, size), dtype=np.uint8)
            img[:, (c * size) // classes : (c * size) // classes + 3] = 250  # a column per class: learnable
            Image.fromarray(img, "L").save(path / str(c) / f"{i}.png")
    return path


def photos_folder(path, *, per_class: int = 5, seed: int = 0) -> Path:
    """``path/{cat,dog}/<i>.jpg``: RGB JPEGs of different sizes (20..70 pixels a side)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    path = Path(path)
    for c in ("cat", "dog"):
        (path / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(20, 70, 2))
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), "RGB").save(path / c / f"{i}.jpg")
    return path


WINE_BAD_LINE = 9  # the line of the "1n/a" cell (header is line 1)


def wine_csv(path, *, rows: int = 30) -> Path:
    """A wine-like CSV: ``alcohol`` has one bad cell (``1n/a``) at line `WINE_BAD_LINE`, ``malic_acid``
    and ``magnesium`` (integers) have empty cells, ``cultivar`` is a string label."""
    rng = np.random.default_rng(0)
    lines = ["alcohol,malic_acid,magnesium,cultivar"]
    names = ["barolo", "grignolino", "barbera"]
    for i in range(rows):
        line = i + 2
        alcohol = "1n/a" if line == WINE_BAD_LINE else f"{rng.uniform(11, 15):.2f}"
        malic = "" if line in (4, 12) else f"{rng.uniform(0.7, 5):.2f}"
        magnesium = "" if line == 6 else str(int(rng.integers(70, 160)))
        lines.append(f"{alcohol},{malic},{magnesium},{names[i % 3]}")
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


def parquet_parts(folder, *, parts: int = 2, rows: int = 6) -> list[Path]:
    """``folder/part-0.parquet`` …: columns ``x`` (float) and ``y`` (string label)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for p in range(parts):
        ids = np.arange(p * rows, (p + 1) * rows)
        table = pa.table({"x": ids.astype(np.float64), "y": [["a", "b"][i % 2] for i in ids]})
        pq.write_table(table, folder / f"part-{p}.parquet")
        out.append(folder / f"part-{p}.parquet")
    return out
