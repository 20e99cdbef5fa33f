"""Token corpora for `benchmarks.bench_sequences`, built once into a cache directory.

Each corpus is one list of documents (token id arrays, uint16), kept twice over the same tokens:

* ``flat.npy`` + ``offsets.npy``: every document's tokens end to end and the ``n + 1`` offsets
  (document ``i`` is ``flat[offsets[i]:offsets[i + 1]]``) — the in-memory source the Grain and
  PyTorch peers read (memory-mapped, so DataLoader workers share it);
* ``xf/``: a crossfeed dataset of the same documents in the same order, written by
  `crossfeed.write_dataset` (feature ``tokens``: uint16, shape ``(None,)``, tensor encoding, so
  plain tf.data reads it with ``decode_raw``), with a lengths file beside each shard
  (`crossfeed.format.lengths`) — what packing plans from.

Documents longer than the row length are cut into pieces of at most that length before anything
is written (every system sees the same pieces; Grain's packer refuses an element longer than a
row, and nothing is truncated).

Corpora: ``synthetic`` — lengths drawn from a log-normal of mean 600 tokens (σ = 1), ids uniform
in a 32,000 vocabulary; ``python`` — the standard library's ``.py`` files of the interpreter
behind this virtualenv (``sys.base_prefix``/lib/python3.X, no site-packages), one document per
file, tokenized by a byte-level BPE (vocabulary 8,000) trained on them here with HF
``tokenizers``; nothing is downloaded.

`fabricate_big` makes the ``--plan-scale`` corpus: one shard of real documents written once, then
hard-linked under many shard names (shard, ``.idx`` and ``.len`` files) with a manifest listing
them all: reads and plans are those of a corpus that size, on a fraction of the disk.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np

VOCAB_SYNTHETIC = 32_000
VOCAB_PYTHON = 8_000
MEAN_LEN = 600
SIGMA = 1.0
SHARDS = 8
MANIFEST = "crossfeed.json"


def lognormal_lengths(n: int, rng, mean: float = MEAN_LEN, sigma: float = SIGMA) -> np.ndarray:
    """``n`` document lengths (≥ 1) from a log-normal of mean ``mean``."""
    mu = np.log(mean) - sigma**2 / 2
    return np.maximum(rng.lognormal(mu, sigma, n).round().astype(np.int64), 1)


def split_long(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Lengths of the pieces when every document longer than ``max_len`` is cut into pieces of
    ``max_len`` (the last one shorter): same total, in the same order."""
    full, rest = np.divmod(lengths, max_len)
    counts = full + (rest > 0)
    out = np.full(int(counts.sum()), max_len, np.int64)
    ends = np.cumsum(counts) - 1
    has_rest = rest > 0
    out[ends[has_rest]] = rest[has_rest]
    return out


def _schema():
    from crossfeed.format.schema import Encoding, Feature, Schema

    return Schema([Feature("tokens", "uint16", (None,), Encoding.TENSOR)])


def _write_crossfeed(root: str, flat: np.ndarray, offsets: np.ndarray, shards: int) -> None:
    import crossfeed

    docs = ({"tokens": flat[offsets[i] : offsets[i + 1]]} for i in range(len(offsets) - 1))
    crossfeed.write_dataset(root, docs, num_shards=shards, schema=_schema(), overwrite=True).close()
    attach_lengths(root)


def attach_lengths(root: str, feature: str = "tokens") -> bool:
    """Give every shard of the dataset at ``root`` its lengths file (the per-record token counts,
    `crossfeed.format.lengths`) and list ``feature`` in the manifest's ``lengths``, unless the
    writer already did. The writer on this branch does not write them (that is the packing
    work's); the benchmark adds them itself from the records, in record order. False where this
    tree has no lengths format at all."""
    try:
        from crossfeed.format.lengths import format_lengths, lengths_path
    except ImportError:
        return False
    import crossfeed

    path = os.path.join(root, MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("lengths"):
        return True  # the writer wrote them
    for split_name, split in manifest["splits"].items():
        # record order: shard by shard, each in file order (shuffle "none")
        got = []
        with crossfeed.Loader(root, split=split_name, batch_size=4096, shuffle="none") as ld:
            for b in ld:
                got.extend(len(t) for t in b[feature])
        lengths = np.asarray(got, np.int64)
        start = 0
        for sh in split["shards"]:
            n = sh["num_records"]
            data = format_lengths(lengths[start : start + n])
            start += n
            with open(lengths_path(os.path.join(root, sh["file"])), "wb") as f:
                f.write(data)
            sh["lengths_sha256"] = hashlib.sha256(data).hexdigest()
        assert start == len(lengths), (start, len(lengths))
    manifest["lengths"] = [feature]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, path)
    return True


