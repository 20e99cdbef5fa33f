"""The native engine: the dataset's shards read by TensorFlow's own C++ runtime.

    shard files ─► (seeded file shuffle) ─► interleave(TFRecordDataset) ─► [shard by record]
      ─► (seeded shuffle buffer) ─► [take: equal share per rank] ─► batch ─► parse_example
      ─► decode in graph ─► [take / repeat] ─► prefetch            yields `element_spec` dicts

Images and variable-shape tensors are parsed and decoded per record, then batched (ragged when
their shapes vary); everything else is batched first and parsed with one vectorised
``parse_example`` per batch.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from crossfeed.adapters import tf_spec
from crossfeed.adapters.tf_options import Shuffle, TFOptions
from crossfeed.errors import ConfigError, DatasetNotFoundError
from crossfeed.read.sources.dataset import Dataset

_CYCLE = 16  # files read at once when shuffling


def derive_seed(seed: int | None, epoch: int, salt: int) -> int | None:
    """A per-(seed, epoch, stage) op seed; a pure function of its inputs (None stays None)."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, epoch, salt]).generate_state(1, np.uint32)[0] & 0x7FFFFFFF)


def shares(counts, world_size: int) -> tuple[list[list[int]] | None, list[int]]:
    """How ``world_size`` readers split the shards: ``(files_per_rank, records_per_rank)``.

    With at least as many shards as readers, whole shards are assigned largest first to the
    least loaded reader (deterministic); ``files_per_rank`` is None when there are fewer shards
    than readers, and every reader then takes every ``world_size``-th record of the stream.
    """
    counts = [int(c) for c in counts]
    total = sum(counts)
    if len(counts) < world_size:
        return None, [total // world_size + (r < total % world_size) for r in range(world_size)]
    files: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        files[r].append(i)
        load[r] += counts[i]
    return [sorted(f) for f in files], load


def shard_paths(ds: Dataset, split: str) -> tuple[list[str], list[str]]:
    """``(paths, compression types)`` of a split's shards, as TensorFlow opens them."""
    paths, comps = [], []
    for sh in ds[split].shards:
        path = ds.storage.url(sh.file)
        if not ds.storage.remote and not os.path.exists(path):
            raise DatasetNotFoundError(f"{path}: shard file is missing; restore it or rebuild with `crossfeed index`")
        paths.append(path)
        comps.append("GZIP" if sh.compressed else "")
    return paths, comps


def _records_of(path, compression):
    return tf.data.TFRecordDataset(path, compression_type=compression)


def build(ds: Dataset, opts: TFOptions, *, take_batches: int | None = None) -> tf.data.Dataset:
    """The native pipeline for ``opts`` (rank ``opts.rank`` of ``opts.world_size``)."""
    if opts.return_index:
        raise ConfigError(
            "return_index=True needs the plan engine (the native engine does not know sample "
            "indices); pass engine='plan'"
        )
    feats = tf_spec.select(ds.schema, opts.features, ds.splits[opts.split].statistics)
    paths, comps = shard_paths(ds, opts.split)
    files_per_rank, per_rank = shares(ds[opts.split].counts, opts.world_size)
    if min(per_rank) == 0:
        raise ConfigError(
            f"split {opts.split!r} ({sum(per_rank)} records in {len(paths)} shards) leaves a reader of "
            f"{opts.world_size} with no records; use fewer readers or more data"
        )
    mine = list(range(len(paths))) if files_per_rank is None else files_per_rank[opts.rank]
    shuffled = opts.shuffle is not Shuffle.NONE
    npc = tf.data.AUTOTUNE if opts.num_parallel_calls is None else opts.num_parallel_calls

    files = tf.data.Dataset.from_tensor_slices(([paths[i] for i in mine], [comps[i] for i in mine]))
    if shuffled:
        files = files.shuffle(len(mine), seed=derive_seed(opts.seed, opts.epoch, 1), reshuffle_each_iteration=True)
    if shuffled:
        records = files.interleave(
            _records_of, cycle_length=min(len(mine), _CYCLE), block_length=1, num_parallel_calls=npc, deterministic=True
        )
    else:  # index order: one shard after another
        records = files.interleave(_records_of, cycle_length=1, block_length=1)
    if files_per_rank is None and opts.world_size > 1:
        records = records.shard(opts.world_size, opts.rank)
    if shuffled:
        records = records.shuffle(
            opts.shuffle_buffer, seed=derive_seed(opts.seed, opts.epoch, 2), reshuffle_each_iteration=True
        )
    if opts.world_size > 1:  # every rank yields the same number of samples
        records = records.take(min(per_rank))
    out = _parse(records, feats, opts, npc)
    n = min(per_rank) if opts.world_size > 1 else sum(per_rank)  # records this rank reads
    return tf_spec.finish(out, opts, take_batches, cardinality=tf_spec.batches(n, opts))


def _parse(records: tf.data.Dataset, feats, opts: TFOptions, npc) -> tf.data.Dataset:
    spec = tf_spec.feature_spec(feats)
    decode = tf_spec.make_decoder(feats)
    bs = opts.batch_size
    if bs is None or tf_spec.per_record(feats):
        out = records.map(
            lambda r: decode(tf.io.parse_single_example(r, spec)), num_parallel_calls=npc, deterministic=True
        )
        if bs is None:
            return out
        if any(None in tf_spec.item_shape(f) for f in feats):
            return out.ragged_batch(bs, drop_remainder=opts.drop_last, row_splits_dtype=tf.int64)
        return out.batch(bs, drop_remainder=opts.drop_last)
    return records.batch(bs, drop_remainder=opts.drop_last).map(
        lambda b: decode(tf.io.parse_example(b, spec)), num_parallel_calls=npc, deterministic=True
    )
