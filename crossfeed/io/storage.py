"""Where a dataset's bytes live: a local directory (mmap) or any fsspec URL (range reads, or
whole shards when reading sequentially). Readers see one interface: `ShardFile`.

Every remote read is bounded twice. In size: a caller says how many bytes it expects at most (the
manifest's size of a shard, the range asked for, what a manifest or index may hold) and no more
are ever read — a server that sends more, or declares more in ``Content-Length``, is an error,
not a buffer that grows. In time: the bytes arrive in pieces of `PIECE` and each piece (and the
request's headers) must come within the read deadline, ``read_timeout`` seconds (default
`READ_TIMEOUT`, or ``$CROSSFEED_READ_TIMEOUT``); a stall cancels the request and raises
`RemoteError` naming the URL. Backends that are not asynchronous (fsspec's sync filesystems) are
bounded in size only. Whatever a backend raises (botocore, aiohttp, …) leaves here as a
`CrossfeedError`: `RemoteError`, or `FileNotFoundError` for a missing file.

How a URL is reached (an endpoint, credentials, a region, HTTP headers) is fsspec's own
``storage_options``, handed to ``fsspec.core.url_to_fs`` as they are given (`FsOptions`); what
they leave out the backend takes from the standard environment and config files (s3fs/botocore:
``AWS_*``, ``~/.aws``; gcsfs: ``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's). See docs/storage.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import mmap
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from crossfeed.errors import (
    ConfigError,
    CorruptRecordError,
    CrossfeedError,
    DatasetNotFoundError,
    ManifestError,
    MissingExtraError,
    RemoteError,
)
from crossfeed.format import tfrecord
from crossfeed.format.manifest import plain_segment

TIMEOUT_ENV = "CROSSFEED_READ_TIMEOUT"
READ_TIMEOUT = 60.0  # seconds a remote request may take to answer, and each piece of its body to arrive
PIECE = 1 << 20  # bytes: the unit of progress a remote read must make within the deadline
ATTEMPTS = 3  # tries of a remote read that failed transiently (a stall, a reset, a 5xx)
# What a file name keeps unquoted in an HTTP(S) URL: RFC 3986's path-segment characters ('?', '#',
# '%', '/' and spaces are quoted)
_SEGMENT_SAFE = "!$&'()*+,;=:@~"


def is_remote(path) -> bool:
    s = os.fspath(path) if not isinstance(path, str) else path
    return "://" in s and not s.startswith("file://")


def read_deadline(value: float | int | str | None = None) -> float:
    """The read deadline in seconds: ``value``, else ``$CROSSFEED_READ_TIMEOUT``, else
    `READ_TIMEOUT`; a positive number of seconds up to a day, written in plain digits."""
    where = "read_timeout"
    if value is None:
        value = os.environ.get(TIMEOUT_ENV) or None
        where = f"${TIMEOUT_ENV}"
        if value is None:
            return READ_TIMEOUT
    if isinstance(value, str):
        if not re.fullmatch(r"[0-9]{1,6}(\.[0-9]{1,6})?", value):
            raise ConfigError(f"{where}: {value!r} is not a number of seconds; use e.g. 60 or 2.5")
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: {value!r} is not a number of seconds; use e.g. 60 or 2.5")
    if not 0 < value <= 86400:
        raise ConfigError(f"{where}: {value:g} s is out of range; use a deadline above 0 and at most 86400 s")
    return float(value)


_SECRET = ("secret", "key", "token", "password", "credential", "session")


class FsOptions(Mapping):
    """fsspec ``storage_options``, frozen: str keys, JSON values (``{"endpoint_url": …,
    "client_kwargs": {"region_name": …}}``). Hashable and compared by value, so a frozen options
    object can hold it; every read gives fresh copies (``dict(o)``, `to_dict`), so nothing can
    change it. Its repr hides the values of secret-looking keys (it ends up in logs)."""

    __slots__ = ("_json", "_keys")
    _json: str
    _keys: tuple[str, ...]

    def __init__(self, value: Mapping | None = None, *, where: str = "storage_options"):
        if isinstance(value, FsOptions):
            self._json, self._keys = value._json, value._keys
            return
        value = {} if value is None else value
        example = "e.g. {'endpoint_url': 'http://127.0.0.1:9000'}"
        if not isinstance(value, Mapping) or not all(isinstance(k, str) and k for k in value):
            raise ConfigError(f"{where} must be a dict of fsspec options with str keys ({example}), got {value!r:.80}")
        try:
            self._json = json.dumps(dict(value), sort_keys=True, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"{where}: each value must be a JSON value (string, number, boolean, null, list or dict "
                f"with str keys) ({e}); {example}"
            ) from None
        self._keys = tuple(sorted(value))

    def to_dict(self) -> dict:
        """The options as a new plain dict (JSON values): what ``url_to_fs`` is given."""
        return json.loads(self._json)

    def __getitem__(self, key: str):
        return self.to_dict()[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __eq__(self, other) -> bool:
        if isinstance(other, FsOptions):
            return self._json == other._json
        return isinstance(other, Mapping) and self.to_dict() == dict(other)

    def __hash__(self) -> int:
        return hash(self._json)

    def __repr__(self) -> str:
        return f"FsOptions({_masked(self.to_dict())!r})"


def join_url(root: str, name: str) -> str:
    """``root/name`` for a remote ``root``; over HTTP(S) ``name`` is percent-quoted first (a
    file name, not URL syntax: ``a#b`` → ``a%23b``, ``a b`` → ``a%20b``, ``%`` → ``%25``)."""
    if _is_http(root):
        name = urllib.parse.quote(name, safe=_SEGMENT_SAFE)
    return f"{root}/{name}"


def _is_http(url: str) -> bool:
    return url.split("://", 1)[0].lower() in ("http", "https")


def filesystem(url: str, storage_options: Mapping | None = None):
    """The fsspec filesystem of ``url``, made with ``storage_options`` (`FsOptions`). Over HTTP(S)
    its client follows a redirect only within the origin it was sent to (the same scheme, host
    and port): a redirect elsewhere is a `RemoteError` naming both origins, so a server cannot
    hand a dataset's reads to another host, around the roots a dataset is confined to
    (`crossfeed.io.roots`)."""
    import fsspec

    options = FsOptions(storage_options).to_dict()
    if _is_http(url):
        options["get_client"] = _same_origin_client
    return fsspec.core.url_to_fs(url, **options)[0]


def origin(url) -> str:
    """``scheme://host:port`` of a URL (a str or ``yarl.URL``), its userinfo left out."""
    import yarl

    u = url if isinstance(url, yarl.URL) else yarl.URL(str(url))
    return f"{(u.scheme or '').lower()}://{(u.host or '').lower()}:{u.port}"


async def _same_origin_client(**kwargs):
    """fsspec's HTTP client session (``get_client``) with `_refuse_other_origins` on every redirect."""
    import aiohttp
    from fsspec.implementations.http import get_client

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(_refuse_other_origins)
    kwargs["trace_configs"] = [*kwargs.get("trace_configs", ()), trace]
    return await get_client(**kwargs)


async def _refuse_other_origins(session, context, params) -> None:
    import yarl

    here = params.url
    try:
        there = here.join(yarl.URL(params.response.headers.get("Location", "")))
    except ValueError:
        there = None
    if there is None or origin(there) != origin(here):
        to = "an unreadable Location" if there is None else origin(there)
        raise RemoteError(
            str(here),
            f"the server redirects to another origin, {to} (from {origin(here)}); crossfeed follows redirects only "
            f"within the origin it asked, so a server cannot send its reads elsewhere: use the final URL itself "
            f"(and allow its root where it lies outside the dataset)",
            transient=False,
        )


def _masked(value):
    if isinstance(value, dict):
        return {
            k: "***" if any(s in k.lower() for s in _SECRET) and v is not None else _masked(v) for k, v in value.items()
        }
    return value


class Storage:
    """A dataset root. ``root`` is a local path, ``file://`` path or an fsspec URL; remote reads
    have the deadline ``read_timeout`` (see the module docstring) and reach the URL with fsspec's
    ``storage_options`` (`FsOptions`: an endpoint, credentials …; unused for a local root)."""

    def __init__(self, root, *, read_timeout: float | int | str | None = None, storage_options: Mapping | None = None):
        self.storage_options = FsOptions(storage_options)
        root = os.fspath(root)
        if root.startswith("file://"):
            root = root[len("file://") :]
        self.root = root.rstrip("/") if is_remote(root) else os.path.abspath(root)
        self.remote = is_remote(root)
        self.read_timeout = read_deadline(read_timeout)
        self._fs: Any = None  # fsspec's filesystem, for a URL
        if self.remote:
            try:
                self._fs = filesystem(self.root, self.storage_options)
            except (ImportError, ValueError) as e:  # an unknown protocol, or its package not installed
                if isinstance(e, ImportError) and self.root.split("://")[0].lower() in ("http", "https"):
                    raise MissingExtraError(f"{self.root}: reading over HTTP", "aiohttp") from None
                raise ConfigError(
                    f"{self.root}: cannot open this URL ({type(e).__name__}: {e}); install the fsspec "
                    f"backend for its protocol (s3fs, gcsfs, adlfs, aiohttp) or check the URL"
                ) from e
            except TypeError as e:  # an option the backend does not take
                raise ConfigError(
                    f"{self.root}: the backend refused storage_options {self.storage_options!r} ({e}); pass "
                    f"only the options of its fsspec filesystem (see docs/storage.md)"
                ) from e

    def url(self, rel: str) -> str:
        """``rel`` (a plain file name: the manifest's names are checked) inside the root; a name
        that is not one path segment, even percent-decoded, never joins a URL (``%2e%2e``). Over
        HTTP(S) the name is percent-quoted as it joins: ``a#b`` is fetched as ``a#b`` (``a%23b``),
        never as ``a`` with a fragment (``?``, ``%``, spaces likewise)."""
        if not self.remote:
            return os.path.join(self.root, rel)
        if not plain_segment(rel):
            raise ManifestError(f"{self.root}: {rel!r} is not a plain file name; a URL join would leave the root")
        return join_url(self.root, rel)

    def read(self, rel: str, *, limit: int, too_long: Callable[[int], Exception] | None = None) -> bytes:
        """The whole file ``rel``, at most ``limit`` bytes: a longer one raises ``too_long(n)``
        (``n`` the size seen or declared; default a `RemoteError`) without being read past it."""
        where = self.url(rel)
        too_long = too_long or _too_long(where, limit)
        try:
            if self.remote:
                data = b"".join(self._pieces(rel, 0, None, limit=limit, too_long=too_long))
            else:
                with open(where, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size > limit:  # a regular file says its size: refused before a byte is read
                        raise too_long(size)
                    data = _read_bounded(f, limit, too_long)
            return data
        except FileNotFoundError as e:
            raise DatasetNotFoundError(f"{where}: no such file") from e

    def download_into(self, rel: str, fd: int, size: int) -> int:
        """The file ``rel`` written into ``fd`` from byte 0, one streamed transfer; returns the
        bytes written. More than ``size`` bytes is a `CorruptRecordError` (nothing past ``size``
        is written)."""
        where = self.url(rel)

        def too_long(n: int) -> Exception:
            return CorruptRecordError(where, 0, f"the server sent or declared {n} bytes, the manifest says {size}")

        try:
            if not self.remote:
                with open(where, "rb") as f:
                    return _pwrite_pieces(fd, iter(lambda: f.read(PIECE), b""), 0, size, too_long)
            return _pwrite_pieces(fd, self._pieces(rel, 0, None, limit=size, too_long=too_long), 0, size, too_long)
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
        """Bytes ``start:stop`` of ``rel`` (fewer where the file ends first); a server that sends
        more (it ignored the range) is a `CorruptRecordError`."""
        if not self.remote:
            with open(self.url(rel), "rb") as f:
                f.seek(start)
                return f.read(stop - start)
        return b"".join(self._pieces(rel, start, stop, limit=stop - start, too_long=self._ignored(rel, start, stop)))

    def write_range(self, rel: str, start: int, stop: int, fd: int) -> int:
        """Bytes ``start:stop`` of a remote file written into the file descriptor ``fd`` at
        ``start`` as they arrive (a request in flight holds a `PIECE`, not the whole range);
        returns how many bytes the server sent. More than asked (it ignored the range) is a
        `CorruptRecordError`, and nothing past ``stop`` is written."""
        too_long = self._ignored(rel, start, stop)
        return _pwrite_pieces(
            fd, self._pieces(rel, start, stop, limit=stop - start, too_long=too_long), start, stop - start, too_long
        )

    def size(self, rel: str) -> int:
        where = self.url(rel)
        try:
            if not self.remote:
                return os.path.getsize(where)
            if getattr(self._fs, "async_impl", False):
                return int(self._call(self._fs._size(where), where))
            return int(self._fs.size(where))
        except FileNotFoundError as e:
            raise DatasetNotFoundError(
                f"{where}: shard file is missing; restore it or rebuild with `crossfeed index`"
            ) from e

    def shard(
        self, rel: str, *, size: int | None = None, buffer=None, stream_bytes: Callable[[], int] | None = None
    ) -> ShardFile:
        return ShardFile(self, rel, size=size, buffer=buffer, stream_bytes=stream_bytes)

    # -- remote reads, bounded in size and time ------------------------------------------------
    def _ignored(self, rel: str, start: int, stop: int) -> Callable[[int], Exception]:
        where = self.url(rel)

        def too_long(n: int) -> Exception:
            return CorruptRecordError(
                where,
                start,
                f"asked for bytes {start}-{stop - 1}, the server sent or declared {n} bytes; the "
                f"server ignored the range or the remote file changed",
            )

        return too_long

    def _pieces(
        self, rel: str, start: int, stop: int | None, *, limit: int, too_long: Callable[[int], Exception]
    ) -> Iterator[bytes]:
        """The bytes ``start:stop`` of remote ``rel`` (``stop`` None: to its end, fetched without
        a range) in pieces of at most `PIECE`, each within the read deadline; past ``limit``
        bytes (or a larger ``Content-Length``) raises ``too_long(n)`` before yielding them."""
        where = self.url(rel)
        if any(p in ("http", "https") for p in _protocols(self._fs)):
            yield from self._http_pieces(where, start, stop, limit, too_long)
            return
        if stop is None:  # whole file: its size first, checked against the limit
            with contextlib.suppress(Exception):  # the size now, not a listing's from before a rewrite
                self._fs.invalidate_cache(where)
            stop = self.size(rel)
            if stop - start > limit:
                raise too_long(stop - start)
        at = start
        with contextlib.ExitStack() as stack:
            f = None
            if not getattr(self._fs, "async_impl", False):  # sync backends: bounded in size only
                f = stack.enter_context(self._fs.open(where, "rb"))
                f.seek(start)
            while at < stop:
                want = min(PIECE, stop - at)
                if f is not None:
                    data = f.read(want)
                else:
                    data = self._call(self._fs._cat_file(where, start=at, end=at + want), where)
                if len(data) > want:
                    raise too_long(at - start + len(data))
                if not data:
                    return
                at += len(data)
                yield data

    def _http_pieces(self, where: str, start: int, stop: int | None, limit: int, too_long) -> Iterator[bytes]:
        fs = self._fs
        kw = dict(fs.kwargs)
        headers = dict(kw.pop("headers", None) or {})
        if stop is not None:
            headers["Range"] = f"bytes={start}-{stop - 1}"

        async def get():
            session = await fs.set_session()
            return await session.get(fs.encode_url(where), headers=headers, **kw)

        r = self._call(get(), where)
        try:
            if r.status in (404, 410):
                raise FileNotFoundError(where)
            if r.status == 416:  # a range past the end: nothing there
                return
            if r.status >= 400:
                raise RemoteError(
                    where,
                    f"the server answered HTTP {r.status} {r.reason}",
                    transient=r.status >= 500 or r.status == 429,
                )
            if stop is not None and start > 0 and r.status != 206:
                raise too_long(r.content_length if r.content_length is not None else limit + 1)
            if r.content_length is not None and r.content_length > limit:
                raise too_long(r.content_length)
            got = 0
            while True:
                data = self._call(_read_piece(r.content, min(PIECE, limit + 1 - got)), where)
                if not data:
                    return
                got += len(data)
                if got > limit:
                    raise too_long(got)
                yield data
        finally:
            fs.loop.call_soon_threadsafe(r.release if r.content.at_eof() else r.close)

    def _call(self, coro, where: str):
        """Run ``coro`` on fsspec's event loop and wait for it at most the read deadline; a stall
        cancels it. Backend errors become `RemoteError` (a missing file stays FileNotFoundError)."""
        t = self.read_timeout
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, t), self._fs.loop)
        try:
            return fut.result(t + 5)  # the inner deadline fires first; this one is a backstop
        except TimeoutError as e:
            fut.cancel()
            raise RemoteError(
                where,
                f"no progress within the read deadline of {t:g} s (fewer than {PIECE >> 20} MiB, or no "
                f"answer); the server stalls or the link is too slow: check it, or raise the deadline "
                f"(read_timeout, ${TIMEOUT_ENV})",
            ) from e
        except (FileNotFoundError, CrossfeedError):
            raise
        except PermissionError as e:
            raise RemoteError(where, f"access denied ({e}); check the credentials", transient=False) from e
        except BaseException as e:
            fut.cancel()
            if not isinstance(e, Exception):
                raise
            raise RemoteError(where, f"cannot read it ({type(e).__name__}: {e})") from e


