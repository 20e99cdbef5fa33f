"""TFRecord framing: the on-disk record format of TensorFlow, read and written without it.

A record is ``uint64 length | uint32 masked_crc32c(length) | payload | uint32 masked_crc32c(payload)``,
all little-endian. Every read checks both CRCs (C-accelerated ``crc32c``); a failure raises
`CorruptRecordError` naming the file and byte offset. GZIP files are the same stream, compressed
whole (what ``tf.io.TFRecordOptions(compression_type="GZIP")`` writes).
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import crc32c as _crc32c
import numpy as np

from crossfeed.errors import CorruptRecordError

HEADER = 12  # uint64 length + uint32 crc of the length
FOOTER = 4  # uint32 crc of the payload
_MASK_DELTA = 0xA282EAD8
_LEN = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<QI")


def mask(crc):
    """TensorFlow's ``crc32c::Mask`` of a CRC: a Python int, or a uint32 array element-wise."""
    if isinstance(crc, np.ndarray):
        crc = crc.astype(np.uint32, copy=False)
        return ((crc >> np.uint32(15)) | (crc << np.uint32(17))) + np.uint32(_MASK_DELTA)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def masked_crc(data) -> int:
    """The masked CRC32C that TFRecord stores."""
    return mask(_crc32c.crc32c(data))


def _crc_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> np.uint32(1)) ^ np.uint32(0x82F63B78), t >> np.uint32(1)).astype(np.uint32)
    return t


_TABLE = _crc_table()


def crc32c_rows(rows: np.ndarray) -> np.ndarray:
    """CRC32C of each row of a small ``(n, k)`` uint8 array, vectorised over rows (for the
    8-byte length headers of many records at once)."""
    c = np.full(len(rows), 0xFFFFFFFF, dtype=np.uint32)
    for j in range(rows.shape[1]):
        c = _TABLE[(c ^ rows[:, j]) & np.uint32(0xFF)] ^ (c >> np.uint32(8))
    return c ^ np.uint32(0xFFFFFFFF)


def frame(payload: bytes) -> bytes:
    """One framed record, ready to append to a shard."""
    length = _LEN.pack(len(payload))
    return b"".join((length, _U32.pack(masked_crc(length)), payload, _U32.pack(masked_crc(payload))))


GZIP_MAGIC = b"\x1f\x8b"
GZIP_ERRORS = (OSError, EOFError, zlib.error)  # what inflating damaged bytes raises (gzip.BadGzipFile is an OSError)


def looks_gzip(head: bytes) -> bool:
    """True when the first bytes of a file are a GZIP stream rather than a TFRecord header.

    A plain TFRecord can start with ``1f 8b`` too (a first record of length ``0x…8b1f``), so
    the GZIP magic only counts when the first 12 bytes are not a valid record header."""
    if head[:2] != GZIP_MAGIC:
        return False
    return len(head) < HEADER or masked_crc(head[:8]) != _U32.unpack_from(head, 8)[0]


def is_gzip(path: str | os.PathLike) -> bool:
    """Whether a shard is GZIP-compressed: sniffed from its first bytes when it is a local file
    (adopted shards need not end in ``.gz``), else from the ``.gz`` suffix of its name."""
    try:
        with open(path, "rb") as f:
            return looks_gzip(f.read(HEADER))
    except (OSError, TypeError, ValueError):
        return str(path).endswith(".gz")


def unframe(buf, offset: int, length: int | None, path: str) -> memoryview:
    """Check the record framed at ``buf[offset:]`` and return a view of its payload.

    ``length`` is the framed length from an index (header + payload + footer), or None when the
    caller does not know it. Raises `CorruptRecordError` naming ``path`` and ``offset``.
    """
    mv = memoryview(buf)
    end = len(mv)
    if offset < 0 or offset + HEADER > end:
        raise CorruptRecordError(path, offset, f"record header runs past the end of the data ({end} bytes)")
    n, len_crc = _HEAD.unpack_from(mv, offset)
    if masked_crc(mv[offset : offset + 8]) != len_crc:
        raise CorruptRecordError(path, offset, "length CRC mismatch (not a TFRecord file, or a damaged header)")
    if length is not None and HEADER + n + FOOTER != length:
        raise CorruptRecordError(
            path, offset, f"index says {length} bytes, the record header says {HEADER + n + FOOTER}"
        )
    start = offset + HEADER
    stop = start + n
    if stop + FOOTER > end:
        raise CorruptRecordError(
            path, offset, f"truncated: the record needs {n + HEADER + FOOTER} bytes, {end - offset} remain"
        )
    payload = mv[start:stop]
    if masked_crc(payload) != _U32.unpack_from(mv, stop)[0]:
        raise CorruptRecordError(path, offset, "payload CRC mismatch (damaged data)")
    return payload


