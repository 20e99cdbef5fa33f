"""The read pipeline as one public object: built once, then asked for batches or records.

    Pipeline.build(source, options, transform=, batch_transform=, alloc=)
        sampler ──► reader (frames ─► decode) ──► builder (transform ─► batch) ──► executor
        (integers)  (one per source, or merged)   (dict of numpy arrays)          (threads/processes)

Every front end assembles through it: the `Loader` (an epoch cursor over it), the adapters (torch,
TF, JAX — which hands it an allocator — and Grain, which reads records by key), the lease server
(batches for the index lists a dispatcher leases), the profiler and the process worker (which
builds one batch at a time in its own thread). Nobody outside this module touches its stages: they
are declared below as small `Protocol`\\ s, which both the plain and the packed stages satisfy.

The two operations every caller needs:

* ``batches(index_lists)`` — each list of global sample ids (or, packed, an encoded batch of the
  plan) built into a batch by the executor, in order;
* ``records(keys)`` — the decoded records of global keys, CRC-checked, no transform applied.

``classify(source)`` says what a source is (one dataset, a mixture, a stream of batches) for every
front end.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from crossfeed.config import resolve_callable
from crossfeed.errors import ConfigError, SchemaError, redact
from crossfeed.format.schema import Feature, mix_feature
from crossfeed.io.cache import Prefetcher, ShardCache
from crossfeed.policy import ErrorBudget, OnError
from crossfeed.read import metrics
from crossfeed.read.executors.processes import ProcessExecutor, WorkerRecipe
from crossfeed.read.executors.threads import ExecutorKind, ThreadExecutor
from crossfeed.read.identity import StreamIdentity
from crossfeed.read.options import LoaderOptions, Shuffle, Source
from crossfeed.read.sources.dataset import Dataset, Split, open_dataset
from crossfeed.read.sources.nested import flatten
from crossfeed.read.sources.union import UnionSplit
from crossfeed.read.stages import pack, recipes
from crossfeed.read.stages.batch import BatchBuilder
from crossfeed.read.stages.fetch import MixtureMerge, MixtureReader, SourceReader
from crossfeed.read.stages.sampler import Sampler

log = logging.getLogger(__name__)

__all__ = ["Builder", "Executor", "Pipeline", "PlanLike", "Reader", "SamplerLike", "SourceKind", "classify"]


# ---- what a source is ---------------------------------------------------------------------------


class SourceKind(str, enum.Enum):
    DATASET = "dataset"  # one dataset: a path, URL or `Dataset`
    MIXTURE = "mixture"  # a `Source`, or a list of them
    STREAM = "stream"  # an iterable of ready batches (``crossfeed.connect(...)``)


def classify(source) -> SourceKind:
    """What ``source`` is, the one answer every front end uses: a `crossfeed.Source` or a list
    of them is a mixture; a path, URL or `Dataset` one dataset; a list of batches (dicts) or any
    other iterable a stream of batches. Any other list (of paths, say) is refused by name."""
    if isinstance(source, Source):
        return SourceKind.MIXTURE
    if isinstance(source, (list, tuple)):
        if source and all(isinstance(s, Source) for s in source):
            return SourceKind.MIXTURE
        if source and all(isinstance(s, Mapping) for s in source):
            return SourceKind.STREAM  # batches in hand
        raise ConfigError(
            "a mixture is a non-empty list of crossfeed.Source(path, split=..., weight=...); got a list of "
            f"{sorted({type(s).__name__ for s in source}) or 'nothing'}"
        )
    if isinstance(source, (str, bytes, os.PathLike, Dataset)):
        return SourceKind.DATASET
    if hasattr(source, "__iter__"):
        return SourceKind.STREAM
    raise ConfigError(
        f"a source is a dataset (path, URL or crossfeed.Dataset), a mixture (crossfeed.Source list) or a "
        f"stream of batches (crossfeed.connect(...)); got {type(source).__name__}"
    )


def sources_of(source) -> tuple[Source, ...] | None:
    """The sources of a mixture, or None for one dataset (`classify`; a stream is refused)."""
    kind = classify(source)
    if kind is SourceKind.STREAM:
        raise ConfigError(f"{type(source).__name__} is a stream of batches: it is read as it comes, not planned")
    if kind is SourceKind.DATASET:
        return None
    return flatten((source,) if isinstance(source, Source) else tuple(source))  # nested mixtures: their leaves


# ---- the stages' contracts ----------------------------------------------------------------------


class PlanLike(Protocol):
    """One rank's (and worker's) batches for the rest of an epoch: what a builder builds."""

    random_access: bool  # ``batch_ids()`` and ``batch(b)`` exist: batches can be looked ahead at

    def __iter__(self) -> Iterator[np.ndarray]: ...

    def __len__(self) -> int: ...


class SamplerLike(Protocol):
    """Stage 1: the epoch plan on integers (`Sampler`, or `pack.PackSampler` over one)."""

    total: int  # samples (documents) per epoch: which data a state was saved for
    options: Any  # the `PlanOptions` it plans with

    def plan(self, epoch: int, position: int = 0) -> PlanLike: ...

    def epoch_total(self, epoch: int = 0) -> int: ...

    def within(self, epoch: int, position: int) -> bool: ...

    def rank_batch_count(self, position: int = 0, epoch: int = 0) -> int: ...

    def position_after(self, position: int, rank_batches_done: int, epoch: int = 0) -> int: ...

    def source_positions(self, epoch: int, position: int) -> list[dict] | None: ...


class Reader(Protocol):
    """Stages 2 and 3: global ids → ``(decoded batch, kept positions)`` (`SourceReader`, `MixtureReader`)."""

    decoder: Any
    mixture: bool  # ids global across a mixture's sources (``starts``)
    starts: np.ndarray  # each source's first global id, and the total at the end (one dataset: [0, N])

    def __call__(self, ids: np.ndarray, budget=None, tick=None) -> tuple[dict[str, np.ndarray], np.ndarray]: ...

    def where(self, i: int) -> str: ...


class Builder(Protocol):
    """Stage 4: one batch (`BatchBuilder`, or `pack.PackBuilder` over one)."""

    reader: Any  # a `Reader`
    transform: Callable | None
    budget: ErrorBudget | None
    meter: metrics.Meter | None
    alloc: Callable | None

    def __call__(self, indices: np.ndarray, timings: dict | None = None, tally=None) -> dict[str, np.ndarray]: ...


class Executor(Protocol):
    """Where batches are built, in order and bounded (`ThreadExecutor`, `ProcessExecutor`)."""

    @property
    def num_threads(self) -> int: ...  # builder threads of this process (0: built in the consumer's thread)

    @property
    def processes(self) -> int: ...  # worker processes (0: none)

    @property
    def skipped(self) -> int: ...  # records skipped in worker processes

    def map(self, build: Callable, items: Iterable) -> Iterator: ...

    def close(self) -> None: ...


# ---- the pipeline -------------------------------------------------------------------------------


class Pipeline:
    """The read pipeline of a dataset or a mixture, built once (`build`); see the module docstring.

    Attributes a front end reads: ``options``, ``kind``, ``sources`` (a mixture's, or None),
    ``datasets``, ``dataset`` (the first), ``split`` (one dataset's, or None), ``features`` (what
    the batches hold), ``starts`` (each source's first global key and the total at the end),
    ``identity`` (the stream's `crossfeed.read.identity.StreamIdentity`)."""

    sampler: SamplerLike
    builder: Builder
    executor: Executor

    @classmethod
    def build(
        cls,
        source,
        options: LoaderOptions | None = None,
        *,
        transform: Callable[[dict], dict] | str | None = None,
        batch_transform: Callable[[dict], dict] | str | None = None,
        alloc: Callable | None = None,
        filter: Callable[[dict], bool] | str | None = None,
        **fields,
    ) -> Pipeline:
        """The pipeline of ``source`` under ``options`` (or its fields as keywords). ``alloc``:
        ``alloc(shape, dtype)`` makes the batch arrays (default ``np.empty``; the JAX adapter's
        aligned buffers, a worker process's shared memory). ``filter``: a predicate on each
        decoded sample (or ``"module:function"``); a sample it rejects is dropped (`recipes`)."""
        options = LoaderOptions.given(options, fields)
        self = cls.__new__(cls)
        self._filter = filter
        self._init(source, options, transform, batch_transform)
        if alloc is not None:
            self.set_allocator(alloc)
        return self

    def _init(self, source, options: LoaderOptions, transform, batch_transform) -> None:
        if classify(source) is SourceKind.MIXTURE:  # a nested mixture's leaves, for workers too
            source = list(sources_of(source) or ())
        filter_ = getattr(self, "_filter", None)
        recipe = WorkerRecipe(source, options, transform, batch_transform, filter=filter_)
        self._filter_name = None if filter_ is None else f"filter {recipes.callable_name(filter_)}"
        self._transform_name = None if transform is None else f"transform {recipes.callable_name(transform)}"
        transform, batch_transform, filter_ = (
            resolve_callable(f, option=o) if isinstance(f, str) else f
            for f, o in ((transform, "transform"), (batch_transform, "batch_transform"), (filter_, "filter"))
        )
        self._filter = filter_
        self.options = options
        read = options.read
        self._budget = ErrorBudget(read.max_skips, logger=log) if read.on_error is OnError.SKIP else None
        self.sources: tuple[Source, ...] | None = sources_of(source)
        self.kind = SourceKind.DATASET if self.sources is None else SourceKind.MIXTURE
        self.datasets: list[Dataset] = []
        self.split: Split | None
        try:
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
                for s in self.sources:
                    self.datasets.append(
                        open_dataset(
                            s.path,
                            allowed_roots=read.allowed_roots,
                            read_timeout=read.read_timeout,
                            storage_options=read.storage_options if s.storage_options is None else s.storage_options,
                        )
                    )
                splits = [ds[s.split] for ds, s in zip(self.datasets, self.sources)]
                self.dataset, self.split = self.datasets[0], None
            self._assemble(source, options, recipe, splits, transform, batch_transform)
        except BaseException:
            for ds in self.datasets:
                ds.close()
            raise

    def _assemble(self, source, options: LoaderOptions, recipe, splits, transform, batch_transform) -> None:
        read, plan = options.read, options.plan
        tokens = pack.read_names(options, self.datasets)  # a token pipeline: packed rows or token budgets
        feats, stored = _features(tokens or options.features, self.datasets, self.sources)
        fit = read.image_fit
        # what the batches hold: the mixture's names, shapes reconciled, images as the fit makes them
        self.features = tuple(fit.feature(f) if fit and read.decode_images else f for f in feats)
        self.cache = ShardCache(read.cache_dir, read.cache_limit) if read.cache_dir is not None else None
        # sources that store the same features in one frame format (TFRecord, tar) share one decoder
        # (frames merged, or — local TFRecords — one pass over every source's shards); any other mix
        # (Parquet's row groups are columns already) decodes each source's part with its own reader
        # and merges the decoded parts (`MixtureMerge`)
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
        self.prefetcher = (
            Prefetcher(self.cache) if self.cache is not None and any(r.frames.cache for r in readers) else None
        )
        reader: SourceReader | MixtureReader
        self.sample_weights: Any = None  # a `crossfeed.format.weights.CumulativeWeights` under weights=
        if plan.weights is not None:  # a mixture's: the set of that name of each source, within its share
            from crossfeed.read.tools.weights import open_weights

            if self.sources is None:
                self.sample_weights = open_weights(self.dataset, plan.weights, options.split)
            else:
                self.sample_weights = [
                    open_weights(ds, plan.weights, src.split) for ds, src in zip(self.datasets, self.sources)
                ]
        self._plan_counts: Any = splits[0].block_counts if self.sources is None else [sp.counts for sp in splits]
        self._weights = None if self.sources is None else [s.weight for s in self.sources]
        if self.sources is None:
            sampler = Sampler(self._plan_counts, plan, options.shard, sample_weights=self.sample_weights)
            reader = readers[0]
            rows = readers[0].frames.rows
            self.starts = np.array([0, len(splits[0])], dtype=np.int64)
        else:
            sampler = Sampler(
                self._plan_counts, plan, options.shard, weights=self._weights, sample_weights=self.sample_weights
            )
            sizes = [len(sp) for sp in splits]
            self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            if alike:
                names = {a.name: f.name for a, f in zip(stored[0], feats)}
                reader = MixtureReader(
                    [] if union else readers, self.starts, union=readers[0] if union else None, names=names
                )
            else:
                merge = MixtureMerge(feats, [[a.name for a in st] for st in stored], decode_images=read.decode_images)
                reader = MixtureReader(readers, self.starts, merge=merge)
            rows = reader.rows
        self._reader = reader
        # stage metrics, always on (`stats`): a few clock reads per batch
        self.meter = metrics.Meter(cache=self.cache) if metrics.ENABLED else None
        self.recipe = self._sample_recipe(transform, tokens is not None, batch_transform)
        recipe = dataclasses.replace(recipe, transform_rng=self.recipe.rng, batch_transform_rng=self.recipe.batch_rng)
        builder = BatchBuilder(
            reader,
            transform=transform,
            batch_transform=batch_transform,
            return_index=options.return_index,
            budget=self._budget,
            meter=self.meter,
            recipe=self.recipe,
        )
        if tokens is not None:  # token datasets: rows packed (or budgets batched) over the documents' plan
            self.sampler, self.builder = pack.token_stages(sampler, builder, splits, stored, self.features, options)
        else:
            self.sampler, self.builder = sampler, builder
        self._plan_sampler: Any = self.sampler  # the plan without skipped steps (packed cursors, walks)
        skips = plan.skip.steps if plan.skip is not None else ()  # skipped steps leave the plan
        if skips:
            self.sampler = recipes.StepSkipSampler(self.sampler, skips)
        self._first_steps = recipes.FirstSteps(self._plan_sampler)
        # Small records cut column-wise are short numpy steps that hold the GIL: a thread only
        # contends for it, and handing a batch over costs more than building it (measured: 1.65M vs
        # 1.2M samples/s at batch 256), so they are built in the consumer's thread when it asks.
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
            self.meter.threads = self.executor.num_threads
            self.meter.processes = self.executor.processes
        # what decides which samples arrive in which order: states carry it, resuming checks it
        self.identity = StreamIdentity.of(
            options, self.datasets, self.sources, self.features, sample_weights=self.sample_weights
        )

    def _sample_recipe(self, transform, packed: bool, batch_transform=None) -> recipes.SampleRecipe:
        """The filter, the per-sample and per-batch generators and the skipped sample ids of the builder."""
        plan, filter_ = self.options.plan, self._filter
        skip = plan.skip
        rng = recipes.wants_rng(transform)
        if packed and rng:
            raise ConfigError(
                "per-sample transforms taking rng are not built for token pipelines (pack=, batch_by_tokens=), "
                "which plan rows from the stored lengths before a document is read; use a batch_transform taking "
                "rng instead — batch_transform=fn(batch, rng): it gets the packed batch and a generator keyed by "
                "(seed, epoch, the batch's global step), the same in any process, worker and resume"
            )
        if packed and filter_ is not None:
            raise ConfigError(
                "filter= is not built for token pipelines (pack=, batch_by_tokens=), "
                "which plan rows before a document is read: run the filter once ahead instead — `crossfeed filter "
                "DATASET --filter module:fn --out filtered.txt` (crossfeed.filter_pass) — then read with "
                "skip='filtered.txt' (a filtered document is absent from the packed plan), or read unpacked"
            )
        if packed and skip is not None and len(skip.samples) and skip.refill:
            raise ConfigError(
                "refilled skipped sample ids (skip= samples) are not built for token pipelines (pack=, "
                "batch_by_tokens=), nor needed: a skipped document is absent from their plan (the rows pack the "
                "following documents, so steps stay full); drop refill=True (a filter pass's file: run "
                "`crossfeed filter` without --refill)"
            )
        skip_ids = None  # a token pipeline's skipped documents have length 0 in its plan (`pack.DocLengths`)
        if skip is not None and len(skip.samples) and not skip.refill and not packed:  # refilled: out of the plan
            names = [str(ds.path) for ds in self.datasets]
            skip_ids = recipes.SkipIds(skip.ids(self.starts, names))
        name = self._filter_name or self._transform_name or "filter"
        if self._filter_name and self._transform_name:
            name = f"{self._filter_name} and {self._transform_name}"
        dropped = recipes.Dropped(self.options.read.max_filtered, name)
        return recipes.SampleRecipe(
            filter=filter_,
            rng=rng,
            batch_rng=recipes.wants_rng(batch_transform),
            rank=self.options.shard.rank,
            seed=plan.seed,
            skip_ids=skip_ids,
            # a token pipeline's documents are planned into rows: its transform may not drop one
            dropped=dropped if filter_ is not None or (transform is not None and not packed) else None,
            transform=transform is not None and not packed,
        )

    @property
    def filtered(self) -> int:
        """Samples dropped by the filter (or a transform returning None) so far, in this process
        and its worker processes."""
        d = self.recipe.dropped
        return (d.dropped if d is not None else 0) + getattr(self.executor, "filtered", 0)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next batches belong to (the per-sample generators' key): the builder's,
        and the process executor's, which sends it with each batch to its workers."""
        self.builder.epoch = int(epoch)  # type: ignore[attr-defined]
        if hasattr(self.executor, "epoch"):
            self.executor.epoch = int(epoch)

    def schedule_point(self, epoch: int, position: int, cursor=None) -> int:
        """The global sample (document) a mixture schedule stands at when ``position`` of
        ``epoch`` is reached: ``epoch × samples per epoch + position``; a packed plan's position
        counts rows: the documents its walk consumed to emit the rows before it
        (`pack.PackSampler.documents_before`, on from ``cursor``, a state's packed cursor)."""
        sampler: Any = self._plan_sampler
        if getattr(sampler, "pack", None) is not None and hasattr(sampler, "documents_before"):
            return epoch * self.total + sampler.documents_before(epoch, position, cursor)
        return epoch * self.total + position

    def global_step(self, epoch: int, position: int) -> int:
        """The global step (skipped ones counted) of the plan batch at ``position`` of ``epoch``:
        ``epoch × steps_per_epoch + step`` (`crossfeed.read.skips`; a token plan whose epochs differ
        in length: the earlier epochs' steps summed, `recipes.FirstSteps`); -1 outside the epoch."""
        if not self._plan_sampler.within(epoch, position):
            return -1
        return self._first_steps.global_step(epoch, position)

    @property
    def step_skips(self) -> recipes.StepSkipSampler | None:
        """The plan's skipped global steps (`crossfeed.read.skips`: which steps are kept, numbered
        without the others), or None when no step is skipped."""
        return self.sampler if isinstance(self.sampler, recipes.StepSkipSampler) else None

    def pinned_source(self):
        """The source with each dataset pinned to the version this pipeline opened (``root@vN``):
        what another process opens to read the same version, whatever is appended meanwhile."""
        at = [f"{ds.index_storage.root}@v{ds.version}" for ds in self.datasets]
        if self.sources is None:
            return at[0]
        return [dataclasses.replace(s, path=p) for s, p in zip(self.sources, at)]

    # -- the plan ---------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        """Samples (documents, for token pipelines) per epoch."""
        return self.sampler.total

    def plan(self, epoch: int, position: int = 0) -> PlanLike:
        """This rank's and worker's batches of epoch ``epoch`` from ``position``."""
        return self.sampler.plan(epoch, position)

    def epoch_total(self, epoch: int = 0) -> int:
        """Positions in epoch ``epoch`` (samples; packed: rows)."""
        return self.sampler.epoch_total(epoch)

    def within(self, epoch: int, position: int) -> bool:
        return self.sampler.within(epoch, position)

    def rank_batch_count(self, position: int = 0, epoch: int = 0) -> int:
        """Batches each rank delivers from ``position`` to the end of epoch ``epoch``."""
        return self.sampler.rank_batch_count(position, epoch=epoch)

    def position_after(self, position: int, rank_batches_done: int, epoch: int = 0) -> int:
        """The position after every rank delivered ``rank_batches_done`` batches from ``position``."""
        return self.sampler.position_after(position, rank_batches_done, epoch=epoch)

    def source_positions(self, epoch: int, position: int) -> list[dict] | None:
        """Where each source of a mixture stands (``{"pass", "offset"}``), for people; None otherwise."""
        return self.sampler.source_positions(epoch, position)

    def rank_sampler(self, rank: int, world_size: int) -> Sampler:
        """This (unpacked) plan as rank ``rank`` of ``world_size`` sees it: the same counts,
        weights or schedules and plan options (a dispatcher's lease server plans every rank)."""
        shard = dataclasses.replace(self.options.shard, rank=rank, world_size=world_size)
        return Sampler(
            self._plan_counts, self.options.plan, shard, weights=self._weights, sample_weights=self.sample_weights
        )

    def resume_state(self, epoch: int, position: int, *, walk: bool = True) -> dict | None:
        """A packed plan's cursor at or just before ``position`` (`pack.PackCursor.to_json`): what
        a state carries so a resume walks on from there (``walk=False``: the nearest one known,
        no walk); None for any other plan."""
        sampler: Any = self._plan_sampler
        if not hasattr(sampler, "cursor_at") or getattr(sampler, "pack", None) is None:
            return None
        cursor = sampler.cursor_at(epoch, position) if walk else sampler.marks(epoch).best(position)
        return cursor.to_json()

    def resume_from(self, state, epoch: int, position: int) -> bool:
        """Take a state's packed cursor (checked: `pack.PackCursor.from_json`) as a place to walk on
        from to ``position``; False where it does not lead there (another epoch, past it)."""
        sampler: Any = self._plan_sampler
        if getattr(sampler, "pack", None) is None:
            raise ConfigError("loader state pack: this Loader does not pack rows; the state was saved by one that does")
        return sampler.resume(state, epoch, position)

    def packed_batch(self, epoch: int, position: int, b: int, rank: int) -> tuple[np.ndarray, int] | None:
        """A packed plan's rank batch by number (`pack.PackSampler.rank_batch`: walked to from the
        nearest cursor): ``(encoded batch, the row its walk began at)``; None past the epoch's end."""
        skips = self.step_skips  # numbered as the plan has them, skipped steps counted
        sampler: Any = self.sampler if skips is None else skips.inner
        if getattr(sampler, "pack", None) is None:
            raise ConfigError("packed_batch: this Loader does not pack rows (pack=)")
        return sampler.rank_batch(epoch, position, b, rank)

    def walker(self) -> pack.PackWalker | recipes.StepSkipWalker:
        """Global batches of a packed plan by number, in any order (a dispatcher's leases); with
        skipped steps numbered without them, as the dispatcher counts an epoch's kept steps."""
        skips = self.step_skips
        if skips is not None:  # kept step j: plan batch `Kept.plan_batch(j)` of the walk
            return recipes.StepSkipWalker(pack.PackWalker(skips.inner), skips)
        return pack.PackWalker(self.sampler)  # refuses any other plan (those are random access: `Plan.batch`)

    # -- the two operations -----------------------------------------------------------------------
    def batches(self, index_lists: Iterable[np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """Each of ``index_lists`` (global sample ids; packed: the plan's encoded batches) built
        into a batch by the executor, in order, at most the executor's window ahead. With stage
        metrics on, the consumer's wait and its own time between batches are timed too (the
        consumer is whoever iterates)."""
        meter = self.meter
        if meter is None:
            yield from self.executor.map(self.builder, index_lists)
            return
        # each clock read ends one interval and begins the next: the consumer's own time ends when
        # it asks (``asked``), and its wait ends when the batch is there (``got``); one iteration
        # writes ``meter.own`` (one writer)
        t, clock = meter.own, time.perf_counter_ns
        if self.executor.processes == 0 and self.executor.num_threads == 0:
            # built in the consumer's thread, into the same tally: the plan ends where the build
            # starts (``t.start``), and the wait where it ends (``t.last``); no hand-over
            build = self.builder
            asked = clock()
            for indices in index_lists:
                batch = build(indices, None, t)
                got = t.last
                t.plan += t.start - asked
                t.n_plan += 1
                t.wait += got - asked
                t.batches += 1
                t.samples += metrics.batch_rows(batch)
                yield batch
                asked = clock()
                t.consumer += asked - got
        else:
            # built on threads: each batch stamped when done (its hand-over starts); in worker
            # processes the executor times the hand-over
            threads = self.executor.processes == 0
            built = self.executor.map(self._stamped if threads else self.builder, meter.timed(index_lists))
            asked = clock()
            for item in built:
                got = clock()
                if threads:
                    batch, done = item
                    t.handover += got - done if got > done else 0
                    t.n_handover += 1
                else:
                    batch = item
                t.wait += got - asked
                t.batches += 1
                t.samples += metrics.batch_rows(batch)
                yield batch
                asked = clock()
                t.consumer += asked - got
        t.wait += clock() - asked

    def epoch(self, epoch: int, position: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """The batches of this rank's (and worker's) plan of epoch ``epoch`` from ``position``;
        remote shards are downloaded ahead of use where the plan can be looked ahead at."""
        plan = self.plan(epoch, position)
        self.set_epoch(epoch)
        ahead = self.prefetcher is not None and plan.random_access and self._uncached()
        items = self._prefetching(plan) if ahead else iter(plan)
        if self.recipe.batch_rng:  # ... and their global step (the batch transform's generator's key)
            items = self._stepped(plan, items, epoch, position)
        elif self.recipe.rng:  # each batch's ids carry their epoch (the per-sample generators' key)
            items = (recipes.tag(ids, epoch) for ids in items)
        yield from self.batches(items)
        if self.meter is not None:
            self.meter.own.epochs += 1

    def _stepped(self, plan, items, epoch: int, position: int) -> Iterator[np.ndarray]:
        """The plan's batches tagged with their epoch and global step (`recipes.tag`): worker ``w``
        of ``K`` yields the rank's kept batches ``w, w+K, …`` from ``position`` (a step-skipping
        plan's kept batch ``j`` is plan batch ``kept.plan_batch(j)``), so its i-th is global step
        ``global_step(epoch, position) + plan batch`` — as ``skip=`` and replay count steps."""
        first = self.global_step(epoch, position)
        kept = getattr(plan, "kept", None)
        worker, k = getattr(plan, "worker", 0), getattr(plan, "num_workers", 1)
        for i, ids in enumerate(items):
            j = worker + i * k
            yield recipes.tag(ids, epoch, first + (kept.plan_batch(j) if kept is not None else j))

    def step_tagged(self, planned: np.ndarray, epoch: int, position: int, step: int) -> np.ndarray:
        """``planned`` (a replayed batch: rank batch ``step`` of ``epoch`` from ``position``, skipped
        steps counted) tagged as iteration tagged it, so its transforms draw the same."""
        if not (self.recipe.rng or self.recipe.batch_rng):
            return planned
        return recipes.tag(planned, epoch, self.global_step(epoch, position) + step)

    def records(self, keys) -> dict[str, np.ndarray]:
        """The decoded records of global ``keys`` (a mixture's keys run through its sources in
        order, see ``starts``), CRC-checked, under the batches' feature names; no transform."""
        batch, _ = self._reader(np.asarray(keys, dtype=np.int64))
        return batch

    def decoded(self, keys) -> tuple[dict, np.ndarray]:
        """The samples of global ``keys`` decoded as a batch builds them, no transform: ``(batch,
        kept)``, ``kept`` each decoded sample's place in ``keys`` (under ``on_error="skip"`` an
        unreadable one is left out, within the budget)."""
        return self.builder.reader(np.asarray(keys, dtype=np.int64), self.builder.budget)

    def map(self, fn: Callable, items) -> Iterator:
        """``fn`` of each of ``items`` on this pipeline's executor, the results in order."""
        return self.executor.map(fn, items)

    def where(self, key: int) -> str:
        """Where record ``key`` lies: shard and byte offset (a mixture's source too)."""
        return self._reader.where(int(key))

    def build_batch(self, indices: np.ndarray, timings: dict[str, float] | None = None) -> dict[str, np.ndarray]:
        """One batch built in this thread (a worker process's, ``crossfeed bench``'s): with
        ``timings``, the seconds of each stage are added to it."""
        return self.builder(indices, timings)

    def set_allocator(self, alloc: Callable | None) -> None:
        """Build the batch arrays with ``alloc(shape, dtype)`` from now on (None: ``np.empty``):
        the collate after a per-sample transform, and — without one — the decoder's own arrays."""
        self.builder.alloc = alloc
        if self.builder.transform is None and hasattr(self.builder.reader.decoder, "alloc"):
            self.builder.reader.decoder.alloc = alloc

    def drain_meter(self):
        """The stage times since the last drain (a worker process sends them with each batch)."""
        return self.meter.drain() if self.meter is not None else None

    # -- what ran -------------------------------------------------------------------------------
    @property
    def skipped(self) -> int:
        """Bad records skipped so far (``on_error="skip"``), in this process and its workers."""
        return (self._budget.count if self._budget else 0) + self.executor.skipped

    @property
    def threads(self) -> int:
        return self.executor.num_threads

    @property
    def processes(self) -> int:
        return self.executor.processes

    @property
    def worker_pids(self) -> list[int]:
        """The process executor's workers (empty with threads, or before the first batch)."""
        return list(getattr(self.executor, "pids", []))

    def paths(self) -> dict[str, dict[str, int]]:
        """Which path of each stage served this process's batches so far:
        ``{"frames": {"rows": n, "whole": n, ...}, "decode": {"cut": n, "parsed": n}}``."""
        out: dict[str, dict[str, int]] = {"frames": {}, "decode": {}}
        for reader in self._readers:
            for stage, part in (("frames", reader.frames), ("decode", reader.decoder)):
                served = getattr(part, "served", None)
                for path, n in (served.snapshot() if served is not None else {}).items():
                    out[stage][path] = out[stage].get(path, 0) + n
        return out

    def stats(self) -> metrics.Stats:
        return self.meter.stats() if self.meter is not None else metrics.Stats()

    def record_bytes(self, indices: np.ndarray) -> int:
        """The framed bytes of one dataset's TFRecord ``indices`` (0 for a mixture or Parquet)."""
        split, total = self.split, 0
        if split is None or split.info.format != "tfrecord":
            return 0
        shard = np.searchsorted(split.starts, indices, side="right") - 1
        for s in np.unique(shard).tolist():
            local = indices[shard == s] - split.starts[s]
            total += int(split.index(s)[local, 1].sum())
        return total

    def clear(self) -> None:
        """Forget what the frame readers hold in memory (the next batches read again)."""
        for r in self._readers:
            clear = getattr(r.frames, "clear", None)
            if clear is not None:
                clear()

    def close(self) -> None:
        self.executor.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        for r in self._readers:
            r.frames.close()
        for ds in self.datasets:
            ds.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inside ---------------------------------------------------------------------------------
    def _stamped(self, indices: np.ndarray) -> tuple[dict[str, np.ndarray], int]:
        """A batch built by an executor thread, and when it was done (its hand-over starts)."""
        assert self.meter is not None
        t = self.meter.tally()
        return self.builder(indices, None, t), t.last

    def _prefetching(self, plan, ahead: int = 16) -> Iterator[np.ndarray]:
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
        assert self.prefetcher is not None
        if len(self._readers) == 1:
            parts = [(self._readers[0], indices)]
        else:
            src = np.searchsorted(self.starts, indices, side="right") - 1
            parts = [(self._readers[s], indices[src == s] - self.starts[s]) for s in np.unique(src).tolist()]
        for reader, ids in parts:
            if reader.frames.cache is not None:
                split = reader.frames.split
                shards = np.unique(np.searchsorted(split.starts, ids, side="right") - 1).tolist()
                self.prefetcher.want(reader.frames.jobs(shards))


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
