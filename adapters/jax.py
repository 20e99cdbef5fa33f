"""JAX adapter: a crossfeed dataset, mixture or stream as batches of global ``jax.Array``\\ s.

    from crossfeed.adapters.jax import JaxLoader
    mesh = Mesh(jax.devices(), ("batch",))                         # after jax.distributed.initialize()
    data = JaxLoader("data/", batch_size=256, seed=0, sharding=NamedSharding(mesh, P("batch")))
    for batch in data.epochs(3):                                   # dict[str, jax.Array], global shapes
        state = train_step(state, batch)                           # a jit with those shardings
        ckpt["data"] = data.state_dict()                           # the Loader's state: JSON, any framework

* ``batch_size`` is the **global** batch (every process together), as JAX code thinks of it. Each
  process reads only its share — ``batch_size // world_size`` samples a step, rank
  ``jax.process_index()`` of ``jax.process_count()`` unless ``rank=``/``world_size=`` say otherwise —
  and the adapter assembles the global arrays with ``jax.make_array_from_process_local_data``.
  ``sharding`` (default: the batch axis over every device, `jax_arrays.default_sharding`) lays out
  every feature; its spec's first entry is the batch axis. The batch size must divide by the
  number of processes and by the devices the batch axis is split over (ConfigError otherwise).
* Equal steps everywhere: the Loader's plan gives every rank the same number of samples
  (``remainder="pad"`` repeats a few, ``"drop"`` drops them) and the partial last batch is
  dropped (``drop_last=True``, this adapter's default and its only choice: shapes stay static,
  so jit compiles once). No host waits at an epoch's end for a batch that never comes.
* Dense only: a feature whose shape varies from sample to sample raises SchemaError naming it,
  unless ``pad_to={name: length}`` pads it with 0 (or truncates it) on its first axis; string and
  bytes features raise ConfigError unless left out (``features=``) or turned into numbers by a
  ``transform``.
* Filters and skipped sample ids (``filter=``, ``skip=Skip(samples=...)``; ``mask=True`` for a
  transform that may return None) make the Loader's batches shorter: each process pads its own
  back to its fixed share with zeros and adds ``__valid__`` (`VALID_KEY`), a bool ``(batch_size,)``
  array, True for the real samples (the Loader's, in its order, first in each process's rows);
  weigh the padded rows 0 in the loss (`jax_arrays.Padder`; docs/jax.md).
* Device prefetch: a thread keeps the next ``device_prefetch`` batches on the devices while the
  step runs; its errors are raised in the consumer; it stops when the iteration ends, is broken
  off, or `close` is called. Default (None): 2, or 0 (no thread) when every device of the
  sharding is a CPU device — there the devices use the Loader's arrays in place, so there is no
  transfer to hide, and a thread only adds a hand-over per batch and contends with the Loader's
  threads for the cores (benchmarks/bench_jax_adapter.py measures both).
  ``prefetch`` (like every other Loader option) is the Loader's own host-side read-ahead.
* State: `state_dict` is the ``crossfeed.Loader.state_dict()`` of the last batch the consumer
  *received* — not of the prefetcher — so it is exact, and it is the one form the PyTorch
  (`StatefulLoader`) and TensorFlow (``dataset(state=...)``) adapters save and resume too, at any
  world size. docs/jax.md shows it saved beside an Orbax checkpoint.
* ``source`` may also be a stream of batches (``crossfeed.connect(...)``, any iterable of dict
  batches that is not a path or a mixture): each process's batches are its rows of the global
  batch; there is no state, no length and no epochs (the servers plan them), and batches must
  all have one size (serve with ``drop_last=True``).

Never imports torch or tensorflow.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

try:
    import jax
except ModuleNotFoundError as e:  # one line naming the extra that installs it
    from crossfeed.errors import missing_extra

    raise missing_extra(e, "crossfeed.adapters.jax") from None

from crossfeed.adapters.jax_arrays import (
    AlignedArrays,
    Assembler,
    Padder,
    batch_shards,
    check_features,
    check_pad_to,
    default_sharding,
)
from crossfeed.errors import ConfigError, CrossfeedError
from crossfeed.format.schema import VALID_KEY
from crossfeed.read import metrics
from crossfeed.read.env import rank_and_world
from crossfeed.read.executors.threads import ExecutorKind
from crossfeed.read.loader import Loader, is_empty
from crossfeed.read.options import LoaderOptions
from crossfeed.read.pipeline import SourceKind, classify

__all__ = ["JaxLoader", "default_sharding"]

log = logging.getLogger(__name__)
POLL_S = 0.1  # how often a waiting producer or consumer checks whether the other side stopped
DEVICE_PREFETCH = 2  # batches the thread keeps on accelerators by default
JOIN_S = 30.0  # how long close() waits for the prefetch thread to finish the batch it is building


def is_stream(source) -> bool:
    """Whether ``source`` is a stream of batches (e.g. ``crossfeed.connect(...)``) rather than a
    dataset or a mixture (`crossfeed.read.pipeline.classify`, the one answer every front end uses)."""
    return classify(source) is SourceKind.STREAM


def _rank_and_world(rank, world_size) -> tuple[int, int]:
    if rank is None and world_size is None:
        return jax.process_index(), jax.process_count()
    return rank_and_world(rank, world_size)


def _statistics(loader: Loader) -> list[dict]:
    """Each source's split statistics (manifest), under the names the batches use."""
    if loader.split is not None:  # one dataset
        return [loader.split.info.statistics]
    return [
        {src.name_of(k): v for k, v in ds[src.split].info.statistics.items()}
        for ds, src in zip(loader.datasets, loader.sources or ())
    ]


