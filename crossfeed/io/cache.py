"""A bounded, crash-safe local cache of remote shards, shared by every process on a node.

Remote shards (any fsspec URL) are downloaded whole into ``cache_dir`` and then read exactly like
local shards (mmap, vectorised checks). A shard larger than `CHUNK` arrives as parallel range
requests (`WINDOW` per shard, `STREAMS` per process: object stores cap one connection well
below the link, so a single GET per shard leaves most of it idle), each written into the
temporary file at its offset as it arrives — over HTTP(S) in 1 MiB pieces, so memory holds a
piece per request in flight, not chunks — and hashed in order from the page cache as the file
fills; a failed request is tried again. Entries are named by the shard's sha256 from the manifest
— content addressing — so a dataset changed remotely (new sha256) is never served from a stale
entry, and two datasets holding the same shard share it.

* **Crash-safe:** a download goes to a temporary file, is checked against the manifest's sha256
  and size, then renamed into place: a kill -9 mid-download leaves only a temporary file, which
  the next writer of the cache removes; no accepted entry is ever partial. (No fsync: an entry
  torn by a power loss fails the once-per-process hash below and is downloaded again.)
* **Shared:** a per-entry file lock (``fcntl.flock``) makes concurrent processes (DataLoader
  workers, ranks, other jobs) download each shard once; no shared memory to leak. A lock dies
  with its process.
* **Bounded:** after each download, least-recently-used entries are removed until the cache is
  under ``limit`` bytes; entries this process has open (its window) are never removed. An entry
  another process has mapped may be removed: POSIX keeps the mapping valid until it is closed.
* **Checked on use:** each process hashes an entry the first time it opens it (an entry it
  downloaded itself was hashed as it arrived); one that does not match its sha256 is removed and
  downloaded again.

`Prefetcher` downloads the shards the plan will need next, ahead of use, with bounded
concurrency; `crossfeed cache ls|prune|clear` manages the directory.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import itertools
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from crossfeed.config import parse_size
from crossfeed.errors import ConfigError, CorruptRecordError, CrossfeedError

log = logging.getLogger(__name__)
ENV = "CROSSFEED_CACHE_DIR"
CHUNK = 4 << 20  # bytes per range request of a large shard
STREAMS = 32  # range requests in flight per process: object stores cap one stream well below the NIC
WINDOW = 8  # range requests in flight or queued per shard (memory: the requests in flight, up to STREAMS)
_TMP = ".tmp-"


@dataclass(frozen=True)
class Entry:
    name: str
    path: str
    size: int
    last_used: float


class ShardCache:
    """The cache directory ``root``, kept under ``limit`` bytes (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike,
        limit: int | str | None = None,
        *,
        chunk_bytes: int | None = None,
        streams: int | None = None,
        window: int | None = None,
    ):
        self.root = os.path.abspath(os.fspath(root))
        self.limit = parse_size(limit, "cache_limit") if limit is not None else None
        chunk_bytes = CHUNK if chunk_bytes is None else chunk_bytes  # module defaults read now: tunable
        streams = STREAMS if streams is None else streams
        window = WINDOW if window is None else window
        if chunk_bytes < 1 or streams < 1 or window < 1:
            raise ConfigError(f"chunk_bytes, streams and window must be >= 1, got {chunk_bytes}, {streams}, {window}")
        self.chunk_bytes, self.streams, self.window = chunk_bytes, streams, window
        self._ranges: ThreadPoolExecutor | None = None  # range requests, shared by every download
        self._ranges_pid = 0
        os.makedirs(self.root, exist_ok=True)
        self._pinned: dict[str, int] = {}  # entries this process has open → open count
        self._verified: set[str] = set()  # entries this process downloaded or hashed
        self._lock = threading.Lock()
        self.downloads = 0  # shards this process downloaded (for tests and `bench`)

    # -- naming --------------------------------------------------------------------------------
    def name_of(self, sha256: str, rel: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{64}", sha256 or ""):
            raise CrossfeedError(
                f"{rel}: the manifest has no sha256 for this shard, so it cannot be cached by "
                f"content; rebuild the manifest with `crossfeed index`"
            )
        return sha256 + (".gz" if rel.endswith(".gz") else "")

    def path_of(self, name: str) -> str:
        return os.path.join(self.root, name[:2], name)

    # -- use -------------------------------------------------------------------------------------
    def fetch(self, storage, rel: str, sha256: str, size: int) -> str:
        """The local path of the shard ``rel`` of ``storage`` (downloaded now if it is not
        cached), pinned until `release`."""
        name = self.name_of(sha256, rel)
        path = self.path_of(name)
        self._pin(name)
        try:
            if not self._valid(path, size) or not self._checked(name, path, sha256):
                with self._entry_lock(name):
                    if not self._valid(path, size) or not self._checked(name, path, sha256):  # fetched meanwhile?
                        self._download(storage, rel, path, sha256, size)
                        with self._lock:
                            self._verified.add(name)
            with contextlib.suppress(OSError):
                os.utime(path)  # last use, for LRU
        except BaseException:
            self.release(name)
            raise
        self._evict()
        return path

    def has(self, sha256: str, rel: str, size: int) -> bool:
        return self._valid(self.path_of(self.name_of(sha256, rel)), size)

    def release(self, name_or_path: str) -> None:
        name = os.path.basename(name_or_path)
        with self._lock:
            n = self._pinned.get(name, 0) - 1
            if n > 0:
                self._pinned[name] = n
            else:
                self._pinned.pop(name, None)

    def _pin(self, name: str) -> None:
        with self._lock:
            self._pinned[name] = self._pinned.get(name, 0) + 1

    def _checked(self, name: str, path: str, sha256: str) -> bool:
        """Whether the entry holds the shard: hashed once per process (bit rot, a damaged disk or
        a hand-edited file are caught here and the shard is downloaded again)."""
        with self._lock:
            if name in self._verified:
                return True
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                while chunk := f.read(8 << 20):
                    digest.update(chunk)
        except OSError:
            return False
        if digest.hexdigest() != sha256:
            log.warning("cache entry %s does not match its sha256; downloading it again", path)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return False
        with self._lock:
            self._verified.add(name)
        return True

    @staticmethod
    def _valid(path: str, size: int) -> bool:
        try:
            return os.path.getsize(path) == size
        except OSError:
            return False

    @contextlib.contextmanager
    def _entry_lock(self, name: str) -> Iterator[None]:
        locks = os.path.join(self.root, ".locks")
        os.makedirs(locks, exist_ok=True)
        fd = os.open(os.path.join(locks, name + ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _download(self, storage, rel: str, path: str, sha256: str, size: int) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._clean_temporaries(os.path.dirname(path))
        tmp = os.path.join(os.path.dirname(path), f"{_TMP}{os.getpid()}-{secrets.token_hex(4)}")
        where = storage.url(rel)
        try:
            if storage.remote and size > self.chunk_bytes:
                digest, got = self._download_ranges(storage, rel, tmp, size)
            else:
                storage.download(rel, tmp)  # one streamed transfer (fsspec get_file)
                digest, got = hashlib.sha256(), 0
                with open(tmp, "rb") as f:  # a small shard: hashed back from the page cache
                    while chunk := f.read(8 << 20):
                        digest.update(chunk)
                        got += len(chunk)
            if got != size or digest.hexdigest() != sha256:
                raise CorruptRecordError(
                    where,
                    0,
                    f"downloaded {got} bytes with sha256 {digest.hexdigest()[:16]}…, the "
                    f"manifest says {size} bytes and {sha256[:16]}…; the remote shard "
                    f"changed or is damaged",
                )
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.downloads += 1
        log.debug("cached %s (%d bytes) as %s", where, size, path)

    def _download_ranges(self, storage, rel: str, tmp: str, size: int):
        """A large shard as ``chunk_bytes`` range requests, ``window`` of them in flight (on a pool
        of ``streams`` shared by every download): each request writes its bytes into the temporary
        file at their offset as soon as they land and lets them go, so memory holds only the
        requests in flight, never finished chunks waiting for an earlier one; the file is hashed in
        order as it fills, read back from the page cache into one reused buffer:
        ``(digest, bytes written)``."""
        with self._lock:
            if self._ranges is None or self._ranges_pid != os.getpid():  # a forked child has no threads
                self._ranges = ThreadPoolExecutor(self.streams, thread_name_prefix="crossfeed-range")
                self._ranges_pid = os.getpid()
            pool = self._ranges
        spans = iter([(a, min(size, a + self.chunk_bytes)) for a in range(0, size, self.chunk_bytes)])
        digest, got = hashlib.sha256(), 0
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        pending: collections.deque = collections.deque()
        try:
            for a, b in itertools.islice(spans, self.window):
                pending.append((a, b, pool.submit(_write_range, storage, rel, a, b, fd)))
            buf = bytearray(min(self.chunk_bytes, size))
            while pending:
                a, b, fut = pending.popleft()
                fut.result()
                nxt = next(spans, None)
                if nxt is not None:
                    pending.append((*nxt, pool.submit(_write_range, storage, rel, *nxt, fd)))
                view = memoryview(buf)[: b - a]
                n = os.preadv(fd, [view], a)
                if n != b - a:
                    raise CorruptRecordError(storage.url(rel), a, f"wrote bytes {a}-{b - 1} but read back {n}")
                digest.update(view)
                got += n
        finally:
            for *_, fut in pending:
                fut.cancel()
            for *_, fut in pending:  # a running request still writes into fd: wait for it
                with contextlib.suppress(BaseException):
                    fut.result()
            os.close(fd)
        return digest, got

    def _clean_temporaries(self, folder: str, older_than: float = 3600.0) -> None:
        """Remove temporary files of downloads whose process is gone (or that are very old)."""
        now = time.time()
        with contextlib.suppress(OSError):
            for f in os.listdir(folder):
                if not f.startswith(_TMP):
                    continue
                p = os.path.join(folder, f)
                pid = f[len(_TMP) :].split("-")[0]
                alive = pid.isdigit() and _alive(int(pid))
                with contextlib.suppress(OSError):
                    if not alive or now - os.path.getmtime(p) > older_than:
                        os.unlink(p)

    # -- size ------------------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        out = []
        for sub in sorted(os.listdir(self.root)):
            d = os.path.join(self.root, sub)
            if sub.startswith(".") or not os.path.isdir(d):
                continue
            for f in os.listdir(d):
                if f.startswith(_TMP):
                    continue
                p = os.path.join(d, f)
                with contextlib.suppress(OSError):
                    st = os.stat(p)
                    out.append(Entry(f, p, st.st_size, st.st_mtime))
        return out

    def size(self) -> int:
        return sum(e.size for e in self.entries())

    def _evict(self) -> None:
        if self.limit is None:
            return
        entries = self.entries()
        total = sum(e.size for e in entries)
        if total <= self.limit:
            return
        with self._lock:
            pinned = set(self._pinned)
        for e in sorted(entries, key=lambda e: e.last_used):
            if total <= self.limit:
                break
            if e.name in pinned:
                continue
            with contextlib.suppress(OSError):
                os.unlink(e.path)
                total -= e.size

    def prune(self, limit: int | str | None = None) -> int:
        """Remove least-recently-used entries until under ``limit`` (default: this cache's);
        returns the bytes freed."""
        before = self.size()
        saved, self.limit = self.limit, parse_size(limit, "cache_limit") if limit is not None else self.limit
        try:
            self._evict()
            for sub in os.listdir(self.root):
                if not sub.startswith(".") and os.path.isdir(os.path.join(self.root, sub)):
                    self._clean_temporaries(os.path.join(self.root, sub), older_than=0 if limit == 0 else 3600.0)
        finally:
            self.limit = saved
        return before - self.size()

    def clear(self) -> int:
        """Remove every entry (and temporary file); returns the bytes freed."""
        freed = 0
        for e in self.entries():
            with contextlib.suppress(OSError):
                os.unlink(e.path)
                freed += e.size
        return freed


def _write_range(storage, rel: str, start: int, stop: int, fd: int, attempts: int = 3) -> int:
    """Bytes ``start:stop`` of a remote shard written into ``fd`` at ``start`` as they arrive
    (`Storage.write_range`): a finished chunk is never held in memory waiting for an earlier one.
    A failed request (a reset connection, a 5xx) is tried again after a short pause — one flaky
    request out of hundreds should not fail the shard; a missing file is not."""
    for attempt in range(attempts):
        try:
            got = storage.write_range(rel, start, stop, fd)
            break
        except (FileNotFoundError, PermissionError):
            raise
        except Exception as e:
            if attempt == attempts - 1:
                raise CrossfeedError(
                    f"{storage.url(rel)}: bytes {start}-{stop - 1} could not be downloaded in {attempts} "
                    f"tries (last: {type(e).__name__}: {e}); check the server or the network and rerun"
                ) from e
            log.info("range %d-%d of %s failed (%s); trying again", start, stop - 1, storage.url(rel), e)
            time.sleep(0.1 * 2**attempt)
    else:
        return 0  # attempts < 1: nothing asked
    if got != stop - start:
        raise CorruptRecordError(
            storage.url(rel),
            start,
            f"asked for bytes {start}-{stop - 1}, got {got} bytes; the server "
            f"ignored the range or the remote shard changed",
        )
    return got


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Prefetcher:
    """Downloads shards into a `ShardCache` ahead of use, ``workers`` at a time; ``want(jobs)``
    queues ``(storage, rel, sha256, size)`` jobs not already cached or in flight."""

    def __init__(self, cache: ShardCache, workers: int = 4):
        self.cache = cache
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="crossfeed-prefetch")
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()

    def want(self, jobs) -> None:
        for storage, rel, sha256, size in jobs:
            name = self.cache.name_of(sha256, rel)
            with self._lock:
                f = self._inflight.get(name)
                if (f is not None and not f.done()) or self.cache.has(sha256, rel, size):
                    continue
                self._inflight[name] = self._pool.submit(self._one, storage, rel, sha256, size, name)

    def _one(self, storage, rel, sha256, size, name) -> None:
        try:
            self.cache.release(self.cache.fetch(storage, rel, sha256, size))
        except Exception as e:  # the reader fetches it again and reports the error where it is needed
            log.warning("prefetching %s failed: %s", storage.url(rel), e)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
