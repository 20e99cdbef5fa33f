"""What flows through a conversion job, a batch at a time.

Sources yield `SampleBatch` (a chunk of samples held in columns, each sample with a stable string
key). `encode_parts` turns one into `Part`s (per split: key hashes, keys, serialised
``tf.train.Example`` payloads) and a `Summary` (per split: bucket histogram, byte count, feature
statistics; the batch's schema). Working on batches rather than single samples is what keeps
Beam's per-element cost out of the conversion rate.

Hashes are blake2b of the UTF-8 key (never Python's salted ``hash()``): the first 64 bits order
records within a split (the write-time shuffle; a nonzero ``seed`` keys the hash), the second
64 bits pick the split.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crossfeed.errors import CrossfeedError, SampleSchemaError, SchemaError
from crossfeed.format.encode import encoder_for
from crossfeed.format.schema import Feature, Schema, infer_schema
from crossfeed.format.stats import FeatureStats, LengthStats

BUCKET_BITS = 16  # the plan counts records per bucket of the top bits of the shuffle hash
NUM_BUCKETS = 1 << BUCKET_BITS


@dataclass
class SampleBatch:
    """A chunk of samples: ``columns[name][i]`` is feature ``name`` of sample ``keys[i]``.

    ``batch_id`` must be unique in the job (built-in sources derive it from file and chunk, so it
    is also stable). ``shapes`` optionally gives decoded shapes of image features for statistics;
    ``skipped`` counts the bad records the source dropped while making this batch; ``dropped``
    counts records left out on purpose, by reason (``{"empty_documents": 3}``: not bad input,
    reported in the manifest's ``dropped_records``).
    """

    batch_id: str
    keys: list[str]
    columns: dict[str, Any]  # an array or a list per feature
    shapes: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    skipped: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, idx: np.ndarray) -> SampleBatch:
        """The samples at positions ``idx``, in that order."""
        ids = idx.tolist()
        cols = {k: (v[idx] if isinstance(v, np.ndarray) else [v[i] for i in ids]) for k, v in self.columns.items()}
        shapes = {k: [v[i] for i in ids] for k, v in self.shapes.items()}
        return SampleBatch(self.batch_id, [self.keys[i] for i in ids], cols, shapes)


class Ragged(list):
    """A column of one-dimensional arrays (a batch's documents' tokens) that are consecutive
    slices of one array: a list of the slices — what any step may read, as any column of arrays —
    that also holds the whole, ``values``, and each slice's length, ``lengths`` (int64), so that a
    batch's lengths and statistics are a few numpy calls. Not to be changed once made."""

    def __init__(self, values: np.ndarray, lengths: np.ndarray):
        ends = np.cumsum(lengths, dtype=np.int64)
        if values.ndim != 1 or (len(ends) and ends[-1] != len(values)) or (not len(ends) and len(values)):
            raise ValueError(f"{len(values)} values do not split into lengths summing to {int(ends[-1:].sum())}")
        super().__init__([values[a:b] for a, b in zip((ends - lengths).tolist(), ends.tolist())])
        self.values = values
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __reduce__(self):  # the whole and the lengths, not each slice again
        return Ragged, (self.values, self.lengths)


@dataclass
class Part:
    """The records of one batch that belong to one split."""

    split: str
    hashes: np.ndarray  # uint64 shuffle hash per record
    keys: list[str]
    payloads: list[bytes]
    lengths: np.ndarray | None = None  # (records, k) uint32: the lengths of the job's lengths features

    def take(self, idx: np.ndarray) -> Part:
        ids = idx.tolist()
        return Part(
            self.split,
            self.hashes[idx],
            [self.keys[i] for i in ids],
            [self.payloads[i] for i in ids],
            None if self.lengths is None else self.lengths[idx],
        )


@dataclass
class StagedPart:
    """A `Part` whose records are framed (TFRecord) in a file of the job's staging folder,
    ``name``, in hash order (`steps.stage_part`): what travels through the runner is each record's
    hash, key, place in the file (``starts``, framed ``sizes``) and lengths — never its bytes.
    A shard writer copies the framed records it keeps from the file (``in_memory``: from the
    same bytes held in `STAGED`, this process's memory, instead)."""

    split: str
    name: str
    hashes: np.ndarray  # uint64 shuffle hash per record
    keys: list[str]
    starts: np.ndarray  # int64: each framed record's offset in the file
    sizes: np.ndarray  # int64: each framed record's size
    lengths: np.ndarray | None = None  # (records, k) uint32, as `Part.lengths`
    in_memory: bool = False  # held in `STAGED` by the process that encoded it, not in a file

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, idx: np.ndarray | slice) -> StagedPart:
        keys = self.keys[idx] if isinstance(idx, slice) else [self.keys[i] for i in idx.tolist()]
        return StagedPart(
            self.split,
            self.name,
            self.hashes[idx],
            keys,
            self.starts[idx],
            self.sizes[idx],
            None if self.lengths is None else self.lengths[idx],
            self.in_memory,
        )


