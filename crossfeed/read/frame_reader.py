"""Stage 2 of the read pipeline: global sample indices → `Frames`, the checked payloads of a batch.

Local shards are memory-mapped (GZIP shards inflated once, remote shards loaded whole when the
plan reads them sequentially); every record's header and payload CRC is checked for the whole
batch at once with the one checker, `crossfeed.format.frames`. Two forms of the same payloads:

* **views** — one zero-copy ``memoryview`` per record (big records, images, mixed layouts);
* **rows** — small records of similar length gathered as the rows of uint8 matrices, one matrix
  per payload length, for the decoder's columnar path (one numpy row-take per shard from a
  sliding-window view of the mmap; no per-record Python).

The form is chosen once per Loader (`rows=True` when the decoder is columnar and the records are
small); a batch whose lengths vary too much for rows comes as views. Remote shards read by range
are checked record by record. A bad record raises `CorruptRecordError` naming its shard and byte
offset — or, with an ``on_error`` callback, is reported to it and dropped from the batch.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable

import numpy as np

from crossfeed.errors import CorruptRecordError
from crossfeed.format import tar, tfrecord
from crossfeed.format.frames import (
    FRAMING,
    bad_headers,
    bad_payload_rows,
    bad_payloads,
    first_error,
    gather,
    out_of_bounds,
    payload_views,
    stored_crcs,
    window,
)
from crossfeed.format.tfrecord import FOOTER, HEADER
from crossfeed.read.cache import ShardCache
from crossfeed.read.dataset import Split
from crossfeed.read.storage import ShardFile, Storage

ROWS_MAX = 4096  # framed records at most this long may come as rows
ROWS_SPREAD = 64  # ... when the lengths in one batch differ by at most this many bytes
ALL_INDEX_MAX = 1 << 21  # splits up to this many records gather batches from one split-wide index table (32 MiB)


@dataclasses.dataclass
class Frames:
    """The checked payloads of one batch, in batch order.

    ``indices``: global sample indices of the records (under ``on_error`` the bad ones are gone).
    Exactly one of ``payloads`` (a buffer per record; ``{extension: buffer}`` per tar sample) and ``rows`` (``[(positions, matrix)]``:
    the ``(g, length)`` uint8 payloads of one length, at ``positions`` of the batch — None: all
    of them, in order) is set.
    """

    indices: np.ndarray
    payloads: list | None = None
    rows: list[tuple[np.ndarray | None, np.ndarray]] | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def as_payloads(self) -> list:
        """One buffer per record, in batch order (rows become their matrix rows)."""
        if self.payloads is not None:
            return self.payloads
        payloads: list = [None] * len(self)
        for pos, matrix in self.rows:
            for j, row in zip(range(len(matrix)) if pos is None else pos.tolist(), matrix):
                payloads[j] = row
        return payloads


class FrameReader:
    """Reads the records of a split by global index. Thread-safe: shards open once.

    ``whole_shards``: load remote shards whole (sequential plans) and keep at most
    ``keep_loaded`` of them; otherwise remote records are range reads. ``rows``: give small
    records as rows (see the module docstring).
    """

    def __init__(
        self,
        split: Split,
        *,
        rows: bool = False,
        whole_shards: bool = False,
        keep_loaded: int | None = None,
        cache: ShardCache | None = None,
    ):
        self.split = split
        self.rows = rows
        self.whole_shards = whole_shards or cache is not None
        self.keep_loaded = keep_loaded
        self.cache = cache
        self._cached: dict[int, ShardFile] = {}  # remote shard → its cached local copy
        self._loaded: list[int] = []
        self._index: np.ndarray | None = None  # see `_all_index`
        self._fits: set[int] = set()  # shards whose every index entry lies inside the loaded stream
        self._u8: dict[int, tuple] = {}  # shard → (buffer, its uint8 array, {width: window view})
        self._ready: dict[int, tuple] = {}  # the same, for local shards whose index fits their stream
        self._sizes = np.zeros(len(split.counts), dtype=np.int64)  # shard → its stream's size, once loaded
        self._lock = threading.Lock()
        # a large split's indexes are read in place, entry by entry (`Split.lazy_index`): opening
        # it and its first batch cost O(shards), not O(records)
        self._large = len(split) > ALL_INDEX_MAX

    def _entries(self, s: int, k: np.ndarray) -> np.ndarray:
        """``(offset, length)`` of records ``k`` of shard ``s``."""
        return self.split.entries(s, k) if self._large else self.split.index(s)[k]

    def small_records(self) -> bool:
        """Whether the split's records are local and small enough for rows (judged by the
        first shard's index)."""
        if not len(self.split.counts) or self.split.file(0).storage.remote:
            return False
        if self._large:  # judged by its first entries
            index = self.split.entries(0, np.arange(min(int(self.split.counts[0]), 4096), dtype=np.int64))
        else:
            index = self.split.index(0)
        return bool(len(index)) and int(index[:, 1].max()) <= ROWS_MAX

    def where(self, i: int) -> str:
        """Names global record ``i``: its shard file and byte offset."""
        s, k = self.split.locate(int(i))
        return f"{self.split.file(s).path}: record at byte offset {int(self._entries(s, np.array([k]))[0, 0])}"

    def __call__(self, indices, on_error: Callable[[CorruptRecordError], None] | None = None) -> Frames:
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices):
            return Frames(indices, payloads=[])
        if self.split.info.format == tar.FORMAT:
            return self._tar_samples(indices, on_error)
        shard = np.searchsorted(self.split.starts, indices, side="right") - 1
        s0 = int(shard[0])
        if shard[-1] == s0 and (shard == s0).all():
            present, parts, order, bounds = [s0], [None], None, [0, len(indices)]
        else:
            per = np.bincount(shard, minlength=len(self.split.counts))
            present = np.flatnonzero(per).tolist()
            # the batch positions of each shard's records (one sort, not one comparison per shard):
            # shard j's are order[bounds[j]:bounds[j + 1]]
            order = np.argsort(shard, kind="stable")
            bounds = [0, *np.cumsum(per[present]).tolist()]
            parts = None  # the same as a list of arrays, made only where needed
        ready = self._ready
        entries = [ready.get(s) for s in present]
        if None in entries:  # a shard not loaded (or not local, or not yet checked) yet
            bufs = [self._buffer(s) for s in present]
            if any(b is None for b in bufs):  # remote range reads: checked record by record as they arrive
                return self._by_record(indices, shard, on_error)
            entries = [self._entry(s, b) for s, b in zip(present, bufs)]
        else:
            bufs = [e[0] for e in entries]
        if parts is None and not self.rows:
            parts = np.split(order, bounds[1:-1])
        if len(present) == 1:
            index = self._entries(s0, indices - self.split.starts[s0])
        elif len(self.split) <= ALL_INDEX_MAX:  # one gather from the split's whole index
            index = self._all_index()[indices]
        else:  # a large split: only the shards the batch touches are loaded
            index = np.empty((len(indices), 2), dtype=np.int64)
            starts, entries_of = self.split.starts, self.split.entries
            for s, a, b in zip(present, bounds, bounds[1:]):
                m = order[a:b]
                index[m] = entries_of(s, indices[m] - starts[s])
        offs, lens = index[:, 0], index[:, 1]
        u8s = [e[1] for e in entries]
        if all(s in self._fits for s in present):
            lo, hi = int(lens.min()), int(lens.max())
            if self.rows and hi <= ROWS_MAX and hi - lo <= ROWS_SPREAD:
                got = self._rows(indices, offs, lens, shard, order, bounds, entries, lo, hi)
            else:
                if parts is None:
                    parts = np.split(order, bounds[1:-1])
                got = self._views(indices, offs, lens, parts, u8s, bufs, present, shard)
            if got is not None:
                return got
        return self._diagnose(indices, offs, lens, shard, present, bufs, on_error)

    # -- the fast forms -------------------------------------------------------------------------
    def _views(self, indices, offs, lens, parts, u8s, bufs, present, shard) -> Frames | None:
        if len(present) == 1:
            head = gather(u8s[0], offs, HEADER)
            foot = stored_crcs(u8s[0], offs, lens)
            if bad_headers(head, lens).any():
                return None
            payloads = payload_views(bufs[0], offs, lens)
        else:
            head = np.empty((len(offs), HEADER), dtype=np.uint8)
            foot = np.empty(len(offs), dtype=np.uint32)
            for m, u8 in zip(parts, u8s):
                head[m] = gather(u8, offs[m], HEADER)
                foot[m] = stored_crcs(u8, offs[m], lens[m])
            if bad_headers(head, lens).any():
                return None
            # one view per record, by shard: map over C callables, no Python bytecode per record
            views = [memoryview(b) for b in bufs]
            which = np.searchsorted(np.asarray(present), shard).tolist()
            payloads = list(
                map(
                    memoryview.__getitem__,
                    map(views.__getitem__, which),
                    map(slice, (offs + HEADER).tolist(), (offs + lens - FOOTER).tolist()),
                )
            )
        if bad_payloads(payloads, foot).any():
            return None
        return Frames(indices, payloads=payloads)

    def _rows(self, indices, offs, lens, shard, order, bounds, entries, lo, hi) -> Frames | None:
        """Each shard's rows are one row-take from a window view of its mmap into a slice of
        one matrix (records grouped by shard, ``order``), put back in batch order at the end;
        the end-of-shard clamp is checked for the whole batch at once."""
        n = len(indices)
        limit = self._sizes[shard] - hi  # the last offset a whole row of width hi starts at
        if lo <= FRAMING or int(limit.min()) < 0:  # (a shard shorter than a row)
            return None
        near = np.flatnonzero(offs > limit)
        o = offs if not len(near) else np.minimum(offs, limit)
        if order is not None:
            o = o[order]
        grouped = np.empty((n, hi), dtype=np.uint8)
        for a, b, (_, u8, wins) in zip(bounds, bounds[1:], entries):
            win = wins.get(hi)
            if win is None:
                win = wins[hi] = window(u8, hi)
            grouped[a:b] = win[o[a:b]]
        if order is None:
            rows = grouped
        else:
            rows = np.empty_like(grouped)
            rows[order] = grouped
        for j in near.tolist():  # records near the end of their shard: the clamped row, fixed up
            u8, at = self._u8[int(shard[j])][1], int(offs[j])
            rows[j] = 0
            rows[j, : len(u8) - at] = u8[at:]
        if bad_headers(rows[:, :HEADER], lens).any():
            return None
        if lo == hi:
            groups = [(None, rows)]
        else:
            present = np.flatnonzero(np.bincount(lens - lo)) + lo
            groups = [(pos, rows[pos]) for pos in (np.flatnonzero(lens == k) for k in present.tolist())]
        out = []
        for pos, framed in groups:
            k = int(lens[0 if pos is None else pos[0]])
            payload = framed[:, HEADER : k - FOOTER]
            if bad_payload_rows(payload, framed[:, k - FOOTER : k].copy().view("<u4").ravel()).any():
                return None
            out.append((pos, payload))
        return Frames(indices, rows=out)

    # -- the exact paths: bad records, remote range reads --------------------------------------
    def _diagnose(self, indices, offs, lens, shard, present, bufs, on_error) -> Frames:
        """Check each record of a batch that failed a batch check on its own: raise the first
        error, or report every bad record to ``on_error`` and return the good ones as views."""
        buf_of = dict(zip(present, bufs))

        def read(j: int):
            s, o, n = int(shard[j]), int(offs[j]), int(lens[j])
            buf, path = buf_of[s], self.split.file(s).path
            if o < 0 or o + n > len(memoryview(buf)) or n < FRAMING:
                raise first_error(buf, o, n, path)
            return tfrecord.unframe(buf, o, n, path)

        return self._each(indices, read, on_error)

    def _by_record(self, indices, shard, on_error) -> Frames:
        def read(j: int):
            s = int(shard[j])
            o, n = (int(x) for x in self.split.index(s)[int(indices[j]) - int(self.split.starts[s])])
            f = self.split.file(s)
            return tfrecord.unframe(self._buffer(s), o, n, f.path) if self._in_memory(f) else f.record(o, n)

        return self._each(indices, read, on_error)

    def _tar_samples(self, indices, on_error) -> Frames:
        """Tar shards (`crossfeed.format.tar`): each sample as ``{extension: view}``, read from
        its index range with every member header's checksum checked (tar has no payload checksum)."""
        shard = np.searchsorted(self.split.starts, indices, side="right") - 1

        def read(j: int):
            s = int(shard[j])
            o, n = (int(x) for x in self.split.index(s)[int(indices[j]) - int(self.split.starts[s])])
            f = self.split.file(s)
            buf = self._buffer(s)
            buf, base = (buf, 0) if buf is not None else f.raw(o, n)
            return tar.read_sample(buf, o - base, n, f.path, base)

        return self._each(indices, read, on_error)

    @staticmethod
    def _each(indices, read, on_error) -> Frames:
        """``read(j)`` for each record of the batch; a `CorruptRecordError` raises, or goes to
        ``on_error`` and drops the record."""
        payloads, keep = [], []
        for j in range(len(indices)):
            try:
                payloads.append(read(j))
                keep.append(j)
            except CorruptRecordError as e:
                if on_error is None:
                    raise
                on_error(e)
        return Frames(indices[keep], payloads=payloads)

    # -- shards ---------------------------------------------------------------------------------
    def _in_memory(self, f) -> bool:
        return not f.storage.remote or self.whole_shards or tfrecord.is_gzip(f.rel)

    def _buffer(self, s: int):
        """Shard ``s``'s whole uncompressed stream, or None where records are range reads. The
        first time, its whole index is checked to lie inside it (then no batch checks bounds);
        a shard whose index does not fit goes through `_diagnose`, which names the bad entry."""
        f = self.split.file(s)
        if not self._in_memory(f):
            return None
        if f.storage.remote and self.cache is not None:
            buf = self._local_copy(s).load()
        else:
            buf = f.load()
        if f.storage.remote and self.keep_loaded:
            self._evict(s)
        if s not in self._fits:
            index = self.split.lazy_index(s) if self._large else self.split.index(s)
            if isinstance(index, np.ndarray):
                fits = not len(index) or not out_of_bounds(index[:, 0], index[:, 1], len(memoryview(buf))).any()
            else:  # a lazy index: every entry it gives lies before its last entry's end
                fits = index.end <= len(memoryview(buf))
            if fits:
                self._fits.add(s)
        return buf

    def _local_copy(self, s: int) -> ShardFile:
        """Remote shard ``s`` through the cache: downloaded (once, shared by every process on
        the node), checked against the manifest's sha256, then memory-mapped like a local shard."""
        got = self._cached.get(s)
        if got is None:  # no reader lock held while downloading: other shards go on meanwhile
            info = self.split.shards[s]
            path = self.cache.fetch(self.split.file(s).storage, info.file, info.sha256, info.num_bytes)
            with self._lock:
                got = self._cached.get(s)
                if got is None:
                    got = self._cached[s] = Storage(os.path.dirname(path)).shard(os.path.basename(path))
                else:  # another thread got there first: one pin is enough
                    self.cache.release(path)
        return got

    def jobs(self, shards) -> list[tuple]:
        """Download jobs (for a `crossfeed.read.cache.Prefetcher`) of the remote shards among ``shards``."""
        out = []
        for s in shards:
            f, info = self.split.file(s), self.split.shards[s]
            if f.storage.remote and s not in self._cached:
                out.append((f.storage, info.file, info.sha256, info.num_bytes))
        return out

    def close(self) -> None:
        for _s, f in list(self._cached.items()):
            f.close()
            self.cache.release(f.path)
        self._cached.clear()
        self._u8.clear()

    def _entry(self, s: int, buf) -> tuple:
        """``(buffer, uint8 array, {width: window view})`` of shard ``s``, made once per loaded
        buffer (numpy's per-call cost would otherwise be paid per batch and shard)."""
        got = self._u8.get(s)
        if got is None or got[0] is not buf:
            got = self._u8[s] = (buf, np.frombuffer(buf, dtype=np.uint8), {})
            self._sizes[s] = len(got[1])
            if not self.split.file(s).storage.remote and s in self._fits:
                self._ready[s] = got  # local: mapped for good, checked; later batches skip `_buffer`
        return got

    def _all_index(self) -> np.ndarray:
        """``(N, 2)`` ``(offset, length)`` of every record of the split, by global index (built
        once, on the first batch that spans shards)."""
        if self._index is None:
            with self._lock:
                if self._index is None:
                    self._index = np.concatenate([self.split.index(s) for s in range(len(self.split.counts))])
        return self._index

    def _evict(self, s: int) -> None:
        """Keep at most ``keep_loaded`` remote shards in memory (the oldest go first)."""
        with self._lock:
            if s in self._loaded:
                return
            self._loaded.append(s)
            while len(self._loaded) > self.keep_loaded:
                old = self._loaded.pop(0)
                self._u8.pop(old, None)  # its arrays view the buffer about to be closed
                self.split.file(old).close()
                local = self._cached.pop(old, None)
                if local is not None:  # the cache may now evict it (this process no longer uses it)
                    local.close()
                    self.cache.release(local.path)
