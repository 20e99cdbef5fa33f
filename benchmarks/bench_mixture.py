"""Weighted mixtures: crossfeed vs tf.data ``sample_from_datasets``, one run, same shards.

Three tabular sources (sizes 4:2:1, weights 5:3:2) written by crossfeed; each reader delivers
``--batches`` batches of ``--batch`` decoded samples. Printed per reader: samples/s, and the
proportion error after those batches — the largest ``|count_i − w_i/Σw × delivered|`` over the
sources, in samples (crossfeed's schedule keeps it under one sample over every prefix; tf.data
draws each element at random). Also crossfeed's mixing overhead: the same Loader settings on the
largest source alone. Each reader runs in a process of its own.

    .venv/bin/python benchmarks/bench_mixture.py [--batches 1000] [--batch 256] [--shuffle global]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHTS = (5, 3, 2)
SIZES = (400_000, 200_000, 100_000)


def _paths(root: str) -> list[str]:
    sys.path.insert(0, os.path.dirname(HERE))
    from benchmarks.workloads import ensure

    return [ensure("tabular", n, root=root) for n in SIZES]


def run_crossfeed(paths, batches: int, batch: int, shuffle: str, single: bool) -> dict:
    import crossfeed

    src = paths[0] if single else [crossfeed.Source(p, weight=w) for p, w in zip(paths, WEIGHTS)]
    kw = {} if single else {"samples_per_epoch": batches * batch}
    with crossfeed.Loader(src, batch_size=batch, seed=0, shuffle=shuffle, return_index=True, **kw) as loader:
        it = iter(loader)
        next(it)
        t, n, counts = time.perf_counter(), 0, np.zeros(3, np.int64)
        for i, b in enumerate(it):
            n += len(b["label"])
            if not single:
                counts += np.bincount(b["__source__"], minlength=3)
            if i + 2 >= batches:
                break
        dt = time.perf_counter() - t
    return {"rate": n / dt, "counts": counts.tolist(), "n": n}


def run_tf(paths, batches: int, batch: int, shuffle: str) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import glob

    import tensorflow as tf

    spec = {"x": tf.io.FixedLenFeature([32], tf.float32), "label": tf.io.FixedLenFeature([], tf.int64)}
    parts = []
    for i, p in enumerate(paths):
        ds = tf.data.TFRecordDataset(
            sorted(glob.glob(os.path.join(p, "train-*.tfrecord"))), num_parallel_reads=tf.data.AUTOTUNE
        )
        if shuffle != "none":
            ds = ds.shuffle(16384, seed=i)
        parts.append(ds.repeat().map(lambda r, i=i: (r, tf.constant(i, tf.int64))))
    w = np.asarray(WEIGHTS, np.float64) / sum(WEIGHTS)
    mixed = tf.data.Dataset.sample_from_datasets(parts, weights=w.tolist(), seed=0)
    mixed = (
        mixed.batch(batch)
        .map(lambda r, s: (tf.io.parse_example(r, spec), s), num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(tf.data.AUTOTUNE)
    )
    it = iter(mixed.as_numpy_iterator())
    next(it)
    t, n, counts = time.perf_counter(), 0, np.zeros(3, np.int64)
    for _ in range(batches - 1):
        b, s = next(it)
        n += len(b["label"])
        counts += np.bincount(s, minlength=3)
    return {"rate": n / (time.perf_counter() - t), "counts": counts.tolist(), "n": n}


def _error(r: dict) -> float:
    w = np.asarray(WEIGHTS, np.float64) / sum(WEIGHTS)
    return float(np.abs(np.asarray(r["counts"]) - w * r["n"]).max())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--shuffle", default="global", choices=["global", "block", "none"])
    ap.add_argument("--data", default=os.path.join(HERE, "_data"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    paths = _paths(a.data)
    if a.child:
        r = (
            run_tf(paths, a.batches, a.batch, a.shuffle)
            if a.child == "tf"
            else run_crossfeed(paths, a.batches, a.batch, a.shuffle, single=a.child == "single")
        )
        print(json.dumps(r))
        return
    out = {}
    for who in ("crossfeed", "single", "tf"):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            who,
            "--batches",
            str(a.batches),
            "--batch",
            str(a.batch),
            "--shuffle",
            a.shuffle,
            "--data",
            a.data,
        ]
        out[who] = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        )
    print(f"3 tabular sources {SIZES}, weights {WEIGHTS}, batch {a.batch}, {a.batches} batches, shuffle {a.shuffle}")
    print(f"{'reader':34} {'samples/s':>12} {'proportion error (samples)':>28}")
    print(f"{'crossfeed mixture':34} {out['crossfeed']['rate']:12,.0f} {_error(out['crossfeed']):28.2f}")
    print(f"{'tf.data sample_from_datasets':34} {out['tf']['rate']:12,.0f} {_error(out['tf']):28.2f}")
    print(f"{'crossfeed, largest source alone':34} {out['single']['rate']:12,.0f}")
    print(
        f"crossfeed / tf.data: {out['crossfeed']['rate'] / out['tf']['rate']:.2f}×; mixing overhead vs one source: "
        f"{out['single']['rate'] / out['crossfeed']['rate'] - 1:+.0%}"
    )


if __name__ == "__main__":
    main()
