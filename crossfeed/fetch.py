"""Fetch: global sample indices → checked record payloads (``list[memoryview]``).

Local plain shards are memory-mapped: offsets, lengths, both stored CRCs and the CRC of every
8-byte length header are gathered and checked with numpy for the whole batch at once; only the
payload CRC is one C call per record. Remote shards go through `ShardFile.record` (range reads)
or are loaded whole when the plan reads them sequentially.
"""

from __future__ import annotations

import threading

import numpy as np

import crc32c as _crc32c

from crossfeed import tfrecord
from crossfeed.dataset import Split
from crossfeed.errors import CorruptRecordError

_MASK_DELTA = np.uint32(0xA282EAD8)


def _table() -> np.ndarray:
    poly = 0x82F63B78
    t = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        t[i] = c
    return t


_TABLE = _table()


def crc32c_rows(rows: np.ndarray) -> np.ndarray:
    """CRC32C of each row of a small ``(n, k)`` uint8 array, vectorised over rows."""
    crc = np.full(len(rows), 0xFFFFFFFF, dtype=np.uint32)
    for j in range(rows.shape[1]):
        crc = _TABLE[(crc ^ rows[:, j]) & 0xFF] ^ (crc >> np.uint32(8))
    return crc ^ np.uint32(0xFFFFFFFF)


def mask(crc: np.ndarray) -> np.ndarray:
    crc = crc.astype(np.uint32)
    return ((crc >> np.uint32(15)) | (crc << np.uint32(17))) + _MASK_DELTA


def _gather(u8: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    return u8[starts[:, None] + np.arange(width)]


def check_frames(buf, offsets: np.ndarray, lengths: np.ndarray, path: str) -> list[memoryview]:
    """Payload views of the records at ``offsets`` of an in-memory stream, every CRC checked.

    Raises `CorruptRecordError` for the first bad record (by position in ``offsets``).
    """
    mv = memoryview(buf)
    u8 = np.frombuffer(buf, dtype=np.uint8)
    size = len(u8)
    bad_range = (offsets < 0) | (offsets + lengths > size) | (lengths < tfrecord.HEADER + tfrecord.FOOTER)
    if bad_range.any():
        i = int(np.argmax(bad_range))
        raise CorruptRecordError(path, int(offsets[i]), f"index entry of {int(lengths[i])} bytes runs past the end of the file ({size} bytes)")
    head = _gather(u8, offsets, 12)
    n = head[:, :8].copy().view("<u8").ravel()
    stored_len_crc = head[:, 8:12].copy().view("<u4").ravel()
    bad = mask(crc32c_rows(head[:, :8])) != stored_len_crc
    bad |= n + tfrecord.HEADER + tfrecord.FOOTER != lengths.astype(np.uint64)
    if bad.any():
        return _first_error(buf, offsets, lengths, path, bad)
    foot = _gather(u8, offsets + lengths - 4, 4).view("<u4").ravel()
    starts = (offsets + tfrecord.HEADER).tolist()
    stops = (offsets + lengths - tfrecord.FOOTER).tolist()
    payloads = [mv[a:b] for a, b in zip(starts, stops)]
    crcs = np.fromiter(map(_crc32c.crc32c, payloads), dtype=np.uint32, count=len(payloads))
    bad = mask(crcs) != foot
    if bad.any():
        return _first_error(buf, offsets, lengths, path, bad)
    return payloads


def _first_error(buf, offsets, lengths, path, bad) -> list:
    i = int(np.argmax(bad))
    tfrecord.unframe(buf, int(offsets[i]), int(lengths[i]), path)  # raises with the precise reason
    raise CorruptRecordError(path, int(offsets[i]), "record failed its checks")


class Fetcher:
    """Reads the records of a split by global index. Thread-safe: shards open once."""

    def __init__(self, split: Split, *, whole_shards: bool = False, keep_loaded: int | None = None):
        self.split = split
        self.whole_shards = whole_shards
        self.keep_loaded = keep_loaded  # remote whole shards held at once (block shuffle's window)
        self._loaded: list[int] = []
        self._lock = threading.Lock()

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(self.split.starts, indices, side="right") - 1
        return shard, indices - self.split.starts[shard]

    def fetch(self, indices: np.ndarray, *, on_error=None) -> list[memoryview | None]:
        """Payloads in the order of ``indices``. With ``on_error`` (a callable taking the
        CorruptRecordError), a bad record becomes None instead of raising."""
        shard, local = self.locate(np.asarray(indices, dtype=np.int64))
        out: list = [None] * len(indices)
        for s in np.unique(shard).tolist():
            pos = np.flatnonzero(shard == s)
            index = self.split.index(s)
            offs, lens = index[local[pos], 0], index[local[pos], 1]
            got = self._shard_records(s, offs, lens, on_error)
            for p, payload in zip(pos.tolist(), got):
                out[p] = payload
        return out

    def _shard_records(self, s: int, offs, lens, on_error) -> list:
        f = self.split.file(s)
        in_memory = not f.storage.remote or self.whole_shards or tfrecord.is_gzip(f.rel)
        if in_memory:
            buf = f.load()
            if f.storage.remote and self.keep_loaded:
                self._evict(s)
            try:
                return check_frames(buf, offs, lens, f.path)
            except CorruptRecordError:
                if on_error is None:
                    raise
            return [self._one(lambda o=o, n=n: tfrecord.unframe(buf, o, n, f.path), on_error) for o, n in zip(offs.tolist(), lens.tolist())]
        return [self._one(lambda o=o, n=n: f.record(o, n), on_error) for o, n in zip(offs.tolist(), lens.tolist())]

    def _evict(self, s: int) -> None:
        """Keep at most ``keep_loaded`` remote shards in memory (the oldest go first)."""
        with self._lock:
            if s in self._loaded:
                return
            self._loaded.append(s)
            while len(self._loaded) > self.keep_loaded:
                self.split.file(self._loaded.pop(0)).close()

    @staticmethod
    def _one(read, on_error):
        try:
            return read()
        except CorruptRecordError as e:
            if on_error is None:
                raise
            on_error(e)
            return None