@dataclass(frozen=True)
class HeldPart:
    """Records ``[lo, hi)`` (in hash order) of a batch's `StagedPart` that `STAGED` holds whole,
    with its framed records, in this process's memory: all that crosses the runner's shuffles
    for it is this handle. `resolve` gives the `StagedPart` of those records."""

    split: str
    name: str
    lo: int
    hi: int

    def __len__(self) -> int:
        return self.hi - self.lo

    def resolve(self, token: str) -> StagedPart:
        return STAGED.part(token, self.name).take(slice(self.lo, self.hi))


class StagedMemory:
    """Batches' framed records (and their `StagedPart`) kept in this process's memory instead of
    files of the staging folder, for a job whose every step runs in this process (the embedded
    runner: `job.convert` asks for it): what would be written to a batch file and read back by the
    shard writers never goes to disk, and only a `HeldPart` handle crosses the shuffles. At most
    ``budget`` bytes of records a job (``token``); past it a batch is staged in a file as usual. A
    job's batches are dropped at its commit or when it fails
    (`crossfeed.beam_jobs.commit.remove_temporaries`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, tuple[bytes, StagedPart]]] = {}
        self._held: dict[str, int] = {}  # bytes held a job

    def put(self, token: str, part: StagedPart, data: bytes, budget: int) -> bool:
        """Hold ``data``, the framed records of ``part`` (batch ``part.name`` of job ``token``), if
        the job stays within ``budget`` bytes (a retried batch replaces its earlier bytes); False:
        not held."""
        with self._lock:
            batches = self._jobs.setdefault(token, {})
            old = batches.get(part.name)
            size = self._held.get(token, 0) - (len(old[0]) if old else 0) + len(data)
            if size > budget:
                return False
            batches[part.name] = (data, part)
            self._held[token] = size
            return True

    def _get(self, token: str, name: str) -> tuple[bytes, StagedPart]:
        with self._lock:
            got = self._jobs.get(token, {}).get(name)
        if got is None:
            raise CrossfeedError(
                f"batch {name}: its records were staged in the memory of the process that encoded them, which "
                f"this step does not share; run the job on the in-process runner, or stage on disk "
                f"(WriteDataset(stage_in_memory=0))"
            )
        return got

    def data(self, token: str, name: str) -> bytes:
        """The framed records of batch ``name`` of job ``token``."""
        return self._get(token, name)[0]

    def part(self, token: str, name: str) -> StagedPart:
        return self._get(token, name)[1]

    def held(self, token: str) -> int:
        """Bytes held for job ``token``."""
        with self._lock:
            return self._held.get(token, 0)

    def drop(self, token: str) -> None:
        with self._lock:
            self._jobs.pop(token, None)
            self._held.pop(token, None)


STAGED = StagedMemory()  # this process's


@dataclass
class Summary:
    """The small facts about one batch that the shard plan needs."""

    batch_id: str
    buckets: dict[str, tuple[np.ndarray, np.ndarray]]  # split -> (bucket ids, record counts)
    num_bytes: dict[str, int]
    stats: dict[str, dict[str, FeatureStats]]
    schema: Schema
    skipped: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


def key_hashes(keys: list[str], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(shuffle_hash, split_hash)``, two uint64 arrays, pure functions of the keys (and seed)."""
    digests = b"".join(hashlib.blake2b(k.encode(), digest_size=16, person=b"crossfeed.key").digest() for k in keys)
    both = np.frombuffer(digests, dtype=">u8").reshape(-1, 2).astype(np.uint64)
    shuffle = both[:, 0]
    if seed:
        salt = str(int(seed)).encode()
        keyed = b"".join(
            hashlib.blake2b(k.encode(), digest_size=8, key=salt, person=b"crossfeed.seed").digest() for k in keys
        )
        shuffle = np.frombuffer(keyed, dtype=">u8").astype(np.uint64)
    return np.ascontiguousarray(shuffle), np.ascontiguousarray(both[:, 1])


def batch_schema(batch: SampleBatch) -> Schema:
    """The schema a batch's own values imply (for inputs that declare none)."""
    names = list(batch.columns)
    return infer_schema({n: batch.columns[n][i] for n in names} for i in range(len(batch)))


