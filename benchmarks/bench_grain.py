"""Host input throughput: crossfeed's Loader beside Grain's own pipeline on the same records, in one
run, global shuffle, batch 256, the ratio crossfeed / Grain's best configuration printed.

* Records: ``raw`` — an ``image`` uint8 (64, 64, 3) raw tensor + ``label`` int64; ``tabular`` —
  ``x`` 32 float32 + ``label`` int64. Generated once (seeded) into ``CROSSFEED_BENCH_DATA``
  (`benchmarks.workloads.cache_dir`) twice: a crossfeed dataset (``crossfeed.write_dataset``, 8
  TFRecord shards) and the very same values as 8 ArrayRecord files (``array_record``'s writer,
  ``group_size:1,uncompressed``: Grain's advice for random access, nothing to inflate).
* Grain: ``MapDataset.source(ArrayRecordDataSource(files)).shuffle(seed)`` (a global shuffle)
  ``.map(parse)`` — the cheapest parse a Grain user writes, ``np.frombuffer`` of the record's
  bytes laid out as ``label`` (8 bytes) then the values — ``.batch(256)``, read with thread
  prefetch (``to_iter_dataset(ReadOptions(num_threads, prefetch_buffer_size))``, several settings)
  and with process prefetch (``.mp_prefetch`` with 2 workers); also ``batch_fn`` parsing the
  batch's 256 records joined in one ``np.frombuffer`` (a hand optimisation beyond ``map``). Its
  best configuration is the one compared.
* crossfeed: ``crossfeed.Loader(path, batch_size=256, shuffle="global", seed=...)``, its default
  read options; and the same batches handed to JAX: through ``crossfeed.adapters.jax.JaxLoader``
  when this tree has it, else Loader + ``jax.device_put`` per batch (a stand-in, printed as such;
  `_crossfeed_jax_batches` is the one place to change). A third, informational line: Grain's
  pipeline over crossfeed's own records (`crossfeed.adapters.grain.GrainSource`).

Each line is one pipeline run over ``1 + --epochs`` epochs (its threads and processes started
once, as in training): the time to its first batch (pipeline built, first batch in hand), then
the best of the ``--epochs`` timed epochs after the first (samples/s, batches/s); every epoch is
checked to hold every record once (count and label sum). The JAX line goes to JAX's default
device (the CPU here) and waits for each batch to be ready there.

    .venv/bin/python -m benchmarks.bench_grain                       # 20k raw, 50k tabular: a few minutes
    .venv/bin/python -m benchmarks.bench_grain --raw 4000 --tabular 20000 --epochs 2   # quick
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np

try:  # run as `python -m benchmarks.bench_grain` or as a script
    from benchmarks import workloads
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import workloads

import crossfeed
from crossfeed.format.manifest import MANIFEST
from crossfeed.format.schema import Encoding, Feature, Schema

log = logging.getLogger("bench_grain")
BATCH = 256
SIDE = 64
SHARDS = 8
SEED = 0
GOALS = {"throughput": 5.0}  # crossfeed / Grain's best, samples/s; and first batch no later than Grain's
SCHEMAS = {
    "raw": Schema(
        [Feature("image", "uint8", (SIDE, SIDE, 3), Encoding.TENSOR), Feature("label", "int64", (), Encoding.INT64)]
    ),
    "tabular": Schema([Feature("x", "float32", (32,), Encoding.FLOAT), Feature("label", "int64", (), Encoding.INT64)]),
}
VALUE = {"raw": "image", "tabular": "x"}


# ---- data: one set of values, written for each reader ---------------------------------------------


def _values(kind: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    if kind == "raw":
        base = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
        return np.stack([np.roll(base, i, axis=0) for i in range(n)]), np.arange(n, dtype=np.int64) % 1000
    return rng.standard_normal((n, 32)).astype(np.float32), np.arange(n, dtype=np.int64) % 10


def prepare(kind: str, n: int) -> tuple[str, list[str], int]:
    """``(crossfeed dataset, ArrayRecord files, label sum)``, generated once."""
    root = os.path.join(workloads.cache_dir(), f"grain-{kind}-{n}")
    cf, ar = os.path.join(root, "crossfeed"), os.path.join(root, "arrayrecord")
    files = [os.path.join(ar, f"part-{s:05d}-of-{SHARDS:05d}.array_record") for s in range(SHARDS)]
    values, labels = None, None
    if not os.path.exists(os.path.join(cf, MANIFEST)):
        log.info("writing %s × %d as a crossfeed dataset in %s", kind, n, cf)
        values, labels = _values(kind, n)
        samples = ({VALUE[kind]: values[i], "label": labels[i]} for i in range(n))
        crossfeed.write_dataset(cf, samples, schema=SCHEMAS[kind], num_shards=SHARDS).close()
    done = os.path.join(ar, "done")
    if not os.path.exists(done):
        from array_record.python.array_record_module import ArrayRecordWriter

        log.info("writing %s × %d as ArrayRecord files in %s", kind, n, ar)
        if values is None:
            values, labels = _values(kind, n)
        os.makedirs(ar, exist_ok=True)
        per = -(-n // SHARDS)
        for s, path in enumerate(files):
            w = ArrayRecordWriter(path, "group_size:1,uncompressed")
            for i in range(s * per, min(n, (s + 1) * per)):
                w.write(labels[i].tobytes() + values[i].tobytes())
            w.close()
        open(done, "w").close()
    label_sum = int((np.arange(n) % (1000 if kind == "raw" else 10)).sum())
    return cf, files, label_sum


# ---- Grain's side -------------------------------------------------------------------------------


def parse_raw(record: bytes) -> dict:
    a = np.frombuffer(record, np.uint8)
    return {"image": a[8:].reshape(SIDE, SIDE, 3), "label": a[:8].view(np.int64)[0]}


def parse_tabular(record: bytes) -> dict:
    return {"x": np.frombuffer(record, np.float32, offset=8), "label": np.frombuffer(record, np.int64, count=1)[0]}


def batch_raw(records) -> dict:
    """A whole batch's records parsed at once: one join, one frombuffer."""
    a = np.frombuffer(b"".join(records), np.uint8).reshape(len(records), 8 + SIDE * SIDE * 3)
    return {"image": a[:, 8:].reshape(-1, SIDE, SIDE, 3), "label": a[:, :8].copy().view(np.int64)[:, 0]}


