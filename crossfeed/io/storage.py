"""Where a dataset's bytes live: a local directory (mmap) or any fsspec URL (range reads, or
whole shards when reading sequentially). Readers see one interface: `ShardFile`."""

from __future__ import annotations

import io
import mmap
import os
import threading
from collections.abc import Callable

from crossfeed.errors import CorruptRecordError, DatasetNotFoundError
from crossfeed.format import tfrecord


def is_remote(path) -> bool:
    s = os.fspath(path) if not isinstance(path, str) else path
    return "://" in s and not s.startswith("file://")


class Storage:
    """A dataset root. ``root`` is a local path, ``file://`` path or an fsspec URL."""

    def __init__(self, root):
        root = os.fspath(root)
        if root.startswith("file://"):
            root = root[len("file://") :]
        self.root = root.rstrip("/") if is_remote(root) else os.path.abspath(root)
        self.remote = is_remote(root)
        self._fs = None
        if self.remote:
            import fsspec

            self._fs, _ = fsspec.core.url_to_fs(self.root)

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}" if self.remote else os.path.join(self.root, rel)

    def read(self, rel: str) -> bytes:
        where = self.url(rel)
        try:
            if self.remote:
                return self._fs.cat_file(where)
            with open(where, "rb") as f:
                return f.read()
        except FileNotFoundError as e:
            raise DatasetNotFoundError(f"{where}: no such file") from e

    def download(self, rel: str, dest: str) -> None:
        """Copy the file to the local path ``dest`` (remote: one streamed transfer)."""
        where = self.url(rel)
        try:
            if self.remote:
                self._fs.get_file(where, dest)
            else:
                import shutil

                shutil.copyfile(where, dest)
        except FileNotFoundError as e:
            raise DatasetNotFoundError(
                f"{where}: shard file is missing; restore it or rebuild with `crossfeed index`"
            ) from e

    def open(self, rel: str):
        """A binary file object of ``rel``, read only (local, or fsspec's for a URL: reads are
        range requests): what a Parquet reader takes."""
        where = self.url(rel)
        try:
            return self._fs.open(where, "rb") if self.remote else open(where, "rb")
        except FileNotFoundError as e:
            raise DatasetNotFoundError(f"{where}: no such file") from e

    def read_range(self, rel: str, start: int, stop: int) -> bytes:
        return self._fs.cat_file(self.url(rel), start=start, end=stop)

    def write_range(self, rel: str, start: int, stop: int, fd: int, piece: int = 1 << 20) -> int:
        """Bytes ``start:stop`` of a remote file written into the file descriptor ``fd`` at
        ``start``; returns how many bytes the server sent (``stop - start``, more where it ignored
        the range: nothing past ``stop`` is written). HTTP(S) streams the response to the file in
        ``piece``-sized reads, so a request in flight holds a piece, not the whole range; other
        filesystems read the range whole first."""
        if not any(p in ("http", "https") for p in _protocols(self._fs)):
            return _pwrite_all(fd, self.read_range(rel, start, stop), start)
        headers = {**self._fs.kwargs.get("headers", {}), "Range": f"bytes={start}-{stop - 1}"}
        at = start
        with self._fs.open(self.url(rel), "rb", block_size=0, size=stop - start, headers=headers) as f:
            while at < stop:
                data = f.read(min(piece, stop - at))
                if not data:
                    return at - start
                at += _pwrite_all(fd, data, at)
            return stop - start + len(f.read(1))  # one byte more: the server ignored the range

    def size(self, rel: str) -> int:
        where = self.url(rel)
        try:
            return int(self._fs.size(where)) if self.remote else os.path.getsize(where)
        except FileNotFoundError as e:
            raise DatasetNotFoundError(
                f"{where}: shard file is missing; restore it or rebuild with `crossfeed index`"
            ) from e

    def shard(self, rel: str, *, stream_bytes: Callable[[], int] | None = None) -> ShardFile:
        return ShardFile(self, rel, stream_bytes=stream_bytes)


def _protocols(fs) -> tuple:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _pwrite_all(fd: int, data, at: int) -> int:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n
    return len(data)


class ShardFile:
    """One shard's uncompressed record stream, opened lazily.

    Local plain shards are memory-mapped, so a record is a zero-copy view. Remote plain shards
    are read by ranges, or whole with `load()`. GZIP shards are inflated whole on first use,
    at most ``stream_bytes()`` bytes: the stream length the shard's index declares (a GZIP bomb
    is refused with `CorruptRecordError`, not inflated into memory).
    """

    def __init__(self, storage: Storage, rel: str, *, stream_bytes: Callable[[], int] | None = None):
        self.storage = storage
        self.rel = rel
        self.stream_bytes = stream_bytes
        self.path = storage.url(rel)
        self._buf = None
        self._lock = threading.Lock()

    def load(self):
        """The whole uncompressed stream (mmap or bytes), opened once."""
        if self._buf is None:
            with self._lock:
                if self._buf is None:
                    self._buf = self._open()
        return self._buf

    def _open(self):
        st = self.storage
        if st.remote:
            data = st.read(self.rel)
            if tfrecord.is_gzip(self.rel) or tfrecord.looks_gzip(data[: tfrecord.HEADER]):
                data = b"".join(tfrecord.inflate(io.BytesIO(data).read, self.path, limit=self._limit()))
            return data
        if not os.path.exists(self.path):
            raise DatasetNotFoundError(
                f"{self.path}: shard file is missing; restore it or rebuild with `crossfeed index`"
            )
        if tfrecord.is_gzip(self.path):  # sniffed: adopted GZIP shards need not end in .gz
            return tfrecord.read_bytes(self.path, limit=self._limit())
        if os.path.getsize(self.path) == 0:
            return b""
        with open(self.path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def _limit(self) -> int | None:
        return None if self.stream_bytes is None else self.stream_bytes()

    def record(self, offset: int, length: int) -> memoryview:
        """The checked payload of the record framed at ``offset`` (``length`` from the index)."""
        if self._buf is None and self.storage.remote and not tfrecord.is_gzip(self.rel):
            data = self.storage.read_range(self.rel, offset, offset + length)
            try:
                return tfrecord.unframe(data, 0, length, self.path)
            except CorruptRecordError as e:
                raise CorruptRecordError(self.path, offset, e.reason) from None
        return tfrecord.unframe(self.load(), offset, length, self.path)

    def raw(self, offset: int, length: int) -> tuple:
        """``(buffer, base)``: a buffer holding the plain bytes ``[offset, offset + length)`` of
        the shard (tar samples: no framing) at ``offset - base`` — the loaded stream (``base``
        0), or one range read of a remote file not loaded whole (``base`` = ``offset``)."""
        if self._buf is None and self.storage.remote:
            return self.storage.read_range(self.rel, offset, offset + length), offset
        return self.load(), 0

    def close(self) -> None:
        buf, self._buf = self._buf, None
        if isinstance(buf, mmap.mmap):
            try:
                buf.close()
            except BufferError:
                pass  # arrays still view it; the mapping goes when they do
