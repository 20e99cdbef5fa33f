"""WebDataset tars read in place: crossfeed (``crossfeed index`` on the tars, then its Loader)
vs webdataset's own pipeline, on the very same ``.tar`` files, in one run.

The tars are written once by ``webdataset.ShardWriter`` (256 samples a shard) from real photos
(scikit-image's data: 224×224 crops of astronaut, coffee, chelsea, rocket, …):

* ``jpeg`` — ``jpg`` (JPEG, quality 90) + ``cls``, decoded to uint8 ``(B, 224, 224, 3)``;
* ``npy``  — ``npy`` (the crop as a uint8 array) + ``cls``.

Readers, each yielding ``(B, 224, 224, 3)`` uint8 + ``(B,)`` int64 batches:

* ``crossfeed`` — ``Loader(dir, batch_size=B, shuffle="global")`` (exact global shuffle: more
  work than the peers' file order, so the ratios are conservative), default threads;
* ``wds`` — ``wds.WebDataset(urls, shardshuffle=False).decode("rgb8").to_tuple(...).batched(B)``
  in the process (webdataset's documented pipeline);
* ``wds+DataLoader`` — the same pipeline split over 2 ``torch.utils.data.DataLoader`` workers
  (``wds.split_by_worker``), when torch is installed.

Each reader runs one warm-up epoch (checked: every sample once, by count and label sum), then
one timed epoch. Ratios are crossfeed's samples/s over the peer's.

    .venv/bin/python -m benchmarks.bench_wds --quick      # 512 samples, about a minute on 2 cores
    .venv/bin/python -m benchmarks.bench_wds              # 2048 samples
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time

import numpy as np

SIDE = 224
BATCHES = (32, 256)


def photos() -> list[np.ndarray]:
    from skimage import data

    names = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "retina")
    out = []
    for n in names:
        try:
            im = getattr(data, n)()
        except Exception:  # noqa: BLE001 - an image scikit-image cannot load here (optional downloads)
            continue
        if im.ndim == 3 and im.shape[2] == 3 and min(im.shape[:2]) >= SIDE:
            out.append(im)
    return out


def prepare(kind: str, n: int, root: str) -> tuple[str, int]:
    """The tar directory for ``kind`` (written once, then indexed), and the labels' sum."""
    import webdataset as wds
    from PIL import Image

    from crossfeed.write.adopt.index import index_dataset

    path = os.path.join(root, f"wds-{kind}-{n}")
    label_sum = sum(i % 10 for i in range(n))
    if os.path.exists(os.path.join(path, "crossfeed.json")):
        return path, label_sum
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    ims = photos()
    with wds.ShardWriter(os.path.join(path, "shard-%06d.tar"), maxcount=256, verbose=0) as sink:
        for i in range(n):
            im = ims[i % len(ims)]
            y, x = (int(rng.integers(0, d - SIDE + 1)) for d in im.shape[:2])
            crop = np.ascontiguousarray(im[y : y + SIDE, x : x + SIDE])
            sample = {"__key__": f"{i:07d}", "cls": i % 10}
            if kind == "jpeg":
                b = io.BytesIO()
                Image.fromarray(crop).save(b, format="JPEG", quality=90)
                sample["jpg"] = b.getvalue()
            else:
                sample["npy"] = crop
            sink.write(sample)
    index_dataset(path)
    return path, label_sum


def urls(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".tar"))


def read_crossfeed(path: str, value: str, batch: int):
    from crossfeed.read.loader import Loader

    with Loader(path, batch_size=batch, shuffle="global", seed=0, features=[value, "cls"]) as loader:
        for b in loader:
            yield b[value], b["cls"]


def _wds_pipeline(path: str, value: str, batch: int, workers: bool):
    import webdataset as wds

    stages = [wds.SimpleShardList(urls(path))]
    if workers:
        stages.append(wds.split_by_worker)
    stages += [wds.tarfile_to_samples(), wds.decode("rgb8"), wds.to_tuple(value, "cls"), wds.batched(batch)]
    return wds.DataPipeline(*stages)


def read_wds(path: str, value: str, batch: int):
    yield from _wds_pipeline(path, value, batch, workers=False)


def read_wds_loader(path: str, value: str, batch: int):
    from torch.utils.data import DataLoader

    for x, y in DataLoader(_wds_pipeline(path, value, batch, workers=True), batch_size=None, num_workers=2):
        yield x.numpy() if hasattr(x, "numpy") else x, y.numpy() if hasattr(y, "numpy") else y


def epoch(reader, path: str, value: str, batch: int) -> tuple[float, int, int]:
    """``(seconds, samples, label sum)`` of one epoch; every batch checked to be uint8 images."""
    t0 = time.perf_counter()
    n = total = 0
    for x, y in reader(path, value, batch):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != np.uint8 or x.shape[1:] != (SIDE, SIDE, 3):
            raise SystemExit(f"{reader.__name__}: got {x.dtype}{list(x.shape)}, expected uint8 (B, {SIDE}, {SIDE}, 3)")
        n += len(y)
        total += int(y.sum())
    return time.perf_counter() - t0, n, total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="512 samples instead of 2048")
    ap.add_argument("-n", type=int, default=None, help="samples per workload")
    ap.add_argument("--workloads", default="jpeg,npy")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "crossfeed-bench-wds"))
    args = ap.parse_args(argv)
    n = args.n or (512 if args.quick else 2048)
    readers = [("crossfeed", read_crossfeed), ("wds", read_wds)]
    try:
        import torch  # noqa: F401

        readers.append(("wds+DataLoader", read_wds_loader))
    except ImportError:
        pass
    print(f"# {n} samples per workload, tars by webdataset.ShardWriter; cpus={os.cpu_count()}", flush=True)
    print(f"{'workload':<8} {'batch':>5} " + " ".join(f"{r:>16}" for r, _ in readers) + "   ratios (crossfeed / peer)")
    for kind in args.workloads.split(","):
        path, label_sum = prepare(kind, n, args.root)
        value = "jpg" if kind == "jpeg" else "npy"
        for batch in (int(b) for b in args.batches.split(",")):
            rates = {}
            for name, reader in readers:
                _, count, got = epoch(reader, path, value, batch)  # warm-up, checked
                if (count, got) != (n, label_sum):
                    raise SystemExit(f"{name}: {count} samples, label sum {got}; expected {n}, {label_sum}")
                seconds, _, _ = epoch(reader, path, value, batch)
                rates[name] = n / seconds
            ratios = "  ".join(f"vs {r}: {rates['crossfeed'] / rates[r]:.2f}x" for r, _ in readers[1:])
            print(
                f"{kind:<8} {batch:>5} " + " ".join(f"{rates[r]:>12,.0f} s/s" for r, _ in readers) + f"   {ratios}",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
