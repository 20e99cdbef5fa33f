"""Fetch: global sample indices → checked record payloads (``list[memoryview]``).

Local plain shards are memory-mapped: offsets, lengths, both stored CRCs and the CRC of every
8-byte length header are gathered and checked with numpy for the whole batch at once; only the
payload CRC is one C call per record. Remote shards go through `ShardFile.record` (range reads)
or are loaded whole when the plan reads them sequentially.

Small records of local shards also have a columnar path, `Fetcher.fetch_rows`: the framed
records of a batch are gathered as rows of one uint8 matrix (one numpy row-take per shard from a
sliding-window view of the mmap), headers and footers are checked column-wise, and each payload
CRC is one C call on a ``bytes`` row — no memoryview, slice or per-record index arithmetic in Python.
"""

from __future__ import annotations

import functools
import operator
import struct
import threading

import numpy as np

import crc32c as _crc32c

from crossfeed import tfrecord
from crossfeed.dataset import Split
from crossfeed.errors import CorruptRecordError

_MASK_DELTA = np.uint32(0xA282EAD8)
ROWS_MAX = 4096  # framed records at most this long take the columnar path (`Fetcher.fetch_rows`)


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


def check_frames(buf, offsets: np.ndarray, lengths: np.ndarray, path: str, *, payload_crcs: bool = True) -> list[memoryview]:
    """Payload views of the records at ``offsets`` of an in-memory stream, every CRC checked.

    Raises `CorruptRecordError` for the first bad record (by position in ``offsets``). With
    ``payload_crcs=False`` only the headers (lengths and their CRCs) are checked here: the
    caller checks the payloads itself with `frame_crcs` and `crc_ok` (`crossfeed.profile` does,
    to time reading and CRC checking apart).
    """
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
    # map over C callables: no Python bytecode runs per record
    payloads = list(map(memoryview(buf).__getitem__, map(slice, (offsets + tfrecord.HEADER).tolist(),
                                                          (offsets + lengths - tfrecord.FOOTER).tolist())))
    if payload_crcs:
        bad = ~crc_ok(payloads, frame_crcs(u8, offsets, lengths))
        if bad.any():
            return _first_error(buf, offsets, lengths, path, bad)
    return payloads


