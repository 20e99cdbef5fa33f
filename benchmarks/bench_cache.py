"""Remote datasets at local speed: crossfeed's shard cache vs local disk vs mosaic streaming vs
webdataset's cache, one run, the same samples behind one slow link.

The samples are raw 224×224×3 uint8 images + int64 labels, written once as a crossfeed dataset,
as mosaic MDS shards and as webdataset tar shards. They are served by a local HTTP file server
and by moto's S3 server, each behind a `benchmarks.link.Link`: a TCP proxy that caps bandwidth
(``--bandwidth`` in all, ``--per-connection`` per stream, as object stores do) and adds
``--latency`` to every request. mosaic streaming reads only object stores (s3://, gs://, …, not
http://), so it goes through the S3 server; crossfeed is run on both. Printed per reader:
epoch 1 (cold cache) and epoch 2 (median of epochs 2–6) samples/s, epoch 1 as a share of the
link's bandwidth, epoch 2 as a share of crossfeed on local disk, and peak anonymous RSS (see
`PeakRSS`); then crossfeed / mosaic ratios. Each reader runs in a process of its own with an
empty cache. "… one GET per shard" is crossfeed with the previous download path (a shard in
one request), for comparison.

mosaic streaming (``mosaicml-streaming``) pulls a CUDA torch, torchvision and transformers as
dependencies: install it with ``--no-deps`` plus the modules it imports, in the benchmark
environment only (``make bench-env``; benchmarks/requirements-bench.txt). Its top-level package
imports torchvision (for its vision datasets); this benchmark imports only ``streaming.base``.

    .venv/bin/python benchmarks/bench_cache.py [--samples 1000] [--bandwidth 64MB]
        [--per-connection 8MB] [--latency 0.03]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import importlib.util
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import types
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from http_helpers import RangeFiles  # noqa: E402  (static files with Range support)

from benchmarks.link import Link  # noqa: E402

SIDE = 224
SHARDS = 8
BATCH = 64
BUCKET = "bench"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def streaming_base():
    """``streaming.base`` (MDSWriter, StreamingDataset) without the top-level package's vision and
    text modules (torchvision); None when mosaic streaming is not importable."""
    spec = importlib.util.find_spec("streaming")
    if spec is None:
        return None
    if "streaming" not in sys.modules:
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = pkg
    try:
        import streaming.base as base
    except ImportError:
        return None
    return base


def make_data(root: str, n: int) -> None:
    import crossfeed

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)

    def samples():
        return ({"image": np.roll(base, i, axis=0), "label": i % 1000} for i in range(n))

    if not os.path.exists(os.path.join(root, "cf", "crossfeed.json")):
        crossfeed.write_dataset(os.path.join(root, "cf"), samples(), num_shards=SHARDS).close()
    if not os.path.exists(os.path.join(root, "wds", f"shard-{SHARDS - 1:05d}.tar")):
        os.makedirs(os.path.join(root, "wds"), exist_ok=True)
        tars = [tarfile.open(os.path.join(root, "wds", f"shard-{s:05d}.tar"), "w") for s in range(SHARDS)]
        for i, s in enumerate(samples()):
            for ext, blob in (("npy", _npy(s["image"])), ("cls", str(s["label"]).encode())):
                info = tarfile.TarInfo(f"{i:08d}.{ext}")
                info.size = len(blob)
                tars[i % SHARDS].addfile(info, io.BytesIO(blob))
        for t in tars:
            t.close()
    mds = streaming_base()
    if mds is not None and not os.path.exists(os.path.join(root, "mds", "index.json")):
        per_shard = n * (SIDE * SIDE * 3 + 64) // SHARDS + 1
        columns = {"image": f"ndarray:uint8:{SIDE},{SIDE},3", "label": "int"}
        with mds.MDSWriter(out=os.path.join(root, "mds"), columns=columns, size_limit=per_shard) as w:
            for s in samples():
                w.write(s)


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def plain_gets(base: str, files: list[str], streams: int = 8) -> float:
    """Bytes/s of plain whole-file GETs through the link, ``streams`` at a time."""

    def get(f):
        with urllib.request.urlopen(f"{base}/{f}") as r:
            return len(r.read())

    t = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        total = sum(pool.map(get, files))
    return total / (time.perf_counter() - t)


def _epochs(make_iter, warm: int = 5) -> list[float]:
    """Samples/s of epoch 1 (cold cache) and the median of the ``warm`` epochs after it (a warm
    epoch of a small dataset is short: one is noise on a shared machine)."""
    rates = []
    for _ in range(1 + warm):
        t, n = time.perf_counter(), 0
        for count in make_iter():
            n += count
        rates.append(n / (time.perf_counter() - t))
        if PeakRSS.current is not None and len(rates) == 1:
            PeakRSS.current.epoch1 = PeakRSS.current.stop(keep=True)
    return [rates[0], float(np.median(rates[1:]))]


def run_crossfeed(url: str, shuffle: str, cache: str | None) -> list[float]:
    import crossfeed

    with crossfeed.Loader(url, batch_size=BATCH, shuffle=shuffle, seed=0, cache_dir=cache) as ld:
        return _epochs(lambda: (len(b["label"]) for b in ld))


def run_wds(url: str, cache: str) -> list[float]:
    import webdataset as wds

    urls = f"{url}/shard-{{00000..{SHARDS - 1:05d}}}.tar"
    ds = wds.WebDataset(urls, cache_dir=cache, shardshuffle=False).decode().to_tuple("npy", "cls").batched(BATCH)
    return _epochs(lambda: (len(b[1]) for b in ds))


def run_mosaic(url: str, shuffle: str, cache: str) -> list[float]:
    base = streaming_base()
    ds = base.StreamingDataset(remote=url, local=cache, batch_size=BATCH, shuffle=shuffle != "none", shuffle_seed=0)

    def samples():
        for s in ds:
            assert s["image"].shape == (SIDE, SIDE, 3)
            yield 1

    return _epochs(samples)


def child(who: str, url: str, shuffle: str, endpoint: str) -> None:
    if endpoint != "-":
        import fsspec

        os.environ.update(CREDENTIALS, S3_ENDPOINT_URL=endpoint)  # mosaic's S3 downloader reads this
        fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    cache = tempfile.mkdtemp(prefix="cf-bench-cache-")
    rss = PeakRSS()
    try:
        if who == "crossfeed":
            rates = run_crossfeed(url, shuffle, cache)
        elif who == "whole-get":  # the previous download path, for comparison: one GET per shard
            import crossfeed.io.cache

            crossfeed.io.cache.CHUNK = 1 << 40
            rates = run_crossfeed(url, shuffle, cache)
        elif who == "local":
            rates = run_crossfeed(url, shuffle, None)
        elif who == "mosaic":
            rates = run_mosaic(url, shuffle, os.path.join(cache, "mds"))
        else:
            rates = run_wds(url, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({"rates": rates, "rss": rss.stop(), "rss1": rss.epoch1}))


class PeakRSS:
    """This process's peak anonymous resident memory (heap, buffers), sampled every 20 ms. Pages
    of memory-mapped shard files are left out: they are the page cache, shared and reclaimable,
    and would make any reader that maps its files look as big as the data it has read."""

    current: PeakRSS | None = None  # the child's sampler: `_epochs` notes the peak of epoch 1

    def __init__(self):
        self.peak = self.epoch1 = 0
        PeakRSS.current = self
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop.wait(0.02):
            self.sample()

    def sample(self) -> None:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    self.peak = max(self.peak, int(line.split()[1]) * 1024)

    def stop(self, keep: bool = False) -> int:
        if not keep:
            self._stop.set()
        self.sample()
        return self.peak


def start_s3(root: str):
    """moto's S3 server holding ``cf/`` and ``mds/``; None when moto is not installed."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        return None, None
    os.environ.update(CREDENTIALS)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
    s3.create_bucket(Bucket=BUCKET)
    for sub in ("cf", "mds"):
        d = os.path.join(root, sub)
        for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            s3.upload_file(os.path.join(d, f), BUCKET, f"{sub}/{f}")
    return server, port


