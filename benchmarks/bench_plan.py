"""Planning cost at scale: the epoch plan never grows with the dataset.

For N = 10^6 … 10^10 samples (counts only, no data) in shards of 10^6, per shuffle mode: the
time to make a rank's plan for an epoch (what every rank and DataLoader worker pays at each
epoch start), the time per 256-sample batch of indices (taken in order, as the Loader takes them), and the
memory allocated, beside the
materialised permutation the plan used before (``np.random.permutation(N)``, up to 10^8).

    .venv/bin/python benchmarks/bench_plan.py [--max-exp 10]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from crossfeed.read.options import PlanOptions, ShardOptions, Shuffle
from crossfeed.read.stages.sampler import Sampler


def measure(n: int, shuffle: Shuffle, batch: int = 256, batches: int = 200) -> tuple[float, float, float]:
    counts = [10**6] * (n // 10**6) if n >= 10**6 else [n]
    tracemalloc.start()
    t = time.perf_counter()
    plan = Sampler(
        counts, PlanOptions(batch_size=batch, shuffle=shuffle, seed=0), ShardOptions(rank=1, world_size=8)
    ).plan(epoch=3, position=0)
    make = time.perf_counter() - t
    t = time.perf_counter()
    for b in range(batches):  # in order, as a Loader takes them
        plan.batch(b)
    per_batch = (time.perf_counter() - t) / batches
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return make, per_batch, peak


def baseline(n: int) -> tuple[float, float]:
    tracemalloc.start()
    t = time.perf_counter()
    np.random.default_rng(0).permutation(n)
    dt = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return dt, peak


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-exp", type=int, default=10)
    a = ap.parse_args(argv)
    print(
        f"{'N':>14} {'shuffle':7} {'plan (ms)':>10} {'µs/batch':>9} {'peak MiB':>9}   materialised permutation (before)"
    )
    for e in range(6, a.max_exp + 1):
        n = 10**e
        base = baseline(n) if e <= 8 else None
        for shuffle in Shuffle:
            make, per, peak = measure(n, shuffle)
            extra = (
                f"   {base[0] * 1e3:9.0f} ms {base[1] / 2**20:8.0f} MiB" if base and shuffle is Shuffle.GLOBAL else ""
            )
            print(f"{n:>14,} {shuffle.value:7} {make * 1e3:10.2f} {per * 1e6:9.1f} {peak / 2**20:9.2f}{extra}")


if __name__ == "__main__":
    main()
