"""Sequences: packed rows of tokens — padding and tokens/s, crossfeed vs Grain, PyTorch, tf.data.

Two corpora (`benchmarks.seqdata`, built once): ``synthetic`` (log-normal lengths of mean 600
tokens, vocabulary 32,000, uint16) and ``python`` (the standard library's ``.py`` files, one
document per file, tokenized by a BPE of 8,000 trained on them here). Documents longer than a row
are cut into row-sized pieces first, so every system gets the same documents and every token.
Each system delivers one epoch (documents shuffled) as batches of ``--batch`` rows; printed per
system: padding (pad tokens / row tokens, over the epoch), tokens/s (real tokens — not padding —
delivered per second, the first batch excluded; also per second of the process's CPU time, as the
box may be loaded — not for torch with workers, whose CPU is theirs), and crossfeed's ratio to it:

* **crossfeed** ``Loader(xf, batch_size=B, pack=Pack(length=L, features=("tokens",)))``: dense
  ``tokens``/``segment_ids``/``positions`` ``(B, L)`` (best-fit, 32 open rows, planned from the
  lengths files); and ``Loader(xf, batch_size=1, batch_by_tokens=B·L)`` (whole documents,
  padded to each batch's longest: ``segment_ids`` is 1 on tokens);
* **Grain** ``grain.experimental.FirstFitPackIterDataset`` (first-fit into ``num_packing_bins``
  rows, all flushed when a document fits none) over ``MapDataset.source`` of the documents in
  memory (the cheapest Grain pipeline: no file reads, no decode), ``.batch(B)``: ``tokens``,
  ``tokens_segment_ids``, ``tokens_positions`` ``(B, L)``; with ``B`` bins (the usual setting)
  and with 64;
* **PyTorch** ``DataLoader(batch_size=B, shuffle=True)`` over the same in-memory documents with
  a collate that pads each batch to its longest document (``tokens`` + ``attention_mask``),
  ``num_workers`` 0 and 2;
* **tf.data** ``TFRecordDataset`` over crossfeed's very shards (``decode_raw``) →
  ``shuffle(8192)`` → ``bucket_by_sequence_length`` (boundaries 64 … L, batch sizes
  ``B·L // boundary``: about ``B·L`` tokens a batch) → ``prefetch``.

Each system runs in a process of its own (TensorFlow and torch do not share one well).

    .venv/bin/python benchmarks/bench_sequences.py --quick          # small corpora, ~3 minutes on 2 cores
    .venv/bin/python benchmarks/bench_sequences.py                  # 20,000 documents + the whole stdlib
    .venv/bin/python benchmarks/bench_sequences.py --corpora synthetic --peers grain8,torch0

``--plan-scale``: a corpus of ``--plan-docs`` documents (default 10^8; one real shard of 10^5
documents with its lengths file, hard-linked under every shard name the manifest lists) — the
time to open it and produce the first packed batch, and to open it, resume a state near the
epoch's end (`make_resume_state`) and produce the first packed batch after it, and the process's
memory (goal: < 1 s and < 200 MB each), beside reading every lengths file into memory (what a planner that loads all lengths
would hold) and crossfeed opening it for a plain (unpacked) first batch.

    .venv/bin/python benchmarks/bench_sequences.py --plan-scale [--plan-docs 100000000]

Data lives in ``--data`` (default ``benchmarks/_data``, or ``CROSSFEED_BENCH_DATA``).
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
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import seqdata  # noqa: E402

LENGTH, BATCH = 2048, 8
BOUNDARIES = (64, 128, 256, 512, 1024)  # tf.data buckets: < 64, < 128, …, < 1024, ≥ 1024 (≤ L)
PEERS = {  # name: (label, child arguments)
    "crossfeed": ("crossfeed Pack (best-fit, bins=32)", ["--peer", "crossfeed"]),
    "crossfeed-tokens": ("crossfeed batch_by_tokens=B·L", ["--peer", "crossfeed-tokens"]),
    "grain8": ("Grain FirstFitPack, bins=B", ["--peer", "grain", "--bins", "B"]),
    "grain64": ("Grain FirstFitPack, bins=64", ["--peer", "grain", "--bins", "64"]),
    "torch0": ("torch DataLoader pad-to-max, w=0", ["--peer", "torch", "--workers", "0"]),
    "torch2": ("torch DataLoader pad-to-max, w=2", ["--peer", "torch", "--workers", "2"]),
    "tf": ("tf.data bucket_by_sequence_length", ["--peer", "tf"]),
}
GOAL_RATIO, GOAL_PAD = 3.0, 0.02  # crossfeed ≥ 3× Grain's packing; padding ≤ 2%
PLAN_GOAL_S, PLAN_GOAL_MB = 1.0, 200


class Docs:
    """The corpus's documents in memory (memory-mapped ``flat.npy`` + ``offsets.npy``): what
    the Grain and PyTorch peers read. ``docs[i]`` is ``{"tokens": uint16 array}``."""

    def __init__(self, root: str):
        self.flat = np.load(os.path.join(root, "flat.npy"), mmap_mode="r")
        self.offsets = np.load(os.path.join(root, "offsets.npy"))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        return {"tokens": np.asarray(self.flat[self.offsets[i] : self.offsets[i + 1]])}


class Count:
    """One epoch's tally: rows, row tokens and real tokens in all, and the real tokens and
    seconds after the first batch (the timed part)."""

    def __init__(self):
        self.rows = self.row_tokens = self.real = self.timed_real = self.batches = 0
        self.t0 = self.first_s = None
        self.start = time.perf_counter()

    def add(self, rows: int, row_tokens: int, real: int) -> None:
        self.rows += rows
        self.row_tokens += row_tokens
        self.real += real
        self.batches += 1
        if self.t0 is None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            self.first_s = self.t0 - self.start
        else:
            self.timed_real += real

    def result(self) -> dict:
        seconds = time.perf_counter() - self.t0
        cpu = time.process_time() - self.c0
        return {
            "cpu_rate": self.timed_real / cpu if cpu > 0 else 0.0,
            "rows": self.rows,
            "row_tokens": self.row_tokens,
            "real": self.real,
            "batches": self.batches,
            "seconds": seconds,
            "rate": self.timed_real / seconds if seconds > 0 else 0.0,
            "first_s": self.first_s,
        }


# ---------------------------------------------------------------- crossfeed


def _crossfeed_packed_rows(path: str, length: int, batch: int) -> dict | None:
    """crossfeed's packed rows: one epoch of ``Loader(path, batch_size=batch,
    pack=Pack(length=length, features=("tokens",)))``, counted. None where this tree has no
    ``crossfeed.Pack`` (the row is skipped)."""
    import crossfeed

    if not hasattr(crossfeed, "Pack"):
        print("crossfeed packing not available in this tree", file=sys.stderr)
        return None
    pack = crossfeed.Pack(length=length, features=("tokens",))
    count = Count()
    with crossfeed.Loader(path, batch_size=batch, seed=0, pack=pack) as loader:
        for b in loader:
            seg = np.asarray(b["segment_ids"])
            count.add(seg.shape[0], seg.size, int(np.count_nonzero(seg)))
    return count.result()


def _crossfeed_token_batches(path: str, length: int, batch: int) -> dict | None:
    """crossfeed's length-aware batches, ``batch_by_tokens=batch·length``, padded: counted as
    the batches come (``segment_ids`` or a per-row length where they carry one; a ragged object
    array otherwise). None where this tree has no packing (no ``crossfeed.Pack``)."""
    import crossfeed

    if not hasattr(crossfeed, "Pack"):
        print("crossfeed packing not available in this tree", file=sys.stderr)
        return None
    count = Count()
    with crossfeed.Loader(path, batch_size=1, seed=0, batch_by_tokens=batch * length) as loader:
        for b in loader:  # (documents, longest): segment_ids is 1 on tokens, 0 on padding
            seg = np.asarray(b["segment_ids"])
            count.add(seg.shape[0], seg.size, int(np.count_nonzero(seg)))
    return count.result()


# ---------------------------------------------------------------- peers


def run_grain(root: str, length: int, batch: int, bins: int) -> dict:
    import grain

    ds = grain.MapDataset.source(Docs(root)).shuffle(seed=0).to_iter_dataset()
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"tokens": length}, num_packing_bins=bins, seed=0, shuffle_bins=True
    ).batch(batch)
    count = Count()
    for b in ds:
        seg = b["tokens_segment_ids"]
        count.add(seg.shape[0], seg.size, int(np.count_nonzero(seg)))
    return count.result()


def _pad_collate(docs):
    lens = [len(d["tokens"]) for d in docs]
    out = np.zeros((len(docs), max(lens)), np.int32)
    for row, d in zip(out, docs):
        row[: len(d["tokens"])] = d["tokens"]
    import torch

    lens_t = torch.tensor(lens)
    mask = torch.arange(out.shape[1])[None, :] < lens_t[:, None]
    return {"tokens": torch.from_numpy(out), "attention_mask": mask, "lengths": lens_t}


def run_torch(root: str, length: int, batch: int, workers: int) -> dict:
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    loader = DataLoader(
        Docs(root),
        batch_size=batch,
        shuffle=True,
        collate_fn=_pad_collate,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )
    count = Count()
    for b in loader:
        count.add(b["tokens"].shape[0], b["tokens"].numel(), int(b["lengths"].sum()))
    return count.result()


def run_tf(root: str, length: int, batch: int) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import glob

    import tensorflow as tf

    files = sorted(glob.glob(os.path.join(root, "xf", "*.tfrecord")))
    spec = {"tokens": tf.io.FixedLenFeature([], tf.string)}

    def parse(rec):
        tok = tf.cast(tf.io.decode_raw(tf.io.parse_single_example(rec, spec)["tokens"], tf.uint16), tf.int32)
        return {"tokens": tok, "length": tf.shape(tok)[0]}

    bounds = list(BOUNDARIES)
    sizes = [batch * length // b for b in bounds] + [batch * length // length]
    ds = (
        tf.data.Dataset.from_tensor_slices(files)
        .shuffle(len(files), seed=0)
        .interleave(tf.data.TFRecordDataset, cycle_length=len(files), num_parallel_calls=tf.data.AUTOTUNE)
        .shuffle(8192, seed=0)
        .map(parse, num_parallel_calls=tf.data.AUTOTUNE)
        .bucket_by_sequence_length(lambda d: d["length"], bounds, sizes)
        .prefetch(tf.data.AUTOTUNE)
    )
    count = Count()
    for b in ds.as_numpy_iterator():
        count.add(b["tokens"].shape[0], b["tokens"].size, int(b["length"].sum()))
    return count.result()


def child(a) -> dict | None:
    root = a.corpus
    if a.peer == "crossfeed":
        return _crossfeed_packed_rows(os.path.join(root, "xf"), a.length, a.batch)
    if a.peer == "crossfeed-tokens":
        return _crossfeed_token_batches(os.path.join(root, "xf"), a.length, a.batch)
    if a.peer == "grain":
        return run_grain(root, a.length, a.batch, a.batch if a.bins == "B" else int(a.bins))
    if a.peer == "torch":
        return run_torch(root, a.length, a.batch, a.workers)
    if a.peer == "tf":
        return run_tf(root, a.length, a.batch)
    if a.peer == "plan":
        return plan_child(a.corpus, a.length, a.batch, a.how)
    raise SystemExit(f"unknown peer {a.peer}")


# ---------------------------------------------------------------- plan scale


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    """This process's peak RSS (VmHWM: unlike ``ru_maxrss``, not carried over from the parent
    that forked it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