def retrying(read: Callable[[], object], where: str, attempts: int = ATTEMPTS, *, what: str = "it"):
    """``read()``, tried again after a short pause when it fails transiently (a stall, a reset
    connection, a 5xx: a `RemoteError` with ``transient``); the last failure is a `RemoteError`
    saying how many tries were made. Data that is wrong (`CorruptRecordError`), a missing file or
    a denied one is not tried again."""
    for attempt in range(attempts):
        try:
            return read()
        except RemoteError as e:
            if not e.transient:
                raise
            if attempt == attempts - 1:
                raise RemoteError(
                    where,
                    f"{what} could not be downloaded in {attempts} tries (last: {e.reason}); check the server or the network and rerun",
                ) from e
            time.sleep(0.1 * 2**attempt)
    raise ConfigError(f"attempts must be >= 1, got {attempts}")


def _read_bounded(f, limit: int, too_long: Callable[[int], Exception]) -> bytes:
    """The rest of the binary file ``f``, at most ``limit`` bytes, read in pieces of `PIECE`: the
    memory taken grows with the bytes that come, never with the ``limit`` a file declared (one
    ``f.read(limit + 1)`` allocates ``limit`` bytes first); more raises ``too_long(n)``."""
    parts: list[bytes] = []
    got = 0
    while True:
        data = f.read(min(PIECE, limit + 1 - got))
        if not data:
            return b"".join(parts)
        got += len(data)
        if got > limit:
            raise too_long(got)
        parts.append(data)


