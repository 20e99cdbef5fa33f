"""Conversion rate: crossfeed's Beam job on the in-process runner and on DaskRunner, against a
plain single-process Python loop writing the same kind of shards (the practical limit), one run.

Workloads, generated in a temporary directory:

* tabular: ``--rows`` rows of 5 columns (int64 id, two floats, a string, an int64 label) in 4 CSV
  files, converted with a 90/10 train/validation split into 8 shards per split;
* jpeg: ``--images`` JPEG/PNG files (``--image-size`` pixels square) in a 4-class image folder
  (`sample_data`), 4 shards.

Ways, on the same data: ``loop`` reads with the same source and writes with
``crossfeed.write_dataset`` (no shuffle, one split: less work than the job); ``direct`` is
``crossfeed.beam_jobs.job.convert`` on the default runner; ``dask`` the same on DaskRunner with a
``LocalCluster`` of ``--workers`` processes (cluster start-up not timed). Prints samples/s and
the ratios direct/loop and dask/direct.

    .venv/bin/python benchmarks/bench_convert.py                       # 200k rows, 3000 images
    .venv/bin/python benchmarks/bench_convert.py --rows 20000 --images 300 --no-dask   # quick

Sizes also come from ``CROSSFEED_BENCH_ROWS``, ``CROSSFEED_BENCH_IMAGES`` and ``CROSSFEED_BENCH_IMAGE_SIZE``.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import shutil
import tempfile
import time

import numpy as np


def make_csv(folder: str, rows: int, files: int = 4, seed: int = 0) -> None:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    per = -(-rows // files)
    for f in range(files):
        n = min(per, rows - f * per)
        ids = np.arange(f * per, f * per + n)
        a, b = rng.normal(size=n), rng.uniform(size=n)
        labels = rng.integers(0, 10, n)
        with open(os.path.join(folder, f"part-{f:02d}.csv"), "w", newline="") as out:
            w = csv.writer(out)
            w.writerow(["id", "a", "b", "name", "label"])
            w.writerows(
                zip(
                    ids.tolist(),
                    np.round(a, 6).tolist(),
                    np.round(b, 6).tolist(),
                    [f"item{i}" for i in ids.tolist()],
                    labels.tolist(),
                )
            )


def plain_loop(source, out: str, shards: int) -> int:
    from crossfeed import write_dataset

    def samples():
        for unit in source.units():
            for batch in source.read(unit):
                names = list(batch.columns)
                cols = [batch.columns[n] for n in names]
                for i in range(len(batch)):
                    yield {n: c[i] for n, c in zip(names, cols)}

    ds = write_dataset(out, samples(), split="train", num_shards=shards, schema=source.schema)
    return len(ds["train"])


def timed(fn) -> tuple[int, float]:
    start = time.perf_counter()
    n = fn()
    return n, time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=int(os.environ.get("CROSSFEED_BENCH_ROWS", 200_000)))
    parser.add_argument("--images", type=int, default=int(os.environ.get("CROSSFEED_BENCH_IMAGES", 3000)))
    parser.add_argument("--image-size", type=int, default=int(os.environ.get("CROSSFEED_BENCH_IMAGE_SIZE", 128)))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-dask", action="store_true")
    parser.add_argument("--workloads", default="tabular,jpeg")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    for name in ("distributed", "apache_beam"):
        logging.getLogger(name).setLevel(logging.ERROR)

    from crossfeed.beam_jobs.job import convert, make_source
    from crossfeed.beam_jobs.sample_data import make_image_folder

    tmp = tempfile.mkdtemp(prefix="crossfeed-bench-convert-")
    cluster = None
    try:
        workloads = {}
        if "tabular" in args.workloads:
            make_csv(os.path.join(tmp, "csv"), args.rows)
            workloads["tabular"] = (
                make_source("csv", os.path.join(tmp, "csv"), label="label"),
                dict(splits="train=0.9,validation=0.1", num_shards=8),
                8,
            )
        if "jpeg" in args.workloads:
            make_image_folder(
                os.path.join(tmp, "img"), n_per_class=max(1, args.images // 4), classes=4, size=args.image_size
            )
            workloads["jpeg"] = (make_source("images", os.path.join(tmp, "img")), dict(num_shards=4), 4)
        if not args.no_dask:
            from distributed import LocalCluster

            cluster = LocalCluster(
                n_workers=args.workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                silence_logs=logging.ERROR,
            )
            logging.getLogger("distributed").setLevel(logging.ERROR)
        print(f"{'workload':10s} {'way':8s} {'samples':>9s} {'seconds':>8s} {'samples/s':>11s}")
        for name, (source, options, shards) in workloads.items():
            rates = {}
            runs = {
                "loop": lambda: plain_loop(source, os.path.join(tmp, f"{name}-loop"), shards),
                "direct": lambda: convert(source, os.path.join(tmp, f"{name}-direct"), **options).total_samples,
            }
            if cluster is not None:
                runs["dask"] = lambda: (
                    convert(
                        source,
                        os.path.join(tmp, f"{name}-dask"),
                        runner="DaskRunner",
                        beam_args=[f"--dask_client_address={cluster.scheduler_address}"],
                        **options,
                    ).total_samples
                )
            for way, fn in runs.items():
                n, s = timed(fn)
                rates[way] = n / s
                print(f"{name:10s} {way:8s} {n:9d} {s:8.2f} {n / s:11,.0f}", flush=True)
            line = f"{name:10s} direct/loop = {rates['direct'] / rates['loop']:.2f}x"
            if "dask" in rates:
                line += f"   dask/direct = {rates['dask'] / rates['direct']:.2f}x"
            print(line, flush=True)
    finally:
        if cluster is not None:
            cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
