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

from crossfeed.errors import ConfigError
from crossfeed.format.schema import INDEX_KEY, SOURCE_KEY
from crossfeed.policy import ErrorBudget, OnError
from crossfeed.read.cache import Prefetcher, ShardCache
from crossfeed.read.dataset import Dataset, Split, open_dataset
from crossfeed.read.decode import collate, make_decoder
from crossfeed.read.executor import ExecutorKind, ThreadExecutor
from crossfeed.read.frame_reader import DeferredCrcError, FrameReader, Frames
from crossfeed.read.options import LoaderOptions, ReadOptions, Source
from crossfeed.read.parquet_reader import ParquetDecoder, ParquetFrameReader
from crossfeed.read.plan import Plan, Remainder, Sampler, Shuffle
from crossfeed.read.procs import ProcessExecutor, WorkerRecipe, resolve_callable
from crossfeed.read.union import UnionSplit

log = logging.getLogger(__name__)
STATE_VERSION = 1
STAGES = ("read", "decode", "transform", "batch")  # what `BatchBuilder` times, in order

__all__ = ["INDEX_KEY", "BatchBuilder", "Loader", "LoaderOptions", "ReadOptions", "Remainder", "Shuffle"]


class SourceReader:
    """Stages 2 and 3 for one split: global sample indices → ``(batch, kept)``, the decoded batch
    and the positions of the indices that made it into it (all, unless ``on_error`` dropped some)."""

    def __init__(
        self,
        split: Split,
        features,
        *,
        read: ReadOptions,
        whole_shards: bool,
        keep_loaded: int | None,
        cache: ShardCache | None = None,
    ):
        self._defer = False
        if split.info.format == "parquet":  # row groups read in place (crossfeed.read.parquet_reader)
            self.decoder = ParquetDecoder(features, decode_images=read.decode_images)
            self.frames = ParquetFrameReader(split, features)
            return
        # batch arrays the consumer has dropped are reused: at most this many are in flight
        self.decoder = make_decoder(
            features,
            decode_images=read.decode_images,
            recycle=read.num_threads + read.prefetch + 4,
            shard_format=split.info.format,
        )
        self.frames = FrameReader(split, whole_shards=whole_shards, keep_loaded=keep_loaded, cache=cache)
        self.frames.rows = self.decoder.columnar and self.frames.small_records()
        # big records' payload CRCs are checked by the columnar decoder as it copies them
        self._defer = self.decoder.columnar and not self.frames.rows

    def __call__(self, indices: np.ndarray, budget=None, tick=None) -> tuple[dict[str, np.ndarray], np.ndarray]:
        frames = self.frames(indices, on_error=budget, defer_crc=True) if self._defer else self.frames(indices, budget)
        if tick:
            tick("read")
        try:
            batch, kept = self._decode(frames, budget)
        except DeferredCrcError:  # a corrupt record: the exact path names it (or drops it into the budget)
            frames = self.frames(indices, on_error=budget)
            batch, kept = self._decode(frames, budget)
        if tick:
            tick("decode")
        if len(frames.indices) == len(indices):
            return batch, kept
        return batch, _positions(indices, frames.indices[kept])  # bad records were skipped (rare)

    def _decode(self, frames: Frames, budget):
        return self.decoder(frames, where=lambda j: self.frames.where(frames.indices[j]), on_error=budget)


def _positions(indices: np.ndarray, kept_values: np.ndarray) -> np.ndarray:
    """Positions in ``indices`` of ``kept_values`` (a subsequence of distinct ``indices``; a batch
    may repeat an index only under padding, where the first occurrences are taken in order)."""
    out, j = [], 0
    vals = kept_values.tolist()
    for i, v in enumerate(indices.tolist()):
        if j < len(vals) and v == vals[j]:
            out.append(i)
            j += 1
    return np.asarray(out, dtype=np.int64)


