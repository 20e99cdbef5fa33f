"""PyTorch adapter: a crossfeed split as a `torch.utils.data.IterableDataset` of batches.

    ds = TorchDataset("data/", split="train", batch_size=64, seed=1)       # after init_process_group
    loader = StatefulLoader(ds, num_workers=4, pin_memory=True, persistent_workers=True)
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        for batch in loader:                 # dict[str, torch.Tensor]; strings/bytes stay lists
            ...
            ckpt["data"] = loader.state_dict()   # exact mid-epoch position; loader.load_state_dict(...)

* Each item is one batch (``DataLoader(batch_size=None)``) — or, with ``batch_size=None``, one
  sample (the Loader's per-sample rule; lengths and states count samples): the Loader's numpy arrays as tensors
  sharing their memory (`crossfeed.adapters.torch_convert`; in a DataLoader worker, views of one
  shared-memory block per batch, copied in once: one storage crosses the worker queue); unsigned integers past uint8 (token
  ids) as int64, what ``nn.Embedding`` and ``cross_entropy`` take (``keep_dtypes=True``: as stored).
* Splitting: by DDP rank (``torch.distributed`` if initialised when the dataset is made, else
  RANK/WORLD_SIZE, else one process; or pass ``rank``/``world_size``) and, inside ``__iter__``, by
  DataLoader worker: worker ``w`` of ``K`` builds the rank's batches ``w, w+K, …``, so the
  DataLoader's round-robin over workers yields exactly the rank's batch sequence, in order. Every
  rank yields ``len(ds)`` batches per epoch whatever ``num_workers`` is; every sample appears once
  per epoch (``remainder="pad"`` repeats the few samples needed to even out the ranks).
* Epochs: ``set_epoch(n)`` as with DistributedSampler; without it an iteration repeats the same
  epoch (`StatefulLoader` moves to the next epoch itself when one ends). The epoch and the resume
  point live in shared memory (`crossfeed.adapters.torch_cursor`), so they reach workers kept
  alive by ``persistent_workers=True``.
* Resumption: ``TorchDataset.state_dict()`` says where the *next* iteration starts. A checkpoint
  in the middle of an epoch needs to know how many batches the training loop actually took
  (workers prefetch); `StatefulLoader` counts them and gives the exact position.
* ``source`` may also be a stream of batches, e.g. ``crossfeed.connect(...)``: any iterable that
  is not a path or `crossfeed.Dataset`. Its batches are converted the same way; there is no
  rank/worker splitting (the servers distribute), no length and no epochs; use ``num_workers=0``.

Never imports tensorflow.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

try:
    import torch.distributed as dist
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info
except ModuleNotFoundError as e:  # one line naming the extra that installs it
    from crossfeed.errors import missing_extra

    raise missing_extra(e, "crossfeed.adapters.torch") from None

from crossfeed.adapters.torch_convert import to_torch, to_torch_group
from crossfeed.adapters.torch_cursor import Cursor
from crossfeed.errors import ConfigError
from crossfeed.read import metrics
from crossfeed.read.env import rank_and_world
from crossfeed.read.identity import follow_tail
from crossfeed.read.loader import Loader, one_sample
from crossfeed.read.options import LoaderOptions
from crossfeed.read.pipeline import SourceKind, classify
from crossfeed.read.sources.dataset import Dataset

__all__ = ["StatefulLoader", "TorchDataset", "to_torch"]


def is_stream(source) -> bool:
    """Whether ``source`` is a stream of batches (e.g. ``crossfeed.connect(...)``) rather than a
    dataset or a mixture (`crossfeed.read.pipeline.classify`, the one answer every front end uses)."""
    return classify(source) is SourceKind.STREAM


def _rank_and_world(rank, world_size) -> tuple[int, int]:
    if rank is None and world_size is None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return rank_and_world(rank, world_size)


class TorchDataset(IterableDataset):
    """Batches of one split as dicts of tensors; see the module docstring. The options are the
    `crossfeed.read.loader.Loader`'s. With ``multiprocessing_context="spawn"`` the transforms must be
    picklable (module-level functions, not lambdas)."""

    def __init__(
        self,
        source,
        options: LoaderOptions | None = None,
        *,
        transform: Callable[[dict], dict] | None = None,
        batch_transform: Callable[[dict], dict] | None = None,
        epoch: int = 0,
        keep_dtypes: bool = False,
        filter: Callable[[dict], bool] | str | None = None,
        **fields,
    ):
        self.filter = filter  # the Loader's filter= (a dropped sample shortens its batch)
        self.keep_dtypes, self.per_sample = bool(keep_dtypes), False
        self._stream = source if is_stream(source) else None
        self._loaders: dict[tuple[int, int], Loader] = {}
        self._pid = os.getpid()
        self._cursor = Cursor(epoch)
        self._pack_state: dict | None = None  # the packed cursor of the state last resumed (`_state`)
        if self._stream is not None:
            self.source, self.rank, self.world_size, self.options = None, 0, 1, None
            return
        # batch_size=None: one sample at a time (DataLoader(batch_size=None)'s items; the Loader's rule)
        self.per_sample = options is None and "batch_size" in fields and fields["batch_size"] is None
        if self.per_sample:
            if fields.get("batch_by_tokens") is not None:
                raise ConfigError("batch_by_tokens= makes batches of documents; it takes a batch_size, not None")
            fields["batch_size"] = 1
        if options is None and fields.get("rank") is None and fields.get("world_size") is None:
            fields["rank"], fields["world_size"] = _rank_and_world(None, None)  # torch.distributed first
        tail_chosen = options is not None or "drop_last" in fields  # else a state's tail is followed
        options = LoaderOptions.given(options, fields, who="TorchDataset (reading a dataset, not a stream)")
        self.options, self._tail_chosen = options, tail_chosen
        self.transform, self.batch_transform = transform, batch_transform
        self.source = source.path if isinstance(source, Dataset) else source  # picklable for spawned workers
        self.rank, self.world_size = options.rank, options.world_size
        self._loader(0, 1)  # opens the dataset and validates every option here, not in a worker
        # workers open that very version again (an append meanwhile does not move them)
        self.source = self._loaders[(0, 1)].pipeline.pinned_source()

    # -- the per-process loaders ----------------------------------------------------------------
    def _loader(self, worker: int, num_workers: int) -> Loader:
        if os.getpid() != self._pid:  # a forked worker: the parent's loaders (and threads) are not ours
            self._loaders, self._pid = {}, os.getpid()
        key = (worker, num_workers)
        if self.options is None:
            raise ConfigError("a TorchDataset of a stream source reads the stream; it has no Loader")
        if key not in self._loaders:
            self._loaders[key] = Loader(
                self.source,
                self.options.replace(worker=worker, num_workers=num_workers),
                transform=self.transform,
                batch_transform=self.batch_transform,
                filter=self.filter,
            )
        return self._loaders[key]

    @property
    def loader(self) -> Loader:
        """This process's whole-rank Loader (worker 0 of 1): the plan, the dataset, the schema."""
        if self._stream is not None:
            raise ConfigError("a stream source has no loader of its own: the servers plan the epochs")
        return self._loader(0, 1)

    def stats(self) -> metrics.Stats:
        """The stage metrics of this process's Loaders, summed (`crossfeed.Loader.stats`). With
        DataLoader workers (``num_workers > 0``) the Loaders run in the workers, whose stats this
        process cannot see: there, ``log_stats=True`` logs each worker's line at each epoch's end,
        and `StatefulLoader.stats` measures the trainer's own wait in this process."""
        if self._stream is not None:
            raise ConfigError("a stream source has no loader of its own: its servers time their stages")
        if os.getpid() != self._pid:
            self._loaders, self._pid = {}, os.getpid()
        return metrics.combine(loader.stats() for loader in self._loaders.values())

    # -- epochs and state ------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._cursor.start()[0]

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (like DistributedSampler.set_epoch). Works with
        persistent workers: the value is shared with them. A no-op for a stream source."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, got {epoch!r}")
        self._cursor.set_epoch(epoch)

    def state_dict(self) -> dict:
        """Where the next iteration starts (the Loader's state format). For a checkpoint in the
        middle of an epoch use `StatefulLoader.state_dict`."""
        epoch, position = self._next_start()
        return self._state(epoch, position)

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration resume ``state``: its epoch, from its position. A state saved
        under other settings is refused by name (`crossfeed.read.identity`); ``drop_last``, when
        this dataset was not given one, follows the state's (a JAX state drops its epochs' tails)."""
        if not self._tail_chosen:
            followed = follow_tail(self.options, state)
            if followed != self.options:
                self.close()
                self._loaders, self.options = {}, followed
        self.loader.load_state_dict(state)  # checks the stream's identity
        self._cursor.resume(int(state["epoch"]), int(state["position"]))
        self._pack_state = state.get("pack")  # a packed state's cursor: DataLoader workers walk on from it

    def _next_start(self) -> tuple[int, int]:
        if self._stream is not None:
            raise ConfigError("a stream source has no state to save: its servers resume unacknowledged batches")
        return self._cursor.start()

    def _state(self, epoch: int, position: int, loader: Loader | None = None) -> dict:
        if loader is None or loader is self.loader:
            return self.loader.state_at(epoch, position)
        # a DataLoader worker's Loader: no walk here to find a packed cursor; the one it knows, or
        # the one the state this dataset resumed carried, whichever stands further on
        state = loader.state_at(epoch, position, walk=False)
        mine, loaded = state.get("pack"), getattr(self, "_pack_state", None)
        if mine is not None and isinstance(loaded, dict) and loaded.get("epoch") == epoch:
            rows = loaded.get("rows")
            if isinstance(rows, int) and mine["rows"] < rows <= position:
                state["pack"] = loaded
        return state

    def __len__(self) -> int:
        """This rank's batches in the next iteration (all DataLoader workers together)."""
        if self._stream is not None:
            raise TypeError("a stream source has no length: its servers decide how many batches come")
        epoch, position = self._next_start()
        return self.loader.rank_batch_count(position, epoch=epoch)

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:  # batch dicts; (meta, batch) pairs from a stream read with_meta
        info = get_worker_info()
        if self._stream is not None:
            if info is not None:
                raise ConfigError(
                    "a stream source is read in the main process: use DataLoader(num_workers=0); "
                    "the servers already run the loading in parallel"
                )
            keep = self.keep_dtypes
            return (
                to_torch(b, keep_dtypes=keep) if not isinstance(b, tuple) else (b[0], to_torch(b[1], keep_dtypes=keep))
                for b in self._stream
            )
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self._batches(self._loader(worker, num_workers), *self._next_start())

    def _batches(self, loader: Loader, epoch: int, position: int) -> Iterator[dict]:
        loader.load_state_dict(self._state(epoch, position, loader))
        one = self.per_sample
        shared = get_worker_info() is not None  # a DataLoader worker: one storage a batch crosses the queue
        for batch in loader:
            yield to_torch(
                one_sample(batch, "TorchDataset") if one else batch, keep_dtypes=self.keep_dtypes, shared=shared
            )

    def _groups(self, size: int, worker: int, num_workers: int) -> Iterator[dict]:
        """This DataLoader worker's batches ``size`` at a time (fewer once they hold `GROUP_BYTES`),
        each group one shared-memory storage (`StatefulLoader`'s ``batches_per_transfer``):
        ``{GROUP: [the iteration's batch numbers], "batches": [...]}`` — worker ``w`` of ``K``'s
        ``j``-th batch is batch ``w + j·K``."""
        loader = self._loader(worker, num_workers)
        loader.load_state_dict(self._state(*self._next_start(), loader))
        one = self.per_sample
        pending: list = []
        made = held = 0
        for batch in loader:
            pending.append(one_sample(batch, "TorchDataset") if one else batch)
            held += sum(v.nbytes for v in pending[-1].values() if isinstance(v, np.ndarray))
            if len(pending) == size or held >= GROUP_BYTES:
                yield self._group(pending, made, worker, num_workers)
                made, pending, held = made + len(pending), [], 0
        if pending:
            yield self._group(pending, made, worker, num_workers)

    def _group(self, batches: list, made: int, worker: int, num_workers: int) -> dict:
        """One group item of `_groups`: ``batches`` after ``made`` of this worker's, in one storage."""
        ids = [worker + (made + i) * num_workers for i in range(len(batches))]
        return {GROUP: ids, "batches": to_torch_group(batches, keep_dtypes=self.keep_dtypes)}

    # -- pickling (DataLoader workers started with spawn/forkserver) -----------------------------
    def __getstate__(self):
        if self._stream is not None:
            raise ConfigError("a stream source cannot be sent to DataLoader workers: use num_workers=0")
        state = dict(self.__dict__)
        state["_loaders"] = {}
        return state

    def close(self) -> None:
        """Close this process's loaders (thread pools and open shards). A stream source is the
        caller's to close."""
        if os.getpid() == self._pid:
            for loader in self._loaders.values():
                loader.close()
        self._loaders = {}

    def __enter__(self) -> TorchDataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