RESUME_BEFORE_END = 10**4  # the resumed state stands this many documents before the epoch's end


def resume_state_file(path: str) -> str:
    return os.path.join(os.path.dirname(path), os.path.basename(path) + "-resume-state.json")


def make_resume_state(path: str, length: int, batch: int) -> dict:
    """A packed state (best-fit, 32 bins) standing ``RESUME_BEFORE_END`` documents before the end
    of epoch 0 — what `Loader.state_dict` saves there: the packer's cursor with ``bins`` open
    rows (here the documents just before it, one each) at document position ``D``. Its row
    number is estimated (``D`` × the mean length / ``length``) since no run walked the 10^9
    documents before it; a resume never reads them, which is what is measured."""
    import crossfeed

    pack = crossfeed.Pack(length=length, features=("tokens",))
    with crossfeed.Loader(path, batch_size=batch, seed=0, pack=pack) as loader:
        sampler = loader.pipeline.sampler
        docs = sampler.total - RESUME_BEFORE_END
        ids = sampler.order(0)(np.arange(docs - 4 * pack.bins, docs, dtype=np.int64))
        lens = sampler.lengths(ids)
        rows = [[[int(i), 0, int(n), int(n)]] for i, n in zip(ids, lens) if 0 < n < length][: pack.bins]
        mean = float(sampler.lengths.shard(0, 0).mean())
        at = int(docs * mean / length)
        state = dict(
            loader.state_at(0, 0), position=at
        )  # (a state at ``at`` would walk there: the cursor is set below)
    state["pack"] = {"epoch": 0, "rows": at, "documents": int(docs), "offset": 0, "open": rows}
    with open(resume_state_file(path), "w") as f:
        json.dump(state, f)
    return {"documents": int(docs), "rows": at}


