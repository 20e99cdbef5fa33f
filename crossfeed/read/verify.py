"""Checking a dataset against its manifest: every record's CRCs, every index entry, record counts,
byte sizes and sha256 of every shard, and that each record decodes per the schema.

``verify_dataset(path)`` is what ``crossfeed verify`` runs. It keeps going after a problem, so one
run lists every bad shard; a problem that stops a shard's scan (a bad record) still leaves the
other shards checked. For GZIP shards offsets are positions in the uncompressed stream.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from crossfeed.format import example as ex
from crossfeed.format import index as idx
from crossfeed.format import tfrecord
from crossfeed.write.adopt import file_sha256, open_stream
from crossfeed.read.dataset import open_dataset
from crossfeed.errors import ConfigError, CorruptRecordError, ExampleError, IndexFileError, SchemaError
from crossfeed.format.manifest import ShardInfo
from crossfeed.format.schema import Schema, decode_value
from crossfeed.read.storage import Storage


@dataclass(frozen=True)
class Problem:
    """One thing wrong: the file, the byte offset (None when the whole file is concerned), why."""

    file: str
    offset: int | None
    reason: str

    def __str__(self) -> str:
        where = f"{self.file}: byte offset {self.offset}" if self.offset is not None else self.file
        return f"{where}: {self.reason}"


def verify_dataset(path, split: str | None = None, progress: Callable[[int], None] | None = None) -> list[Problem]:
    """All problems of the dataset at ``path`` (one split, or all); an empty list when it is sound.
    ``progress`` is called with each shard's byte size once it is checked."""
    with open_dataset(path) as ds:
        if ds.storage.remote:
            raise ConfigError(f"{ds.path}: verify reads local datasets; copy it to a local directory first")
        if split is not None and split not in ds.splits:
            raise ConfigError(f"{ds.path}: no split {split!r}; it has {sorted(ds.splits)}")
        problems: list[Problem] = []
        for name in [split] if split is not None else sorted(ds.splits):
            for shard in ds.splits[name].shards:
                problems += verify_shard(ds.storage, shard, ds.schema)
                if progress is not None:
                    progress(shard.num_bytes)
        return problems


def verify_shard(storage: Storage, shard: ShardInfo, schema: Schema) -> list[Problem]:
    path = storage.url(shard.file)
    ipath = idx.index_path(path)
    try:
        size = storage.size(shard.file)
    except FileNotFoundError:
        return [Problem(path, None, "shard file is missing; restore it, or re-index what is left with `crossfeed index --force`")]
    problems = []
    if size != shard.num_bytes:
        problems.append(Problem(path, None, f"file is {size} bytes, the manifest says {shard.num_bytes}"))
    if file_sha256(path) != shard.sha256:
        problems.append(Problem(path, None, "sha256 differs from the manifest: the file changed after it was written"))
    scanned, stream_len, complete = _scan(path, schema, problems)
    if complete and len(scanned) != shard.num_records:
        problems.append(Problem(path, None, f"holds {len(scanned)} records, the manifest says {shard.num_records}"))
    problems += _check_index(ipath, scanned, stream_len, shard.num_records)
    return problems


def _scan(path: str, schema: Schema, problems: list[Problem]) -> tuple[np.ndarray, int, bool]:
    """Walk the shard's records; returns ``(offsets_and_lengths, stream_length, reached_the_end)``."""
    found: list[tuple[int, int]] = []
    bad_sample = False
    stream_len = 0
    try:
        with open_stream(path) as buf:
            stream_len = len(buf)
            for offset, payload in tfrecord.records(buf, path):
                found.append((offset, tfrecord.HEADER + len(payload) + tfrecord.FOOTER))
                if not bad_sample:
                    reason = _decode_problem(schema, payload)
                    if reason:
                        bad_sample = True
                        problems.append(Problem(path, offset, reason))
            payload = None  # release the view before the mmap closes
        complete = True
    except CorruptRecordError as e:
        if e.offset == 0 and "GZIP" in e.reason:
            data, reason = _inflate_partial(path)
            problems.append(Problem(path, len(data), reason))
            try:
                found = [(o, tfrecord.HEADER + len(p) + tfrecord.FOOTER) for o, p in tfrecord.records(data, path)]
            except CorruptRecordError:
                pass  # the damage is already reported
            stream_len = len(data)
        else:
            problems.append(Problem(path, e.offset, e.reason))
        complete = False
    return np.array(found, dtype=np.int64).reshape(-1, 2), stream_len, complete


def _decode_problem(schema: Schema, payload) -> str | None:
    try:
        parsed = ex.decode(payload)
        for f in schema:
            decode_value(f, parsed, decode_images=False)
    except (ExampleError, SchemaError) as e:
        return f"record does not match the schema: {e}"
    return None


def _inflate_partial(path: str) -> tuple[bytes, str]:
    """What a damaged GZIP shard still yields, and why it stops."""
    out, d = [], zlib.decompressobj(31)
    with open(path, "rb") as f:
        data = f.read()
    try:
        out.append(d.decompress(data))
    except zlib.error as e:
        return b"".join(out), f"GZIP stream is damaged ({e}); records after this uncompressed offset are lost"
    return b"".join(out), "GZIP stream ends early (truncated file); records after this uncompressed offset are lost"


def _check_index(ipath: str, scanned: np.ndarray, stream_len: int, expected: int) -> list[Problem]:
    try:
        entries = idx.read_index(ipath)
    except IndexFileError as e:
        return [Problem(ipath, None, str(e).removeprefix(f"{ipath}: "))]
    problems = []
    if len(entries) != expected:
        problems.append(Problem(ipath, None, f"{len(entries)} entries, the manifest says {expected} records"))
    past = np.flatnonzero(entries.sum(axis=1) > stream_len)
    if past.size:
        o, n = entries[past[0]]
        problems.append(Problem(ipath, int(o), f"entry {past[0]} ({o} {n}) points past the end of the shard "
                                               f"({stream_len} bytes){_more(past.size)}; rebuild it with `crossfeed index --force`"))
    k = min(len(entries), len(scanned))
    wrong = np.flatnonzero(np.any(entries[:k] != scanned[:k], axis=1))
    wrong = np.setdiff1d(wrong, past)
    if wrong.size:
        i = int(wrong[0])
        problems.append(Problem(ipath, int(entries[i][0]), f"entry {i} says '{entries[i][0]} {entries[i][1]}', the record "
                                                          f"there is '{scanned[i][0]} {scanned[i][1]}'{_more(wrong.size)}; "
                                                          f"rebuild it with `crossfeed index --force`"))
    return problems


def _more(n: int) -> str:
    return f" (and {n - 1} more such entries)" if n > 1 else ""