GROUP = "__crossfeed_group__"  # the key of a group of batches crossing a DataLoader's queue as one item
GROUP_BYTES = 8 << 20  # a group is cut at this many bytes of arrays: large batches cross one at a time


class _Grouped(IterableDataset):
    """What a `StatefulLoader`'s DataLoader iterates: the dataset's batches, in each DataLoader
    worker ``size`` at a time (`TorchDataset._groups`); the dataset object itself is left as it
    is (a plain DataLoader over it still gets one batch an item)."""

    def __init__(self, dataset: TorchDataset, size: int):
        self.dataset, self.size = dataset, size

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is None or self.size <= 1 or self.dataset._stream is not None:
            return iter(self.dataset)
        return self.dataset._groups(self.size, info.id, info.num_workers)


class StatefulLoader:
    """A `torch.utils.data.DataLoader` over a `TorchDataset` that knows where it is in the epoch.

    ``StatefulLoader(ds, num_workers=2, pin_memory=True, persistent_workers=True)`` passes the
    keyword arguments to DataLoader (``batch_size`` is None: the dataset yields batches). It counts
    the batches the training loop has taken, so ``state_dict()`` is the Loader state with
    ``position = position_after(start, total, batches_taken, world_size)`` — exact however many
    batches the workers had prefetched — and ``load_state_dict()`` makes the next iteration (in a
    fresh process, any ``num_workers``, any world size) start there. When an epoch ends it moves
    the dataset to the next epoch, so ``set_epoch`` calls are optional.

    ``batches_per_transfer`` (default 8 with workers; fewer where they pass `GROUP_BYTES`): each DataLoader worker hands its batches
    over that many at a time, in one shared-memory storage (one segment and one file descriptor
    passed, where a batch each costs one apiece: the queue's per-item cost, not the batches,
    bounds a DataLoader on few cores); the loader yields them one by one, in the dataset's order.
    A worker's first batch waits for its group; 1: a batch an item, as a DataLoader does.
    """

    def __init__(self, dataset: TorchDataset, *, batches_per_transfer: int | None = None, **dataloader_kwargs):
        if not isinstance(dataset, TorchDataset):
            raise ConfigError(f"StatefulLoader wraps a TorchDataset, got {type(dataset).__name__}")
        for bad in ("sampler", "batch_sampler", "shuffle", "drop_last"):
            if dataloader_kwargs.get(bad) not in (None, False):
                raise ConfigError(
                    f"{bad}= is the TorchDataset's job (its shuffle/drop_last options), not the DataLoader's"
                )
        if dataloader_kwargs.pop("batch_size", None) is not None:
            raise ConfigError("batch_size belongs to the TorchDataset; the DataLoader gets batch_size=None")
        self.dataset = dataset
        workers = int(dataloader_kwargs.get("num_workers") or 0)
        group = (8 if workers else 1) if batches_per_transfer is None else batches_per_transfer
        if type(group) is not int or not 1 <= group <= 1024:
            raise ConfigError(f"batches_per_transfer must be an integer from 1 to 1024, got {batches_per_transfer!r}")
        self.batches_per_transfer = group
        self.dataloader = DataLoader(_Grouped(dataset, group), batch_size=None, **dataloader_kwargs)
        self._running: tuple[int, int] | None = None  # (epoch, start position) of the iteration under way
        self._taken = 0
        self._meter = metrics.Meter(processes=self.dataloader.num_workers)  # the trainer's wait, timed here

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[dict]:
        meter = self._meter
        if self.dataset._stream is not None:  # a stream is a source too: no epochs, no position to track
            asked = time.perf_counter_ns()
            for batch in self.dataloader:
                got = meter.delivered(batch, asked)
                yield batch
                asked = meter.consumed(got)
            meter.ended(asked)
            return
        epoch, position = self.dataset._next_start()
        self._running, self._taken = (epoch, position), 0
        asked = time.perf_counter_ns()
        for batch in self._in_order():
            self._taken += 1
            got = meter.delivered(batch, asked)
            yield batch
            asked = meter.consumed(got)
        meter.ended(asked)
        if self._running == (epoch, position):
            self._running = None
            self.dataset.set_epoch(epoch + 1)

    def _in_order(self) -> Iterator[dict]:
        """The DataLoader's items, groups of batches (`TorchDataset._groups`) taken apart and put
        back in the dataset's order (groups come round-robin over the workers)."""
        pending: dict[int, dict] = {}
        expected = 0
        for item in self.dataloader:
            if not (isinstance(item, dict) and GROUP in item):
                yield item
                continue
            pending.update(zip(item[GROUP], item["batches"]))
            while expected in pending:
                yield pending.pop(expected)
                expected += 1
        if pending:  # a worker's batches missing before these: never (each worker's come in order)
            raise RuntimeError(f"DataLoader workers left batches {sorted(pending)[:5]} without batch {expected}")

    def stats(self) -> metrics.Stats:
        """The trainer's view, timed in this process around the DataLoader: batches, samples, its
        wait for each batch and its own time between them (so the verdict's wait ratio is the
        trainer's, whatever ``num_workers``), with the stage times of the dataset's Loaders when
        they run here (``num_workers=0``); in DataLoader workers they cannot be seen from here
        (``log_stats=True`` logs each worker's)."""
        own = self._meter.stats()
        if self.dataloader.num_workers or self.dataset._stream is not None:
            return own
        loaders = self.dataset.stats()
        return dataclasses.replace(
            loaders,
            **{k: getattr(own, k) for k in ("batches", "samples", "wait_seconds", "consumer_seconds", "epochs")},
        )

    def state_dict(self) -> dict:
        """The Loader state after the batches taken so far (a stream source has none: ConfigError)."""
        if self._running is None:
            return self.dataset.state_dict()
        epoch, position = self._running
        done = self.dataset.loader.position_after(position, self._taken, epoch=epoch)
        return self.dataset._state(epoch, done)

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)
        self._running, self._taken = None, 0

    def close(self) -> None:
        """Stop persistent workers now rather than at garbage collection."""
        it = getattr(self.dataloader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.dataloader._iterator = None
        self.dataset.close()

    def __enter__(self) -> StatefulLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