def batch_tabular(records) -> dict:
    a = np.frombuffer(b"".join(records), np.uint8).reshape(len(records), 8 + 32 * 4)
    return {"x": a[:, 8:].copy().view(np.float32), "label": a[:, :8].copy().view(np.int64)[:, 0]}


PARSE = {"raw": (parse_raw, batch_raw), "tabular": (parse_tabular, batch_tabular)}


def grain_configs(kind: str, files: list[str], procs: int) -> dict[str, Callable[[int], Iterator[dict]]]:
    """Grain's pipelines by name: each call builds one and iterates ``epochs`` epochs of it."""
    import grain

    parse, whole = PARSE[kind]

    def source(epochs: int, *, batch_fn=None):
        ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files)).shuffle(seed=SEED)
        ds = ds.batch(BATCH, batch_fn=batch_fn) if batch_fn else ds.map(parse).batch(BATCH)
        return ds.repeat(epochs)

    def threads(n: int, buffer: int, **kw):
        def run(epochs: int):
            return iter(
                source(epochs, **kw).to_iter_dataset(grain.ReadOptions(num_threads=n, prefetch_buffer_size=buffer))
            )

        return run

    def processes(n: int, **kw):
        def run(epochs: int):
            ds = source(epochs, **kw).to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=16))
            return iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=n)))

        return run

    return {
        "threads=1 buffer=16": threads(1, 16),
        "threads=4 buffer=16": threads(4, 16),
        "threads=16 buffer=500 (default)": threads(16, 500),
        f"mp_prefetch workers={procs}": processes(procs),
        "batch_fn threads=4 buffer=16": threads(4, 16, batch_fn=whole),
        f"batch_fn mp_prefetch workers={procs}": processes(procs, batch_fn=whole),
    }