def scan(buf, path: str) -> Iterator[tuple[int, int]]:
    """Walk a whole (uncompressed) TFRecord stream; yields ``(offset, framed_length)`` per record,
    checking every CRC. Raises `CorruptRecordError` at the first bad record, after yielding
    the good ones before it."""
    for offset, payload in records(buf, path):
        yield offset, HEADER + len(payload) + FOOTER


def records(buf, path: str, *, batch: int = 4096) -> Iterator[tuple[int, memoryview]]:
    """Walk a whole (uncompressed) TFRecord stream; yields ``(offset, payload_view)`` per record
    with both CRCs checked (zero-copy views into ``buf``).

    The fast path for sequential reads: record boundaries are found with one ``unpack_from``
    each, then the length CRCs of a batch of records are checked at once with numpy and the
    payload CRCs with one C call each; a bad record is re-checked by `unframe` for its error.
    """
    mv = memoryview(buf)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    end = len(mv)
    arr = np.frombuffer(mv, dtype=np.uint8) if end else np.zeros(0, np.uint8)
    unpack = _LEN.unpack_from
    crc = _crc32c.crc32c
    offset = 0
    while offset < end:
        offs: list[int] = []
        lens: list[int] = []
        while offset < end and len(offs) < batch:
            if offset + HEADER + FOOTER > end:
                break
            n = unpack(mv, offset)[0]
            if offset + HEADER + n + FOOTER > end:
                break
            offs.append(offset)
            lens.append(n)
            offset += HEADER + n + FOOTER
        short = offset < end and len(offs) < batch  # the record at `offset` does not fit
        good = len(offs)
        if good:
            o = np.array(offs, dtype=np.int64)
            ln = np.array(lens, dtype=np.int64)
            head = arr[o[:, None] + _ARANGE12]  # (n, 12): length bytes + their masked crc
            ok = mask(crc32c_rows(head[:, :8])) == head[:, 8:12].copy().view("<u4")[:, 0]
            bad = np.flatnonzero(~ok)
            if bad.size:
                good = int(bad[0])
            starts = (o[:good] + HEADER).tolist()
            stops = (o[:good] + HEADER + ln[:good]).tolist()
            sums = np.array([crc(mv[a:b]) for a, b in zip(starts, stops)], dtype=np.uint32)
            foot = arr[(o[:good] + HEADER + ln[:good])[:, None] + _ARANGE4].copy().view("<u4")[:, 0]
            bad = np.flatnonzero(mask(sums) != foot)
            if bad.size:
                good = int(bad[0])
            for i in range(good):
                yield offs[i], mv[starts[i] : stops[i]]
        if good < len(offs) or short:
            at = offs[good] if good < len(offs) else offset
            unframe(mv, at, None, path)  # raises the precise error for the bad record
            raise CorruptRecordError(path, at, "record failed its checks")  # unframe always raises first


_ARANGE12 = np.arange(HEADER, dtype=np.int64)
_ARANGE4 = np.arange(FOOTER, dtype=np.int64)


# A record of a GZIP stream read without an index (adoption, verify's slow path) is held whole
# before its CRC can be checked; past this size the shard must be decompressed to be indexed.
MAX_STREAMED_RECORD = 256 << 20
_INFLATE_BLOCK = 1 << 20


