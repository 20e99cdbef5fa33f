"""TensorFlow adapter throughput: the native engine, the plan engine and a hand-written tf.data
pipeline, on the same TFRecord shards, in one run.

The hand-written pipeline is what a TF user writes from the docs: shuffled file list, parallel
interleave of TFRecordDataset, a seeded shuffle buffer, then (fixed records) batch →
``parse_example`` → ``decode_raw`` or (images) ``parse_single_example`` → ``decode_jpeg`` →
batch, AUTOTUNE maps and prefetch. It does the same work as the native engine: the claim is that
the native engine costs nothing over writing tf.data by hand (goal: within 10%). The plan
engine (the crossfeed Loader's exact global shuffle through ``from_generator``, the order the
PyTorch adapter also has) is printed beside them.

Printed per reader: the best epoch's samples/s (wall clock) and its ratio to the hand-written
pipeline, and the process CPU time per sample (robust on a shared, busy machine, where wall
clock is not). Each reader: one untimed warm-up epoch, then ``--epochs`` timed epochs, the readers alternating
epoch by epoch (hand, native, plan, hand, …); the best epoch of each is kept. Every epoch checks its sample
count and the sum of its labels.

    .venv/bin/python benchmarks/bench_tf.py            # ~2 minutes on 2 cores (data cached after)
    .venv/bin/python benchmarks/bench_tf.py --workloads raw --raw 65536 --epochs 3 --json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time

import numpy as np

WORKLOADS = {  # name: (samples, batch size)
    "raw": (32768, 256),  # uint8 (32, 32, 3) raw tensor + label
    "jpeg": (4096, 128),  # 64x64 JPEG + label, decoded in graph
    "tabular": (262144, 2048),  # float32 (16,) + label
}
SHARDS = 8
SHUFFLE_BUFFER = 4096


def _sample(kind: str, i: int, rng) -> dict:
    if kind == "raw":
        return {"image": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8), "label": i % 10}
    if kind == "jpeg":
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
        return {"image": buf.getvalue(), "label": i % 10}
    return {"x": rng.standard_normal(16).astype(np.float32).tolist(), "label": i % 10}  # a float_list


def prepare(kind: str, n: int, cache: str) -> str:
    """The dataset for a workload, generated once into ``cache``."""
    import crossfeed
    from crossfeed.format.schema import Encoding, Feature, Schema

    root = os.path.join(cache, f"tf-{kind}-{n}")
    if os.path.exists(os.path.join(root, "crossfeed.json")):
        return root
    schema = None
    if kind == "jpeg":
        schema = Schema(
            [Feature("image", "uint8", (64, 64, 3), Encoding.IMAGE), Feature("label", "int64", (), Encoding.INT64)]
        )
    rng = np.random.default_rng(0)
    crossfeed.write_dataset(root, (_sample(kind, i, rng) for i in range(n)), num_shards=SHARDS, schema=schema).close()
    return root


def hand_written(kind: str, root: str, batch_size: int, seed: int):
    """The tf.data pipeline a user writes by hand for these shards."""
    import tensorflow as tf

    files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tfrecord"))
    ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=seed)
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=len(files), num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.shuffle(SHUFFLE_BUFFER, seed=seed)
    if kind == "jpeg":
        spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

        def one(rec):
            p = tf.io.parse_single_example(rec, spec)
            image = tf.ensure_shape(tf.io.decode_jpeg(p["image"], channels=3), [64, 64, 3])
            return {"image": image, "label": p["label"]}

        ds = ds.map(one, num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size, drop_remainder=True)
    elif kind == "raw":
        spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

        def batch(recs):
            p = tf.io.parse_example(recs, spec)
            return {"image": tf.reshape(tf.io.decode_raw(p["image"], tf.uint8), [-1, 32, 32, 3]), "label": p["label"]}

        ds = ds.batch(batch_size, drop_remainder=True).map(batch, num_parallel_calls=tf.data.AUTOTUNE)
    else:
        spec = {"x": tf.io.FixedLenFeature([16], tf.float32), "label": tf.io.FixedLenFeature([], tf.int64)}
        ds = ds.batch(batch_size, drop_remainder=True).map(
            lambda r: tf.io.parse_example(r, spec), num_parallel_calls=tf.data.AUTOTUNE
        )
    return ds.prefetch(tf.data.AUTOTUNE)


def readers(kind: str, root: str, batch_size: int, seed: int = 0) -> dict:
    import crossfeed.adapters.tf as cftf

    return {
        "tf.data (hand-written)": hand_written(kind, root, batch_size, seed),
        "crossfeed native": cftf.dataset(
            root, batch_size=batch_size, seed=seed, engine="native", shuffle_buffer=SHUFFLE_BUFFER
        ),
        "crossfeed plan": cftf.dataset(root, batch_size=batch_size, seed=seed, engine="plan"),
    }


def epoch(ds) -> tuple[float, float, int, int]:
    """``(wall seconds, process CPU seconds, samples, label sum)`` of one full pass."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = s = 0
    for b in ds:
        labels = b["label"]._numpy()
        n += len(labels)
        s += int(labels.sum())
    return time.perf_counter() - t0, time.process_time() - c0, n, s