# ---- crossfeed's side ---------------------------------------------------------------------------


def _crossfeed_batches(path: str, epochs: int) -> Iterator[dict]:
    with crossfeed.Loader(path, batch_size=BATCH, shuffle="global", seed=SEED) as loader:
        yield from loader.epochs(epochs)


def _crossfeed_jax_batches(path: str) -> tuple[str, bool, Callable[[int], Iterator[dict]]]:
    """``(label, drops the last partial batch, epochs maker)`` of crossfeed's batches as JAX arrays,
    each ready on the device: the JAX adapter when this tree has it, else the Loader +
    ``jax.device_put`` per batch."""
    import jax

    try:
        from crossfeed.adapters.jax import JaxLoader
    except ImportError:
        JaxLoader = None

    def ready(batches):
        for b in batches:
            yield jax.block_until_ready(b)

    if JaxLoader is not None:  # drop_last: its one choice (static shapes)
        return (
            "crossfeed.adapters.jax.JaxLoader",
            True,
            lambda epochs: ready(JaxLoader(path, batch_size=BATCH, shuffle="global", seed=SEED).epochs(epochs)),
        )
    return (
        "Loader + jax.device_put (stand-in: no crossfeed.adapters.jax)",
        False,
        lambda epochs: ready(jax.device_put(b) for b in _crossfeed_batches(path, epochs)),
    )


def _grain_over_crossfeed(path: str) -> Callable[[int], Iterator[dict]]:
    import grain

    from crossfeed.adapters.grain import GrainSource

    def run(epochs: int):
        ds = grain.MapDataset.source(GrainSource(path)).shuffle(seed=SEED).batch(BATCH).repeat(epochs)
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=16)))

    return run


# ---- measuring ----------------------------------------------------------------------------------


def measure(make: Callable[[int], Iterator[dict]], n: int, label_sum: int, epochs: int, *, drop_last=False) -> dict:
    """One pipeline over ``1 + epochs`` epochs: the time to its first batch (built, first batch in
    hand), the rest of that epoch as warm-up, then the best of the ``epochs`` timed epochs — a
    pipeline's processes and threads start once, as in training."""
    per = n // BATCH if drop_last else -(-n // BATCH)
    t0 = time.perf_counter()
    it = make(1 + epochs)
    got = [next(it)]
    first_s = time.perf_counter() - t0
    got += [next(it) for _ in range(per - 1)]
    _check(got, n, label_sum, drop_last)
    best, cpu = None, None
    for _ in range(epochs):
        c0, t0 = _cpu_seconds(), time.perf_counter()
        got = [next(it) for _ in range(per)]
        dt, dc = time.perf_counter() - t0, _cpu_seconds() - c0
        _check(got, n, label_sum, drop_last)
        best = dt if best is None else min(best, dt)
        cpu = dc if cpu is None else min(cpu, dc)
    if next(it, None) is not None:
        raise AssertionError("the pipeline gave more batches than its epochs hold")
    close = getattr(it, "close", None)
    if close is not None:
        close()
    samples = n // BATCH * BATCH if drop_last else n
    return {"first_s": first_s, "samples_s": samples / best, "batches_s": per / best, "cpu_us": cpu / samples * 1e6}


