"""The DoFns of `WriteDataset` (see write.py for how they are wired), each one job:

``Encode``      SampleBatch                      -> (batch_id, Encoded: StagedParts + Summary)
``Plan``        (0, [Summary…, begin marker])    -> ("route", batch_id, tables) / ("shard", (split, i), ShardPlan) / ("commit", CommitInfo)
``Route``       (batch_id, [StagedParts, tables]) -> ((split, i), ("piece", StagedPart))
``WriteShard``  ((split, i), [ShardPlan, StagedPart…]) -> (0, ("staged", split, i, StagedShard | PendingShard))
``Commit``      (0, [CommitInfo, staged…])       -> WriteResult

The records' bytes never go through the runner: ``Encode`` frames each batch's records (TFRecord)
into a file of the job's staging folder (``.tmp-<token>.batches`` in the output root, which every
worker reaches as it reaches the shards it writes), sorted by hash, and passes on only each
record's hash, key, place in that file and lengths (`records.StagedPart`); ``WriteShard`` reads
the byte range of each batch file its records lie in and copies the framed records it keeps into
its shard, in order. ``Commit`` removes the folder. A job whose every step runs in one process
(``WriteConfig.memory_budget``: the embedded runner, `job.convert`) keeps those batches in that
process's memory instead (`records.STAGED`, up to the budget), never on disk, and finishes each
shard (hash, index, fsync) on a thread while it writes the next (`handoff.FINISHING`: what
reaches ``Commit`` is a `handoff.PendingShard`, which it waits for).

No DoFn uses side inputs, tagged outputs or ``finish_bundle`` output: every runner, DaskRunner
included, executes them the same way, and each output is a pure function of the data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import secrets
from dataclasses import dataclass, field

import apache_beam as beam
import numpy as np

from crossfeed.beam_jobs import plan as planning
from crossfeed.beam_jobs.commit import commit_splits, remove_temporaries
from crossfeed.beam_jobs.handoff import FINISHING, PendingShard
from crossfeed.beam_jobs.policy import EmptyInputError, ErrorPolicy
from crossfeed.beam_jobs.records import (
    NUM_BUCKETS,
    STAGED,
    HeldPart,
    Part,
    SampleBatch,
    StagedPart,
    Summary,
    encode_parts,
)
from crossfeed.beam_jobs.splits import SplitSpec
from crossfeed.errors import ConfigError, CorruptRecordError, CrossfeedError, SchemaError
from crossfeed.format import tfrecord
from crossfeed.format.frames import check_frames
from crossfeed.format.schema import Schema, widen
from crossfeed.format.stats import FeatureStats
from crossfeed.write.commit import remove_entry
from crossfeed.write.options import WriteOptions
from crossfeed.write.staging import TMP_PREFIX, ShardSink, StagedShard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteConfig:
    """Everything the write steps need; validated where it is made."""

    root: str
    token: str
    splits: SplitSpec
    options: WriteOptions = WriteOptions()  # shards, compression, the job-wide bad-record budget
    schema: Schema | None = None
    metadata: dict = field(default_factory=dict)
    seed: int = 0
    progress: bool = False
    overwrite: bool = False
    add_split: bool = False
    append: bool = False  # the shards join the dataset as its next version (`commit_splits`)
    lengths: tuple[str, ...] = ()  # features whose per-record lengths go into lengths files
    # Bytes of staged batches held in this process's memory rather than in files: only for a
    # runner that runs every step in this process (0: all staged on disk).
    memory_budget: int = 0

    def __post_init__(self):
        if not isinstance(self.options, WriteOptions):
            raise ConfigError(f"options must be a WriteOptions, got {type(self.options).__name__}")
        if not isinstance(self.memory_budget, int) or self.memory_budget < 0:
            raise ConfigError(f"memory_budget must be a whole number of bytes >= 0, got {self.memory_budget!r}")
        if not self.token or not self.token.isalnum():
            raise ConfigError(f"job token must be alphanumeric, got {self.token!r}")
        object.__setattr__(self, "lengths", tuple(self.lengths))
        if self.schema is not None:
            unknown = [n for n in self.lengths if n not in self.schema.names]
            if unknown:
                raise ConfigError(f"lengths of {unknown} asked for; the schema's features are {self.schema.names}")

    @property
    def policy(self) -> ErrorPolicy:
        return ErrorPolicy.of(self.options)

    @property
    def progress_dir(self) -> str:
        return os.path.join(self.root, f".tmp-{self.token}.progress")

    @property
    def batches_dir(self) -> str:
        """Where ``Encode`` stages each batch's framed records until the commit."""
        return os.path.join(self.root, f"{TMP_PREFIX}{self.token}.batches")


