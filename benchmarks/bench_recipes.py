"""Data recipes' overhead: the same mixture epoch with and without a mixture schedule, a skip
list of 10^5 sample ids and per-sample randomness (issue 36: together at most 5% over it).

Both runs read a mixture of two "tabular" workloads (``--n`` and ``--n // 4`` samples of 32
float32 and a label; ``--n`` samples an epoch) through the same per-sample augmentation — Gaussian
noise added to ``x``, then ``--work`` extra numpy steps — so the difference is the recipes' cost
alone:

* plain: fixed weights 3:1, the noise drawn from one shared generator (what a transform does
  without recipes: the same work, not reproducible);
* recipes: a two-phase `crossfeed.Schedule` (3:1, then 1:3 from the epoch's middle), ``--skip``
  random sample ids of the first source skipped (never read), and the noise drawn from each
  sample's own generator (``rng``, keyed by seed, epoch and sample id).

Printed: each run's epoch seconds and microseconds per delivered sample, wall and this process's
CPU (best of ``--rounds``, runs alternating; the CPU time is the steadier measure on a shared
machine), and their ratios per delivered sample — the recipes' cost for the samples that arrive
(skipped ones are never read, so a whole epoch is faster with them) — and that cost in CPU
microseconds per delivered sample (``--parts``: each recipe alone too).

    .venv/bin/python benchmarks/bench_recipes.py [--n 400000] [--skip 100000] [--rounds 3] [--work 0] [--parts]

``--instructions`` (with valgrind, its ``valgrind/callgrind.h`` and a C compiler): instead of
timing, each run in a process of its own under callgrind, counting the instructions of one epoch
(the second: collection is switched on around it) — the same count whatever else the machine runs,
where a shared machine's CPU times swing by more than the parts cost.

``--work 0`` (noise on 32 floats, a few microseconds) is the worst case: the per-sample
generator's reset (one 96-byte write, `crossfeed.read.stages.recipes.PhiloxRewind`) and the
per-sample recipe loop are a fixed cost per sample; ``--work 60`` stands for a realistic
augmentation.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
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


def _sources(big: str, small: str, n: int, scheduled: bool) -> list:
    """The mixture: fixed weights 3:1, or (``scheduled``) 3:1 then 1:3 from sample ``n // 2``."""
    import crossfeed

    if not scheduled:
        return [crossfeed.Source(big, weight=3), crossfeed.Source(small, weight=1)]
    half = n // 2
    return [
        crossfeed.Source(big, weight=crossfeed.Schedule.constant([(0, 3), (half, 1)])),
        crossfeed.Source(small, weight=crossfeed.Schedule.constant([(0, 1), (half, 3)])),
    ]


def _epoch(source, **kw) -> tuple[float, float, int]:
    """``(wall seconds, CPU seconds of this process, samples delivered)`` of one epoch."""
    import crossfeed

    with crossfeed.Loader(source, batch_size=256, seed=0, **kw) as ld:
        t, c = time.perf_counter(), time.process_time()
        n = sum(len(b["label"]) for b in ld)
        return time.perf_counter() - t, time.process_time() - c, n


CALLGRIND_C = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void cg_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _counted_epoch(source, lib: str, **kw) -> int:
    """One epoch's samples, the instructions of the second epoch counted (``--instructions``)."""
    import ctypes

    import crossfeed

    cg = ctypes.CDLL(lib)
    with crossfeed.Loader(source, batch_size=256, seed=0, **kw) as ld:
        sum(len(b["label"]) for b in ld)  # the first epoch: files opened, caches warm
        cg.cg_start()
        n = sum(len(b["label"]) for b in ld)
        cg.cg_stop()
    return n


def _instructions(names, argv: list[str]) -> dict[str, tuple[int, int]]:
    """``{run: (instructions of one epoch, samples delivered)}``, each run under callgrind."""
    tmp = tempfile.mkdtemp(prefix="bench_recipes_")
    lib, src = os.path.join(tmp, "cg.so"), os.path.join(tmp, "cg.c")
    with open(src, "w") as f:
        f.write(CALLGRIND_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
    out = {}
    for name in names:
        log = os.path.join(tmp, f"{name}.callgrind")
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no"]
        cmd += [f"--callgrind-out-file={log}", sys.executable, os.path.abspath(__file__), *argv]
        run = subprocess.run([*cmd, "--one", name, "--lib", lib], capture_output=True, text=True, check=True)
        delivered = int(run.stdout.split("DELIVERED")[1].split()[0])
        with open(log) as f:
            total = next(int(line.split()[1]) for line in f if line.startswith("totals:"))
        out[name] = (total, delivered)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400_000)
    ap.add_argument("--skip", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="builder threads (0: in the consumer's thread)")
    ap.add_argument("--work", type=int, default=0, help="extra numpy steps per sample (~1 us each)")
    ap.add_argument("--parts", action="store_true", help="also each recipe alone (schedule, skip, rng)")
    ap.add_argument("--instructions", action="store_true", help="count each run's instructions (valgrind)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # --instructions: this run, in this process
    ap.add_argument("--lib", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    WORK[0] = a.work
    sys.path.insert(0, os.path.dirname(HERE))
    import crossfeed
    from benchmarks.workloads import ensure

    big, small = ensure("tabular", a.n), ensure("tabular", max(1, a.n // 4))
    ids = np.sort(np.random.default_rng(1).choice(a.n, size=min(a.skip, a.n), replace=False))
    skip = crossfeed.Skip(samples=np.stack([np.zeros_like(ids), ids], axis=1))  # (source 0, index)
    common = {"num_threads": a.threads, "samples_per_epoch": a.n}
    plain = (_sources(big, small, a.n, False), {"transform": noise_shared, **common})
    recipe = (_sources(big, small, a.n, True), {"transform": noise_rng, "skip": skip, **common})
    runs = {"plain": plain, "recipes": recipe}
    if a.parts:  # each recipe alone over the plain run
        runs["schedule"] = (recipe[0], plain[1])
        runs["skip"] = (plain[0], {**plain[1], "skip": skip})
        runs["rng"] = (plain[0], {**plain[1], "transform": noise_rng})
    if a.one:
        print("DELIVERED", _counted_epoch(runs[a.one][0], a.lib, **runs[a.one][1]))
        return
    if a.instructions:
        args = [x for x in (sys.argv[1:] if argv is None else argv) if x != "--instructions"]
        got = _instructions(list(runs), args)
        pi, pn = got["plain"]
        for name, (i, n) in got.items():
            print(f"{name:8s} {i:15,} instructions/epoch  {n:9,} samples  {i / n:9,.0f} per delivered sample")
        for name in [k for k in got if k != "plain"]:
            i, n = got[name]
            print(
                f"cost of {name}: {i / n - pi / pn:+,.0f} instructions per delivered sample ({i / n / (pi / pn) - 1:+.1%})"
            )
        return
    best: dict[str, list] = {}
    for _ in range(a.rounds):
        for name, (source, kw) in runs.items():
            wall, cpu, n = _epoch(source, **kw)
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
    for name in [k for k in best if k != "plain"]:
        _, c, n = best[name]
        print(f"cost of {name}: {1e6 * (c / n - pc / pn):+.2f} CPU-us per delivered sample")
    print(f"whole epoch, recipes / plain (CPU): {rc / pc:.3f} (skipped samples are never read)")


if __name__ == "__main__":
    main()
