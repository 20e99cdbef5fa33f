"""Before and after: the same Loader workloads under two source trees, in one run, side by side.

A change that should not change speed (a move, a rename, one options path) is shown not to:
each (tree, workload) runs in a fresh process whose ``sys.path`` starts with that tree (ahead of
the editable install), rounds alternate the trees, the best epoch of each is kept, and the table
prints both and the ratio after/before. The data is written once, by the "after" tree, in the
format both read.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/bench_trees.py --before /tmp/before          # after = this tree
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
AFTER = os.path.dirname(HERE)

# (name, samples, sample maker): small raw tensors, tabular rows, a mixture of the two raw halves
WORKLOADS = {
    "raw 32x32x3": "lambda i, r: {'image': r.integers(0, 255, (32, 32, 3), dtype=np.uint8), 'label': i}",
    "tabular 32 floats": "lambda i, r: {'x': r.random(32, dtype=np.float32), 'label': i}",
}
CONFIGS = [(32, "none"), (32, "global"), (256, "none"), (256, "global"), (1024, "global")]

_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import crossfeed
assert crossfeed.__file__.startswith(sys.argv[1]), crossfeed.__file__
path, configs, epochs = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
out = {}
for batch, shuffle in configs:
    best = 0.0
    with crossfeed.Loader(path, batch_size=batch, shuffle=shuffle, seed=0) as loader:
        n = sum(len(b["label"]) for b in loader)  # warm-up epoch: pages mapped, plan drawn
        for _ in range(epochs):
            t = time.perf_counter()
            n = sum(len(b["label"]) for b in loader)
            best = max(best, n / (time.perf_counter() - t))
    out[f"{batch}/{shuffle}"] = best
print(json.dumps(out))
"""


def _write(root: str, maker: str, n: int) -> str:
    code = (
        "import sys, numpy as np, crossfeed\n"
        f"r = np.random.default_rng(0); make = {maker}\n"
        f"crossfeed.write_dataset(sys.argv[1], (make(i, r) for i in range({n})), num_shards=4).close()\n"
    )
    if not os.path.exists(os.path.join(root, "crossfeed.json")):
        subprocess.run([sys.executable, "-c", code, root], check=True)
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the source tree to compare with (a git worktree)")
    ap.add_argument("--after", default=AFTER)
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per process (best kept)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both trees (best kept)")
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "crossfeed-bench-trees"))
    a = ap.parse_args()
    trees = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
    configs = json.dumps(CONFIGS)
    best: dict = {}
    for name, maker in WORKLOADS.items():
        root = _write(os.path.join(a.data, f"{name.split()[0]}-{a.samples}"), maker, a.samples)
        for r in range(a.rounds):
            for which in ("before", "after") if r % 2 == 0 else ("after", "before"):
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                p = subprocess.run(
                    [sys.executable, "-c", _CHILD, trees[which], root, configs, str(a.epochs)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                for cfg, sps in json.loads(p.stdout).items():
                    key = (name, cfg, which)
                    best[key] = max(best.get(key, 0.0), sps)
    print(f"{'workload':20s} {'batch/shuffle':>14s} {'before':>14s} {'after':>14s} {'after/before':>13s}")
    for name in WORKLOADS:
        for batch, shuffle in CONFIGS:
            cfg = f"{batch}/{shuffle}"
            b, f = best[(name, cfg, "before")], best[(name, cfg, "after")]
            print(f"{name:20s} {cfg:>14s} {b:>12,.0f}/s {f:>12,.0f}/s {f / b:>12.2f}×")


if __name__ == "__main__":
    main()
