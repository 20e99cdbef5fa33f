"""CRC-checked record read rate: crossfeed's framing layer against tf.data's TFRecordDataset.

Both read every record's payload of every shard of the same files, sequentially, with both CRCs
checked: crossfeed through an mmap with `crossfeed.format.tfrecord.records` (zero-copy payload views);
tf.data with ``TFRecordDataset`` (tuned: batched with the payload sizes summed in the graph, so
Python is not the bottleneck, and — for large records — plain iteration; each sequential and with
``num_parallel_reads=AUTOTUNE``; the fastest of these counts). tf.data runs
in a subprocess of its own. Files are read once before timing (warm page cache); each reader
gets ``--repeat`` passes and the best pass counts.

    .venv/bin/python -m benchmarks.bench_records            # full sizes (see benchmarks/workloads.py)
    .venv/bin/python -m benchmarks.bench_records --quick    # small sizes, seconds
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time

from benchmarks import workloads
from crossfeed.format import tfrecord

GOALS = {"raw": 2.0, "tabular": 1.0, "jpeg": 1.0}  # crossfeed / tf.data record rate

_TF_READER = r"""
import json, sys, time
import tensorflow as tf
files, repeat = json.loads(sys.argv[1]), int(sys.argv[2])

def dataset(parallel):
    return tf.data.TFRecordDataset(files, buffer_size=8 << 20, num_parallel_reads=tf.data.AUTOTUNE if parallel else None)

def batched(parallel):  # payload sizes summed in the graph, 1024 records per Python step
    n = nbytes = 0
    t = time.perf_counter()
    for count, size in dataset(parallel).batch(1024).map(lambda b: (tf.size(b), tf.reduce_sum(tf.strings.length(b)))):
        n += int(count)
        nbytes += int(size)
    return time.perf_counter() - t, n, nbytes

def plain(parallel):  # one payload tensor per step: fastest for large records
    n = 0
    t = time.perf_counter()
    for _ in dataset(parallel):
        n += 1
    return time.perf_counter() - t, n, None

best = None
for parallel in (False, True):
    batched(parallel)  # warm-up
    runs = [("batched", parallel, *batched(parallel)) for _ in range(repeat)]
    n, nbytes = runs[0][3], runs[0][4]
    if nbytes / max(n, 1) >= 32 << 10:
        plain(parallel)
        runs += [("plain", parallel, *plain(parallel)) for _ in range(repeat)]
    for mode, par, secs, count, _ in runs:
        if count != n:
            sys.exit(f"{mode} read {count} records, expected {n}")
        if best is None or secs < best[2]:
            best = (mode, par, secs)
print(json.dumps({"seconds": best[2], "records": n, "bytes": nbytes, "parallel": best[1], "mode": best[0]}))
"""


def shard_files(path: str) -> list[str]:
    from crossfeed.read.sources.dataset import open_dataset

    with open_dataset(path) as ds:
        return [os.path.join(ds.path, s.file) for name in sorted(ds.splits) for s in ds.splits[name].shards]


def read_crossfeed(files: list[str]) -> tuple[float, int, int]:
    """One pass: ``(seconds, records, payload_bytes)``."""
    n = nbytes = 0
    t = time.perf_counter()
    for path in files:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            if hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_SEQUENTIAL)
            for _, payload in tfrecord.records(mm, path):
                n += 1
                nbytes += len(payload)
            del payload
        finally:
            try:
                mm.close()
            except BufferError:
                pass
    return time.perf_counter() - t, n, nbytes


def read_tf(files: list[str], repeat: int) -> tuple[float, int, int, bool]:
    proc = subprocess.run(
        [sys.executable, "-c", _TF_READER, json.dumps(files), str(repeat)],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    if proc.returncode != 0:
        raise SystemExit(f"tf.data reader failed:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return r["seconds"], r["records"], r["bytes"], (r["mode"], r["parallel"])


def warm(files: list[str]) -> None:
    for path in files:
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="raw,tabular,jpeg")
    ap.add_argument("--quick", action="store_true", help="small workloads (see benchmarks/workloads.py)")
    ap.add_argument("--repeat", type=int, default=3, help="timed passes per reader; the best counts")
    a = ap.parse_args(argv)
    rows = []
    for name in a.workloads.split(","):
        files = shard_files(workloads.ensure(name, quick=a.quick))
        warm(files)
        read_crossfeed(files)  # warm-up
        cf_secs, cf_n, cf_bytes = min(read_crossfeed(files) for _ in range(a.repeat))
        tf_secs, tf_n, tf_bytes, parallel = read_tf(files, a.repeat)
        if (cf_n, cf_bytes) != (tf_n, tf_bytes):
            raise SystemExit(f"{name}: crossfeed read {cf_n} records / {cf_bytes} bytes, tf.data {tf_n} / {tf_bytes}")
        rows.append(
            (
                name,
                cf_n,
                cf_bytes / cf_n,
                cf_n / cf_secs,
                cf_bytes / cf_secs,
                tf_n / tf_secs,
                tf_bytes / tf_secs,
                parallel,
            )
        )
    print(
        f"{'workload':<9} {'records':>8} {'rec size':>9} | {'crossfeed rec/s':>15} {'MB/s':>7} | "
        f"{'tf.data rec/s':>13} {'MB/s':>7} | {'ratio':>6} {'goal':>5}"
    )
    for name, n, size, cf_r, cf_b, tf_r, tf_b, parallel in rows:
        ratio = cf_r / tf_r
        mark = "ok" if ratio >= GOALS[name] else "MISS"
        tf_note = "*" if parallel[1] else " "
        print(
            f"{name:<9} {n:>8} {size / 1e3:>7.1f}KB | {cf_r:>15,.0f} {cf_b / 1e6:>7,.0f} | "
            f"{tf_r:>12,.0f}{tf_note} {tf_b / 1e6:>7,.0f} | {ratio:>5.2f}x {GOALS[name]:>4.1f}x {mark}"
        )
    print(
        "both check every CRC; best of",
        a.repeat,
        "passes on a warm page cache; * = tf.data faster with num_parallel_reads=AUTOTUNE",
    )


if __name__ == "__main__":
    main()
