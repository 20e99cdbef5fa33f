"""The Loader: the read pipeline in stages, framework-neutral.

    Sampler ──► FrameReader ──► decoder ──► transform ──► batch ──► executor ──► consumer
    (plan: batches  (Frames: checked  (dict of numpy  (user fn,    (re-stack    (threads,    (for loop, torch,
     of global       payloads, views   arrays, one     per sample)  samples)     in order,    tf, serve)
     indices)        or rows)          strategy)                                 bounded)

``Loader(source, options)`` (or ``Loader(source, batch_size=..., shuffle=..., ...)``, which makes
the `LoaderOptions`) iterates one epoch of batches, each a ``dict[str, np.ndarray]``; iterating
again runs the next epoch. Both framework adapters, ``crossfeed serve`` and ``crossfeed bench``
are thin layers over it and take the same options object.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import numpy as np

from crossfeed.config import resolve_callable
from crossfeed.errors import ConfigError, SchemaError, redact
from crossfeed.format.schema import INDEX_KEY, Feature, mix_feature
from crossfeed.io.cache import Prefetcher, ShardCache
from crossfeed.policy import ErrorBudget, OnError
from crossfeed.read import metrics
from crossfeed.read.executors.processes import ProcessExecutor, WorkerRecipe
from crossfeed.read.executors.threads import ExecutorKind, ThreadExecutor
from crossfeed.read.options import LoaderOptions, ReadOptions, Remainder, Shuffle, Source
from crossfeed.read.sources.dataset import Dataset, Split, open_dataset
from crossfeed.read.sources.parquet import ParquetFrameReader
from crossfeed.read.sources.union import UnionSplit
from crossfeed.read.stages import pack
from crossfeed.read.stages.batch import BatchBuilder
from crossfeed.read.stages.fetch import MixtureMerge, MixtureReader, SourceReader
from crossfeed.read.stages.sampler import Plan, Sampler

log = logging.getLogger(__name__)
STATE_VERSION = 1

__all__ = ["INDEX_KEY", "Loader", "LoaderOptions", "ReadOptions", "Remainder", "Shuffle"]


class Loader:
    """Batches of one split, planned on integers, then fetched (see the module docstring).

    ``options``: a `LoaderOptions`, or its fields as keywords (``batch_size``, ``shuffle``
    "global"/"block"/"none", ``seed``, ``drop_last``, ``remainder`` "pad"/"drop", ``rank``,
    ``world_size``, ``worker``, ``num_workers``, ``block_shards``, ``read=ReadOptions(...)``,
    ``on_error``, ``max_skips``, ``split``, ``features``, ``return_index``). ``transform`` maps
    each sample dict and ``batch_transform`` each batch, in the loader's threads (or its worker
    processes, with ``executor="process"``; either may be a ``"module:function"`` string). ``start``:
    ``(epoch, position)`` to begin at (``epoch=`` alone: that epoch's start).

    ``source``: a dataset (TFRecord, WebDataset tar or Parquet; a path, URL or `Dataset`), or a
    mixture — a list of `crossfeed.Source`, of any of those formats, their features renamed to
    one set of names (``Source("wds/", rename={"jpg": "image", "cls": "label"})``); `features`
    says what the batches hold (a mixture's shapes and dtypes are the more general of its sources').

    Iteration is a cursor over the epochs, not a restartable collection (unlike
    ``torch.utils.data.DataLoader``): ``len(loader)`` is the number of batches the *next*
    iteration yields — the whole epoch at its start, the batches left after a broken-off one; a
    new ``iter()`` after a ``break`` continues the epoch where it stopped (no sample twice, none
    missed: what `state_dict` saves); an iteration that runs to the end moves the Loader to the
    next epoch. ``set_epoch(n)`` starts epoch ``n`` from its beginning (DataLoader's restart).
    """

    def __init__(
        self,
        source,
        options: LoaderOptions | None = None,
        *,
        transform: Callable[[dict], dict] | None = None,
        batch_transform: Callable[[dict], dict] | None = None,
        start: tuple[int, int] | None = None,
        epoch: int | None = None,
        **fields,
    ):
        options = LoaderOptions.given(options, fields)
        recipe = WorkerRecipe(source, options, transform, batch_transform)
        transform, batch_transform = (
            resolve_callable(f) if isinstance(f, str) else f for f in (transform, batch_transform)
        )
        if start is not None and epoch is not None:
            raise ConfigError("pass start=(epoch, position) or epoch=, not both")
        self.options = options
        read, plan = options.read, options.plan
        self.transform, self.batch_transform = transform, batch_transform
        self._budget = ErrorBudget(read.max_skips, logger=log) if read.on_error is OnError.SKIP else None
        self.sources: tuple[Source, ...] | None = _as_sources(source)
        if self.sources is None:
            self.dataset: Dataset = open_dataset(
                source,
                allowed_roots=read.allowed_roots,
                read_timeout=read.read_timeout,
                storage_options=read.storage_options,
            )
            self.datasets = [self.dataset]
            self.split = self.dataset[options.split]
            splits = [self.split]
        else:
            if plan.samples_per_epoch is None and not self.sources:
                raise ConfigError("a mixture needs at least one Source")
            self.datasets = [
                open_dataset(
                    s.path,
                    allowed_roots=read.allowed_roots,
                    read_timeout=read.read_timeout,
                    storage_options=read.storage_options if s.storage_options is None else s.storage_options,
                )
                for s in self.sources
            ]
            splits = [ds[s.split] for ds, s in zip(self.datasets, self.sources)]
            self.dataset, self.split = self.datasets[0], None
        tokens = pack.read_names(options, self.datasets)  # a token Loader: packed rows or token budgets
        feats, stored = _features(tokens or options.features, self.datasets, self.sources)
        fit = read.image_fit
        # what the batches hold: the mixture's names, shapes reconciled, images as the fit makes them
        self.features = tuple(fit.feature(f) if fit and read.decode_images else f for f in feats)
        self.cache = ShardCache(read.cache_dir, read.cache_limit) if read.cache_dir is not None else None
        # sources that store the same features in one frame format (TFRecord, tar) share one decoder
        # (frames merged, or — local TFRecords — one pass over every source's shards); any other mix
        # (Parquet's row groups are columns already) decodes each
        # source's part with its own reader and merges the decoded parts (`MixtureMerge`)
        formats = {sp.info.format for sp in splits}
        alike = len(formats) == 1 and "parquet" not in formats and all(s == stored[0] for s in stored)
        union = (
            self.sources is not None
            and alike
            and not any(ds.storage.remote for ds in self.datasets)
            and all(sp.info.format == "tfrecord" for sp in splits)
        )
        readers = []
        for i, (ds, sp) in enumerate([(self.datasets[0], UnionSplit(splits))] if union else zip(self.datasets, splits)):
            cache, whole, keep = _remote_mode(ds, sp, plan, self.cache)
            readers.append(SourceReader(sp, stored[i], read=read, whole_shards=whole, keep_loaded=keep, cache=cache))
        self._readers = readers
        self.prefetcher = Prefetcher(self.cache) if any(r.frames.cache for r in readers) else None
        if self.sources is None:
            self.sampler = Sampler(self.split.block_counts, plan, options.shard)
            reader = readers[0]
            rows = reader.frames.rows
        else:
            self.sampler = Sampler(
                [sp.counts for sp in splits], plan, options.shard, weights=[s.weight for s in self.sources]
            )
            sizes = [len(sp) for sp in splits]
            starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            if alike:
                names = {a.name: f.name for a, f in zip(stored[0], feats)}
                reader = MixtureReader(
                    [] if union else readers, starts, union=readers[0] if union else None, names=names
                )
            else:
                merge = MixtureMerge(feats, [[a.name for a in st] for st in stored], decode_images=read.decode_images)
                reader = MixtureReader(readers, starts, merge=merge)
            rows = reader.rows
        # stage metrics, always on (`stats`): a few clock reads per batch
        self.meter = metrics.Meter(cache=self.cache) if metrics.ENABLED else None
        self.builder = BatchBuilder(
            reader,
            transform=transform,
            batch_transform=batch_transform,
            return_index=options.return_index,
            budget=self._budget,
            meter=self.meter,
        )
        # Small records cut column-wise are short numpy steps that hold the GIL: a thread only
        # contends for it, and handing a batch over costs more than building it (measured: 1.65M vs
        # 1.2M samples/s at batch 256), so they are built in the consumer's thread when it asks.
        if tokens is not None:
            self.sampler, self.builder = pack.token_loader(
                self.sampler, self.builder, splits, stored, self.features, options, transform
            )
        threads = 0 if rows and transform is None and tokens is None else read.num_threads
        if read.executor is ExecutorKind.PROCESS:
            if isinstance(source, Dataset):  # workers open it again, by path, trusting what it was opened with
                trusted = options.replace(allowed_roots=(*read.allowed_roots, *source.allowed_roots))
                recipe = dataclasses.replace(recipe, source=source.path, options=trusted)
            recipe = dataclasses.replace(recipe, manifests=tuple(ds.manifest_sha256 for ds in self.datasets))
            self.executor = ProcessExecutor(recipe, read.processes, read.processes + read.prefetch, meter=self.meter)
        else:
            self.executor = ThreadExecutor(threads, max(1, read.num_threads + read.prefetch))
        if self.meter is not None:
            self.meter.threads = self.executor.num_threads if isinstance(self.executor, ThreadExecutor) else 0
            self.meter.processes = read.processes if read.executor is ExecutorKind.PROCESS else 0
            self._mark = self.meter.stats()  # the counters at the start of the epoch (`log_stats`)
        epoch, position = start if start is not None else (epoch or 0, 0)
        self.start_at(epoch, position)

    # -- plan & state -------------------------------------------------------------------------
    def paths(self) -> dict[str, dict[str, int]]:
        """Which path of each stage served this process's batches so far:
        ``{"frames": {"rows": n, "whole": n, ...}, "decode": {"cut": n, "parsed": n}}`` (see
        `FrameReader.served`, `ColumnarDecoder.served`), summed over a mixture's sources. Worker
        processes (``executor="process"``) count in their own processes."""
        out: dict[str, dict[str, int]] = {"frames": {}, "decode": {}}
        for reader in self._readers:
            for stage, part in (("frames", reader.frames), ("decode", reader.decoder)):
                served = getattr(part, "served", None)
                for path, n in (served.snapshot() if served is not None else {}).items():
                    out[stage][path] = out[stage].get(path, 0) + n
        return out

    def stats(self) -> metrics.Stats:
        """Where the time went: the Loader's stage metrics, cumulative since it was made (see
        `crossfeed.read.metrics`; ``stats().since(earlier)`` for an interval, ``.verdict()`` for
        whether the consumer waits on input and which stage to look at). Stages that ran in
        worker processes are included: each batch brings its own."""
        if self.meter is None:
            return metrics.Stats()
        return self.meter.stats()

    @property
    def rank(self) -> int:
        return self.options.shard.rank

    @property
    def world_size(self) -> int:
        return self.options.shard.world_size

    @property
    def worker(self) -> int:
        return self.options.shard.worker

    @property
    def num_workers(self) -> int:
        return self.options.shard.num_workers

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def skipped(self) -> int:
        return (self._budget.count if self._budget else 0) + getattr(self.executor, "skipped", 0)

    def start_at(self, epoch: int, position: int = 0) -> None:
        """Begin the next iteration at sample ``position`` of epoch ``epoch`` (positions count
        the samples every rank together consumed; see `crossfeed.read.stages.sampler`)."""
        if int(epoch) < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        if not self.sampler.within(int(epoch), int(position)):  # a packed epoch: walked no further than position
            raise ConfigError(
                f"position {position} is outside the epoch of {self.sampler.epoch_total(int(epoch))} samples; "
                f"was the state saved for another dataset?"
            )
        self._epoch, self._position, self._delivered = int(epoch), int(position), 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning on the next iteration (like DistributedSampler)."""
        self.start_at(epoch, 0)

    def plan(self) -> Plan:
        """This rank's and worker's batches for the rest of the current epoch."""
        return self.sampler.plan(self._epoch, self.position)

    @property
    def position(self) -> int:
        return self.sampler.position_after(self._position, self._delivered, epoch=self._epoch)

    def batch_count(self, *, all_workers: bool = False) -> int:
        """Batches the next iteration yields: this worker's, or with ``all_workers`` the whole
        rank's (every rank yields the same number)."""
        rank = self.sampler.rank_batch_count(self.position, epoch=self._epoch)
        if all_workers:
            return rank
        return len(range(self.worker, rank, self.num_workers))

    def __len__(self) -> int:
        return self.batch_count()

    def state_dict(self) -> dict:
        """Small and framework-free: resume with `load_state_dict` in any process, any world size."""
        state = {
            "version": STATE_VERSION,
            "seed": self.options.plan.seed,
            "epoch": self._epoch,
            "position": self.position,
            "num_samples": self.sampler.total,
            "batch_size": self.options.plan.batch_size,
        }
        if self.sources is not None and isinstance(self.sampler, Sampler):  # for people: where each source stands
            order = self.sampler.plan(self._epoch, self.position).order
            draws = order.epoch * order.per_epoch + order.draws(
                np.full(len(self.sources), self.position), np.arange(len(self.sources))
            )
            state["sources"] = [
                {"pass": int(d // n), "offset": int(d % n)} for d, n in zip(draws.tolist(), order.sizes.tolist())
            ]
        return state

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"loader state version {got!r} is not {STATE_VERSION}")
        try:
            seed, num, epoch, position = (
                state["seed"],
                state["num_samples"],
                int(state["epoch"]),
                int(state["position"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"loader state is missing or has a bad field: {e}") from None
        if seed != self.options.plan.seed or num != self.sampler.total:
            raise ConfigError(
                f"state was saved with seed {seed} over {num} samples; this loader has seed "
                f"{self.options.plan.seed} over {self.sampler.total}: resume with the same seed and dataset"
            )
        self.start_at(epoch, position)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self._position, self._delivered = self.position, 0
        step = self.num_workers if self.num_workers > 1 else 1
        plan = self.plan()
        ahead = self.prefetcher is not None and isinstance(plan, Plan) and self._uncached()
        batches = self._prefetching(plan) if ahead else iter(plan)
        meter = self.meter
        if meter is None:
            for batch in self.executor.map(self.builder, batches):
                self._delivered += step
                yield batch
        else:  # timed (`metrics.Tally`): the plan, each batch's hand-over, the consumer's wait and own time
            # each clock read ends one interval and begins the next: the consumer's own time ends when
            # it asks (``asked``), and its wait ends when the batch is there (``got``); an iteration of
            # the Loader writes ``meter.own`` (one writer)
            t, clock = meter.own, time.perf_counter_ns
            if (
                isinstance(self.executor, ThreadExecutor)
                and self.executor.num_threads == 0
                and type(self.builder) is BatchBuilder
            ):
                # built in the consumer's thread, into the same tally: the plan ends where the build
                # starts (``t.start``), and the wait where it ends (``t.last``); no hand-over
                build = self.builder
                asked = clock()
                for indices in batches:
                    batch = build(indices, None, t)
                    got = t.last
                    t.plan += t.start - asked
                    t.n_plan += 1
                    t.wait += got - asked
                    t.batches += 1
                    t.samples += metrics.batch_rows(batch)
                    self._delivered += step
                    yield batch
                    asked = clock()
                    t.consumer += asked - got
            else:
                # built on threads: each batch stamped when done (its hand-over starts); in worker
                # processes the executor times the hand-over
                threads = isinstance(self.executor, ThreadExecutor) and self.executor.num_threads > 0
                built = self.executor.map(self._stamped if threads else self.builder, meter.timed(batches))
                asked = clock()
                for batch in built:
                    got = clock()
                    if threads:
                        batch, done = batch
                        t.handover += got - done if got > done else 0
                        t.n_handover += 1
                    t.wait += got - asked
                    t.batches += 1
                    t.samples += metrics.batch_rows(batch)
                    self._delivered += step
                    yield batch
                    asked = clock()
                    t.consumer += asked - got
            t.wait += clock() - asked
            t.epochs += 1

        self._epoch, self._position, self._delivered = self._epoch + 1, 0, 0
        if meter is not None and self.options.read.log_stats:
            now = meter.stats()
            log.info("crossfeed epoch %d: %s", self._epoch - 1, now.since(self._mark).line())
            self._mark = now

    def _stamped(self, indices: np.ndarray) -> tuple[dict[str, np.ndarray], int]:
        """A batch built by an executor thread, and when it was done (its hand-over starts: the
        clock read that ended its last stage)."""
        t = self.meter.tally()
        return self.builder(indices, None, t), t.last

    def epochs(self, count: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """The batches of ``count`` epochs in a row (None: without end), from where the Loader
        stands; `state_dict` is exact after any batch, so an endless run resumes anywhere."""
        if count is not None and count < 0:
            raise ConfigError(f"epochs must be >= 0 or None, got {count}")
        done = 0
        while count is None or done < count:
            yield from self
            done += 1

    def _prefetching(self, plan: Plan, ahead: int = 16) -> Iterator[np.ndarray]:
        """The plan's batches, telling the prefetcher which remote shards the batch ``ahead``
        batches later needs (the plan knows the future: downloads run ahead of use)."""
        ids = plan.batch_ids()  # a range: sliced lazily, never a list of every batch
        for i, b in enumerate(ids):
            for k in ids[i + (ahead if i else 0) : i + ahead + 1]:  # the first time: the whole lookahead
                self._want(plan.batch(k))
            yield plan.batch(b)

    def _uncached(self) -> bool:
        """Whether a remote shard is not held in the cache yet (once every one is — a cached
        epoch — batches go without per-batch prefetch bookkeeping, as a local split's do)."""
        return any(
            r.frames.cache is not None and r.frames.jobs(range(len(r.frames.split.counts))) for r in self._readers
        )

    def _want(self, indices: np.ndarray) -> None:
        if self.sources is None:
            parts = [(self._readers[0], indices)]
        else:
            starts = self.builder.reader.starts
            src = np.searchsorted(starts, indices, side="right") - 1
            parts = [(self._readers[s], indices[src == s] - starts[s]) for s in np.unique(src).tolist()]
        for reader, ids in parts:
            if reader.frames.cache is not None:
                split = reader.frames.split
                shards = np.unique(np.searchsorted(split.starts, ids, side="right") - 1).tolist()
                self.prefetcher.want(reader.frames.jobs(shards))

    def close(self) -> None:
        self.executor.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        for r in self._readers:
            if r.frames.cache is not None or isinstance(r.frames, ParquetFrameReader):
                r.frames.close()
        for ds in self.datasets:
            ds.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_sources(source) -> tuple[Source, ...] | None:
    """The sources of a mixture (a list of `Source`), or None for one dataset."""
    if isinstance(source, Source):
        return (source,)
    if isinstance(source, (list, tuple)) and source and all(isinstance(s, Source) for s in source):
        return tuple(source)
    if isinstance(source, (list, tuple)):
        raise ConfigError("a mixture is a list of crossfeed.Source(path, split=..., weight=...)")
    return None


def _features(names, datasets: list[Dataset], sources) -> tuple[list[Feature], list[list[Feature]]]:
    """``(features, stored)``: the features the batches hold, and each source's own definitions of
    them (its names, `Source.rename`) in the same order. ``names``: the features to read, or None:
    every feature (a mixture: every feature its sources share, renamed). A mixture's feature
    covers each source's definition (`mix_feature`: shapes widened, dtypes to the wider one)."""
    if sources is None:
        schema = datasets[0].schema
        for n in names or ():
            if n not in schema.names:
                raise ConfigError(f"features: {datasets[0].path} has no feature {n!r}; it has {schema.names}")
        feats = [schema[n] for n in names] if names is not None else list(schema)
        return feats, [feats]
    # each source's features under the mixture's names: {mixture name: its own feature}
    own = []
    for i, (ds, src) in enumerate(zip(datasets, sources)):
        unknown = sorted(set(dict(src.rename)) - set(ds.schema.names))
        if unknown:
            raise ConfigError(
                f"source {i} ({ds.path}): rename= names {unknown}, not features of it; it has {ds.schema.names}"
            )
        mine = {src.name_of(f.name): f for f in ds.schema}
        if src.features is not None:
            missing = [n for n in src.features if n not in mine]
            if missing:
                raise ConfigError(
                    f"source {i} ({ds.path}): its features= names {missing}, which it does not have under the "
                    f"mixture's names; it has {sorted(mine)} (rename= {dict(src.rename)})"
                )
            mine = {n: mine[n] for n in src.features}
        own.append(mine)
    if names is None:
        names = [n for n in own[0] if all(n in m for m in own)]
        if not names:
            raise ConfigError(
                f"the mixture's sources share no feature ({[sorted(m) for m in own]}); pass features= to "
                f"choose, or rename= a source's features to the others' names"
            )
    where = [f"source {i} ({ds.path})" for i, ds in enumerate(datasets)]
    feats = []
    for n in names:
        for i, m in enumerate(own):
            if n not in m:
                raise ConfigError(
                    f"features: {where[i]} has no feature {n!r}; it has {sorted(m)}; rename= one of its "
                    f"features to {n!r}, or leave {n!r} out"
                )
        try:
            feats.append(mix_feature(n, [m[n] for m in own], where))
        except SchemaError as e:
            raise ConfigError(str(e)) from None
    return feats, [[m[n] for n in names] for m in own]


_warned: set[str] = set()


def _remote_mode(
    ds: Dataset, split: Split, plan, cache: ShardCache | None
) -> tuple[ShardCache | None, bool, int | None]:
    """How a split's shards are read: ``(cache or None, whole shards, shards kept open)``.

    Local: mmap, all of them. Remote with a cache: whole shards into the cache — all kept open
    (mapped, read as local shards are) when the split fits the cache, a window of them otherwise
    (a global shuffle needs the split to fit).
    Remote without one (or a global shuffle that does not fit): whole shards in memory for the
    sequential shuffles, one range request per record for the global one.
    """
    if not ds.storage.remote:
        return None, False, None
    window = 2 * plan.block_shards
    total = sum(s.num_bytes for s in split.shards)
    if cache is not None:
        if cache.limit is None or total <= cache.limit:
            return cache, True, None
        if plan.shuffle is not Shuffle.GLOBAL:  # the window the cache can hold: its entries are pinned
            holds = cache.holds(max(s.num_bytes for s in split.shards))
            thrash = plan.shuffle is Shuffle.BLOCK and holds < plan.block_shards
            if thrash and f"{ds.path}/{split.name}/block" not in _warned:
                _warned.add(f"{ds.path}/{split.name}/block")
                log.warning(
                    "%s split %r: cache_limit holds %d of its shards, a block shuffle reads %d at once "
                    "(block_shards): shards will be downloaded again within an epoch. Raise cache_limit or "
                    "lower block_shards.",
                    redact(ds.path),
                    split.name,
                    holds,
                    plan.block_shards,
                )
            return cache, True, min(window, holds)
        key = f"{ds.path}/{split.name}"
        if key not in _warned:
            _warned.add(key)
            log.warning(
                "%s split %r is %.1f GB, more than the cache limit of %.1f GB: a global shuffle would read one "
                "range request per record (slow on object stores). Use shuffle='block' (each shard downloaded "
                "once per epoch, %d shards in memory), or raise cache_limit above %.1f GB.",
                redact(ds.path),
                split.name,
                total / 1e9,
                cache.limit / 1e9,
                window,
                total / 1e9,
            )
    whole = plan.shuffle is not Shuffle.GLOBAL
    return None, whole, window if whole else None