def run(kind: str, n: int, batch_size: int, *, epochs: int, cache: str) -> dict:
    root = prepare(kind, n, cache)
    rs = readers(kind, root, batch_size)
    expect_n = n // batch_size * batch_size
    expect_sum = sum(i % 10 for i in range(n))  # drop_last: the sum of the samples kept
    best = {name: float("inf") for name in rs}
    cpu = {name: float("inf") for name in rs}
    for ds in rs.values():
        epoch(ds)  # warm-up: tracing, thread pools, page cache
    for _ in range(epochs):  # readers alternate epoch by epoch, so a busy moment hits them alike
        for name, ds in rs.items():
            sec, cpu_sec, got, total = epoch(ds)
            if got != expect_n or (got == n and total != expect_sum):
                raise RuntimeError(
                    f"{name} delivered {got} samples (label sum {total}) in an epoch, expected {expect_n}"
                )
            best[name], cpu[name] = min(best[name], sec), min(cpu[name], cpu_sec)
    rates = {name: expect_n / sec for name, sec in best.items()}
    hand = rates["tf.data (hand-written)"]
    return {
        "workload": kind,
        "samples": n,
        "batch_size": batch_size,
        "samples_per_s": rates,
        "cpu_us_per_sample": {name: 1e6 * c / expect_n for name, c in cpu.items()},
        "native_vs_hand": rates["crossfeed native"] / hand,
        "plan_vs_hand": rates["crossfeed plan"] / hand,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    for k, (n, _) in WORKLOADS.items():
        ap.add_argument(f"--{k}", type=int, default=n, help=f"samples of the {k} workload")
    ap.add_argument("--epochs", type=int, default=5, help="timed epochs per reader (best kept)")
    ap.add_argument(
        "--cache", default=os.environ.get("CROSSFEED_BENCH_DIR", os.path.join(tempfile.gettempdir(), "crossfeed-bench"))
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line per workload instead of a table")
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    print(f"{'workload':9} {'reader':24} {'samples/s':>12} {'vs tf.data':>10} {'CPU us/sample':>14}")
    for kind in args.workloads.split(","):
        res = run(kind, getattr(args, kind), WORKLOADS[kind][1], epochs=args.epochs, cache=args.cache)
        if args.json:
            print(json.dumps(res))
            continue
        hand = res["samples_per_s"]["tf.data (hand-written)"]
        for name, rate in res["samples_per_s"].items():
            print(f"{kind:9} {name:24} {rate:12,.0f} {rate / hand:9.2f}x {res['cpu_us_per_sample'][name]:14.2f}")
        verdict = "yes" if res["native_vs_hand"] >= 0.9 else "NO (compare CPU us/sample on a busy machine)"
        print(f"{kind:9} native engine within 10% of hand-written tf.data: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
