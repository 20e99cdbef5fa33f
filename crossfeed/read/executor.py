"""Stage 5 of the read pipeline, the executor: builds batches in parallel, in order, with bounded
memory. It is the seam where the work goes — threads today (numpy, CRC and JPEG decoding release
the GIL); worker processes that fill shared-memory batches plug in here with the same contract.

``executor.map(build, items)`` yields ``build(item)`` for each item, in the order of ``items``,
with at most ``window`` results built or being built ahead of the consumer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from crossfeed.errors import ConfigError

T = TypeVar("T")
R = TypeVar("R")


class ThreadExecutor:
    """``num_threads`` threads, at most ``window`` batches in flight (built, or being built, and
    not yet taken). Exceptions raised by ``build`` reach the consumer unchanged, at the item that
    raised; batches after it are cancelled."""

    def __init__(self, num_threads: int, window: int, *, name: str = "crossfeed-loader"):
        if num_threads < 1 or window < 1:
            raise ConfigError(f"an executor needs num_threads >= 1 and window >= 1, got {num_threads}, {window}")
        self.num_threads, self.window, self._name = num_threads, window, name
        self._pool: ThreadPoolExecutor | None = None

    def map(self, build: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix=self._name)
        pool, it = self._pool, iter(items)
        pending: deque = deque()
        try:
            for item in it:
                pending.append(pool.submit(build, item))
                if len(pending) >= self.window:
                    break
            while pending:
                result = pending.popleft().result()
                nxt = next(it, _END)
                if nxt is not _END:
                    pending.append(pool.submit(build, nxt))
                yield result
        finally:
            for f in pending:
                f.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


_END = object()
