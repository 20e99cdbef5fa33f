"""Stage 5 of the read pipeline, the executor: builds batches in parallel, in order, with bounded
memory. It is the seam where the work goes — threads today (numpy, CRC and JPEG decoding release
the GIL); worker processes that fill shared-memory batches (`crossfeed.read.executors.processes`) plug in
here with the same contract, chosen by `ExecutorKind`.

``executor.map(build, items)`` yields ``build(item)`` for each item, in the order of ``items``,
with at most ``window`` results built or being built ahead of the consumer.
"""

from __future__ import annotations

import enum
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from crossfeed.errors import ConfigError

T = TypeVar("T")
R = TypeVar("R")


class ExecutorKind(str, enum.Enum):
    """Where a Loader builds its batches: ``"thread"`` (``num_threads`` threads of this process)
    or ``"process"`` (``processes`` worker processes, batches in shared memory)."""

    THREAD = "thread"
    PROCESS = "process"


class ThreadExecutor:
    """``num_threads`` threads, at most ``window`` batches in flight (built, or being built, and
    not yet taken); 0 threads: each batch is built in the consumer's thread when it asks (no
    overlap with the consumer's work, but no hand-over either: the fastest for small records whose
    building holds the GIL, when the consumer does little else). Exceptions raised by ``build`` reach the consumer unchanged, at the item that
    raised; batches after it are cancelled."""

    def __init__(self, num_threads: int, window: int, *, name: str = "crossfeed-loader"):
        if num_threads < 0 or window < 1:
            raise ConfigError(f"an executor needs num_threads >= 0 and window >= 1, got {num_threads}, {window}")
        self.num_threads, self.window, self._name = num_threads, window, name
        self.processes = 0  # (the `crossfeed.read.pipeline.Executor` contract: no worker processes)
        self.skipped = 0  # records are skipped by the builder's own budget, in this process
        self._pool: ThreadPoolExecutor | None = None
        self._stops: set[threading.Event] = set()

    def map(self, build: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        if self.num_threads == 0:  # in the consumer's thread: no hand-over, no overlap
            return (build(item) for item in items)
        if self.num_threads == 1:
            return self._pipelined(build, items)
        return self._pooled(build, items)

    def _pooled(self, build: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix=self._name)
        pool, it = self._pool, iter(items)
        pending: deque = deque()
        try:
            for item in it:
                pending.append(pool.submit(build, item))
                if len(pending) == 1:  # the first batch alone: it gets every core (time to first batch)
                    pending[0].exception()
                if len(pending) >= self.window:
                    break
            while pending:
                result = pending.popleft().result()
                try:
                    nxt = next(it)
                except StopIteration:
                    pass
                else:
                    pending.append(pool.submit(build, nxt))
                yield result
        finally:
            for f in pending:
                f.cancel()

    def _pipelined(self, build: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """One thread: it builds the items in order into a queue of ``window`` results (one
        hand-over per batch is all the synchronisation; a pool's futures cost more than a small
        batch takes to build)."""
        out: queue.Queue = queue.Queue(self.window)
        stop = threading.Event()
        self._stops.add(stop)  # `close` stops the producer even if this generator is never finished

        def put(entry) -> bool:
            """Hand an entry over unless the consumer went away (then False)."""
            while not stop.is_set():
                try:
                    out.put(entry, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for item in items:
                    if not put((True, build(item))):
                        return
                put((True, _END))
            except BaseException as e:  # reaches the consumer at the item that raised
                put((False, e))

        worker = threading.Thread(target=produce, name=self._name, daemon=True)
        worker.start()
        try:
            while True:
                ok, r = out.get()
                if not ok:
                    raise r
                if r is _END:
                    return
                yield r
        finally:
            stop.set()
            worker.join()
            self._stops.discard(stop)

    def close(self) -> None:
        for stop in list(self._stops):
            stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


_END = object()
