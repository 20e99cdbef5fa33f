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

import operator
import threading

import numpy as np

import crc32c as _crc32c

from crossfeed.format import tfrecord
from crossfeed.read.dataset import Split
from crossfeed.errors import CorruptRecordError
from crossfeed.format.frames import check_frames, crc32c_rows, crc_ok, frame_crcs, gather, len_crcs, mask, window

ROWS_MAX = 4096  # framed records at most this long take the columnar path (`Fetcher.fetch_rows`)


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
                got = window(u8, hi)[np.minimum(o, size - hi)]
                for j in np.flatnonzero(o > size - hi).tolist():
                    got[j] = 0
                    got[j, : size - int(o[j])] = u8[int(o[j]):]
            else:
                got = window(u8, hi)[o]
            if m is None:
                rows = got
            else:
                rows[m] = got
        # headers, column-wise: the length field matches the index, its CRC the length's
        if not (rows[:, :8].copy().view("<u8").ravel() == (lens - tfrecord.HEADER - tfrecord.FOOTER).astype(np.uint64)).all():
            return None
        if not (rows[:, 8:12].copy().view("<u4").ravel() == len_crcs(lo, hi)[lens - lo]).all():
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
        if crcs is None:  # global shuffle: check the records of all shards together
            got = self._spread_records(shard, np.asarray(indices, dtype=np.int64))
            if got is not None:
                return got
        order = np.argsort(shard, kind="stable")
        bounds = np.flatnonzero(np.diff(shard[order])) + 1
        flat: list = []
        for pos in np.split(order, bounds):
            flat += self._shard_records(int(shard[pos[0]]), local[pos], on_error, crcs, pos)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return list(operator.itemgetter(*inverse.tolist())(flat)) if len(flat) > 1 else flat

    def _spread_records(self, shard: np.ndarray, indices: np.ndarray) -> list[memoryview] | None:
        """Payload views of records spread over several local shards, in the order of
        ``indices``, with every header and payload CRC checked in one pass for the whole batch
        (not one `check_frames` per shard). None where a shard is remote or any check fails:
        the per-shard path then reads the batch and reports (or skips) the exact bad record."""
        index = self._all_index()[indices]
        offs, lens = index[:, 0], index[:, 1]
        head = np.empty((len(indices), 12), dtype=np.uint8)
        foot = np.empty((len(indices), 4), dtype=np.uint8)
        views = []
        for s in np.unique(shard).tolist():
            f = self.split.file(s)
            if f.storage.remote:
                return None
            buf = f.load()
            u8 = np.frombuffer(buf, dtype=np.uint8)
            m = shard == s
            o, n = offs[m], lens[m]
            if (o < 0).any() or (o + n > len(u8)).any() or (n < tfrecord.HEADER + tfrecord.FOOTER).any():
                return None
            head[m] = gather(u8, o, 12)
            foot[m] = gather(u8, o + n - 4, 4)
            views.append(memoryview(buf))
        n = head[:, :8].copy().view("<u8").ravel()
        if not (n + tfrecord.HEADER + tfrecord.FOOTER == lens.astype(np.uint64)).all():
            return None
        if not (mask(crc32c_rows(head[:, :8])) == head[:, 8:12].copy().view("<u4").ravel()).all():
            return None
        # one view per record, by shard: map over C callables, no Python bytecode per record
        which = np.searchsorted(np.unique(shard), shard).tolist()
        payloads = list(map(memoryview.__getitem__, map(views.__getitem__, which),
                            map(slice, (offs + tfrecord.HEADER).tolist(), (offs + lens - tfrecord.FOOTER).tolist())))
        if not crc_ok(payloads, foot.view("<u4").ravel()).all():
            return None
        return payloads

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