class MixtureReader:
    """Stages 2 and 3 for a mixture: the batch's sample ids (global across sources, see
    `crossfeed.read.plan.MixtureOrder`) are read by their sources' frame readers, the frames
    merged back into batch order (rows of one length from several sources become one matrix) and
    decoded once — the sources agree on every feature's definition, so one decoder serves all."""

    def __init__(self, readers: list[SourceReader], starts: np.ndarray, *, union: SourceReader | None = None):
        """``union``: one reader over every source's shards (a `UnionSplit`; local sources),
        which reads a mixture batch in one pass — then ``readers`` may be empty."""
        self.readers, self.starts, self.union = readers, starts, union
        self.decoder = (union or readers[0]).decoder
        self.rows = union.frames.rows if union is not None else all(r.frames.rows for r in readers)

    def where(self, i: int) -> str:
        s = int(np.searchsorted(self.starts, i, side="right") - 1)
        if self.union is not None:
            return f"source {s}: {self.union.frames.where(int(i))}"
        return f"source {s}: {self.readers[s].frames.where(int(i - self.starts[s]))}"

    def __call__(self, ids: np.ndarray, budget=None, tick=None) -> tuple[dict[str, np.ndarray], np.ndarray]:
        if self.union is not None:  # ids are the union's record ids: one read, one decode
            return self.union(ids, budget, tick)
        src = np.searchsorted(self.starts, ids, side="right") - 1
        parts = []
        for s in np.unique(src).tolist():
            m = np.flatnonzero(src == s)
            local = ids[m] - self.starts[s]
            fr = self.readers[s].frames(local, on_error=budget)
            parts.append((m if len(fr.indices) == len(m) else m[_positions(local, fr.indices)], fr))
        kept = np.concatenate([p for p, _ in parts]) if parts else np.zeros(0, np.int64)
        order = np.argsort(kept, kind="stable")
        slot = np.empty(len(ids), dtype=np.int64)  # batch position → position among the kept records
        slot[kept[order]] = np.arange(len(kept))
        if all(fr.rows is not None for _, fr in parts):
            by_len: dict[int, list] = {}
            for p, fr in parts:
                for pos, mat in fr.rows:
                    by_len.setdefault(mat.shape[1], []).append((slot[p if pos is None else p[pos]], mat))
            rows = [(np.concatenate([q for q, _ in g]), np.concatenate([mt for _, mt in g])) for g in by_len.values()]
            merged = Frames(ids[kept[order]], rows=rows)
        else:
            payloads: list = [None] * len(kept)
            for p, fr in parts:
                for j, v in zip(slot[p].tolist(), fr.as_payloads()):
                    payloads[j] = v
            merged = Frames(ids[kept[order]], payloads=payloads)
        if tick:
            tick("read")
        batch, ok = self.decoder(merged, where=lambda j: self.where(merged.indices[j]), on_error=budget)
        if tick:
            tick("decode")
        return batch, kept[order][ok]


class BatchBuilder:
    """One batch from its sample ids: frames → decode (`SourceReader`, or `MixtureReader`) →
    transform → batch. Runs in an executor thread; shared by the threads.

    With ``timings`` (a dict), the seconds each stage took are added to it under `STAGES`:
    ``crossfeed bench`` times the very stages the Loader runs.
    """

    def __init__(
        self,
        reader: SourceReader | MixtureReader,
        *,
        transform=None,
        batch_transform=None,
        return_index: bool = False,
        budget: ErrorBudget | None = None,
    ):
        self.reader = reader
        self.transform, self.batch_transform = transform, batch_transform
        self.return_index = return_index
        self.budget = budget
        self.alloc = None  # collate's allocator (None: np.empty); a worker process's puts batches in shared memory

    def __call__(self, indices: np.ndarray, timings: dict[str, float] | None = None) -> dict[str, np.ndarray]:
        tick = _Ticker(timings) if timings is not None else None
        batch, kept = self.reader(indices, self.budget, tick)
        indices = indices[kept]
        if self.transform is not None:
            samples = [self.transform({k: v[i] for k, v in batch.items()}) for i in range(len(indices))]
            if tick:
                tick("transform")
            if samples:
                batch = {k: collate([s[k] for s in samples], alloc=self.alloc or np.empty) for k in samples[0]}
            if tick:
                tick("batch")
        if self.return_index:
            if isinstance(self.reader, MixtureReader):
                starts = self.reader.starts
                src = starts[1:-1].searchsorted(indices, side="right")
                batch[SOURCE_KEY] = src
                batch[INDEX_KEY] = indices - starts.take(src)
            else:
                batch[INDEX_KEY] = indices
        if self.batch_transform is not None:
            if tick:
                tick(None)
            batch = self.batch_transform(batch)
            if tick:
                tick("transform")
        return batch