def _cpu_seconds() -> float:
    """CPU time of this process and its live children (Grain's worker processes): robust where the
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


def _check(batches: list, n: int, label_sum: int, drop_last: bool) -> None:
    """Every record once in the epoch (a drop_last reader: all but the remainder's)."""
    count = sum(len(b["label"]) for b in batches)
    total = sum(int(np.asarray(b["label"]).sum()) for b in batches)
    if drop_last and count == n // BATCH * BATCH:
        return
    if (count, total) != (n, label_sum):
        raise AssertionError(f"an epoch held {count} samples (label sum {total}), not {n} ({label_sum})")


def run(kinds: list[str], sizes: dict[str, int], epochs: int, procs: int) -> None:
    from absl import flags

    if not flags.FLAGS.is_parsed():  # Grain's worker processes read absl flags (absl.app.run parses them)
        flags.FLAGS.mark_as_parsed()
    for kind in kinds:
        n = sizes[kind]
        path, files, label_sum = prepare(kind, n)
        rows = []
        for name, make in grain_configs(kind, files, procs).items():
            rows.append(("grain", name, measure(make, n, label_sum, epochs)))
            _report(kind, *rows[-1])
        rows.append(("crossfeed", "Loader", measure(lambda e: _crossfeed_batches(path, e), n, label_sum, epochs)))
        _report(kind, *rows[-1])
        label, drop_last, make = _crossfeed_jax_batches(path)
        rows.append(("crossfeed+jax", label, measure(make, n, label_sum, epochs, drop_last=drop_last)))
        _report(kind, *rows[-1])
        rows.append(
            ("grain+crossfeed", "GrainSource threads=4", measure(_grain_over_crossfeed(path), n, label_sum, epochs))
        )
        _report(kind, *rows[-1])
        grain_rows = [r for r in rows if r[0] == "grain"]
        best = max(grain_rows, key=lambda r: r[2]["samples_s"])
        first = min(grain_rows, key=lambda r: r[2]["first_s"])
        cf = {r[0]: r[2] for r in rows}
        print(f"\n{kind} × {n}: Grain's best = {best[1]} ({best[2]['samples_s']:,.0f} samples/s)")
        cheapest = min(grain_rows, key=lambda r: r[2]["cpu_us"])
        for who in ("crossfeed", "crossfeed+jax"):
            ratio = cf[who]["samples_s"] / best[2]["samples_s"]
            ok = "meets" if ratio >= GOALS["throughput"] else "MISSES"
            per_cpu = cheapest[2]["cpu_us"] / cf[who]["cpu_us"]
            print(
                f"  {who:14s} / Grain best: {ratio:5.2f}× samples/s ({ok} the {GOALS['throughput']:.0f}× goal); "
                f"{per_cpu:5.2f}× fewer CPU µs/sample than Grain's cheapest ({cheapest[1]})"
            )
        fb = cf["crossfeed"]["first_s"]
        ok = "meets" if fb <= first[2]["first_s"] else "MISSES"
        print(
            f"  first batch: crossfeed {fb * 1e3:.1f} ms, Grain's fastest {first[2]['first_s'] * 1e3:.1f} ms "
            f"({first[1]}), Grain's best-throughput config {best[2]['first_s'] * 1e3:.1f} ms ({ok} the goal)\n",
            flush=True,
        )


def _report(kind: str, who: str, name: str, r: dict) -> None:
    print(
        f"{kind:8s} {who:15s} {name:58s} first batch {r['first_s'] * 1e3:8.1f} ms  "
        f"{r['samples_s']:12,.0f} samples/s  {r['batches_s']:9,.1f} batches/s  {r['cpu_us']:8.1f} CPU µs/sample",
        flush=True,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="raw,tabular")
    ap.add_argument("--raw", type=int, default=20_000)
    ap.add_argument("--tabular", type=int, default=50_000)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per line, the best kept")
    ap.add_argument("--processes", type=int, default=2, help="Grain's mp_prefetch workers")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run(a.workloads.split(","), {"raw": a.raw, "tabular": a.tabular}, a.epochs, a.processes)


if __name__ == "__main__":
    main()
