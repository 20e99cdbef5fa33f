"""The benchmark workloads, generated once into a cache directory as crossfeed datasets
(shards + ``.idx`` + manifest, written by `crossfeed.write_dataset`):

=========  ==========================================================  ==================
name       sample                                                      default size
=========  ==========================================================  ==================
raw        ``image`` uint8 (224, 224, 3) raw tensor + ``label`` int64  4,000 in 8 shards
tabular    ``x`` float32 (32,) float list + ``label`` int64           400,000 in 8 shards
jpeg       ``image`` 224×224 JPEG (Pillow quality 90, smooth random    4,000 in 8 shards
           content), Encoding.IMAGE + ``label`` int64
=========  ==========================================================  ==================

Sizes come from arguments or the environment (``CROSSFEED_BENCH_RAW``, ``CROSSFEED_BENCH_TABULAR``,
``CROSSFEED_BENCH_JPEG``); the cache directory from ``CROSSFEED_BENCH_DATA`` (default
``benchmarks/_data/``, gitignored). A dataset is reused when its manifest exists.

    .venv/bin/python -m benchmarks.workloads            # generate all three
    .venv/bin/python -m benchmarks.workloads --quick    # small versions
"""

from __future__ import annotations

import argparse
import io
import os
from collections.abc import Iterator

import numpy as np

import crossfeed
from crossfeed.format.manifest import MANIFEST
from crossfeed.format.schema import Encoding, Feature, Schema

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_data")
DEFAULT_SIZES = {"raw": 4000, "tabular": 400_000, "jpeg": 4000}
QUICK_SIZES = {"raw": 400, "tabular": 40_000, "jpeg": 400}
NUM_SHARDS = 8
SIDE = 224

SCHEMAS = {
    "raw": Schema(
        [Feature("image", "uint8", (SIDE, SIDE, 3), Encoding.TENSOR), Feature("label", "int64", (), Encoding.INT64)]
    ),
    "tabular": Schema([Feature("x", "float32", (32,), Encoding.FLOAT), Feature("label", "int64", (), Encoding.INT64)]),
    "jpeg": Schema(
        [Feature("image", "uint8", (SIDE, SIDE, 3), Encoding.IMAGE), Feature("label", "int64", (), Encoding.INT64)]
    ),
}


def cache_dir() -> str:
    return os.environ.get("CROSSFEED_BENCH_DATA", DEFAULT_DIR)


def size_of(name: str, quick: bool = False) -> int:
    default = (QUICK_SIZES if quick else DEFAULT_SIZES)[name]
    return int(os.environ.get(f"CROSSFEED_BENCH_{name.upper()}", default))


def _raw(n: int, rng) -> Iterator[dict]:
    base = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    for i in range(n):
        yield {"image": np.roll(base, i, axis=0), "label": i % 1000}


def _tabular(n: int, rng) -> Iterator[dict]:
    x = rng.standard_normal((n, 32)).astype(np.float32)
    for i in range(n):
        yield {"x": x[i], "label": i % 10}


def smooth_image(rng, side: int = SIDE) -> np.ndarray:
    """Random but photo-like content (low-frequency), so JPEG sizes are realistic (~10-20 KB)."""
    from PIL import Image

    small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((side, side), Image.BICUBIC))


def _jpeg(n: int, rng) -> Iterator[dict]:
    from PIL import Image

    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(smooth_image(rng)).save(buf, format="JPEG", quality=90)
        yield {"image": buf.getvalue(), "label": i % 1000}


_GENERATORS = {"raw": _raw, "tabular": _tabular, "jpeg": _jpeg}


def ensure(name: str, n: int | None = None, *, root: str | None = None, quick: bool = False) -> str:
    """The path of workload ``name`` with ``n`` samples, generating it on first use."""
    n = size_of(name, quick) if n is None else n
    path = os.path.join(root or cache_dir(), f"{name}-{n}")
    if not os.path.exists(os.path.join(path, MANIFEST)):
        rng = np.random.default_rng(0)
        crossfeed.write_dataset(
            path,
            _GENERATORS[name](n, rng),
            schema=SCHEMAS[name],
            num_shards=min(NUM_SHARDS, n),
            metadata={"workload": name},
        ).close()
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="raw,tabular,jpeg")
    ap.add_argument("--quick", action="store_true", help="small sizes for a fast run")
    a = ap.parse_args(argv)
    for name in a.workloads.split(","):
        print(f"{name}: {ensure(name, quick=a.quick)}")


if __name__ == "__main__":
    main()
