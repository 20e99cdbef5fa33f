"""TFDS prepared datasets read in place: crossfeed (``crossfeed index DIR --index-dir IDX``, no
conversion) vs TFDS's own reader (``builder.as_dataset`` → tf.data), on the very same shard files.

Workloads, each a dataset prepared by tensorflow-datasets itself (``GeneratorBasedBuilder``,
``download_and_prepare``, 8 shards a split), cached under ``$CROSSFEED_BENCH_DIR/tfds``:

* ``mnist``: ``Image(shape=(28, 28, 1))`` (PNG) + ``ClassLabel(10)`` — the classic TFDS layout;
* ``tabular``: ``Tensor(shape=(32,), float32)`` + ``ClassLabel``;
* ``raw``: ``Tensor(shape=(64, 64, 3), uint8, encoding="bytes")`` + ``ClassLabel``.

Both sides deliver the same numpy batches (``image``/``x`` and ``label``), batch 256 by default.
Shuffle ``none``: crossfeed in file order vs ``as_dataset(shuffle_files=False)``; ``global``:
crossfeed's exact global shuffle vs ``as_dataset(shuffle_files=True).shuffle(10_000)`` (windowed,
less work). TFDS's pipeline: ``as_dataset(read_config=ReadConfig(interleave_cycle_length=AUTOTUNE,
try_autocache=False)).batch(B).prefetch(AUTOTUNE)`` then ``tfds.as_numpy`` (without
``try_autocache=False`` TFDS keeps a dataset under 250 MiB read in file order in memory, decoded,
after its first epoch: a memory cache, not a reader). Each reader runs in a process of its own
(crossfeed's never imports TensorFlow): one untimed warm-up epoch (label sum checked: every sample
once), then ``--epochs`` timed epochs, best kept; ``--rounds`` repeats, readers interleaved.

    .venv/bin/python benchmarks/bench_tfds.py --quick        # small sizes, ~3 minutes
    .venv/bin/python benchmarks/bench_tfds.py --workloads mnist --batch-sizes 256,1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SIZES = {"mnist": 30_000, "tabular": 100_000, "raw": 8_000}
QUICK = {"mnist": 8_000, "tabular": 30_000, "raw": 3_000}
GOAL = 1.5
SHUFFLE_BUFFER = 10_000


def _builder(kind: str, n: int, data_dir: str):
    import numpy as np
    import tensorflow_datasets as tfds

    f = tfds.features
    value = {
        "mnist": ("image", f.Image(shape=(28, 28, 1))),
        "tabular": ("x", f.Tensor(shape=(32,), dtype=np.float32)),
        "raw": ("image", f.Tensor(shape=(64, 64, 3), dtype=np.uint8, encoding="bytes")),
    }[kind]

    class Bench(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, features=f.FeaturesDict({value[0]: value[1], "label": f.ClassLabel(num_classes=10)})
            )

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            rng = np.random.default_rng(0)
            for i in range(n):
                if kind == "mnist":
                    v = (rng.integers(0, 8, (28, 28, 1)) * 32).astype(np.uint8)  # compressible, like digits
                elif kind == "tabular":
                    v = rng.standard_normal(32).astype(np.float32)
                else:
                    v = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
                yield i, {value[0]: v, "label": i % 10}

    Bench.name = f"bench_{kind}_{n}"
    return Bench(data_dir=data_dir), value[0]


def prepare(kind: str, n: int, root: str) -> tuple[str, str]:
    """``(tfds data dir, crossfeed index dir)``, built once and cached."""
    index_dir = os.path.join(root, f"index-{kind}-{n}")
    done = os.path.join(index_dir, "crossfeed.json")
    if not os.path.exists(done):
        subprocess.run([sys.executable, __file__, "--prepare", kind, str(n), root], check=True, stdout=sys.stderr)
    with open(done) as f:
        return json.load(f)["data_root"], index_dir


def _prepare_child(kind: str, n: int, root: str) -> None:
    import tensorflow_datasets as tfds

    builder, _ = _builder(kind, n, os.path.join(root, "data"))
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=8))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "crossfeed.cli.main",
            "index",
            str(builder.data_dir),
            "--index-dir",
            os.path.join(root, f"index-{kind}-{n}"),
            "--force",
        ],
        check=True,
    )


def reader_crossfeed(index_dir: str, data_dir: str, kind: str, b: int, shuffle: str):
    from crossfeed.read.loader import Loader

    loader = Loader(index_dir, batch_size=b, shuffle=shuffle, seed=0, allowed_roots=[data_dir])  # our own data
    return loader, loader.close


def reader_tfds(index_dir: str, data_dir: str, kind: str, b: int, shuffle: str):
    import tensorflow as tf
    import tensorflow_datasets as tfds

    builder = tfds.builder_from_directory(data_dir)
    auto = tf.data.AUTOTUNE
    # try_autocache=False: TFDS would otherwise keep a small dataset read in file order in memory,
    # decoded, after the first epoch; both sides read and decode the files every epoch.
    read_config = tfds.ReadConfig(interleave_cycle_length=auto, shuffle_seed=0, try_autocache=False)
    ds = builder.as_dataset(split="train", shuffle_files=shuffle == "global", read_config=read_config)
    if shuffle == "global":
        ds = ds.shuffle(SHUFFLE_BUFFER, seed=0)
    ds = ds.batch(b).prefetch(auto)

    class Epochs:
        def __iter__(self):
            return iter(tfds.as_numpy(ds))

    return Epochs(), lambda: None


READERS = {"crossfeed": reader_crossfeed, "tfds": reader_tfds}


def child(reader: str, index_dir: str, data_dir: str, kind: str, configs: list, epochs: int, n: int) -> list[dict]:
    if reader == "tfds":
        import tensorflow  # noqa: F401  (imported before any clock starts)
    out = []
    for b, shuffle in configs:
        t0 = time.perf_counter()
        it, close = READERS[reader](index_dir, data_dir, kind, b, shuffle)
        first, seen, total = None, 0, 0
        for batch in it:  # warm-up epoch: every sample once
            first = first if first is not None else time.perf_counter() - t0
            seen += len(batch["label"])
            total += int(batch["label"].sum())
        want = sum(i % 10 for i in range(n))
        if seen != n or total != want:
            raise SystemExit(
                f"{reader} {kind} b={b} {shuffle}: read {seen} samples (label sum {total}), want {n} ({want})"
            )
        best = None
        for _ in range(epochs):
            t = time.perf_counter()
            k = sum(len(batch["label"]) for batch in it)
            rate = k / (time.perf_counter() - t)
            best = rate if best is None else max(best, rate)
        close()
        out.append({"b": b, "shuffle": shuffle, "rate": best, "first": first})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes")
    ap.add_argument("--workloads", default=",".join(SIZES))
    ap.add_argument("--batch-sizes", default="256")
    ap.add_argument("--shuffles", default="none,global")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    root = os.path.join(
        os.environ.get("CROSSFEED_BENCH_DIR", os.path.join(tempfile.gettempdir(), "crossfeed-bench")), "tfds"
    )
    os.makedirs(root, exist_ok=True)
    configs = [(int(b), s) for b in args.batch_sizes.split(",") for s in args.shuffles.split(",")]
    print(f"crossfeed (TFDS dir adopted in place) vs TFDS as_dataset, same shard files; {os.cpu_count()} CPUs")
    print(f"{'workload':<9} {'n':>7} {'batch':>5} {'shuffle':<7} {'crossfeed/s':>12} {'tfds/s':>10} {'ratio':>6}  goal")
    for kind in args.workloads.split(","):
        n = (QUICK if args.quick else SIZES)[kind]
        data_dir, index_dir = prepare(kind, n, root)
        best: dict = {}
        for _ in range(args.rounds):
            for reader in READERS:
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    reader,
                    index_dir,
                    data_dir,
                    kind,
                    json.dumps(configs),
                    str(args.epochs),
                    str(n),
                ]
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
                if res.returncode != 0:
                    raise SystemExit(f"{reader} failed:\n{res.stderr[-3000:]}")
                for r in json.loads(res.stdout.strip().splitlines()[-1]):
                    key = (reader, r["b"], r["shuffle"])
                    best[key] = max(best.get(key, 0.0), r["rate"])
        for b, s in configs:
            cf, tf = best[("crossfeed", b, s)], best[("tfds", b, s)]
            ratio = cf / tf
            print(
                f"{kind:<9} {n:>7} {b:>5} {s:<7} {cf:>12,.0f} {tf:>10,.0f} {ratio:>5.2f}×  {'✓' if ratio >= GOAL else '✗'} ≥{GOAL}×"
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--prepare":
        _prepare_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, reader, index_dir, data_dir, kind, configs, epochs, n = sys.argv
        print(json.dumps(child(reader, index_dir, data_dir, kind, json.loads(configs), int(epochs), int(n))))
    else:
        main()
