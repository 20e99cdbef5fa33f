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

import logging
import time
from collections.abc import Callable, Iterator

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.format.schema import INDEX_KEY
from crossfeed.policy import ErrorBudget, OnError
from crossfeed.read.dataset import Dataset, open_dataset
from crossfeed.read.decode import RecordDecoder, collate, make_decoder
from crossfeed.read.executor import ThreadExecutor
from crossfeed.read.frame_reader import FrameReader
from crossfeed.read.options import LoaderOptions, ReadOptions
from crossfeed.read.plan import Plan, Remainder, Sampler, Shuffle

log = logging.getLogger(__name__)
STATE_VERSION = 1
STAGES = ("read", "decode", "transform", "batch")  # what `BatchBuilder` times, in order

__all__ = ["INDEX_KEY", "BatchBuilder", "Loader", "LoaderOptions", "ReadOptions", "Remainder", "Shuffle"]


class BatchBuilder:
    """One batch from its global indices: frames → decode → transform → batch. Runs in an
    executor thread; stateless but for the decoder's buffer recycler, so threads share it.

    With ``timings`` (a dict), the seconds each stage took are added to it under `STAGES`:
    ``crossfeed bench`` times the very stages the Loader runs.
    """

    def __init__(self, frames: FrameReader, decoder: RecordDecoder, *, transform=None, batch_transform=None,
                 return_index: bool = False, budget: ErrorBudget | None = None):
        self.frames, self.decoder = frames, decoder
        self.transform, self.batch_transform = transform, batch_transform
        self.return_index = return_index
        self.budget = budget

    def __call__(self, indices: np.ndarray, timings: dict[str, float] | None = None) -> dict[str, np.ndarray]:
        tick = _Ticker(timings) if timings is not None else _no_tick
        frames = self.frames(indices, on_error=self.budget)
        tick("read")
        batch, kept = self.decoder(frames, where=lambda j: self.frames.where(frames.indices[j]), on_error=self.budget)
        indices = frames.indices[kept]
        tick("decode")
        if self.transform is not None:
            samples = [self.transform({k: v[i] for k, v in batch.items()}) for i in range(len(indices))]
            tick("transform")
            if samples:
                batch = {k: collate([s[k] for s in samples]) for k in samples[0]}
            tick("batch")
        if self.return_index:
            batch[INDEX_KEY] = indices
        if self.batch_transform is not None:
            tick(None)
            batch = self.batch_transform(batch)
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


def _no_tick(name: str | None) -> None:
    pass


class Loader:
    """Batches of one split, planned on integers, then fetched (see the module docstring).

    ``options``: a `LoaderOptions`, or its fields as keywords (``batch_size``, ``shuffle``
    "global"/"block"/"none", ``seed``, ``drop_last``, ``remainder`` "pad"/"drop", ``rank``,
    ``world_size``, ``worker``, ``num_workers``, ``block_shards``, ``read=ReadOptions(...)``,
    ``on_error``, ``max_skips``, ``split``, ``features``, ``return_index``). ``transform`` maps
    each sample dict and ``batch_transform`` each batch, in the loader's threads. ``start``:
    ``(epoch, position)`` to begin at (``epoch=`` alone: that epoch's start).
    """

    def __init__(self, source, options: LoaderOptions | None = None, *, transform: Callable[[dict], dict] | None = None,
                 batch_transform: Callable[[dict], dict] | None = None, start: tuple[int, int] | None = None,
                 epoch: int | None = None, **fields):
        if options is None:
            if "batch_size" not in fields:
                raise ConfigError("Loader needs batch_size= (or a LoaderOptions)")
            options = LoaderOptions.of(**fields)
        elif fields:
            raise ConfigError(f"pass either a LoaderOptions or keywords, not both (got {sorted(fields)})")
        if not isinstance(options, LoaderOptions):
            raise ConfigError(f"options must be a LoaderOptions, got {type(options).__name__}")
        if start is not None and epoch is not None:
            raise ConfigError("pass start=(epoch, position) or epoch=, not both")
        self.options = options
        self.dataset: Dataset = open_dataset(source)
        self.split = self.dataset[options.split]
        names = list(options.features) if options.features is not None else self.dataset.schema.names
        try:
            feats = [self.dataset.schema[n] for n in names]
        except KeyError as e:
            raise ConfigError(f"features: {e.args[0]}") from None
        self.sampler = Sampler(self.split.counts, options.plan, options.shard)
        read = options.read
        self.transform, self.batch_transform = transform, batch_transform
        self._budget = ErrorBudget(read.max_skips, logger=log) if read.on_error is OnError.SKIP else None
        # batch arrays the consumer has dropped are reused: at most this many are in flight
        decoder = make_decoder(feats, decode_images=read.decode_images, recycle=read.num_threads + read.prefetch + 4)
        whole = self.dataset.storage.remote and options.plan.shuffle is not Shuffle.GLOBAL
        frames = FrameReader(self.split, whole_shards=whole, keep_loaded=2 * options.plan.block_shards if whole else None)
        frames.rows = decoder.columnar and frames.small_records()
        self.builder = BatchBuilder(frames, decoder, transform=transform, batch_transform=batch_transform,
                                    return_index=options.return_index, budget=self._budget)
        # Small records cut column-wise are short numpy steps that hold the GIL: a second thread
        # only contends for it, so they get one (the prefetch window stays as wide).
        threads = 1 if frames.rows and transform is None else read.num_threads
        self.executor = ThreadExecutor(threads, read.num_threads + read.prefetch)
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
        return self._budget.count if self._budget else 0

    def start_at(self, epoch: int, position: int = 0) -> None:
        """Begin the next iteration at sample ``position`` of epoch ``epoch`` (positions count
        the samples every rank together consumed; see `crossfeed.read.plan`)."""
        if int(epoch) < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        if not 0 <= int(position) <= len(self.split):
            raise ConfigError(f"position {position} is outside the epoch of {len(self.split)} samples; "
                              f"was the state saved for another dataset?")
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
        return {"version": STATE_VERSION, "seed": self.config.seed, "epoch": self._epoch, "position": self.position,
                "num_samples": len(self.split), "batch_size": self.config.batch_size}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"loader state version {got!r} is not {STATE_VERSION}")
        try:
            seed, num, epoch, position = state["seed"], state["num_samples"], int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"loader state is missing or has a bad field: {e}") from None
        if seed != self.config.seed or num != len(self.split):
            raise ConfigError(
                f"state was saved with seed {seed} over {num} samples; this loader has seed "
                f"{self.config.seed} over {len(self.split)}: resume with the same seed and dataset")
        self.start_at(epoch, position)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self._position, self._delivered = self.position, 0
        step = self.num_workers if self.num_workers > 1 else 1
        for batch in self.executor.map(self.builder, self.plan()):
            self._delivered += step
            yield batch
        self._epoch, self._position, self._delivered = self._epoch + 1, 0, 0

    def close(self) -> None:
        self.executor.close()
        self.dataset.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