@dataclass
class CommitInfo:
    schema: Schema
    num_shards: dict[str, int]
    statistics: dict[str, dict]
    skipped: int
    dropped: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class WriteResult:
    """What a job wrote: samples and shards per split, bytes in all."""

    root: str
    samples: dict[str, int]
    shards: dict[str, int]
    num_bytes: int
    skipped: int


class EncodeDoFn(beam.DoFn):
    def __init__(self, cfg: WriteConfig):
        self.cfg = cfg

    def process(self, batch: SampleBatch):
        parts, summary = encode_parts(batch, self.cfg.schema, self.cfg.splits.assign, self.cfg.seed, self.cfg.lengths)
        name = hashlib.blake2b(batch.batch_id.encode(), digest_size=10, person=b"crossfeed.bat").hexdigest()
        staged = [stage_part(p, self.cfg, f"{name}-{j}") for j, p in enumerate(parts)]
        if self.cfg.progress:
            _report_progress(self.cfg.progress_dir, batch.batch_id, len(batch), sum(summary.num_bytes.values()))
        yield batch.batch_id, (staged, summary)


def stage_part(part: Part, cfg: WriteConfig, name: str) -> StagedPart | HeldPart:
    """``part``'s records framed, in hash order, into ``cfg.batches_dir/name`` (written under a
    name of its own, then renamed: a retried bundle writes the same bytes again), as a
    `StagedPart`; or, within the job's ``memory_budget``, held in this process's memory under that
    name (`records.STAGED`), as a `HeldPart` handle. In hash order, the records a shard keeps — a
    range of hashes — are one range of the file."""
    order = np.argsort(part.hashes, kind="stable")
    ids = order.tolist()
    data, sizes = tfrecord.frame_many([part.payloads[i] for i in ids])
    staged = StagedPart(
        part.split,
        name,
        part.hashes[order],
        [part.keys[i] for i in ids],
        np.cumsum(sizes) - sizes,
        sizes,
        None if part.lengths is None else part.lengths[order],
    )
    held = dataclasses.replace(staged, in_memory=True)
    if cfg.memory_budget and STAGED.put(cfg.token, held, data, cfg.memory_budget):
        return HeldPart(part.split, name, 0, len(staged))
    _write_batch(cfg.batches_dir, name, data)
    return staged


def _write_batch(folder: str, name: str, data: bytes) -> None:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _report_progress(folder: str, batch_id: str, samples: int, num_bytes: int) -> None:
    """One small file per batch; `job.watch_progress` adds them up. Best effort."""
    try:
        os.makedirs(folder, exist_ok=True)
        name = hashlib.blake2b(batch_id.encode(), digest_size=8).hexdigest()
        tmp = os.path.join(folder, f".{name}")
        with open(tmp, "w") as f:
            f.write(f"{samples} {num_bytes}\n")
        os.replace(tmp, os.path.join(folder, name))
    except OSError as e:
        log.debug("progress report failed: %s", e)


