"""``samples | WriteDataset(path, split="train")``: a composite PTransform that writes a crossfeed
dataset (balanced TFRecord shards, index files, manifest with statistics) from any pipeline.

Input elements are ``(key, sample)`` pairs (``key`` a unique str, ``sample`` a dict of numpy
arrays, scalars, bytes or str), or, with ``batched=True``, `records.SampleBatch` chunks as the
built-in sources emit them. The output is one `steps.WriteResult`, once the dataset is committed.

What flows (see steps.py for each step)::

    SampleBatch ─Encode─► (batch_id, Parts+Summary) ─┬─Summaries─► GroupSummaries ─Plan─┬─► route tables ─┐
                                                     └─Parts──────────────────────────── GroupByBatch ◄──┘─Route─►
    ((split, shard), pieces) + shard plans ─GroupByShard─WriteShards─► staged shards ─GroupForCommit─Commit─► WriteResult

Determinism: each record's place is a pure function of its key hash (blake2b) and the global
bucket counts, so the same input and options give byte-identical shards on every runner and at
every parallelism. Records of one split are ordered by ``(hash, key)`` and cut into ``num_shards``
ranges whose counts differ by at most one. Atomicity: shards are written under ``.tmp-<token>-…``
names and the manifest last, in one atomic rename (commit.py); a failed job removes its temporaries,
a killed job's are removed by the next commit. One job per output directory at a time.
"""

from __future__ import annotations

import hashlib
import secrets

import apache_beam as beam

from crossfeed.beam_jobs.records import SampleBatch
from crossfeed.beam_jobs.splits import SplitSpec
from crossfeed.beam_jobs.steps import CommitDoFn, EncodeDoFn, PlanDoFn, WriteConfig, WriteShardDoFn, route_batch
from crossfeed.errors import ConfigError, SchemaError
from crossfeed.format.schema import Schema
from crossfeed.write.options import WriteOptions

PAIR_BATCH = 1024


