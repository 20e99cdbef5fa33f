"""The producing side of a server: a thread that runs `factory(epoch)` and encodes batches.

Yields into a bounded `Prefetch` queue, in order:
    Item(seq, epoch, frames, n)       one encoded batch
    EpochEnd(epoch, batches)          after the last batch of an epoch
    StreamEnd(epochs)                 after the last epoch (only with a finite `epochs`)
    ProducerFailed(message)           the factory or its iterator raised; nothing follows
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from crossfeed.format import wire
from crossfeed.format.schema import INDEX_KEY
from crossfeed.net.stream.credits import Item

logger = logging.getLogger(__name__)

BatchFactory = Callable[[int], Iterable[Mapping[str, Any]]]


@dataclasses.dataclass(frozen=True)
class EpochEnd:
    epoch: int
    batches: int


@dataclasses.dataclass(frozen=True)
class StreamEnd:
    epochs: int


@dataclasses.dataclass(frozen=True)
class ProducerFailed:
    message: str


def encode_item(batch: Mapping[str, Any], *, epoch: int, seq: int, server_id: str) -> Item:
    """An Item whose frames carry `batch`; the "__index__" key becomes the provenance ids."""
    fields = {k: v for k, v in batch.items() if k != INDEX_KEY}
    ids = batch.get(INDEX_KEY)
    ids = None if ids is None else np.asarray(ids, dtype=np.int64).reshape(-1)
    meta = wire.BatchMeta(epoch=epoch, seq=seq, server_id=server_id, sample_ids=ids)
    frames = wire.encode(fields, meta)
    num = len(ids) if ids is not None else _leading_dim(fields)
    nbytes = sum(f.nbytes if isinstance(f, np.ndarray) else len(f) for f in frames)
    return Item(seq=seq, epoch=epoch, frames=frames, num_samples=num, nbytes=nbytes)


def _leading_dim(fields: Mapping[str, Any]) -> int:
    for v in fields.values():
        shape = getattr(v, "shape", None)
        if shape:
            return int(shape[0])
        if isinstance(v, (list, tuple)):
            return len(v)
    return 0


class Prefetch:
    """A bounded hand-off from the producer thread to the server loop: at most `maxsize` items
    and (but for the first) `max_bytes` bytes of batches; 0 bytes: no byte bound.

    A producer that finds it full waits until it is half empty and then refills it in one
    burst, instead of waking (and taking the GIL from the loop while it sends) once per item.
    `put` raises queue.Full and `get`/`get_nowait` raise queue.Empty, as `queue.Queue` does.
    """

    def __init__(self, maxsize: int, max_bytes: int = 0):
        self.maxsize, self.max_bytes = max(maxsize, 1), max(max_bytes, 0)
        self._items: collections.deque[Any] = collections.deque()
        self._bytes = 0
        self._cond = threading.Condition(threading.Lock())
        self._producer_waits = False
        self._consumer_waits = False

    def empty(self) -> bool:
        return not self._items

    def _full(self) -> bool:
        return len(self._items) >= self.maxsize or bool(
            self.max_bytes and self._items and self._bytes >= self.max_bytes
        )

    def _half_empty(self) -> bool:
        return len(self._items) <= self.maxsize // 2 and (
            not self.max_bytes or self._bytes <= self.max_bytes // 2 or len(self._items) <= 1
        )

    def put(self, item: Any, timeout: float) -> None:
        with self._cond:
            if self._full():
                self._producer_waits = True
                try:
                    if not self._cond.wait_for(self._half_empty, timeout):
                        raise queue.Full
                finally:
                    self._producer_waits = False
            self._items.append(item)
            self._bytes += getattr(item, "nbytes", 0)
            if self._consumer_waits:
                self._cond.notify_all()

    def get_nowait(self) -> Any:
        with self._cond:
            if not self._items:
                raise queue.Empty
            item = self._items.popleft()
            self._bytes -= getattr(item, "nbytes", 0)
            if self._producer_waits and self._half_empty():
                self._cond.notify_all()
            return item

    def get(self, timeout: float) -> Any:
        with self._cond:
            if not self._items:
                self._consumer_waits = True
                try:
                    if not self._cond.wait_for(lambda: self._items, timeout):
                        raise queue.Empty
                finally:
                    self._consumer_waits = False
        return self.get_nowait()


def put_until(q: queue.Queue | Prefetch, item: Any, stop, on_put=None, void=None) -> bool:
    """Put ``item`` on the server's queue, waiting for room in short steps so ``stop`` (an Event)
    is heard; ``on_put()`` wakes the server. False, and nothing put, once ``stop`` is set or
    ``void()`` turns true (the item is no longer wanted)."""
    while not stop.is_set():
        if void is not None and void():
            return False
        try:
            q.put(item, timeout=0.1)
        except queue.Full:
            continue
        if on_put is not None:
            on_put()
        return True
    return False


class Producer:
    """Runs epochs `start, start+1, ...` (`epochs` of them, or until stopped) on a thread."""

    def __init__(
        self,
        factory: BatchFactory,
        *,
        server_id: str,
        epochs: int | None,
        start_epoch: int = 0,
        prefetch: int = 4,
        prefetch_bytes: int = 0,
        on_put: Callable[[], None] | None = None,
    ):
        self._factory = factory
        self._server_id = server_id
        self._epochs = epochs
        self._start = start_epoch
        self._on_put = on_put  # called on this thread after each put (the server's wake-up)
        self.queue = Prefetch(prefetch, prefetch_bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crossfeed-producer", daemon=True)

    def start(self) -> Producer:
        self._thread.start()
        return self

    def _put(self, item: Any) -> bool:
        return put_until(self.queue, item, self._stop, self._on_put)

    def _run(self) -> None:
        seq = 0
        epoch = self._start
        try:
            while self._epochs is None or epoch < self._start + self._epochs:
                count = 0
                batches = self._factory(epoch)
                try:
                    for batch in batches:
                        item = encode_item(batch, epoch=epoch, seq=seq, server_id=self._server_id)
                        if not self._put(item):
                            return
                        seq += 1
                        count += 1
                finally:
                    close = getattr(batches, "close", None)
                    if callable(close):
                        close()
                if count == 0:
                    raise ValueError(f"the batch factory gave no batches for epoch {epoch}")
                if not self._put(EpochEnd(epoch, count)):
                    return
                epoch += 1
            self._put(StreamEnd(epoch - self._start))
        except Exception as e:  # crosses the thread boundary wrapped, never swallowed
            logger.exception("producing epoch %d failed", epoch)
            self._put(ProducerFailed(f"epoch {epoch}: {type(e).__name__}: {e}"))

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("producer thread did not stop within %.1fs", timeout)
