"""The JAX adapter's overhead: ``crossfeed.Loader`` alone vs `crossfeed.adapters.jax.JaxLoader`
on the same data and options, on CPU devices (1 and 4 forced with XLA_FLAGS, each count in a
process of its own, since JAX reads the flag once).

* data: raw 64×64×3 uint8 images + an int64 label, and rows of 32 float32 + a label, written
  once to a temporary directory; batch 256, exact global shuffle, seed 0.
* Loader alone: its numpy batches, touched (one element read). JaxLoader: global ``jax.Array``
  batches assembled with ``make_array_from_process_local_data`` over a batch-sharded
  ``NamedSharding`` of every device, prefetched to the devices by its thread
  (``device_prefetch=2``), each waited for (``block_until_ready``) as a step would.
* One warm-up epoch each (its sample count checked), then ``--epochs`` timed epochs, best kept.
  The overhead is JaxLoader's time per batch over the Loader's, minus one (goal: at most 10%).

    .venv/bin/python -m benchmarks.bench_jax_adapter            # about a minute on 2 cores
    .venv/bin/python -m benchmarks.bench_jax_adapter --images 2048 --rows 65536 --epochs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

BATCH = 256


def _write(root: str, images: int, rows: int) -> dict[str, str]:
    import crossfeed

    rng = np.random.default_rng(0)
    paths = {"images": os.path.join(root, "images"), "rows": os.path.join(root, "rows")}
    crossfeed.write_dataset(
        paths["images"],
        ({"image": rng.integers(0, 255, (64, 64, 3), dtype=np.uint8), "label": i} for i in range(images)),
        num_shards=4,
    ).close()
    crossfeed.write_dataset(
        paths["rows"],
        ({"x": rng.normal(size=32).astype(np.float32), "label": i} for i in range(rows)),
        num_shards=4,
    ).close()
    return paths


def _epoch_loader(loader) -> tuple[float, int]:
    t, n = time.perf_counter(), 0
    for batch in loader:
        n += len(batch["label"])
        batch["label"][-1]  # touched
    return time.perf_counter() - t, n


def _epoch_jax(data) -> tuple[float, int]:
    t, n = time.perf_counter(), 0
    for batch in data:
        for v in batch.values():
            v.block_until_ready()
        n += batch["label"].shape[0]
    return time.perf_counter() - t, n


def _measure(paths: dict[str, str], epochs: int) -> dict:
    """In this process (XLA_FLAGS already set): batches/s of each reader, per dataset."""
    import jax

    import crossfeed
    from crossfeed.adapters.jax import JaxLoader

    out = {"devices": jax.device_count()}
    for name, path in paths.items():
        kw = dict(batch_size=BATCH, shuffle="global", seed=0, drop_last=True)
        with crossfeed.Loader(path, **kw) as loader, JaxLoader(path, **kw) as data:
            expect = len(loader) * BATCH
            times = {}
            for who, run, it in (("loader", _epoch_loader, loader), ("jax", _epoch_jax, data)):
                secs, n = run(it)  # warm-up (and jit-free: the adapter compiles nothing)
                assert n == expect, f"{who} read {n} samples of {expect}"
                times[who] = min(run(it)[0] for _ in range(epochs))
            batches = len(loader)
        out[name] = {
            "batches": batches,
            "loader_bps": batches / times["loader"],
            "jax_bps": batches / times["jax"],
            "overhead": times["jax"] / times["loader"] - 1,
        }
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--rows", type=int, default=131072)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--devices", default="1,4", help="CPU device counts to force, comma-separated")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # internal: measure these paths in this process
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(_measure(json.loads(args.measure), args.epochs)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-jax-") as root:
        paths = _write(root, args.images, args.rows)
        print(f"batch {BATCH}, global shuffle; images: {args.images} × 64×64×3 uint8, rows: {args.rows} × 32 float32")
        print(f"{'devices':>7} {'data':>7} {'batches':>8} {'Loader b/s':>11} {'JaxLoader b/s':>14} {'overhead':>9}")
        for n in (int(d) for d in args.devices.split(",")):
            env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu")
            cmd = [sys.executable, "-m", "benchmarks.bench_jax_adapter", "--epochs", str(args.epochs)]
            proc = subprocess.run(
                [*cmd, "--measure", json.dumps(paths)], env=env, capture_output=True, text=True, timeout=600
            )
            if proc.returncode != 0:
                sys.exit(f"the {n}-device run failed:\n{proc.stderr[-3000:]}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            for name in paths:
                r = res[name]
                print(
                    f"{res['devices']:>7} {name:>7} {r['batches']:>8} {r['loader_bps']:>11.1f} "
                    f"{r['jax_bps']:>14.1f} {r['overhead']:>+9.1%}"
                )


if __name__ == "__main__":
    main()