def inflate(read: Callable[[int], bytes], path: str, *, limit: int | None = None) -> Iterator[bytes]:
    """The inflated bytes of a GZIP stream (concatenated members and zero padding after them as
    ``gzip`` accepts), in chunks of at most 1 MiB read through ``read(n)``. Raises
    `CorruptRecordError` (its offset a position in the uncompressed stream) when the stream is
    damaged or truncated, or inflates past ``limit`` bytes (what an index declared), so a GZIP
    bomb costs at most ``limit`` bytes, or one chunk when streamed. Each round consumes input or
    yields output, or fails: the loop advances."""
    d = zlib.decompressobj(31)
    total, tail, started = 0, b"", False
    while True:
        if not tail:
            tail = read(_INFLATE_BLOCK)
            if not tail:
                if started and not d.eof:
                    raise CorruptRecordError(
                        path, total, "GZIP stream ends early (truncated file); the records after this offset are lost"
                    )
                return
        if d.eof:  # a member ended: zero padding, or another member
            tail = tail.lstrip(b"\0")
            if not tail:
                continue
            d, started = zlib.decompressobj(31), False
        before = len(tail)
        try:
            out = d.decompress(tail, _INFLATE_BLOCK)
        except zlib.error as e:
            raise CorruptRecordError(path, total, f"not a readable GZIP stream ({e})") from e
        started = True
        tail = d.unused_data if d.eof else d.unconsumed_tail
        if not out and len(tail) >= before and not d.eof:
            raise CorruptRecordError(path, total, "the GZIP stream makes no progress: it is damaged")
        total += len(out)
        if limit is not None and total > limit:
            raise CorruptRecordError(
                path,
                limit,
                f"the GZIP stream inflates past the {limit} bytes its index declares (a damaged shard, or a "
                f"decompression bomb); restore the shard or rebuild the index with `crossfeed index --force`",
            )
        if out:
            yield out


def read_bytes(path: str | os.PathLike, *, limit: int | None = None) -> bytes:
    """The uncompressed stream of a shard file (GZIP shards are inflated, refused past ``limit``
    bytes: the stream length the shard's index declares; see `inflate`)."""
    with open(path, "rb") as f:
        if is_gzip(path):
            return b"".join(inflate(f.read, str(path), limit=limit))
        return f.read()


def stream_records(chunks: Iterable[bytes], path: str) -> Iterator[tuple[int, bytes]]:
    """Walk an uncompressed TFRecord stream given as chunks (`inflate`'s) without holding it:
    yields ``(offset, payload)`` per record, both CRCs checked; memory is one record and one
    chunk. A record longer than `MAX_STREAMED_RECORD` is refused before it is read. Raises
    `CorruptRecordError` naming ``path`` and the record's offset."""
    it = iter(chunks)
    buf = bytearray()
    base = 0  # the stream offset of buf[0]

    def fill(n: int) -> bool:
        while len(buf) < n:
            chunk = next(it, None)
            if chunk is None:
                return False
            buf.extend(chunk)
        return True

    while fill(1):
        if not fill(HEADER):
            raise CorruptRecordError(path, base, f"record header runs past the end of the data ({len(buf)} bytes left)")
        n = _LEN.unpack_from(buf, 0)[0]
        if masked_crc(bytes(buf[:8])) != _U32.unpack_from(buf, 8)[0]:
            raise CorruptRecordError(path, base, "length CRC mismatch (not a TFRecord file, or a damaged header)")
        if n > MAX_STREAMED_RECORD:
            raise CorruptRecordError(
                path,
                base,
                f"a record of {n} bytes in a GZIP stream read without an index (at most {MAX_STREAMED_RECORD} "
                f"are held); decompress the shard (gunzip) and index it in place",
            )
        size = HEADER + n + FOOTER
        if not fill(size):
            raise CorruptRecordError(path, base, f"truncated: the record needs {size} bytes, {len(buf)} remain")
        payload = bytes(buf[HEADER : HEADER + n])
        if masked_crc(payload) != _U32.unpack_from(buf, HEADER + n)[0]:
            raise CorruptRecordError(path, base, "payload CRC mismatch (damaged data)")
        del buf[:size]  # CPython drops a bytearray's head without moving the rest
        yield base, payload
        base += size  # size >= 16: the walk advances


_OVERLAP = 1 << 20  # a write of at least this many bytes is hashed on another thread as it is written
_CRC_HOLDS_GIL = 32 << 20  # up to this many bytes, a CRC32C is taken without letting go of the GIL
_BEHIND = 32 << 20  # bytes of earlier writes whose sha256 may still be under way (held until it is done)