def frame_crcs(u8: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The masked payload CRCs stored in the footers of the records at ``offsets``."""
    return _gather(u8, offsets + lengths - 4, 4).view("<u4").ravel()


def crc_ok(payloads, stored: np.ndarray) -> np.ndarray:
    """Which payloads match their stored masked CRC32C (one C call per payload)."""
    crcs = np.fromiter(map(_crc32c.crc32c, payloads), dtype=np.uint32, count=len(payloads))
    return mask(crcs) == stored


def _window(u8: np.ndarray, width: int) -> np.ndarray:
    """Row ``k`` is ``u8[k : k + width]`` (a read-only strided view: no copy)."""
    return np.lib.stride_tricks.as_strided(u8, (len(u8) - width + 1, width), (1, 1), writeable=False)


@functools.lru_cache(maxsize=64)
def _len_crcs(lo: int, hi: int) -> np.ndarray:
    """The masked CRC of the length header of framed records of ``lo..hi`` bytes."""
    return np.array([tfrecord.masked_crc(struct.pack("<Q", n - tfrecord.HEADER - tfrecord.FOOTER)) for n in range(lo, hi + 1)],
                    dtype=np.uint32)


def _first_error(buf, offsets, lengths, path, bad) -> list:
    i = int(np.argmax(bad))
    tfrecord.unframe(buf, int(offsets[i]), int(lengths[i]), path)  # raises with the precise reason
    raise CorruptRecordError(path, int(offsets[i]), "record failed its checks")


class _NotInMemory(Exception):
    pass


def _reorder_crcs(parts: list) -> np.ndarray:
    n = sum(len(c) for _, c in parts)
    out = np.empty(n, dtype=np.uint32)
    for pos, c in parts:
        out[slice(None) if pos is None else pos] = c
    return out


class Fetcher:
    """Reads the records of a split by global index. Thread-safe: shards open once."""

    def __init__(self, split: Split, *, whole_shards: bool = False, keep_loaded: int | None = None):
        self.split = split
        self.whole_shards = whole_shards
        self.keep_loaded = keep_loaded  # remote whole shards held at once (block shuffle's window)
        self._loaded: list[int] = []
        self._index: np.ndarray | None = None  # see `_all_index`
        self._lock = threading.Lock()

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(self.split.starts, indices, side="right") - 1
        return shard, indices - self.split.starts[shard]

    def fetch(self, indices: np.ndarray, *, on_error=None) -> list[memoryview | None]:
        """Payloads in the order of ``indices``. With ``on_error`` (a callable taking the
        CorruptRecordError), a bad record becomes None instead of raising."""
        return self._fetch(indices, on_error, None)

    def fetch_deferred(self, indices: np.ndarray) -> tuple[list[memoryview], np.ndarray] | None:
        """``(payloads, stored_crcs)`` with only the record headers checked: the caller checks
        each payload against its masked CRC (`crc_ok`) and, on a mismatch, calls `fetch` for the
        exact error. None where the records are not all in memory (remote range reads)."""
        crcs: list = []
        try:
            payloads = self._fetch(indices, None, crcs)
        except _NotInMemory:
            return None
        return payloads, _reorder_crcs(crcs)

    def small_records(self) -> bool:
        """Whether the split's local records look small enough for `fetch_rows` (judged by its
        first shard's index)."""
        if not len(self.split.counts) or self.split.file(0).storage.remote:
            return False
        index = self.split.index(0)
        return bool(len(index)) and int(index[:, 1].max()) <= ROWS_MAX

    def fetch_rows(self, indices: np.ndarray) -> list[tuple[np.ndarray | None, np.ndarray]] | None:
        """The payloads of ``indices`` as ``[(positions, rows)]``, one entry per payload length:
        ``rows`` is a ``(g, length)`` uint8 matrix of the payloads at ``positions`` of
        ``indices`` (None: all of them, in order), every header and payload CRC checked.

        None when the columnar path does not apply (remote shards, records over `ROWS_MAX`
        bytes, lengths too varied) or any check failed: `fetch` then gives the exact error.
        """
        indices = np.asarray(indices, dtype=np.int64)
        shard, local = self.locate(indices)
        n = len(shard)
        if not n:
            return None
        s0 = int(shard[0])
        if shard[-1] == s0 and (shard == s0).all():
            parts = [(s0, None, local)]
        else:
            present = np.flatnonzero(np.bincount(shard, minlength=len(self.split.counts)))
            masks = [shard == s for s in present.tolist()]
            parts = [(s, m, local[m]) for s, m in zip(present.tolist(), masks)]
        bufs = []
        for s, _, _ in parts:
            f = self.split.file(s)
            if f.storage.remote:
                return None
            bufs.append(np.frombuffer(f.load(), dtype=np.uint8))
        if len(parts) == 1:
            index = self.split.index(s0)[local]
        else:  # one gather from the split's whole index instead of one per shard
            index = self._all_index()[indices]
        offs, lens = index[:, 0], index[:, 1]
        lo, hi = int(lens.min()), int(lens.max())
        if lo <= tfrecord.HEADER + tfrecord.FOOTER or hi > ROWS_MAX or hi - lo > 64:
            return None
        # framed records as rows of width hi (a shorter record's row runs on into the next bytes)
        rows = np.empty((n, hi), dtype=np.uint8)
        for (s, m, loc), u8 in zip(parts, bufs):
            o = offs if m is None else offs[m]
            size = len(u8)
            if size < hi or (o < 0).any() or (o + (lens if m is None else lens[m]) > size).any():
                return None  # let `fetch` name the record whose index entry runs past the end
            if int(o.max()) > size - hi:  # records near the end of the shard: clamp, then fix up
                got = _window(u8, hi)[np.minimum(o, size - hi)]
                for j in np.flatnonzero(o > size - hi).tolist():
                    got[j] = 0
                    got[j, : size - int(o[j])] = u8[int(o[j]):]
            else:
                got = _window(u8, hi)[o]
            if m is None:
                rows = got
            else:
                rows[m] = got
        # headers, column-wise: the length field matches the index, its CRC the length's
        if not (rows[:, :8].copy().view("<u8").ravel() == (lens - tfrecord.HEADER - tfrecord.FOOTER).astype(np.uint64)).all():
            return None
        if not (rows[:, 8:12].copy().view("<u4").ravel() == _len_crcs(lo, hi)[lens - lo]).all():
            return None
        if lo == hi:
            groups = [(None, rows)]
        else:
            present = np.flatnonzero(np.bincount(lens - lo)) + lo
            groups = [(pos, rows[pos]) for pos in (np.flatnonzero(lens == k) for k in present)]
        out = []
        for pos, framed in groups:
            k = int(lens[0 if pos is None else pos[0]])
            payload = framed[:, tfrecord.HEADER : k - tfrecord.FOOTER]
            # one C call per record, on bytes objects made in one C loop (a void view's tolist)
            crcs = np.fromiter(map(_crc32c.crc32c, payload.view(f"V{payload.shape[1]}")[:, 0].tolist()), dtype=np.uint32,
                               count=len(payload))
            if not (mask(crcs) == framed[:, k - tfrecord.FOOTER : k].copy().view("<u4").ravel()).all():
                return None
            out.append((pos, payload))
        return out

    def _all_index(self) -> np.ndarray:
        """``(N, 2)`` ``(offset, length)`` of every record of the split, by global index (built
        once, on the first batch that spans shards)."""
        if self._index is None:
            with self._lock:
                if self._index is None:
                    self._index = np.concatenate([self.split.index(s) for s in range(len(self.split.counts))])
        return self._index

    def _fetch(self, indices, on_error, crcs: list | None) -> list:
        shard, local = self.locate(np.asarray(indices, dtype=np.int64))
        if not len(shard):
            return []
        if shard[0] == shard[-1] and (shard == shard[0]).all():  # block / none shuffle: one shard
            return self._shard_records(int(shard[0]), local, on_error, crcs, None)
        order = np.argsort(shard, kind="stable")
        bounds = np.flatnonzero(np.diff(shard[order])) + 1
        flat: list = []
        for pos in np.split(order, bounds):
            flat += self._shard_records(int(shard[pos[0]]), local[pos], on_error, crcs, pos)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return list(operator.itemgetter(*inverse.tolist())(flat)) if len(flat) > 1 else flat

    def _shard_records(self, s: int, local, on_error, crcs: list | None, pos) -> list:
        index = self.split.index(s)
        offs, lens = index[local, 0], index[local, 1]
        f = self.split.file(s)
        in_memory = not f.storage.remote or self.whole_shards or tfrecord.is_gzip(f.rel)
        if crcs is not None and not in_memory:
            raise _NotInMemory
        if in_memory:
            buf = f.load()
            if f.storage.remote and self.keep_loaded:
                self._evict(s)
            try:
                got = check_frames(buf, offs, lens, f.path, payload_crcs=crcs is None)
                if crcs is not None:
                    crcs.append((pos, frame_crcs(np.frombuffer(buf, dtype=np.uint8), offs, lens)))
                return got
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