def plan_child(path: str, length: int, batch: int, how: str) -> dict | None:
    """In a fresh process: ``how`` = ``pack`` (crossfeed opens the corpus and makes its first
    packed batch), ``resume`` (crossfeed opens it, loads the state `make_resume_state` wrote and
    makes the first packed batch after it), ``plain`` (crossfeed opens it and makes a first plain
    batch of ``batch`` documents, shuffle global) or ``lengths`` (numpy reads every lengths file
    into one array)."""
    import crossfeed

    if how == "state":
        return make_resume_state(path, length, batch)
    base = _rss_mb()
    t = time.perf_counter()
    if how == "resume":
        with open(resume_state_file(path)) as f:
            state = json.load(f)
        loader = crossfeed.Loader(
            path, batch_size=batch, seed=0, pack=crossfeed.Pack(length=length, features=("tokens",))
        )
        loader.load_state_dict(state)
        b = next(iter(loader))
        got = int(np.count_nonzero(b["segment_ids"]))
        assert loader.position == state["position"] + batch  # the batch after the state's position
    elif how == "pack":
        if not hasattr(crossfeed, "Pack"):
            print("crossfeed packing not available in this tree", file=sys.stderr)
            return None
        loader = crossfeed.Loader(
            path, batch_size=batch, seed=0, pack=crossfeed.Pack(length=length, features=("tokens",))
        )
        b = next(iter(loader))
        got = int(np.count_nonzero(b["segment_ids"]))
    elif how == "plain":
        loader = crossfeed.Loader(path, batch_size=batch, seed=0, shuffle="global")
        b = next(iter(loader))
        got = sum(len(x) for x in b["tokens"])
    else:
        import glob

        files = sorted(glob.glob(os.path.join(path, "*.len")))
        lengths = np.concatenate([np.fromfile(f, "<u4") for f in files])
        got = int(lengths.sum())
        loader = None
    seconds = time.perf_counter() - t
    out = {
        "seconds": seconds,
        "rss_mb": _rss_mb(),
        "base_mb": base,
        "peak_mb": _peak_mb(),
        "tokens": got,
    }
    if loader is not None:
        loader.close()
    return out


