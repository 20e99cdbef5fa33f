"""Weighted mixtures: crossfeed vs tf.data ``sample_from_datasets``, one run, same shards.

Three tabular sources (sizes 4:2:1, weights 5:3:2) written by crossfeed; each reader delivers
``--batches`` batches of ``--batch`` decoded samples. Printed per reader: samples/s, and the
proportion error after those batches — the largest ``|count_i − w_i/Σw × delivered|`` over the
sources, in samples (crossfeed's schedule keeps it under one sample over every prefix; tf.data
draws each element at random). Also crossfeed's mixing overhead: the same Loader settings on the
largest source alone, both timed over whole epochs (an epoch's start, where its order is drawn,
included). Each reader runs in a process of its own.

    .venv/bin/python benchmarks/bench_mixture.py [--batches 1000] [--batch 256] [--shuffle global]

``--formats``: a mixture of one TFRecord dataset, WebDataset tars and a Parquet file (renamed to
one set of names, each source decoded by its own reader), against each source alone: the cost
of mixing formats is the mixture's time against its sources' own times for the samples it draws.

    .venv/bin/python benchmarks/bench_mixture.py --formats [--batch 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHTS = (5, 3, 2)
SIZES = (400_000, 200_000, 100_000)


def _paths(root: str) -> list[str]:
    sys.path.insert(0, os.path.dirname(HERE))
    from benchmarks.workloads import ensure

    return [ensure("tabular", n, root=root) for n in SIZES]


def _per_source(loader) -> None:
    """Give a mixture Loader the reader it had before one read over every source's shards
    (`UnionSplit`): a read per source, frames merged back into batch order — the "before". The
    one place outside the pipeline's tests that swaps a stage (`Pipeline.builder.reader`): it
    measures a strategy the pipeline no longer chooses, so no public operation builds it."""
    from crossfeed.read.stages.fetch import MixtureReader, SourceReader

    union = loader.pipeline.builder.reader.union
    readers = [
        SourceReader(sp, union.decoder.features, read=loader.options.read, whole_shards=False, keep_loaded=None)
        for sp in union.frames.split.splits
    ]
    loader.pipeline.builder.reader = MixtureReader(readers, loader.pipeline.builder.reader.starts)


def run_crossfeed(paths, batches: int, batch: int, shuffle: str, rounds: int) -> dict:
    """The mixture (one read per batch, and per source as before), and the largest source alone,
    with the Loader's defaults and with ``return_index=True`` (which adds ``__source__`` and
    ``__index__``), each timed over whole epochs — so an epoch's start (drawing its order) counts
    — in alternating rounds in one process (best round each: the box may be loaded); the
    proportions are counted over the mixture's first ``batches`` batches."""
    import crossfeed

    def mixture(return_index: bool):
        src = [crossfeed.Source(p, weight=w) for p, w in zip(paths, WEIGHTS)]
        return crossfeed.Loader(src, batch_size=batch, seed=0, shuffle=shuffle, return_index=return_index)

    def single(return_index: bool):
        return crossfeed.Loader(paths[0], batch_size=batch, seed=0, shuffle=shuffle, return_index=return_index)

    loaders = {
        "mixture": mixture(False),
        "mixture_ri": mixture(True),
        "per_source": mixture(False),
        "single": single(False),
        "single_ri": single(True),
    }
    _per_source(loaders["per_source"])
    counts = np.zeros(3, np.int64)
    it = loaders["mixture_ri"].epochs(None)
    for _ in range(batches):
        counts += np.bincount(next(it)["__source__"], minlength=3)
    for ld in loaders.values():  # warm: every shard mapped and checked once
        for _ in ld:
            pass
    best = dict.fromkeys(loaders, 0.0)
    cpu = dict.fromkeys(loaders, 0.0)
    for _ in range(rounds):
        for k, ld in loaders.items():
            n, t, c = 0, time.perf_counter(), time.process_time()
            for b in ld:  # one whole epoch
                n += len(b["label"])
            best[k] = max(best[k], n / (time.perf_counter() - t))
            cpu[k] = max(cpu[k], n / (time.process_time() - c))
    for ld in loaders.values():
        ld.close()
    # small records are built in the consumer's thread: CPU seconds are the work, even on a busy box
    out = {k: {"rate": best[k], "cpu_rate": cpu[k]} for k in loaders}
    out["mixture"].update(counts=counts.tolist(), n=batches * batch)
    return out


