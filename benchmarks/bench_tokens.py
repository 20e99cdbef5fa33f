"""Language-model tokens: packed rows of 2,048 — crossfeed beside LitData's ``TokensLoader`` and
MosaicML Streaming.

One generated corpus (``--docs`` documents of log-normal length, mean ~600 tokens, σ = 1,
uint32 ids below 50,000; built once under ``--data``), written by each tool's own writer, then
read for one epoch (shuffled) as batches of ``--batch`` rows of ``--length`` tokens:

* **crossfeed** ``Loader(xf, batch_size=B, pack=Pack(L, split="rows"), num_threads=0)``
  (concatenate and chunk) and ``Pack(L)`` (best-fit into 32 open rows), both with
  ``segment_ids``/``positions``, and ``Pack(L, split="rows", segments=False)`` (the tokens
  alone: what LitData's rows hold); ``num_threads=0`` builds each batch in the consumer's thread
  (a packed batch is a few numpy calls: threads only hand it over), and the Loader's default
  (2 threads) is printed beside it; through ``crossfeed.adapters.torch.TorchDataset`` +
  ``StatefulLoader(num_workers=2)`` for the worker rows;
* **LitData** ``StreamingDataset(ld, item_loader=TokensLoader(block_size=L), shuffle=True)``
  through ``StreamingDataLoader(batch_size=B, num_workers=0 / 2)`` (concatenate and chunk);
* **MosaicML Streaming** the pre-tokenized LM path llm-foundry uses: the writer concatenates the
  documents and cuts rows of L tokens at write time (``MDSWriter(columns={"tokens":
  "ndarray:uint32"})``, 64 MB shards, no compression), read by
  ``StreamingDataset(local=mds, shuffle=True, batch_size=B)`` through a torch
  ``DataLoader(batch_size=B, num_workers=0 / 2)``.

Printed per system: tokens/s (row tokens delivered per second, the first batch excluded) and
crossfeed's ratio to LitData's and MosaicML's; the share of the corpus's tokens the epoch
delivered (row tokens, padding included, over corpus tokens: ~1 for concatenate-and-chunk — every
token once, less the tail — a little over 1 for best-fit, which pads); and the write time of the
same token arrays (tokenization excluded): crossfeed ``write_dataset`` (8 shards; lengths files —
what packing plans from — written in the same pass) against LitData's ``optimize``
(``TokensLoader``, one worker) and MosaicML's ``MDSWriter``. Each read runs in a process of its
own; the machine's load average is printed beside the numbers.

    make bench-env                                                    # pip install --no-deps -r requirements-bench.txt
    .venv/bin/python benchmarks/bench_tokens.py                      # 20,000 documents, ~3 minutes on 2 cores
    .venv/bin/python benchmarks/bench_tokens.py --docs 50000 --repeat 3
    .venv/bin/python benchmarks/bench_tokens.py --docs 50000 --write-only --repeat 5   # the writers alone
    .venv/bin/python benchmarks/bench_tokens.py --docs 50000 --write-only --convert-text --repeat 3

``--convert-text`` (with ``--write-only``) also times ``crossfeed convert text`` of the same corpus
written as text (``.txt``, a document per line, each id as its decimal word; a word-level
``tokenizers`` tokenizer maps word N to id N, so the tokens written are the corpus's own — checked
document by document after the first round): the job the command runs, in this process, less the
time its tokenizer took inside the same run (``encode_batch_fast`` and the id lists made
``uint32`` arrays), beside the tokenizer timed alone on the same documents (the same work), and
beside the Beam floor: the job's own graph — the same transforms and ``GroupByKey``s on the same
in-process runner, as many elements at each step — with trivial elements and steps
(`beam_floor`), the runner's fixed cost that ``convert text`` cannot go under.

LitData and MosaicML Streaming are benchmark-only packages (benchmarks/requirements-bench.txt),
never dependencies; a system whose package is not importable is left out, and said so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

LENGTH, BATCH, VOCAB, MEAN, SIGMA, SHARDS = 2048, 16, 50_000, 600.0, 1.0, 8
SYSTEMS = ("xf-rows", "xf-rows-bare", "xf-best", "xf-rows-threads", "ld", "mds")
PEERS = {"ld": "litdata", "mds": "streaming"}  # peer system -> the package it needs


def corpus(data: str, docs: int) -> str:
    """``flat.npy`` (uint32 tokens) and ``offsets.npy`` of ``docs`` documents, made once."""
    root = os.path.join(data, f"tokens-{docs}")
    if not os.path.exists(os.path.join(root, "offsets.npy")):
        os.makedirs(root, exist_ok=True)
        rng = np.random.default_rng(0)
        mu = np.log(MEAN) - SIGMA**2 / 2
        lengths = np.maximum(1, rng.lognormal(mu, SIGMA, docs).round().astype(np.int64))
        np.save(os.path.join(root, "flat.npy"), rng.integers(0, VOCAB, int(lengths.sum()), dtype=np.uint32))
        np.save(os.path.join(root, "offsets.npy"), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    return root


def _arrays(root: str):
    flat = np.load(os.path.join(root, "flat.npy"), mmap_mode="r")
    return flat, np.load(os.path.join(root, "offsets.npy"))


def write_crossfeed(root: str) -> float:
    import crossfeed
    from crossfeed.format.schema import Encoding, Feature, Schema

    flat, off = _arrays(root)
    out = os.path.join(root, "xf")
    shutil.rmtree(out, ignore_errors=True)
    schema = Schema([Feature("tokens", "uint32", (None,), Encoding.TENSOR)])
    t = time.perf_counter()
    docs = ({"tokens": flat[off[i] : off[i + 1]]} for i in range(len(off) - 1))
    crossfeed.write_dataset(out, docs, num_shards=SHARDS, schema=schema, overwrite=True).close()
    seconds = time.perf_counter() - t
    with open(os.path.join(out, "crossfeed.json")) as f:
        listed = json.load(f).get("lengths")
    if not listed:  # a writer without lengths files: added (not timed; say so)
        from benchmarks import seqdata

        seqdata.attach_lengths(out)
        print("  (crossfeed's writer wrote no lengths files: added after, untimed)")
    return seconds


def _ld_items(k: int):
    root = os.environ["BENCH_TOKENS_ROOT"]
    flat, off = _arrays(root)
    n = len(off) - 1
    for i in range(k * n // SHARDS, (k + 1) * n // SHARDS):
        yield np.asarray(flat[off[i] : off[i + 1]])


def write_litdata(root: str) -> float:
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    out = os.path.join(root, "ld")
    shutil.rmtree(out, ignore_errors=True)
    os.environ["BENCH_TOKENS_ROOT"] = root
    t = time.perf_counter()
    optimize(
        fn=_ld_items,
        inputs=list(range(SHARDS)),
        output_dir=out,
        chunk_bytes="64MB",
        item_loader=TokensLoader(),
        num_workers=1,
        mode="overwrite",
    )
    return time.perf_counter() - t


def streaming_base():
    """``streaming.base`` (``MDSWriter``, ``StreamingDataset``) without the top-level package's
    vision and text modules (they import torchvision); None when MosaicML Streaming is not
    importable (as benchmarks/bench_cache.py)."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or spec.submodule_search_locations is None:
            return None
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = pkg
    try:
        import streaming.base as base
    except ImportError:
        return None
    return base


