"""Token datasets for the packing tests: documents whose every token names itself.

Token ``i`` of document ``d`` of source ``s`` is ``s << 40 | d << 20 | i``, so a packed row says
which document piece each token came from, and a test can check every token of an epoch appears
exactly once. `add_lengths` writes the lengths files (`crossfeed.format.lengths`) beside the shards
and pins them in the manifest, as ``crossfeed convert text`` does.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

import crossfeed
from crossfeed.format.lengths import format_lengths, lengths_path
from crossfeed.format.manifest import MANIFEST


def token(source: int, doc: int, i) -> np.ndarray:
    return (np.int64(source) << 40) | (np.int64(doc) << 20) | np.asarray(i, dtype=np.int64)


RAW = False  # write_tokens stores raw int64 tensors (the packed fast path's layout) instead of int64 lists


def documents(lengths, source: int = 0) -> list[dict]:
    if RAW:
        return [{"tokens": token(source, d, np.arange(n))} for d, n in enumerate(lengths)]
    return [{"tokens": token(source, d, np.arange(n)).tolist()} for d, n in enumerate(lengths)]


def raw_schema():
    from crossfeed.format.schema import Encoding, Feature, Schema

    return Schema([Feature("tokens", "int64", (None,), Encoding.TENSOR)])


def write_tokens(root, lengths, *, source: int = 0, num_shards: int = 3, with_lengths: bool = True) -> str:
    """A dataset of ``len(lengths)`` documents (round-robin over ``num_shards`` shards)."""
    schema = raw_schema() if RAW else None
    crossfeed.write_dataset(
        root, documents(lengths, source), num_shards=num_shards, schema=schema, lengths=None if with_lengths else ()
    ).close()
    if with_lengths:
        add_lengths(root, ("tokens",))
    return str(root)


def add_lengths(root, features) -> None:
    """Lengths files for ``features`` beside every shard of every split, pinned in the manifest."""
    path = os.path.join(root, MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    with crossfeed.open_dataset(root) as ds:
        for name, split in manifest["splits"].items():
            sp = ds[name]
            for k, shard in enumerate(split["shards"]):
                lens = [
                    [np.size(sp.decode(k, j, features=[f])[f]) for f in features] for j in range(shard["num_records"])
                ]
                data = format_lengths(np.asarray(lens, dtype=np.int64).reshape(-1, len(features)))
                with open(lengths_path(os.path.join(root, shard["file"])), "wb") as f:
                    f.write(data)
                shard["lengths_sha256"] = hashlib.sha256(data).hexdigest()
    manifest["lengths"] = list(features)
    with open(path, "w") as f:
        json.dump(manifest, f)


def source_doc_pos(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = np.asarray(tokens, dtype=np.int64)
    return t >> 40, (t >> 20) & ((1 << 20) - 1), t & ((1 << 20) - 1)


def write_language(root, *, docs: int = 200, vocab: int = 32, seed: int = 0) -> str:
    """A tiny learnable corpus: each document follows ``next = (3 * token + 1) % vocab`` from a
    random first token, with log-normal lengths (lengths files written)."""
    rng = np.random.default_rng(seed)
    lens = np.maximum(2, rng.lognormal(np.log(24), 0.8, docs)).astype(np.int64)
    samples = []
    for n in lens.tolist():
        t = [int(rng.integers(vocab))]
        for _ in range(n - 1):
            t.append((3 * t[-1] + 1) % vocab)
        samples.append({"tokens": t})
    crossfeed.write_dataset(root, samples, num_shards=2).close()
    add_lengths(str(root), ("tokens",))
    return str(root)


def write_stored_ids(root, *, docs: int = 60, vocab: int = 32, dtype: str = "uint16", top: int | None = None) -> str:
    """`write_language`'s corpus with its ids stored as ``convert text`` stores them: a ``tensor``
    feature of ``dtype`` (uint16 or uint32) with lengths files. ``top``: one document holds this id."""
    rng = np.random.default_rng(0)
    samples = []
    for d in range(docs):
        t = [int(rng.integers(vocab))]
        for _ in range(int(rng.integers(2, 40)) - 1):
            t.append((3 * t[-1] + 1) % vocab)
        if top is not None and d == 0:
            t[0] = top
        samples.append({"tokens": np.asarray(t, dtype=dtype)})
    schema = crossfeed.Schema([crossfeed.Feature("tokens", dtype, (None,), "tensor")])
    crossfeed.write_dataset(root, samples, num_shards=2, schema=schema).close()
    add_lengths(str(root), ("tokens",))
    return str(root)


def repin_lengths(root, lengths_of_shard0) -> str:
    """Lengths file 0 replaced by other lengths, well-formed and re-pinned in the manifest (what a
    buggy tool or a hand edit leaves): they no longer fit the records. Returns shard 0's file."""
    path = os.path.join(root, MANIFEST)
    with open(path) as f:
        m = json.load(f)
    shard = m["splits"]["train"]["shards"][0]
    data = format_lengths(np.asarray(lengths_of_shard0))
    with open(os.path.join(root, shard["file"] + ".len"), "wb") as f:
        f.write(data)
    shard["lengths_sha256"] = hashlib.sha256(data).hexdigest()
    with open(path, "w") as f:
        json.dump(m, f)
    return shard["file"]
