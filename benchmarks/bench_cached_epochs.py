"""A cached remote epoch against the same Loader on the local copy: one run, the same data.

The dataset is written once locally and served over HTTP (Range support, from a thread) on
127.0.0.1; the remote Loader reads it through a shard cache (``cache_dir``). Its first epoch
downloads; every epoch after is a *cached epoch*, which should run at local speed (the cached
shards are read exactly as local ones: the same mappings, the same fast paths). For each record
size, shuffle and batch size, the local and the remote Loader run one warm-up epoch each, then
``--epochs`` epochs alternating, and the best epoch of each is printed with the ratio
cached / local and whether both took the same fast paths (`Loader.paths`) in their timed epochs.

Records: small = 32×32×3 uint8 images + an int64 label (3 KiB framed: the rows form, a split
held whole); large = 224×224×3 (147 KiB: views, CRC checked at the copy).

    .venv/bin/python benchmarks/bench_cached_epochs.py [--small 50000] [--large 2048]
        [--batches 32,64,256,1024] [--shuffles global,block] [--epochs 5]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from http_helpers import RangeFiles  # noqa: E402  (static files with Range support)

SHARDS = 8
SIDES = {"small": 32, "large": 224}


def make_data(root: str, side: int, n: int) -> None:
    import crossfeed

    if os.path.exists(os.path.join(root, "crossfeed.json")):
        return
    base = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    samples = ({"image": np.roll(base, i, axis=0), "label": i % 1000} for i in range(n))
    crossfeed.write_dataset(root, samples, num_shards=SHARDS).close()


def serve(root: str):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeFiles, directory=root))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _epoch(loader) -> tuple[float, int]:
    t, n = time.perf_counter(), 0
    for b in loader:
        n += len(b["label"])
    return time.perf_counter() - t, n


def _paths(loader) -> dict:
    return {stage: sorted(p for p in got) for stage, got in loader.paths().items()}


def compare(root: str, url: str, cache: str, *, batch: int, shuffle: str, epochs: int) -> dict:
    import crossfeed

    kw = dict(batch_size=batch, shuffle=shuffle, seed=0)
    with crossfeed.Loader(root, **kw) as local, crossfeed.Loader(url, cache_dir=cache, **kw) as remote:
        _epoch(remote)  # downloads (or opens the cache)
        _epoch(local)
        _epoch(remote)  # warm: every shard mapped, the split held whole
        p_local, p_remote = local.paths(), remote.paths()
        best = {"local": float("inf"), "cached": float("inf")}
        n = 0
        for _ in range(epochs):
            for who, loader in (("local", local), ("cached", remote)):
                dt, n = _epoch(loader)
                best[who] = min(best[who], dt)
        timed = {
            who: {p: c - before["frames"].get(p, 0) for p, c in ld.paths()["frames"].items()}
            for who, ld, before in (("local", local, p_local), ("cached", remote, p_remote))
        }
        timed = {who: {p: c for p, c in got.items() if c} for who, got in timed.items()}
    return {
        "local": n / best["local"],
        "cached": n / best["cached"],
        "same_paths": timed["local"] == timed["cached"],
        "paths": timed["cached"],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", type=int, default=50000, help="samples of 32×32×3 (0: skip)")
    ap.add_argument("--large", type=int, default=2048, help="samples of 224×224×3 (0: skip)")
    ap.add_argument("--batches", default="32,64,256,1024")
    ap.add_argument("--shuffles", default="global,block")
    ap.add_argument("--epochs", type=int, default=5, help="timed epochs per Loader (best is printed)")
    ap.add_argument("--dir", default=None, help="where to write the data (default: a temporary directory)")
    a = ap.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    shuffles = a.shuffles.split(",")
    with tempfile.TemporaryDirectory(prefix="cf-cached-") as tmp:
        where = a.dir or tmp
        print(f"{'records':8s} {'shuffle':8s} {'batch':>6s} {'local/s':>10s} {'cached/s':>10s} {'ratio':>6s}  paths")
        for size, n in (("small", a.small), ("large", a.large)):
            if not n:
                continue
            root = os.path.join(where, f"{size}-{n}")
            make_data(root, SIDES[size], n)
            server, url = serve(root)
            try:
                for shuffle in shuffles:
                    for batch in batches:
                        if batch > n:
                            continue
                        r = compare(
                            root, url, os.path.join(tmp, f"cache-{size}"), batch=batch, shuffle=shuffle, epochs=a.epochs
                        )
                        same = "same" if r["same_paths"] else "DIFFERENT"
                        print(
                            f"{size:8s} {shuffle:8s} {batch:6d} {r['local']:10.0f} {r['cached']:10.0f} "
                            f"{r['cached'] / r['local']:6.2f}  {same} {r['paths']}",
                            flush=True,
                        )
            finally:
                server.shutdown()
                server.server_close()


if __name__ == "__main__":
    main()