class WriteDataset(beam.PTransform):
    """Write the input as split ``split`` (or as ``splits``, a `SplitSpec` or ``"a=0.9,b=0.1"``)
    of the dataset at ``path`` (a local or shared-filesystem directory every worker can reach).

    How it is laid out is one `WriteOptions`, whole (``options=``) or as its fields (``num_shards``
    fixes the shard count, otherwise it is ``ceil(bytes / shard_size)``; ``compress``;
    ``max_skips``, the job-wide budget of bad records the sources may skip). ``schema`` is
    inferred when not given. ``seed`` changes the write-time shuffle (not split membership).
    ``key_groups`` sets how many groups ``(key, sample)`` input is batched in (each group is held
    in memory once). ``path`` must hold no dataset: ``overwrite=True`` replaces one whole,
    ``add_split=True`` adds new splits to it (`crossfeed.write.writer.check_target`); the commit
    is one atomic rename. ``lengths`` names variable-length features whose per-record lengths
    (number of values) are written beside each shard (``NAME.len``, `crossfeed.format.lengths`),
    pinned by the manifest. ``stage_in_memory``: bytes of encoded batches held in this process's
    memory rather than staged in files until the shard writers copy them — only for a runner that
    runs every step in this process (the embedded in-process runner; `job.convert` sets it there),
    where each shard is also finished (hashed, indexed, fsynced) on a thread while the next is
    written; they are dropped, and those threads joined, at the commit, or — when the pipeline fails — by
    ``crossfeed.beam_jobs.commit.remove_temporaries(path, token=self.cfg.token)``, as `job.convert` does.
    """

    def __init__(
        self,
        path,
        *,
        split: str = "train",
        splits: SplitSpec | str | None = None,
        schema: Schema | None = None,
        metadata: dict | None = None,
        seed: int = 0,
        batched: bool = False,
        key_groups: int = 64,
        token: str | None = None,
        progress: bool = False,
        overwrite: bool = False,
        add_split: bool = False,
        lengths: tuple[str, ...] = (),
        options: WriteOptions | None = None,
        append: bool = False,
        stage_in_memory: int = 0,
        **fields,
    ):
        super().__init__()
        options = WriteOptions.given(options, fields, who="WriteDataset")
        if isinstance(splits, str):
            splits = SplitSpec.parse(splits)
        if key_groups < 1:
            raise ConfigError(f"key_groups must be >= 1, got {key_groups}")
        self.cfg = WriteConfig(
            root=str(path),
            token=token or secrets.token_hex(6),
            splits=splits or SplitSpec.single(split),
            options=options,
            schema=schema,
            metadata=dict(metadata or {}),
            seed=seed,
            progress=progress,
            overwrite=overwrite,
            add_split=add_split,
            lengths=tuple(lengths),
            append=append,
            memory_budget=stage_in_memory,
        )
        self.batched = batched
        self.key_groups = key_groups

    def expand(self, pcoll):
        cfg = self.cfg
        batches = pcoll if self.batched else pcoll | "BatchPairs" >> _BatchPairs(self.key_groups)
        encoded = batches | "Encode" >> beam.ParDo(EncodeDoFn(cfg))
        # A marker from a one-element Create, so that an empty input still reaches Plan and fails clearly
        # (made already tagged: every transform more costs the in-process runner ~8 ms to build and run).
        begin = pcoll.pipeline | "Begin" >> beam.Create([(0, ("begin", None))])
        summaries = encoded | "Summaries" >> beam.Map(lambda kv: (0, ("summary", kv[1][1])))
        planned = (
            (summaries, begin)
            | "GatherSummaries" >> beam.Flatten()
            | "GroupSummaries" >> beam.GroupByKey()
            | "Plan" >> beam.ParDo(PlanDoFn(cfg))
        )
        tables = planned | "RouteTables" >> beam.FlatMap(_pick, "route", "table")
        shard_plans = planned | "ShardPlans" >> beam.FlatMap(_pick, "shard", "plan")
        commit_info = planned | "CommitInfo" >> beam.FlatMap(_pick, "commit", "commit")
        parts = encoded | "Parts" >> beam.Map(lambda kv: (kv[0], ("parts", kv[1][0])))
        pieces = (
            (parts, tables)
            | "JoinPlan" >> beam.Flatten()
            | "GroupByBatch" >> beam.GroupByKey()
            | "Route" >> beam.FlatMap(route_batch, cfg.token)
        )
        staged = (
            (pieces, shard_plans)
            | "JoinShardPlans" >> beam.Flatten()
            | "GroupByShard" >> beam.GroupByKey()
            | "WriteShards" >> beam.ParDo(WriteShardDoFn(cfg))
        )
        return (
            (staged, commit_info)
            | "JoinCommit" >> beam.Flatten()
            | "GroupForCommit" >> beam.GroupByKey()
            | "Commit" >> beam.ParDo(CommitDoFn(cfg))
        )


def _pick(element, tag: str, new_tag: str):
    if element[0] == tag:
        yield element[1], (new_tag, element[2])


class _BatchPairs(beam.PTransform):
    """``(key, sample)`` pairs → `SampleBatch` chunks: grouped by a stable hash of the key into
    ``groups`` groups, sorted by key, cut every `PAIR_BATCH` samples (so batch ids are stable)."""

    def __init__(self, groups: int):
        super().__init__()
        self.groups = groups

    def expand(self, pcoll):
        return (
            pcoll
            | "KeyByGroup" >> beam.Map(_group_of, self.groups)
            | "GroupPairs" >> beam.GroupByKey()
            | "ToBatches" >> beam.FlatMap(_to_batches)
        )


def _group_of(pair, groups: int):
    key, sample = pair
    if not isinstance(key, str):
        raise ConfigError(f"WriteDataset takes (key: str, sample: dict) pairs; got a key of type {type(key).__name__}")
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8, person=b"crossfeed.grp").digest(), "big")
    return h % groups, (key, sample)


def _to_batches(element):
    group, pairs = element
    pairs = sorted(pairs, key=lambda kv: kv[0])
    for c in range(0, len(pairs), PAIR_BATCH):
        chunk = pairs[c : c + PAIR_BATCH]
        names = list(chunk[0][1])
        for key, sample in chunk:
            if len(sample) != len(names) or any(n not in sample for n in names):
                raise SchemaError(f"sample {key!r} has features {sorted(sample)}, others have {sorted(names)}")
        columns = {n: [s[n] for _, s in chunk] for n in names}
        yield SampleBatch(f"pairs-{group:05d}-{c // PAIR_BATCH:06d}", [k for k, _ in chunk], columns)
