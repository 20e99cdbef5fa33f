"""Writing datasets without TensorFlow: `write_samples` (behind `crossfeed.write_dataset`), for
data one process can produce.

It stages shards (`crossfeed.write.staging`), gathers each feature's statistics, and commits
them atomically (`crossfeed.write.commit`) — the pieces the Beam jobs use from many workers. A
write never mixes two datasets in one directory: see `check_target` for ``overwrite`` and
``add_split``.
"""

from __future__ import annotations

import logging
import operator
import secrets
from collections.abc import Iterable, Mapping

import numpy as np

from crossfeed.errors import ConfigError, CrossfeedError, SchemaError
from crossfeed.format import tfrecord
from crossfeed.format.encode import SampleSchemaError, encoder_for
from crossfeed.format.encode_codec import FLOAT_SCALARS, INT_SCALARS
from crossfeed.format.schema import Feature, Schema, infer_feature, widen
from crossfeed.format.stats import FeatureStats, merge_all
from crossfeed.policy import OnError
from crossfeed.write.commit import check_target, commit_split, read_manifest_or_none, writer_lock
from crossfeed.write.options import WriteOptions
from crossfeed.write.staging import ShardSink, StagedShard, discard, finish_all
from crossfeed.write.target import write_target

log = logging.getLogger(__name__)


def write_samples(
    path,
    samples: Iterable[Mapping],
    *,
    split: str = "train",
    schema: Schema | None = None,
    metadata: dict | None = None,
    overwrite: bool = False,
    add_split: bool = False,
    options: WriteOptions | None = None,
    storage_options: Mapping | None = None,
    lengths: tuple[str, ...] | None = None,
    append: bool = False,
    **fields,
):
    """Write ``samples`` (dicts of numpy arrays, scalars, bytes or str) as split ``split`` of the
    dataset at ``path``, and return its root (``crossfeed.write_dataset`` returns it opened).

    How it is laid out is one `WriteOptions`, given whole (``options=``) or as its fields
    (``num_shards=``, ``shard_size="64MB"``, ``compress=True``): with ``num_shards`` samples go
    round-robin, so shard counts differ by at most one; without it a new shard starts every
    ``shard_size`` bytes. Every sample is the caller's: there is no bad-record policy here (a
    sample that does not fit the schema raises), so ``on_error="skip"`` is refused. The schema
    is inferred unless given (list lengths may vary; tensor shapes may not unless the schema
    says ``None``).

    ``path`` is a local directory or any fsspec URL the read side reads (``s3://bucket/dir``,
    ``gs://``, ``memory://``), reached with fsspec's ``storage_options``; a URL is written through
    a local staging directory and published with the manifest last (`crossfeed.write.target`).

    A given schema's variable-length raw tensors (shape ``(None,)``: a document's tokens) have
    their per-record lengths written beside each shard in the same pass (lengths files,
    `crossfeed.format.lengths`, listed in the manifest's ``lengths``), which packing and
    ``batch_by_tokens`` plan from. ``lengths=()`` writes none; a tuple of feature names writes
    those.

    ``path`` must be a new or empty directory. ``overwrite=True`` replaces the dataset there, all of
    its splits; ``add_split=True`` adds ``split`` to it, keeping its other splits (same schema).
    The commit is atomic (`commit_splits`): on any error, or if the process dies, readers see the
    old dataset or the new one, never a mix, and nothing of a failed write is left behind.

    ``append=True`` adds the samples to the dataset at ``path`` (to split ``split``, which it may
    have or not) as its next version: new shards, the old ones kept, the old manifest kept as
    ``crossfeed.v<N>.json`` and readable as ``open_dataset(path, version=N)`` or ``"path@vN"``
    (`crossfeed.write.commit.commit_splits`). The schema inferred from the samples (or given) must
    be the dataset's, feature by feature (a difference is refused, naming the feature: pass
    ``schema=crossfeed.open_dataset(path).schema`` to encode to it), and they get its lengths files;
    a local directory only.
    """
    opts = WriteOptions.given(options, fields)
    if opts.on_error is OnError.SKIP:
        raise ConfigError(
            "write_dataset has no bad-record policy (on_error='skip' applies to the convert sources, which "
            "parse their input): leave out the samples you do not want before writing"
        )
    num_shards, shard_size, compress = opts.num_shards, opts.shard_size, opts.compress
    with write_target(path, storage_options=storage_options, overwrite=overwrite) as target:
        root = target.root
        if append and target.remote:
            raise ConfigError(f"{target.url}: append=True writes to a local directory; append there, then upload it")
        # fail before the work
        old = check_target(root, overwrite=overwrite, add_split=add_split, splits=[split], clean=True, append=append)
        if append and old:
            schema = _appended_schema(root, old, schema, lengths)
            lengths = tuple(old.lengths) if lengths is None else lengths
        token = secrets.token_hex(6)
        with writer_lock(root, token):
            _write(
                root,
                token,
                samples,
                split=split,
                num_shards=num_shards,
                shard_size=shard_size,
                schema=schema,
                compress=compress,
                metadata=metadata,
                overwrite=overwrite,
                add_split=add_split,
                lengths=lengths,
                append=append,
            )
    return target.url if target.remote else root