class PlanDoFn(beam.DoFn):
    """Merges every batch's summary in batch-id order (so statistics are the same on any runner)
    and lays out the shards of every split."""

    def __init__(self, cfg: WriteConfig):
        self.cfg = cfg

    def process(self, element):
        values = list(element[1])
        summaries = sorted((v for tag, v in values if tag == "summary"), key=lambda s: s.batch_id)
        cfg = self.cfg
        if not summaries:
            raise EmptyInputError(f"{cfg.root}: the input produced no samples; nothing was written")
        hist = {name: np.zeros(NUM_BUCKETS, dtype=np.int64) for name in cfg.splits.names}
        nbytes = dict.fromkeys(cfg.splits.names, 0)
        stats: dict[str, dict[str, FeatureStats]] = {name: {} for name in cfg.splits.names}
        schema = cfg.schema
        feats: dict = {}
        for s in summaries:
            for name, (buckets, counts) in s.buckets.items():
                np.add.at(hist[name], buckets, counts)
                nbytes[name] += s.num_bytes[name]
                for k, st in s.stats[name].items():
                    stats[name][k] = stats[name][k].merge(st) if k in stats[name] else st
            if cfg.schema is None:
                feats = _widen_schema(feats, s)
        schema = schema if schema is not None else Schema(feats.values())
        skipped = sum(s.skipped for s in summaries)
        cfg.policy.check_total(skipped, cfg.root)
        dropped: dict[str, int] = {}
        for s in summaries:
            for why, count in s.dropped.items():
                dropped[why] = dropped.get(why, 0) + count
        total = sum(int(h.sum()) for h in hist.values())
        num_shards, tables = {}, {}
        for name in cfg.splits.names:
            count = int(hist[name].sum())
            if not count:
                raise EmptyInputError(
                    f"{cfg.root}: split {name!r} received none of the {total} samples; "
                    f"give it a larger ratio or convert more data"
                )
            n = planning.num_shards_for(
                name, count, nbytes[name], num_shards=cfg.options.num_shards, shard_size=cfg.options.shard_size
            )
            num_shards[name] = n
            plans = planning.plan_split(name, hist[name], n)
            tables[name] = planning.route_table(plans)
            for p in plans:
                yield "shard", (name, p.index), p
        for s in summaries:
            yield "route", s.batch_id, {name: tables[name] for name in s.buckets}
        statistics = {name: {k: v.to_json() for k, v in st.items()} for name, st in stats.items()}
        yield "commit", 0, CommitInfo(schema, num_shards, statistics, skipped, dropped)


def _widen_schema(feats: dict, s: Summary) -> dict:
    if feats and set(feats) != set(s.schema.names):
        raise SchemaError(
            f"batch {s.batch_id} has features {sorted(s.schema.names)}, earlier ones {sorted(feats)}; "
            f"every sample needs the same features, or pass schema="
        )
    out = dict(feats)
    for f in s.schema:
        out[f.name] = widen(out[f.name], f) if f.name in out else f
    return out


def route_batch(element, token: str = ""):
    """A batch's parts sent to the shards that keep their records: each piece a range of the
    part's records (in hash order; a `HeldPart` handle for a part held in memory by job ``token``)."""
    batch_id, values = element[0], list(element[1])
    parts = [v for tag, v in values if tag == "parts"]
    tables = [v for tag, v in values if tag == "table"]
    if len(parts) != 1 or len(tables) != 1:
        raise CrossfeedError(
            f"batch {batch_id!r}: expected one batch and one plan, got {len(parts)} and {len(tables)}; "
            f"are two batches using the same id?"
        )
    for part in parts[0]:
        if isinstance(part, HeldPart):
            for shard, lo, hi in planning.route_ranges(part.resolve(token), tables[0][part.split]):
                yield (part.split, shard), ("piece", HeldPart(part.split, part.name, part.lo + lo, part.lo + hi))
            continue
        for shard, piece in planning.route(part, tables[0][part.split]):
            yield (part.split, shard), ("piece", piece)


