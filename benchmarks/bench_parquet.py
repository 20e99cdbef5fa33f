"""Parquet read in place: crossfeed's Loader vs pyarrow's own readers (and HF ``datasets``) on the
very same Parquet files, in one run.

Workloads (written once by pyarrow, row groups of ``--row-group`` rows, several files):

* **tabular** — ``label`` int64, ``x`` fixed_size_list<float32>[32] (→ ``(B, 32)`` float32);
* **tensor** — ``label`` int64, ``image`` fixed_size_list<uint8>[3072] read as a 32×32×3 tensor.

Every reader delivers the same numpy batches (``label`` int64 ``(B,)``, ``x`` float32 ``(B, 32)`` or
``image`` uint8 ``(B, 3072)``/``(B, 32, 32, 3)``); each epoch's label sum is checked (every row once).

* crossfeed: ``Loader(dir, shuffle="block" | "global")`` after ``crossfeed index dir`` (no rewrite);
  its row-group LRU is emptied before every epoch, so each timed epoch decodes every row group
  (like the peers) — within an epoch, a global shuffle of these splits decodes each one once.
  ``global-warm`` is a Loader running epochs as it does in training: these splits fit its row-group
  LRU (512 MiB), so after the first epoch their decoded columns are kept and batches are numpy takes;
* pyarrow ``ParquetFile.iter_batches`` file by file + numpy (file order: no shuffle, less work);
* pyarrow ``dataset(dir).to_batches`` + numpy (file order, pyarrow's threaded scanner);
* HF ``datasets``: ``Dataset.from_parquet`` (an Arrow cache copy, made before the clock starts) with
  the numpy format, ``.iter(batch_size)`` in order and after ``.shuffle(seed)`` (an exact global
  shuffle through an indices mapping, like crossfeed's).

Each cell: one untimed warm-up epoch, then ``--epochs`` timed epochs (best kept); samples/s and the
ratio crossfeed / peer. Numbers are from whatever machine runs it (say if it was loaded).

    .venv/bin/python benchmarks/bench_parquet.py --quick
    .venv/bin/python benchmarks/bench_parquet.py --batch-sizes 32,256 --readers crossfeed,iter_batches,dataset
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time

import numpy as np

WORKLOADS = {"tabular": 400_000, "tensor": 40_000}
QUICK = {"tabular": 100_000, "tensor": 10_000}
READERS = ("crossfeed", "iter_batches", "dataset", "hf")


def prepare(kind: str, n: int, root: str, row_group: int, files: int = 4) -> str:
    """``root/kind-n-rg`` holding ``files`` Parquet files written by pyarrow, indexed by crossfeed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from crossfeed.write.adopt.index import index_dataset

    out = os.path.join(root, f"{kind}-{n}-{row_group}")
    if os.path.exists(os.path.join(out, "crossfeed.json")):
        return out
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(0)
    per = -(-n // files)
    for f in range(files):
        m = min(per, n - f * per)
        label = rng.integers(0, 1000, m)
        if kind == "tabular":
            col = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(m * 32, dtype=np.float32)), 32)
            table = pa.table({"label": pa.array(label), "x": col})
        else:
            col = pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 256, m * 3072, dtype=np.uint8)), 3072)
            table = pa.table({"label": pa.array(label), "image": col})
        pq.write_table(table, os.path.join(out, f"part-{f:03d}.parquet"), row_group_size=row_group)
    index_dataset(out, features=["label", "image=tensor:uint8:32,32,3"] if kind == "tensor" else None)
    return out


def _arrow_batch(rb, kind: str) -> dict:
    """A pyarrow RecordBatch as the numpy batch every reader delivers."""
    name, width = ("x", 32) if kind == "tabular" else ("image", 3072)
    col = rb.column(name)
    return {
        "label": rb.column("label").to_numpy(),
        name: col.flatten().to_numpy().reshape(len(col), width),
    }


