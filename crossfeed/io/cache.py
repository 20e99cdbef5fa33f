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
  under ``limit`` bytes; entries this process has open (its window) are never removed. A reader
  gets an entry already open and mapped (`ShardCache.open`), never a path to open later, so an
  entry removed meanwhile — by another process, whose pins this one cannot see — stays readable
  through that mapping (POSIX keeps an unlinked file's pages until the last mapping goes).
* **Only its own files:** the cache removes nothing but what it wrote — entries named by their
  sha256 in the folder of their first two hex digits, its own temporary files — each checked with
  ``lstat`` (a regular file, not a link) and removed through a folder opened with ``O_NOFOLLOW``;
  a symlink anywhere in the cache is never followed. A ``cache_dir`` holding anything else at its
  top (a folder of someone's files, a planted link) is refused, so pointing it at the wrong folder
  costs an error, not the folder. A new cache is marked with `MARKER`.
* **Checked on use:** each process hashes an entry the first time it opens it (an entry it
  downloaded itself was hashed as it arrived); one that does not match its sha256 is removed and
  downloaded again. The bytes hashed are those of the mapping handed out.
* **Bounded reads:** a download takes at most the manifest's size of the shard, each piece within
  the read deadline (`crossfeed.io.storage`); a stall or a reset is tried again (`ATTEMPTS`).

`Prefetcher` downloads the shards the plan will need next, ahead of use, with bounded
concurrency; `crossfeed cache ls|prune|clear` manages the directory.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from crossfeed.config import parse_size
from crossfeed.errors import ConfigError, CorruptRecordError, CrossfeedError, RemoteError, redact
from crossfeed.format import tfrecord
from crossfeed.io.storage import ATTEMPTS, retrying

log = logging.getLogger(__name__)
ENV = "CROSSFEED_CACHE_DIR"
CHUNK = 4 << 20  # bytes per range request of a large shard
STREAMS = 32  # range requests in flight per process: object stores cap one stream well below the NIC
WINDOW = 8  # range requests in flight or queued per shard (memory: the requests in flight, up to STREAMS)
MARKER = ".crossfeed-cache"  # the file that marks a directory as a crossfeed cache
OPEN_TRIES = 4  # downloads of one entry that other processes may evict before it is opened
ROOM_WAIT = 30.0  # seconds a download waits for the entries in use to make room under the limit
_TMP = ".tmp-"
_LOCKS = ".locks"
_ENTRY = re.compile(r"[0-9a-f]{64}(\.gz)?")  # an entry: the shard's sha256 (and .gz)
_FOLDER = re.compile(r"[0-9a-f]{2}")  # an entry's folder: its first two hex digits
_TEMPORARY = re.compile(re.escape(_TMP) + r"([0-9]{1,10})-[0-9a-f]{8}")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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
        self._claim()
        self._pinned: dict[str, int] = {}  # entries this process has open → open count
        self._pinned_sizes: dict[str, int] = {}  # … → its size (what `room` subtracts)
        self._downloading: dict[str, int] = {}  # entries this process is downloading → size (room made first)
        self._waiting: set[str] = set()  # … waiting for room to download (pinned, nothing on disk yet)
        self._verified: set[str] = set()  # entries this process downloaded or hashed
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when a pin or a download ends
        self.downloads = 0  # shards this process downloaded (for tests, `bench` and `Loader.stats`)
        self.downloaded_bytes = 0  # … their bytes
        self.hits = 0  # opens served by an entry already in the cache (`Loader.stats`)

    # -- the directory: only the cache's own layout, never through a link ----------------------
    def _claim(self) -> None:
        """Make ``root`` a cache, or check that it is one: it may hold only `MARKER`, the lock
        folder and entry folders (real folders, not links); anything else refuses it."""
        try:
            os.makedirs(self.root, exist_ok=True)
            with self._root_fd() as fd:
                foreign = sorted(n for n in os.listdir(fd) if not _ours(fd, n))
                if foreign:
                    shown = ", ".join(foreign[:5]) + (", …" if len(foreign) > 5 else "")
                    raise ConfigError(
                        f"{self.root}: not a crossfeed cache: it holds {len(foreign)} name(s) the cache did not "
                        f"write ({shown}); the cache removes files, so it only takes a directory of its own: "
                        f"point cache_dir (--cache-dir, --dir, ${ENV}) at a new or empty directory"
                    )
                with contextlib.suppress(FileExistsError):
                    mark = os.open(
                        MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd
                    )
                    try:
                        os.write(mark, b"crossfeed shard cache: entries named by sha256; see crossfeed.io.cache\n")
                    finally:
                        os.close(mark)
        except OSError as e:
            raise ConfigError(f"{self.root}: cannot use it as the cache directory ({e.strerror or e})") from e

    @contextlib.contextmanager
    def _root_fd(self) -> Iterator[int]:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root itself is the user's choice
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _folder(self, name: str, *, create: bool) -> Iterator[int | None]:
        """The cache's folder ``name`` opened without following a link (None: it does not exist
        and ``create`` is false); a link or file in its place is a `ConfigError`."""
        with self._root_fd() as root:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=root)
            try:
                fd = os.open(name, _DIR, dir_fd=root)
            except FileNotFoundError:
                if create:
                    raise
                fd = None
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise ConfigError(
                    f"{os.path.join(self.root, name)}: a link or file where the cache keeps a folder; the cache "
                    f"never follows links: remove it, or use a cache directory of your own"
                ) from e
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

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
    def open(self, storage, rel: str, sha256: str, size: int, *, stream_limit: int | None = None) -> tuple[str, object]:
        """``(path, stream)`` of the shard ``rel`` of ``storage`` (downloaded now if it is not
        cached), pinned until `release`: ``stream`` is the checked entry already mapped
        (read-only mmap; ``b""`` when empty; GZIP inflated, to at most ``stream_limit`` bytes:
        what the shard's index declares), valid however long it is held, even if the entry is
        removed meanwhile."""
        name = self.name_of(sha256, rel)
        self._pin(name, size)
        downloads = self.downloads
        try:
            for _ in range(OPEN_TRIES):
                got = self._map(name, sha256, size, stream_limit)
                if got is None:
                    with self._entry_lock(name):
                        got = self._map(name, sha256, size, stream_limit)  # downloaded meanwhile by another process?
                        if got is None:
                            self._download(storage, rel, name, sha256, size)
                            with self._lock:
                                self._verified.add(name)
                            got = self._map(
                                name, sha256, size, stream_limit
                            )  # None: another process evicted it already
                if got is not None:
                    break
            else:
                raise CrossfeedError(
                    f"{storage.url(rel)}: downloaded into the cache {OPEN_TRIES} times and removed each time "
                    f"by another process before it could be opened; the processes sharing {self.root} need "
                    f"more room than cache_limit={self.limit}: raise it"
                )
        except BaseException:
            self.release(name)
            raise
        if self.downloads == downloads:  # (another thread's download meanwhile makes this a miss: rare, harmless)
            with self._lock:
                self.hits += 1
        self._evict()
        return self.path_of(name), got

    def fetch(self, storage, rel: str, sha256: str, size: int) -> str:
        """The local path of the shard (see `open`), pinned until `release`."""
        path, stream = self.open(storage, rel, sha256, size)
        if isinstance(stream, mmap.mmap):
            stream.close()
        return path

    def has(self, sha256: str, rel: str, size: int) -> bool:
        name = self.name_of(sha256, rel)
        with self._folder(name[:2], create=False) as fd:
            if fd is None:
                return False
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                return False
            return stat.S_ISREG(st.st_mode) and st.st_size == size

    def release(self, name_or_path: str) -> None:
        """Unpin an entry; the last pin gone, the cache is brought back under its limit (an
        eviction that ran while the entry was pinned had to pass it by)."""
        name = os.path.basename(name_or_path)
        with self._lock:
            n = self._pinned.get(name, 0) - 1
            if n > 0:
                self._pinned[name] = n
                return
            self._pinned.pop(name, None)
            self._pinned_sizes.pop(name, None)
            self._room.notify_all()
        with contextlib.suppress(OSError):  # a root gone meanwhile is reported by the next use
            self._evict()

    def _pin(self, name: str, size: int) -> None:
        with self._lock:
            self._pinned[name] = self._pinned.get(name, 0) + 1
            self._pinned_sizes[name] = size

    def holds(self, size: int) -> int:
        """How many entries of ``size`` bytes a reader may keep pinned at once (at least one): as
        many as fit the limit, so its window and the one download beside it stay within the limit
        plus one shard. Unbounded: as many as it likes."""
        if self.limit is None:
            return 1 << 62
        return max(1, self.limit // max(1, size))

    def room(self, besides: frozenset[str] | set[str] = frozenset()) -> int | None:
        """Bytes of ``limit`` not held by this process's pinned entries other than ``besides``
        (None: no limit): what downloads ahead of use may take without pushing the entries in
        use over the limit."""
        if self.limit is None:
            return None
        with self._lock:
            return self.limit - sum(n for name, n in self._pinned_sizes.items() if name not in besides)

    def _map(self, name: str, sha256: str, size: int, stream_limit: int | None = None):
        """The entry's stream, opened with ``O_NOFOLLOW`` and checked (a regular file of
        ``size`` bytes whose bytes hash to ``sha256``: hashed once per process — bit rot, a
        damaged disk or a hand-edited file are caught here), or None where it is missing or
        wrong (a wrong one is removed)."""
        with self._folder(name[:2], create=False) as folder:
            if folder is None:
                return None
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
            except OSError:  # missing, or a link (ELOOP): replaced by the download
                return None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                    return None
                buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else b""
                with self._lock:
                    verified = name in self._verified
                if not verified:
                    if hashlib.sha256(buf).hexdigest() != sha256:
                        log.warning(
                            "cache entry %s does not match its sha256; downloading it again", self.path_of(name)
                        )
                        self._remove(folder, name, st.st_ino)
                        return None
                    with self._lock:
                        self._verified.add(name)
                with contextlib.suppress(OSError):
                    os.utime(fd)  # last use, for LRU
            finally:
                os.close(fd)
        if name.endswith(".gz") or tfrecord.looks_gzip(bytes(buf[: tfrecord.HEADER])):
            view, at = memoryview(buf), 0

            def read(n: int) -> bytes:
                nonlocal at
                chunk = bytes(view[at : at + n])
                at += len(chunk)
                return chunk

            return b"".join(tfrecord.inflate(read, self.path_of(name), limit=stream_limit))
        return buf

    @staticmethod
    def _remove(folder: int, name: str, ino: int | None = None) -> int:
        """Remove the entry or temporary ``name`` of the folder ``folder`` (an fd): only a
        regular file (a link is never followed), only the inode ``ino`` when given; returns
        the bytes freed (0: nothing removed)."""
        try:
            st = os.stat(name, dir_fd=folder, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or (ino is not None and st.st_ino != ino):
                return 0
            os.unlink(name, dir_fd=folder)
        except OSError:
            return 0
        return st.st_size

    @contextlib.contextmanager
    def _entry_lock(self, name: str) -> Iterator[None]:
        with self._folder(_LOCKS, create=True) as locks:
            fd = os.open(name + ".lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=locks)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _download(self, storage, rel: str, name: str, sha256: str, size: int) -> None:
        """Download the entry ``name``, room made for it first: the unpinned entries its temporary
        file would push over the limit go before it grows (not after it is complete)."""
        with self._room:
            deadline = time.monotonic() + ROOM_WAIT
            self._waiting.add(name)
            try:
                while not self._fits(name) and (left := deadline - time.monotonic()) > 0:
                    self._room.wait(left)
            finally:
                self._waiting.discard(name)
            if not self._fits(name):
                log.warning(
                    "%s: no room under cache_limit=%d after %g s (the readers sharing this cache keep more "
                    "shards open than it holds); downloading %s anyway: raise cache_limit",
                    self.root,
                    self.limit,
                    ROOM_WAIT,
                    redact(storage.url(rel)),
                )
            self._downloading[name] = size
        try:
            self._evict()
            self._download_now(storage, rel, name, sha256, size)
        finally:
            with self._room:
                self._downloading.pop(name, None)
                self._room.notify_all()

    def _fits(self, name: str) -> bool:
        """(lock held) Whether one more download may start: the entries in use and the downloads
        in flight fit the limit, so this one is at most the one shard over it. Otherwise it waits
        for a pin or a download to end (at most `ROOM_WAIT`: readers that pin more than the limit
        holds, several sharing one cache, go over it rather than stall)."""
        if self.limit is None:
            return True
        busy = sum(self._downloading.values())
        used = sum(
            n
            for e, n in self._pinned_sizes.items()
            if e != name and e not in self._downloading and e not in self._waiting
        )
        return busy == 0 and used <= self.limit or used + busy <= self.limit

    def _download_now(self, storage, rel: str, name: str, sha256: str, size: int) -> None:
        where = storage.url(rel)
        with self._folder(name[:2], create=True) as folder:
            self._clean_temporaries(folder)  # type: ignore[arg-type]  # (create=True: never None)
            tmp = f"{_TMP}{os.getpid()}-{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder)
            try:
                try:
                    if storage.remote and size > self.chunk_bytes:
                        digest, got = self._download_ranges(storage, rel, fd, size)
                    else:
                        got = retrying(lambda: _download_whole(storage, rel, fd, size), where)
                        digest = _hash_fd(fd, got)  # a small shard: hashed back from the page cache
                finally:
                    os.close(fd)
                if got != size or digest.hexdigest() != sha256:
                    raise CorruptRecordError(
                        where,
                        0,
                        f"downloaded {got} bytes with sha256 {digest.hexdigest()[:16]}…, the "
                        f"manifest says {size} bytes and {sha256[:16]}…; the remote shard "
                        f"changed or is damaged",
                    )
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise
        with self._lock:
            self.downloads += 1
            self.downloaded_bytes += size
        log.debug("cached %s (%d bytes) as %s", redact(where), size, self.path_of(name))

    def _download_ranges(self, storage, rel: str, fd: int, size: int):
        """A large shard as ``chunk_bytes`` range requests, ``window`` of them in flight (on a pool
        of ``streams`` shared by every download): each request writes its bytes into the temporary
        file ``fd`` at their offset as soon as they land and lets them go, so memory holds only the
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
        return digest, got

    def _clean_temporaries(self, folder: int, older_than: float = 3600.0) -> None:
        """Remove temporary files (of the cache's own naming) of downloads whose process is gone
        (or that are very old) from the entry folder ``folder`` (an fd)."""
        now = time.time()
        with contextlib.suppress(OSError):
            for f in os.listdir(folder):
                m = _TEMPORARY.fullmatch(f)
                if m is None:
                    continue
                with contextlib.suppress(OSError):
                    st = os.stat(f, dir_fd=folder, follow_symlinks=False)
                    if not _alive(int(m.group(1))) or now - st.st_mtime > older_than:
                        self._remove(folder, f, st.st_ino)

    # -- size ------------------------------------------------------------------------------------
    def _folders(self) -> Iterator[tuple[str, int]]:
        """``(name, fd)`` of each entry folder (links and anything else are skipped, and said)."""
        with self._root_fd() as root:
            names = sorted(n for n in os.listdir(root) if _FOLDER.fullmatch(n))
        for sub in names:
            try:
                with self._folder(sub, create=False) as fd:
                    if fd is not None:
                        yield sub, fd
            except ConfigError as e:
                log.warning("%s; skipped", e)

    def entries(self) -> list[Entry]:
        """The cache's entries: regular files named by a sha256 in their folder (nothing else
        under the root is an entry, and no link is followed)."""
        out = []
        for sub, fd in self._folders():
            for f in os.listdir(fd):
                if not _ENTRY.fullmatch(f) or f[:2] != sub:
                    continue
                with contextlib.suppress(OSError):
                    st = os.stat(f, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        out.append(Entry(f, os.path.join(self.root, sub, f), st.st_size, st.st_mtime))
        return out

    def size(self) -> int:
        return sum(e.size for e in self.entries())

    def _evict(self) -> None:
        if self.limit is None:
            return
        with self._lock:  # the downloads in flight will take their size: room for them counts
            flight = sum(self._downloading.values())
        # listed after the downloads in flight were counted: one that ends meanwhile is renamed into
        # place before it leaves the count, so it is counted at least once (listed first, one that
        # ended between the listing and the count would be missed, and the cache run a shard over)
        entries = self.entries()
        total = sum(e.size for e in entries) + flight
        if total <= self.limit:
            return
        with self._lock:
            pinned = set(self._pinned)
        for e in sorted(entries, key=lambda e: e.last_used):
            if total <= self.limit:
                break
            if e.name in pinned:
                continue
            total -= self._unlink(e.name)

    def _unlink(self, name: str) -> int:
        with self._folder(name[:2], create=False) as fd:
            return 0 if fd is None else self._remove(fd, name)

    def prune(self, limit: int | str | None = None) -> int:
        """Remove least-recently-used entries until under ``limit`` (default: this cache's);
        returns the bytes freed."""
        before = self.size()
        saved, self.limit = self.limit, parse_size(limit, "cache_limit") if limit is not None else self.limit
        try:
            self._evict()
            for _, fd in self._folders():
                self._clean_temporaries(fd, older_than=0 if limit == 0 else 3600.0)
        finally:
            self.limit = saved
        return before - self.size()

    def clear(self) -> int:
        """Remove every entry (and the temporary files of finished downloads); returns the
        bytes freed."""
        freed = sum(self._unlink(e.name) for e in self.entries())
        for _, fd in self._folders():
            self._clean_temporaries(fd)
        return freed


def _ours(root: int, name: str) -> bool:
    """Whether ``name`` at the top of a cache directory is of the cache's own layout."""
    try:
        st = os.stat(name, dir_fd=root, follow_symlinks=False)
    except OSError:
        return True  # gone meanwhile
    if name == MARKER:
        return stat.S_ISREG(st.st_mode)
    return (name == _LOCKS or _FOLDER.fullmatch(name) is not None) and stat.S_ISDIR(st.st_mode)


def _download_whole(storage, rel: str, fd: int, size: int) -> int:
    os.ftruncate(fd, 0)  # a try before may have written part of it
    return storage.download_into(rel, fd, size)


def _hash_fd(fd: int, size: int):
    digest, at = hashlib.sha256(), 0
    while at < size:
        chunk = os.pread(fd, min(8 << 20, size - at), at)
        if not chunk:
            break
        digest.update(chunk)
        at += len(chunk)
    return digest


def _write_range(storage, rel: str, start: int, stop: int, fd: int, attempts: int = ATTEMPTS) -> int:
    """Bytes ``start:stop`` of a remote shard written into ``fd`` at ``start`` as they arrive
    (`Storage.write_range`): a finished chunk is never held in memory waiting for an earlier one.
    A request that failed transiently (a stall, a reset connection, a 5xx) is tried again after a
    short pause — one flaky request out of hundreds should not fail the shard; a missing file or
    wrong data is not."""
    where = storage.url(rel)
    got = retrying(lambda: storage.write_range(rel, start, stop, fd), where, attempts, what=f"bytes {start}-{stop - 1}")
    if got != stop - start:
        raise CorruptRecordError(
            where,
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
    queues ``(storage, rel, sha256, size)`` jobs not already cached or in flight.

    Once a download ahead fails (after its tries) or `close` is called, downloading ahead stops:
    queued jobs are dropped and each one in flight ends at its next request instead of trying
    again (`_Stoppable`), so a remote that fails does not keep the process busy (or from
    exiting) for everyone's tries; the reader fetches what it needs and reports the error."""

    def __init__(self, cache: ShardCache, workers: int = 4):
        self.cache = cache
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="crossfeed-prefetch")
        self._inflight: dict[str, tuple[Future, int]] = {}  # name → (download, size)
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def want(self, jobs) -> None:
        """Queue the jobs, in order, while the cache has room for them beside the entries in use
        and the downloads in flight (a job that does not fit is left to the reader, which
        fetches it when it needs it: a bounded cache stays within one shard of its limit)."""
        for storage, rel, sha256, size in jobs:
            if self._stopped.is_set():
                return
            name = self.cache.name_of(sha256, rel)
            with self._lock:
                self._inflight = {n: fs for n, fs in self._inflight.items() if not fs[0].done()}
                if name in self._inflight or self.cache.has(sha256, rel, size):
                    continue
                room = self.cache.room(besides=set(self._inflight))
                if room is not None and size + sum(n for _, n in self._inflight.values()) > room:
                    return
                self._inflight[name] = (self._pool.submit(self._one, storage, rel, sha256, size, name), size)

    def _one(self, storage, rel, sha256, size, name) -> None:
        if self._stopped.is_set():
            return
        room = self.cache.room()
        if room is not None and size > room:  # the reader's window took the room meanwhile: the reader fetches it
            return
        try:
            self.cache.release(self.cache.fetch(_Stoppable(storage, self._stopped), rel, sha256, size))
        except Exception as e:  # the reader fetches it again and reports the error where it is needed
            if not self._stopped.is_set():
                log.warning("prefetching %s failed: %s; downloading ahead stops", redact(storage.url(rel)), e)
                self.stop()

    def stop(self) -> None:
        """Stop downloading ahead: queued jobs are dropped, those in flight end at their next request."""
        self._stopped.set()
        with self._lock:
            for future, _size in self._inflight.values():
                future.cancel()

    def close(self) -> None:
        self.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)


class _Stoppable:
    """A storage for one download ahead: each request first checks `stopped`, and once it is set
    fails without trying again (a non-transient `RemoteError`), so a stopped `Prefetcher`'s
    downloads end at their next request."""

    def __init__(self, storage, stopped: threading.Event):
        self._storage, self._stopped = storage, stopped

    def __getattr__(self, name: str):
        return getattr(self._storage, name)

    def _check(self, rel: str) -> None:
        if self._stopped.is_set():
            raise RemoteError(self._storage.url(rel), "downloading ahead stopped", transient=False)

    def download_into(self, rel: str, fd: int, size: int) -> int:
        self._check(rel)
        return self._storage.download_into(rel, fd, size)

    def write_range(self, rel: str, start: int, stop: int, fd: int) -> int:
        self._check(rel)
        return self._storage.write_range(rel, start, stop, fd)