def run_tf(paths, batches: int, batch: int, shuffle: str) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import glob

    import tensorflow as tf

    spec = {"x": tf.io.FixedLenFeature([32], tf.float32), "label": tf.io.FixedLenFeature([], tf.int64)}
    parts = []
    for i, p in enumerate(paths):
        ds = tf.data.TFRecordDataset(
            sorted(glob.glob(os.path.join(p, "train-*.tfrecord"))), num_parallel_reads=tf.data.AUTOTUNE
        )
        if shuffle != "none":
            ds = ds.shuffle(16384, seed=i)
        parts.append(ds.repeat().map(lambda r, i=i: (r, tf.constant(i, tf.int64))))
    w = np.asarray(WEIGHTS, np.float64) / sum(WEIGHTS)
    mixed = tf.data.Dataset.sample_from_datasets(parts, weights=w.tolist(), seed=0)
    mixed = (
        mixed.batch(batch)
        .map(lambda r, s: (tf.io.parse_example(r, spec), s), num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(tf.data.AUTOTUNE)
    )
    it = iter(mixed.as_numpy_iterator())
    next(it)
    t, n, counts = time.perf_counter(), 0, np.zeros(3, np.int64)
    for _ in range(batches - 1):
        b, s = next(it)
        n += len(b["label"])
        counts += np.bincount(s, minlength=3)
    return {"rate": n / (time.perf_counter() - t), "counts": counts.tolist(), "n": n}


def _error(r: dict) -> float:
    w = np.asarray(WEIGHTS, np.float64) / sum(WEIGHTS)
    return float(np.abs(np.asarray(r["counts"]) - w * r["n"]).max())


def run_mosaic(paths, batches: int, batch: int, shuffle: str, root: str) -> dict:
    """mosaic streaming over the same samples written once as MDS shards (one stream per source,
    ``Stream(proportion=w/Σw)``), iterated in-process without a DataLoader, batched here."""
    import importlib.util
    import shutil
    import types

    if "streaming" not in sys.modules:  # its __init__ imports every integration (vision: torchvision);
        spec = importlib.util.find_spec("streaming")  # only streaming.base is needed
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = pkg
    from streaming.base import MDSWriter, Stream, StreamingDataset

    import crossfeed

    locals_ = []
    for i, p in enumerate(paths):
        out = os.path.join(root, f"mds-{os.path.basename(p)}")
        if not os.path.exists(os.path.join(out, "index.json")):
            shutil.rmtree(out, ignore_errors=True)
            with MDSWriter(out=out, columns={"x": "ndarray:float32:32", "label": "int64", "src": "int"}) as w:
                for b in crossfeed.Loader(p, batch_size=4096, shuffle="none"):
                    for x, y in zip(b["x"], b["label"].tolist()):
                        w.write({"x": x, "label": y, "src": i})
        locals_.append(out)
    w = np.asarray(WEIGHTS, np.float64) / sum(WEIGHTS)
    streams = [Stream(local=loc, proportion=float(f)) for loc, f in zip(locals_, w)]
    ds = StreamingDataset(
        streams=streams,
        shuffle=shuffle != "none",
        shuffle_seed=0,
        batch_size=batch,
        epoch_size=batches * batch + batch,
        cache_limit=None,
    )
    it = iter(ds)
    t, n, counts, seen = None, 0, np.zeros(3, np.int64), 0
    for sample in it:
        if seen == batch:  # the first batch is the warm-up, as for the others
            t = time.perf_counter()
        seen += 1
        if t is not None:
            n += 1
            counts[sample["src"]] += 1
            if n == (batches - 1) * batch:
                break
    return {"rate": n / (time.perf_counter() - t), "counts": counts.tolist(), "n": n}


FORMAT_SIZES = {"tfrecord": 60_000, "tar": 30_000, "parquet": 20_000}  # weights 5:3:2, as above


def _format_paths(root: str) -> dict[str, str]:
    """The same kind of samples (``x`` float32[32], a label) in each format the Loader reads:
    a crossfeed TFRecord dataset, WebDataset tars (webdataset's TarWriter; ``npy``/``cls``) and a
    Parquet file (pyarrow; ``vec``/``y``), each adopted with ``crossfeed index``; written once."""
    import crossfeed
    from crossfeed.write.adopt.index import index_dataset

    out = {k: os.path.join(root, f"formats-{k}-{n}") for k, n in FORMAT_SIZES.items()}
    rng = np.random.default_rng(0)
    if not os.path.exists(os.path.join(out["tfrecord"], "manifest.json")):
        n = FORMAT_SIZES["tfrecord"]
        x = rng.random((n, 32), dtype=np.float32)
        samples = ({"x": x[i], "label": i % 10} for i in range(n))
        crossfeed.write_dataset(out["tfrecord"], samples, num_shards=8, overwrite=True).close()
    if not os.path.exists(os.path.join(out["tar"], "manifest.json")):
        import webdataset as wds

        os.makedirs(out["tar"], exist_ok=True)
        with wds.ShardWriter(os.path.join(out["tar"], "part-%06d.tar"), maxcount=5000, verbose=0) as sink:
            for i in range(FORMAT_SIZES["tar"]):
                sink.write({"__key__": f"s{i:07d}", "npy": rng.random(32, dtype=np.float32), "cls": i % 10})
        index_dataset(out["tar"])
    if not os.path.exists(os.path.join(out["parquet"], "manifest.json")):
        import pyarrow as pa
        import pyarrow.parquet as pq

        n = FORMAT_SIZES["parquet"]
        os.makedirs(out["parquet"], exist_ok=True)
        vec = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 32, dtype=np.float32)), 32)
        table = pa.table({"vec": vec, "y": pa.array(np.arange(n) % 10)})
        pq.write_table(table, os.path.join(out["parquet"], "part.parquet"), row_group_size=5000)
        index_dataset(out["parquet"])
    return out


