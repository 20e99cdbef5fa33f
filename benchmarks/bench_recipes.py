"""Data recipes' overhead: the same epoch plain, and with a skip list of 10^5 sample ids and a
per-sample generator in the transform (issue 36: together at most 5% over the plain epoch).

Both runs read the "tabular" workload (``--n`` samples of 32 float32 and a label) with a
per-sample transform that adds Gaussian noise to ``x``: the plain run draws it from one shared
generator (what a transform does without recipes: not reproducible), the recipe run from each
sample's own generator (``rng``, keyed by seed, epoch and sample id) with ``--skip`` random sample
ids skipped (never read). Printed: each run's epoch seconds and microseconds per delivered
sample, wall and this process's CPU (best of ``--rounds``, runs alternating; the CPU time is the
steadier measure on a shared machine), and their ratios per delivered sample — the
recipes' cost for the samples that arrive (skipped ones are never read, so a whole epoch is
faster with them).

    .venv/bin/python benchmarks/bench_recipes.py [--n 400000] [--skip 100000] [--rounds 3] [--work 0]

The generator's cost is fixed per sample (a Philox state reset, ~2-3 us on a loaded core), so
its share depends on the transform: ``--work 0`` (a trivial 5 us transform on 32 floats) is the
worst case; ``--work 60`` stands for a realistic augmentation.

A mixture schedule (issue 36, item 1) joins the recipe run where this crossfeed has one: see
`_schedule` (the hook returns nothing on branches without schedules).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
_SHARED = np.random.default_rng(0)
WORK = [0]  # extra numpy steps per sample (--work): a heavier augmentation, the same in both runs


def _work(x: np.ndarray) -> np.ndarray:
    for _ in range(WORK[0]):
        x = np.sqrt(x * x + 1.0)
    return x


def noise_shared(sample):
    out = dict(sample)
    out["x"] = _work(sample["x"] + _SHARED.standard_normal(32, dtype=np.float32))
    return out


def noise_rng(sample, rng):
    out = dict(sample)
    out["x"] = _work(sample["x"] + rng.standard_normal(32, dtype=np.float32))
    return out


def _schedule(path: str) -> dict:
    """Loader keywords that add a mixture schedule to the recipe run, where schedules exist
    (issue 36, item 1); nothing here: the recipe run reads ``path`` alone."""
    return {}


def _epoch(path: str, **kw) -> tuple[float, float, int]:
    """``(wall seconds, CPU seconds of this process, samples delivered)`` of one epoch."""
    import crossfeed

    with crossfeed.Loader(path, batch_size=256, seed=0, **kw) as ld:
        t, c = time.perf_counter(), time.process_time()
        n = sum(len(b["label"]) for b in ld)
        return time.perf_counter() - t, time.process_time() - c, n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400_000)
    ap.add_argument("--skip", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="builder threads (0: in the consumer's thread)")
    ap.add_argument("--work", type=int, default=0, help="extra numpy steps per sample (~1 us each)")
    a = ap.parse_args(argv)
    WORK[0] = a.work
    sys.path.insert(0, os.path.dirname(HERE))
    import crossfeed
    from benchmarks.workloads import ensure

    path = ensure("tabular", a.n)
    ids = np.random.default_rng(1).choice(a.n, size=min(a.skip, a.n), replace=False)
    skip = crossfeed.Skip(samples=np.sort(ids))
    plain = {"transform": noise_shared, "num_threads": a.threads}
    recipe = {"transform": noise_rng, "skip": skip, "num_threads": a.threads, **_schedule(path)}
    best: dict[str, list] = {}
    for _ in range(a.rounds):
        for name, kw in (("plain", plain), ("recipes", recipe)):
            wall, cpu, n = _epoch(path, **kw)
            b = best.setdefault(name, [wall, cpu, n])
            b[0], b[1] = min(b[0], wall), min(b[1], cpu)
    for name, (wall, cpu, n) in best.items():
        print(
            f"{name:8s} {wall:7.2f} s/epoch  {n:9,} samples  {1e6 * wall / n:6.2f} us/sample  {1e6 * cpu / n:6.2f} cpu-us/sample"
        )
    (pw, pc, pn), (rw, rc, rn) = best["plain"], best["recipes"]
    for what, p, r in (("wall", pw, rw), ("CPU", pc, rc)):
        ratio = (r / rn) / (p / pn)
        print(
            f"recipes / plain per delivered sample ({what}): {ratio:.3f} (overhead {100 * (ratio - 1):+.1f}%; goal <= +5%)"
        )


if __name__ == "__main__":
    main()
