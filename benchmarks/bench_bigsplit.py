"""Opening a split of 3×10^7 small records: open + the first globally shuffled batch, and memory.

The dataset (100 shards of 300,000 int64 records, written once by `crossfeed.write_dataset` as one
shard, then hard-linked 100 times under the manifest's names: the reads are the same as for 100
written shards; ~1.1 GB of shards + 0.3 GB of index on disk) lives in ``--data``. Each reader runs
in a fresh process: the time to make the Loader (``open``), to get its first batch (``first``),
the resident memory above the same process with an empty Loader (a 1-record dataset) open, and
samples/s over the next ``--batches`` batches (a lazy index checks each block of entries as a
batch first touches it, so part of what was paid at the first batch is paid in these), and the
time from opening to the end of them. ``--baseline DIR`` runs the same in a checkout of
crossfeed at DIR too (before/after in one run).

    .venv/bin/python benchmarks/bench_bigsplit.py [--data /tmp/crossfeed-bigsplit] [--baseline /work/main]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHARDS, PER_SHARD = 100, 300_000


def ensure(root: str) -> str:
    """The 3×10^7-record dataset at ``root`` (made once)."""
    import crossfeed
    from crossfeed.format.schema import Encoding, Feature, Schema

    big = os.path.join(root, "big")
    if os.path.exists(os.path.join(big, "crossfeed.json")):
        return big
    one = os.path.join(root, "one-shard")
    if not os.path.exists(os.path.join(one, "crossfeed.json")):
        schema = Schema([Feature("label", "int64", (), Encoding.INT64)])
        crossfeed.write_dataset(one, ({"label": i} for i in range(PER_SHARD)), num_shards=1, schema=schema).close()
    with open(os.path.join(one, "crossfeed.json")) as f:
        manifest = json.load(f)
    split = manifest["splits"]["train"]
    (info,) = split["shards"]
    tmp = big + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    shards = []
    for s in range(SHARDS):
        name = f"train-{s:05d}-of-{SHARDS:05d}.tfrecord"
        for src, dst in ((info["file"], name), (info["file"] + ".idx", name + ".idx")):
            if not os.path.exists(os.path.join(tmp, dst)):
                os.link(os.path.join(one, src), os.path.join(tmp, dst))
        shards.append({**info, "file": name})
    split.update(shards=shards, num_records=SHARDS * PER_SHARD, num_bytes=SHARDS * info["num_bytes"])
    split.pop("statistics", None)
    with open(os.path.join(tmp, "crossfeed.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    os.rename(tmp, big)
    return big


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(root: str, batches: int, batch: int) -> dict:
    import crossfeed

    assert os.path.dirname(os.path.dirname(crossfeed.__file__)) == os.getcwd(), crossfeed.__file__

    with crossfeed.Loader(os.path.join(root, "one-record"), batch_size=1) as empty:
        next(iter(empty))
        base = _rss()
        t = time.perf_counter()
        loader = crossfeed.Loader(os.path.join(root, "big"), batch_size=batch, seed=0, shuffle="global")
        t_open = time.perf_counter() - t
        it = iter(loader)
        next(it)
        t_first = time.perf_counter() - t
        rss = _rss() - base
        t = time.perf_counter()
        for _ in range(batches):
            next(it)
        rate = batches * batch / (time.perf_counter() - t)
        peak = _rss() - base
        loader.close()
    return {"open": t_open, "first": t_first, "rss": rss, "rate": rate, "rss_after": peak}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/tmp/crossfeed-bigsplit")
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--baseline", help="a crossfeed checkout to run the same in (before)")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per reader (best of)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.data, a.batches, a.batch)))
        return
    import crossfeed

    ensure(a.data)
    one = os.path.join(a.data, "one-record")
    if not os.path.exists(os.path.join(one, "crossfeed.json")):
        crossfeed.write_dataset(one, [{"label": 0}]).close()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [("crossfeed", here)] + ([("before", os.path.abspath(a.baseline))] if a.baseline else [])
    print(f"{SHARDS * PER_SHARD:,} records in {SHARDS} shards, batch {a.batch}, shuffle global")
    print(
        f"{'':10} {'open (s)':>9} {'first batch (s)':>16} {'MB above empty':>15} {'MB after':>9} {'samples/s':>11} "
        f"{'to batch ' + str(a.batches + 1) + ' (s)':>18}"
    )
    results: dict[str, list] = {name: [] for name, _ in runs}
    for _ in range(a.repeat):  # alternating fresh processes; the best of each (the box may be loaded)
        for name, tree in runs:
            env = {**os.environ, "PYTHONPATH": tree}  # crossfeed imported from that tree
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--data", a.data]
            cmd += ["--batches", str(a.batches), "--batch", str(a.batch)]
            out = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for name, got in results.items():
        r = {k: (max if k == "rate" else min)(x[k] for x in got) for k in got[0]}
        print(
            f"{name:10} {r['open']:9.3f} {r['first']:16.3f} {r['rss'] / 1e6:15.1f} {r['rss_after'] / 1e6:9.1f} "
            f"{r['rate']:11,.0f} {r['first'] + a.batches * a.batch / r['rate']:18.2f}"
        )


if __name__ == "__main__":
    main()