def run_formats(root: str, batch: int, shuffle: str, rounds: int) -> dict:
    """A mixture of the three formats, renamed to ``x``/``label`` (each source read and decoded by
    its own reader, the decoded parts merged), against each source alone with the same settings,
    timed over whole epochs in alternating rounds (best round each). What mixing costs is the
    mixture's time against the weighted sum of its sources' own times for the samples it draws
    from each; the largest source alone is printed too."""
    import crossfeed

    paths = _format_paths(root)
    rename = {"tfrecord": {}, "tar": {"npy": "x", "cls": "label"}, "parquet": {"vec": "x", "y": "label"}}
    kw = dict(batch_size=batch, seed=0, shuffle=shuffle)
    loaders = {
        "mixture": crossfeed.Loader(
            [crossfeed.Source(paths[k], weight=w, rename=rename[k]) for k, w in zip(FORMAT_SIZES, WEIGHTS)], **kw
        ),
        **{k: crossfeed.Loader(p, **kw) for k, p in paths.items()},
    }
    for ld in loaders.values():  # warm
        for _ in ld:
            pass
    best = dict.fromkeys(loaders, 0.0)
    for _ in range(rounds):
        for k, ld in loaders.items():
            n, t = 0, time.perf_counter()
            for b in ld:
                n += len(next(iter(b.values())))
            best[k] = max(best[k], n / (time.perf_counter() - t))
    for ld in loaders.values():
        ld.close()
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--shuffle", default="global", choices=["global", "block", "none"])
    ap.add_argument("--data", default=os.path.join(HERE, "_data"))
    ap.add_argument("--rounds", type=int, default=5, help="alternating timed epochs of crossfeed's readers")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--formats", action="store_true", help="a mixture of TFRecord, tar and Parquet sources instead")
    a = ap.parse_args(argv)
    if a.formats:
        r = run_formats(a.data, a.batch, a.shuffle, a.rounds)
        w = np.asarray(WEIGHTS, np.float64) / sum(WEIGHTS)
        expected = 1 / sum(f / r[k] for f, k in zip(w, FORMAT_SIZES))  # each draw at its source's own speed
        print(f"3 sources {FORMAT_SIZES}, weights {WEIGHTS}, batch {a.batch}, shuffle {a.shuffle}")
        for k in ("mixture", *FORMAT_SIZES):
            print(f"{'crossfeed ' + k + (' alone' if k != 'mixture' else ''):44} {r[k]:12,.0f} samples/s")
        print(
            f"mixing overhead vs the sources' own speeds, weighted: {expected / r['mixture'] - 1:+.1%} "
            f"(expected {expected:,.0f} samples/s); the largest source alone is {r['tfrecord'] / r['mixture']:.2f}× "
            f"the mixture (its tar and Parquet draws are slower per sample); best of {a.rounds} alternating epochs"
        )
        return
    paths = _paths(a.data)
    if a.child:
        if a.child == "tf":
            r = run_tf(paths, a.batches, a.batch, a.shuffle)
        elif a.child == "mosaic":
            r = run_mosaic(paths, a.batches, a.batch, a.shuffle, a.data)
        else:
            r = run_crossfeed(paths, a.batches, a.batch, a.shuffle, a.rounds)
        print(json.dumps(r))
        return
    out = {}
    for who in ("crossfeed", "tf", "mosaic"):
        cmd = [sys.executable, __file__, "--child", who, "--batches", str(a.batches), "--batch", str(a.batch)]
        cmd += ["--shuffle", a.shuffle, "--data", a.data, "--rounds", str(a.rounds)]
        got = subprocess.run(cmd, capture_output=True, text=True)
        if got.returncode:
            print(
                f"{who}: failed, skipped ({got.stderr.strip().splitlines()[-1] if got.stderr.strip() else got.returncode})"
            )
            continue
        out[who] = json.loads(got.stdout.strip().splitlines()[-1])
    cf = out["crossfeed"]
    print(f"3 tabular sources {SIZES}, weights {WEIGHTS}, batch {a.batch}, {a.batches} batches, shuffle {a.shuffle}")
    print(f"{'reader':44} {'samples/s':>12} {'proportion error (samples)':>28}")
    print(f"{'crossfeed mixture':44} {cf['mixture']['rate']:12,.0f} {_error(cf['mixture']):28.2f}")
    print(f"{'crossfeed mixture, return_index=True':44} {cf['mixture_ri']['rate']:12,.0f}")
    print(f"{'crossfeed mixture, a read per source (before)':44} {cf['per_source']['rate']:12,.0f}")
    print(f"{'crossfeed, largest source alone':44} {cf['single']['rate']:12,.0f}")
    print(f"{'crossfeed, largest source alone, return_index':44} {cf['single_ri']['rate']:12,.0f}")
    for who, name in (("tf", "tf.data sample_from_datasets"), ("mosaic", "mosaic streaming Stream(proportion=)")):
        if who in out:
            print(f"{name:44} {out[who]['rate']:12,.0f} {_error(out[who]):28.2f}")
    for key, what in (("rate", "wall clock"), ("cpu_rate", "CPU time")):
        single = cf["single"][key]
        print(
            f"mixing overhead vs the largest source alone ({what}): {single / cf['mixture'][key] - 1:+.1%} "
            f"(both with return_index=True: {cf['single_ri'][key] / cf['mixture_ri'][key] - 1:+.1%}; "
            f"before: {single / cf['per_source'][key] - 1:+.1%}); best of {a.rounds} alternating whole epochs"
        )
    for who in ("tf", "mosaic"):
        if who in out:
            print(f"crossfeed mixture / {who}: {cf['mixture']['rate'] / out[who]['rate']:.2f}×")


if __name__ == "__main__":
    main()
