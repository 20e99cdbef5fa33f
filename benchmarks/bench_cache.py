"""Remote datasets at local speed: crossfeed's shard cache vs local disk vs webdataset's cache,
one run, the same samples served by one local HTTP server that injects latency per request.

The samples are raw 224×224×3 uint8 images + int64 labels, written once as a crossfeed dataset
and as webdataset tar shards, served over HTTP from ``127.0.0.1`` with ``--latency`` seconds per
request (an object store's time to first byte). Printed per reader: epoch 1 (cold cache) and
epoch 2 samples/s, epoch 1 as a share of the link's bandwidth (measured first: every shard
downloaded by plain GETs, 4 at a time), epoch 2 as a share of crossfeed on local disk, and peak
RSS. Each reader runs in a process of its own with an empty cache.

mosaic streaming (``mosaicml-streaming``) is run too when it can be imported; install it in a
benchmark environment with ``pip install --no-deps mosaicml-streaming`` plus the modules it
imports, not in the project's own environment (its dependencies pull a CUDA torch).

    .venv/bin/python benchmarks/bench_cache.py [--samples 2000] [--latency 0.02]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SIDE = 224
SHARDS = 8


class _Handler(http.server.SimpleHTTPRequestHandler):
    latency = 0.02

    def log_message(self, *a):
        pass

    def end_headers(self):
        self.send_header("Accept-Ranges", "bytes")
        super().end_headers()

    def do_GET(self):
        time.sleep(self.latency)
        rng = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not rng or not os.path.isfile(path):
            return super().do_GET()
        size = os.path.getsize(path)
        a, b = rng.split("=")[1].split("-")
        start, stop = int(a), min(size, int(b) + 1 if b else size)
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(stop - start)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def make_data(root: str, n: int) -> None:
    import crossfeed

    if os.path.exists(os.path.join(root, "cf", "crossfeed.json")):
        return
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    samples = [{"image": np.roll(base, i, axis=0), "label": i % 1000} for i in range(n)]
    crossfeed.write_dataset(os.path.join(root, "cf"), samples, num_shards=SHARDS).close()
    os.makedirs(os.path.join(root, "wds"), exist_ok=True)
    tars = [tarfile.open(os.path.join(root, "wds", f"shard-{s:05d}.tar"), "w") for s in range(SHARDS)]
    for i, s in enumerate(samples):
        for ext, blob in (("npy", _npy(s["image"])), ("cls", str(s["label"]).encode())):
            info = tarfile.TarInfo(f"{i:08d}.{ext}")
            info.size = len(blob)
            tars[i % SHARDS].addfile(info, io.BytesIO(blob))
    for t in tars:
        t.close()


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def link_bandwidth(base: str, files: list[str]) -> float:
    def get(f):
        with urllib.request.urlopen(f"{base}/{f}") as r:
            return len(r.read())

    t = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        total = sum(pool.map(get, files))
    return total / (time.perf_counter() - t)


def _epochs(make_iter, epochs: int = 2) -> list[float]:
    rates = []
    for _ in range(epochs):
        t, n = time.perf_counter(), 0
        for count in make_iter():
            n += count
        rates.append(n / (time.perf_counter() - t))
    return rates


def run_crossfeed(url: str, shuffle: str, cache: str | None) -> list[float]:
    import crossfeed

    with crossfeed.Loader(url, batch_size=64, shuffle=shuffle, seed=0, cache_dir=cache) as ld:
        return _epochs(lambda: (len(b["label"]) for b in ld))


def run_wds(url: str, cache: str) -> list[float]:
    import webdataset as wds

    urls = f"{url}/shard-{{00000..{SHARDS - 1:05d}}}.tar"
    ds = wds.WebDataset(urls, cache_dir=cache, shardshuffle=False).decode().to_tuple("npy", "cls").batched(64)
    return _epochs(lambda: (len(b[1]) for b in ds))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--latency", type=float, default=0.02)
    ap.add_argument("--data", default=os.path.join(HERE, "_data", "cache"))
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    root = os.path.join(a.data, str(a.samples))
    if a.child:
        who, url, shuffle = a.child
        cache = tempfile.mkdtemp(prefix="cf-bench-cache-")
        try:
            if who == "crossfeed":
                rates = run_crossfeed(url, shuffle, cache)
            elif who == "local":
                rates = run_crossfeed(url, shuffle, None)
            else:
                rates = run_wds(url, cache)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        print(json.dumps({"rates": rates, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
        return
    make_data(root, a.samples)
    handler = type("H", (_Handler,), {"latency": a.latency})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=root))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        shard_files = [f"cf/{f}" for f in sorted(os.listdir(os.path.join(root, "cf"))) if f.endswith(".tfrecord")]
        bw = link_bandwidth(base, shard_files)
        nbytes = sum(os.path.getsize(os.path.join(root, f)) for f in shard_files) / a.samples
        runs = {}
        for who, url, shuffle in (
            ("local", os.path.join(root, "cf"), "global"),
            ("crossfeed", f"{base}/cf", "global"),
            ("crossfeed", f"{base}/cf", "block"),
            ("wds", f"{base}/wds", "none"),
        ):
            out = subprocess.run(
                [sys.executable, __file__, "--samples", str(a.samples), "--data", a.data, "--child", who, url, shuffle],
                capture_output=True,
                text=True,
            )
            if out.returncode:
                print(f"{who} {shuffle} failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            runs[(who, shuffle)] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.shutdown()
    local = runs.get(("local", "global"), {"rates": [float("nan")] * 2})["rates"][1]
    print(
        f"{a.samples} raw {SIDE}×{SIDE}×3 samples ({nbytes / 1e3:.0f} KB each) over HTTP, {a.latency * 1e3:.0f} ms per "
        f"request; link {bw / 1e6:,.0f} MB/s = {bw / nbytes:,.0f} samples/s"
    )
    print(f"{'reader':28} {'epoch 1/s':>10} {'of link':>8} {'epoch 2/s':>10} {'of local':>9} {'peak RSS':>9}")
    for (who, shuffle), r in runs.items():
        e1, e2 = r["rates"]
        name = {
            "local": "crossfeed, local disk",
            "crossfeed": f"crossfeed cache, {shuffle}",
            "wds": "webdataset cache_dir",
        }[who]
        print(f"{name:28} {e1:10,.0f} {e1 * nbytes / bw:8.2f} {e2:10,.0f} {e2 / local:9.2f} {r['rss'] / 2**20:7.0f} MB")
    try:
        import streaming  # noqa: F401
    except ImportError:
        print("mosaic streaming: not installed here (see the module docstring)")


if __name__ == "__main__":
    main()