def plan_scale(a) -> None:
    per_shard = min(a.plan_per_shard, a.plan_docs)
    t = time.perf_counter()
    path = seqdata.fabricate_big(a.data, a.plan_docs, per_shard, a.length)
    made = time.perf_counter() - t
    with open(os.path.join(path, seqdata.MANIFEST)) as f:
        man = json.load(f)
    split = man["splits"]["train"]
    n, shards = split["num_records"], len(split["shards"])
    has_len = bool(man.get("lengths"))
    print(
        f"{n:,} documents in {shards} shards of {per_shard:,} (one real shard hard-linked; "
        f"{split['num_bytes'] / 2**30:,.0f} GiB of shards as listed), lengths files: {'yes' if has_len else 'no'}"
        f"{f'; made in {made:.0f} s' if made > 1 else ''}"
    )
    cmd = [sys.executable, os.path.abspath(__file__), "--peer", "plan", "--how", "state", "--corpus", path]
    where = _run(cmd + ["--length", str(a.length), "--batch", str(a.batch)], a.timeout)
    if where is not None:
        print(
            f"resumed state: document {where['documents']:,} of {n:,}, row {where['rows']:,} (best-fit, 32 open rows)"
        )
    print(f"{'':44} {'seconds':>8} {'RSS MB':>8} {'above import':>13} {'peak MB':>8}")
    for how, label in (
        ("pack", f"crossfeed open + first packed batch ({a.batch}×{a.length})"),
        ("resume", "crossfeed open + resume + first packed batch"),
        ("plain", f"crossfeed open + first plain batch ({a.batch} docs)"),
        ("lengths", "numpy: every lengths file into memory"),
    ):
        cmd = [sys.executable, os.path.abspath(__file__), "--peer", "plan", "--how", how, "--corpus", path]
        cmd += ["--length", str(a.length), "--batch", str(a.batch)]
        r = _run(cmd, a.timeout)
        if r is None:
            print(f"{label:44} failed (above)")
            continue
        goal = ""
        if how in ("pack", "resume"):
            ok = r["seconds"] < PLAN_GOAL_S and r["peak_mb"] < PLAN_GOAL_MB
            goal = f"  goal < {PLAN_GOAL_S:.0f} s, < {PLAN_GOAL_MB} MB {'✓' if ok else '✗'}"
        print(
            f"{label:44} {r['seconds']:8.3f} {r['rss_mb']:8.0f} {r['rss_mb'] - r['base_mb']:13.0f} "
            f"{r['peak_mb']:8.0f}{goal}"
        )


# ---------------------------------------------------------------- parent


