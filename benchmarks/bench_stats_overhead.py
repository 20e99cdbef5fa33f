"""What the Loader's always-on stage metrics cost: the same Loader settings with metrics on and
off (`crossfeed.read.metrics.ENABLED`, this benchmark's switch only), one run, same data.

Small records (the ``tabular`` workload: 32 float32 + an int64 label per sample), batch 32 — where
a batch is cheapest, so the few clock reads per batch weigh most. Two configurations: the
default (small records without a transform are built in the consumer's thread) and a per-sample
transform on 2 threads. Each builds one Loader with metrics on and one with them off, runs a
warm-up epoch on each, then ``--reps`` rounds: ``--chunk`` batches from one, as many from the
other, which one first alternating — fine-grained interleaving, so that a machine shared with
other work slows both sides alike. Each chunk is timed by the wall clock and by this process's
CPU time (``time.process_time``, every thread's). Printed per clock: batches per second of each
side and the overhead ``on/off − 1``, over the whole run and the median of the rounds. The goal:
≤ 1%.

    .venv/bin/python benchmarks/bench_stats_overhead.py [--samples 40000] [--reps 400] [--chunk 25]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def keep(sample: dict) -> dict:
    """An identity per-sample transform: batches are then built on the Loader's threads."""
    return sample


def _chunks(loader, size: int):
    """The Loader's batches without end, ``size`` at a time (its epochs one after another)."""
    it = loader.epochs(None)
    while True:
        yield [b for _, b in zip(range(size), it)]


def run(path: str, reps: int, batch: int, chunk: int, **kw) -> tuple[list, list]:
    """``reps`` rounds; in each, ``chunk`` batches from the Loader with metrics on and as many
    from the one with them off, in turn (which goes first alternates). Returns each side's
    ``(wall s, cpu s)`` per round."""
    from crossfeed.read import metrics
    from crossfeed.read.loader import Loader

    loaders = {}
    for on in (True, False):
        metrics.ENABLED = on
        loaders[on] = Loader(path, batch_size=batch, shuffle="global", **kw)
    metrics.ENABLED = True
    assert loaders[True].pipeline.meter is not None and loaders[False].pipeline.meter is None
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    try:
        streams = {on: _chunks(ld, chunk) for on, ld in loaders.items()}
        for on in (True, False):  # warm-up: a whole epoch each (pages mapped, the index read)
            for _ in range(len(loaders[on]) // chunk + 1):
                next(streams[on])
        for r in range(reps):
            for on in (True, False) if r % 2 == 0 else (False, True):
                t, c = time.perf_counter(), time.process_time()
                got = next(streams[on])
                times[on].append((time.perf_counter() - t, time.process_time() - c))
                assert len(got) == chunk and all(len(b["label"]) == batch for b in got)
    finally:
        for ld in loaders.values():
            ld.close()
    return times[True], times[False]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=40_000)
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--chunk", type=int, default=25, help="batches per side in each round")
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args(argv)
    from benchmarks.workloads import ensure

    path = ensure("tabular", args.samples)
    print(
        f"tabular, {args.samples:,} samples, batch {args.batch}, shuffle global; {args.reps} rounds of "
        f"{args.chunk} batches per side, alternating"
    )
    print(
        f"{'configuration':34s} {'clock':5s} {'on batches/s':>13s} {'off batches/s':>14s} {'total':>8s} {'median':>8s}"
    )
    for name, kw in (
        ("default (consumer's thread)", {}),
        ("per-sample transform, 2 threads", {"transform": keep, "num_threads": 2}),
    ):
        on, off = run(path, args.reps, args.batch, args.chunk, **kw)
        for i, clock in enumerate(("wall", "cpu")):
            a, b = [r[i] for r in on], [r[i] for r in off]
            n = args.chunk * args.reps
            print(
                f"{name if i == 0 else '':34s} {clock:5s} {n / sum(a):>13,.0f} {n / sum(b):>14,.0f} "
                f"{sum(a) / sum(b) - 1:>8.2%} {statistics.median(x / y - 1 for x, y in zip(a, b)):>8.2%}"
            )
    print("overhead = time with metrics on / time with them off − 1: over the whole run, and the median round")


if __name__ == "__main__":
    main()