def _appended_schema(root: str, old, schema: Schema | None, lengths) -> Schema | None:
    """The schema samples appended to ``old`` are encoded with: a given one must be the dataset's;
    None (inferred from the samples, then compared with the dataset's when committed)."""
    from crossfeed.write.commit import check_same_schema

    if schema is not None:
        check_same_schema(root, old, schema, tuple(old.lengths) if lengths is None else tuple(lengths))
    return schema


def _write(
    root: str,
    token: str,
    samples: Iterable[Mapping],
    *,
    split,
    num_shards,
    shard_size,
    schema,
    compress,
    metadata,
    overwrite,
    add_split,
    lengths=None,
    append=False,
) -> None:
    feats: dict[str, Feature] = {f.name: f for f in schema} if schema is not None else {}
    inferred = schema is None
    sinks: list[ShardSink] = []
    # each record's value counts, per sink, of the features that get lengths files: those named,
    # or a given schema's raw variable-length tensors (`_lengthy`); an inferred schema's, none
    if lengths is None and add_split:  # a split added to a dataset has the lengths files its splits have
        old = read_manifest_or_none(root)
        lengths = tuple(old.lengths) if old else None
    if lengths is not None:
        counted = list(lengths)
    elif inferred:
        counted = []
    else:
        counted = [f.name for f in schema if _lengthy(f)]
    sizes: list[list] = []
    staged: list[StagedShard] = []
    stats: dict[str, FeatureStats] = {}

    def new_sink() -> ShardSink:
        sinks.append(ShardSink(root, f"{token}-{split}-{len(sinks):05d}", compress=compress))
        sizes.append([])
        return sinks[-1]

    def put(payload: bytes, count: int, size) -> None:
        if num_shards is not None:
            k = (count - 1) % num_shards
        else:
            if not sinks or sinks[-1].num_bytes >= shard_size:
                if sinks:
                    staged.append(finish(len(sinks) - 1))
                new_sink()
            k = len(sinks) - 1
        sinks[k].write(payload)
        if size is not None:
            sizes[k].append(np.asarray(size, dtype=np.int64).reshape(1, -1))

    def put_many(payloads: list[bytes], done: int, rows: np.ndarray | None) -> None:
        """`put` of records ``done + 1``, ``done + 2``, … (``rows``: their sizes, ``(n, k)``): each
        shard's share framed and written as one batch, to the shards `put` would choose."""
        n = len(payloads)
        if num_shards is not None:
            for k in range(num_shards):
                j = (k - done) % num_shards  # the first of these records that goes to shard k
                sinks[k].write_many(payloads[j::num_shards])
                if rows is not None:
                    sizes[k].append(rows[j::num_shards])
            return
        framed = np.fromiter(map(len, payloads), dtype=np.int64, count=n) + _FRAMING
        i = 0
        while i < n:
            if not sinks or sinks[-1].num_bytes >= shard_size:
                if sinks:
                    staged.append(finish(len(sinks) - 1))
                new_sink()
            if compress:  # the compressed size grows as the stream flushes: a record at a time
                m = 1
            else:  # up to and including the record that reaches shard_size
                m = min(n - i, int(np.searchsorted(np.cumsum(framed[i:]), shard_size - sinks[-1].num_bytes)) + 1)
            sinks[-1].write_many(payloads[i : i + m])
            if rows is not None:
                sizes[-1].append(rows[i : i + m])
            i += m

    def _sizes_of(k: int) -> np.ndarray | None:
        if not keys:
            return None
        got = np.concatenate([np.zeros((0, len(keys)), dtype=np.int64), *sizes[k]])
        sizes[k] = []
        return got

    def finish(k: int) -> StagedShard:
        return sinks[k].finish(_sizes_of(k))

    keys = counted

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
                put(payload, count, _sizes(sample, keys) if keys else None)
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
                    put_many(payloads, count, _chunk_sizes(chunk, keys) if keys else None)
                    count += len(chunk)
                if pending is not None:
                    raise pending
                if len(chunk) < _CHUNK:
                    break
        if count == 0:
            raise ConfigError(f"no samples to write for split {split!r}: the iterable was empty")
        final = Schema(feats.values())
        missing = [k for k in keys if k not in final.names]
        if missing:
            raise ConfigError(f"lengths={list(keys)}: no feature {missing[0]!r} in the schema {list(final.names)}")
        last = range(len(sinks)) if num_shards is not None else [len(sinks) - 1]  # the shards still open
        staged += finish_all([sinks[k] for k in last], [_sizes_of(k) for k in last])
        commit_split(
            root,
            split,
            staged,
            final,
            statistics={k: v.to_json() for k, v in merge_all([stats]).items()},
            metadata=metadata,
            overwrite=overwrite,
            add_split=add_split,
            token=token,
            lengths=tuple(keys),
            append=append,
        )
    except BaseException:
        for s in sinks:
            s.abort()
        discard(staged)
        raise


