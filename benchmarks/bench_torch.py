"""PyTorch input throughput: crossfeed's TorchDataset vs the ``tfrecord`` package's TFRecordDataset
vs webdataset's WebDataset, through ``torch.utils.data.DataLoader`` with 0 and 2 workers, on the
same samples, in one run.

* crossfeed reads a `benchmarks.workloads` dataset (raw 224×224×3 uint8 + label; 32 float32 +
  label; 224×224 JPEG + label) with its exact global shuffle (the peers read in file order, which
  is less work: the ratios are conservative).
* the ``tfrecord`` package reads the very same TFRecord shards with their ``.idx`` files (the
  index format it uses), one TFRecordDataset per shard chained, its own worker splitting;
  DataLoader(batch_size=B) collates.
* webdataset reads the same samples written once as tar shards with ``webdataset.ShardWriter``
  (``.npy`` payloads for arrays, the JPEG bytes as ``.jpg``), decoded with its own decoders and
  batched in the pipeline (``.batched``), DataLoader(batch_size=None).

Every reader yields the same batches — ``image`` uint8 ``(B, 224, 224, 3)`` or ``x`` float32
``(B, 32)``, and ``label`` int64 ``(B,)`` as torch tensors — and every warm-up epoch checks the
sample count and the sum of the labels (every sample exactly once). Then ``--epochs`` timed
epochs, best kept. TensorFlow is never imported (the ``tfrecord`` package cannot share a process
with it).

    .venv/bin/python -m benchmarks.bench_torch --quick        # small sizes, < 2 minutes on 2 cores
    .venv/bin/python -m benchmarks.bench_torch                # workloads' default sizes
    .venv/bin/python -m benchmarks.bench_torch --workloads raw --raw 2000 --workers 0,2,4

Sizes: ``--raw/--tabular/--jpeg`` or ``CROSSFEED_BENCH_RAW/…`` (see `benchmarks.workloads`).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

import numpy as np

try:  # run as `python -m benchmarks.bench_torch` or as a script
    from benchmarks import workloads
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import workloads

READERS = ("crossfeed", "tfrecord", "webdataset")
BATCH = {"raw": 64, "jpeg": 64, "tabular": 1024}
VALUE = {"raw": "image", "jpeg": "image", "tabular": "x"}
GOALS = {"tfrecord": 5.0, "webdataset": 1.5}
QUICK = {"raw": 1536, "tabular": 40_000, "jpeg": 1024}  # big enough for epochs of ~0.2 s or more


# ---- data: the workload's TFRecord dataset, and the same samples as webdataset tars --------------


def prepare(kind: str, n: int) -> tuple[str, str, dict]:
    """``(crossfeed dataset, webdataset directory, {"n", "label_sum"})``, generated once."""
    import crossfeed

    path = workloads.ensure(kind, n)
    wds_dir = path + "-wds"
    meta_path = os.path.join(wds_dir, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            return path, wds_dir, json.load(f)
    import webdataset as wds

    print(f"writing {kind} × {n} as webdataset tars in {wds_dir} …", file=sys.stderr, flush=True)
    os.makedirs(wds_dir, exist_ok=True)
    ds = crossfeed.open_dataset(path)
    split = ds["train"]
    per_shard = -(-len(split) // workloads.NUM_SHARDS)
    label_sum, i = 0, 0
    with wds.ShardWriter(os.path.join(wds_dir, "shard-%05d.tar"), maxcount=per_shard, verbose=0) as sink:
        for s, count in enumerate(split.counts.tolist()):
            for k in range(count):
                sample = split.decode(s, k, decode_images=False)
                value = sample[VALUE[kind]]
                ext = "jpg" if kind == "jpeg" else "npy"
                sink.write({"__key__": f"{i:09d}", ext: value, "cls": int(sample["label"])})
                label_sum += int(sample["label"])
                i += 1
    ds.close()
    meta = {"n": i, "label_sum": label_sum}
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return path, wds_dir, meta


# ---- readers: each returns a re-iterable of epochs of dict batches ---------------------------------


def _loader(dataset, workers: int, **kw):
    from torch.utils.data import DataLoader

    return DataLoader(dataset, num_workers=workers, persistent_workers=workers > 0, **kw)


class _Epochs:
    """Iterating gives the next epoch (with ``set_epoch``, as a training loop would)."""

    def __init__(self, dataset, loader):
        self.dataset, self.loader, self.epoch = dataset, loader, 0

    def __iter__(self):
        self.dataset.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)


def reader_crossfeed(kind: str, path: str, wds_dir: str, b: int, workers: int):
    from crossfeed.adapters.torch import TorchDataset

    ds = TorchDataset(path, batch_size=b, seed=0, rank=0, world_size=1)
    return _Epochs(ds, _loader(ds, workers, batch_size=None))


def _decode_jpeg(data) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


class _TfrecordTransform:  # a class, so that spawned workers could pickle it
    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, s: dict) -> dict:
        key = VALUE[self.kind]
        v = s[key]
        if self.kind == "raw":
            v = np.frombuffer(v, np.uint8).reshape(workloads.SIDE, workloads.SIDE, 3)
        elif self.kind == "jpeg":
            v = _decode_jpeg(v)
        return {key: v, "label": s["label"][0]}


def reader_tfrecord(kind: str, path: str, wds_dir: str, b: int, workers: int):
    from tfrecord.torch.dataset import TFRecordDataset
    from torch.utils.data import ChainDataset

    shards = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".tfrecord"))
    desc = {VALUE[kind]: "float" if kind == "tabular" else "byte", "label": "int"}
    ds = ChainDataset([TFRecordDataset(f, f + ".idx", desc, transform=_TfrecordTransform(kind)) for f in shards])
    return _loader(ds, workers, batch_size=b)


class _WdsCollate:
    def __init__(self, kind: str):
        self.key = VALUE[kind]

    def __call__(self, samples):
        import torch

        values, labels = zip(*samples)
        return {self.key: torch.from_numpy(np.stack(values)), "label": torch.as_tensor(labels, dtype=torch.int64)}


def reader_webdataset(kind: str, path: str, wds_dir: str, b: int, workers: int):
    import webdataset as wds

    urls = sorted(os.path.join(wds_dir, f) for f in os.listdir(wds_dir) if f.endswith(".tar"))
    ext = "jpg" if kind == "jpeg" else "npy"
    ds = (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False, nodesplitter=wds.single_node_only)
        .decode("rgb8")
        .to_tuple(ext, "cls")
        .batched(b, collation_fn=_WdsCollate(kind), partial=True)
    )
    return _loader(ds, workers, batch_size=None)


# ---- measuring ---------------------------------------------------------------------------------


def measure(
    reader: str, kind: str, path: str, wds_dir: str, meta: dict, b: int, workers: int, epochs: int
) -> tuple[float, float]:
    """Best samples/s and least CPU seconds per sample over ``epochs`` timed epochs, after a
    checked warm-up epoch."""
    it = globals()[f"reader_{reader}"](kind, path, wds_dir, b, workers)
    count = label_sum = 0
    for batch in it:
        v = batch[VALUE[kind]]
        if not (
            hasattr(v, "shape") and v.shape[1:] == ((workloads.SIDE, workloads.SIDE, 3) if kind != "tabular" else (32,))
        ):
            raise SystemExit(f"{reader}/{kind}: unexpected batch of {type(v).__name__} {getattr(v, 'shape', '')}")
        count += len(batch["label"])
        label_sum += int(batch["label"].sum())
    if (count, label_sum) != (meta["n"], meta["label_sum"]):
        raise SystemExit(
            f"{reader}/{kind}/{workers} workers: {count} samples with label sum {label_sum}, "
            f"expected {meta['n']} and {meta['label_sum']}"
        )
    best, cpu = 0.0, float("inf")
    for _ in range(epochs):
        c, t = _cpu_seconds(), time.perf_counter()
        count = sum(len(batch["label"]) for batch in it)
        best = max(best, count / (time.perf_counter() - t))
        cpu = min(cpu, (_cpu_seconds() - c) / count)
    del it
    return best, cpu


def _cpu_seconds() -> float:
    """CPU time of this process and its live children (DataLoader workers): robust where the
    wall clock is not, on a busy machine."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="raw,tabular,jpeg")
    ap.add_argument("--readers", default=",".join(READERS))
    ap.add_argument("--workers", default="0,2", help="DataLoader num_workers values, comma-separated")
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per configuration (best kept)")
    ap.add_argument("--quick", action="store_true", help=f"small sizes: {QUICK}")
    for kind in ("raw", "tabular", "jpeg"):
        ap.add_argument(f"--{kind}", type=int, default=None, help=f"samples of the {kind} workload")
    a = ap.parse_args(argv)
    kinds, readers = a.workloads.split(","), a.readers.split(",")
    worker_counts = [int(w) for w in a.workers.split(",")]
    results: dict[tuple[str, str, int], tuple[float, float]] = {}
    t0 = time.perf_counter()
    for kind in kinds:
        n = getattr(a, kind) or (QUICK[kind] if a.quick else workloads.size_of(kind))
        path, wds_dir, meta = prepare(kind, n)
        for workers in worker_counts:
            for reader in readers:
                sps, cpu = measure(reader, kind, path, wds_dir, meta, BATCH[kind], workers, a.epochs)
                results[(kind, reader, workers)] = sps, cpu
                print(
                    f"  {kind:8s} {reader:11s} workers={workers}: {sps:12,.0f} samples/s  {cpu * 1e6:8,.0f} CPU µs/sample",
                    file=sys.stderr,
                    flush=True,
                )
    _table(kinds, readers, worker_counts, results)
    assert "tensorflow" not in sys.modules
    print(
        f"\n({time.perf_counter() - t0:.0f}s; batch sizes {BATCH}; best of {a.epochs} epochs; "
        f"{os.cpu_count()} CPUs; tensorflow imported: no)"
    )


