"""The producing side of a server: runs `factory(epoch)` and encodes batches.

Yields into a bounded `Prefetch` queue, in order:
    Item(seq, epoch, frames, n)       one encoded batch
    EpochEnd(epoch, batches)          after the last batch of an epoch
    StreamEnd(epochs)                 after the last epoch (only with a finite `epochs`)
    ProducerFailed(message)           the factory or its iterator raised; nothing follows

A thread builds them, and with `inline=True` (the server's distribution loop) hands the building
over to the reader of the queue once builds are quick: after INLINE_AFTER batches in a row each
built in under FAST seconds, the thread stops and `queue.get_nowait()` builds the next batch on
the caller's thread when the queue is empty — no thread hand-over per batch (a lock, a wake-up
and a GIL switch each way, which cost a small packed batch as much CPU as building it). A build
that takes longer than SLOW seconds (an epoch's start, a cold cache) gives the building back to a
thread; that one build held the reader (the server loop, which beats to its trainers) for as long
as it took: a build that stalls on storage holds the loop's heartbeats with it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Mapping
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


INLINE_AFTER = 8  # quick builds in a row before the building moves to the queue's reader
FAST = 0.005  # seconds: a build this quick may run on the server loop's thread
SLOW = 0.05  # seconds: a build this slow moves the building back to a thread


class Producer:
    """Runs epochs `start, start+1, ...` (`epochs` of them, or until stopped) on a thread (or,
    with `inline`, on the queue's reader's thread while builds are quick: see the module)."""

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
        inline: bool = False,
    ):
        self._factory = factory
        self._server_id = server_id
        self._epochs = epochs
        self._start = start_epoch
        self._on_put = on_put  # called on this thread after each put (the server's wake-up)
        self._prefetch = Prefetch(prefetch, prefetch_bytes)
        self.queue: Prefetch | _Inline = _Inline(self) if inline else self._prefetch
        self._allow_inline = inline
        self._items = self._produce()  # advanced by one thread at a time: the builder's, or the reader's
        self._inline = False  # True: the builder thread has stopped and the reader builds
        self._finished = False
        self.handovers = 0  # times the building moved between the thread and the reader
        self._stop = threading.Event()
        self._thread = self._new_thread()

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name="crossfeed-producer", daemon=True)

    def start(self) -> Producer:
        self._thread.start()
        return self

    def _put(self, item: Any) -> bool:
        return put_until(self._prefetch, item, self._stop, self._on_put)

    def _produce(self) -> Generator[Any, None, None]:
        seq = 0
        epoch = self._start
        try:
            while self._epochs is None or epoch < self._start + self._epochs:
                count = 0
                batches = self._factory(epoch)
                try:
                    for batch in batches:
                        yield encode_item(batch, epoch=epoch, seq=seq, server_id=self._server_id)
                        seq += 1
                        count += 1
                finally:
                    close = getattr(batches, "close", None)
                    if callable(close):
                        close()
                if count == 0:
                    raise ValueError(f"the batch factory gave no batches for epoch {epoch}")
                yield EpochEnd(epoch, count)
                epoch += 1
            yield StreamEnd(epoch - self._start)
        except Exception as e:  # crosses the thread boundary wrapped, never swallowed
            logger.exception("producing epoch %d failed", epoch)
            yield ProducerFailed(f"epoch {epoch}: {type(e).__name__}: {e}")

    def _run(self) -> None:
        quick = 0
        while not self._stop.is_set():
            began = time.perf_counter()
            item = next(self._items, None)
            if item is None:
                self._finished = True
                return
            quick = quick + 1 if time.perf_counter() - began < FAST else 0
            if not self._put(item):
                return
            if isinstance(item, (StreamEnd, ProducerFailed)):
                self._finished = True
                return
            if self._allow_inline and quick >= INLINE_AFTER:
                self.handovers += 1
                self._inline = True  # this thread's last step but the wake-up: the reader builds from here on
                if self._on_put is not None:
                    self._on_put()  # a loop waiting for this thread's next put builds it now
                return

    def build_here(self) -> Any:
        """The next item, built on the caller's thread (inline mode, the builder thread
        stopped); None when there is none (the stream ended, or stopping). A slow build gives
        the building back to a thread."""
        if self._finished or self._stop.is_set():
            return None
        began = time.perf_counter()
        item = next(self._items, None)
        if item is None or isinstance(item, (StreamEnd, ProducerFailed)):
            self._finished = True
        elif time.perf_counter() - began > SLOW:
            self.handovers += 1
            self._inline = False
            self._thread = self._new_thread()
            self._thread.start()
        return item

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("producer thread did not stop within %.1fs", timeout)
                return
        if not self._thread.is_alive():
            try:
                self._items.close()  # the factory's iterator is closed (a Loader's epoch ends)
            except ValueError:  # the reader is building on it right now (stopped from another thread)
                logger.debug("producer stopped while its reader builds; its iterator is closed when collected")


class _Inline:
    """The queue a server loop reads from an inline `Producer`: what the thread put first, then
    batches built on the reader's thread while the building is handed over."""

    def __init__(self, producer: Producer):
        self._producer = producer

    def empty(self) -> bool:
        p = self._producer
        return p._prefetch.empty() and not (p._inline and not p._finished)

    def get_nowait(self) -> Any:
        p = self._producer
        try:
            return p._prefetch.get_nowait()
        except queue.Empty:
            if not p._inline:
                raise
        item = p.build_here()
        if item is None:
            raise queue.Empty
        return item

    def get(self, timeout: float) -> Any:
        try:
            return self.get_nowait()
        except queue.Empty:
            return self._producer._prefetch.get(timeout)