def _run(cmd: list[str], timeout: float) -> dict | None:
    try:
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  ({' '.join(cmd[2:5])}: over {timeout:.0f} s, skipped)")
        return None
    if got.returncode:
        err = got.stderr.strip().splitlines()
        print(f"  ({' '.join(cmd[2:5])}: failed: {err[-1] if err else got.returncode})")
        return None
    line = got.stdout.strip().splitlines()[-1] if got.stdout.strip() else "null"
    return json.loads(line)


def corpora(a) -> dict[str, str]:
    out = {}
    for name in a.corpora.split(","):
        t = time.perf_counter()
        if name == "synthetic":
            out[name] = seqdata.synthetic(a.data, a.docs, a.length)
        elif name == "python":
            out[name] = seqdata.python_corpus(a.data, a.length, a.files)
        else:
            raise SystemExit(f"unknown corpus {name}")
        if time.perf_counter() - t > 1:
            print(f"(built {out[name]} in {time.perf_counter() - t:.0f} s)")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5,000 synthetic documents, 400 stdlib files")
    ap.add_argument("--docs", type=int, help="synthetic documents (default 20,000; --quick 5,000)")
    ap.add_argument("--files", type=int, help="stdlib files (default all; --quick 400)")
    ap.add_argument("--corpora", default="synthetic,python")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"any of {','.join(PEERS)}")
    ap.add_argument("--length", type=int, default=LENGTH)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--data", default=os.environ.get("CROSSFEED_BENCH_DATA", os.path.join(HERE, "_data")))
    ap.add_argument("--timeout", type=float, default=300, help="seconds per system")
    ap.add_argument("--plan-scale", action="store_true")
    ap.add_argument("--plan-docs", type=int, default=10**8)
    ap.add_argument("--plan-per-shard", type=int, default=10**5)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--bins", default="B", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--how", default="pack", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.peer:
        print(json.dumps(child(a)))
        return
    if a.plan_scale:
        plan_scale(a)
        return
    a.docs = a.docs or (5_000 if a.quick else 20_000)
    a.files = a.files or (400 if a.quick else None)
    for name, root in corpora(a).items():
        with open(os.path.join(root, "meta.json")) as f:
            meta = json.load(f)
        what = (
            f"{meta['source_docs']:,} documents, log-normal lengths of mean {seqdata.MEAN_LEN}"
            if name == "synthetic"
            else f"{meta['files']:,} stdlib .py files ({meta['bytes'] / 2**20:.0f} MiB), BPE vocab {meta['vocab']:,}"
        )
        print(
            f"\n{name}: {what}; {meta['docs']:,} pieces of ≤ {a.length} tokens, {meta['tokens']:,} tokens "
            f"(mean {meta['tokens'] / meta['docs']:.0f}); rows of {a.length}, batches of {a.batch} rows"
        )
        print(
            f"{'system':36} {'padding':>8} {'tokens/s':>11} {'CPU tok/s':>11} {'batches':>8} {'1st batch s':>11} {'tokens ok':>9}  crossfeed ×"
        )
        results = {}
        for key in a.peers.split(","):
            label, extra = PEERS[key]
            cmd = [sys.executable, os.path.abspath(__file__), "--corpus", root, *extra]
            cmd += ["--length", str(a.length), "--batch", str(a.batch)]
            r = _run(cmd, a.timeout)
            if r is None:
                print(f"{label:36} failed (above)")
                continue
            results[key] = r
            pad = 1 - r["real"] / r["row_tokens"]
            cf = results.get("crossfeed")
            ratio = f"{cf['rate'] / r['rate']:.2f}×" if cf and not key.startswith("crossfeed") else ""
            cpu = "—" if key == "torch2" else f"{r['cpu_rate']:,.0f}"  # its workers' CPU is not counted
            ok = "✓" if r["real"] == meta["tokens"] else f"✗ {r['real']:,}"
            print(
                f"{label:36} {pad:8.2%} {r['rate']:11,.0f} {cpu:>11} {r['batches']:8,} {r['first_s']:11.3f} {ok:>9}  {ratio}",
                flush=True,
            )
        cf = results.get("crossfeed")
        if cf:
            pad = 1 - cf["real"] / cf["row_tokens"]
            print(f"goal padding ≤ {GOAL_PAD:.0%}: {pad:.2%} {'✓' if pad <= GOAL_PAD else '✗'}")
            for g in ("grain8", "grain64"):
                if g in results:
                    ratio = cf["rate"] / results[g]["rate"]
                    print(f"goal ≥ {GOAL_RATIO:.0f}× {PEERS[g][0]}: {ratio:.2f}× {'✓' if ratio >= GOAL_RATIO else '✗'}")


if __name__ == "__main__":
    main()
