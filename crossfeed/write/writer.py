"""Writing datasets without TensorFlow.

`write_dataset` is for data one process can produce. The pieces it is made of — `StagedShard`
(a shard written under a temporary name) and `commit_split` (rename into place, manifest
last) — are what the Beam jobs use from many workers.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from crossfeed.format import index as idx
from crossfeed.format import tfrecord
from crossfeed.errors import ConfigError, CrossfeedError, SchemaError
from crossfeed.format.manifest import MANIFEST, Manifest, ShardInfo, SplitInfo, loads, shard_name, write_manifest
from crossfeed.format.encode import SampleSchemaError, encoder_for
from crossfeed.format.schema import Schema, infer_feature, widen
from crossfeed.format.stats import FeatureStats, merge_all

DEFAULT_SHARD_SIZE = 256 << 20


@dataclass(frozen=True)
class StagedShard:
    """A finished shard under a temporary name, waiting for `commit_split`."""

    tmp_path: str
    num_records: int
    num_bytes: int
    sha256: str


class ShardSink:
    """Writes one shard and its index file under temporary names in the dataset root."""

    def __init__(self, root: str, tag: str, *, compress: bool = False):
        self.tmp_path = os.path.join(root, f".tmp-{tag}.tfrecord" + (".gz" if compress else ""))
        self._writer = tfrecord.RecordWriter(self.tmp_path, compress=compress)

    def write(self, payload: bytes) -> None:
        self._writer.write(payload)

    @property
    def num_records(self) -> int:
        return len(self._writer.offsets)

    @property
    def num_bytes(self) -> int:
        return self._writer.num_bytes

    def finish(self) -> StagedShard:
        self._writer.close()
        idx.write_index(idx.index_path(self.tmp_path), self._writer.offsets)
        return StagedShard(self.tmp_path, len(self._writer.offsets), self._writer.num_bytes, self._writer.sha256)

    def abort(self) -> None:
        self._writer.close()
        for p in (self.tmp_path, idx.index_path(self.tmp_path)):
            if os.path.exists(p):
                os.unlink(p)


def discard(staged: Iterable[StagedShard]) -> None:
    for s in staged:
        for p in (s.tmp_path, idx.index_path(s.tmp_path)):
            if os.path.exists(p):
                os.unlink(p)


def read_manifest(root: str) -> Manifest | None:
    path = os.path.join(root, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return loads(f.read(), path)


def commit_splits(root, staged: dict[str, list[StagedShard]], schema: Schema, *,
                  statistics: dict[str, dict] | None = None, metadata: dict | None = None) -> Manifest:
    """Move staged shards to their final names and write the manifest, last.

    Adds the splits in ``staged`` (each list in shard order) to the dataset at ``root`` or replaces
    them (their old shards are deleted); other splits are kept when their schema is the same. While
    this runs the manifest is absent, so no reader ever sees old and new files mixed, and a job
    committing several splits never leaves a new ``train`` beside an old ``validation``.
    """
    root = os.fspath(root)
    if not staged or any(not v for v in staged.values()):
        raise ConfigError(f"{root}: nothing to commit ({ {k: len(v) for k, v in staged.items()} })")
    old = read_manifest(root)
    splits = dict(old.splits) if old else {}
    others = set(splits) - set(staged)
    if old and old.schema != schema and others:
        raise SchemaError(
            f"{root}: the dataset's splits {sorted(others)} have schema {old.schema.names} with other types than "
            f"the splits {sorted(staged)} being written; write to another directory, or rewrite every split")
    manifest_path = os.path.join(root, MANIFEST)
    if os.path.exists(manifest_path):
        os.unlink(manifest_path)
    for name in staged:
        for sh in splits[name].shards if name in splits else ():
            for p in (os.path.join(root, sh.file), idx.index_path(os.path.join(root, sh.file))):
                if os.path.exists(p):
                    os.unlink(p)
    for name, shards in sorted(staged.items()):
        infos = []
        for i, s in enumerate(shards):
            final = shard_name(name, i, len(shards), compress=s.tmp_path.endswith(".gz"))
            os.replace(s.tmp_path, os.path.join(root, final))
            os.replace(idx.index_path(s.tmp_path), idx.index_path(os.path.join(root, final)))
            infos.append(ShardInfo(final, s.num_records, s.num_bytes, s.sha256))
        splits[name] = SplitInfo(name, tuple(infos), (statistics or {}).get(name, {}))
    meta = dict(old.metadata) if old else {}
    meta.update(metadata or {})
    manifest = Manifest(schema, splits, meta)
    write_manifest(root, manifest)
    return manifest


def commit_split(root, split: str, staged: list[StagedShard], schema: Schema, *,
                 statistics: dict | None = None, metadata: dict | None = None) -> Manifest:
    """`commit_splits` for one split."""
    return commit_splits(root, {split: staged}, schema, statistics={split: statistics or {}}, metadata=metadata)


def write_dataset(path, samples: Iterable[Mapping], *, split: str = "train", num_shards: int | None = None,
                  shard_size: int = DEFAULT_SHARD_SIZE, schema: Schema | None = None, compress: bool = False,
                  metadata: dict | None = None):
    """Write ``samples`` (dicts of numpy arrays, scalars, bytes or str) as split ``split`` of the
    dataset at ``path``, and return the opened dataset.

    With ``num_shards`` samples go round-robin, so shard counts differ by at most one; without it
    a new shard starts every ``shard_size`` bytes. The schema is inferred unless given (list
    lengths may vary; tensor shapes may not unless the schema says ``None``). The split is added
    or replaced atomically: on any error nothing of it is left behind.
    """
    from crossfeed.read.dataset import open_dataset

    if num_shards is not None and num_shards < 1:
        raise ConfigError(f"num_shards must be >= 1, got {num_shards}")
    if shard_size < 1:
        raise ConfigError(f"shard_size must be >= 1 byte, got {shard_size}")
    root = os.fspath(path)
    os.makedirs(root, exist_ok=True)
    token = secrets.token_hex(4)
    feats = {f.name: f for f in schema} if schema is not None else None
    inferred = schema is None
    sinks: list[ShardSink] = []
    staged: list[StagedShard] = []
    stats: dict[str, FeatureStats] = {}

    def new_sink() -> ShardSink:
        sinks.append(ShardSink(root, f"{token}-{split}-{len(sinks):05d}", compress=compress))
        return sinks[-1]

    def put(payload: bytes, count: int) -> None:
        if num_shards is not None:
            sinks[(count - 1) % num_shards].write(payload)
        else:
            if not sinks or sinks[-1].num_bytes >= shard_size:
                if sinks:
                    staged.append(sinks[-1].finish())
                new_sink()
            sinks[-1].write(payload)

    try:
        if num_shards is not None:
            for _ in range(num_shards):
                new_sink()
        count = 0
        if inferred:  # the schema may widen at any sample: one at a time
            enc = None
            for count, sample in enumerate(samples, 1):
                feats = _widen_all(feats, sample, count)
                sch = Schema(feats.values())
                if enc is None or enc.schema != sch:
                    enc = encoder_for(sch)
                try:
                    payload = enc.encode(sample)
                except SchemaError as e:
                    raise SchemaError(f"sample {count - 1}: {e}") from None
                for k, v in sample.items():
                    stats.setdefault(k, FeatureStats()).add(v)
                put(payload, count)
        else:  # a chunk at a time, with the same results and errors as one at a time
            enc = encoder_for(Schema(feats.values()))
            it = iter(samples)
            while True:
                chunk, pending = [], None
                try:
                    for sample in it:
                        chunk.append(sample)
                        if len(chunk) >= _CHUNK:
                            break
                except BaseException as e:  # raised after the samples before it, as it would have been
                    pending = e
                if chunk:
                    try:
                        payloads = enc.encode_rows(chunk)
                    except SampleSchemaError as e:
                        if e.index:
                            _add_stats({}, chunk[: e.index])  # what would have failed before it
                        raise SchemaError(f"sample {count + e.index}: {e.reason}") from None
                    _add_stats(stats, chunk)
                    for payload in payloads:
                        count += 1
                        put(payload, count)
                if pending is not None:
                    raise pending
                if len(chunk) < _CHUNK:
                    break
        if count == 0:
            raise ConfigError(f"no samples to write for split {split!r}: the iterable was empty")
        staged += [s.finish() for s in (sinks if num_shards is not None else sinks[-1:])]
        commit_split(root, split, staged, Schema(feats.values()),
                     statistics={k: v.to_json() for k, v in merge_all([stats]).items()}, metadata=metadata)
    except BaseException:
        for s in sinks:
            s.abort()
        discard(staged)
        raise
    return open_dataset(root)


_CHUNK = 1024
_STAT_SCALARS = {float: np.float64, np.float64: np.float64, np.float32: np.float32, int: np.int64,
                 **{t: t for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)}}


def _add_stats(stats: dict[str, FeatureStats], chunk: list) -> None:
    """``FeatureStats.add`` of every value of ``chunk`` (samples with the same keys), per column:
    columns of one scalar type take a few numpy operations with exactly the same result (min/max
    in order, the total summed left to right); anything else goes value by value."""
    for k in chunk[0]:
        st = stats.setdefault(k, FeatureStats())
        col = [s[k] for s in chunk]
        types = set(map(type, col))
        if types <= {str, bytes}:
            st.count += len(col)
            continue
        if len(types) == 1 and _add_scalars(st, col, _STAT_SCALARS.get(types.pop())):
            continue
        for v in col:
            st.add(v)


def _add_scalars(st: FeatureStats, col: list, dtype) -> bool:
    if dtype is None:
        return False
    try:
        arr = np.array(col, dtype=dtype)
    except (OverflowError, ValueError, TypeError):
        return False
    vals = arr.astype(np.float64)
    if arr.dtype.kind == "f" and (np.isnan(vals).any() or not vals.all()):
        return False  # NaN and ±0 make min/max depend on the order: go value by value
    lo, hi = float(vals.min()), float(vals.max())
    st.count += len(col)
    st.min = lo if st.min is None else min(st.min, lo)
    st.max = hi if st.max is None else max(st.max, hi)
    st.total = float(np.add.accumulate(np.concatenate(([st.total], vals)))[-1])
    st.n_values += len(col)
    return True


def _widen_all(feats, sample: Mapping, count: int):
    feats = dict(feats or {})
    if count > 1 and set(sample) != set(feats):
        raise SchemaError(f"sample {count - 1} has keys {sorted(sample)}, earlier samples had {sorted(feats)}")
    for k, v in sample.items():
        try:
            f = infer_feature(k, v)
            feats[k] = widen(feats[k], f) if k in feats else f
        except SchemaError as e:
            raise SchemaError(f"sample {count - 1}: {e}") from None
        except CrossfeedError:
            raise
    return feats