class WriteShardDoFn(beam.DoFn):
    """Sorts what one shard received and writes its ranks ``[lo, hi)`` to a staged shard: the
    framed records copied from the batches' staged files."""

    def __init__(self, cfg: WriteConfig):
        self.cfg = cfg

    def process(self, element):
        (split, index), values = element[0], list(element[1])
        plans = [v for tag, v in values if tag == "plan"]
        pieces: list[StagedPart] = [
            v.resolve(self.cfg.token) if isinstance(v, HeldPart) else v for tag, v in values if tag == "piece"
        ]
        if len(plans) != 1:
            raise CrossfeedError(f"shard {index} of split {split!r}: expected one plan, got {len(plans)}")
        p: planning.ShardPlan = plans[0]
        hashes = np.concatenate([x.hashes for x in pieces]) if pieces else np.zeros(0, np.uint64)
        keys = [k for x in pieces for k in x.keys]
        lengths = _lengths_of(pieces, len(self.cfg.lengths))
        if len(keys) != p.end_offset - p.first_offset:
            raise CrossfeedError(
                f"shard {index} of split {split!r}: received {len(keys)} records, the plan expects "
                f"{p.end_offset - p.first_offset}; the runner lost or repeated data"
            )
        order = planning.sorted_order(hashes, keys, split)
        os.makedirs(self.cfg.root, exist_ok=True)
        sink = ShardSink(self.cfg.root, f"{self.cfg.token}-{split}-{index:05d}", compress=self.cfg.options.compress)
        mine = order[p.lo - p.first_offset : p.hi - p.first_offset]
        try:
            views, starts = _read_pieces(self.cfg.batches_dir, pieces, self.cfg.token)
            which = np.repeat(np.arange(len(pieces)), [len(x) for x in pieces])[mine].tolist()
            sizes = np.concatenate([x.sizes for x in pieces])[mine] if pieces else np.zeros(0, np.int64)
            begin = starts[mine]
            rows = list(zip(which, begin.tolist(), (begin + sizes).tolist()))
            for at in range(0, len(rows), _WRITE_BATCH):  # written a batch at a time, as they were framed
                data = b"".join([views[w][a:b] for w, a, b in rows[at : at + _WRITE_BATCH]])
                sink.write_framed(data, sizes[at : at + _WRITE_BATCH])
            kept = None if lengths is None else lengths[mine]
            staged: StagedShard | PendingShard
            if self.cfg.memory_budget:  # every step in this process: finished on a thread as the next is written
                what = f"shard {index} of split {split!r} ({sink.tmp_path})"
                staged = FINISHING.hand_off(self.cfg.token, split, index, what, functools.partial(_finish, sink, kept))
            else:
                staged = sink.finish(kept)
        except BaseException:
            sink.abort()
            raise
        yield 0, ("staged", split, index, staged)


def _finish(sink: ShardSink, lengths: np.ndarray | None) -> StagedShard:
    """`ShardSink.finish`, the shard's files removed when it fails (on a `FINISHING` thread)."""
    try:
        return sink.finish(lengths)
    except BaseException:
        sink.abort()
        raise


_WRITE_BATCH = 1024  # records written at once (`ShardSink.write_framed`)