def _too_long(where: str, limit: int) -> Callable[[int], Exception]:
    def make(n: int) -> Exception:
        return RemoteError(where, f"{n} bytes or more, more than the {limit} expected here", transient=False)

    return make


async def _read_piece(content, n: int) -> bytes:
    """Up to ``n`` bytes of a response body: fewer only at its end (a trickle does not count as
    progress until a whole piece has come)."""
    parts, got = [], 0
    while got < n:
        data = await content.read(n - got)
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def _protocols(fs) -> tuple:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _pwrite_pieces(fd: int, pieces, at: int, limit: int, too_long) -> int:
    """Write ``pieces`` into ``fd`` from ``at``; more than ``limit`` bytes raises ``too_long``."""
    got = 0
    with contextlib.closing(pieces) if hasattr(pieces, "close") else contextlib.nullcontext():
        for data in pieces:
            if got + len(data) > limit:
                raise too_long(got + len(data))
            _pwrite_all(fd, data, at + got)
            got += len(data)
    return got


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

    def __init__(
        self,
        storage: Storage,
        rel: str,
        *,
        size: int | None = None,
        buffer=None,
        stream_bytes: Callable[[], int] | None = None,
    ):
        self.storage = storage
        self.rel = rel
        self.stream_bytes = stream_bytes
        self.path = storage.url(rel)
        self.size = size  # bytes, as the manifest declares: a remote read takes no more
        self._buf = buffer  # given: already open (a cache entry mapped by `crossfeed.io.cache`)
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
            size = st.size(self.rel) if self.size is None else self.size

            def too_long(n: int) -> Exception:
                return CorruptRecordError(
                    self.path, size, f"the server sent or declared {n} bytes, the manifest says {size}"
                )

            data = retrying(lambda: st.read(self.rel, limit=size, too_long=too_long), self.path)
            if len(data) != size:
                raise CorruptRecordError(
                    self.path, len(data), f"the file ended after {len(data)} bytes, the manifest says {size}"
                )
            if tfrecord.is_gzip(self.rel) or tfrecord.looks_gzip(data[: tfrecord.HEADER]):
                data = b"".join(tfrecord.inflate(io.BytesIO(data).read, self.path, limit=self.stream_limit()))
            return data
        if not os.path.exists(self.path):
            raise DatasetNotFoundError(
                f"{self.path}: shard file is missing; restore it or rebuild with `crossfeed index`"
            )
        if tfrecord.is_gzip(self.path):  # sniffed: adopted GZIP shards need not end in .gz
            return tfrecord.read_bytes(self.path, limit=self.stream_limit())
        if os.path.getsize(self.path) == 0:
            return b""
        with open(self.path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def stream_limit(self) -> int | None:
        """The uncompressed stream length this shard's index declares (None: unknown): what a
        GZIP shard may inflate to."""
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