def write_mosaic(root: str, length: int = LENGTH) -> float:
    """llm-foundry's pre-tokenized path (``ConcatTokensDataset`` + ``MDSWriter``): documents are
    concatenated and cut into rows of ``length`` tokens at write time (the tail under one row is
    dropped), one MDS sample per row."""
    base = streaming_base()
    flat, off = _arrays(root)
    out = os.path.join(root, "mds")
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    with base.MDSWriter(out=out, columns={"tokens": "ndarray:uint32"}, size_limit=1 << 26) as w:
        pending: list[np.ndarray] = []
        held = 0
        for i in range(len(off) - 1):
            doc = flat[off[i] : off[i + 1]]
            pending.append(doc)
            held += len(doc)
            if held >= length:
                buf = np.concatenate(pending)
                rows = len(buf) // length
                for r in range(rows):
                    w.write({"tokens": buf[r * length : (r + 1) * length]})
                rest = buf[rows * length :]
                pending, held = [rest], len(rest)
    return time.perf_counter() - t


TEXT_FILES = 8  # the text corpus's .txt files (one document per line), as many as the shards


def text_corpus(root: str) -> str:
    """The same corpus as text for ``crossfeed convert text``, made once under ``root/text``: a
    word-level tokenizer (``tokenizer.json``: word ``"N"`` is id N, split on whitespace, no special
    tokens) and ``TEXT_FILES`` ``.txt`` files of one document per line, each token id written as its
    decimal number — so the tokenizer gives back exactly the corpus's token arrays."""
    out = os.path.join(root, "text")
    tok_path = os.path.join(out, "tokenizer.json")
    if not os.path.exists(tok_path):
        from tokenizers import Tokenizer, models, pre_tokenizers

        os.makedirs(out, exist_ok=True)
        flat, off = _arrays(root)
        words = np.array([str(i) for i in range(VOCAB)], dtype=object)
        n = len(off) - 1
        for k in range(TEXT_FILES):
            with open(os.path.join(out, f"docs-{k:02d}.txt"), "w") as f:
                for i in range(k * n // TEXT_FILES, (k + 1) * n // TEXT_FILES):
                    f.write(" ".join(words[flat[off[i] : off[i + 1]]]) + "\n")
        vocab = {str(i): i for i in range(VOCAB)} | {"[UNK]": VOCAB}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(tok_path + ".tmp")
        os.replace(tok_path + ".tmp", tok_path)
    return out


def tokenize_text(text_dir: str) -> float:
    """Tokenization alone, as ``convert text`` does it: the same documents, read whole first
    (untimed), encoded in batches of its ``BATCH_DOCS`` with ``encode_batch_fast`` and each
    document's ids made a ``uint32`` array — what any writer's caller pays to get token arrays."""
    from tokenizers import Tokenizer

    from crossfeed.beam_jobs.text_source import BATCH_DOCS

    tok = Tokenizer.from_file(os.path.join(text_dir, "tokenizer.json"))
    docs = []
    for k in range(TEXT_FILES):
        with open(os.path.join(text_dir, f"docs-{k:02d}.txt"), encoding="utf-8") as f:
            docs += [line.rstrip("\n") for line in f]
    t = time.perf_counter()
    for b in range(0, len(docs), BATCH_DOCS):
        for enc in tok.encode_batch_fast(docs[b : b + BATCH_DOCS], add_special_tokens=False):
            np.asarray(enc.ids, dtype="<u4")
    return time.perf_counter() - t


def convert_text(root: str, text_dir: str, check: bool = False) -> tuple[float, float]:
    """``crossfeed convert text DOCS... xf-text --tokenizer tokenizer.json --per-line --shards 8
    --token-dtype uint32 --no-special-tokens --no-verify`` in this process: the job the command
    runs (`crossfeed.beam_jobs.job.convert`, Beam's in-process runner), timed from the scan to the
    commit. Returns (seconds, of which tokenizing): the tokenizer's time measured inside the same
    run — each batch's ``encode_batch_fast`` and its documents' id lists made ``uint32`` arrays,
    what `tokenize_text` times, wrapped around `TokenizeDoFn._encode` — so that a loaded machine's
    swings do not land between two runs.
    ``check``: the tokens written equal the corpus's, document by document (untimed)."""
    from crossfeed.beam_jobs import job
    from crossfeed.beam_jobs.text_source import TokenizeDoFn
    from crossfeed.write.options import WriteOptions

    out = os.path.join(root, "xf-text")
    shutil.rmtree(out, ignore_errors=True)
    files = [os.path.join(text_dir, f"docs-{k:02d}.txt") for k in range(TEXT_FILES)]
    spent = [0.0]
    encode = TokenizeDoFn._encode

    def timed(self, texts, keys):
        t0 = time.perf_counter()
        got = encode(self, texts, keys)
        spent[0] += time.perf_counter() - t0
        return got

    TokenizeDoFn._encode = timed
    try:
        t = time.perf_counter()
        source = job.make_source(
            "text",
            files,
            tokenizer=os.path.join(text_dir, "tokenizer.json"),
            per_line=True,
            add_special_tokens=False,
            token_dtype="uint32",
        )
        job.convert(source, out, options=WriteOptions(num_shards=SHARDS))
        seconds = time.perf_counter() - t
    finally:
        TokenizeDoFn._encode = encode
    if check:
        _check_text(root, out)
    return seconds, spent[0]


def beam_floor(root: str, docs: int, carry: str = "") -> float:
    """The runner's fixed cost of ``convert text``'s job: the same graph (`WriteDataset`'s
    transforms and ``GroupByKey``s, behind the same ``Create`` of work units and read and tokenize
    steps) on the same runner (`crossfeed.beam_jobs.runner.run_pipeline`, the in-process
    ``FnApiRunner``), the same number of elements at every step — ``TEXT_FILES`` units, batches of
    ``BATCH_DOCS`` documents, ``SHARDS`` shards — but each a few bytes and each step trivial: no
    reading, tokenizing, encoding or writing. What this takes, ``convert text`` cannot go under.
    ``carry``: text the read and tokenize steps hold (as the job's hold its tokenizer's JSON, which
    the runner pickles with them)."""
    import apache_beam as beam

    from crossfeed.beam_jobs import runner, write
    from crossfeed.beam_jobs.text_source import BATCH_DOCS

    per_file = -(-(docs // TEXT_FILES) // BATCH_DOCS)
    batch_ids = [f"{k}-{c}" for k in range(TEXT_FILES) for c in range(per_file)]

    class Read(beam.DoFn):
        def __init__(self, carry: str):
            self.carry = carry

        def process(self, unit):
            yield from (f"{unit}-{c}" for c in range(per_file))

    class Tokenize(beam.DoFn):
        def __init__(self, carry: str):
            self.carry = carry

        def process(self, batch_id):
            yield batch_id

    class Step(beam.DoFn):  # a write step stand-in: made from the job's config, as the real ones
        def __init__(self, cfg):
            self.cfg = cfg

    class Encode(Step):
        def process(self, batch_id):
            yield batch_id, ([("train", batch_id)], ("summary", batch_id))

    class Plan(Step):
        def process(self, element):
            got = list(element[1])
            assert len(got) == len(batch_ids) + 1, len(got)
            for b in batch_ids:
                yield "route", b, "table"
            for i in range(SHARDS):
                yield "shard", ("train", i), ("plan", i)
            yield "commit", 0, "info"

    def route(element, *_):
        for i in range(SHARDS):
            yield ("train", i), ("piece", element[0])

    class WriteShard(Step):
        def process(self, element):
            got = list(element[1])
            assert len(got) == len(batch_ids) + 1, len(got)
            yield 0, ("staged", element[0])

    class Commit(Step):
        def process(self, element):
            got = list(element[1])
            assert len(got) == SHARDS + 1, len(got)
            yield len(got)

    real = {n: getattr(write, n) for n in ("EncodeDoFn", "PlanDoFn", "route_batch", "WriteShardDoFn", "CommitDoFn")}
    fake = {"EncodeDoFn": Encode, "PlanDoFn": Plan, "route_batch": route, "WriteShardDoFn": WriteShard}
    for name, value in {**fake, "CommitDoFn": Commit}.items():
        setattr(write, name, value)
    try:
        t = time.perf_counter()
        write_step = write.WriteDataset(os.path.join(root, "floor"), batched=True, token="floor")

        def build(p):
            units = p | "Units" >> beam.Create(list(range(TEXT_FILES)), reshuffle=False)
            batches = units | "Read" >> beam.ParDo(Read(carry)) | "Tokenize" >> beam.ParDo(Tokenize(carry))
            return batches | "Write" >> write_step

        runner.run_pipeline(build, work_units=TEXT_FILES)
        return time.perf_counter() - t
    finally:
        for name, value in real.items():
            setattr(write, name, value)


def _check_text(root: str, out: str) -> None:
    """Every document's tokens as written by ``convert text`` equal the corpus's (keys
    ``docs-KK.txt:LINE``, lines counted from 1)."""
    import crossfeed

    flat, off = _arrays(root)
    n = len(off) - 1
    seen = 0
    with crossfeed.open_dataset(out) as ds:
        for rec in ds["train"]:
            key = rec["id"].decode() if isinstance(rec["id"], bytes) else str(rec["id"])
            name, line = key.rsplit(":", 1)
            k = int(name.rsplit("-", 1)[1].split(".")[0])
            i = k * n // TEXT_FILES + int(line) - 1
            if not np.array_equal(np.asarray(rec["tokens"]), flat[off[i] : off[i + 1]]):
                raise SystemExit(f"convert text wrote other tokens for document {i} ({key})")
            seen += 1
    if seen != n:
        raise SystemExit(f"convert text wrote {seen:,} documents of {n:,}")
    print(f"  (convert text's tokens checked: all {n:,} documents equal the corpus's)")


class Count:
    """Row tokens per second from the second batch on, and a checksum of every token delivered (the
    first batch too): the sum of the ids, timed apart and left out of the rate."""

    def __init__(self):
        self.tokens = self.batches = self.seen = self.total = 0  # seen, total: the first batch too
        self.t0 = None
        self.checking = self.checking_cpu = 0.0

    def add(self, tokens) -> None:
        t, c = time.perf_counter(), time.process_time()
        a = tokens.numpy() if hasattr(tokens, "numpy") else tokens
        self.total += int(a.sum(dtype=np.uint64))
        self.checking += time.perf_counter() - t
        self.checking_cpu += time.process_time() - c
        self.seen += a.size
        if self.t0 is None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            self.checking = self.checking_cpu = 0.0
        else:
            self.tokens += a.size
        self.batches += 1

    def rate(self) -> float:
        return self.tokens / (time.perf_counter() - self.t0 - self.checking)

    def cpu_rate(self) -> float:
        return self.tokens / max(1e-9, time.process_time() - self.c0 - self.checking_cpu)


def read(system: str, root: str, workers: int, length: int, batch: int) -> dict:
    count = Count()
    if system.startswith("xf"):
        import crossfeed

        split = "documents" if system == "xf-best" else "rows"
        segments = system != "xf-rows-bare"  # Pack(segments=False): the tokens alone, as LitData's rows
        opts = dict(batch_size=batch, seed=0, pack=crossfeed.Pack(length, split=split, segments=segments))
        if system != "xf-rows-threads":  # built in the consumer's thread (docs/sequences.md: the fast setting)
            opts["num_threads"] = 0
        path = os.path.join(root, "xf")
        if workers:
            from crossfeed.adapters.torch import StatefulLoader, TorchDataset

            with TorchDataset(path, rank=0, world_size=1, **opts) as ds:
                loader = StatefulLoader(ds, num_workers=workers)
                for b in loader:
                    count.add(b["tokens"])
                loader.close()
        else:
            with crossfeed.Loader(path, **opts) as loader:
                for b in loader:
                    count.add(b["tokens"])
    elif system == "mds":
        import torch.utils.data

        base = streaming_base()
        base.util.clean_stale_shared_memory()
        ds = base.StreamingDataset(local=os.path.join(root, "mds"), shuffle=True, shuffle_seed=0, batch_size=batch)
        for b in torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers):
            count.add(b["tokens"])
    else:
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        ds = StreamingDataset(
            os.path.join(root, "ld"), item_loader=TokensLoader(block_size=length), shuffle=True, seed=0
        )
        for b in StreamingDataLoader(ds, batch_size=batch, num_workers=workers):
            count.add(b)
    return {
        "rate": count.rate(),
        "cpu_rate": count.cpu_rate(),
        "tokens": count.tokens,
        "seen": count.seen,
        "sum": count.total,
        "batches": count.batches,
    }


def write_writers(root: str, systems: list[str], length: int, repeat: int, text: bool = False) -> None:
    """Time each writer on the same token arrays, ``repeat`` rounds taking turns (a loaded machine
    slows them alike), and print the best of each and crossfeed's ratio to it; ``text``: also
    ``convert text`` of the same corpus as text, less its tokenization (timed apart)."""
    writers = {"crossfeed write_dataset": write_crossfeed}
    if text:
        text_dir = text_corpus(root)
        inside: list[float] = []  # convert text's own tokenizing time, round by round

        def conv(r: str) -> float:
            seconds, tokenizing = convert_text(r, text_dir, check=not inside)
            inside.append(tokenizing)
            return seconds

        writers["crossfeed convert text"] = conv
        writers["tokenization"] = lambda r: tokenize_text(text_dir)
        docs = int(np.load(os.path.join(root, "offsets.npy"), mmap_mode="r").shape[0]) - 1
        writers["Beam floor (convert's graph)"] = lambda r: beam_floor(r, docs)
    if "ld" in systems:
        writers["LitData optimize"] = write_litdata
    if "mds" in systems:
        writers["MosaicML MDSWriter"] = lambda r: write_mosaic(r, length)
    times: dict[str, list[float]] = {k: [] for k in writers}
    for _ in range(repeat):
        for k, write in writers.items():
            times[k].append(write(root))
    print(
        f"\nwrite the same token arrays (s, best of {repeat}; tokenization excluded; crossfeed with its lengths "
        f"files; load now {os.getloadavg()[0]:.2f}):"
    )
    xf = times["crossfeed write_dataset"]
    for k, v in times.items():
        peer = not k.startswith(("crossfeed", "Beam floor")) and k != "tokenization"
        ratio = f"  crossfeed takes {min(xf) / min(v):.2f}× its time" if peer else ""
        if repeat > 1:  # the median's ratio too: the load moves single rounds
            ratio += f" (median {float(np.median(xf)) / float(np.median(v)):.2f}×)" if ratio else ""
            ratio += "  rounds: " + ", ".join(f"{t:.2f}" for t in v)
        print(f"  {k:<28} {min(v):6.2f}{ratio}")
    if text:
        print(f"  {'  of which tokenizing':<28} {min(inside):6.2f}  rounds: " + ", ".join(f"{t:.2f}" for t in inside))
        conv = [c - t for c, t in zip(times["crossfeed convert text"], inside)]
        print(f"  {'convert text - tokenizing':<28} {min(conv):6.2f}  rounds: " + ", ".join(f"{t:.2f}" for t in conv))
        for k in times:
            if k not in (
                "crossfeed convert text",
                "tokenization",
                "crossfeed write_dataset",
                "Beam floor (convert's graph)",
            ):
                print(
                    f"    convert text less tokenization over {k}: {min(conv) / min(times[k]):.2f}× "
                    f"(median {float(np.median(conv)) / float(np.median(times[k])):.2f}×)"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--length", type=int, default=LENGTH)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--repeat", type=int, default=2, help="epochs per system and setting (the best is printed)")
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument(
        "--write-only", action="store_true", help="time the writers alone (--repeat rounds, the best printed); no reads"
    )
    ap.add_argument(
        "--convert-text",
        action="store_true",
        help="with --write-only: also time `convert text` of the same corpus as text, less its tokenization",
    )
    ap.add_argument("--data", default=os.environ.get("CROSSFEED_BENCH_DATA", os.path.join(HERE, "_data")))
    ap.add_argument("--child", nargs=3, metavar=("SYSTEM", "ROOT", "WORKERS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    unknown = sorted(set(a.systems.split(",")) - set(SYSTEMS))
    if unknown:
        ap.error(f"--systems: unknown {', '.join(unknown)}; choose from {','.join(SYSTEMS)}")
    if a.child:
        system, root, workers = a.child
        print(json.dumps(read(system, root, int(workers), a.length, a.batch)))
        return
    root = corpus(a.data, a.docs)
    flat, off = _arrays(root)
    total = len(flat)
    id_sum = int(flat.sum(dtype=np.uint64))
    rows_sum = int(flat[: total // a.length * a.length].sum(dtype=np.uint64))  # less the tail under a row
    print(f"corpus: {len(off) - 1:,} documents, {total:,} uint32 tokens (mean {total / (len(off) - 1):.0f})")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    systems = []
    for system in a.systems.split(","):
        package = PEERS.get(system)
        if package and importlib.util.find_spec(package) is None:
            print(f"  {system}: {package} is not importable here (benchmarks/requirements-bench.txt): left out")
        elif system == "mds" and streaming_base() is None:
            print("  mds: streaming.base does not import here (benchmarks/requirements-bench.txt): left out")
        else:
            systems.append(system)
    write_writers(root, systems, a.length, a.repeat if a.write_only else 1, text=a.convert_text)
    if a.write_only:
        return
    labels = {
        "xf-rows": 'crossfeed Pack(L, split="rows")',
        "xf-rows-bare": 'crossfeed split="rows", segments=False',
        "xf-best": "crossfeed Pack(L) best-fit",
        "xf-rows-threads": 'crossfeed split="rows", 2 threads',
        "ld": "LitData TokensLoader",
        "mds": "MosaicML StreamingDataset",
    }
    results: dict[tuple[str, int], float] = {}
    cpu: dict[tuple[str, int], float] = {}
    seen: dict[tuple[str, int], int] = {}
    sums: dict[tuple[str, int], int] = {}
    for workers in [int(w) for w in a.workers.split(",")]:
        for system in systems:
            best = best_cpu = 0.0
            for _ in range(a.repeat):
                cmd = [sys.executable, __file__, "--child", system, root, str(workers)]
                cmd += ["--length", str(a.length), "--batch", str(a.batch)]
                got = subprocess.run(cmd, capture_output=True, text=True)
                if got.returncode:
                    print(got.stderr[-2000:], file=sys.stderr)
                    break
                row = json.loads(got.stdout.strip().splitlines()[-1])
                best, best_cpu = max(best, row["rate"]), max(best_cpu, row["cpu_rate"])
                seen[(system, workers)], sums[(system, workers)] = row["seen"], row["sum"]
            results[(system, workers)], cpu[(system, workers)] = best, best_cpu
    print(
        f"\ntokens/s, rows of {a.length}, batch {a.batch}, best of {a.repeat} epochs (load now {os.getloadavg()[0]:.2f}):"
    )
    print("  (tok/CPU-s: tokens per CPU-second of the process's own CPU, workers=0 only — the load barely moves it;")
    print("   epoch: row tokens the epoch delivered over the corpus's tokens, padding included;")
    print("   ids: the sum of the token ids delivered over the corpus's — 'all' when equal: every token once;")
    print(f"   'all-tail': every token but the corpus's last {total % a.length:,}, under one row, which is dropped)")
    head = f"  {'system':<40} {'workers':>7} {'tokens/s':>12} {'× LitData':>10} {'× Mosaic':>9}"
    print(f"{head} {'tok/CPU-s':>12} {'× LitData':>10} {'× Mosaic':>9} {'epoch':>6} {'ids':>8}")

    def ratio(num: float, den: float | None, width: int) -> str:
        return f"{num / den:{width - 1}.2f}×" if den else " " * width

    for (system, workers), rate in results.items():
        c = cpu[(system, workers)]
        line = f"  {labels[system]:<40} {workers:>7} {rate / 1e6:10.1f} M"
        line += f" {ratio(rate, results.get(('ld', workers)), 10)} {ratio(rate, results.get(('mds', workers)), 9)}"
        if workers:
            line += " " * 34
        else:
            line += f" {c / 1e6:10.1f} M {ratio(c, cpu.get(('ld', 0)), 10)} {ratio(c, cpu.get(('mds', 0)), 9)}"
        if (system, workers) in seen:
            got = sums[(system, workers)]
            ids = "all" if got == id_sum else "all-tail" if got == rows_sum else f"{got / id_sum:.5f}"
            line += f" {seen[(system, workers)] / total:6.3f} {ids:>8}"
        print(line)


if __name__ == "__main__":
    main()