def _table(kinds, readers, worker_counts, results) -> None:
    """Two tables: samples/s (wall clock) and CPU µs per sample (all processes); the ratios are
    crossfeed's advantage (higher samples/s, lower CPU per sample)."""
    for title, col, fmt, better in (
        ("samples/s (wall clock, best epoch)", 0, "{:12,.0f}", lambda cf, v: cf / v),
        ("CPU µs per sample (main + workers, best epoch)", 1, "{:12,.1f}", lambda cf, v: v / cf),
    ):
        print(f"\n{title}")
        print(
            f"{'workload':9s} {'workers':>7s} "
            + " ".join(f"{r:>12s}" for r in readers)
            + "   crossfeed's advantage (goal)"
        )
        for kind in kinds:
            for w in worker_counts:
                row = [results.get((kind, r, w)) for r in readers]
                cells = " ".join(fmt.format(v[col] * (1e6 if col else 1)) if v else f"{'-':>12s}" for v in row)
                ratios = []
                cf = results.get((kind, "crossfeed", w))
                for peer, goal in GOALS.items():
                    v = results.get((kind, peer, w))
                    if cf and v:
                        r = better(cf[col], v[col])
                        ratios.append(f"×{r:.1f} vs {peer} ({'ok' if r >= goal else 'MISS'} ≥{goal})")
                print(f"{kind:9s} {w:7d} {cells}   {'; '.join(ratios)}")


if __name__ == "__main__":
    main()