class _Ticker:
    """Adds the seconds since the last tick to ``timings[name]`` (None: not counted)."""

    def __init__(self, timings: dict[str, float]):
        self.timings, self.last = timings, time.perf_counter()

    def __call__(self, name: str | None) -> None:
        now = time.perf_counter()
        if name is not None:
            self.timings[name] = self.timings.get(name, 0.0) + now - self.last
        self.last = now


class Loader:
    """Batches of one split, planned on integers, then fetched (see the module docstring).

    ``options``: a `LoaderOptions`, or its fields as keywords (``batch_size``, ``shuffle``
    "global"/"block"/"none", ``seed``, ``drop_last``, ``remainder`` "pad"/"drop", ``rank``,
    ``world_size``, ``worker``, ``num_workers``, ``block_shards``, ``read=ReadOptions(...)``,
    ``on_error``, ``max_skips``, ``split``, ``features``, ``return_index``). ``transform`` maps
    each sample dict and ``batch_transform`` each batch, in the loader's threads (or its worker
    processes, with ``executor="process"``; either may be a ``"module:function"`` string). ``start``:
    ``(epoch, position)`` to begin at (``epoch=`` alone: that epoch's start).
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
            self.dataset: Dataset = open_dataset(source)
            self.datasets = [self.dataset]
            self.split = self.dataset[options.split]
            splits = [self.split]
        else:
            if plan.samples_per_epoch is None and not self.sources:
                raise ConfigError("a mixture needs at least one Source")
            self.datasets = [open_dataset(s.path) for s in self.sources]
            splits = [ds[s.split] for ds, s in zip(self.datasets, self.sources)]
            if any(sp.info.format == "parquet" for sp in splits):
                raise ConfigError(
                    "a mixture reads TFRecord or tar sources; mixing Parquet sources is not supported yet"
                )
            formats = [sp.info.format for sp in splits]
            if len(set(formats)) > 1:  # one decoder serves all: tar samples and TFRecords parse differently
                raise ConfigError(f"a mixture's sources must share one shard format, got {formats}; mix like with like")
            self.dataset, self.split = self.datasets[0], None
        feats = _features(options.features, self.datasets, self.sources)
        self.cache = ShardCache(read.cache_dir, read.cache_limit) if read.cache_dir is not None else None
        readers = []
        # a local mixture reads its sources' shards as one split (one pass per batch, not one per source)
        union = (  # one pass over every source's shards: local TFRecord sources
            self.sources is not None
            and not any(ds.storage.remote for ds in self.datasets)
            and all(sp.info.format == "tfrecord" for sp in splits)
        )
        for ds, sp in [(self.datasets[0], UnionSplit(splits))] if union else zip(self.datasets, splits):
            cache, whole, keep = _remote_mode(ds, sp, plan, self.cache)
            readers.append(
                SourceReader(
                    sp, [ds.schema[f.name] for f in feats], read=read, whole_shards=whole, keep_loaded=keep, cache=cache
                )
            )
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
            reader = MixtureReader([], starts, union=readers[0]) if union else MixtureReader(readers, starts)
            rows = reader.rows
        self.builder = BatchBuilder(
            reader,
            transform=transform,
            batch_transform=batch_transform,
            return_index=options.return_index,
            budget=self._budget,
        )
        # Small records cut column-wise are short numpy steps that hold the GIL: a thread only
        # contends for it, and handing a batch over costs more than building it (measured: 1.65M vs
        # 1.2M samples/s at batch 256), so they are built in the consumer's thread when it asks.
        threads = 0 if rows and transform is None else read.num_threads
        if read.executor is ExecutorKind.PROCESS:
            if isinstance(source, Dataset):  # workers open it again, by path
                recipe = dataclasses.replace(recipe, source=source.path)
            self.executor = ProcessExecutor(recipe, read.processes, read.processes + read.prefetch)
        else:
            self.executor = ThreadExecutor(threads, max(1, read.num_threads + read.prefetch))
        epoch, position = start if start is not None else (epoch or 0, 0)
        self.start_at(epoch, position)

    # -- plan & state -------------------------------------------------------------------------
    @property
    def config(self):
        """The plan options (`crossfeed.read.options.PlanOptions`)."""
        return self.options.plan

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
        the samples every rank together consumed; see `crossfeed.read.plan`)."""
        if int(epoch) < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        if not 0 <= int(position) <= self.sampler.total:
            raise ConfigError(
                f"position {position} is outside the epoch of {self.sampler.total} samples; "
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
        return self.sampler.position_after(self._position, self._delivered)

    def batch_count(self, *, all_workers: bool = False) -> int:
        """Batches the next iteration yields: this worker's, or with ``all_workers`` the whole
        rank's (every rank yields the same number)."""
        rank = self.sampler.rank_batch_count(self.position)
        if all_workers:
            return rank
        return len(range(self.worker, rank, self.num_workers))

    def __len__(self) -> int:
        return self.batch_count()

    def state_dict(self) -> dict:
        """Small and framework-free: resume with `load_state_dict` in any process, any world size."""
        state = {
            "version": STATE_VERSION,
            "seed": self.config.seed,
            "epoch": self._epoch,
            "position": self.position,
            "num_samples": self.sampler.total,
            "batch_size": self.config.batch_size,
        }
        if self.sources is not None:  # for people: where each source stands (derived from the above)
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
        if seed != self.config.seed or num != self.sampler.total:
            raise ConfigError(
                f"state was saved with seed {seed} over {num} samples; this loader has seed "
                f"{self.config.seed} over {self.sampler.total}: resume with the same seed and dataset"
            )
        self.start_at(epoch, position)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self._position, self._delivered = self.position, 0
        step = self.num_workers if self.num_workers > 1 else 1
        plan = self.plan()
        batches = iter(plan) if self.prefetcher is None else self._prefetching(plan)
        for batch in self.executor.map(self.builder, batches):
            self._delivered += step
            yield batch
        self._epoch, self._position, self._delivered = self._epoch + 1, 0, 0

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


def _features(names, datasets: list[Dataset], sources) -> list:
    """The features to read: ``names``, or every feature (a mixture: every feature its sources
    share); each must have the same definition in every source."""
    first = datasets[0].schema
    if names is None:
        names = [n for n in first.names if all(n in ds.schema.names for ds in datasets)]
        if not names:
            raise ConfigError("the mixture's sources share no feature; pass features= to choose")
    out = []
    for n in names:
        defs = []
        for i, ds in enumerate(datasets):
            if n not in ds.schema.names:
                where = f"source {i} ({ds.path})" if sources else ds.path
                raise ConfigError(f"features: {where} has no feature {n!r}; it has {ds.schema.names}")
            defs.append(ds.schema[n])
        for i, d in enumerate(defs[1:], 1):
            if (d.dtype, d.shape, d.encoding) != (defs[0].dtype, defs[0].shape, defs[0].encoding):
                raise ConfigError(
                    f"feature {n!r} differs between mixture sources: source 0 has {defs[0].dtype}{list(defs[0].shape)} "
                    f"{defs[0].encoding.value}, source {i} has {d.dtype}{list(d.shape)} {d.encoding.value}; "
                    f"pass features= without it, or convert one source"
                )
        out.append(defs[0])
    return out


_warned: set[str] = set()


def _remote_mode(
    ds: Dataset, split: Split, plan, cache: ShardCache | None
) -> tuple[ShardCache | None, bool, int | None]:
    """How a split's shards are read: ``(cache or None, whole shards, shards kept open)``.

    Local: mmap, all of them. Remote with a cache: whole shards into the cache — all kept open
    for a global shuffle (which needs the split to fit the cache), a window of them otherwise.
    Remote without one (or a global shuffle that does not fit): whole shards in memory for the
    sequential shuffles, one range request per record for the global one.
    """
    if not ds.storage.remote:
        return None, False, None
    window = 2 * plan.block_shards
    total = sum(s.num_bytes for s in split.shards)
    if cache is not None:
        if plan.shuffle is not Shuffle.GLOBAL:
            return cache, True, window
        if cache.limit is None or total <= cache.limit:
            return cache, True, None
        key = f"{ds.path}/{split.name}"
        if key not in _warned:
            _warned.add(key)
            log.warning(
                "%s split %r is %.1f GB, more than the cache limit of %.1f GB: a global shuffle would read one "
                "range request per record (slow on object stores). Use shuffle='block' (each shard downloaded "
                "once per epoch, %d shards in memory), or raise cache_limit above %.1f GB.",
                ds.path,
                split.name,
                total / 1e9,
                cache.limit / 1e9,
                window,
                total / 1e9,
            )
    whole = plan.shuffle is not Shuffle.GLOBAL
    return None, whole, window if whole else None