_CHUNK = 1024
_FRAMING = tfrecord.HEADER + tfrecord.FOOTER  # a framed record's bytes beyond its payload


def _lengthy(f) -> bool:
    """Whether feature ``f`` of a given schema gets a lengths file by default: a variable-length
    one-dimensional raw tensor of numbers (a document's tokens)."""
    return tuple(f.shape) == (None,) and f.codec.dense and f.encoding.value == "tensor"


def _sizes(sample: Mapping, keys: list[str]) -> tuple[int, ...]:
    """The number of values of each of ``keys`` in ``sample`` (a list, an array, a scalar)."""
    try:
        return tuple(len(v) if isinstance(v, (list, tuple)) else int(np.size(v)) for v in map(sample.__getitem__, keys))
    except KeyError as e:
        raise ConfigError(f"lengths={list(keys)}: the samples have no feature {e.args[0]!r}") from None


def _chunk_sizes(chunk: list, keys: list[str]) -> np.ndarray:
    """`_sizes` of each sample of ``chunk`` (samples with the same keys), as an ``(n, k)`` array."""
    missing = [k for k in keys if k not in chunk[0]]
    if missing:
        raise ConfigError(f"lengths={list(keys)}: the samples have no feature {missing[0]!r}")
    out = np.empty((len(chunk), len(keys)), dtype=np.int64)
    for j, k in enumerate(keys):
        out[:, j] = np.fromiter(
            (
                v.size if isinstance(v, np.ndarray) else len(v) if isinstance(v, (list, tuple)) else int(np.size(v))
                for v in map(operator.itemgetter(k), chunk)
            ),
            dtype=np.int64,
            count=len(chunk),
        )
    return out


_STAT_SCALARS: dict = {**FLOAT_SCALARS, **INT_SCALARS}  # the scalar types whose columns are summed by numpy


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
        if st.add_arrays(col):  # integer arrays: tokens
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