def _read_pieces(folder: str, pieces: list[StagedPart], token: str = "") -> tuple[list[memoryview], np.ndarray]:
    """The byte range of its batch's staged file that each piece's records lie in (one read a
    piece: the file is in hash order, a piece a range of hashes), and every record's offset in its
    piece's range, in the pieces' order. A piece held in memory (job ``token``'s, `records.STAGED`)
    is a view of those bytes, which never left this process (no read, no check)."""
    views, starts = [], []
    for x in pieces:
        lo, hi = (int(x.starts.min()), int((x.starts + x.sizes).max())) if len(x) else (0, 0)
        path = os.path.join(folder, x.name)
        if x.in_memory:
            views.append(memoryview(STAGED.data(token, x.name))[lo:hi])
            starts.append(x.starts - lo)
            continue
        try:
            with open(path, "rb") as f:
                f.seek(lo)
                buf = f.read(hi - lo)
        except FileNotFoundError:
            raise CrossfeedError(
                f"{path}: a batch's staged records are gone; was the job's staging folder removed?"
            ) from None
        if len(buf) != hi - lo:
            raise CrossfeedError(
                f"{path}: a batch's staged records end at byte {lo + len(buf)}, the plan expects {hi}; "
                f"the staging folder was changed while the job ran"
            )
        try:  # both CRCs of every staged record checked, so a shard never blesses bytes changed on disk
            check_frames(buf, x.starts - lo, x.sizes, path)
        except CorruptRecordError as e:
            raise CorruptRecordError(
                path, lo + e.offset, f"{e.reason}; a batch's staged record changed while the job ran (run it again)"
            ) from None
        views.append(memoryview(buf))
        starts.append(x.starts - lo)
    return views, (np.concatenate(starts) if starts else np.zeros(0, np.int64))


def _lengths_of(pieces: list[StagedPart], k: int) -> np.ndarray | None:
    """The pieces' records' lengths, ``(records, k)``, in the pieces' order (None: no lengths kept)."""
    if not k:
        return None
    if any(x.lengths is None for x in pieces):
        raise CrossfeedError("a piece of a shard carries no lengths, though the job keeps lengths files")
    return np.concatenate([x.lengths for x in pieces]) if pieces else np.zeros((0, k), np.uint32)


class CommitDoFn(beam.DoFn):
    """Checks every planned shard was staged, commits all splits, removes temporaries."""

    def __init__(self, cfg: WriteConfig):
        self.cfg = cfg

    def process(self, element):
        values = list(element[1])
        cfg = self.cfg
        infos = [v[1] for v in values if v[0] == "commit"]
        staged_items = [v[1:] for v in values if v[0] == "staged"]
        staged: dict[str, list[StagedShard | None]] = {}
        if len(infos) == 1:
            staged = {name: [None] * n for name, n in infos[0].num_shards.items()}
        try:
            if len(infos) != 1:
                raise CrossfeedError(f"{cfg.root}: expected one commit record, got {len(infos)}")
            for split, index, shard in staged_items:  # (a shard finished on a thread: once it is)
                staged[split][index] = shard.resolve(cfg.token) if isinstance(shard, PendingShard) else shard
            missing = [(n, i) for n, lst in staged.items() for i, s in enumerate(lst) if s is None]
            if missing:
                raise CrossfeedError(f"{cfg.root}: shards {missing} were never written; the runner lost work")
            info = infos[0]
            meta = dict(cfg.metadata)
            meta["skipped_records"] = info.skipped
            if info.dropped:
                meta["dropped_records"] = dict(sorted(info.dropped.items()))
            manifest = commit_splits(
                cfg.root,
                {n: [s for s in lst if s is not None] for n, lst in staged.items()},  # (none missing)
                info.schema,
                statistics=info.statistics,
                metadata=meta,
                overwrite=cfg.overwrite,
                add_split=cfg.add_split,
                append=cfg.append,
                token=cfg.token,
                lengths=cfg.lengths,
            )
        except BaseException:
            remove_temporaries(cfg.root, token=cfg.token)
            raise
        remove_entry(cfg.batches_dir)
        STAGED.drop(cfg.token)
        FINISHING.drop(cfg.token)
        remove_temporaries(cfg.root)  # this job's progress files and any stale job's leftovers
        yield WriteResult(
            cfg.root,
            {k: v.num_records for k, v in manifest.splits.items() if k in staged},
            {k: len(v) for k, v in staged.items()},
            sum(v.num_bytes for k, v in manifest.splits.items() if k in staged),
            info.skipped,
        )
