"""Stage 2 of the read pipeline: global sample indices → `Frames`, the checked payloads of a batch.

Local shards are memory-mapped (GZIP shards inflated once, remote shards loaded whole when the
plan reads them sequentially; a remote shard in the cache is its entry's mapping, read exactly as a
local shard is once the reader keeps it for good); every record's header and payload CRC is checked for the whole
batch at once with the one checker, `crossfeed.format.frames`. Two forms of the same payloads:

* **views** — one zero-copy ``memoryview`` per record (big records, images, mixed layouts);
* **rows** — small records of similar length gathered as the rows of uint8 matrices, one matrix
  per payload length, for the decoder's columnar path (one numpy row-take for the whole batch
  from a sliding-window view of the shards' bytes, `Span`; no per-record Python).

The form is chosen once per Loader (`rows=True` when the decoder is columnar and the records are
small); a batch whose lengths vary too much for rows comes as views. Remote shards read by range
are checked record by record. A bad record raises `CorruptRecordError` naming its shard and byte
offset — or, with an ``on_error`` callback, is reported to it and dropped from the batch.
"""

from __future__ import annotations

import ctypes
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
    out_of_bounds,
    payload_views,
    window,
)
from crossfeed.format.tfrecord import FOOTER, HEADER, mask
from crossfeed.io.cache import ShardCache
from crossfeed.io.storage import ShardFile, Storage
from crossfeed.read.sources.dataset import Split

ROWS_MAX = 4096  # framed records at most this long may come as rows
ROWS_SPREAD = 64  # ... when the lengths in one batch differ by at most this many bytes
ALL_INDEX_MAX = 1 << 21  # splits up to this many records gather batches from one split-wide index table (32 MiB)


DEFER_MIN = 16 * 1024  # views of payloads this long on average may have their CRC checked where they are copied