def encode_parts(
    batch: SampleBatch, schema: Schema | None, assign, seed: int = 0, lengths: tuple[str, ...] = ()
) -> tuple[list[Part], Summary]:
    """Encode every sample of ``batch``; ``assign(split_hashes) -> (names, index array)`` picks
    each record's split (see `splits.SplitSpec.assign`). ``lengths`` names the features whose
    per-record lengths (number of values) the parts carry, for the shards' lengths files."""
    if schema is None:
        schema = batch_schema(batch)
    names = schema.names
    missing = [n for n in names if n not in batch.columns]
    if missing or len(batch.columns) != len(names):
        raise SchemaError(f"batch {batch.batch_id}: columns {sorted(batch.columns)} differ from the schema {names}")
    try:  # column-wise: numeric columns take a few numpy operations per batch
        payloads = encoder_for(schema).encode_columns(batch.columns, len(batch))
    except SampleSchemaError as e:
        raise SchemaError(f"sample {batch.keys[e.index]!r}: {e.reason}") from None
    sizes = record_lengths(batch, lengths) if lengths else None
    shuffle, split_h = key_hashes(batch.keys, seed)
    split_names, which = assign(split_h)
    parts: list[Part] = []
    summary = Summary(batch.batch_id, {}, {}, {}, schema, batch.skipped, dict(batch.dropped))
    everything = len(split_names) == 1
    for s, name in enumerate(split_names):
        idx = np.arange(len(batch)) if everything else np.flatnonzero(which == s)
        if not len(idx):
            continue
        whole = Part(name, shuffle, batch.keys, payloads, sizes)
        part = whole if everything else whole.take(idx)
        parts.append(part)
        buckets, counts = np.unique((part.hashes >> np.uint64(64 - BUCKET_BITS)).astype(np.int64), return_counts=True)
        summary.buckets[name] = (buckets, counts.astype(np.int64))
        summary.num_bytes[name] = sum(map(len, part.payloads))
        summary.stats[name] = batch_stats(schema, batch if everything else batch.take(idx), lengths)
    return parts, summary


def record_lengths(batch: SampleBatch, names: tuple[str, ...]) -> np.ndarray:
    """``(records, len(names))`` uint32: each record's number of values of each feature."""
    out = np.zeros((len(batch), len(names)), dtype=np.uint32)
    for j, name in enumerate(names):
        col = batch.columns[name]
        if isinstance(col, Ragged):
            out[:, j] = col.lengths
            continue
        out[:, j] = np.fromiter((np.size(v) for v in col), dtype=np.int64, count=len(batch))
    return out


def batch_stats(schema: Schema, batch: SampleBatch, lengths: tuple[str, ...] = ()) -> dict[str, FeatureStats]:
    """Per-feature `FeatureStats` of a batch, vectorised where the column is a fixed-shape array.

    Numbers ignore NaN (a missing CSV/Parquet float) in min/max/mean; ``count`` counts samples.
    A feature in ``lengths`` (variable-length integers: tokens) gets `LengthStats` of its
    records' lengths instead of a histogram of shapes, and its values' min/max/mean at once.
    """
    out = {}
    n = len(batch)
    for f in schema:
        col = batch.columns[f.name]
        st = FeatureStats()
        if f.name in lengths:
            _length_stats(st, col, n)
        elif f.codec.image:
            st.count = n
            for shape in batch.shapes.get(f.name, ()):
                st.add_shape(shape)
        elif f.codec.text and not f.shape:
            st.count = n
        elif isinstance(col, np.ndarray) and col.dtype.kind in "biuf" and f.fixed:
            _array_stats(st, col, n, f)
        else:
            for v in col if not isinstance(col, np.ndarray) else list(col):
                st.add(v)
        out[f.name] = st
    return out


def _length_stats(st: FeatureStats, col, n: int) -> None:
    st.count = n
    st.lengths = LengthStats()
    ragged = isinstance(col, Ragged)
    st.lengths.add(col.lengths if ragged else np.fromiter((np.size(v) for v in col), dtype=np.int64, count=n))
    if st.lengths.total:
        vals = col.values if ragged else np.concatenate([np.ravel(v) for v in col])
        st.min, st.max = float(vals.min()), float(vals.max())
        st.total, st.n_values = float(vals.sum(dtype=np.float64)), int(vals.size)


def _array_stats(st: FeatureStats, col: np.ndarray, n: int, f: Feature) -> None:
    st.count = n
    if col.ndim > 1:
        st.shapes["x".join(str(d) for d in col.shape[1:])] = n
    vals = col.astype(np.float64, copy=False) if col.dtype.kind == "f" else col
    ok = ~np.isnan(vals) if vals.dtype.kind == "f" else None
    size = int(ok.sum()) if ok is not None else int(vals.size)
    if not size:
        return
    st.min = float(np.nanmin(vals)) if ok is not None else float(vals.min())
    st.max = float(np.nanmax(vals)) if ok is not None else float(vals.max())
    st.total = float(np.nansum(vals, dtype=np.float64)) if ok is not None else float(vals.sum(dtype=np.float64))
    st.n_values = size
