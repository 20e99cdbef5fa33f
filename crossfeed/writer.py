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

from crossfeed import index as idx
from crossfeed import tfrecord
from crossfeed.errors import ConfigError, CrossfeedError, SchemaError
from crossfeed.manifest import MANIFEST, Manifest, ShardInfo, SplitInfo, loads, shard_name, write_manifest
from crossfeed.schema import Schema, encode_sample, infer_feature, widen
from crossfeed.stats import FeatureStats, merge_all

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
    from crossfeed.dataset import open_dataset

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

    try:
        if num_shards is not None:
            for _ in range(num_shards):
                new_sink()
        count = 0
        for count, sample in enumerate(samples, 1):
            if inferred:
                feats = _widen_all(feats, sample, count)
            try:
                payload = encode_sample(Schema(feats.values()), sample)
            except SchemaError as e:
                raise SchemaError(f"sample {count - 1}: {e}") from None
            for k, v in sample.items():
                stats.setdefault(k, FeatureStats()).add(v)
            if num_shards is not None:
                sinks[(count - 1) % num_shards].write(payload)
            else:
                if not sinks or sinks[-1].num_bytes >= shard_size:
                    if sinks:
                        staged.append(sinks[-1].finish())
                    new_sink()
                sinks[-1].write(payload)
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