class PathCounts:
    """How many batches (or groups) each path of a stage served, thread-safe: which fast path
    ran is an observable fact (`Loader.paths`), not a guess from timings."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, path: str) -> None:
        with self._lock:
            self._counts[path] = self._counts.get(path, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class DeferredCrcError(Exception):
    """A payload CRC checked after the frame stage (`Frames.verify`) did not match: the batch is
    read again on the exact path, which names the record (not a `CrossfeedError`: never a
    bad-record budget's to swallow)."""


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
    # the stored masked CRCs of ``payloads`` whose payload CRC is not checked yet (big records read
    # with ``defer_crc``): the decoder checks each while copying it (`verify`); None: all checked
    unchecked: np.ndarray | None = None

    def verify(self, crcs: np.ndarray | None = None) -> None:
        """Check the payloads' deferred CRCs — ``crcs``, computed by the caller in batch order
        while the bytes were in cache, or else computed here; raise `DeferredCrcError` on a
        mismatch. A no-op once checked."""
        if self.unchecked is None:
            return
        stored, self.unchecked = self.unchecked, None
        if crcs is None:
            bad = bad_payloads(self.payloads, stored)
        else:
            bad = mask(crcs) != stored
        if bad.any():
            raise DeferredCrcError(f"payload CRC mismatch at batch position {int(np.flatnonzero(bad)[0])}")

    def __len__(self) -> int:
        return len(self.indices)

    def as_payloads(self) -> list:
        """One buffer per record, in batch order (rows become their matrix rows)."""
        if self.payloads is not None:
            return self.payloads
        payloads: list = [None] * len(self)
        for pos, matrix in self.rows or ():  # (exactly one of payloads and rows is set)
            for j, row in zip(range(len(matrix)) if pos is None else pos.tolist(), matrix):
                payloads[j] = row
        return payloads


class Span:
    """The bytes of several loaded shards addressed as one uint8 array, so that rows from any of
    them come out of one numpy take, in batch order (no grouping by shard, no per-shard call).

    The array covers the process's address range from the lowest shard's first byte to the
    highest shard's last, gaps included: only offsets inside a shard — ``base[s] + o`` with
    ``0 <= o <= size(s) - width``, which `FrameReader._rows` establishes for every batch before
    it takes — may be read. The shards' own arrays are held here, so their buffers (and the
    mmaps under them, which refuse to close while exported) live as long as the span.
    """

    def __init__(self, arrays: dict[int, np.ndarray], shards: int):
        self.arrays = {s: a for s, a in arrays.items() if len(a)}
        self.base = np.full(shards, -1, dtype=np.int64)  # shard → its first byte in `u8`; -1: not in the span
        self.wins: dict[int, np.ndarray] = {}
        if not self.arrays:
            self.u8 = np.zeros(0, dtype=np.uint8)
            return
        addr = {s: a.ctypes.data for s, a in self.arrays.items()}
        lo = min(addr.values())
        end = max(addr[s] + len(a) for s, a in self.arrays.items())
        for s, at in addr.items():
            self.base[s] = at - lo
        # numpy's stubs do not list ctypes arrays among buffers (they are)
        self.u8 = np.frombuffer((ctypes.c_char * (end - lo)).from_address(lo), dtype=np.uint8)  # type: ignore[call-overload]

    def rows(self, shard: np.ndarray, offsets: np.ndarray, width: int) -> np.ndarray:
        """``(n, width)`` copy of the bytes at ``offsets`` of shards ``shard`` (see the class
        docstring for the offsets allowed)."""
        return self.at(self.base[shard] + offsets, width)

    def at(self, starts: np.ndarray, width: int) -> np.ndarray:
        """``(n, width)`` copy of the bytes at span offsets ``starts`` (each inside a shard, with
        ``width`` bytes of it left)."""
        win = self.wins.get(width)
        if win is None:
            win = self.wins[width] = window(self.u8, width)
        return win[starts]


class Whole:
    """A split's index in `Span` terms, for a split whose every shard the span holds: per record
    one 16-byte entry — its framed record's offset in the span, its length, and the bytes left in
    its shard from its start (``room``) — so that a batch's entries are one gather, with no shard
    lookup. (Length and room are capped at 2**31 - 1: only compared with row widths ≤ ROWS_MAX.)"""

    ENTRY = np.dtype([("at", "<i8"), ("len", "<i4"), ("room", "<i4")])
    CAP = (1 << 31) - 1

    def __init__(self, span: Span, table: np.ndarray):
        self.span, self.table = span, table

    @classmethod
    def of(cls, span: Span, index: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> Whole:
        """From the split's ``(N, 2)`` ``(offset, length)`` index, shard ``s`` holding records
        ``starts[s]:starts[s + 1]`` of ``sizes[s]`` bytes."""
        shard = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
        offs, lens = index[:, 0], index[:, 1]
        table = np.empty(len(index), dtype=cls.ENTRY)
        table["at"] = span.base[shard] + offs
        table["len"] = np.minimum(lens, cls.CAP)
        table["room"] = np.minimum(sizes[shard] - offs, cls.CAP)
        return cls(span, table)

    def __call__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(span offsets, framed lengths, room)`` of records ``indices`` (one take of whole
        entries: numpy's row gather of a 2-D table costs three times as much)."""
        t = self.table.take(indices)
        return t["at"], t["len"], t["room"]


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
        self._u8: dict[int, tuple] = {}  # shard → (buffer, its uint8 array)
        self._ready: dict[int, tuple] = {}  # the same, for shards mapped for good (`_kept`) whose index fits
        self._sizes = np.zeros(len(split.counts), dtype=np.int64)  # shard → its stream's size, once loaded
        self._span = Span({}, len(split.counts))  # the ready shards as one array (`Span`), grown as shards get ready
        # once the span holds every (non-empty) shard of a small split read as rows, the span and
        # `Whole`, the split's index in span terms: then a batch needs no per-shard bookkeeping
        self._whole: Whole | None = None
        self._lock = threading.Lock()
        # batches served by: "whole" (a split held whole), "whole_fixup" (the same, a record near its
        # shard's end fixed up), "rows", "views" (one view per record), "exact" (record by record)
        self.served = PathCounts()
        # a large split's indexes are read in place, entry by entry (`Split.lazy_index`): opening
        # it and its first batch cost O(shards), not O(records)
        self._large = len(split) > ALL_INDEX_MAX

    def _entries(self, s: int, k: np.ndarray) -> np.ndarray:
        """``(offset, length)`` of records ``k`` of shard ``s``."""
        return self.split.entries(s, k) if self._large else np.take(self.split.index(s), k, axis=0)

    def small_records(self) -> bool:
        """Whether the split's records are small enough for rows (judged by the first shard's
        index) and read from local mappings: local shards, or remote ones through the cache."""
        if not len(self.split.counts) or (self.split.file(0).storage.remote and self.cache is None):
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

    def __call__(
        self, indices, on_error: Callable[[CorruptRecordError], None] | None = None, *, defer_crc: bool = False
    ) -> Frames:
        """The checked frames of records ``indices``. ``defer_crc``: views of big records may come
        with their payload CRCs unchecked (`Frames.unchecked`) for the caller to check while it
        copies them (read once from memory, not twice); it must `Frames.verify` before any other use."""
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices):
            return Frames(indices, payloads=[])
        if self.split.info.format == tar.FORMAT:
            return self._tar_samples(indices, on_error)
        whole = self._whole
        if whole is not None:  # the common case, in short: every shard mapped, checked, in one span
            got = self._whole_rows(indices, whole)
            if got is not None:
                return got
            self.served.add("whole_declined")  # (records too long or too uneven for rows)
        shard = np.searchsorted(self.split.starts, indices, side="right") - 1
        s0 = int(shard[0])
        if shard[-1] == s0 and (shard == s0).all():
            present, per = [s0], None
        else:
            per = np.bincount(shard, minlength=len(self.split.counts))
            present = np.flatnonzero(per).tolist()
        ready = self._ready
        entries: list = [ready.get(s) for s in present]  # each shard's (buffer, u8), or None
        if None in entries:  # a shard not loaded (or not local, or not yet checked) yet
            bufs = [self.shard_buffer(s) for s in present]
            if any(b is None for b in bufs):  # remote range reads: checked record by record as they arrive
                return self._by_record(indices, shard, on_error)
            entries = [self._entry(s, b) for s, b in zip(present, bufs)]
        else:
            bufs = [e[0] for e in entries]
        if per is None:
            index = self._entries(s0, indices - self.split.starts[s0])
        elif len(self.split) <= ALL_INDEX_MAX:  # one gather from the split's whole index
            index = np.take(self._all_index(), indices, axis=0)
        else:  # a large split: only the index entries of the shards the batch touches are read
            index = np.empty((len(indices), 2), dtype=np.int64)
            order = np.argsort(shard, kind="stable")  # shard j's batch positions: one sort, then slices
            bounds = [0, *np.cumsum(per[present]).tolist()]
            for s, a, b in zip(present, bounds, bounds[1:]):
                m = order[a:b]
                index[m] = self.split.entries(s, indices[m] - self.split.starts[s])
        offs, lens = index[:, 0], index[:, 1]
        if all(s in self._fits for s in present):
            span = self._span_of(present, entries)
            lo, hi = int(lens.min()), int(lens.max())
            if self.rows and hi <= ROWS_MAX and hi - lo <= ROWS_SPREAD:
                got, path = self._rows(indices, offs, lens, shard, span, lo, hi), "rows"
            else:
                got, path = self._views(indices, offs, lens, span, bufs, present, shard, defer_crc), "views"
            if got is not None:
                self.served.add(path)
                return got
        self.served.add("exact")
        return self._diagnose(indices, offs, lens, shard, present, bufs, on_error)

    def _span_of(self, present: list[int], entries: list[tuple]) -> Span:
        """A `Span` holding every shard of the batch: the reader's span of its ready (mapped for
        good: local or kept in the cache, `_kept`) shards, grown when a batch first touches one;
        or, for a batch with shards that may be evicted (a window of them loaded whole), a span
        of this batch's shards."""
        span = self._span
        if (span.base[present] >= 0).all():
            return span
        if all(s in self._ready for s in present):
            with self._lock:
                span = self._span = Span({s: e[1] for s, e in self._ready.items()}, len(self.split.counts))
                every = len(self._ready) == int(np.count_nonzero(self.split.counts))
                if every and self.rows and len(self.split) <= ALL_INDEX_MAX and self._whole is None:
                    index = self._index if self._index is not None else self._concat_index()
                    self._whole = Whole.of(span, index, self.split.starts, self._sizes)
                    self._index = None  # (`Whole` holds the same entries; rebuilt if a fallback needs it)
            return span
        return Span({s: e[1] for s, e in zip(present, entries)}, len(self.split.counts))

    # -- the fast forms -------------------------------------------------------------------------
    def _whole_rows(self, indices, whole: Whole) -> Frames | None:
        """`_rows` for a split held whole: a record's span offset, length and room left in its
        shard come from one gather of `Whole`'s table; a batch with a record too near its shard's
        end for a row of the batch's width goes the long way (`_rows`, which fixes such rows up)."""
        at, lens, room = whole(indices)
        lo, hi = int(lens.min()), int(lens.max())
        if hi > ROWS_MAX or hi - lo > ROWS_SPREAD:
            return None
        if lo > FRAMING and int(room.min()) >= hi:
            got, path = self._checked_rows(indices, whole.span.at(at, hi), lens, lo, hi), "whole"
        else:
            shard = np.searchsorted(self.split.starts, indices, side="right") - 1
            got, path = self._rows(indices, at - whole.span.base[shard], lens, shard, whole.span, lo, hi), "whole_fixup"
        if got is not None:
            self.served.add(path)
        return got

    def _views(self, indices, offs, lens, span, bufs, present, shard, defer_crc=False) -> Frames | None:
        if (offs < 0).any() or (offs + lens > self._sizes[shard]).any() or (lens < FRAMING).any():
            return None  # (`_diagnose` names the entry)
        head = span.rows(shard, offs, HEADER)
        foot = span.rows(shard, offs + lens - FOOTER, FOOTER).view("<u4").ravel()
        if bad_headers(head, lens).any():
            return None
        if len(present) == 1:
            payloads = payload_views(bufs[0], offs, lens)
        else:  # one view per record, by shard: map over C callables, no Python bytecode per record
            views = [memoryview(b) for b in bufs]
            which = np.searchsorted(np.asarray(present), shard).tolist()
            payloads = list(
                map(
                    memoryview.__getitem__,
                    map(views.__getitem__, which),
                    map(slice, (offs + HEADER).tolist(), (offs + lens - FOOTER).tolist()),
                )
            )
        if defer_crc and int(lens.sum()) >= DEFER_MIN * len(lens):
            return Frames(indices, payloads=payloads, unchecked=foot)
        if bad_payloads(payloads, foot).any():
            return None
        return Frames(indices, payloads=payloads)

    def _rows(self, indices, offs, lens, shard, span, lo, hi) -> Frames | None:
        """The batch's framed records as rows of width ``hi``: one take from the span, in batch
        order. A row that would run past its shard's end starts earlier (clamped) and is fixed
        up after; offsets are checked non-negative and clamped for the whole batch at once."""
        limit = self._sizes[shard] - hi  # the last offset a whole row of width hi starts at
        if lo <= FRAMING or int(limit.min()) < 0 or int(offs.min()) < 0:  # (a shard shorter than a row)
            return None
        near = np.flatnonzero(offs > limit)
        rows = span.rows(shard, offs if not len(near) else np.minimum(offs, limit), hi)
        for j in near.tolist():  # records near the end of their shard: the clamped row, fixed up
            u8, at = span.arrays[int(shard[j])], int(offs[j])
            rows[j] = 0
            rows[j, : len(u8) - at] = u8[at:]
        return self._checked_rows(indices, rows, lens, lo, hi)

    @staticmethod
    def _checked_rows(indices, rows, lens, lo, hi) -> Frames | None:
        """`Frames` of framed ``rows`` (width ``hi``), every header and payload CRC checked;
        None if one fails (`_diagnose` names it)."""
        if bad_headers(rows[:, :HEADER], lens).any():
            return None
        groups: list[tuple[np.ndarray | None, np.ndarray]]
        if lo == hi:
            groups = [(None, rows)]
        else:
            present = np.flatnonzero(np.bincount(lens - lo)) + lo
            groups = [(pos, rows[pos]) for pos in (np.flatnonzero(lens == k) for k in present.tolist())]
        out: list[tuple[np.ndarray | None, np.ndarray]] = []
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
            return tfrecord.unframe(self.shard_buffer(s), o, n, f.path) if self._in_memory(f) else f.record(o, n)

        return self._each(indices, read, on_error)

    def _tar_samples(self, indices, on_error) -> Frames:
        """Tar shards (`crossfeed.format.tar`): each sample as ``{extension: view}``, read from
        its index range with every member header's checksum checked (tar has no payload checksum)."""
        shard = np.searchsorted(self.split.starts, indices, side="right") - 1

        def read(j: int):
            s = int(shard[j])
            o, n = (int(x) for x in self.split.index(s)[int(indices[j]) - int(self.split.starts[s])])
            f = self.split.file(s)
            buf = self.shard_buffer(s)
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

    def shard_buffer(self, s: int):
        """Shard ``s``'s whole uncompressed stream, or None where records are range reads. The
        first time, its whole index is checked to lie inside it (then no batch checks bounds);
        a shard whose index does not fit goes through `_diagnose`, which names the bad entry."""
        f = self.split.file(s)
        if not self._in_memory(f):
            return None
        if f.storage.remote and self.cache is not None:
            buf = self._local_copy(s, self.cache).load()
        else:
            buf = f.load()
        if f.storage.remote and self.keep_loaded:
            self._evict(s, self.keep_loaded)
        if s not in self._fits:
            index = self.split.lazy_index(s) if self._large else self.split.index(s)
            if isinstance(index, np.ndarray):
                fits = not len(index) or not out_of_bounds(index[:, 0], index[:, 1], len(memoryview(buf))).any()
            else:  # a lazy index: every entry it gives lies before its last entry's end
                fits = index.end <= len(memoryview(buf))
            if fits:
                self._fits.add(s)
        return buf

    def _local_copy(self, s: int, cache: ShardCache) -> ShardFile:
        """Remote shard ``s`` through the cache: downloaded (once, shared by every process on
        the node), checked against the manifest's sha256, and handed over already
        memory-mapped: the mapping stays valid while anything holds it, whatever the cache (or
        another process) removes meanwhile."""
        got = self._cached.get(s)
        if got is None:  # no reader lock held while downloading: other shards go on meanwhile
            info, f = self.split.shards[s], self.split.file(s)
            try:
                path, stream = cache.open(
                    f.storage, info.file, info.sha256, info.num_bytes, stream_limit=f.stream_limit()
                )
            except FileNotFoundError as e:  # gone: a rewrite of the dataset, or the file's own fault
                err = self.split.dataset.rewritten(f.path, "the shard file is gone")
                if err is None:
                    raise
                raise err from e
            with self._lock:
                got = self._cached.get(s)
                if got is None:
                    local = Storage(os.path.dirname(path))
                    got = self._cached[s] = local.shard(
                        os.path.basename(path), buffer=stream, stream_bytes=self.split.file(s).stream_bytes
                    )
                else:  # another thread got there first: one pin is enough
                    cache.release(path)
        return got

    def jobs(self, shards) -> list[tuple]:
        """Download jobs (for a `crossfeed.io.cache.Prefetcher`) of the remote shards among ``shards``."""
        out = []
        for s in shards:
            f, info = self.split.file(s), self.split.shards[s]
            if f.storage.remote and s not in self._cached:
                out.append((f.storage, info.file, info.sha256, info.num_bytes))
        return out

    def close(self) -> None:
        self._u8.clear()  # first: arrays that view a mapping keep it from closing
        self._ready.clear()
        self._span, self._whole = Span({}, len(self.split.counts)), None
        for _s, f in list(self._cached.items()):
            f.close()
            if self.cache is not None:  # (shards are cached only with a cache)
                self.cache.release(f.path)
        self._cached.clear()

    def _entry(self, s: int, buf) -> tuple:
        """``(buffer, uint8 array)`` of shard ``s``, made once per loaded
        buffer (numpy's per-call cost would otherwise be paid per batch and shard)."""
        got = self._u8.get(s)
        if got is None or got[0] is not buf:
            got = self._u8[s] = (buf, np.frombuffer(buf, dtype=np.uint8))
            self._sizes[s] = len(got[1])
            if s in self._fits and self._kept(s):
                self._ready[s] = got  # mapped for good, checked: later batches skip `_buffer`
        return got

    def _kept(self, s: int) -> bool:
        """Whether shard ``s``'s mapping stays for the reader's life: a local shard, or a cached
        remote one when no window evicts shards (``keep_loaded`` None) — the cache entry pinned
        and mapped until `close`, read exactly as a local shard is (same span, same fast paths)."""
        if not self.split.file(s).storage.remote:
            return True
        return self.cache is not None and self.keep_loaded is None and s in self._cached

    def _all_index(self) -> np.ndarray:
        """``(N, 2)`` ``(offset, length)`` of every record of the split, by global index (built
        once, on the first batch that spans shards)."""
        index = self._index
        if index is None:
            with self._lock:
                index = self._index
                if index is None:
                    index = self._index = self._concat_index()
        return index

    def _concat_index(self) -> np.ndarray:
        return np.concatenate([self.split.index(s) for s in range(len(self.split.counts))])

    def _evict(self, s: int, keep_loaded: int) -> None:
        """Keep at most ``keep_loaded`` remote shards in memory (the oldest go first)."""
        with self._lock:
            if s in self._loaded:
                return
            self._loaded.append(s)
            while len(self._loaded) > keep_loaded:
                old = self._loaded.pop(0)
                self._u8.pop(old, None)  # its arrays view the buffer about to be closed
                self.split.file(old).close()
                local = self._cached.pop(old, None)
                if (
                    local is not None and self.cache is not None
                ):  # the cache may now evict it (this process no longer uses it)
                    # not closed: a batch on another thread may still read its mapping, which
                    # goes when the last reference to it does
                    self.cache.release(local.path)
