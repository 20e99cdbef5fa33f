"""The Loader: plan → fetch → decode → transform → batch → prefetch, framework-neutral.

``Loader(source, split=..., batch_size=...)`` iterates one epoch of batches, each a
``dict[str, np.ndarray]`` (see `crossfeed.read.decode` for strings and ragged features); iterating
again runs the next epoch. Both framework adapters and ``crossfeed serve`` are thin layers over it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from crossfeed.read.dataset import Dataset, open_dataset
from crossfeed.read.decode import BatchDecoder, collate
from crossfeed.read.env import rank_and_world
from crossfeed.errors import ConfigError, CrossfeedError
from crossfeed.read.fetch import Fetcher
from crossfeed.read.plan import Plan, PlanConfig, Remainder, Shuffle, _enum

log = logging.getLogger(__name__)
INDEX_KEY = "__index__"
STATE_VERSION = 1


@dataclass(frozen=True)
class ReadOptions:
    """How hard to work: ``num_threads`` batches are built in parallel, at most
    ``num_threads + prefetch`` batches exist at once, so memory is bounded by batches, not data.
    Small fixed-layout records (no per-sample ``transform``) are built by one thread, as that
    path holds the GIL throughout and a second thread only slows it; the window stays as wide."""

    num_threads: int = 2
    prefetch: int = 2
    decode_images: bool = True

    def __post_init__(self):
        if self.num_threads < 1 or self.prefetch < 0:
            raise ConfigError(f"num_threads must be >= 1 and prefetch >= 0, got {self.num_threads}, {self.prefetch}")


class _Skips:
    """Counts records skipped under ``on_error="skip"`` and enforces the budget."""

    def __init__(self, budget: int):
        self.budget = budget
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, err: CrossfeedError) -> None:
        with self._lock:
            self.count += 1
            n = self.count
        if n <= 10 or n % 100 == 0:
            log.warning("skipped bad record #%d: %s", n, err)
        if n > self.budget:
            raise CrossfeedError(f"more than {self.budget} bad records skipped (max_skips); last: {err}") from err


class Loader:
    """Batches of one split, planned on integers, then fetched.

    ``shuffle``: "global" (exact permutation), "block" (windows of ``block_shards`` shards, each
    shard read once and whole — for remote data), "none". ``remainder``: when the samples left do
    not divide by the world size, "pad" repeats samples (like DistributedSampler) and "drop" drops
    a tail that moves with the epoch; either way every rank yields ``len(loader)`` batches.
    ``transform`` maps each sample dict; ``batch_transform`` each batch; both run in the loader's
    threads. ``on_error="skip"`` drops bad records (counted in ``skipped``) up to ``max_skips``.
    """

    def __init__(self, source, *, split: str = "train", batch_size: int, shuffle: Shuffle | str = Shuffle.GLOBAL,
                 seed: int = 0, epoch: int = 0, rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = False, remainder: Remainder | str = Remainder.PAD,
                 features: Sequence[str] | None = None, transform: Callable[[dict], dict] | None = None,
                 batch_transform: Callable[[dict], dict] | None = None, block_shards: int = 4,
                 read: ReadOptions = ReadOptions(), on_error: str = "raise", max_skips: int = 1000,
                 return_index: bool = False, worker: int = 0, num_workers: int = 1):
        self.dataset: Dataset = open_dataset(source)
        self.split = self.dataset[split]
        self.config = PlanConfig(batch_size, _enum(Shuffle, shuffle, "shuffle"), seed, drop_last,
                                 _enum(Remainder, remainder, "remainder"), block_shards)
        self.rank, self.world_size = rank_and_world(rank, world_size)
        if not 0 <= worker < num_workers:
            raise ConfigError(f"worker {worker} is not in range for num_workers {num_workers}")
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error={on_error!r} is not 'raise' or 'skip'")
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        names = list(features) if features is not None else self.dataset.schema.names
        try:
            feats = [self.dataset.schema[n] for n in names]
        except KeyError as e:
            raise ConfigError(f"features: {e.args[0]}") from None
        self.worker, self.num_workers = worker, num_workers
        self.transform, self.batch_transform = transform, batch_transform
        self.read = read
        self.return_index = return_index
        self._skips = _Skips(max_skips) if on_error == "skip" else None
        # batch arrays the consumer has dropped are reused: at most this many are in flight
        self._decoder = BatchDecoder(feats, decode_images=read.decode_images, recycle=read.num_threads + read.prefetch + 4)
        whole = self.dataset.storage.remote and self.config.shuffle is not Shuffle.GLOBAL
        self._fetcher = Fetcher(self.split, whole_shards=whole, keep_loaded=2 * block_shards if whole else None)
        self._rows = self._decoder.fixed  # small fixed-layout records: try the columnar path
        self._pool: ThreadPoolExecutor | None = None
        self._epoch = epoch
        self._position = 0  # samples of the epoch consumed (by all ranks) before this iteration
        self._delivered = 0  # batches this rank delivered since _position

    # -- plan & state -------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def skipped(self) -> int:
        return self._skips.count if self._skips else 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning on the next iteration (like DistributedSampler)."""
        self._epoch, self._position, self._delivered = int(epoch), 0, 0

    def plan(self) -> Plan:
        return self.config.make(self.split.counts, epoch=self._epoch, position=self.position, rank=self.rank,
                                world_size=self.world_size, worker=self.worker, num_workers=self.num_workers)

    @property
    def position(self) -> int:
        return self.config.position_after(self._position, len(self.split), self._delivered, self.world_size)

    def __len__(self) -> int:
        return len(self.plan())

    def state_dict(self) -> dict:
        """Small and framework-free: resume with `load_state_dict` in any process, any world size."""
        return {"version": STATE_VERSION, "seed": self.config.seed, "epoch": self._epoch, "position": self.position,
                "num_samples": len(self.split), "batch_size": self.config.batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        if state["seed"] != self.config.seed or state["num_samples"] != len(self.split):
            raise ConfigError(
                f"state was saved with seed {state['seed']} over {state['num_samples']} samples; this loader has seed "
                f"{self.config.seed} over {len(self.split)}: resume with the same seed and dataset")
        self._epoch, self._position, self._delivered = int(state["epoch"]), int(state["position"]), 0

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self._position, self._delivered = self.position, 0
        plan = self.plan()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads(), thread_name_prefix="crossfeed-loader")
        window = self.read.num_threads + self.read.prefetch
        ids = iter(plan.batch_ids())
        pending: deque = deque(self._pool.submit(self._build, plan.batch(b)) for b in itertools.islice(ids, window))
        try:
            while pending:
                batch = pending.popleft().result()
                nxt = next(ids, None)
                if nxt is not None:
                    pending.append(self._pool.submit(self._build, plan.batch(nxt)))
                self._delivered += self.num_workers if self.num_workers > 1 else 1
                yield batch
        finally:
            for f in pending:
                f.cancel()
        self._epoch, self._position, self._delivered = self._epoch + 1, 0, 0

    def _threads(self) -> int:
        """Threads building batches: ``read.num_threads``, but one for small fixed-layout records.
        Their columnar path is short numpy steps holding the GIL; a second thread only contends
        for it (and for the cache) and is measurably slower. The prefetch window stays as wide."""
        self._rows = self._rows and self._fetcher.small_records()
        if self._rows and self.transform is None:
            return 1
        return self.read.num_threads

    def _build(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """One batch: fetch → decode → transform (runs in a loader thread)."""
        batch = self._build_rows(indices) if self._rows else None
        if batch is None:
            payloads = self._fetcher.fetch(indices, on_error=self._skips)
            if self._skips is not None:  # without a skip policy a bad record raised: no None to drop
                ok = [i for i, p in enumerate(payloads) if p is not None]
                if len(ok) < len(payloads):
                    indices, payloads = indices[ok], [payloads[i] for i in ok]
            batch, kept = self._decoder(payloads, where=lambda i: self._where(int(indices[i])), on_error=self._skips)
            indices = indices[kept]
        if self.transform is not None:
            batch = self._map_samples(batch, len(indices))
        if self.return_index:
            batch[INDEX_KEY] = indices
        if self.batch_transform is not None:
            batch = self.batch_transform(batch)
        return batch

    def _build_rows(self, indices: np.ndarray) -> dict[str, np.ndarray] | None:
        """The batch through the columnar path (`Fetcher.fetch_rows` → `BatchDecoder.decode_rows`),
        or None: then the record-by-record path builds it, and reports any bad record exactly."""
        groups = self._fetcher.fetch_rows(indices)
        if groups is None:
            return None
        batch = self._decoder.decode_rows(groups, len(indices))
        if batch is None:  # the records do not share a fixed layout: stop trying
            self._rows = False
        return batch

    def _map_samples(self, batch: dict, n: int) -> dict:
        samples = [self.transform({k: v[i] for k, v in batch.items()}) for i in range(n)]
        if not samples:
            return batch
        return {k: collate([s[k] for s in samples]) for k in samples[0]}

    def _where(self, i: int) -> str:
        s, k = self.split.locate(i)
        return f"{self.split.file(s).path}: record at byte offset {int(self.split.index(s)[k][0])}"

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.dataset.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