def _save(root: str, flat: np.ndarray, lengths: np.ndarray, meta: dict) -> None:
    tmp = root + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(os.path.join(tmp, "flat.npy"), flat.astype(np.uint16))
    np.save(os.path.join(tmp, "offsets.npy"), offsets)
    _write_crossfeed(os.path.join(tmp, "xf"), flat, offsets, SHARDS)
    meta = {**meta, "docs": int(len(lengths)), "tokens": int(lengths.sum())}
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    shutil.rmtree(root, ignore_errors=True)
    os.rename(tmp, root)


def synthetic(cache: str, docs: int, max_len: int, seed: int = 0) -> str:
    """The synthetic corpus of ``docs`` documents (before long ones are cut), made once."""
    root = os.path.join(cache, f"seq-synthetic-{docs}-{max_len}")
    if os.path.exists(os.path.join(root, "meta.json")):
        return root
    rng = np.random.default_rng(seed)
    lengths = split_long(lognormal_lengths(docs, rng), max_len)
    flat = rng.integers(0, VOCAB_SYNTHETIC, int(lengths.sum()), dtype=np.uint16)
    _save(root, flat, lengths, {"corpus": "synthetic", "source_docs": docs, "vocab": VOCAB_SYNTHETIC})
    return root


def stdlib_files(limit: int | None = None) -> list[str]:
    """The standard library's ``.py`` files (no site-packages), sorted; the first ``limit``."""
    lib = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    files = sorted(
        p for p in glob.glob(os.path.join(lib, "**", "*.py"), recursive=True) if "site-packages" not in p.split(os.sep)
    )
    return files[:limit] if limit else files


def python_corpus(cache: str, max_len: int, limit: int | None = None) -> str:
    """The standard-library corpus (BPE trained on it here), made once."""
    root = os.path.join(cache, f"seq-python-{limit or 'all'}-{max_len}")
    if os.path.exists(os.path.join(root, "meta.json")):
        return root
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = []
    for p in stdlib_files(limit):
        with open(p, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    t = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_PYTHON, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    train_s = time.perf_counter() - t
    t = time.perf_counter()
    ids = [np.asarray(e.ids, np.uint16) for e in tok.encode_batch(texts)]
    encode_s = time.perf_counter() - t
    file_lengths = np.asarray([len(x) for x in ids], np.int64)
    keep = file_lengths > 0
    file_lengths = file_lengths[keep]
    flat = np.concatenate([x for x, k in zip(ids, keep) if k])
    lengths = split_long(file_lengths, max_len)
    os.makedirs(cache, exist_ok=True)
    tok.save(os.path.join(cache, f"seq-python-{limit or 'all'}-tokenizer.json"))
    meta = {
        "corpus": "python",
        "files": int(keep.sum()),
        "bytes": int(sum(len(s.encode()) for s in texts)),
        "vocab": tok.get_vocab_size(),
        "train_s": round(train_s, 1),
        "encode_s": round(encode_s, 1),
        "mean_file_tokens": float(file_lengths.mean()),
    }
    _save(root, flat, lengths, meta)
    return root


def fabricate_big(cache: str, docs: int, per_shard: int, max_len: int, seed: int = 0) -> str:
    """A ``docs``-document corpus: one shard of ``per_shard`` real documents (log-normal lengths,
    mean 600, cut at ``max_len``) written once with its lengths file, hard-linked ``docs /
    per_shard`` times under the manifest's shard names."""
    shards = -(-docs // per_shard)
    big = os.path.join(cache, f"seq-plan-{shards}x{per_shard}-{max_len}")
    if os.path.exists(os.path.join(big, MANIFEST)):
        return big
    one = os.path.join(cache, f"seq-plan-one-{per_shard}-{max_len}")
    if not os.path.exists(os.path.join(one, MANIFEST)):
        rng = np.random.default_rng(seed)
        lengths = lognormal_lengths(per_shard, rng)
        lengths = np.minimum(lengths, max_len)  # one record per document here: the count is what matters
        flat = rng.integers(0, VOCAB_SYNTHETIC, int(lengths.sum()), dtype=np.uint16)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        _write_crossfeed(one, flat, offsets, 1)
    with open(os.path.join(one, MANIFEST)) as f:
        manifest = json.load(f)
    split = manifest["splits"]["train"]
    (info,) = split["shards"]
    suffixes = ("", ".idx") + ((".len",) if info.get("lengths_sha256") else ())
    tmp = big + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    entries = []
    for s in range(shards):
        name = f"train-{s:05d}-of-{shards:05d}.tfrecord"
        for suf in suffixes:
            os.link(os.path.join(one, info["file"] + suf), os.path.join(tmp, name + suf))
        entries.append({**info, "file": name})
    split.update(shards=entries, num_records=shards * per_shard, num_bytes=shards * info["num_bytes"])
    split.pop("statistics", None)
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    os.rename(tmp, big)
    return big
