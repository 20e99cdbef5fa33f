"""The JAX adapter's overhead: ``crossfeed.Loader`` alone vs `crossfeed.adapters.jax.JaxLoader`
on the same data and options, on CPU devices (1 and 4 forced with XLA_FLAGS, each count in a
process of its own, since JAX reads the flag once).

* data: raw 64×64×3 uint8 images + an int64 label, and rows of 32 float32 + a label, written
  once to a temporary directory; batch 256, exact global shuffle, seed 0.
* Loader alone: its numpy batches, touched (one element read). JaxLoader: global ``jax.Array``
  batches over a batch-sharded ``NamedSharding`` of every device, each waited for
  (``block_until_ready``) as a step would: as it comes (on CPU devices: no device-prefetch
  thread), with the thread (``device_prefetch=2``), and, for comparison, as it was first written
  (the thread, and ``jax.device_put`` of the Loader's unaligned arrays: a copy, and device_put's
  Python layers).
* One warm-up epoch each (its sample count checked), then ``--epochs`` rounds, the readers taking
  turns within a round (the load of a shared machine falls on all of them alike); the best
  epoch of each is kept, wall time and CPU time (``time.process_time``: every thread of the
  process, the Loader's and JAX's included). The overhead is JaxLoader's time per batch over
  the Loader's, minus one (goal: at most 10%).

    .venv/bin/python -m benchmarks.bench_jax_adapter            # about a minute on 2 cores
    .venv/bin/python -m benchmarks.bench_jax_adapter --images 4096 --rows 65536 --epochs 3
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


def _epoch_loader(loader) -> int:
    n = 0
    for batch in loader:
        n += len(batch["label"])
        batch["label"][-1]  # touched
    return n


def _epoch_jax(data) -> int:
    n = 0
    for batch in data:
        for v in batch.values():
            v.block_until_ready()
        n += batch["label"].shape[0]
    return n


READERS = ("loader", "jax", "jax_pf2", "jax_before")


def _readers(path: str) -> dict:
    """Each reader of the comparison, over ``path``: ``name -> (epoch function, object)``."""
    import dataclasses

    import crossfeed
    from crossfeed.adapters.jax import JaxLoader

    kw = dict(batch_size=BATCH, shuffle="global", seed=0, drop_last=True)
    before = JaxLoader(path, device_prefetch=2, **kw)
    # as before: the Loader's own (unaligned) arrays, copied by jax.device_put
    before.loader.pipeline.set_allocator(None)
    before._assemble = dataclasses.replace(before._assemble, fast=False, alloc=None)
    return {
        "loader": (_epoch_loader, crossfeed.Loader(path, **kw)),
        "jax": (_epoch_jax, JaxLoader(path, **kw)),
        "jax_pf2": (_epoch_jax, JaxLoader(path, device_prefetch=2, **kw)),
        "jax_before": (_epoch_jax, before),
    }


def _measure(paths: dict[str, str], epochs: int) -> dict:
    """In this process (XLA_FLAGS already set): seconds per batch of each reader, wall and CPU."""
    import jax

    out = {"devices": jax.device_count()}
    for name, path in paths.items():
        readers = _readers(path)
        batches = len(readers["loader"][1])
        for who, (run, it) in readers.items():  # warm-up (the adapter compiles nothing)
            n = run(it)
            assert n == batches * BATCH, f"{who} read {n} samples of {batches * BATCH}"
        best = {who: [float("inf"), float("inf")] for who in readers}
        for _ in range(epochs):
            for who, (run, it) in readers.items():
                wall, cpu = time.perf_counter(), time.process_time()
                run(it)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                best[who] = [min(best[who][0], wall / batches), min(best[who][1], cpu / batches)]
        for _, it in readers.values():
            it.close()
        out[name] = {"batches": batches, **best}
    out["load"] = os.getloadavg()[0]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=8192)
    p.add_argument("--rows", type=int, default=131072)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--devices", default="1,4", help="CPU device counts to force, comma-separated")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # internal: measure these paths in this process
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(_measure(json.loads(args.measure), args.epochs)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-jax-") as root:
        paths = _write(root, args.images, args.rows)
        print(f"batch {BATCH}, global shuffle; images: {args.images} × 64×64×3 uint8, rows: {args.rows} × 32 float32")
        print(f"{os.cpu_count()} CPU core(s); load average before: {os.getloadavg()[0]:.1f}")
        print("ms per batch (best epoch of each), wall / CPU; overhead over the Loader alone, wall / CPU")
        head = f"{'devices':>7} {'data':>6} {'Loader':>13}"
        for who in READERS[1:]:
            head += f" {who:>13} {'overhead':>15}"
        print(head)
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
                lw, lc = r["loader"]
                line = f"{res['devices']:>7} {name:>6} {lw * 1e3:>6.2f}/{lc * 1e3:<6.2f}"
                for who in READERS[1:]:
                    w, c = r[who]
                    line += f" {w * 1e3:>6.2f}/{c * 1e3:<6.2f} {w / lw - 1:>+7.0%}/{c / lc - 1:<+7.0%}"
                print(line)
            print(f"        (load average after the {n}-device run: {res['load']:.1f})")


if __name__ == "__main__":
    main()
