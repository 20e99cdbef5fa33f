"""Loader throughput: crossfeed vs tf.data vs the ``tfrecord`` package vs webdataset, one run.

Every reader reads the same samples from the same machine in the same run: crossfeed and tf.data
and the ``tfrecord`` package read the very same TFRecord shards (the package through crossfeed's
``.idx`` files, which are in its index format); webdataset reads the same samples written as tar
shards. Each reader delivers the same numpy/torch batches — ``image`` uint8 ``(B, 224, 224, 3)``
(raw tensor or decoded JPEG) or ``x`` float32 ``(B, 32)``, and ``label`` int64 ``(B,)`` — and the
sum of the labels of each epoch is checked (every sample exactly once).

Each (reader, configuration, workload) runs in a process of its own (the ``tfrecord`` package
cannot share a process with TensorFlow, and peak RSS must be per reader): one untimed warm-up
epoch (also giving time to first batch, from constructing the reader), then ``--epochs`` timed
epochs, best kept. Peers are tuned: several configurations are run and the fastest is compared.

crossfeed reads with an exact global shuffle (its default); the peers read in file order without
shuffling, which is less work — the ratios are conservative.

    .venv/bin/python benchmarks/bench_loader.py                 # full sizes
    .venv/bin/python benchmarks/bench_loader.py --quick         # < 3 minutes
    .venv/bin/python benchmarks/bench_loader.py --workloads raw --readers crossfeed,tf --raw 8192

Sizes also come from the environment: ``CROSSFEED_BENCH_RAW``, ``…_JPEG``, ``…_TABULAR`` (sample
counts), ``CROSSFEED_BENCH_DIR`` (cache of generated data, default ``$TMPDIR/crossfeed-bench``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

import numpy as np

HW = 224
WORKLOADS = ("raw", "jpeg", "tabular")
READERS = ("crossfeed", "tf", "tfrecord", "wds")
FULL = {"raw": 16384, "jpeg": 16384, "tabular": 1 << 20}
QUICK = {"raw": 4096, "jpeg": 3072, "tabular": 1 << 18}
BATCH = {"raw": 128, "jpeg": 128, "tabular": 4096}
SHARDS = 8
GOALS = {("raw", "tf"): 3.0, ("jpeg", "tf"): 1.2, ("tabular", "tf"): 2.0,
         ("raw", "tfrecord"): 5.0, ("jpeg", "tfrecord"): 5.0, ("tabular", "tfrecord"): 5.0}
# configurations tried per reader; a peer is compared at its best one
CONFIGS = {
    "crossfeed": ["global", "block", "none"],
    "tf": ["seq", "par"],  # TFRecordDataset num_parallel_reads None (sequential) / AUTOTUNE
    "tfrecord": ["w0", "w2"],  # torch DataLoader num_workers 0 / 2
    "wds": ["w0", "w2"],
}
CONFIGS_QUICK = {"crossfeed": ["global", "none"], "tf": ["seq", "par"], "tfrecord": ["w2"], "wds": ["w2"]}


# ---- data ------------------------------------------------------------------------------------

def _sample(kind: str, i: int, rng: np.random.Generator) -> dict:
    if kind == "raw":
        return {"image": rng.integers(0, 256, (HW, HW, 3), dtype=np.uint8), "label": i}
    if kind == "tabular":
        return {"x": rng.standard_normal(32, dtype=np.float32), "label": i}
    return {"image": _jpeg(rng), "label": i}


def _jpeg(rng: np.random.Generator) -> bytes:
    """A photo-like 224×224 JPEG (smooth structure plus grain, ~20 KB at quality 90)."""
    from PIL import Image

    small = Image.fromarray(rng.integers(0, 256, (14, 14, 3), dtype=np.uint8))
    arr = np.asarray(small.resize((HW, HW), Image.BICUBIC), dtype=np.int16)
    arr = np.clip(arr + rng.integers(-12, 13, arr.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _schema(kind: str):
    from crossfeed.format.schema import Encoding, Feature, Schema

    label = Feature("label", "int64", (), Encoding.INT64)
    if kind == "raw":
        return Schema([Feature("image", "uint8", (HW, HW, 3), Encoding.TENSOR), label])
    if kind == "tabular":
        return Schema([Feature("x", "float32", (32,), Encoding.FLOAT), label])
    return Schema([Feature("image", "uint8", (None, None, 3), Encoding.IMAGE), label])


def prepare(kind: str, n: int, root: str) -> str:
    """Generate (once; cached by kind and size) ``<root>/<kind>-<n>/{tfrecord,wds}``."""
    import crossfeed

    d = os.path.join(root, f"{kind}-{n}")
    done = os.path.join(d, "DONE")
    if os.path.exists(done):
        return d
    os.makedirs(d, exist_ok=True)
    print(f"generating {kind} × {n} in {d} …", file=sys.stderr, flush=True)

    def samples():
        rng = np.random.default_rng(1234)
        for i in range(n):
            yield _sample(kind, i, rng)

    crossfeed.write_dataset(os.path.join(d, "tfrecord"), samples(), num_shards=SHARDS, schema=_schema(kind)).close()
    os.makedirs(os.path.join(d, "wds"), exist_ok=True)
    tars = [tarfile.open(os.path.join(d, "wds", f"shard-{s:05d}.tar"), "w") for s in range(SHARDS)]
    ext = {"raw": "raw", "jpeg": "jpg", "tabular": "f32"}[kind]
    for i, s in enumerate(samples()):
        value = s["image"] if kind != "tabular" else s["x"]
        data = value if isinstance(value, bytes) else value.tobytes()
        for name, blob in ((f"{i:09d}.{ext}", data), (f"{i:09d}.cls", str(i).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tars[i % SHARDS].addfile(info, io.BytesIO(blob))
    for t in tars:
        t.close()
    open(done, "w").close()
    return d


# ---- readers (each yields dict batches with "label" and "image"/"x") ----------------------------

def _tfrecord_files(d: str) -> list[str]:
    t = os.path.join(d, "tfrecord")
    return sorted(os.path.join(t, f) for f in os.listdir(t) if f.endswith(".tfrecord"))


def _decode_pil(data) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def reader_crossfeed(kind: str, d: str, b: int, config: str):
    from crossfeed.read.loader import Loader

    loader = Loader(os.path.join(d, "tfrecord"), batch_size=b, shuffle=config, seed=0)
    return loader, loader.close


def reader_tf(kind: str, d: str, b: int, config: str):
    import tensorflow as tf

    files = _tfrecord_files(d)
    value = "x" if kind == "tabular" else "image"
    spec = {"label": tf.io.FixedLenFeature([], tf.int64),
            value: tf.io.FixedLenFeature([32], tf.float32) if kind == "tabular" else tf.io.FixedLenFeature([], tf.string)}
    auto = tf.data.AUTOTUNE
    ds = tf.data.TFRecordDataset(files, num_parallel_reads=None if config == "seq" else auto, buffer_size=8 << 20)
    if kind == "jpeg":
        def parse_one(rec):
            p = tf.io.parse_single_example(rec, spec)
            return {"image": tf.io.decode_jpeg(p["image"], channels=3), "label": p["label"]}
        ds = ds.map(parse_one, num_parallel_calls=auto, deterministic=False).batch(b)
    else:
        def parse_batch(recs):
            p = tf.io.parse_example(recs, spec)
            if kind == "raw":
                p["image"] = tf.reshape(tf.io.decode_raw(p["image"], tf.uint8), [-1, HW, HW, 3])
            return p
        ds = ds.batch(b).map(parse_batch, num_parallel_calls=auto, deterministic=False)
    opts = tf.data.Options()
    opts.deterministic = False
    ds = ds.with_options(opts).prefetch(auto)

    class Epochs:
        def __iter__(self):
            return ds.as_numpy_iterator()
    return Epochs(), lambda: None


def reader_tfrecord(kind: str, d: str, b: int, config: str):
    import torch
    from tfrecord.torch.dataset import TFRecordDataset

    value = "x" if kind == "tabular" else "image"
    desc = {value: "float" if kind == "tabular" else "byte", "label": "int"}

    def transform(s):
        v = s[value]
        if kind == "raw":
            v = np.frombuffer(v, np.uint8).reshape(HW, HW, 3)
        elif kind == "jpeg":
            v = _decode_pil(v)
        return {value: v, "label": s["label"][0]}

    ds = torch.utils.data.ChainDataset(
        [TFRecordDataset(f, f + ".idx", desc, transform=transform) for f in _tfrecord_files(d)])
    workers = int(config[1:])
    dl = torch.utils.data.DataLoader(ds, batch_size=b, num_workers=workers, persistent_workers=workers > 0)
    return dl, lambda: None


def reader_wds(kind: str, d: str, b: int, config: str):
    import torch
    import webdataset as wds

    t = os.path.join(d, "wds")
    urls = sorted(os.path.join(t, f) for f in os.listdir(t) if f.endswith(".tar"))
    ext = {"raw": "raw", "jpeg": "jpg", "tabular": "f32"}[kind]
    value = "x" if kind == "tabular" else "image"

    def decode(s):
        data = s[ext]
        if kind == "raw":
            v = np.frombuffer(data, np.uint8).reshape(HW, HW, 3)
        elif kind == "jpeg":
            v = _decode_pil(data)
        else:
            v = np.frombuffer(data, np.float32)
        return v, int(s["cls"])

    def collate(samples):
        vs, ls = zip(*samples)
        return {value: np.stack(vs), "label": np.asarray(ls, np.int64)}

    ds = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node, empty_check=False)
          .map(decode).batched(b, collation_fn=collate, partial=True))
    workers = int(config[1:])
    if workers == 0:
        return ds, lambda: None
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True)
    return dl, lambda: None


# ---- one measurement, in a child process ----------------------------------------------------------

class _MemSampler:
    """Peak RSS and peak private (RSS − shared: not counting mmap'd page cache) of this process."""

    def __init__(self, period: float = 0.02):
        import psutil

        self._p = psutil.Process()
        self.peak_rss = self.peak_private = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._t.start()

    def _run(self, period):
        while not self._stop.wait(period):
            self.sample()

    def sample(self):
        m = self._p.memory_info()
        self.peak_rss = max(self.peak_rss, m.rss)
        self.peak_private = max(self.peak_private, m.rss - getattr(m, "shared", 0))

    def stop(self):
        self._stop.set()
        self._t.join(timeout=5)
        self.sample()


def _cpu_seconds(proc) -> float:
    """CPU time of this process and its children (DataLoader workers) so far."""
    total = sum(proc.cpu_times()[:2])
    for c in proc.children(recursive=True):
        try:
            total += sum(c.cpu_times()[:2])
        except Exception:  # a child that just exited
            pass
    return total


def _len_and_label_sum(batch) -> tuple[int, int, tuple]:
    lab = np.asarray(batch["label"])
    value = batch["x"] if "x" in batch else batch["image"]
    return len(lab), int(lab.astype(np.int64).sum()), (tuple(np.asarray(value).shape[1:]), str(np.asarray(value).dtype))


def child(reader: str, kind: str, d: str, b: int, config: str, epochs: int, n: int) -> dict:
    mem = _MemSampler()
    baseline = mem._p.memory_info().rss
    t0 = time.perf_counter()
    it, close = globals()[f"reader_{reader}"](kind, d, b, config)
    # warm-up epoch; also time to first batch from constructing the reader
    ttfb, count, label_sum, form = None, 0, 0, None
    for batch in it:
        if ttfb is None:
            ttfb = time.perf_counter() - t0
        k, s, form = _len_and_label_sum(batch)
        count, label_sum = count + k, label_sum + s
    if count != n or label_sum != n * (n - 1) // 2:
        raise SystemExit(f"{reader}/{config}/{kind}: delivered {count} samples, label sum {label_sum}; expected {n}, {n * (n - 1) // 2}")
    best, best_cpu = 0.0, 0.0
    for _ in range(epochs):
        c0, t = _cpu_seconds(mem._p), time.perf_counter()
        count = 0
        for batch in it:
            count += len(batch["label"])
        wall, cpu = time.perf_counter() - t, _cpu_seconds(mem._p) - c0
        best, best_cpu = max(best, count / wall), max(best_cpu, count / max(cpu, 1e-9))
    close()
    mem.stop()
    return {"reader": reader, "config": config, "workload": kind, "samples_per_s": best, "per_cpu_s": best_cpu, "ttfb_s": ttfb,
            "peak_rss": mem.peak_rss, "peak_private": mem.peak_private, "baseline_rss": baseline,
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "form": form}


def shuffle_quality(d: str, b: int) -> dict:
    """Correlation of delivery position with original index for crossfeed's shuffle modes."""
    from crossfeed.read.loader import Loader

    out = {}
    for mode in ("global", "block", "none"):
        with Loader(os.path.join(d, "tfrecord"), batch_size=b, shuffle=mode, seed=0, features=["label"],
                    return_index=True) as loader:
            order = np.concatenate([bt["__index__"] for bt in loader])
            starts = loader.split.starts
        n = len(order)
        pos = np.arange(n, dtype=np.float64)
        spearman = float(np.corrcoef(pos, np.argsort(np.argsort(order)).astype(np.float64))[0, 1])
        pearson = float(np.corrcoef(pos, order.astype(np.float64))[0, 1])
        shard = np.searchsorted(starts, order, side="right") - 1
        same_shard = float(np.mean(shard[1:] == shard[:-1]))
        jump = float(np.mean(np.abs(np.diff(order))) / n)  # a uniform permutation gives ≈ 1/3
        out[mode] = {"spearman": spearman, "pearson": pearson, "same_shard_adjacent": same_shard, "mean_jump": jump}
    return out


# ---- driver -------------------------------------------------------------------------------------

def _run_child(args: list[str], timeout: float) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  {' '.join(args[:3])}: timed out after {timeout:.0f}s", file=sys.stderr)
        return None
    if p.returncode != 0:
        print(f"  {' '.join(args[:3])}: failed:\n{p.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: the whole run takes < 3 minutes")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--readers", default=",".join(READERS))
    for k in WORKLOADS:
        ap.add_argument(f"--{k}", type=int, default=None, help=f"samples of the {k} workload")
        ap.add_argument(f"--{k}-batch", type=int, default=BATCH[k])
    ap.add_argument("--epochs", type=int, default=None, help="timed epochs per reader (best kept)")
    ap.add_argument("--dir", default=os.environ.get("CROSSFEED_BENCH_DIR", os.path.join(tempfile.gettempdir(), "crossfeed-bench")))
    ap.add_argument("--rounds", type=int, default=None, help="rounds over all readers (best kept); default 1 quick, 2 full")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--child", nargs=7, metavar=("READER", "KIND", "DIR", "B", "CONFIG", "EPOCHS", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        r, k, d, b, c, e, n = a.child
        if r == "shuffle":
            print(json.dumps(shuffle_quality(d, int(b))))
        else:
            print(json.dumps(child(r, k, d, int(b), c, int(e), int(n))))
        return

    sizes = dict(QUICK if a.quick else FULL)
    for k in WORKLOADS:
        env = os.environ.get(f"CROSSFEED_BENCH_{k.upper()}")
        sizes[k] = getattr(a, k) or (int(env) if env else sizes[k])
    epochs = a.epochs or 2
    a.rounds = a.rounds or (1 if a.quick else 2)
    kinds = [k for k in a.workloads.split(",") if k]
    readers = [r for r in a.readers.split(",") if r]
    print(f"bench_loader: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, sizes {({k: sizes[k] for k in kinds})}, "
          f"batch {({k: getattr(a, k + '_batch') for k in kinds})}, {a.rounds} round(s) × {epochs} timed epochs (best kept)", flush=True)
    results: dict[tuple[str, str], dict] = {}
    runs: dict[tuple[str, str, str], dict] = {}
    for k in kinds:
        d = prepare(k, sizes[k], a.dir)
        b = getattr(a, k + "_batch")
        # rounds interleave the readers, so that load from elsewhere on the machine hits all of them
        for rnd in range(a.rounds):
            for r in readers:
                for c in (CONFIGS_QUICK if a.quick else CONFIGS)[r]:
                    res = _run_child([r, k, d, str(b), c, str(epochs), str(sizes[k])], a.timeout)
                    if res is None:
                        continue
                    print(f"  {k:8s} {r:10s} {c:7s} round {rnd + 1}: {res['samples_per_s']:>11,.0f} samples/s "
                          f"({res['per_cpu_s']:>10,.0f} per CPU-s)  first batch {res['ttfb_s']:.2f}s  "
                          f"peak RSS {res['peak_rss'] / 2**20:,.0f} MiB (private {res['peak_private'] / 2**20:,.0f})", flush=True)
                    key = (k, r, c)
                    if key in runs:  # best of the rounds, per measure
                        old = runs[key]
                        for m in ("samples_per_s", "per_cpu_s"):
                            res[m] = max(res[m], old[m])
                        for m in ("ttfb_s", "peak_rss", "peak_private"):
                            res[m] = min(res[m], old[m])
                    runs[key] = res
    for (k, r, c), res in runs.items():
        # crossfeed is compared in its default (global shuffle); peers at their best config
        key = (k, r)
        if r == "crossfeed":
            if c == "global":
                results[key] = res
        elif key not in results or res["samples_per_s"] > results[key]["samples_per_s"]:
            results[key] = res
    _table(kinds, readers, results, runs)
    if "crossfeed" in readers:
        k = "tabular" if "tabular" in kinds else kinds[0]
        q = _run_child(["shuffle", k, os.path.join(a.dir, f"{k}-{sizes[k]}"), str(getattr(a, k + "_batch")), "-", "0", "0"], a.timeout)
        if q:
            print(f"\nshuffle quality (crossfeed, {k} workload, {sizes[k]:,} samples; position vs original index, 0 = no order left):")
            print(f"  {'mode':8s} {'spearman':>9s} {'pearson':>9s} {'same-shard neighbours':>22s} {'mean |jump|/N':>14s}")
            for mode, m in q.items():
                print(f"  {mode:8s} {m['spearman']:>9.4f} {m['pearson']:>9.4f} {m['same_shard_adjacent']:>22.3f} {m['mean_jump']:>14.3f}")
            print("  (a uniform random order gives spearman ≈ 0, same-shard neighbours ≈ 1/shards, mean |jump|/N ≈ 0.333)")


def _table(kinds, readers, results, runs) -> None:
    print("\nsamples/s (peers at their best configuration; crossfeed with global shuffle)")
    head = f"{'workload':9s}" + "".join(f"{r:>22s}" for r in readers)
    print(head)
    for k in kinds:
        row = f"{k:9s}"
        for r in readers:
            res = results.get((k, r))
            cell = f"{res['samples_per_s']:,.0f} ({res['config']})" if res else "—"
            row += f"{cell:>22s}"
        print(row)
    cf = {k: results.get((k, "crossfeed")) for k in kinds}
    print("\ncrossfeed (global shuffle) / peer: wall-clock samples/s, [per CPU-second], (crossfeed in file order like the peers)")
    for k in kinds:
        for r in readers:
            if r == "crossfeed" or not cf[k] or (k, r) not in results:
                continue
            peer = results[(k, r)]
            ratio = cf[k]["samples_per_s"] / peer["samples_per_s"]
            cpu = cf[k]["per_cpu_s"] / peer["per_cpu_s"]
            same = runs.get((k, "crossfeed", "none"))
            same_s = f"({same['samples_per_s'] / peer['samples_per_s']:.2f}×)" if same else ""
            goal = GOALS.get((k, r))
            verdict = "" if goal is None else f"  goal ≥ {goal:.1f}× {'MET' if ratio >= goal else 'MISSED'}"
            print(f"  {k:8s} vs {r:9s} {ratio:6.2f}×  [{cpu:5.2f}×]  {same_s:9s}{verdict}")
    print("\ntime to first batch (s) / peak RSS MiB (private, i.e. without mmap'd page cache)")
    for k in kinds:
        parts = []
        for r in readers:
            res = results.get((k, r))
            if res:
                parts.append(f"{r} {res['ttfb_s']:.2f}s / {res['peak_rss'] / 2**20:,.0f} ({res['peak_private'] / 2**20:,.0f})")
        print(f"  {k:8s} " + "; ".join(parts))


if __name__ == "__main__":
    main()