class JaxLoader:
    """Global ``jax.Array`` batches of a dataset, a mixture or a stream; see the module docstring.

    ``options``: a `crossfeed.LoaderOptions` (its ``batch_size`` read as the global batch, its
    ``drop_last`` True), or its fields as keywords (``batch_size``, ``split``, ``shuffle``,
    ``seed``, ``features``, ``rank``, ``world_size``, ``num_threads`` …) — not both: the
    Loader's one entry point (`LoaderOptions.given`), its defaults and its refusals, except that
    ``drop_last`` defaults to True and the share (``rank`` of ``world_size``; a whole
    LoaderOptions' default 0 of 1) to ``jax.process_index()`` of ``jax.process_count()``.
    ``transform``/``batch_transform``/``epoch`` are the Loader's. Unsigned integers past uint8
    (token ids) arrive as int32, checked to fit (``keep_dtypes=True``: as stored; see
    `crossfeed.adapters.int_dtypes`). Iterating yields one epoch
    and moves to the next, as the Loader does; `epochs` runs several without a pause.
    """

    def __init__(
        self,
        source,
        options: LoaderOptions | None = None,
        *,
        sharding: jax.sharding.Sharding | None = None,
        device_prefetch: int | None = None,
        pad_to: dict[str, int] | None = None,
        transform: Callable[[dict], dict] | None = None,
        batch_transform: Callable[[dict], dict] | None = None,
        epoch: int = 0,
        keep_dtypes: bool = False,
        filter: Callable[[dict], bool] | str | None = None,
        mask: bool | None = None,
        **fields,
    ):
        if mask is not None and not isinstance(mask, bool):
            raise ConfigError(f"mask must be True, False or None (on with filter= or skipped sample ids), got {mask!r}")
        if device_prefetch is not None and (
            isinstance(device_prefetch, bool) or not isinstance(device_prefetch, int) or device_prefetch < 0
        ):
            raise ConfigError(f"device_prefetch must be an int >= 0 (0: no thread) or None, got {device_prefetch!r}")
        if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
            raise ConfigError(f"sharding must be a jax.sharding.Sharding, got {type(sharding).__name__}")
        self.sharding = sharding if sharding is not None else default_sharding()
        if device_prefetch is None:
            # (jaxlib's Device is not typed for mypy)
            cpu = all(d.platform == "cpu" for d in self.sharding.device_set)  # type: ignore[attr-defined]
            device_prefetch = 0 if cpu else DEVICE_PREFETCH
        self.device_prefetch = device_prefetch
        pad = check_pad_to(pad_to)
        # batch buffers the devices use in place; a few big ones reused once nothing holds them
        self._alloc = AlignedArrays(keep=8 + device_prefetch)  # as many as the core recycler, + the thread's
        self._stream: Any = source if is_stream(source) else None
        self._meter = metrics.Meter()  # the training loop's own wait and step, timed in `_run`
        self._running: _Ahead | None = None
        self.loader: Loader | None = None
        if self._stream is not None:  # of the options, only the batch and the share mean anything here
            batch_size = fields.pop("batch_size", None)
            self.rank, self.world_size = _rank_and_world(fields.pop("rank", None), fields.pop("world_size", None))
            extra = sorted(
                k
                for k, v in {
                    "options": options,
                    "transform": transform,
                    "filter": filter,
                    "mask": mask,
                    **fields,
                }.items()
                if v is not None
            )
            if extra or batch_transform is not None or epoch:
                raise ConfigError(
                    f"a stream is read as its servers send it: {extra or ['batch_transform/epoch']} apply to a "
                    f"dataset path or a mixture (give them to `crossfeed serve`)"
                )
            local = None
            if batch_size is not None:
                local = self._local_batch(batch_size)
            self.global_batch_size = batch_size
            self._assemble = Assembler(
                self.sharding, self.world_size, local, pad, alloc=self._alloc, keep_dtypes=bool(keep_dtypes)
            )
            return
        # one entry point for the options (the Loader's); the share defaults to JAX's processes
        if options is None:
            fields.setdefault("drop_last", True)
            if fields.get("rank") is None and fields.get("world_size") is None:
                fields.update(rank=jax.process_index(), world_size=jax.process_count())
        elif isinstance(options, LoaderOptions) and options.world_size == 1 and not fields:
            options = options.replace(rank=jax.process_index(), world_size=jax.process_count())
        opts = LoaderOptions.given(options, fields, who="JaxLoader")
        self.rank, self.world_size = opts.rank, opts.world_size
        if not opts.plan.drop_last:
            raise ConfigError(
                "JaxLoader keeps shapes static, so the partial last batch is dropped: drop_last=True "
                "(the default here; set it in a LoaderOptions passed whole)"
            )
        if opts.plan.batch_by_tokens is not None:
            raise ConfigError(
                "batch_by_tokens= gives batches of varying shape (documents, longest), which a jax.Array "
                "step would retrace for: use pack=crossfeed.Pack(length=...) for dense (B, length) rows"
            )
        self.global_batch_size = opts.plan.batch_size
        pad = check_pad_to(pad_to, self.global_batch_size)  # (B, length) of each padded feature: bounded
        local = self._local_batch(self.global_batch_size)
        skip = opts.plan.skip
        shorter = [
            what
            for what, given in (
                ("filter=", filter is not None),
                ("skipped sample ids not refilled", skip is not None and len(skip.samples) > 0 and not skip.refill),
            )
            if given
        ]
        if shorter and mask is False:
            raise ConfigError(
                f"{' and '.join(shorter)} make batches shorter, and a JaxLoader's global arrays have static shapes: "
                f"leave mask= on (None or True) to pad them back with a {VALID_KEY!r} mask, or filter when converting"
            )
        self.mask = bool(shorter) if mask is None else mask
        self.options = opts.replace(batch_size=local, rank=self.rank, world_size=self.world_size)
        # batches built straight into aligned buffers (a worker process's slots are aligned already)
        aligned = self._alloc if self.options.read.executor is not ExecutorKind.PROCESS else None
        self.loader = Loader(
            source,
            self.options,
            transform=transform,
            batch_transform=batch_transform,
            epoch=epoch,
            alloc=aligned,
            filter=filter,
        )
        try:
            packed = opts.plan.pack is not None  # packed rows are dense: (B, length) of every feature
            if transform is None and batch_transform is None and not packed:  # a transform may make anything dense
                check_features(self.loader.features, pad, _statistics(self.loader))
            self._assemble = Assembler(
                self.sharding, self.world_size, local, pad, alloc=self._alloc, keep_dtypes=bool(keep_dtypes)
            )
        except BaseException:
            self.loader.close()
            raise
        self._pad = Padder(local, pad, alloc=self._alloc) if self.mask else None
        self._state = self.loader.state_dict()

    def _local_batch(self, global_batch: int) -> int:
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise ConfigError(f"batch_size (the global batch) must be a positive int, got {global_batch!r}")
        if global_batch % self.world_size:
            raise ConfigError(
                f"batch_size {global_batch} is the global batch and does not divide by the {self.world_size} "
                f"processes; make it a multiple of {self.world_size}"
            )
        shards = batch_shards(self.sharding)
        if shards is not None and global_batch % shards:
            raise ConfigError(
                f"batch_size {global_batch} does not divide by the {shards} devices the sharding splits the batch "
                f"axis over ({getattr(self.sharding, 'spec', self.sharding)}); make it a multiple of {shards}"
            )
        return global_batch // self.world_size

    @property
    def local_batch_size(self) -> int | None:
        """The rows of each global batch this process reads."""
        return self._assemble.local_rows

    # -- epochs and state ------------------------------------------------------------------------
    def _need_loader(self, what: str) -> Loader:
        if self.loader is None:
            raise ConfigError(f"a stream source has no {what}: its servers plan the epochs and resume batches")
        return self.loader

    @property
    def epoch(self) -> int:
        """The epoch of the next batch the consumer will receive."""
        self._need_loader("epoch")
        return int(self._state["epoch"])

    def state_dict(self) -> dict:
        """The Loader state after the last batch the consumer received (batches prefetched to the
        devices but not yet received do not count): a JSON-able dict, the one form every
        crossfeed adapter saves and resumes (any world size)."""
        self._need_loader("state to save")
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration start at ``state`` (from any adapter, any world size)."""
        loader = self._need_loader("state to load")
        self._stop()
        loader.load_state_dict(state)  # checks version, seed and dataset size
        self._state = loader.state_dict()

    def stats(self) -> metrics.Stats:
        """The stage metrics (`crossfeed.Loader.stats`) with the training loop's view: batches,
        samples, its wait for each batch and its own step time, timed around this iterator — so
        the verdict's wait ratio is the loop's, device prefetch or not. A stream has no Loader
        here: only the loop's view (its servers time their stages)."""
        own = self._meter.stats()
        if self.loader is None:
            return own
        keep = ("batches", "samples", "wait_seconds", "consumer_seconds", "epochs")
        return dataclasses.replace(self.loader.stats(), **{k: getattr(own, k) for k in keep})

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning on the next iteration."""
        loader = self._need_loader("epochs")
        self._stop()
        loader.set_epoch(epoch)
        self._state = loader.state_dict()

    def __len__(self) -> int:
        """Steps (global batches) the next iteration yields; the same on every process."""
        if self.loader is None:
            raise TypeError("a stream source has no length: its servers decide how many batches come")
        return self.loader.rank_batch_count(int(self._state["position"]), epoch=int(self._state["epoch"]))

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        return self._run(1)

    def epochs(self, count: int | None = None) -> Iterator[dict]:
        """The batches of ``count`` epochs in a row (None: without end), prefetching across
        epoch boundaries; `state_dict` is exact after any batch."""
        self._need_loader("epochs")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise ConfigError(f"epochs must be an int >= 0 or None, got {count!r}")
        return self._run(count)

    def _run(self, count: int | None) -> Iterator[dict]:
        self._stop()  # one producer at a time: a new iteration replaces a broken-off one
        items: Generator[tuple, None, None]
        if self.loader is None:  # a stream source
            items = (("batch", self._convert(b), None) for b in self._stream)
        else:
            self.loader.load_state_dict(self._state)  # from the consumer's place, not the prefetcher's
            items = self._produce(self.loader, count)
        ahead = _Ahead(items, self.device_prefetch) if self.device_prefetch else None
        self._running = ahead
        meter = self._meter
        asked = time.perf_counter_ns()
        try:
            for kind, batch, state in ahead if ahead is not None else items:
                if state is not None:
                    self._state = state
                if kind == "batch":
                    got = meter.delivered(batch, asked)
                    yield batch
                    asked = meter.consumed(got)
            meter.ended(asked)
        finally:
            if ahead is not None:
                ahead.close()
                if self._running is ahead:
                    self._running = None
            else:
                items.close()

    def _produce(self, loader: Loader, count: int | None) -> Generator[tuple, None, None]:
        """``("batch", arrays, state after it)`` for each batch, ``("end", None, state)`` after each epoch."""
        done, pad = 0, self._pad
        while count is None or done < count:
            epoch = iter(loader)
            held: list[tuple[dict, dict]] = []  # empty batches before the first with rows (`Padder`)
            try:
                for batch in epoch:
                    if pad is None:
                        yield "batch", self._assemble(batch), loader.state_dict()
                    elif not pad.known and is_empty(batch):  # its features' shapes are not known yet
                        held.append((batch, loader.state_dict()))
                    else:
                        padded = pad(batch)
                        for empty, state in held:
                            yield "batch", self._assemble(pad(empty)), state
                        held = []
                        yield "batch", self._assemble(padded), loader.state_dict()
                for empty, state in held:  # this process's whole epoch was dropped: as its empty batches hold
                    yield "batch", self._assemble(pad.like(empty) if pad is not None else empty), state
            finally:
                epoch.close()
            done += 1
            yield "end", None, loader.state_dict()

    def _convert(self, item):
        if isinstance(item, tuple):  # connect(with_meta=True): (meta, batch)
            return item[0], self._assemble(item[1])
        return self._assemble(item)

    def _stop(self) -> None:
        if self._running is not None:
            self._running.close()
            self._running = None

    def close(self) -> None:
        """Stop the prefetch thread and close the Loader (a stream source is the caller's to close)."""
        self._stop()
        if self.loader is not None:
            self.loader.close()

    def __enter__(self) -> JaxLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_DONE = object()


class _Ahead:
    """Runs ``items`` in a daemon thread, at most ``depth`` items ahead of the consumer. The
    thread's exception is raised in the consumer; `close` stops it (bounded waits both sides)."""

    def __init__(self, items: Iterator, depth: int):
        self._items = items
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="crossfeed-jax-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self) -> None:
        try:
            for item in self._items:
                if not self._put(item):
                    return
            self._put(_DONE)
        except BaseException as e:  # handed to the consumer, which raises it
            self._put(_Failed(e))
        finally:
            close = getattr(self._items, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Iterator:
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    if self._stop.is_set():
                        return
                    raise CrossfeedError("the JAX prefetch thread ended without a batch or an error") from None
                continue
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def close(self) -> None:
        self._stop.set()
        while True:  # free a producer blocked on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_S)
            if self._thread.is_alive():
                log.warning("the JAX prefetch thread did not stop within %.0f s; leaving it (a daemon)", JOIN_S)


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error