def main(argv=None) -> None:
    from crossfeed.config import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--latency", type=float, default=0.03, help="seconds added to every request")
    ap.add_argument("--bandwidth", default="64MB", help="the link's bandwidth, bytes/s (e.g. 64MB)")
    ap.add_argument("--per-connection", default="8MB", help="one connection's bandwidth, bytes/s")
    ap.add_argument("--data", default=os.path.join(HERE, "_data", "cache"))
    ap.add_argument(
        "--readers",
        default="",
        help="run only the readers whose name contains one of these |-separated strings "
        "(e.g. 'http, block|s3, block'); crossfeed on local disk always runs (the epoch-2 reference)",
    )
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(*a.child)
    root = os.path.join(a.data, str(a.samples))
    make_data(root, a.samples)
    bw, per = parse_size(a.bandwidth), parse_size(a.per_connection)
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeFiles, directory=root))
    files.daemon_threads = True
    threading.Thread(target=files.serve_forever, daemon=True).start()
    http_link = Link(files.server_address[1], bw, a.latency, per)
    s3, s3_port = start_s3(root)
    s3_link = Link(s3_port, bw, a.latency, per) if s3 is not None else None
    has_mosaic = os.path.exists(os.path.join(root, "mds", "index.json"))
    runs = {}
    try:
        shard_files = [f"cf/{f}" for f in sorted(os.listdir(os.path.join(root, "cf"))) if f.endswith(".tfrecord")]
        measured = plain_gets(http_link.url, shard_files)
        nbytes = sum(os.path.getsize(os.path.join(root, f)) for f in shard_files) / a.samples
        plan = [
            ("crossfeed, local disk", "local", os.path.join(root, "cf"), "global", "-"),
            ("crossfeed http, global", "crossfeed", f"{http_link.url}/cf", "global", "-"),
            ("crossfeed http, block", "crossfeed", f"{http_link.url}/cf", "block", "-"),
            ("  … one GET per shard", "whole-get", f"{http_link.url}/cf", "block", "-"),
            ("webdataset http cache_dir", "wds", f"{http_link.url}/wds", "none", "-"),
        ]
        if s3_link is not None:
            plan += [
                ("crossfeed s3, global", "crossfeed", f"s3://{BUCKET}/cf", "global", s3_link.url),
                ("crossfeed s3, block", "crossfeed", f"s3://{BUCKET}/cf", "block", s3_link.url),
            ]
            if has_mosaic:
                plan.append(("mosaic s3, shuffle", "mosaic", f"s3://{BUCKET}/mds", "global", s3_link.url))
        words = [w.strip() for w in a.readers.split("|") if w.strip()]
        plan = [p for p in plan if not words or p[1] == "local" or any(w in p[0] for w in words)]
        for name, who, url, shuffle, endpoint in plan:
            cmd = [sys.executable, __file__, "--child", who, url, shuffle, endpoint]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                print(f"{name} failed: {out.stderr.strip().splitlines()[-3:]}")
                continue
            runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        http_link.close()
        files.shutdown()
        if s3 is not None:
            s3_link.close()
            s3.stop()
    local = runs.get("crossfeed, local disk", {"rates": [float("nan")] * 2})["rates"][1]
    print(
        f"{a.samples} raw {SIDE}×{SIDE}×3 samples ({nbytes / 1e3:.0f} KB each); link {bw / 1e6:,.0f} MB/s "
        f"({per / 1e6:,.0f} MB/s per connection), {a.latency * 1e3:.0f} ms per request = {bw / nbytes:,.0f} "
        f"samples/s; plain GETs, 8 at a time, measured {measured / 1e6:,.0f} MB/s"
    )
    print(
        f"{'reader':28} {'epoch 1/s':>10} {'of link':>8} {'epoch 2/s':>10} {'of local':>9} {'peak anon RSS':>13}"
        f" {'(epoch 1)':>9}"
    )
    for name, r in runs.items():
        e1, e2 = r["rates"]
        share = "-" if "local" in name else f"{e1 * nbytes / bw:.2f}"
        print(
            f"{name:28} {e1:10,.0f} {share:>8} {e2:10,.0f} {e2 / local:9.2f} {r['rss'] / 2**20:11.0f} MB {r['rss1'] / 2**20:6.0f} MB"
        )
    mosaic = runs.get("mosaic s3, shuffle")
    if mosaic is None:
        print("mosaic streaming: not importable here (see the module docstring)" if not has_mosaic else "")
        return
    for name in ("crossfeed s3, block", "crossfeed s3, global"):
        if name in runs:
            (c1, c2), (m1, m2) = runs[name]["rates"], mosaic["rates"]
            print(f"{name} / mosaic s3: epoch 1 {c1 / m1:.2f}×, epoch 2 {c2 / m2:.2f}×")


if __name__ == "__main__":
    main()