class _HashingFile:
    """A write-only file that hashes (sha256 and CRC32C) and counts what passes through it. A
    large write's sha256 runs on a thread of the file's own (it releases the GIL) while the bytes
    go to the file and the caller makes the next ones: up to `_BEHIND` bytes of earlier writes
    behind, all done at `close` (the hash is final then), where the thread ends."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.hash = hashlib.sha256()
        self.crc = 0
        self.size = 0
        self._hasher: ThreadPoolExecutor | None = None
        self._behind: collections.deque = collections.deque()  # (hash under way, its bytes), oldest first
        self._behind_bytes = 0

    def write(self, data) -> int:
        while self._behind and self._behind[0][0].done():
            self._settle_one()
        if len(data) >= _OVERLAP or self._behind:  # on the thread, after the hashes still under way there
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="crossfeed-sha256")
            held = data if type(data) is bytes else bytes(data)  # what the hash reads later: unchanged
            while self._behind and self._behind_bytes > _BEHIND:  # (this one's may run as it is written)
                self._settle_one()
            self._behind.append((self._hasher.submit(self.hash.update, held), len(held)))
            self._behind_bytes += len(held)
        else:  # nothing under way: a small write is hashed here, in order
            self.hash.update(data)
        # up to _CRC_HOLDS_GIL bytes (a few ms at ~10 GB/s) the CRC keeps the GIL: letting go of it can
        # cost as long again to get it back from the hashing and shard-finishing threads
        self.crc = _crc32c.crc32c(data, self.crc, 0 if len(data) <= _CRC_HOLDS_GIL else 1)
        self.size += len(data)
        return self._f.write(data)

    def _settle_one(self) -> None:
        done, size = self._behind.popleft()
        self._behind_bytes -= size
        done.result()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        try:
            while self._behind:
                self._settle_one()
        finally:
            if self._hasher is not None:
                self._hasher.shutdown()
                self._hasher = None
            self._f.close()


def frame_many(payloads: list) -> tuple[bytes, np.ndarray]:
    """``payloads`` (bytes-like) framed as TFRecords, concatenated, and each framed record's size
    (int64): the length headers and their CRCs computed with numpy, the payload CRCs one C call
    each — the bytes `frame` gives one record at a time."""
    n = len(payloads)
    lens = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
    head = np.empty((n, HEADER), dtype=np.uint8)
    head[:, :8] = lens.astype("<u8").view(np.uint8).reshape(n, 8)
    head[:, 8:] = mask(crc32c_rows(head[:, :8])).astype("<u4").view(np.uint8).reshape(n, 4)
    foot = mask(np.fromiter(map(_crc32c.crc32c, payloads), dtype=np.uint32, count=n)).astype("<u4")
    pieces: list = [b""] * (3 * n)
    pieces[0::3] = head.view(f"V{HEADER}").ravel().tolist()
    pieces[1::3] = payloads
    pieces[2::3] = foot.view(f"V{FOOTER}").tolist()
    return b"".join(pieces), lens + (HEADER + FOOTER)


class RecordWriter:
    """Appends framed records to one shard file and remembers each record's ``(offset, length)``
    in the uncompressed stream, for the index file."""

    def __init__(self, path: str | os.PathLike, *, compress: bool = False):
        self.path = str(path)
        raw = _HashingFile(open(self.path, "wb"))
        self._raw = raw
        # mtime=0 keeps GZIP output byte-identical from run to run.
        self._f: gzip.GzipFile | _HashingFile = (
            gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) if compress else raw
        )
        self.offsets: list[tuple[int, int]] = []
        self._pos = 0

    def write(self, payload: bytes) -> None:
        rec = frame(payload)
        self._f.write(rec)
        self.offsets.append((self._pos, len(rec)))
        self._pos += len(rec)

    def write_many(self, payloads: list) -> None:
        """`write` of each of ``payloads`` (bytes-like) in order, framed as a batch — the same
        bytes: the length headers and their CRCs computed with numpy, the payload CRCs one C call
        each, and one write of the whole batch."""
        if payloads:
            self.write_framed(*frame_many(payloads))

    def write_framed(self, data, sizes: np.ndarray) -> None:
        """Write ``data``, records already framed (`frame_many`) whose framed sizes are
        ``sizes``, in one write: the same bytes and index as `write_many` of their payloads."""
        if not len(sizes):
            return
        self._f.write(data)
        ends = np.cumsum(sizes, dtype=np.int64) + self._pos
        self.offsets.extend(zip((ends - sizes).tolist(), np.asarray(sizes, dtype=np.int64).tolist()))
        self._pos = int(ends[-1])

    @property
    def num_bytes(self) -> int:
        """Bytes written to the file (compressed size for GZIP); final after `close`."""
        return self._raw.size

    @property
    def sha256(self) -> str:
        """Hex sha256 of the file's bytes; final after `close`."""
        return self._raw.hash.hexdigest()

    @property
    def crc32c(self) -> int:
        """CRC32C of the file's bytes (unmasked); final after `close`."""
        return self._raw.crc

    def close(self) -> None:
        if self._f is not self._raw:
            self._f.close()
        self._raw.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