def reader(name: str, kind: str, d: str, b: int, shuffle: str):
    """A function running one epoch, yielding numpy batches."""
    files = sorted(glob.glob(os.path.join(d, "*.parquet")))
    col = "x" if kind == "tabular" else "image"
    if name == "crossfeed":
        from crossfeed.read.loader import Loader

        warm = shuffle.endswith("-warm")
        loader = Loader(d, batch_size=b, shuffle=shuffle.removesuffix("-warm"), seed=0, features=["label", col])

        def epoch():  # every epoch decodes its row groups afresh, as the peers do (unless -warm)
            if not warm:
                loader.pipeline.clear()
            return iter(loader)

        return epoch, loader.close
    if name == "iter_batches":
        import pyarrow.parquet as pq

        def epoch():
            for f in files:
                for rb in pq.ParquetFile(f).iter_batches(batch_size=b, columns=["label", col]):
                    yield _arrow_batch(rb, kind)

        return epoch, None
    if name == "dataset":
        import pyarrow.dataset as pads

        dset = pads.dataset(files, format="parquet")  # a list: crossfeed.json in the directory is no Parquet

        def epoch():
            for rb in dset.to_batches(batch_size=b, columns=["label", col]):
                if rb.num_rows:
                    yield _arrow_batch(rb, kind)

        return epoch, None
    if name == "hf":
        import datasets

        datasets.disable_progress_bars()
        hf = datasets.Dataset.from_parquet(files, cache_dir=os.path.join(d, ".hf-cache")).with_format("numpy")
        if shuffle != "none":
            hf = hf.shuffle(seed=0)
        return lambda: hf.iter(batch_size=b), None
    raise ValueError(name)


def run_cell(name: str, kind: str, d: str, b: int, shuffle: str, epochs: int, label_sum: int, n: int) -> float:
    epoch, close = reader(name, kind, d, b, shuffle)
    try:
        best = 0.0
        for e in range(1 + epochs):
            t0 = time.perf_counter()
            count, total = 0, 0
            for batch in epoch():
                count += len(batch["label"])
                total += int(np.asarray(batch["label"]).sum())
            dt = time.perf_counter() - t0
            if count != n or total != label_sum:
                raise AssertionError(f"{name} {kind} b={b} {shuffle}: {count} rows, label sum {total} != {label_sum}")
            if e:  # the first epoch warms up (file cache, decoders, threads)
                best = max(best, n / dt)
        return best
    finally:
        if close is not None:
            close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller files (a quarter of the rows)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--batch-sizes", default="32,256")
    ap.add_argument("--readers", default=",".join(READERS))
    ap.add_argument("--row-group", type=int, default=16384, help="rows per row group (pyarrow's default: 1Mi)")
    ap.add_argument("--epochs", type=int, default=1, help="timed epochs per cell (best kept)")
    ap.add_argument(
        "--dir", default=os.environ.get("CROSSFEED_BENCH_DIR", os.path.join(tempfile.gettempdir(), "crossfeed-bench"))
    )
    args = ap.parse_args(argv)
    readers = args.readers.split(",")
    sizes = QUICK if args.quick else WORKLOADS
    batches = [int(x) for x in args.batch_sizes.split(",")]
    print(f"crossfeed Parquet read in place vs pyarrow / HF datasets, {os.cpu_count()} CPUs, samples/s (ratio)")
    for kind in args.workloads.split(","):
        n = sizes[kind]
        d = prepare(kind, n, os.path.join(args.dir, "parquet"), args.row_group)
        import pyarrow.parquet as pq

        label_sum = sum(
            int(pq.read_table(f, columns=["label"]).column(0).to_numpy().sum()) for f in glob.glob(d + "/*.parquet")
        )
        print(f"\n{kind}: {n:,} rows, {len(glob.glob(d + '/*.parquet'))} files, row groups of {args.row_group:,} rows")
        for b in batches:
            res = {}
            for name in readers:
                for shuffle in (
                    ("block", "global", "global-warm")
                    if name == "crossfeed"
                    else ("none", "global")
                    if name == "hf"
                    else ("none",)
                ):
                    res[(name, shuffle)] = run_cell(name, kind, d, b, shuffle, args.epochs, label_sum, n)
            peers = {k: v for k, v in res.items() if k[0] != "crossfeed"}
            for (name, shuffle), v in res.items():
                if name != "crossfeed":
                    continue
                vs = "  ".join(f"{v / pv:5.2f}× {pn}/{ps}" for (pn, ps), pv in peers.items())
                print(f"  b={b:<5} crossfeed {shuffle:<11} {v:>12,.0f}/s   vs  {vs}")
            for (name, shuffle), v in peers.items():
                print(f"  b={b:<5} {name:<12} {shuffle:<11} {v:>10,.0f}/s")


if __name__ == "__main__":
    main()
